"""The peer libraries bench/peers.py runs beside flashmix: finding and loading
each one, and one small adapter per peer op that maps flashmix's inputs onto
the peer's and returns a callable (no arguments) that runs it.

A peer that is not installed, fails to load, or cannot take a case raises
Missing(reason); bench/peers.py records that as ``missing: <reason>``, never as
a time. Nothing here imports torch at module level, so the loading logic can
be exercised without it (every loader then reports torch as missing).

Peers (what bench/peers_fetch.sh downloads and bench/peers_setup.sh unpacks on
the GPU machine; versions that load under torch 2.11):

- sgl-kernel (``sglang-kernel`` 0.4.5): only its sm_90 ops library
  ``sgl_kernel/sm90/common_ops.abi3.so``, found on ``sys.path`` (or at
  ``$FLASHMIX_PEERS_SGL_OPS``) and loaded alone; its ops are then
  ``torch.ops.sgl_kernel.*``. Used here:
    apply_shuffle_mul_sum(input [M, H], output [T, H], permutation int32 [T*k],
        factors [T*k] of output's dtype or None):
        ``output[t] = sum_j factors[t*k + j] * input[permutation[t*k + j]]``,
        fp32 sums, one rounding at the end; no bias. With flashmix's
        ``unpermuted_row_to_permuted_row`` (index ``j*T + t``) the permutation is
        its token-major transpose, and factors are the router weights in bf16.
    moe_sum_reduce(input [T, k, H], output [T, H], routed_scaling_factor):
        ``output[t] = factor * sum_j input[t, j]``: no gather and no weights (an
        engine that scatters and weights in the GEMM's epilogue leaves only
        this); fed here the rows already gathered into token order and
        weighted, outside the timing.
- DeepGEMM (``tokenspeed-deepgemm`` 2.5.0.post20260604, module ``deep_gemm``):
    m_grouped_bf16_gemm_nt_contiguous(a [M_pad, K], b [E, N, K], d [M_pad, N],
        m_indices int32 [M_pad]): every expert's rows padded to
        ``get_mk_alignment_for_contiguous_layout()`` rows, m_indices the expert
        of each row, -1 on padding. JIT-compiles per shape with the machine's
        nvcc (seconds): warm up before timing.
    tf32_hc_prenorm_gemm(a bf16 [B, K], b fp32 [N, K], d fp32 [S, B, N],
        sqr_sum fp32 [S, B], num_splits=S): the mHC projection (TF32) and the
        row sums of squares, as S partial sums; a part of mhc_pre only.
- triton_kernels (OpenAI's, the copy inside ``sglang-kernel`` 0.4.5; pure Python
  + Triton, imported from ``sys.path``): the MoE GEMM ``matmul_ogs`` as vLLM
  and SGLang run gpt-oss's MXFP4 experts on Hopper. What this generation of it
  does there (read from its source; TritonMxfp4Moe below drives it):
    weights: e2m1 bytes and ue8m0 scales, K along the packed axis, viewed
        ``[E, K/2, N]`` / ``[E, K/32, N]`` (flashmix's ``[E, N, K/2]``
        transposed, no copy) and converted once into its Hopper layouts
        (``HopperMXValueLayout``: bytes shuffled for the wgmma operand order and
        their bits re-packed so that one shift-and-mask gives bf16;
        ``HopperMXScaleLayout`` for num_warps 8, which fixes the kernel's
        block_n at 256). The kernel upcasts each weight tile to bf16 (e2m1 x
        2^(scale - 127), exact) and runs bf16 MMAs; with these layouts the
        activations must be bf16 (W4A16; the kernel asserts it). FP8 activations
        would need the plain strided layout, where tl.dot_scaled is emulated on
        Hopper (both operands upcast to bf16): not what engines run there. Not
        persistent, no TMA for MXFP4 on Hopper; block_k 128, block_m 16..64 from
        the rows per expert.
    routing: RoutingData(gate_scal, expt_hist, n_expts_tot, n_expts_act,
        expt_data=RaggedTensorMetadata from make_ragged_tensor_metadata),
        GatherIndx(src_indx: sorted row -> slot t*k + j, dst_indx: its inverse),
        ScatterIndx(src_indx: slot -> sorted row or -1 for a slot this rank does
        not hold, dst_indx: sorted row -> slot); built here from the router's
        ids and weights with torch ops (triton_routing_indices).
    FC1: gather fused (row slot // k of X); a fused activation: its SwiGLU is
        gpt-oss's ``g' sigmoid(alpha g') (u' + 1)`` on interleaved gate/up
        columns, g' = min(g, limit), u' = clamp(u, -limit, limit); bias added
        before it (fp32 ``[E, 2I]``).
    FC2: gammas (the router weights, per sorted row) multiply the rows in the
        epilogue; the scatter writes each slot's row (rounded to bf16) into a
        ``[T*k, N]`` scratch, then its ``reduce`` kernel sums a token's k rows
        (slots with src_indx -1 masked) into ``[T, N]``.
"""
import ctypes
import glob
import importlib.util
import os
import re
import sys
import types


