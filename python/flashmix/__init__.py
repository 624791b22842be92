"""flashmix: fused GPU kernels for the end of a Mixture-of-Experts layer and
for DeepSeek's mHC hyper-connections (the math: SPEC.md; this package:
python/README.md).

Every function takes torch tensors (CUDA or CPU) or numpy arrays (CPU). The
arrays decide the backend: all on one CUDA device -> the fused kernels,
asynchronous on a CUDA stream; all on the CPU -> the reference backend
(double accumulation), synchronous. Outputs the caller does not pass are
allocated like the inputs (``torch.empty`` on the input's device, or
``numpy.empty``) and returned. Nothing is copied implicitly: an array with the
wrong dtype or layout raises ``ValueError`` naming the argument, as does any
argument the library rejects (its message: ``"<op>: <argument>: <rule>"``).
A request this build or GPU cannot serve raises ``NotImplementedError`` (a
``RuntimeError``); a CUDA error, ``RuntimeError``.

Streams: ``stream=None`` means the current torch stream of the tensors'
device (``torch.cuda.current_stream(device).cuda_stream``), or the legacy
default stream 0 without torch. Pass a ``torch.cuda.Stream`` or a raw
``cudaStream_t`` as an int to choose another. Nothing synchronises the stream
and no device memory is read on the host, so every call can be captured in a
CUDA graph; workspaces are allocated with ``torch.empty(uint8)`` (inside a
capture, from the graph's pool).

bfloat16 on the CPU without torch: numpy arrays of ``ml_dtypes.bfloat16``.

torch.compile: when torch is importable, ``torch.ops.flashmix.build_moe_routing_maps``,
``finalize_moe_routing``, ``moe_fc2_finalize``, ``mhc_expand``, ``mhc_pre``,
``mhc_pre_with_workspace`` (mhc_pre with the small-batch workspace), ``mhc_post``
and ``mhc_head`` are registered as custom ops with shape
functions; call those inside compiled code (the functions here call the
binding directly, which is cheaper in eager mode but a graph break under
torch.compile).
"""
import collections
import pkgutil

# The compiled module may live in a build tree beside this source package
# (PYTHONPATH=<build>/python:<source>/python): look for flashmix/ there too.
__path__ = pkgutil.extend_path(__path__, __name__)

# torch first, when it is there: the process then runs on torch's CUDA runtime
# (one libcudart.so.<major> per process, whichever loads first), which torch
# needs and which serves flashmix as long as it is not older than the toolkit
# flashmix was built with.
try:
    import torch as _torch
except ImportError:
    _torch = None

try:
    from . import _C
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "flashmix._C is not built or not on the path: configure with -DFLASHMIX_PYTHON=ON, build the "
        "flashmix_python target and put <build>/python on PYTHONPATH (python/README.md)") from e

__version__ = _C.__version__
MHC_MAX_STREAMS = _C.MHC_MAX_STREAMS
FC2_MODES = _C.FC2_MODES
mhc_num_coefficients = _C.mhc_num_coefficients
build_moe_routing_maps_workspace_size = _C.build_moe_routing_maps_workspace_size
mhc_workspace_bytes = _C.mhc_workspace_bytes

#: MhcParams::seed(): the seed document's setting (all eps 0), as keyword arguments.
MHC_SEED_PARAMS = {"eps_norm": 0.0, "eps_pre": 0.0, "eps_sinkhorn": 0.0}

RoutingMaps = collections.namedtuple(
    "RoutingMaps", ["expert_first_token_offset", "permuted_row_to_unpermuted_row",
                    "unpermuted_row_to_permuted_row", "permuted_input"])
MhcPreOutput = collections.namedtuple("MhcPreOutput", ["f_pre", "h_post", "h_res"])
MhcActivateOutput = collections.namedtuple("MhcActivateOutput", ["h_pre", "h_post", "h_res"])

__all__ = [
    "finalize_moe_routing", "debug_check_finalize_moe_routing_indices", "build_moe_routing_maps",
    "build_moe_routing_maps_workspace_size", "moe_fc2_finalize", "moe_fc2_finalize_workspace_size",
    "mhc_pre", "mhc_post", "mhc_project", "mhc_activate", "mhc_pre_mix", "mhc_head", "mhc_expand",
    "mhc_workspace_bytes",
    "mhc_num_coefficients", "MHC_MAX_STREAMS", "MHC_SEED_PARAMS", "FC2_MODES", "RoutingMaps", "MhcPreOutput",
    "MhcActivateOutput", "torch_ops_registered",
]


