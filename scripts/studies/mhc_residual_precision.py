#!/usr/bin/env python3
"""How much precision the mHC residual stream loses when it is stored in bf16
or FP8 instead of fp32, over a deep stack (issue 27's accuracy study).

A stack of `layers` layers, each (spec §4.2, float64 arithmetic):
    F_pre, H_post, H_res = pre(X)            # mhc_pre
    F_out = sublayer(F_pre)                  # a random layer: rmsnorm, a
                                             # random C x C matrix, tanh
    X = post(X, F_out, H_post, H_res)        # mhc_post (res_layout kDeepSeek)
with X stored after every post in one of these formats:
    fp32        the baseline
    bf16        what flashmix stores today (round to nearest even)
    fp8_f32     e4m3 (round to nearest even, saturating at 448) with an fp32
                scale per (token, stream, 128 channels): scale = amax / 448
    fp8_ue8m0   the same with a power-of-two scale: 2^ceil(log2(amax / 448))
F_pre and F_out are rounded to bf16 as the ops write them. Every format sees
the same weights and inputs; the error of a format at layer L is
||X_L - X_L(fp32)|| / ||X_L(fp32)|| (Frobenius, over the batch), and the same
for the F_pre each sublayer receives.

Numpy only (no GPU, no flashmix): the math is spec §4.2 written out again.
Usage: PYTHONPATH=.deps/python python3 scripts/studies/mhc_residual_precision.py
           [--layers 60] [--tokens 32] [--n 4] [--channels 7168] [--seed 0] [--markdown]
"""
import argparse

import numpy as np


def round_bf16(x):
    """Round float64 values to bf16 (nearest even), returned as float64."""
    f = x.astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def round_e4m3(x):
    """Round to FP8 e4m3 (OCP, no infinities: saturate at +-448), nearest even, as float64."""
    a = np.abs(x)
    # The quantum of a's binade: 2^(e - 3) for normals (e >= -6), 2^-9 below.
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, -6.0) - 3.0)
    q = np.round(a / step) * step  # numpy rounds halves to even
    return np.sign(x) * np.minimum(q, 448.0)


def store(x, fmt, group=128):
    """X [B, n, C] as it reads back after being stored in `fmt`."""
    if fmt == "fp32":
        return x.astype(np.float32).astype(np.float64)
    if fmt == "bf16":
        return round_bf16(x)
    B, n, C = x.shape
    g = x.reshape(B, n, C // group, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0)
    if fmt == "fp8_ue8m0":
        scale = np.exp2(np.ceil(np.log2(scale)))
    else:
        scale = scale.astype(np.float32).astype(np.float64)
    return (round_e4m3(g / scale) * scale).reshape(B, n, C)


def pre(X, phi, alpha, bias, n, iters=20, eps=1e-6, post_mult=2.0):
    """spec §4.2: (F_pre [B, C], H_post [B, n], H_res [B, n, n])."""
    B = X.shape[0]
    x = X.reshape(B, -1)
    r = np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    a = np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(n * n, alpha[2])])
    h = a * (x @ phi.T) / r + bias
    h_pre = 1.0 / (1.0 + np.exp(-h[:, :n])) + eps
    h_post = post_mult / (1.0 + np.exp(-h[:, n:2 * n]))
    m = h[:, 2 * n:].reshape(B, n, n)
    m = np.exp(m - m.max(axis=2, keepdims=True))
    m = m / m.sum(axis=2, keepdims=True) + eps
    m = m / (m.sum(axis=1, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(axis=2, keepdims=True) + eps)
        m = m / (m.sum(axis=1, keepdims=True) + eps)
    f_pre = np.einsum("bi,bic->bc", h_pre, X)
    return f_pre, h_post, m


def post(X, f_out, h_post, h_res):
    """spec §4.2, res_layout kDeepSeek: X_next[i] = sum_j H_res[j, i] X[j] + H_post[i] F_out."""
    return np.einsum("bji,bjc->bic", h_res, X) + h_post[:, :, None] * f_out[:, None, :]


def sublayer(f_pre, w):
    r = np.sqrt((f_pre * f_pre).mean(axis=1, keepdims=True) + 1e-6)
    return np.tanh((f_pre / r) @ w)


def run(args):
    rng = np.random.default_rng(args.seed)
    B, n, C, L = args.tokens, args.n, args.channels, args.layers
    K, N = n * C, 2 * n + n * n
    emb = rng.standard_normal((B, C))
    X0 = np.repeat(emb[:, None, :], n, axis=1)  # mhc_expand: every stream the embedding
    fmts = ["fp32", "bf16", "fp8_f32", "fp8_ue8m0"]
    X = {f: store(X0, f) for f in fmts}
    err_x = {f: [] for f in fmts}
    err_f = {f: [] for f in fmts}
    for li in range(L):
        # Each layer's weights from its own stream (made when needed: 60 C x C matrices would not fit).
        lr = np.random.default_rng([args.seed, li])
        lay = dict(phi=lr.standard_normal((N, K)) / np.sqrt(K), alpha=np.array([1.0, 1.0, 1.0]),
                   bias=lr.standard_normal(N) * 0.5, w=lr.standard_normal((C, C)) / np.sqrt(C))
        outs = {}
        for f in fmts:
            f_pre, h_post, h_res = pre(X[f], lay["phi"], lay["alpha"], lay["bias"], n)
            f_pre = round_bf16(f_pre)
            f_out = round_bf16(sublayer(f_pre, lay["w"]))
            outs[f] = (f_pre, store(post(X[f], f_out, h_post, h_res), f))
        base_f, base_x = outs["fp32"]
        for f in fmts:
            f_pre, x = outs[f]
            err_f[f].append(np.linalg.norm(f_pre - base_f) / np.linalg.norm(base_f))
            err_x[f].append(np.linalg.norm(x - base_x) / np.linalg.norm(base_x))
            X[f] = x
    return fmts, err_x, err_f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--channels", type=int, default=7168)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    fmts, err_x, err_f = run(args)
    shown = [f for f in fmts if f != "fp32"]
    rows = sorted({0, 4, 9, 19, 29, 39, 49, args.layers - 1} & set(range(args.layers)))
    if args.markdown:
        print("| layer | " + " | ".join("X %s" % f for f in shown) + " | " +
              " | ".join("F_pre %s" % f for f in shown) + " |")
        print("|---:|" + "---:|" * (2 * len(shown)))
    for i in rows:
        cells = ["%.2e" % err_x[f][i] for f in shown] + ["%.2e" % err_f[f][i] for f in shown]
        if args.markdown:
            print("| %d | %s |" % (i + 1, " | ".join(cells)))
        else:
            print("layer %3d  " % (i + 1) + "  ".join("%s X %s" % (f, c) for f, c in zip(shown, cells[:len(shown)])))


if __name__ == "__main__":
    main()