class Missing(Exception):
    """A peer (or one of its ops) is absent or cannot run; str(e) says why."""


def _torch():
    try:
        import torch
    except ImportError as e:
        raise Missing("torch is not importable (%s)" % e) from None
    return torch


def _first_line(e):
    text = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, text[0] if text else "")


# ---------------------------------------------------------------------------
# Loading. Each loader runs once; its result (or its Missing) is kept.
# ---------------------------------------------------------------------------

_cache = {}


def _once(name, loader):
    if name not in _cache:
        try:
            _cache[name] = loader()
        except Missing as e:
            _cache[name] = e
        except Exception as e:  # noqa: BLE001 - a peer that fails to load is missing, with why
            _cache[name] = Missing("failed to load: " + _first_line(e))
    result = _cache[name]
    if isinstance(result, Missing):
        raise result
    return result


def _search_path(relative):
    """The first sys.path entry holding `relative` (a glob), or None."""
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry or ".", relative)))
        if hits:
            return hits[0]
    return None


def _cuda_library_dirs():
    """Where the CUDA libraries a wheel was linked against may be: the nvidia-* wheels torch
    depends on, then the toolkit."""
    dirs = []
    for entry in sys.path:
        dirs += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs += [os.path.join(home, "lib64"), os.path.join(home, "targets", "x86_64-linux", "lib")]
    return [d for d in dirs if os.path.isdir(d)]


def _load_shared_object(path, load):
    """load(path), preloading (RTLD_GLOBAL) each CUDA library the dynamic loader reports it cannot
    find (e.g. libnvrtc.so.13 when torch did not load it) from _cuda_library_dirs()."""
    tried = set()
    while True:
        try:
            return load(path)
        except (OSError, ImportError) as e:
            m = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file",
                          " ".join(str(x) for x in (e, e.__cause__, e.__context__) if x is not None))
            if not m or m.group(1) in tried:
                raise
            name = m.group(1)
            tried.add(name)
            for d in _cuda_library_dirs():
                if os.path.exists(os.path.join(d, name)):
                    ctypes.CDLL(os.path.join(d, name), mode=ctypes.RTLD_GLOBAL)
                    break
            else:
                raise


def has_torch_op(torch, namespace, name):
    """Whether torch.ops.<namespace>.<name> is registered."""
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


SGL_OPS = "sgl_kernel/sm90/common_ops*.so"