# ---------------------------------------------------------------------------
# Arrays: torch tensors (when torch is importable) or numpy arrays.
# ---------------------------------------------------------------------------

def _torch_tensor(x):
    return _torch is not None and isinstance(x, _torch.Tensor)


def _dtype_name(x):
    """'float32', 'bfloat16', 'int32', ... for a torch tensor or a numpy array."""
    if _torch_tensor(x):
        return str(x.dtype).rpartition(".")[2]
    return x.dtype.name  # ml_dtypes.bfloat16 is 'bfloat16'


def _framework_dtype(like, name):
    """The dtype called `name` in the framework of `like` (a dtype object is passed through)."""
    if not isinstance(name, str):
        return name
    if _torch_tensor(like):
        return getattr(_torch, name)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise ImportError("flashmix: bfloat16 numpy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    import numpy
    return numpy.dtype(name)


def _empty(like, shape, dtype, zero=False):
    """An uninitialised (or zeroed) array beside `like`: same framework and device."""
    dtype = _framework_dtype(like, dtype)
    if _torch_tensor(like):
        return (_torch.zeros if zero else _torch.empty)(shape, dtype=dtype, device=like.device)
    import numpy
    return (numpy.zeros if zero else numpy.empty)(shape, dtype=dtype)


def _arg(x):
    """What the binding receives for an array argument (None passes through)."""
    if x is None:
        return None
    if _torch_tensor(x):
        # The legacy capsule: unlike Tensor.__dlpack__ it synchronises no streams (older torch
        # made the default stream wait, which breaks a graph capture), does not require the
        # tensor's device to be current (the binding makes it current) and takes tensors that
        # require grad (the ops are forward only); and it costs a tenth.
        return _torch.utils.dlpack.to_dlpack(x)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and getattr(dtype, "name", None) == "bfloat16" and hasattr(x, "view"):
        # numpy cannot export bfloat16 through DLPack: hand over a bfloat16 view of its bits.
        import numpy
        return _C.bfloat16_view(x.view(numpy.uint16))
    return x


def _stream(stream, like):
    """The cudaStream_t (an int) a call runs on."""
    if stream is None:
        if _torch_tensor(like) and like.is_cuda:
            return _torch.cuda.current_stream(like.device).cuda_stream
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"flashmix: stream must be None, an int (cudaStream_t) or a torch.cuda.Stream, got {stream!r}")


def _cuda_device(like):
    """The CUDA device index of `like`, or None for CPU arrays."""
    if _torch_tensor(like):
        return like.device.index if like.is_cuda else None
    dev = getattr(like, "__dlpack_device__", None)
    if dev is not None:
        kind, index = dev()
        return index if kind == 2 else None
    return None


def _workspace(like, nbytes):
    """A fresh uint8 buffer of `nbytes` on `like`'s device; None when no workspace is needed."""
    return _empty(like, (nbytes,), "uint8") if nbytes else None


def _streams_from_coefficients(N, op, arg):
    for n in range(1, MHC_MAX_STREAMS + 1):
        if mhc_num_coefficients(n) == N:
            return n
    raise ValueError(f"{op}: {arg}: has {N} coefficients, not N = n*n + 2n for an n in [1, {MHC_MAX_STREAMS}]")


def _mhc_hidden(x, n, op):
    """C for X [B, n, C] or [B, n*C]."""
    if len(x.shape) == 3:
        return x.shape[2]
    if len(x.shape) == 2:
        return x.shape[1] // n
    raise ValueError(f"{op}: x: must be [B, n, C] or [B, n*C] (got shape {tuple(x.shape)})")


# ---------------------------------------------------------------------------
# MoE (SPEC §1-§3)
# ---------------------------------------------------------------------------

