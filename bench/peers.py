#!/usr/bin/env python3
"""flashmix against its peers on the issues' headline shapes, in one process on one GPU.

Each op runs as flashmix (through the Python binding) and as what an engine
would otherwise run (the peers' loading and their adapters: bench/peers_adapters.py):
  moe_finalize (spec §2): sgl-kernel's apply_shuffle_mul_sum (the same function:
    gather by index, router weights, top-k sum; no bias operand); sgl-kernel's
    moe_sum_reduce (the top-k sum alone, on rows gathered into token order and
    weighted beforehand, outside the timing: what is left of the finalize in an
    engine whose GEMM epilogue scatters and weights); torch eager (the spec's math
    written plainly); torch.compile of it (inductor, default mode).
  moe_fc2 (spec §3, FC2 GEMM + finalize): flashmix's atomic, deterministic and
    unfused modes; DeepGEMM's m_grouped_bf16_gemm_nt_contiguous alone (its
    contiguous layout, every expert's rows padded to the kernel's block, built
    from the same routing outside the timing; the padded-row fraction is
    recorded) and followed by sgl's apply_shuffle_mul_sum; torch._grouped_mm
    alone, followed by the finalize in torch, and by sgl's; cuBLAS bmm with the
    rows spread evenly (a grouped GEMM with perfect balance); a dense cuBLAS
    GEMM of equal FLOPs (the ceiling flashmix-bench uses).
  moe_fc1_fp8 / moe_fc2_fp8 (spec §9.7, §3.5: e4m3 with 1 x 128 activation and
    128 x 128 weight scales): flashmix's FC1 (gathered, and from a permuted copy)
    and FC2 (atomic, deterministic); DeepGEMM's m_grouped_fp8_gemm_nt_contiguous
    alone (padded contiguous layout, MN-major activation scales, built outside the
    timing), + the activation in torch (FC1) or + sgl's finalize (FC2);
    torch._scaled_grouped_mm on its own row-wise FP8 of the same bf16 data, alone
    and (FC2) + sgl's finalize; the ceiling is torch._scaled_mm of equal FLOPs with
    per-tensor scales and fast accumulation (`ceiling` "gemm_fp8", as flashmix-bench).
  moe_router (spec §8; flashmix-bench's case names, bf16 logits rotated through CUDA-graph
    replays): torch eager, torch.compile of the spec's math; sgl-kernel's topk_softmax on the
    softmax cases (its weights renormalised for gpt-oss's softmax over the k).
  mhc_pre / mhc_post (spec §4): torch eager, torch.compile; for mhc_pre also
    DeepGEMM's tf32_hc_prenorm_gemm, the projection and sums of squares only
    (a part of mhc_pre, timed against flashmix's whole op).
  moe_forward_mxfp4 (spec §13.7; --ops mxfp4): the MXFP4 expert layer at decode on
    DeepSeek-V4-Flash's shapes, rank 0 of EP 8 (H 4096, I 2048, 256 experts, top 6,
    experts 0..31 held; flashmix-bench's cases v4flash_ep8_T16 / _T64 with its
    inputs: the same hashes for X, the router logits and the MXFP4 weights, routed
    once by flashmix's sqrtsoftplus router): flashmix's moe_forward W4A8 (the
    ratios' reference), W4A16, and W4A8 with the router in the call (as
    flashmix-bench times it); triton_kernels' matmul_ogs layer with bf16
    activations (its Hopper MXFP4 path: adapters.TritonMxfp4Moe): routing maps
    built in the call, FC1 with the gather and its SwiGLU fused, FC2 with the
    router weights, scatter and top-k sum; the same with the maps built outside
    the timing; with DeepSeek-V4's SwiGLU as a kernel of its own; FC1's and FC2's
    GEMMs alone. Every record's `fraction` is of the copy rate, for the bytes
    of the e2m1 weights and their scales of the held experts that receive a
    slot (a GEMM alone: its own weights).
Every record has `ratio` = its time / flashmix's time on the case (above 1:
flashmix is faster; FC2: against flashmix atomic, and `ratio_deterministic`
against flashmix deterministic; the MXFP4 layer: against flashmix W4A8).

Ceilings are measured in the same run: a 1 GiB device-to-device copy (bytes
read + written) and an 8192^3 bf16 cuBLAS GEMM. Timing: CUDA events around
batches of back-to-back calls, median of the batches after warm-up; inputs
larger than L2. Decode cases (T or B <= 64) are CUDA-graph replays of 100
back-to-back calls (no Python launch overhead, as in an engine's decode
graphs) on the same inputs, which stay in L2 (`_l2_warm` in the case name).

Checks: every output is compared with flashmix's (which the C++ tests check
against the CPU reference): max |peer - flashmix| / max |flashmix| <= 1e-2
(TOL_SAME: same inputs and fp32 sums, so only the final bf16 rounding
differs, 2^-8 = 3.9e-3 of an element), 2e-2 (TOL_BF16_STEP) where the peer
rounds an intermediate to bf16 (a GEMM's output before the finalize, rows
weighted beforehand) or sums in another order over K. Router weights are
drawn bf16-exact (sgl takes them in bf16). GEMM-alone rows are checked
against a per-expert torch GEMM. The MXFP4 layer: triton_kernels runs bf16
activations on the same dequantised weights, so it is checked against flashmix
W4A16 within TOL_BF16_STEP (its rows are rounded to bf16 before the top-k
sum) and its relative Frobenius error against W4A8 is recorded; flashmix
W4A16 is checked against W4A8 by that error within 2^-3 (W4A8 rounds X and
FC1's output to e4m3: ~4 % of the output's norm), as flashmix-bench does. A
peer that disagrees is reported as such and makes the exit status 1.

A peer that is not installed or fails to load is recorded as `missing:
<reason>`; one that raises on the case, `failed: <error>`; an operand it does
not have (bias), `n/a: <why>`. None of them has a time.

Usage (on a GPU machine, with the binding built, e.g. by
`PYTEST=0 scripts/gpu_python_tests.sh BUILD`, and the peers unpacked by
bench/peers_setup.sh into /tmp/site):
    PYTHONPATH=/tmp/site:BUILD/python:python python3 bench/peers.py [--json FILE_OR_FOLDER]
        [--commit HASH] [--no-compile] [--ops finalize,fc2,fc1,fc2_fp8,fc1_fp8,mhc,router,mxfp4]
scripts/peers_table.py prints the README's table from the JSON records.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

import torch

import flashmix

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_adapters as adapters  # noqa: E402
from peers_adapters import Missing  # noqa: E402

DEV = "cuda"
TOL_SAME = 1e-2
TOL_BF16_STEP = 2e-2
GRAPH_CALLS = 100


# ===========================================================================
# Timing and records
# ===========================================================================

def timed(fn, repeats, warmup=3):
    """Median over `repeats` batches of the time per call, each batch a run of
    back-to-back calls between two events (>= ~2 ms of GPU work), so the
    Python and binding overhead of a call hides behind the GPU's queue, as
    in an engine; flashmix-bench times its cases the same way."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    batch = max(1, min(200, int(2000.0 / max(1.0, e0.elapsed_time(e1) * 1e3))))
    times = []
    for _ in range(repeats):
        e0.record()
        for _ in range(batch):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / batch)
    return statistics.median(times)


def timed_graph(fn, repeats, calls=GRAPH_CALLS):
    """Median over `repeats` replays of a CUDA graph of `calls` back-to-back calls, per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del graph
    return statistics.median(times)


def rel_err(a, b):
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class Aborted(Exception):
    """The GPU is unusable (a sticky CUDA error after a peer raised): the run stops there."""


def settle():
    """Waits for the GPU after a peer raised; a sticky CUDA error then aborts the run."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise Aborted("the GPU is unusable after a peer's error (%s); rerun with --ops to skip it" % e) from None


def first_line(e):
    text = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, text[0][:300] if text else "")