def _load_sgl():
    torch = _torch()
    info = {}
    if not has_torch_op(torch, "sgl_kernel", "apply_shuffle_mul_sum"):
        path = os.environ.get("FLASHMIX_PEERS_SGL_OPS") or _search_path(SGL_OPS)
        if not path:
            raise Missing("%s not found on sys.path (bench/peers_setup.sh unpacks it)" % SGL_OPS)
        if not torch.cuda.is_available():
            raise Missing("no CUDA device")
        cc = torch.cuda.get_device_capability()
        if cc != (9, 0):
            raise Missing("this is the sm_90 build of sgl-kernel's ops; the GPU is sm_%d%d" % cc)

        def load(p):
            # As the package loads it: a Python extension module whose import registers the ops.
            spec = importlib.util.spec_from_file_location("common_ops", p)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        try:
            _load_shared_object(path, load)
        except Exception as first:  # noqa: BLE001 - a plain dlopen registers the ops as well
            try:
                _load_shared_object(path, torch.ops.load_library)
            except Exception:  # noqa: BLE001 - report the first, more direct, error
                raise Missing("failed to load %s: %s" % (path, _first_line(first))) from None
        info["from"] = path
        version_file = os.path.join(os.path.dirname(os.path.dirname(path)), "version.py")
        if os.path.exists(version_file):
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", open(version_file).read())
            if m:
                info["version"] = m.group(1)
    else:
        info["from"] = "already registered in torch.ops.sgl_kernel"
        version = getattr(sys.modules.get("sgl_kernel"), "__version__", None)
        if version:
            info["version"] = version
    for op in ("apply_shuffle_mul_sum", "moe_sum_reduce"):
        if not has_torch_op(torch, "sgl_kernel", op):
            raise Missing("loaded, but torch.ops.sgl_kernel.%s is not registered" % op)
    return torch.ops.sgl_kernel, info


def _load_deep_gemm():
    torch = _torch()
    if not torch.cuda.is_available():
        raise Missing("no CUDA device")
    try:
        import deep_gemm
    except ImportError as e:
        raise Missing("deep_gemm is not importable (%s)" % _first_line(e)) from None
    for op in ("m_grouped_bf16_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"):
        if not hasattr(deep_gemm, op):
            raise Missing("deep_gemm %s has no %s" % (getattr(deep_gemm, "__version__", "?"), op))
    return deep_gemm, {"version": getattr(deep_gemm, "__version__", "unknown"),
                       "from": os.path.dirname(deep_gemm.__file__)}


# What this adapter uses of triton_kernels, by module: an older or newer generation (routing.py
# with ExptData; matmul instead of matmul_ogs) lacks some of these and is reported as missing.
TRITON_KERNELS_API = {
    "matmul_ogs": ("matmul_ogs", "PrecisionConfig", "FlexCtx", "FnSpecs", "FusedActivation", "RoutingData",
                   "GatherIndx", "ScatterIndx"),
    "tensor": ("FP4", "convert_layout", "wrap_torch_tensor", "make_ragged_tensor_metadata"),
    "tensor_details.layout": ("make_default_matmul_mxfp4_w_layout", "make_default_matmul_mxfp4_w_scale_layout"),
    "numerics": ("InFlexData",),
    "swiglu": ("swiglu_fn",),
}


def _load_triton_kernels():
    torch = _torch()
    if not torch.cuda.is_available():
        raise Missing("no CUDA device")
    cc = torch.cuda.get_device_capability()
    if cc < (9, 0):
        raise Missing("triton_kernels' MXFP4 matmul needs sm_90 or newer; the GPU is sm_%d%d" % cc)
    try:
        import triton
    except ImportError as e:
        raise Missing("triton is not importable (%s)" % _first_line(e)) from None
    if importlib.util.find_spec("triton_kernels") is None:
        raise Missing("triton_kernels not found on sys.path (bench/peers_setup.sh unpacks it)")
    ns = types.SimpleNamespace()
    for module, names in TRITON_KERNELS_API.items():
        m = importlib.import_module("triton_kernels." + module)  # an import error: "failed to load: ..."
        for name in names:
            if not hasattr(m, name):
                raise Missing("this triton_kernels has no %s.%s (another generation of its API)" % (module, name))
            setattr(ns, name, getattr(m, name))
    path = os.path.dirname(importlib.import_module("triton_kernels").__file__)
    source = os.path.join(path, "PEER_SOURCE")
    info = {"from": path, "triton": triton.__version__,
            "version": open(source).read().strip() if os.path.exists(source) else "unknown"}
    return ns, info


def triton_kernels():
    """triton_kernels' pieces this adapter uses (TRITON_KERNELS_API) as one namespace; raises Missing."""
    return _once("triton_kernels", _load_triton_kernels)[0]


def sgl_ops():
    """torch.ops.sgl_kernel, with apply_shuffle_mul_sum and moe_sum_reduce; raises Missing."""
    return _once("sgl-kernel", _load_sgl)[0]


def deep_gemm_module():
    """The deep_gemm module; raises Missing."""
    return _once("deep_gemm", _load_deep_gemm)[0]


