"""A small numpy reference written from docs/spec.md alone (float64, no flashmix
code), and the random problems the Python tests share."""
import numpy as np

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the mHC and bf16 cases skip without it
    ml_dtypes = None
    BF16 = None

# Relative size of one unit in the last place of each output dtype.
ULP = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def rounded(values, dtype_name):
    """float64 -> dtype, rounded the way the reference backend stores: via float32."""
    return np.asarray(values, np.float64).astype(np.float32).astype(np_dtype(dtype_name))


def f64(a):
    return np.asarray(a).astype(np.float64)


# ---------------------------------------------------------------------------
# spec §1: routing maps
# ---------------------------------------------------------------------------

def routing_maps(experts, start, e_local):
    """(expert_first_token_offset [E_local+1], permuted_row_to_unpermuted_row [P],
    unpermuted_row_to_permuted_row [k*T]) for int32 experts [T, k]."""
    T, k = experts.shape
    local = []  # (local expert, slot j*T + t), ordered by expert then slot (stable)
    u2p = np.full(k * T, -1, np.int64)
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            if start <= e < start + e_local:
                local.append((e - start, j * T + t))
    local.sort()
    offsets = np.zeros(e_local + 1, np.int64)
    for e, _ in local:
        offsets[e + 1] += 1
    offsets = np.cumsum(offsets)
    p2u = np.array([s for _, s in local], np.int64)
    for p, s in enumerate(p2u):
        u2p[s] = p
    return offsets, p2u, u2p


# ---------------------------------------------------------------------------
# spec §2: finalize
# ---------------------------------------------------------------------------

def finalize(rows, u2p, experts, scales, bias, shared, start, e_local, H, fill=True, out_before=None):
    """float64 out [T, H]; rows/bias/shared any float dtype. With fill=False, tokens without a
    local slot keep out_before. Also returns the sum of |terms| per element (for tolerances)."""
    T, k = experts.shape
    rows, bias, shared = f64(rows), None if bias is None else f64(bias), None if shared is None else f64(shared)
    out = np.zeros((T, H)) if out_before is None else f64(out_before).copy()
    magnitude = np.zeros((T, H))
    for t in range(T):
        acc, mag, any_local = np.zeros(H), np.zeros(H), False
        for j in range(k):
            e = int(experts[t, j])
            if not start <= e < start + e_local:
                continue  # never read
            any_local = True
            w = 1.0 if scales is None else float(scales[t, j])
            x = rows[int(u2p[j * T + t]), :H].copy()
            if bias is not None:
                x += bias[e - start, :H]
            acc += w * x
            mag += np.abs(w * x)
        if not any_local and not fill:
            continue
        if shared is not None:
            acc += shared[t, :H]
            mag += np.abs(shared[t, :H])
        out[t] = acc
        magnitude[t] = mag
    return out, magnitude


def finalize_problem(rng, T, k, H, padded_H, rows_dtype, e_total, start, e_local, scales=True, bias=False,
                     shared=False, out_dtype=None):
    """Random inputs in TensorRT-LLM's layouts: distinct experts per token; the rows buffer holds the
    local rows at the permuted positions and NaN everywhere else; non-local u2p entries are garbage."""
    out_dtype = out_dtype or rows_dtype
    experts = np.array([rng.permutation(e_total)[:k] for _ in range(T)], np.int32).reshape(T, k)
    offsets, p2u, u2p = routing_maps(experts, start, e_local)
    P = len(p2u)
    num_rows = P + 3  # spare rows, NaN: never read
    rows = np.full((num_rows, padded_H), np.nan, np.float32)
    rows[:P, :H] = rng.uniform(-2, 2, (P, H))
    garbage = rng.integers(-(2 ** 31), 2 ** 31 - 1, size=k * T)
    u2p_arr = np.where(u2p >= 0, u2p, garbage).astype(np.int32)  # non-local entries: anything
    p = {
        "rows": rows.astype(np_dtype(rows_dtype)),
        "u2p": u2p_arr,
        "experts": experts,
        "scales": rng.uniform(0, 1, (T, k)).astype(np.float32) if scales else None,
        "bias": rng.uniform(-1, 1, (e_local, H)).astype(np_dtype(rows_dtype)) if bias else None,
        "shared": rng.uniform(-1, 1, (T, H)).astype(np_dtype(out_dtype)) if shared else None,
        "offsets": offsets.astype(np.int64),
        "p2u": np.concatenate([p2u, np.full(num_rows - P, -7)]).astype(np.int32),
        "start": start, "e_local": e_local, "H": H, "out_dtype": out_dtype,
    }
    return p