class Run:
    """The records of one run, the same-run ceilings, and each case's flashmix times."""

    def __init__(self, args):
        self.args = args
        self.records = []
        self.refs = {}  # (op, case) -> {"flashmix impl": us}
        self.timing = None  # how measure() timed the last call, when not plainly
        big = 1 << 30
        src = torch.empty(big, dtype=torch.uint8, device=DEV)
        src.random_(0, 255)
        dst = torch.empty_like(src)
        us = timed(lambda: dst.copy_(src), 20)
        self.copy_gbps = 2 * big / (us * 1e-6) / 1e9
        src = dst = None
        n = 8192
        x = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        y = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        us = timed(lambda: x @ y, 20)
        self.gemm_tflops = 2 * n ** 3 / (us * 1e-6) / 1e12
        print("ceilings: copy %.1f GB/s (a 1 GiB copy, bytes read + written), cuBLAS bf16 GEMM %.1f TFLOP/s" %
              (self.copy_gbps, self.gemm_tflops))

    def compiled(self, fn):
        return torch.compile(fn, dynamic=False) if not self.args.no_compile else None

    def record(self, op, case, impl, us, *, status=None, bytes_=None, dense_us=None, err=None, tol=None,
               note=None, extra=None):
        r = {"op": op, "case": case, "impl": impl, "median_us": None if us is None else round(us, 3)}
        refs = self.refs.get((op, case), {})
        if us is not None and refs:
            first = next(iter(refs))  # the case's first flashmix timing (FC2: atomic)
            r["ratio"] = round(us / refs[first], 4)
            r["ratio_vs"] = first
            if "flashmix deterministic" in refs and first != "flashmix deterministic":
                r["ratio_deterministic"] = round(us / refs["flashmix deterministic"], 4)
        if us is not None and bytes_ is not None:
            r["ceiling"] = "copy"
            r["fraction"] = round(bytes_ / (us * 1e-6) / 1e9 / self.copy_gbps, 4)
        if us is not None and dense_us is not None:
            r["ceiling"] = "gemm"
            r["dense_us"] = round(dense_us, 3)
            r["ratio_to_dense"] = round(us / dense_us, 4)
        if err is not None:
            r["max_rel_err_vs_flashmix"] = err
            r["tolerance"] = tol
            r["check"] = "agrees" if err <= tol else "DISAGREES (%.3g > %.3g)" % (err, tol)
        else:
            r["check"] = status or "reference"
        if us is not None and getattr(self, "timing", None):
            r["timing"] = self.timing
        self.timing = None
        if note:
            r["note"] = note
        if extra:
            r.update(extra)
        self.records.append(r)
        if us is None:
            print("%-13s %-36s %-38s %12s  %s" % (op, case, impl, "-", r["check"]), flush=True)
        else:
            ratio = ("%6.2fx" % r["ratio"]) if "ratio" in r else "      "
            print("%-13s %-36s %-38s %9.2f us %s  %s" % (op, case, impl, us, ratio, r["check"]), flush=True)
        return r

    def reference(self, op, case, impl, fn, *, graph=False, repeats=30, **kw):
        """Times flashmix's `impl` (fn already run once; its output is the case's reference unless
        err, its difference from the reference, is given)."""
        us = self.measure(fn, repeats, graph)
        self.refs.setdefault((op, case), {})[impl] = us
        return self.record(op, case, impl, us, **kw)

    def peer(self, op, case, impl, make, *, check=None, tol=TOL_SAME, graph=False, repeats=10, **kw):
        """One peer: make() builds its callable (Missing: recorded as missing), which is run once,
        checked (check() -> max relative error vs flashmix, or None), then timed."""
        try:
            fn = make()
        except Missing as e:
            return self.record(op, case, impl, None, status="missing: %s" % e, note=kw.get("note"))
        except Exception as e:  # noqa: BLE001 - a peer that fails on a case is reported, not timed
            settle()
            return self.record(op, case, impl, None, status="failed: %s" % first_line(e), note=kw.get("note"))
        try:
            fn()
            torch.cuda.synchronize()
            err = check() if check is not None else None
            us = self.measure(fn, repeats, graph)
        except Missing as e:
            return self.record(op, case, impl, None, status="n/a: %s" % e, note=kw.get("note"))
        except Exception as e:  # noqa: BLE001 - a peer that fails on a case is reported, not timed
            settle()
            return self.record(op, case, impl, None, status="failed: %s" % first_line(e), note=kw.get("note"))
        if err is None:
            kw.setdefault("status", "not checked")
        return self.record(op, case, impl, us, err=err, tol=tol, **kw)

    def measure(self, fn, repeats, graph):
        """Times fn; with graph, as CUDA-graph replays, or, when fn cannot be captured, back to back
        (self.timing says which, for the record)."""
        if not graph:
            self.timing = None
            return timed(fn, repeats)
        try:
            us = timed_graph(fn, max(repeats, 20))
            self.timing = "cuda graph of %d calls" % GRAPH_CALLS
            return us
        except RuntimeError as e:
            settle()
            self.timing = "back to back: graph capture failed (%s)" % first_line(e)
            return timed(fn, repeats)


def mark_not_applicable(run, op, case, impl, why, note=None):
    run.record(op, case, impl, None, status="n/a: %s" % why, note=note)


# ===========================================================================
# moe_finalize (spec §2)
# ===========================================================================

def finalize_torch(rows, u2p, experts, scales, bias):
    T, k = experts.shape
    g = rows[u2p.view(k, T).t().long()].float()  # [T, k, H]
    if bias is not None:
        g = g + bias[experts.long()].float()
    return (g * scales[..., None]).sum(1).to(rows.dtype)


def bench_finalize(run, T, k, H, E, with_bias):
    decode = T <= 64
    case = ("decode_T%d_k%d_H%d%s_l2_warm" if decode else "T%d_k%d_H%d_bf16%s") % (
        T, k, H, "_bias" if with_bias else "")
    op = "moe_finalize"
    rows = torch.randn(T * k, H, device=DEV, dtype=torch.bfloat16)
    experts = torch.rand(T, E, device=DEV).topk(k, dim=1).indices.int()
    u2p = torch.randperm(T * k, device=DEV).int()
    scales = torch.rand(T, k, device=DEV).bfloat16().float()  # bf16-exact: sgl takes them in bf16
    bias = torch.randn(E, H, device=DEV, dtype=torch.bfloat16) if with_bias else None
    nbytes = (T * k * H + T * H) * 2 + T * k * 12
    time = dict(graph=decode, bytes_=nbytes)

    out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
    fm = lambda: flashmix.finalize_moe_routing(rows, u2p, experts, num_experts_per_node=E, scales=scales,
                                                bias=bias, out=out)
    fm()
    ref = out.clone()
    run.reference(op, case, "flashmix", fm, **time)

    if with_bias:
        mark_not_applicable(run, op, case, "sgl apply_shuffle_mul_sum", "no bias operand")
    else:
        out_sgl = torch.empty_like(out)
        run.peer(op, case, "sgl apply_shuffle_mul_sum",
                 lambda: adapters.sgl_apply_shuffle_mul_sum(rows, u2p, scales, out_sgl),
                 check=lambda: rel_err(out_sgl, ref), tol=TOL_SAME, repeats=30, **time)

    # moe_sum_reduce: the rows gathered into token order, weighted (and biased) outside the timing.
    out_sum = torch.empty_like(out)

    def make_sum_reduce():
        adapters.sgl_ops()  # Missing before the preparation allocates anything
        g = rows[adapters.token_major(u2p, T, k).long()].view(T, k, H).float()
        if bias is not None:
            g = g + bias[experts.long()].float()
        weighted = (g * scales[..., None]).to(torch.bfloat16).contiguous()
        return adapters.sgl_moe_sum_reduce(weighted, out_sum)
    run.peer(op, case, "sgl moe_sum_reduce (pre-gathered)", make_sum_reduce, check=lambda: rel_err(out_sum, ref),
             tol=TOL_BF16_STEP, repeats=30,
             note="top-k sum only: rows gathered into token order and weighted (with bias) outside the timing", **time)

    run.peer(op, case, "torch eager", lambda: (lambda: finalize_torch(rows, u2p, experts, scales, bias)),
             check=lambda: rel_err(finalize_torch(rows, u2p, experts, scales, bias), ref), tol=TOL_SAME, **time)
    comp = run.compiled(finalize_torch)
    if comp is not None:
        f = lambda: comp(rows, u2p, experts, scales, bias)
        run.peer(op, case, "torch.compile", lambda: f, check=lambda: rel_err(f(), ref), tol=TOL_SAME, repeats=20,
                 **time)


# ===========================================================================
# moe_fc2: the FC2 grouped GEMM + finalize (spec §3)
# ===========================================================================

def expert_rows_torch(A, W2, offs):
    """The GEMM rows ``A[p] @ W2[e]^T`` per expert (bf16), to check the GEMM-alone peers."""
    o = offs.tolist()
    y = torch.empty(o[-1], W2.shape[1], device=A.device, dtype=torch.bfloat16)
    for e in range(W2.shape[0]):
        if o[e + 1] > o[e]:
            y[o[e]:o[e + 1]] = A[o[e]:o[e + 1]] @ W2[e].t()
    return y