def peer_versions():
    """{peer: {"version", "from"} or {"missing": reason}} for every peer (loading each once)."""
    out = {}
    for name, loader in (("sgl-kernel", _load_sgl), ("deep_gemm", _load_deep_gemm),
                         ("triton_kernels", _load_triton_kernels)):
        try:
            out[name] = dict(_once(name, loader)[1])
        except Missing as e:
            out[name] = {"missing": str(e)}
    try:
        import triton
        out["triton"] = {"version": triton.__version__}
    except ImportError as e:
        out["triton"] = {"missing": str(e)}
    return out


# ---------------------------------------------------------------------------
# Index maps: flashmix's routing onto each peer's layout (plain torch).
# ---------------------------------------------------------------------------

def token_major(u2p, T, k):
    """flashmix's unpermuted_row_to_permuted_row (index ``j*T + t``) as a token-major int32 map
    (index ``t*k + j``): sgl's ``permutation``."""
    return u2p[:T * k].view(k, T).t().contiguous().view(-1).int()


def contiguous_layout(offsets, num_rows, alignment):
    """DeepGEMM's contiguous layout of flashmix's expert-sorted rows: each expert's rows start at a
    multiple of `alignment`. `offsets` is expert_first_token_offset (``[E + 1]``, any device).
    Returns (dest, m_indices, padded_rows): dest int64 ``[num_rows]`` the padded row of each
    permuted row, m_indices int32 ``[padded_rows]`` (expert per row, -1 on padding)."""
    torch = _torch()
    offs = offsets.detach().to("cpu", torch.int64)
    counts = offs[1:] - offs[:-1]
    padded = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(padded, 0) - padded
    padded_rows = int(padded.sum())
    experts = torch.repeat_interleave(torch.arange(len(counts)), counts)
    dest = starts[experts] + torch.arange(num_rows) - offs[:-1][experts]
    m_indices = torch.full((padded_rows,), -1, dtype=torch.int32)
    m_indices[dest] = experts.int()
    return dest.to(offsets.device), m_indices.to(offsets.device), padded_rows


# ---------------------------------------------------------------------------
# Adapters: each returns a callable with no arguments (writing into `out`).
# ---------------------------------------------------------------------------

def sgl_shuffle_mul_sum_into(u2p, scales, out):
    """sgl's gather + weight + top-k sum (the finalize without bias) as ``f(rows)`` writing `out`
    ``[T, H]``: rows ``[M, H]`` contiguous, of out's width and dtype; u2p is flashmix's
    unpermuted_row_to_permuted_row into those rows, scales fp32 ``[T, k]`` (given to sgl in out's
    dtype, as it requires)."""
    ops = sgl_ops()
    T, k = scales.shape
    perm = token_major(u2p, T, k)
    factors = scales.to(out.dtype).contiguous().view(-1)
    op = ops.apply_shuffle_mul_sum.default

    def finalize(rows):
        return op(rows, out, perm, factors)
    return finalize


def sgl_apply_shuffle_mul_sum(rows, u2p, scales, out):
    """sgl_shuffle_mul_sum_into on fixed rows: a callable with no arguments."""
    if not rows.is_contiguous() or rows.shape[1] != out.shape[1] or rows.dtype != out.dtype:
        raise Missing("apply_shuffle_mul_sum takes contiguous rows of the output's width and dtype")
    finalize = sgl_shuffle_mul_sum_into(u2p, scales, out)
    return lambda: finalize(rows)


def sgl_moe_sum_reduce(rows_token_major, out):
    """sgl's unweighted top-k sum: rows_token_major ``[T, k, H]`` contiguous -> out ``[T, H]``."""
    ops = sgl_ops()
    op = ops.moe_sum_reduce.default
    return lambda: op(rows_token_major, out, 1.0)