def finalize_moe_routing(expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts, *,
                         num_experts_per_node, start_expert_id=0, scales=None, bias=None, shared_output=None,
                         out=None, hidden=None, out_dtype=None, fill=True, permuted_row_to_unpermuted_row=None,
                         expert_first_token_offset=None, enable_pdl=True, prefetch_indices=False,
                         threads_per_block=0, vectors_per_thread=0, chunks_per_token=0, stream=None):
    """SPEC §2: un-permute the expert outputs, weight and reduce the top-k, add bias.

    ``out[t, c] = sum over local slots j of scales[t, j] * (rows[u2p[j*T + t], c] + bias[e - start, c])
    (+ shared_output[t, c])``, summed in a fixed order (bitwise reproducible).

    Args:
      expanded_permuted_rows: ``[num_rows, padded_H]`` float32/float16/bfloat16, rows may be strided.
      unpermuted_row_to_permuted_row: int32 ``[k*T]`` (index ``j*T + t``).
      token_selected_experts: int32 ``[T, k]`` global expert ids (k in 1..16).
      num_experts_per_node, start_expert_id: this rank's experts ``[start, start + E_local)``; other
        slots are never read.
      scales: float32 ``[T, k]`` router weights, or None (every weight 1).
      bias: ``[E_local, >= H]`` of the rows' dtype, or None.
      shared_output: ``[T, >= H]`` of the output dtype, added once unweighted, or None.
      out: ``[T, H]`` output (rows may be strided); allocated when None, with ``H = hidden`` (default
        ``padded_H``) and dtype ``out_dtype`` (default: the rows' dtype).
      fill: False = tokens without a local slot are left untouched (a fresh ``out`` is then zeroed)
        and the cost follows the local rows; needs ``permuted_row_to_unpermuted_row`` and
        ``expert_first_token_offset`` (the maps of build_moe_routing_maps).
      enable_pdl, threads_per_block, vectors_per_thread, chunks_per_token: launch options (GPU).
      prefetch_indices: with enable_pdl, the routing indices are read before the previous kernel on
        the stream finishes; only when that kernel does not write them (in a MoE layer it is the FC2
        GEMM). The rows, bias and shared_output are always read after it.
      stream: see the module docstring.

    Returns ``out``.
    """
    if out is None:
        T = token_selected_experts.shape[0]
        H = expanded_permuted_rows.shape[1] if hidden is None else hidden
        dtype = _dtype_name(expanded_permuted_rows) if out_dtype is None else out_dtype
        out = _empty(expanded_permuted_rows, (T, H), dtype, zero=not fill)
    _C.finalize_moe_routing(
        _arg(expanded_permuted_rows), _arg(unpermuted_row_to_permuted_row), _arg(token_selected_experts), _arg(out),
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=_arg(scales),
        bias=_arg(bias), shared_output=_arg(shared_output), fill=fill,
        permuted_row_to_unpermuted_row=_arg(permuted_row_to_unpermuted_row),
        expert_first_token_offset=_arg(expert_first_token_offset), enable_pdl=enable_pdl,
        prefetch_indices=prefetch_indices, threads_per_block=threads_per_block,
        vectors_per_thread=vectors_per_thread, chunks_per_token=chunks_per_token, stream=_stream(stream, out))
    return out


def debug_check_finalize_moe_routing_indices(expanded_permuted_rows, unpermuted_row_to_permuted_row,
                                             token_selected_experts, out, *, num_experts_per_node,
                                             start_expert_id=0, fill=True, permuted_row_to_unpermuted_row=None,
                                             expert_first_token_offset=None, stream=None):
    """Checks the device-side indices of a finalize call (expert ids, permutation in range, maps
    consistent); raises ValueError naming the broken one. CUDA arrays only. SYNCHRONISES the stream:
    for debugging, never inside a CUDA graph capture."""
    _C.debug_check_finalize_moe_routing_indices(
        _arg(expanded_permuted_rows), _arg(unpermuted_row_to_permuted_row), _arg(token_selected_experts), _arg(out),
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, fill=fill,
        permuted_row_to_unpermuted_row=_arg(permuted_row_to_unpermuted_row),
        expert_first_token_offset=_arg(expert_first_token_offset), stream=_stream(stream, out))