def bench_fc2(run, name, T, k, E, I, H):
    case = "%s_T%d_k%d_E%d_I%d_H%d" % (name, T, k, E, I, H)
    op = "moe_fc2"
    P = T * k
    experts = torch.rand(T, E, device=DEV).topk(k, dim=1).indices.int()  # every slot local, uniform
    scales = torch.rand(T, k, device=DEV).bfloat16().float()  # bf16-exact: sgl takes them in bf16
    A = torch.randn(P, I, device=DEV, dtype=torch.bfloat16)
    W2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * (1.0 / I ** 0.5)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E)
    offs, p2u, u2p = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, \
        maps.unpermuted_row_to_permuted_row
    torch.cuda.synchronize()
    # Dense cuBLAS GEMM of equal FLOPs, timed right here (the clock moves under tensor load).
    Ad, Wd = torch.randn(P, I, device=DEV, dtype=torch.bfloat16), torch.randn(H, I, device=DEV, dtype=torch.bfloat16)
    dense = lambda: Ad @ Wd.t()
    dense_us = timed(dense, 10)
    time = dict(dense_us=dense_us)

    # flashmix, every mode; deterministic's output is the case's reference.
    outs, fns = {}, {}
    for mode in ("deterministic", "atomic", "unfused"):
        out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
        ws = torch.empty(flashmix.moe_fc2_finalize_workspace_size(T, k, H, I, E, mode), dtype=torch.uint8, device=DEV)
        fns[mode] = lambda out=out, ws=ws, mode=mode: flashmix.moe_fc2_finalize(
            A, W2, offs, p2u, k=k, scales=scales, mode=mode, out=out, workspace=ws)
        fns[mode]()
        torch.cuda.synchronize()
        outs[mode] = out.clone()
    ref = outs["deterministic"]
    for mode in ("atomic", "deterministic", "unfused"):  # atomic first: the ratios' reference
        err = None if mode == "deterministic" else rel_err(outs[mode], ref)
        run.reference(op, case, "flashmix " + mode, fns[mode], repeats=10, err=err, tol=TOL_BF16_STEP, **time)
    ref_rows = expert_rows_torch(A, W2, offs)
    offs32 = offs[1:].int()

    # torch._grouped_mm: alone, + the finalize in torch, + sgl's finalize.
    gm = lambda: torch._grouped_mm(A, W2.transpose(1, 2), offs=offs32)
    run.peer(op, case, "torch._grouped_mm only", lambda: gm, check=lambda: rel_err(gm(), ref_rows),
             tol=TOL_BF16_STEP, note="GEMM alone, no finalize; checked against a per-expert torch GEMM", **time)
    tf = lambda: finalize_torch(gm(), u2p, experts, scales, None)
    run.peer(op, case, "torch._grouped_mm + torch finalize", lambda: tf, check=lambda: rel_err(tf(), ref),
             tol=TOL_BF16_STEP, **time)
    out_gs = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)

    def make_grouped_sgl():
        finalize = adapters.sgl_shuffle_mul_sum_into(u2p, scales, out_gs)
        return lambda: finalize(gm())
    run.peer(op, case, "torch._grouped_mm + sgl finalize", make_grouped_sgl, check=lambda: rel_err(out_gs, ref),
             tol=TOL_BF16_STEP, **time)

    # DeepGEMM: its contiguous layout built once, outside the timing; alone, then + sgl's finalize.
    layout = {}

    def make_deep_gemm():
        if not layout:
            layout.update(adapters.deep_gemm_layout(A, offs, P))
            layout["gemm"], layout["d"] = adapters.deep_gemm_m_grouped(layout, W2)
        return layout["gemm"]

    def layout_facts(r):
        if layout:
            r.update(padded_rows=layout["padded_rows"], alignment=layout["alignment"],
                     padded_fraction=round(layout["padded_fraction"], 4))
    layout_facts(run.peer(op, case, "DeepGEMM m_grouped_bf16 only", make_deep_gemm,
                          check=lambda: rel_err(layout["d"][layout["dest"]], ref_rows), tol=TOL_BF16_STEP,
                          note="GEMM alone (contiguous layout: experts padded to the block), no finalize; "
                          "checked against a per-expert torch GEMM", **time))
    out_ds = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)

    def make_deep_gemm_sgl():
        gemm = make_deep_gemm()
        # the padded row of each slot: flashmix's map through the layout
        fin = adapters.sgl_apply_shuffle_mul_sum(layout["d"], layout["dest"][u2p.long()].int(), scales, out_ds)
        return lambda: (gemm(), fin())
    layout_facts(run.peer(op, case, "DeepGEMM + sgl finalize", make_deep_gemm_sgl,
                          check=lambda: rel_err(out_ds, ref), tol=TOL_BF16_STEP, **time))
    layout.clear()

    # cuBLAS batched with the rows spread evenly: a grouped GEMM with perfect balance (no finalize).
    Ab = A.view(E, P // E, I)
    bm = lambda: torch.bmm(Ab, W2.transpose(1, 2))
    run.peer(op, case, "cuBLAS bmm, even rows", lambda: bm, note="GEMM alone, rows spread evenly, no finalize",
             **time)
    dense_end = timed(dense, 10)
    run.record(op, case, "cuBLAS dense, equal FLOPs", dense_end, dense_us=dense_us, status="ceiling")
    # The clock drops under sustained tensor load: every dense ratio of the case
    # is taken against the faster of the two dense timings (never flatters flashmix).
    best = min(dense_us, dense_end)
    for r in run.records:
        if r["case"] == case and r.get("median_us") and "dense_us" in r:
            r["dense_us"] = round(best, 3)
            r["ratio_to_dense"] = round(r["median_us"] / best, 4)


# ===========================================================================
# MoE FC1 with the gather and SwiGLU fused (spec §9)
# ===========================================================================

def fc1_inputs(name, T, k, E, I, H):
    """An FC1 case's name, slots P and inputs: uniform routing over E experts (every slot local),
    bf16 x [T, H] and W1 [E, 2I, H]."""
    experts = torch.rand(T, E, device=DEV).topk(k, dim=1).indices.int()
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    W1 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * (1.0 / H ** 0.5)
    return "%s_T%d_k%d_E%d_I%d_H%d" % (name, T, k, E, I, H), T * k, experts, x, W1


def bench_fc1(run, name, T, k, E, I, H):
    """flashmix's FC1 (gathering X itself, and from a permuted copy) against what an engine runs
    instead: gather X into a permuted copy, a grouped GEMM to [P, 2I], then silu(gate) * up."""
    case, P, experts, x, W1 = fc1_inputs(name, T, k, E, I, H)
    op = "moe_fc1"
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E, input=x)
    offs, p2u, xp = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, maps.permuted_input
    torch.cuda.synchronize()
    Ad, Wd = torch.randn(P, H, device=DEV, dtype=torch.bfloat16), torch.randn(2 * I, H, device=DEV,
                                                                            dtype=torch.bfloat16)
    dense = lambda: Ad @ Wd.t()
    dense_us = timed(dense, 10)
    time = dict(dense_us=dense_us)
    out = torch.empty(P, I, device=DEV, dtype=torch.bfloat16)
    fm = lambda: flashmix.moe_fc1(x, W1, offs, p2u, k=k, out=out)
    fm()
    torch.cuda.synchronize()
    ref = out.clone()
    run.reference(op, case, "flashmix (gather fused)", fm, repeats=10, **time)
    out_p = torch.empty(P, I, device=DEV, dtype=torch.bfloat16)
    fmp = lambda: flashmix.moe_fc1(xp, W1, offs, p2u, k=k, x_permuted=True, num_tokens=T, out=out_p)
    fmp()
    torch.cuda.synchronize()
    run.reference(op, case, "flashmix (permuted copy given)", fmp, repeats=10, err=rel_err(out_p, ref),
                  tol=TOL_SAME, **time)
    offs32 = offs[1:].int()
    tok = (p2u.long() % T)

    def torch_path(gather):
        def f():
            a = x[tok] if gather else xp
            h = torch._grouped_mm(a, W1.transpose(1, 2), offs=offs32)
            return torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        return f
    for gather in (True, False):
        f = torch_path(gather)
        run.peer(op, case, "torch %s_grouped_mm + silu*up" % ("gather + " if gather else "(permuted copy) "),
                 lambda f=f: f, check=lambda f=f: rel_err(f(), ref), tol=TOL_BF16_STEP,
                 note="gate and up rounded to bf16 before the activation", **time)
    gm = lambda: torch._grouped_mm(xp, W1.transpose(1, 2), offs=offs32)
    run.peer(op, case, "torch._grouped_mm only (permuted copy)", lambda: gm, note="GEMM alone, no activation",
             **time)
    layout = {}

    def make_deep_gemm():
        if not layout:
            layout.update(adapters.deep_gemm_layout(xp, offs, P))
            layout["gemm"], layout["d"] = adapters.deep_gemm_m_grouped(layout, W1)
        return layout["gemm"]
    run.peer(op, case, "DeepGEMM m_grouped_bf16 only (permuted copy)", make_deep_gemm,
             note="GEMM alone on a contiguous (padded) layout built outside the timing, no activation", **time)
    layout.clear()
    dense_end = timed(dense, 10)
    run.record(op, case, "cuBLAS dense, equal FLOPs", dense_end, dense_us=dense_us, status="ceiling")
    best = min(dense_us, dense_end)
    for r in run.records:
        if r["case"] == case and r.get("median_us") and "dense_us" in r:
            r["dense_us"] = round(best, 3)
            r["ratio_to_dense"] = round(r["median_us"] / best, 4)


# ===========================================================================
# FP8 FC1 / FC2 (spec §9.7, §3.5: 1 x 128 activation and 128 x 128 weight scales)
# ===========================================================================