def deep_gemm_layout(A, offsets, num_rows):
    """A's first num_rows (expert-sorted) rows in DeepGEMM's contiguous layout: a dict with
    a_padded ``[M_pad, K]`` (zeros on padding), m_indices, dest (padded row of each row),
    padded_rows, alignment, padded_fraction = padding rows / M_pad."""
    torch = _torch()
    dg = deep_gemm_module()
    alignment = int(dg.get_mk_alignment_for_contiguous_layout())
    dest, m_indices, padded_rows = contiguous_layout(offsets, num_rows, alignment)
    a_padded = torch.zeros(padded_rows, A.shape[1], dtype=A.dtype, device=A.device)
    a_padded[dest] = A[:num_rows]
    return {"a_padded": a_padded, "m_indices": m_indices, "dest": dest, "padded_rows": padded_rows,
            "alignment": alignment, "padded_fraction": (padded_rows - num_rows) / max(1, padded_rows)}


def deep_gemm_m_grouped(layout, W2):
    """DeepGEMM's bf16 m-grouped contiguous GEMM ``d = a_padded @ W2[e]^T`` (W2 ``[E, N, K]``).
    Returns (callable, d ``[M_pad, N]``)."""
    torch = _torch()
    dg = deep_gemm_module()
    a, m_indices = layout["a_padded"], layout["m_indices"]
    d = torch.empty(a.shape[0], W2.shape[1], dtype=torch.bfloat16, device=a.device)
    gemm = dg.m_grouped_bf16_gemm_nt_contiguous
    return (lambda: gemm(a, W2, d, m_indices)), d


def deep_gemm_fp8_layout(Aq, a_scales, offsets, num_rows):
    """deep_gemm_layout for e4m3 rows with their 1 x 128 float32 scales (``[rows, K/128]``): a dict
    with a_padded (zeros on padding), sa_padded (ones on padding, MN-major: stride ``(1, M_pad)``,
    the layout DeepGEMM's kernel reads, so it needs no transpose per call), m_indices, dest,
    padded_rows, alignment, padded_fraction."""
    torch = _torch()
    dg = deep_gemm_module()
    alignment = int(dg.get_mk_alignment_for_contiguous_layout())
    dest, m_indices, padded_rows = contiguous_layout(offsets, num_rows, alignment)
    a_padded = torch.zeros(padded_rows, Aq.shape[1], dtype=torch.float8_e4m3fn, device=Aq.device)
    a_padded[dest] = Aq[:num_rows].view(torch.float8_e4m3fn)
    sa = torch.ones(a_scales.shape[1], padded_rows, dtype=torch.float32, device=Aq.device).t()
    sa[dest] = a_scales[:num_rows].float()
    return {"a_padded": a_padded, "sa_padded": sa, "m_indices": m_indices, "dest": dest,
            "padded_rows": padded_rows, "alignment": alignment,
            "padded_fraction": (padded_rows - num_rows) / max(1, padded_rows)}


def deep_gemm_m_grouped_fp8(layout, Wq, w_scales):
    """DeepGEMM's block-scaled FP8 m-grouped contiguous GEMM ``d = a_padded @ Wq[e]^T`` (Wq e4m3
    ``[E, N, K]`` with float32 128 x 128 scales ``[E, N/128, K/128]``), bf16 out. Returns
    (callable, d ``[M_pad, N]``)."""
    torch = _torch()
    dg = deep_gemm_module()
    if not hasattr(dg, "m_grouped_fp8_gemm_nt_contiguous"):
        raise Missing("deep_gemm %s has no m_grouped_fp8_gemm_nt_contiguous" % getattr(dg, "__version__", "?"))
    a, sa, m_indices = layout["a_padded"], layout["sa_padded"], layout["m_indices"]
    b = (Wq.view(torch.float8_e4m3fn), w_scales.float())
    d = torch.empty(a.shape[0], Wq.shape[1], dtype=torch.bfloat16, device=a.device)
    gemm = dg.m_grouped_fp8_gemm_nt_contiguous
    return (lambda: gemm((a, sa), b, d, m_indices, disable_ue8m0_cast=True)), d