def build_moe_routing_maps(token_selected_experts, *, num_experts_per_node, start_expert_id=0, input=None,
                           expert_first_token_offset=None, permuted_row_to_unpermuted_row=None,
                           unpermuted_row_to_permuted_row=None, permuted_input=None, workspace=None,
                           enable_pdl=True, single_block_max_slots=0, stream=None):
    """SPEC §1: the routing maps of this rank's slots (and optionally the gathered input rows).

    Args:
      token_selected_experts: int32 ``[T, k]`` global expert ids.
      num_experts_per_node, start_expert_id: this rank's experts.
      input: ``[T, H]`` rows to gather into ``permuted_input`` ``[k*T, H]``, or None.
      expert_first_token_offset (int64 ``[E_local + 1]``), permuted_row_to_unpermuted_row (int32
        ``[k*T]``, first P written), unpermuted_row_to_permuted_row (int32 ``[k*T]``, -1 = not local),
        permuted_input: outputs, allocated when None.
      workspace: uint8 device buffer of ``build_moe_routing_maps_workspace_size(T, k, E_local)``
        bytes; allocated when None and needed.

    Returns RoutingMaps(expert_first_token_offset, permuted_row_to_unpermuted_row,
    unpermuted_row_to_permuted_row, permuted_input). P (the local slots) is
    ``expert_first_token_offset[-1]``, on the device.
    """
    ex = token_selected_experts
    T, k = ex.shape[0], ex.shape[1]
    if expert_first_token_offset is None:
        expert_first_token_offset = _empty(ex, (num_experts_per_node + 1,), "int64")
    if permuted_row_to_unpermuted_row is None:
        permuted_row_to_unpermuted_row = _empty(ex, (k * T,), "int32")
    if unpermuted_row_to_permuted_row is None:
        unpermuted_row_to_permuted_row = _empty(ex, (k * T,), "int32")
    if input is not None and permuted_input is None:
        permuted_input = _empty(input, (k * T, input.shape[1]), _dtype_name(input))
    if workspace is None and _cuda_device(ex) is not None:
        workspace = _workspace(ex, _C.build_moe_routing_maps_workspace_size(
            T, k, num_experts_per_node, start_expert_id, single_block_max_slots))
    _C.build_moe_routing_maps(
        _arg(ex), _arg(expert_first_token_offset), _arg(permuted_row_to_unpermuted_row),
        _arg(unpermuted_row_to_permuted_row), num_experts_per_node=num_experts_per_node,
        start_expert_id=start_expert_id, input=_arg(input), permuted_input=_arg(permuted_input),
        workspace=_arg(workspace), enable_pdl=enable_pdl, single_block_max_slots=single_block_max_slots,
        stream=_stream(stream, ex))
    return RoutingMaps(expert_first_token_offset, permuted_row_to_unpermuted_row, unpermuted_row_to_permuted_row,
                       permuted_input)


def moe_fc2_finalize_workspace_size(num_tokens, k, hidden, inter, num_experts_per_node, mode="atomic",
                                    device=None):
    """Bytes of device workspace moe_fc2_finalize needs. The answer holds on any device (it is
    sized for the most SMs an sm_90 GPU has); ``device`` (an index, a torch.device, or None for
    the current device) is kept for compatibility."""
    index = -1 if device is None else getattr(device, "index", device)
    return _C.moe_fc2_finalize_workspace_size(num_tokens, k, hidden, inter, num_experts_per_node, mode,
                                              -1 if index is None else index)


def moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, *, k, num_tokens=None,
                     scales=None, bias=None, apply_bias=True, mode="atomic", out=None, out_already_zeroed=False,
                     workspace=None, gemm_kernel="auto", raster=0, swizzle=0, stream=None):
    """SPEC §3: the FC2 grouped GEMM with the finalize fused into its epilogue (sm_90a).

    ``out[t, :] = sum over local slots (t, j): scales[t, j] * (A[p] @ W2[e]^T + bias[e])``

    Args:
      A: bf16 ``[k*T capacity, I]`` FC1 activations in permuted order (first P rows used).
      W2: bf16 ``[E_local, H, I]``.
      expert_first_token_offset, permuted_row_to_unpermuted_row: from build_moe_routing_maps.
      k: experts per token; num_tokens: T (default: ``out.shape[0]``, else ``scales.shape[0]``).
      scales: float32 ``[T, k]`` or None; bias: bf16 ``[E_local, H]`` or None; apply_bias=False
        ignores it (all but one tensor-parallel rank).
      mode: "atomic", "atomic_fp32", "deterministic" (bitwise reproducible) or "unfused".
      out: bf16 ``[T, H]`` (rows may be strided, even stride); allocated when None.
      out_already_zeroed: "atomic" only: ``out`` holds zeros (or a residual to add to) already.
      workspace: uint8 device buffer of moe_fc2_finalize_workspace_size(...) bytes, 256-byte
        aligned; allocated when None.
      gemm_kernel: the GEMM under the epilogue: "auto" (the library's choice), or pinned:
        "rows" (flashmix's own), "cutlass_cooperative" or "cutlass_pingpong" (builds with
        CUTLASS only: NotImplementedError otherwise). raster and swizzle tune the CUTLASS ones.

    Returns ``out``. CPU arrays run the reference (any mode).
    """
    if out is None:
        if out_already_zeroed:
            raise ValueError("moe_fc2_finalize: out: out_already_zeroed=True needs the caller's out")
        if num_tokens is None:
            if scales is None:
                raise ValueError("moe_fc2_finalize: num_tokens: needed to allocate out (no out, no scales)")
            num_tokens = scales.shape[0]
        out = _empty(A, (num_tokens, W2.shape[1]), "bfloat16")
    device = _cuda_device(out)
    if workspace is None and device is not None:
        workspace = _workspace(out, _C.moe_fc2_finalize_workspace_size(
            out.shape[0], k, W2.shape[1], W2.shape[2], W2.shape[0], mode, device))
    _C.moe_fc2_finalize(
        _arg(A), _arg(W2), _arg(expert_first_token_offset), _arg(permuted_row_to_unpermuted_row), _arg(out), k=k,
        scales=_arg(scales), bias=_arg(bias), apply_bias=apply_bias, mode=mode,
        out_already_zeroed=out_already_zeroed, workspace=_arg(workspace), gemm_kernel=gemm_kernel, raster=raster,
        swizzle=swizzle, stream=_stream(stream, out))
    return out


