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
"""
import ctypes
import glob
import importlib.util
import os
import re
import sys


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


def _has_torch_op(torch, namespace, name):
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


SGL_OPS = "sgl_kernel/sm90/common_ops*.so"


def _load_sgl():
    torch = _torch()
    info = {}
    if not _has_torch_op(torch, "sgl_kernel", "apply_shuffle_mul_sum"):
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
        if not _has_torch_op(torch, "sgl_kernel", op):
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


def sgl_ops():
    """torch.ops.sgl_kernel, with apply_shuffle_mul_sum and moe_sum_reduce; raises Missing."""
    return _once("sgl-kernel", _load_sgl)[0]


def deep_gemm_module():
    """The deep_gemm module; raises Missing."""
    return _once("deep_gemm", _load_deep_gemm)[0]


def peer_versions():
    """{peer: {"version", "from"} or {"missing": reason}} for every peer (loading each once)."""
    out = {}
    for name, loader in (("sgl-kernel", _load_sgl), ("deep_gemm", _load_deep_gemm)):
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
    print("peers_adapters self-check: token-major permutation and contiguous layout agree with spec §2")
    print(peer_versions())


if __name__ == "__main__":
    _selftest()