def deep_gemm_hc_prenorm(x2d, phi, splits):
    """DeepGEMM's mHC projection: ``x2d @ phi^T`` (TF32) and the row sums of squares, as `splits`
    partial sums over slices of K (None: the plain form, one [B, N] / [B] output). Returns
    (callable, d ``[S, B, N]``, sqr_sum ``[S, B]``), S = 1 for None: their sums over dim 0 are the
    projection and the sums of squares."""
    torch = _torch()
    dg = deep_gemm_module()
    if not hasattr(dg, "tf32_hc_prenorm_gemm"):
        raise Missing("deep_gemm %s has no tf32_hc_prenorm_gemm" % getattr(dg, "__version__", "?"))
    B, N = x2d.shape[0], phi.shape[0]
    d = torch.empty(splits or 1, B, N, dtype=torch.float32, device=x2d.device)
    sqr = torch.empty(splits or 1, B, dtype=torch.float32, device=x2d.device)
    phi = phi.float().contiguous()
    op = dg.tf32_hc_prenorm_gemm
    if splits is None:
        d2, sqr1 = d[0], sqr[0]
        return (lambda: op(x2d, phi, d2, sqr1, num_splits=None)), d, sqr
    return (lambda: op(x2d, phi, d, sqr, num_splits=splits)), d, sqr


# ---------------------------------------------------------------------------
# triton_kernels: the MXFP4 expert layer on matmul_ogs
# ---------------------------------------------------------------------------

def triton_routing_indices(ids, scales, start_expert_id, num_local_experts):
    """triton_kernels' routing maps for this rank's experts from the router's global ids (int
    ``[T, k]``) and weights (float ``[T, k]``), in plain torch with no host sync (CUDA-graph
    capturable), as an engine builds them from a router's top-k. Slots (index ``t*k + j``) are
    sorted by local expert, stably; the slots of experts this rank does not hold sort last and are
    dropped. Returns a dict of
      order       int32 ``[T*k]``: sorted row -> slot (GatherIndx.src_indx, ScatterIndx.dst_indx)
      row_of      int32 ``[T*k]``: slot -> sorted row (GatherIndx.dst_indx)
      row_or_drop int32 ``[T*k]``: row_of, -1 for a dropped slot (ScatterIndx.src_indx)
      hist        int32 ``[E_local]``: slots per local expert (the ragged slices' sizes)
      gate        float32 ``[T*k]``: the router weight of each sorted row (FC2's gammas)."""
    torch = _torch()
    slots = ids.numel()
    local = ids.reshape(-1).long() - start_expert_id
    held = (local >= 0) & (local < num_local_experts)
    key = torch.where(held, local, torch.full_like(local, num_local_experts))
    order = torch.sort(key, stable=True).indices
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=ids.device))
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return {"order": order.int(), "row_of": row_of.int(),
            "row_or_drop": torch.where(held, row_of, torch.full_like(row_of, -1)).int(),
            "hist": counts[:num_local_experts], "gate": scales.reshape(-1).float()[order]}