# ---------------------------------------------------------------------------
# mHC (SPEC §4). X is bf16 [B, n, C] or [B, n*C]; phi [N, n*C] float32 or
# bf16; alpha float32 [3]; bias float32 [N]; N = n*n + 2n.
# ---------------------------------------------------------------------------

def mhc_pre(x, phi, alpha, bias, *, f_pre=None, h_post=None, h_res=None, eps_norm=1e-6, eps_pre=1e-6,
            post_mult=2.0, eps_sinkhorn=1e-6, sinkhorn_iters=20, res_layout="deepseek", enable_pdl=True,
            prefetch_weights=False, workspace=None, stream=None):
    """SPEC §4 mhc_pre: X -> (F_pre, H_post, H_res) in one pass over X.

    n comes from phi (N = n*n + 2n rows). Returns MhcPreOutput(f_pre bf16 ``[B, C]``,
    h_post float32 ``[B, n]``, h_res float32 ``[B, n, n]``, row-major, before any transpose);
    outputs not passed are allocated. Parameters default to SPEC §4 (DeepSeek's);
    ``**MHC_SEED_PARAMS`` gives the seed's. ``res_layout`` is an MhcParams field that only
    mhc_post uses. ``prefetch_weights`` (with enable_pdl): phi, alpha and bias are read before
    the previous kernel on the stream finishes; only when that kernel does not write them.
    ``workspace`` (optional): a uint8 device buffer of ``mhc_workspace_bytes(B, n, C)`` bytes,
    zeroed once by the caller (every launch leaves it zeroed; one launch at a time per buffer).
    With it, small batches (B <= 32) of shapes without the resident kernel (n != 4, ...) spread
    the projection over every SM (decode n = 8 on an H200: 103 -> 26 us).
    """
    n = _streams_from_coefficients(phi.shape[0], "mhc_pre", "phi")
    B, C = x.shape[0], _mhc_hidden(x, n, "mhc_pre")
    f_pre = _empty(x, (B, C), "bfloat16") if f_pre is None else f_pre
    h_post = _empty(x, (B, n), "float32") if h_post is None else h_post
    h_res = _empty(x, (B, n, n), "float32") if h_res is None else h_res
    _C.mhc_pre(_arg(x), _arg(phi), _arg(alpha), _arg(bias), _arg(f_pre), _arg(h_post), _arg(h_res),
               eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn,
               sinkhorn_iters=sinkhorn_iters, res_layout=res_layout, enable_pdl=enable_pdl,
               prefetch_weights=prefetch_weights, workspace=_arg(workspace), stream=_stream(stream, x))
    return MhcPreOutput(f_pre, h_post, h_res)


def mhc_post(x, f_out, h_post, h_res, *, x_next=None, res_layout="deepseek", enable_pdl=True, stream=None):
    """SPEC §4 mhc_post: ``X_next[b, i] = sum_j R[b, i, j] X[b, j] + H_post[b, i] F_out[b]`` with
    R = H_res^T ("deepseek") or H_res ("row_mix"). n from h_post ``[B, n]``. ``x_next`` (X's
    shape, must not overlap X) is allocated when None. Returns ``x_next``."""
    x_next = _empty(x, tuple(x.shape), "bfloat16") if x_next is None else x_next
    _C.mhc_post(_arg(x), _arg(f_out), _arg(h_post), _arg(h_res), _arg(x_next), res_layout=res_layout,
                enable_pdl=enable_pdl, stream=_stream(stream, x))
    return x_next