def dense_fp8_timer(M, N, K):
    """The issue's FP8 ceiling: torch._scaled_mm of equal FLOPs with per-tensor scales and fast
    accumulation ([M, K] x [K, N], bf16 out). Returns a callable."""
    a = torch.randn(M, K, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device=DEV).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV, dtype=torch.float32)
    return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def expert_rows_fp8_torch(Aq, As, Wq, Ws, offs):
    """The dequantised GEMM rows ``A[p] @ W[e]^T`` per expert (fp32 math, bf16 out), to check the
    GEMM-alone peers: A e4m3 ``[P, K]`` with scales ``[P, K/128]``, W e4m3 ``[E, N, K]`` with
    ``[E, N/128, K/128]``."""
    o = offs.tolist()
    P, K = o[-1], Aq.shape[1]
    E, N = Wq.shape[0], Wq.shape[1]
    y = torch.empty(P, N, device=DEV, dtype=torch.bfloat16)
    for e in range(E):
        if o[e + 1] == o[e]:
            continue
        rows = o[e + 1] - o[e]
        a = (Aq[o[e]:o[e + 1]].view(torch.float8_e4m3fn).float().view(rows, K // 128, 128) *
             As[o[e]:o[e + 1]].float().unsqueeze(2)).view(rows, K)
        w = (Wq[e].view(torch.float8_e4m3fn).float().view(N // 128, 128, K // 128, 128) *
             Ws[e].float().view(N // 128, 1, K // 128, 1)).view(N, K)
        y[o[e]:o[e + 1]] = (a @ w.t()).bfloat16()
    return y


def rowwise_fp8(x):
    """e4m3 with one float32 scale per row (amax / 448), the scaling torch._scaled_grouped_mm takes."""
    s = x.float().abs().amax(-1).clamp_min(1e-12) / 448.0
    return (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_peer(a_bf16, W_bf16, offs32):
    """torch._scaled_grouped_mm on row-wise FP8 (its scaling; quantised here, outside the timing):
    ``a [P, K]`` ragged by offs32 times ``W [E, N, K]``. Returns a callable (bf16 ``[P, N]``)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise Missing("torch %s has no _scaled_grouped_mm" % torch.__version__)
    aq, sa = rowwise_fp8(a_bf16)
    wq, sw = rowwise_fp8(W_bf16)  # [E, N, K], scales [E, N]
    b = wq.transpose(1, 2)  # [E, K, N], K-major per column (what the op takes)
    return lambda: torch._scaled_grouped_mm(aq, b, sa, sw, offs=offs32, out_dtype=torch.bfloat16)


def fp8_dense_ratios(run, op, case, dense, dense_us):
    """Records the FP8 ceiling at the case's end; every dense ratio against the faster timing."""
    dense_end = timed(dense, 10)
    run.record(op, case, "torch._scaled_mm dense FP8, equal FLOPs", dense_end, dense_us=dense_us,
               status="ceiling", note="per-tensor scales, fast accumulation")
    best = min(dense_us, dense_end)
    for r in run.records:
        if r["op"] == op and r["case"] == case and r.get("median_us") and "dense_us" in r:
            r["dense_us"] = round(best, 3)
            r["ratio_to_dense"] = round(r["median_us"] / best, 4)
            r["ceiling"] = "gemm_fp8"


# Error bounds of the FP8 peers against flashmix on the same e4m3 inputs: fp32
# sums in another order over K and a bf16 rounding of the GEMM's output before
# the activation / finalize: TOL_BF16_STEP. torch._scaled_grouped_mm runs on its
# own (row-wise) quantisation of the same bf16 data: each operand's e4m3
# rounding (up to 2^-4 of an element) differs from flashmix's, hence 0.1 of the
# largest output (a wrong row or scale gives errors of order 1).
TOL_OTHER_SCALING = 0.1


class Fp8Gemm:
    """One FP8 case's GEMM-alone pieces, built on first use: the reference rows (a per-expert GEMM
    of the dequantised operands) and DeepGEMM's padded contiguous layout with its GEMM."""

    def __init__(self, Aq, As, Wq, Ws, offs, P):
        self.args = (Aq, As, Wq, Ws, offs, P)
        self.rows = None
        self.layout = {}

    def ref_rows(self):
        if self.rows is None:
            Aq, As, Wq, Ws, offs, _ = self.args
            self.rows = expert_rows_fp8_torch(Aq, As, Wq, Ws, offs)
        return self.rows

    def deep_gemm(self):
        """DeepGEMM's GEMM as a callable (Missing where the peer is absent)."""
        if not self.layout:
            Aq, As, Wq, Ws, offs, P = self.args
            self.layout.update(adapters.deep_gemm_fp8_layout(Aq, As, offs, P))
            self.layout["gemm"], self.layout["d"] = adapters.deep_gemm_m_grouped_fp8(self.layout, Wq, Ws)
        return self.layout["gemm"]

    def deep_gemm_rows_err(self):
        return rel_err(self.layout["d"][self.layout["dest"]], self.ref_rows())

    def facts(self, r):
        """Adds DeepGEMM's padding to its record r."""
        if self.layout:
            r.update(padded_rows=self.layout["padded_rows"], alignment=self.layout["alignment"],
                     padded_fraction=round(self.layout["padded_fraction"], 4))

    def release(self):
        self.rows = None
        self.layout.clear()


def bench_fc1_fp8(run, name, T, k, E, I, H):
    """flashmix's block-FP8 FC1 (gather and SwiGLU fused) against DeepGEMM's FP8 m-grouped GEMM
    (+ the activation in torch) and torch._scaled_grouped_mm, all on a permuted copy given."""
    case, P, experts, x, W1 = fc1_inputs(name, T, k, E, I, H)
    op = "moe_fc1_fp8"
    W1q, W1s = flashmix.quantize_fp8(W1, block="128x128")
    xq, xs = flashmix.quantize_fp8(x, block="1x128")
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E, input=x)
    offs, p2u, xp = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, maps.permuted_input
    xpq, xps = flashmix.quantize_fp8(xp[:P], block="1x128")  # per row: the gathered rows' very codes
    torch.cuda.synchronize()
    dense = dense_fp8_timer(P, 2 * I, H)
    dense_us = timed(dense, 10)
    time = dict(dense_us=dense_us)
    fp8 = dict(fp8="block", w1_scales=W1s)
    out = torch.empty(P, I, device=DEV, dtype=torch.bfloat16)
    fm = lambda: flashmix.moe_fc1(xq, W1q, offs, p2u, k=k, x_scales=xs, out=out, **fp8)
    fm()
    torch.cuda.synchronize()
    ref = out.clone()
    run.reference(op, case, "flashmix (gather fused)", fm, repeats=10, **time)
    out_p = torch.empty(P, I, device=DEV, dtype=torch.bfloat16)
    fmp = lambda: flashmix.moe_fc1(xpq, W1q, offs, p2u, k=k, x_permuted=True, num_tokens=T, x_scales=xps,
                                   out=out_p, **fp8)
    fmp()
    torch.cuda.synchronize()
    run.reference(op, case, "flashmix (permuted copy given)", fmp, repeats=10, err=rel_err(out_p, ref),
                  tol=TOL_SAME, **time)
    g = Fp8Gemm(xpq, xps, W1q, W1s, offs, P)
    g.facts(run.peer(op, case, "DeepGEMM m_grouped_fp8 only (permuted copy)", g.deep_gemm,
                     check=g.deep_gemm_rows_err, tol=TOL_BF16_STEP,
                     note="GEMM alone on a contiguous (padded) layout built outside the timing, no "
                     "activation; checked against a per-expert GEMM of the dequantised operands", **time))
    act = {}

    def make_deep_gemm_act():
        gemm, d = g.deep_gemm(), g.layout["d"]

        def f():
            gemm()
            act["y"] = torch.nn.functional.silu(d[:, :I]) * d[:, I:]
            return act["y"]
        return f
    g.facts(run.peer(op, case, "DeepGEMM m_grouped_fp8 + silu*up (permuted copy)", make_deep_gemm_act,
                     check=lambda: rel_err(act["y"][g.layout["dest"]], ref), tol=TOL_BF16_STEP,
                     note="gate and up rounded to bf16 before the activation", **time))
    offs32 = offs[1:].int()
    sg = {}

    def make_scaled_grouped():
        sg["f"] = scaled_grouped_mm_peer(xp[:P], W1, offs32)
        return sg["f"]
    run.peer(op, case, "torch._scaled_grouped_mm only (row-wise FP8, permuted copy)", make_scaled_grouped,
             check=lambda: rel_err(sg["f"](), g.ref_rows()), tol=TOL_OTHER_SCALING,
             note="GEMM alone, its own row-wise quantisation of the same bf16 data, no activation", **time)
    g.release()
    fp8_dense_ratios(run, op, case, dense, dense_us)


def bench_fc2_fp8(run, name, T, k, E, I, H):
    """flashmix's block-FP8 FC2 with the finalize fused against DeepGEMM's FP8 m-grouped GEMM
    (alone, and + sgl's finalize) and torch._scaled_grouped_mm."""
    case = "%s_T%d_k%d_E%d_I%d_H%d" % (name, T, k, E, I, H)
    op = "moe_fc2_fp8"
    P = T * k
    experts = torch.rand(T, E, device=DEV).topk(k, dim=1).indices.int()
    scales = torch.rand(T, k, device=DEV).bfloat16().float()  # bf16-exact: sgl takes them in bf16
    A = torch.randn(P, I, device=DEV, dtype=torch.bfloat16)
    W2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * (1.0 / I ** 0.5)
    Aq, As = flashmix.quantize_fp8(A, block="1x128")
    W2q, W2s = flashmix.quantize_fp8(W2, block="128x128")
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E)
    offs, p2u, u2p = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, \
        maps.unpermuted_row_to_permuted_row
    torch.cuda.synchronize()
    dense = dense_fp8_timer(P, H, I)
    dense_us = timed(dense, 10)
    time = dict(dense_us=dense_us)
    outs, fns = {}, {}
    for mode in ("deterministic", "atomic"):
        out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
        ws = torch.empty(flashmix.moe_fc2_finalize_workspace_size(T, k, H, I, E, mode), dtype=torch.uint8, device=DEV)
        fns[mode] = lambda out=out, ws=ws, mode=mode: flashmix.moe_fc2_finalize(
            Aq, W2q, offs, p2u, k=k, scales=scales, mode=mode, out=out, workspace=ws, fp8="block", a_scales=As,
            w2_scales=W2s)
        fns[mode]()
        torch.cuda.synchronize()
        outs[mode] = out.clone()
    ref = outs["deterministic"]
    for mode in ("atomic", "deterministic"):  # atomic first: the ratios' reference
        err = None if mode == "deterministic" else rel_err(outs[mode], ref)
        run.reference(op, case, "flashmix " + mode, fns[mode], repeats=10, err=err, tol=TOL_BF16_STEP, **time)
    g = Fp8Gemm(Aq, As, W2q, W2s, offs, P)
    g.facts(run.peer(op, case, "DeepGEMM m_grouped_fp8 only", g.deep_gemm, check=g.deep_gemm_rows_err,
                     tol=TOL_BF16_STEP, note="GEMM alone (contiguous layout: experts padded to the block), no "
                     "finalize; checked against a per-expert GEMM of the dequantised operands", **time))
    out_ds = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)

    def make_deep_gemm_sgl():
        gemm = g.deep_gemm()
        fin = adapters.sgl_apply_shuffle_mul_sum(g.layout["d"], g.layout["dest"][u2p.long()].int(), scales, out_ds)
        return lambda: (gemm(), fin())
    g.facts(run.peer(op, case, "DeepGEMM m_grouped_fp8 + sgl finalize", make_deep_gemm_sgl,
                     check=lambda: rel_err(out_ds, ref), tol=TOL_BF16_STEP, **time))
    offs32 = offs[1:].int()
    sg = {}

    def make_scaled_grouped():
        sg["f"] = scaled_grouped_mm_peer(A, W2, offs32)
        return sg["f"]
    run.peer(op, case, "torch._scaled_grouped_mm only (row-wise FP8)", make_scaled_grouped,
             check=lambda: rel_err(sg["f"](), g.ref_rows()), tol=TOL_OTHER_SCALING,
             note="GEMM alone, its own row-wise quantisation of the same bf16 data, no finalize", **time)
    out_gs = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)

    def make_scaled_grouped_sgl():
        gm = make_scaled_grouped()
        finalize = adapters.sgl_shuffle_mul_sum_into(u2p, scales, out_gs)
        return lambda: finalize(gm())
    run.peer(op, case, "torch._scaled_grouped_mm + sgl finalize", make_scaled_grouped_sgl,
             check=lambda: rel_err(out_gs, ref), tol=TOL_OTHER_SCALING, **time)
    g.release()
    fp8_dense_ratios(run, op, case, dense, dense_us)


# ===========================================================================
# The MXFP4 expert layer at decode (spec §13.7): moe_forward against triton_kernels' matmul_ogs
# ===========================================================================

MXFP4_CASES = [  # name, T, k, E, E_local, H, I: DeepSeek-V4-Flash's experts on rank 0 of EP 8 (flashmix-bench's)
    ("v4flash_ep8_T16", 16, 6, 256, 32, 4096, 2048),
    ("v4flash_ep8_T64", 64, 6, 256, 32, 4096, 2048),
]
SWIGLU_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit (flashmix's "swiglu_clamped")
# W4A16 against W4A8 (and the peer, whose activations are bf16, against W4A8): the FP8 layer
# rounds X and FC1's output to e4m3 (up to 2^-4 of an element, ~4 % of the output's norm
# together), so these are compared by the relative Frobenius error, within 2^-3 as flashmix-bench
# checks its MXFP4 layer against the bf16 one.
TOL_W4A8_FROBENIUS = 0.125


def rel_frobenius(a, b):
    a, b = a.float(), b.float()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_hashed_bf16(n, seed, scale):
    """flashmix-bench's fill_bf16 (bench/bench_common.cu), value for value: scale * u, u in [-1, 1)
    from a 64-bit hash of i + seed, rounded to bf16 (on the CPU, in Python integers; exact)."""
    mask = (1 << 64) - 1
    vals = []
    for i in range(n):
        h = ((i + seed) * 0x9E3779B97F4A7C15) & mask
        h ^= h >> 31
        h = (h * 0xBF58476D1CE4E5B9) & mask
        h ^= h >> 29
        vals.append(scale * ((h >> 40) / float(1 << 24) * 2.0 - 1.0))
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16)


def bench_hashed_bytes(n, seed, lo=0, span=0):
    """flashmix-bench's fill_mx_kernel (bench/bench_moe_forward.cu), byte for byte, on the GPU: a
    32-bit hash of (i, seed), as the byte itself (span 0) or lo + hash % span."""
    m32 = 0xFFFFFFFF

    def mul32(h, c):  # h * c mod 2^32 without leaving int64
        return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & m32
    out = torch.empty(n, dtype=torch.uint8, device=DEV)
    step = 1 << 24
    for s in range(0, n, step):
        h = mul32(torch.arange(s, min(n, s + step), device=DEV, dtype=torch.int64), 0x9E3779B9) ^ seed
        h ^= h >> 16
        h = mul32(h, 0x85EBCA6B)
        h ^= h >> 13
        h = mul32(h, 0xC2B2AE35)
        h ^= h >> 16
        out[s:s + h.numel()] = (lo + h % span if span else h & 0xFF).to(torch.uint8)
    return out


def swiglu_clamped_interleaved(h, limit=SWIGLU_LIMIT):
    """DeepSeek-V4's clamped SwiGLU, ``silu(min(g, L)) * clamp(u, -L, L)`` (spec §9), on rows of
    interleaved gate/up columns; bf16 out."""
    g = h[:, 0::2].float().clamp(max=limit)
    u = h[:, 1::2].float().clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


class Mxfp4Experts:
    """The local experts of the MXFP4 cases, shared by them: flashmix-bench's weights byte for byte
    (e2m1 bytes from its hash, scales 2^-9 .. 2^-5) as flashmix's stacks (W1 gate/up), and, on first
    use, triton_kernels' operands (made from the interleaved copy; a failure is kept and raised again)
    and the dequantised weights of one expert for the GEMM-alone checks."""

    def __init__(self, E_local, H, I, k):
        self.E_local, self.H, self.I, self.k = E_local, H, I, k
        self.w1 = bench_hashed_bytes(E_local * 2 * I * H // 2, 33).view(E_local, 2 * I, H // 2)
        self.w2 = bench_hashed_bytes(E_local * H * I // 2, 34).view(E_local, H, I // 2)
        self.w1s = bench_hashed_bytes(E_local * 2 * I * H // 32, 35, 118, 5).view(E_local, 2 * I, H // 32)
        self.w2s = bench_hashed_bytes(E_local * H * I // 32, 36, 118, 5).view(E_local, H, I // 32)
        self._peer = None

    def triton(self):
        """adapters.TritonMxfp4Moe over these experts (W1 interleaved for its fused SwiGLU)."""
        if self._peer is None:
            E, N, c = self.w1.shape
            try:
                adapters.triton_kernels()  # Missing before anything is allocated
                w1i = self.w1.view(E, 2, N // 2, c).transpose(1, 2).reshape(E, N, c)
                s1i = self.w1s.view(E, 2, N // 2, -1).transpose(1, 2).reshape(E, N, -1)
                self._peer = adapters.TritonMxfp4Moe(w1i, s1i, self.w2, self.w2s, k=self.k, limit=SWIGLU_LIMIT)
            except Exception as e:  # noqa: BLE001 - kept: every record of the peer reports it
                self._peer = e
            torch.cuda.empty_cache()
        if isinstance(self._peer, Exception):
            raise self._peer
        return self._peer

    def w1_interleaved_bf16(self, e):
        """Expert e's W1 dequantised (flashmix's mxfp4_to_bf16, exact), rows interleaved gate/up."""
        w = flashmix.mxfp4_to_bf16(self.w1[e], self.w1s[e])
        return w.view(2, self.I, self.H).transpose(0, 1).reshape(2 * self.I, self.H)

    def w2_bf16(self, e):
        return flashmix.mxfp4_to_bf16(self.w2[e], self.w2s[e])


def sorted_rows_reference(a, gather_k, maps, weight_of):
    """The GEMM rows a triton_kernels grouped GEMM writes, per held sorted row r: ``a[src(r)] @
    W[e(r)]^T`` in fp32 from bf16 operands, bf16 out; src(r) = the token of r's slot (slot //
    gather_k) with the gather, r itself with gather_k 0. maps: adapters.triton_routing_indices';
    weight_of(e): W[e] bf16."""
    hist = maps["hist"].tolist()
    order = maps["order"].long()
    n = sum(hist)
    y = None
    start = 0
    for e, rows in enumerate(hist):
        if rows:
            r = torch.arange(start, start + rows, device=a.device)
            src = order[r] // gather_k if gather_k else r
            part = (a[src].float() @ weight_of(e).float().t()).to(torch.bfloat16)
            if y is None:
                y = torch.empty(n, part.shape[1], dtype=torch.bfloat16, device=a.device)
            y[start:start + rows] = part
        start += rows
    return y


def bench_mxfp4(run, experts, name, T, k, E, E_local, H, I):
    """flashmix's MXFP4 moe_forward (W4A8, W4A16) against triton_kernels' matmul_ogs layer on the
    same routing: flashmix-bench's inputs for the case (X, router logits and weights from its
    hashes), routed by flashmix's sqrtsoftplus router (top-k of E, renormalised, x 1.5) once,
    outside the timing; this rank holds experts [0, E_local). Every record: CUDA-graph replays,
    bytes_ = the e2m1 bytes and ue8m0 scales of the held experts that receive a slot (both GEMMs)."""
    op, case = "moe_forward_mxfp4", name
    logits = bench_hashed_bf16(T * E, 32, 4.0).view(T, E).to(DEV)
    x = bench_hashed_bf16(T * H, 31, 1.0).view(T, H).to(DEV)
    router = dict(scoring="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5)
    ids, scales = flashmix.moe_router(logits, k, **router)
    maps = adapters.triton_routing_indices(ids, scales, 0, E_local)
    torch.cuda.synchronize()
    hist = maps["hist"].tolist()
    used = [e for e, n in enumerate(hist) if n]
    per_gemm = {"fc1": 2 * I * H * 17 // 32, "fc2": H * I * 17 // 32}  # e2m1 bytes + a scale byte per 32
    nbytes = len(used) * (per_gemm["fc1"] + per_gemm["fc2"])
    facts = {"experts_used": len(used), "held_slots": sum(hist), "slots": T * k, "weight_bytes": nbytes,
             "ep": "experts 0..%d of %d" % (E_local - 1, E)}
    print("%s: %d of %d held experts receive %d of %d slots; %.1f MB of MXFP4 weights" %
          (case, len(used), E_local, sum(hist), T * k, nbytes / 1e6))
    time = dict(graph=True, bytes_=nbytes)

    # flashmix: W4A8 (its default with MXFP4 weights; the ratios' reference) and W4A16, on the
    # router's choice; then W4A8 with the router in the call, as flashmix-bench times it.
    layer = dict(k=k, num_experts=E, activation="swiglu_clamped", weights="mxfp4", w1_mx_scales=experts.w1s,
                 w2_mx_scales=experts.w2s)
    outs, fns = {}, {}
    for label, fp8, with_router in (("W4A8", "block", False), ("W4A16", "none", False),
                                    ("W4A8 router", "block", True)):
        out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
        size = flashmix.moe_forward_workspace_size(T, k, H, I, E_local, with_router=with_router, num_experts=E,
                                                   fp8=fp8, weights="mxfp4")
        ws = torch.empty(size, dtype=torch.uint8, device=DEV)
        routing = dict(router_logits=logits, **router) if with_router else dict(token_selected_experts=ids,
                                                                                  token_final_scales=scales)
        fns[label] = lambda out=out, ws=ws, fp8=fp8, routing=routing: flashmix.moe_forward(
            x, experts.w1, experts.w2, fp8=fp8, out=out, workspace=ws, **routing, **layer)
        fns[label]()
        torch.cuda.synchronize()
        outs[label] = out.clone()
    w4a16 = outs["W4A16"]  # the peer's numerics: bf16 activations, the same dequantised weights
    run.reference(op, case, "flashmix W4A8", fns["W4A8"], extra=facts, **time,
                  note="X and FC1's output in e4m3 with 1 x 128 scales; the router's choice given")
    run.reference(op, case, "flashmix W4A16", fns["W4A16"], err=rel_frobenius(w4a16, outs["W4A8"]),
                  tol=TOL_W4A8_FROBENIUS, extra=facts, **time,
                  note="bf16 activations; error: relative Frobenius vs flashmix W4A8")
    run.reference(op, case, "flashmix W4A8 + router", fns["W4A8 router"],
                  err=rel_err(outs["W4A8 router"], outs["W4A8"]), tol=TOL_SAME, extra=facts, **time,
                  note="sqrtsoftplus router on the logits inside the call, as flashmix-bench times the layer")

    # triton_kernels: the layer as an engine runs it (routing maps from the router's choice, FC1 with
    # the gather and its SwiGLU fused, FC2 with the weights, scatter and top-k sum), the same with
    # the maps built once outside the timing, and with DeepSeek-V4's SwiGLU as a kernel of its own.
    act = run.compiled(swiglu_clamped_interleaved)
    act_how = "torch.compile" if act is not None else "torch eager"
    act = act or swiglu_clamped_interleaved
    held = {}

    def make_layer(label, maps_inside, activation):
        def make():
            peer = experts.triton()
            out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
            held[label] = out
            if maps_inside:
                return lambda: peer.forward(x, peer.routing(ids, scales), out, activation=activation)
            fixed = peer.routing(ids, scales)
            return lambda: peer.forward(x, fixed, out, activation=activation)
        return make

    def check_layer(label):
        def check():
            out = held[label]
            held[label + " w4a8"] = rel_frobenius(out, outs["W4A8"])
            return rel_err(out, w4a16)
        return check

    layer_note = ("W4A16 (bf16 activations; Hopper: weights upcast to bf16 in the kernel, bf16 MMAs); %s; "
                  "checked against flashmix W4A16 (max error / max |out|)")
    fused_note = ("FC1's fused SwiGLU is gpt-oss's silu(g') (u' + 1); an up bias of -1 makes it V4's clamped "
                  "SwiGLU wherever -9 <= u <= 10 (up_values_outside_exact_range counts the others)")
    fused = ("triton_kernels W4A16 layer", "triton_kernels W4A16, maps prebuilt")
    for label, maps_inside, activation, note in (
            (fused[0], True, None,
             layer_note % "routing maps built in the call (torch sort + its ragged metadata)" + "; " + fused_note),
            (fused[1], False, None,
             layer_note % "routing maps built once outside the timing" + "; " + fused_note),
            ("triton_kernels W4A16, SwiGLU unfused", True, act,
             layer_note % ("routing maps built in the call; FC1's GEMM alone, its interleaved gate/up rows in bf16, "
                           "then V4's clamped SwiGLU (%s), then FC2" % act_how))):
        rec = run.peer(op, case, label, make_layer(label, maps_inside, activation), check=check_layer(label),
                       tol=TOL_BF16_STEP, repeats=20, note=note, extra=facts, **time)
        if label + " w4a8" in held:
            rec["rel_frobenius_vs_flashmix_w4a8"] = round(held[label + " w4a8"], 5)

    # Each GEMM alone (maps prebuilt; rows in triton_kernels' expert-sorted order), against a
    # per-expert GEMM of the dequantised weights; its bytes are that GEMM's weights only.
    rows = {}

    def make_fc1_rows():
        peer = experts.triton()
        routing = peer.routing(ids, scales)
        rows["fc1"] = torch.empty(T * k, 2 * I, device=DEV, dtype=torch.bfloat16)
        return lambda: peer.fc1(x, routing, activation=False, out=rows["fc1"])

    def check_fc1_rows():
        n = sum(hist)
        got = rows["fc1"][:n]
        up = got[:, 1::2].float()
        held["up_outside"] = int(((up > SWIGLU_LIMIT) | (up < 1 - SWIGLU_LIMIT)).sum())
        return rel_err(got, sorted_rows_reference(x, k, maps, experts.w1_interleaved_bf16))
    run.peer(op, case, "triton_kernels FC1 GEMM only (gather)", make_fc1_rows, check=check_fc1_rows,
             tol=TOL_BF16_STEP, repeats=20, graph=True, bytes_=len(used) * per_gemm["fc1"],
             extra=dict(facts, gemm_weight_bytes=len(used) * per_gemm["fc1"]),
             note="matmul_ogs with the gather, no activation, W1's bytes only; checked against a per-expert GEMM "
             "of the dequantised weights")
    h = torch.randn(T * k, I, device=DEV, dtype=torch.bfloat16)

    def make_fc2_rows():
        peer = experts.triton()
        routing = peer.routing(ids, scales)
        rows["fc2"] = torch.empty(T * k, H, device=DEV, dtype=torch.bfloat16)
        return lambda: peer.fc2_rows(h, routing, out=rows["fc2"])
    run.peer(op, case, "triton_kernels FC2 GEMM only", make_fc2_rows,
             check=lambda: rel_err(rows["fc2"][:sum(hist)], sorted_rows_reference(h, 0, maps, experts.w2_bf16)),
             tol=TOL_BF16_STEP, repeats=20, graph=True, bytes_=len(used) * per_gemm["fc2"],
             extra=dict(facts, gemm_weight_bytes=len(used) * per_gemm["fc2"]),
             note="matmul_ogs on expert-sorted rows, no weights, scatter or sum, W2's bytes only; checked against "
             "a per-expert GEMM of the dequantised weights")
    for rec in run.records:  # the count is known once FC1's rows were checked
        if rec["op"] == op and rec["case"] == case and rec["impl"] in fused and "up_outside" in held:
            rec["up_values_outside_exact_range"] = held["up_outside"]
    rows.clear()
    held.clear()


# ===========================================================================
# mHC: mhc_pre, mhc_post (spec §4)
# ===========================================================================

def mhc_pre_torch(x, phi, alpha, bias, n, eps_norm=1e-6, eps_pre=1e-6, post_mult=2.0, eps_s=1e-6, iters=20):
    B = x.shape[0]
    xf = x.reshape(B, -1).float()
    proj = xf @ phi.t()
    r = torch.sqrt((xf * xf).mean(1, keepdim=True) + eps_norm)
    a = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])
    h = a * proj / r + bias
    h_pre = torch.sigmoid(h[:, :n]) + eps_pre
    h_post = post_mult * torch.sigmoid(h[:, n:2 * n])
    m = torch.softmax(h[:, 2 * n:].reshape(B, n, n), dim=-1) + eps_s
    m = m / (m.sum(1, keepdim=True) + eps_s)
    for _ in range(iters - 1):
        m = m / (m.sum(2, keepdim=True) + eps_s)
        m = m / (m.sum(1, keepdim=True) + eps_s)
    f_pre = (h_pre[..., None] * x.reshape(B, n, -1).float()).sum(1).to(torch.bfloat16)
    return f_pre, h_post, m


def mhc_post_torch(x, f_out, h_post, h_res):
    # res_layout deepseek: X_next[i] = sum_j H_res[j, i] X[j] + H_post[i] F_out
    y = torch.einsum("bji,bjc->bic", h_res, x.float()) + h_post[..., None] * f_out[:, None, :].float()
    return y.to(torch.bfloat16)


def bench_mhc(run, B, n, C):
    decode = B <= 64
    case = ("decode_B%d_n%d_C%d" if decode else "B%d_n%d_C%d") % (B, n, C)
    warm = "_l2_warm" if decode else ""
    N, K = n * n + 2 * n, n * C
    torch.backends.cuda.matmul.allow_tf32 = False  # the spec's fp32 projection
    x = torch.randn(B, n, C, device=DEV, dtype=torch.bfloat16)
    phi = torch.randn(N, K, device=DEV) * (1.0 / K ** 0.5)
    alpha = torch.tensor([0.8, 1.1, 0.9], device=DEV)
    bias = torch.randn(N, device=DEV) * 0.1

    op, pcase = "mhc_pre", case + "_phif32" + warm
    pre_bytes = (B * K + B * C) * 2
    time = dict(graph=decode, bytes_=pre_bytes)
    outs = flashmix.mhc_pre(x, phi, alpha, bias)
    fm = lambda: flashmix.mhc_pre(x, phi, alpha, bias, f_pre=outs.f_pre, h_post=outs.h_post, h_res=outs.h_res)
    fm()
    ref = tuple(t.clone() for t in outs)
    run.reference(op, pcase, "flashmix", fm, **time)
    errs = lambda o: max(rel_err(o[0], ref[0]), rel_err(o[1], ref[1]), rel_err(o[2], ref[2]))
    eager = lambda: mhc_pre_torch(x, phi, alpha, bias, n)
    run.peer(op, pcase, "torch eager", lambda: eager, check=lambda: errs(eager()), tol=TOL_BF16_STEP, **time)
    comp = run.compiled(mhc_pre_torch)
    if comp is not None:
        f = lambda: comp(x, phi, alpha, bias, n)
        run.peer(op, pcase, "torch.compile", lambda: f, check=lambda: errs(f()), tol=TOL_BF16_STEP, repeats=20,
                 **time)

    # DeepGEMM's projection: B rows of K in TF32, as S partial sums over K (S = 16 for small
    # batches, to spread them over SMs, as TokenSpeed calls it; the plain form when the rows
    # alone fill the GPU, as sglang calls it).
    x2d = x.view(B, K)
    held = {}

    def make_hc_prenorm():
        for splits in ((None, 1) if B >= 2048 else (16, None)):
            try:
                fn, d, sqr = adapters.deep_gemm_hc_prenorm(x2d, phi, splits)
                fn()
                torch.cuda.synchronize()
            except Missing:
                raise
            except Exception as e:  # noqa: BLE001 - try the next split count, report the last error
                held["error"] = e
                continue
            held.update(d=d, sqr=sqr, splits=splits)
            return fn
        raise held["error"]

    def check_hc_prenorm():
        xf = x2d.float()
        return max(rel_err(held["d"].sum(0), xf @ phi.t()), rel_err(held["sqr"].sum(0), (xf * xf).sum(1)))
    r = run.peer(op, pcase, "DeepGEMM tf32_hc_prenorm_gemm (part)", make_hc_prenorm, check=check_hc_prenorm,
                 tol=TOL_BF16_STEP, **time,
                 note="projection + sums of squares only (TF32), a part of mhc_pre; checked against torch in fp32")
    if "splits" in held:
        r["splits"] = held["splits"] or 1

    op, case = "mhc_post", case + warm
    f_out = torch.randn(B, C, device=DEV, dtype=torch.bfloat16)
    h_post, h_res = ref[1], ref[2]
    x_next = torch.empty_like(x)
    post_bytes = (2 * B * K + B * C) * 2
    time = dict(graph=decode, bytes_=post_bytes)
    fm = lambda: flashmix.mhc_post(x, f_out, h_post, h_res, x_next=x_next)
    fm()
    ref_post = x_next.clone()
    run.reference(op, case, "flashmix", fm, **time)
    eager = lambda: mhc_post_torch(x, f_out, h_post, h_res)
    run.peer(op, case, "torch eager", lambda: eager, check=lambda: rel_err(eager(), ref_post), tol=TOL_SAME, **time)
    comp = run.compiled(mhc_post_torch)
    if comp is not None:
        f = lambda: comp(x, f_out, h_post, h_res)
        run.peer(op, case, "torch.compile", lambda: f, check=lambda: rel_err(f(), ref_post), tol=TOL_SAME,
                 repeats=20, **time)


# ===========================================================================
# moe_router (spec §8)
# ===========================================================================

def router_torch(logits, k, scoring, renormalize, bias, scale, n_group, topk_group):
    """The spec's router in torch (fp32): ids [T, k] int64 and weights [T, k] fp32."""
    lf = logits.float()
    if scoring == "softmax_after_topk":
        v, ids = lf.topk(k, dim=-1)
        return ids, torch.softmax(v, -1) * scale
    s = torch.softmax(lf, -1) if scoring == "softmax" else torch.sigmoid(lf)
    sel = s + bias if bias is not None else s
    if n_group > 1:
        T, E = sel.shape
        group = sel.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(topk_group, dim=-1)[1], 1.0)
        sel = sel.masked_fill(keep.repeat_interleave(E // n_group, dim=1) == 0, float("-inf"))
    ids = sel.topk(k, dim=-1)[1]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scale


def bench_router(run, case, scoring, E, k, renormalize, with_bias, scale, n_group, topk_group, T=8192):
    """flashmix-bench's router cases (same names; bf16 logits, randn), CUDA-graph replays over sets
    of logits rotated call by call (at least 128 MB of them where 100 calls reach that)."""
    op = "moe_router"
    per_set = T * E * 2
    sets = max(2, min(GRAPH_CALLS, -(-(128 << 20) // per_set)))
    logits = [torch.randn(T, E, device=DEV).to(torch.bfloat16) for _ in range(sets)]
    bias = (torch.randn(E, device=DEV) * 0.1) if with_bias else None
    ids = torch.empty(T, k, device=DEV, dtype=torch.int32)
    w = torch.empty(T, k, device=DEV, dtype=torch.float32)
    turn = [0]

    def rotating(call):
        def fn():
            i = turn[0] % sets
            turn[0] += 1
            return call(logits[i])
        return fn

    # Checks on set 0 against the spec's math in torch: the same experts (compared by their
    # selection values, sorted, so that a tie broken differently still agrees) and the same
    # weights (sorted) within TOL_SAME.
    ref_ids, ref_w = router_torch(logits[0], k, scoring, renormalize, bias, scale, n_group, topk_group)
    lf0 = logits[0].float()
    key0 = lf0 if scoring == "softmax_after_topk" else (
        torch.softmax(lf0, -1) if scoring == "softmax" else torch.sigmoid(lf0)) + (bias if bias is not None else 0)

    def agree(out_ids, out_w):
        # A token may choose differently where two selection values lie within the scorings'
        # approximation (~1e-6 relative) at the k-th place: up to one token in a thousand may.
        same = (key0.gather(1, out_ids.long()).sort(-1)[0] == key0.gather(1, ref_ids).sort(-1)[0]).all(-1)
        if (~same).sum().item() > T // 1000:
            return float("inf")
        return rel_err(out_w.float().sort(-1)[0][same], ref_w.sort(-1)[0][same])

    args = dict(scoring=scoring, renormalize=renormalize, correction_bias=bias, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=scale)
    fm = rotating(lambda lg: flashmix.moe_router(lg, k, token_selected_experts=ids, token_final_scales=w, **args))
    flashmix.moe_router(logits[0], k, token_selected_experts=ids, token_final_scales=w, **args)
    torch.cuda.synchronize()
    fm_err = agree(ids, w)
    time = dict(graph=True, bytes_=per_set, note="%d logit sets rotated call by call" % sets)
    run.reference(op, case, "flashmix", fm, err=fm_err, tol=TOL_SAME, **time)

    eager = rotating(lambda lg: router_torch(lg, k, scoring, renormalize, bias, scale, n_group, topk_group))
    run.peer(op, case, "torch eager", lambda: eager, check=lambda: agree(
        *router_torch(logits[0], k, scoring, renormalize, bias, scale, n_group, topk_group)), **time)
    comp = run.compiled(router_torch)
    if comp is not None:
        f = rotating(lambda lg: comp(lg, k, scoring, renormalize, bias, scale, n_group, topk_group))
        run.peer(op, case, "torch.compile", lambda: f, check=lambda: agree(
            *comp(logits[0], k, scoring, renormalize, bias, scale, n_group, topk_group)), repeats=20, **time)

    # sgl-kernel's topk_softmax: softmax over the E logits, top k, optional renormalising (the
    # weights of gpt-oss's softmax over the k are the renormalised ones: the same top k).
    if scoring in ("softmax", "softmax_after_topk") and scale == 1.0:
        renorm = renormalize or scoring == "softmax_after_topk"
        sw = torch.empty(T, k, device=DEV, dtype=torch.float32)
        si = torch.empty(T, k, device=DEV, dtype=torch.int32)

        def make_sgl():
            ops = adapters.sgl_ops()
            if not adapters.has_torch_op(torch, "sgl_kernel", "topk_softmax"):
                raise Missing("this sgl-kernel build has no topk_softmax")
            return rotating(lambda lg: ops.topk_softmax.default(sw, si, lg, renorm, 0.0, None))

        def check_sgl():
            adapters.sgl_ops().topk_softmax.default(sw, si, logits[0], renorm, 0.0, None)
            torch.cuda.synchronize()
            return agree(si, sw)
        run.peer(op, case, "sgl-kernel topk_softmax", make_sgl, check=check_sgl, repeats=20, **time)
    else:
        mark_not_applicable(run, op, case, "sgl-kernel topk_softmax",
                            "softmax scoring only (sgl-kernel 0.4.5 has no grouped sigmoid top-k: its "
                            "moe_fused_gate moved out of the wheel)")


# ===========================================================================
# Main: the cases, the summary table, the JSON record
# ===========================================================================

FINALIZE_CASES = [  # T, k, H, E, bias
    (8192, 8, 7168, 256, False),
    (8192, 8, 7168, 256, True),
    (8192, 2, 4096, 8, False),
    (16, 8, 7168, 256, False),
    (64, 8, 7168, 256, False),
]
FC2_CASES = [  # name, T, k, E, I, H
    ("deepseek_ep", 1024, 8, 32, 2048, 7168),
    ("mixtral", 4096, 2, 8, 14336, 4096),
    ("qwen3moe", 4096, 8, 128, 768, 2048),
]
MHC_CASES = [(8192, 4, 7168), (16, 4, 7168)]  # B, n, C
ROUTER_CASES = [  # flashmix-bench's names: case, scoring, E, k, renormalize, bias, scale, n_group, topk_group
    ("deepseek_v3_T8192_E256_k8", "sigmoid", 256, 8, True, True, 2.5, 8, 4),
    ("qwen3_T8192_E128_k8", "softmax", 128, 8, True, False, 1.0, 1, 1),
    ("mixtral_T8192_E8_k2", "softmax", 8, 2, True, False, 1.0, 1, 1),
    ("gptoss_T8192_E128_k4", "softmax_after_topk", 128, 4, False, False, 1.0, 1, 1),
]


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(records):
    print("\n%-13s %-36s %-38s %12s %8s %8s  %s" % ("op", "case", "impl", "median", "ratio", "ceiling", "check"))
    for r in records:
        t = "%9.2f us" % r["median_us"] if r["median_us"] is not None else "%12s" % "-"
        ratio = "%7.2fx" % r["ratio"] if "ratio" in r else "%8s" % ""
        ceil = ("%.3f cp" % r["fraction"]) if "fraction" in r else (
            "%.2fx dn" % r["ratio_to_dense"] if "ratio_to_dense" in r else "")
        print("%-13s %-36s %-38s %12s %8s %8s  %s" % (r["op"], r["case"], r["impl"], t, ratio, ceil, r["check"]))
    print("ratio: time / flashmix's on the case (FC2: flashmix atomic); above 1 = flashmix faster. "
          "cp: fraction of the copy rate; dn: x the dense GEMM.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the record to this file, or into this folder as "
                    "peers-<GPU>-<date>-<time>.json (the name bench/results/ uses)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD, if a repo)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--ops", default="finalize,fc2,fc1,fc2_fp8,fc1_fp8,mhc,router,mxfp4",
                    help="comma-separated subset of finalize,fc2,fc1,fc2_fp8,fc1_fp8,mhc,router,mxfp4")
    args = ap.parse_args()
    ops = set(args.ops.split(","))
    torch.manual_seed(0)
    versions = adapters.peer_versions()
    for name, v in versions.items():
        print("peer %-11s %s" % (name, v.get("version", "missing: %s" % v.get("missing"))))
    run = Run(args)
    aborted = None
    try:
        if "finalize" in ops:
            for T, k, H, E, with_bias in FINALIZE_CASES:
                bench_finalize(run, T, k, H, E, with_bias)
        if "mhc" in ops:
            for B, n, C in MHC_CASES:
                bench_mhc(run, B, n, C)
        if "router" in ops:
            for case in ROUTER_CASES:
                bench_router(run, *case)
        if "fc2" in ops:
            for case in FC2_CASES:
                bench_fc2(run, *case)
        if "fc1" in ops:
            for case in FC2_CASES:  # the same routings as FC2's cases
                bench_fc1(run, *case)
        if "fc2_fp8" in ops:
            for case in FC2_CASES:
                bench_fc2_fp8(run, *case)
        if "fc1_fp8" in ops:
            for case in FC2_CASES:
                bench_fc1_fp8(run, *case)
        if "mxfp4" in ops:
            _, _, k, _, E_local, H, I = MXFP4_CASES[0]
            experts = Mxfp4Experts(E_local, H, I, k)  # every case's weights (the same, as in flashmix-bench)
            for case in MXFP4_CASES:
                bench_mxfp4(run, experts, *case)
            del experts
            torch.cuda.empty_cache()
    except Aborted as e:
        aborted = str(e)
        print("ABORTED:", aborted)
    print_table(run.records)
    if args.json:
        doc = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"), "commit": args.commit or git_commit(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "flashmix": getattr(flashmix, "__version__", "unknown"), "peers": versions,
            "tolerances": {"same": TOL_SAME, "bf16_step": TOL_BF16_STEP, "w4a8_frobenius": TOL_W4A8_FROBENIUS},
            "graph_calls": GRAPH_CALLS,
            "copy_gbps": round(run.copy_gbps, 2), "gemm_tflops": round(run.gemm_tflops, 2), "records": run.records}
        if aborted:
            doc["aborted"] = aborted
        path = args.json
        if os.path.isdir(path):  # a folder: the file named as in bench/results/
            now = datetime.datetime.now(datetime.timezone.utc)
            path = os.path.join(path, "peers-%s-%s.json" % (re.sub(r"[^A-Za-z0-9]+", "_", doc["gpu"]).strip("_"),
                                                            now.strftime("%Y%m%d-%H%M%S")))
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", path)
    bad = [r for r in run.records if r["check"].startswith("DISAGREES")]
    return 2 if aborted else 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