# ---------------------------------------------------------------------------
# spec §3: FC2 + finalize
# ---------------------------------------------------------------------------

def fc2_finalize(A, W2, offsets, p2u, scales, bias, T, k):
    """float64 out [T, H] = sum over local slots w * (A[p] @ W2[e]^T + bias[e])."""
    A, W2 = f64(A), f64(W2)
    E, H, _ = W2.shape
    out = np.zeros((T, H))
    for e in range(E):
        for p in range(int(offsets[e]), int(offsets[e + 1])):
            s = int(p2u[p])
            t, j = s % T, s // T
            w = 1.0 if scales is None else float(scales[t, j])
            y = W2[e] @ A[p]
            if bias is not None:
                y = y + f64(bias)[e]
            out[t] += w * y
    return out


# ---------------------------------------------------------------------------
# spec §4: mHC
# ---------------------------------------------------------------------------

def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def sinkhorn(logits, iters, eps):
    """H_res from the n x n logits: row softmax + eps, column normalisation, then iters - 1
    rounds of (row, column) normalisation, each dividing by (sum + eps)."""
    m = np.exp(logits - logits.max(axis=1, keepdims=True))
    m = m / m.sum(axis=1, keepdims=True) + eps
    m = m / (m.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(axis=1, keepdims=True) + eps)
        m = m / (m.sum(axis=0, keepdims=True) + eps)
    return m


def mhc_coefficients(x, phi, alpha, bias, n, eps_norm=1e-6, eps_pre=1e-6, post_mult=2.0, eps_sinkhorn=1e-6,
                     sinkhorn_iters=20):
    """h [B, N], r [B], H_pre [B, n], H_post [B, n], H_res [B, n, n] in float64 from X [B, n*C]."""
    X = f64(x).reshape(x.shape[0], -1)
    K = X.shape[1]
    r = np.sqrt((X * X).sum(axis=1) / K + eps_norm)
    a = np.array([alpha[0]] * n + [alpha[1]] * n + [alpha[2]] * (n * n), np.float64)
    h = a * (X @ f64(phi).T) / r[:, None] + f64(bias)
    h_pre = sigmoid(h[:, :n]) + eps_pre
    h_post = post_mult * sigmoid(h[:, n:2 * n])
    h_res = np.stack([sinkhorn(h[b, 2 * n:].reshape(n, n), sinkhorn_iters, eps_sinkhorn) for b in range(len(X))])
    return h, r, h_pre, h_post, h_res.reshape(len(X), n, n)


def mhc_pre(x, phi, alpha, bias, n, **params):
    """(F_pre [B, C], H_post, H_res) in float64."""
    _, _, h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, n, **params)
    X = f64(x).reshape(x.shape[0], n, -1)
    return np.einsum("bi,bic->bc", h_pre, X), h_post, h_res


def mhc_post(x, f_out, h_post, h_res, res_layout="deepseek"):
    """X_next [B, n, C] in float64: R X + H_post F_out, R = H_res^T (deepseek) or H_res (row_mix)."""
    n = h_post.shape[1]
    X = f64(x).reshape(x.shape[0], n, -1)
    R = f64(h_res)
    R = np.transpose(R, (0, 2, 1)) if res_layout == "deepseek" else R
    return np.einsum("bij,bjc->bic", R, X) + f64(h_post)[:, :, None] * f64(f_out)[:, None, :]


def mhc_problem(rng, B, n, C, phi_dtype="float32"):
    """X ~ U(-2, 2), phi scaled so that h is O(1), alpha in [0.5, 1.5], bias in [-1, 1]."""
    K, N = n * C, n * n + 2 * n
    x = rng.uniform(-2, 2, (B, n, C)).astype(BF16)
    phi = (rng.uniform(-1, 1, (N, K)) / np.sqrt(K)).astype(np_dtype(phi_dtype))
    alpha = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    bias = rng.uniform(-1, 1, N).astype(np.float32)
    return x, phi, alpha, bias


def post_problem(rng, B, n, C):
    x = rng.uniform(-2, 2, (B, n, C)).astype(BF16)
    f_out = rng.uniform(-2, 2, (B, C)).astype(BF16)
    h_post = rng.uniform(0, 2, (B, n)).astype(np.float32)
    h_res = ((1 + 0.5 * rng.uniform(-1, 1, (B, n, n))) / n).astype(np.float32)
    return x, f_out, h_post, h_res