class TritonMxfp4Moe:
    """triton_kernels' MXFP4 expert layer over this rank's experts, as vLLM and SGLang drive
    matmul_ogs for gpt-oss on Hopper: bf16 activations, weights in its Hopper layouts.

    Built from flashmix's stacks (spec §13.1) with W1 in the interleaved gate/up order (the order
    its fused SwiGLU reads): w1 ``[E, 2I, H/2]`` e2m1 bytes with w1_scales ``[E, 2I, H/32]`` ue8m0,
    w2 ``[E, H, I/2]`` with w2_scales ``[E, H, I/32]`` (uint8 or the torch fp4 / e8m0 dtypes). The
    conversion into its layouts runs here, once (outside any timing; it needs a few GB of
    temporaries). k: experts per token; limit: the SwiGLU clamp (DeepSeek-V4: 10); num_warps: the
    kernel's, which the scale layout is made for (8, as vLLM and SGLang make it on Hopper).

    Its fused activation is gpt-oss's ``silu(g') (u' + 1)``. FC1 here adds a bias of -1 to the up
    columns before it, so that it computes ``silu(min(g, L)) clamp(u, 1 - L, 1 + L)``: DeepSeek-V4's
    ``silu(min(g, L)) clamp(u, -L, L)`` wherever ``1 - L <= u <= L`` (the outputs' check shows
    whether a clamp fired). The unfused form (``forward(..., activation=f)``) runs FC1's GEMM alone
    and ``f`` on its interleaved ``[T*k, 2I]`` rows."""

    def __init__(self, w1, w1_scales, w2, w2_scales, *, k, limit=10.0, num_warps=8):
        torch = _torch()
        self.tk = tk = triton_kernels()
        self.k, self.limit = k, limit
        self.num_local_experts, two_i = int(w1.shape[0]), int(w1.shape[1])
        self.w1, self.pc1 = self._operand(w1, w1_scales, num_warps)
        self.w2, self.pc2 = self._operand(w2, w2_scales, num_warps)
        self.up_shift = torch.zeros(self.num_local_experts, two_i, dtype=torch.float32, device=w1.device)
        self.up_shift[:, 1::2] = -1.0
        self.swiglu = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                         (1.0, float(limit)))

    def _operand(self, w, scales, num_warps):
        """(weight, PrecisionConfig) in the default MXFP4 layouts of this GPU (Hopper: HopperMXValueLayout,
        HopperMXScaleLayout), K along axis 1 of the ``[E, K/2, N]`` view."""
        torch, tk = _torch(), self.tk
        value_layout, value_opts = tk.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = tk.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
        value = tk.convert_layout(tk.wrap_torch_tensor(w.view(torch.uint8).transpose(-2, -1), dtype=tk.FP4),
                                  value_layout, **value_opts)
        scale = tk.convert_layout(tk.wrap_torch_tensor(scales.view(torch.uint8).transpose(-2, -1)),
                                  scale_layout, **scale_opts)
        return value, tk.PrecisionConfig(weight_scale=scale, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()))

    def routing(self, ids, scales, start_expert_id=0):
        """(RoutingData, GatherIndx, ScatterIndx) from the router's global ids and weights (torch ops and
        make_ragged_tensor_metadata's two kernels: capturable)."""
        tk = self.tk
        maps = triton_routing_indices(ids, scales, start_expert_id, self.num_local_experts)
        meta = tk.make_ragged_tensor_metadata(maps["hist"], ids.numel())
        data = tk.RoutingData(maps["gate"], maps["hist"], self.num_local_experts, self.k, expt_data=meta)
        return data, tk.GatherIndx(maps["order"], maps["row_of"]), tk.ScatterIndx(maps["row_or_drop"], maps["order"])

    def fc1(self, x, routing, *, activation=True, out=None):
        """FC1 with the gather fused, rows in the sorted order (rows past the held slots are not
        written): ``[T*k, I]`` with the fused activation, ``[T*k, 2I]`` (interleaved gate/up) without."""
        data, gather, _ = routing
        if activation:
            return self.tk.matmul_ogs(x, self.w1, self.up_shift, data, gather_indx=gather, precision_config=self.pc1,
                                      fused_activation=self.swiglu, y=out)
        return self.tk.matmul_ogs(x, self.w1, None, data, gather_indx=gather, precision_config=self.pc1, y=out)

    def fc2(self, h, routing, out=None):
        """FC2 with the router weights, the scatter and the top-k sum: h ``[T*k, I]`` in the sorted
        order -> out bf16 ``[T, H]`` (tokens without a held slot: 0)."""
        data, _, scatter = routing
        return self.tk.matmul_ogs(h, self.w2, None, data, scatter_indx=scatter, precision_config=self.pc2,
                                  gammas=data.gate_scal, y=out)

    def fc2_rows(self, h, routing, out=None):
        """FC2's GEMM alone: ``h[r] @ W2[e(r)]^T`` per sorted row, ``[T*k, H]``, no weights, no scatter."""
        return self.tk.matmul_ogs(h, self.w2, None, routing[0], precision_config=self.pc2, y=out)

    def forward(self, x, routing, out, activation=None):
        """The layer into out ``[T, H]``: FC1 (the fused activation when activation is None, else FC1's
        GEMM then ``activation(rows [T*k, 2I]) -> [T*k, I]``), then FC2."""
        h = self.fc1(x, routing) if activation is None else activation(self.fc1(x, routing, activation=False))
        return self.fc2(h, routing, out)


# ---------------------------------------------------------------------------
# A CPU self-check of the index maps against the peers' documented semantics
# (python3 bench/peers_adapters.py; needs torch, no GPU, no peer).
# ---------------------------------------------------------------------------