def mhc_project(x, phi, alpha, bias, *, h=None, r=None, eps_norm=1e-6, enable_pdl=True, prefetch_weights=False,
                workspace=None, stream=None):
    """mhc_pre's stage 1: h float32 ``[B, N]`` (alpha, 1/r and bias applied, before the
    activations) and r float32 ``[B]``. Returns (h, r). ``workspace`` as in mhc_pre."""
    n = _streams_from_coefficients(phi.shape[0], "mhc_project", "phi")
    B = x.shape[0]
    h = _empty(x, (B, phi.shape[0]), "float32") if h is None else h
    r = _empty(x, (B,), "float32") if r is None else r
    _mhc_hidden(x, n, "mhc_project")
    _C.mhc_project(_arg(x), _arg(phi), _arg(alpha), _arg(bias), _arg(h), _arg(r), eps_norm=eps_norm,
                   enable_pdl=enable_pdl, prefetch_weights=prefetch_weights, workspace=_arg(workspace),
                   stream=_stream(stream, x))
    return h, r


def mhc_activate(h, *, h_pre=None, h_post=None, h_res=None, eps_pre=1e-6, post_mult=2.0, eps_sinkhorn=1e-6,
                 sinkhorn_iters=20, enable_pdl=True, stream=None):
    """mhc_pre's stage 2: the sigmoids and Sinkhorn, h ``[B, N]`` -> MhcActivateOutput(h_pre
    ``[B, n]``, h_post ``[B, n]``, h_res ``[B, n, n]``), all float32."""
    n = _streams_from_coefficients(h.shape[1], "mhc_activate", "h")
    B = h.shape[0]
    h_pre = _empty(h, (B, n), "float32") if h_pre is None else h_pre
    h_post = _empty(h, (B, n), "float32") if h_post is None else h_post
    h_res = _empty(h, (B, n, n), "float32") if h_res is None else h_res
    _C.mhc_activate(_arg(h), _arg(h_pre), _arg(h_post), _arg(h_res), eps_pre=eps_pre, post_mult=post_mult,
                    eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                    stream=_stream(stream, h))
    return MhcActivateOutput(h_pre, h_post, h_res)


def mhc_pre_mix(x, h_pre, *, f_pre=None, enable_pdl=True, stream=None):
    """mhc_pre's stage 3: ``F_pre[b, c] = sum_i H_pre[b, i] X[b, i, c]`` (bf16 ``[B, C]``)."""
    n = h_pre.shape[1]
    f_pre = _empty(x, (x.shape[0], _mhc_hidden(x, n, "mhc_pre_mix")), "bfloat16") if f_pre is None else f_pre
    _C.mhc_pre_mix(_arg(x), _arg(h_pre), _arg(f_pre), enable_pdl=enable_pdl, stream=_stream(stream, x))
    return f_pre


def mhc_head(x, phi, alpha, bias, *, out=None, eps_norm=1e-6, eps_pre=1e-6, enable_pdl=True, workspace=None,
             stream=None):
    """mhc_head (before the final LM head): the pre mix only, with phi ``[n, n*C]``, alpha
    ``[1]`` (alpha_pre) and bias ``[n]``. Returns out bf16 ``[B, C]``. ``workspace`` as in mhc_pre."""
    n = phi.shape[0]
    out = _empty(x, (x.shape[0], _mhc_hidden(x, n, "mhc_head")), "bfloat16") if out is None else out
    _C.mhc_head(_arg(x), _arg(phi), _arg(alpha), _arg(bias), _arg(out), eps_norm=eps_norm, eps_pre=eps_pre,
                enable_pdl=enable_pdl, workspace=_arg(workspace), stream=_stream(stream, x))
    return out


def mhc_expand(embedding, *, n=None, x=None, enable_pdl=True, stream=None):
    """mhc_expand: embedding bf16 ``[B, C]`` -> X ``[B, n, C]`` (n copies). Give ``n`` or ``x``."""
    if x is None:
        if n is None:
            raise ValueError("mhc_expand: n: give n (or x)")
        x = _empty(embedding, (embedding.shape[0], n, embedding.shape[1]), "bfloat16")
    _C.mhc_expand(_arg(embedding), _arg(x), enable_pdl=enable_pdl, stream=_stream(stream, embedding))
    return x


# ---------------------------------------------------------------------------
# torch custom ops (torch.compile, CUDA graphs), when torch is importable.
# ---------------------------------------------------------------------------

if _torch is None:
    torch_ops_registered = False
else:
    from . import _torch_ops  # noqa: F401,E402
    torch_ops_registered = True