def _selftest():
    torch = _torch()
    g = torch.Generator().manual_seed(1)
    for T, k, E, H, alignment in ((5, 2, 4, 8, 4), (37, 8, 16, 24, 8), (3, 4, 32, 16, 128)):
        experts = torch.rand(T, E, generator=g).topk(k, dim=1).indices
        scales = torch.rand(T, k, generator=g).bfloat16().float()
        # expert-sorted (stable) permutation: flashmix's maps
        slot_expert = experts.t().reshape(-1)  # index j*T + t
        p2u = torch.sort(slot_expert, stable=True).indices
        u2p = torch.empty_like(p2u)
        u2p[p2u] = torch.arange(T * k)
        offsets = torch.zeros(E + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.bincount(slot_expert, minlength=E), 0)
        rows = torch.randn(T * k, H, generator=g)
        want = (rows[u2p.view(k, T).t()] * scales[..., None]).sum(1)  # spec §2 without bias
        # apply_shuffle_mul_sum as documented
        perm, factors = token_major(u2p, T, k).long(), scales.reshape(-1)
        got = (rows[perm] * factors[:, None]).view(T, k, H).sum(1)
        assert torch.allclose(got, want, atol=1e-5), "token_major"
        # DeepGEMM's contiguous layout: every row lands in its expert's padded block
        dest, m_indices, padded_rows = contiguous_layout(offsets, T * k, alignment)
        assert padded_rows % alignment == 0 and len(set(dest.tolist())) == T * k
        e_of_row = torch.searchsorted(offsets[1:], torch.arange(T * k), right=True)
        assert torch.equal(m_indices[dest].long(), e_of_row), "m_indices"
        assert int((m_indices >= 0).sum()) == T * k
        starts = torch.nonzero(torch.diff(m_indices.long(), prepend=torch.tensor([-2]))).view(-1)
        assert all(int(s) % alignment == 0 for s in starts if m_indices[s] >= 0), "alignment"
        padded = torch.zeros(padded_rows, H)
        padded[dest] = rows
        got = (padded[dest[perm]] * factors[:, None]).view(T, k, H).sum(1)
        assert torch.allclose(got, want, atol=1e-5), "padded finalize"
    # triton_kernels' routing maps, with a rank holding experts [start, start + E_local) of E:
    # matmul_ogs' gather, ragged slices, gammas, scatter and masked top-k sum (as its source
    # reads them) give the spec §2 sum over the held slots.
    for T, k, E, E_local, start, H in ((5, 2, 4, 4, 0, 8), (37, 6, 256, 32, 0, 16), (16, 6, 64, 8, 24, 8)):
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.int()
        scales = torch.rand(T, k, generator=g)
        m = triton_routing_indices(ids, scales, start, E_local)
        local = ids.reshape(-1).long() - start
        held = (local >= 0) & (local < E_local)
        n = int(held.sum())
        order, hist = m["order"].long(), m["hist"].long()
        assert m["hist"].dtype == torch.int32 and int(hist.sum()) == n, "slice sizes"
        assert torch.equal(local[order[:n]], torch.repeat_interleave(torch.arange(E_local), hist)), "slices"
        assert torch.equal(m["row_of"].long()[order], torch.arange(T * k)), "row_of inverts order"
        assert torch.equal(m["row_or_drop"].long() >= 0, held), "dropped slots"
        rows = torch.randn(T * k, H, generator=g)  # FC2's output row of each slot, by slot
        sorted_rows = rows[order] * m["gate"][:, None]  # the epilogue's gammas, per sorted row
        scratch = torch.full((T * k, H), float("nan"))
        scratch[order[:n]] = sorted_rows[:n]  # the scatter: only the held rows are written
        mask = (m["row_or_drop"] != -1).view(T, k, 1)
        got = torch.where(mask, scratch.view(T, k, H), torch.zeros(())).sum(1)
        want = ((rows * held[:, None]).view(T, k, H) * scales[..., None]).sum(1)
        assert torch.allclose(got, want, atol=1e-5), "triton_kernels scatter + reduce"
    print("peers_adapters self-check: token-major permutation and contiguous layout agree with spec §2; "
          "triton_kernels' routing maps give the spec §2 sum over a rank's held slots")
    print(peer_versions())


if __name__ == "__main__":
    _selftest()
