"""MoE: the routing maps (spec §1), the finalize (spec §2), the FC2 grouped
GEMM with the finalize fused (spec §3), the router (spec §8), FC1 with the
gather and the gated activation fused (spec §9) and the routed-expert layer in
one call (spec §10) of docs/spec.md -- each function with its torch custom op
and shape function beside it -- and MoeLayer, a torch module over the layer.

Keyword defaults are the library's (the Args initialisers of
include/flashmix/moe.h, read through ``_C.moe_defaults()``); the binding
(python/src/moe.cpp) takes every argument explicitly.
"""
import collections

from ._common import _C, arg, cuda_device, defaults, dtype_name, empty, new_workspace, stream_of, torch
from .fp8 import _as_bytes, _e4m3_dtype, _mx_bytes, _scale_dtype, quantize_fp8

__all__ = [
    "build_moe_routing_maps", "build_moe_routing_maps_workspace_size", "RoutingMaps",
    "finalize_moe_routing", "debug_check_finalize_moe_routing_indices",
    "moe_fc2_finalize", "moe_fc2_finalize_workspace_size", "FC2_MODES", "FC2_GEMM_KERNELS",
    "moe_router", "MoeRouterOutput", "ROUTER_SCORINGS",
    "moe_fc1", "FC1_ACTIVATIONS", "FC1_WEIGHT_LAYOUTS", "FP8_SCALINGS", "MOE_WEIGHT_FORMATS",
    "moe_forward", "moe_forward_workspace_size", "FC1_INPUTS",
]

if torch is not None:
    from ._torch_ops import Optional, Tensor, Tuple, custom_op

_DEFAULTS = defaults(_C.moe_defaults())
_ROUTING = _DEFAULTS["build_moe_routing_maps"]
_FINALIZE = _DEFAULTS["finalize_moe_routing"]
_FC2 = _DEFAULTS["moe_fc2_finalize"]
_ROUTER = _DEFAULTS["moe_router"]
_FC1 = _DEFAULTS["moe_fc1"]
_FORWARD = _DEFAULTS["moe_forward"]

RoutingMaps = collections.namedtuple(
    "RoutingMaps", ["expert_first_token_offset", "permuted_row_to_unpermuted_row",
                    "unpermuted_row_to_permuted_row", "permuted_input", "permuted_input_scales"],
    defaults=(None,))


# ---------------------------------------------------------------------------
# Routing maps (spec §1)
# ---------------------------------------------------------------------------

def _new_offsets(ex, num_experts_per_node):
    return empty(ex, (num_experts_per_node + 1,), "int64")


def _new_slot_map(ex):
    return empty(ex, (ex.shape[0] * ex.shape[1],), "int32")


def _new_permuted_input(input, ex):
    return empty(input, (ex.shape[0] * ex.shape[1], input.shape[1]), dtype_name(input))


def build_moe_routing_maps_workspace_size(num_tokens, k, num_experts_per_node, start_expert_id=_ROUTING.start_expert_id,
                                          single_block_max_slots=_ROUTING.single_block_max_slots):
    """Bytes of device workspace build_moe_routing_maps needs (0: none)."""
    return _C.build_moe_routing_maps_workspace_size(num_tokens, k, num_experts_per_node, start_expert_id,
                                                    single_block_max_slots)


def build_moe_routing_maps(token_selected_experts, *, num_experts_per_node, start_expert_id=_ROUTING.start_expert_id,
                           input=None, expert_first_token_offset=None, permuted_row_to_unpermuted_row=None,
                           unpermuted_row_to_permuted_row=None, permuted_input=None, fp8_scale_format=None,
                           permuted_input_scales=None, workspace=None, enable_pdl=_ROUTING.enable_pdl,
                           single_block_max_slots=_ROUTING.single_block_max_slots, stream=None):
    """spec §1: the routing maps of this rank's slots (and optionally the gathered input rows).

    Args:
      token_selected_experts: int32 ``[T, k]`` global expert ids.
      num_experts_per_node, start_expert_id: this rank's experts.
      input: ``[T, H]`` rows to gather into ``permuted_input`` ``[k*T, H]``, or None.
      expert_first_token_offset (int64 ``[E_local + 1]``), permuted_row_to_unpermuted_row (int32
        ``[k*T]``, first P written), unpermuted_row_to_permuted_row (int32 ``[k*T]``, -1 = not local),
        permuted_input: outputs, allocated when None.
      fp8_scale_format: ``"float32"`` or ``"ue8m0"``: the FP8 expansion (spec §1.4) instead of the
        copy: ``input`` bfloat16, ``permuted_input`` its rows' e4m3 codes (``torch.float8_e4m3fn``
        or uint8 ``[k*T, H]``) and ``permuted_input_scales`` ``[k*T, H / 128]`` (float32, or
        ``float8_e8m0fnu`` / uint8), bitwise ``quantize_fp8`` 1 x 128 of the rows; H % 128 == 0.
      workspace: uint8 device buffer of ``build_moe_routing_maps_workspace_size(T, k, E_local)``
        bytes; allocated when None and needed.

    Returns RoutingMaps(expert_first_token_offset, permuted_row_to_unpermuted_row,
    unpermuted_row_to_permuted_row, permuted_input, permuted_input_scales). P (the local slots) is
    ``expert_first_token_offset[-1]``, on the device.
    """
    ex = token_selected_experts
    if expert_first_token_offset is None:
        expert_first_token_offset = _new_offsets(ex, num_experts_per_node)
    if permuted_row_to_unpermuted_row is None:
        permuted_row_to_unpermuted_row = _new_slot_map(ex)
    if unpermuted_row_to_permuted_row is None:
        unpermuted_row_to_permuted_row = _new_slot_map(ex)
    if permuted_input_scales is not None and fp8_scale_format is None:
        fp8_scale_format = "float32"
    fp8 = fp8_scale_format is not None
    if input is not None and permuted_input is None:
        permuted_input = (empty(input, (ex.shape[0] * ex.shape[1], input.shape[1]), _e4m3_dtype(input)) if fp8
                          else _new_permuted_input(input, ex))
    if fp8 and input is not None and permuted_input_scales is None:
        permuted_input_scales = empty(input, (ex.shape[0] * ex.shape[1], input.shape[1] // 128),
                                      _scale_dtype(input, fp8_scale_format))
    if workspace is None and cuda_device(ex) is not None:
        workspace = new_workspace(ex, _C.build_moe_routing_maps_workspace_size(
            ex.shape[0], ex.shape[1], num_experts_per_node, start_expert_id, single_block_max_slots))
    _C.build_moe_routing_maps(
        arg(ex), arg(expert_first_token_offset), arg(permuted_row_to_unpermuted_row),
        arg(unpermuted_row_to_permuted_row), num_experts_per_node=num_experts_per_node,
        start_expert_id=start_expert_id, input=arg(input), permuted_input=arg(_as_bytes(permuted_input)),
        permuted_input_scales=arg(_as_bytes(permuted_input_scales)), scale_format=fp8_scale_format or "float32",
        workspace=arg(workspace), enable_pdl=enable_pdl, single_block_max_slots=single_block_max_slots,
        stream=stream_of(stream, ex))
    return RoutingMaps(expert_first_token_offset, permuted_row_to_unpermuted_row, unpermuted_row_to_permuted_row,
                       permuted_input, permuted_input_scales)


if torch is not None:
    def _routing_maps_fake(token_selected_experts, num_experts_per_node, input, **_):
        ex = token_selected_experts
        return (_new_offsets(ex, num_experts_per_node), _new_slot_map(ex), _new_slot_map(ex),
                _new_permuted_input(input, ex) if input is not None else ex.new_empty((0, 0)))

    @custom_op("build_moe_routing_maps", fake=_routing_maps_fake)
    def _build_moe_routing_maps_op(token_selected_experts: Tensor, num_experts_per_node: int,
                                   start_expert_id: int = _ROUTING.start_expert_id, input: Optional[Tensor] = None,
                                   enable_pdl: bool = _ROUTING.enable_pdl) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """flashmix.build_moe_routing_maps as a custom op: (expert_first_token_offset int64
        ``[E_local + 1]``, permuted_row_to_unpermuted_row int32 ``[k*T]``,
        unpermuted_row_to_permuted_row int32 ``[k*T]``, permuted_input ``[k*T, H]``). As in the C++
        API, P = ``expert_first_token_offset[-1]`` (on the device) and only the first P entries of
        permuted_row_to_unpermuted_row and rows of permuted_input are written; the rest is
        unspecified. Without ``input``, permuted_input is an empty ``[0, 0]`` tensor."""
        maps = build_moe_routing_maps(token_selected_experts, num_experts_per_node=num_experts_per_node,
                                      start_expert_id=start_expert_id, input=input, enable_pdl=enable_pdl)
        permuted = maps.permuted_input if input is not None else token_selected_experts.new_empty((0, 0))
        return (maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row,
                maps.unpermuted_row_to_permuted_row, permuted)


# ---------------------------------------------------------------------------
# Finalize (spec §2)
# ---------------------------------------------------------------------------

def _new_finalize_out(expanded_permuted_rows, token_selected_experts, hidden, out_dtype, fill):
    """The ``out`` a call without one gets: ``[T, hidden or padded_H]`` of ``out_dtype or the rows'
    dtype``, zeroed when not filling."""
    rows = expanded_permuted_rows
    H = rows.shape[1] if hidden is None else hidden
    dtype = dtype_name(rows) if out_dtype is None else out_dtype
    return empty(rows, (token_selected_experts.shape[0], H), dtype, zero=not fill)


def finalize_moe_routing(expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts, *,
                         num_experts_per_node, start_expert_id=_FINALIZE.start_expert_id, scales=None, bias=None,
                         shared_output=None, out=None, hidden=None, out_dtype=None, fill=_FINALIZE.fill,
                         permuted_row_to_unpermuted_row=None, expert_first_token_offset=None,
                         enable_pdl=_FINALIZE.enable_pdl, prefetch_indices=_FINALIZE.prefetch_indices,
                         threads_per_block=_FINALIZE.threads_per_block,
                         vectors_per_thread=_FINALIZE.vectors_per_thread,
                         chunks_per_token=_FINALIZE.chunks_per_token, schedule=_FINALIZE.schedule, stream=None):
    """spec §2: un-permute the expert outputs, weight and reduce the top-k, add bias.

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
      enable_pdl, threads_per_block, vectors_per_thread, chunks_per_token, schedule: launch options
        (GPU; zeros: chosen by shape; schedule 1 = persistent warps, 2 = a block per token).
      prefetch_indices: with enable_pdl, the routing indices are read before the previous kernel on
        the stream finishes; only when that kernel does not write them (in a MoE layer it is the FC2
        GEMM). The rows, bias and shared_output are always read after it.
      stream: see the package docstring.

    Returns ``out``.
    """
    if out is None:
        out = _new_finalize_out(expanded_permuted_rows, token_selected_experts, hidden, out_dtype, fill)
    _C.finalize_moe_routing(
        arg(expanded_permuted_rows), arg(unpermuted_row_to_permuted_row), arg(token_selected_experts), arg(out),
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=arg(scales),
        bias=arg(bias), shared_output=arg(shared_output), fill=fill,
        permuted_row_to_unpermuted_row=arg(permuted_row_to_unpermuted_row),
        expert_first_token_offset=arg(expert_first_token_offset), enable_pdl=enable_pdl,
        prefetch_indices=prefetch_indices, threads_per_block=threads_per_block,
        vectors_per_thread=vectors_per_thread, chunks_per_token=chunks_per_token, schedule=schedule,
        stream=stream_of(stream, out))
    return out


def debug_check_finalize_moe_routing_indices(expanded_permuted_rows, unpermuted_row_to_permuted_row,
                                             token_selected_experts, out, *, num_experts_per_node,
                                             start_expert_id=_FINALIZE.start_expert_id, scales=None, bias=None,
                                             shared_output=None, fill=_FINALIZE.fill,
                                             permuted_row_to_unpermuted_row=None, expert_first_token_offset=None,
                                             stream=None):
    """Checks the device-side indices of a finalize call (expert ids, permutation in range, maps
    consistent); raises ValueError naming the broken one. CUDA arrays only. SYNCHRONISES the stream:
    for debugging, never inside a CUDA graph capture."""
    _C.debug_check_finalize_moe_routing_indices(
        arg(expanded_permuted_rows), arg(unpermuted_row_to_permuted_row), arg(token_selected_experts), arg(out),
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=arg(scales),
        bias=arg(bias), shared_output=arg(shared_output), fill=fill,
        permuted_row_to_unpermuted_row=arg(permuted_row_to_unpermuted_row),
        expert_first_token_offset=arg(expert_first_token_offset), stream=stream_of(stream, out))


if torch is not None:
    def _finalize_fake(expanded_permuted_rows, token_selected_experts, hidden, out_dtype, **_):
        # fill=False zeroes a fresh out: the same shape
        return _new_finalize_out(expanded_permuted_rows, token_selected_experts, None if hidden < 0 else hidden,
                                 out_dtype, True)

    @custom_op("finalize_moe_routing", fake=_finalize_fake)
    def _finalize_moe_routing_op(expanded_permuted_rows: Tensor, unpermuted_row_to_permuted_row: Tensor,
                                 token_selected_experts: Tensor, num_experts_per_node: int,
                                 start_expert_id: int = _FINALIZE.start_expert_id, scales: Optional[Tensor] = None,
                                 bias: Optional[Tensor] = None, shared_output: Optional[Tensor] = None,
                                 hidden: int = -1, out_dtype: Optional[torch.dtype] = None,
                                 fill: bool = _FINALIZE.fill, permuted_row_to_unpermuted_row: Optional[Tensor] = None,
                                 expert_first_token_offset: Optional[Tensor] = None,
                                 enable_pdl: bool = _FINALIZE.enable_pdl,
                                 prefetch_indices: bool = _FINALIZE.prefetch_indices) -> Tensor:
        """flashmix.finalize_moe_routing as a custom op; returns a fresh ``out`` ``[T, H]``
        (``hidden=-1``: H = padded_H; with ``fill=False`` tokens without a local slot are 0;
        ``prefetch_indices`` as in flashmix.finalize_moe_routing)."""
        return finalize_moe_routing(
            expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts,
            num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=scales, bias=bias,
            shared_output=shared_output, hidden=None if hidden < 0 else hidden, out_dtype=out_dtype, fill=fill,
            permuted_row_to_unpermuted_row=permuted_row_to_unpermuted_row,
            expert_first_token_offset=expert_first_token_offset, enable_pdl=enable_pdl,
            prefetch_indices=prefetch_indices)


# ---------------------------------------------------------------------------
# FC2 grouped GEMM + finalize (spec §3)
# ---------------------------------------------------------------------------

#: The ``mode`` values of moe_fc2_finalize.
FC2_MODES = _C.FC2_MODES
FC2_GEMM_KERNELS = _C.FC2_GEMM_KERNELS


def moe_fc2_finalize_workspace_size(num_tokens, k, hidden, inter, num_experts_per_node, mode=_FC2.mode,
                                    device=None):
    """Bytes of device workspace moe_fc2_finalize needs. The answer holds on any device (it is
    sized for the most SMs an sm_90 GPU has); ``device`` (an index, a torch.device, or None for
    the current device) is kept for compatibility."""
    index = -1 if device is None else getattr(device, "index", device)
    return _C.moe_fc2_finalize_workspace_size(num_tokens, k, hidden, inter, num_experts_per_node, mode,
                                              -1 if index is None else index)


def _inter_of_w2(W2, weights):
    """I of a W2 ``[E_local, H, I]``, or of packed MXFP4 bytes ``[E_local, H, I/2]``."""
    return W2.shape[2] * (2 if weights == "mxfp4" else 1)


def _new_fc2_out(A, W2, num_tokens, fill=True):
    """A fresh bf16 ``[T, H]`` out, zeroed when not filling."""
    return empty(A, (num_tokens, W2.shape[1]), "bfloat16", zero=not fill)


def moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, *, k, num_tokens=None,
                     scales=None, bias=None, apply_bias=_FC2.apply_bias, shared_output=None, fill=_FC2.fill,
                     mode=_FC2.mode, out=None, out_already_zeroed=_FC2.out_already_zeroed, fp8=_FC2.fp8,
                     a_scales=None, w2_scales=None, weights=_FC2.weights, w2_mx_scales=None, workspace=None,
                     gemm_kernel=_FC2.gemm_kernel, raster=_FC2.raster, swizzle=_FC2.swizzle, stream=None):
    """spec §3: the FC2 grouped GEMM with the finalize fused into its epilogue (sm_90a).

    ``out[t, :] = sum over local slots (t, j): scales[t, j] * (A[p] @ W2[e]^T + bias[e])``

    Args:
      A: bf16 ``[k*T capacity, I]`` FC1 activations in permuted order (first P rows used).
      W2: bf16 ``[E_local, H, I]``.
      expert_first_token_offset, permuted_row_to_unpermuted_row: from build_moe_routing_maps.
      k: experts per token; num_tokens: T (default: ``out.shape[0]``, else ``scales.shape[0]``, else
        ``shared_output.shape[0]``).
      scales: float32 ``[T, k]`` or None; bias: bf16 ``[E_local, H]`` or None; apply_bias=False
        ignores it (all but one tensor-parallel rank).
      shared_output: bf16 ``[T, >= H]`` (rows may be strided, a stride that is a multiple of 8), added
        once, unweighted, to every token written (a shared expert's output or a residual), or None.
        May not overlap ``out``.
      fill: False = tokens without a local row are left untouched (expert parallelism: each rank
        writes only its tokens; a fresh ``out`` is then zeroed); True: they get 0 (+ shared_output).
      mode: "atomic", "atomic_fp32", "deterministic" (bitwise reproducible) or "unfused" (FC2_MODES).
      out: bf16 ``[T, H]`` (rows may be strided, even stride); allocated when None.
      out_already_zeroed: "atomic" only: ``out`` holds zeros (or a residual to add to) already; not
        with shared_output, nor with fill=False.
      workspace: uint8 device buffer of moe_fc2_finalize_workspace_size(...) bytes, 256-byte
        aligned; allocated when None.
      gemm_kernel: the GEMM under the epilogue, one of FC2_GEMM_KERNELS: "auto" (the library's
        choice), or pinned: "rows" (flashmix's own), "cutlass_cooperative" or "cutlass_pingpong"
        (builds with CUTLASS only: NotImplementedError otherwise).
      raster, swizzle: tuning of the CUTLASS kernels (zeros: chosen by shape).
      fp8: "none" (bf16 A and W2), "block" or "tensor" (FP8_SCALINGS; spec §3.5, §11): A and W2 hold
        e4m3 values (``torch.float8_e4m3fn`` or uint8 bytes) and a_scales / w2_scales their float32
        scales: "block" ``[rows of A, I/128]`` and ``[E_local, ceil(H/128), I/128]``, "tensor" ``[1]``
        and ``[E_local]``. FP8 runs on the "rows" kernel.
      weights: "dense" (W2 bf16, or e4m3 with ``fp8``) or "mxfp4" (MOE_WEIGHT_FORMATS; spec §13.7): W2
        is packed e2m1 ``[E_local, H, I/2]`` (``torch.float4_e2m1fn_x2`` or uint8) and w2_mx_scales its
        ue8m0 scales ``[E_local, H, I/32]`` (``torch.float8_e8m0fnu`` or uint8), I a multiple of 128;
        ``fp8`` then picks A: "block" (W4A8: e4m3 A with a_scales ``[rows of A, I/128]``) or "none"
        (W4A16: bf16 A); no w2_scales. Runs on the "rows" kernel.

    Returns ``out``. CPU arrays run the reference (any mode).
    """
    if out is None:
        if out_already_zeroed:
            raise ValueError("moe_fc2_finalize: out: out_already_zeroed=True needs the caller's out")
        if num_tokens is None:
            if scales is None and shared_output is None:
                raise ValueError("moe_fc2_finalize: num_tokens: needed to allocate out (no out, scales or "
                                 "shared_output)")
            num_tokens = (scales if scales is not None else shared_output).shape[0]
        out = _new_fc2_out(A, W2, num_tokens, fill)
    device = cuda_device(out)
    if workspace is None and device is not None:
        workspace = new_workspace(out, _C.moe_fc2_finalize_workspace_size(
            out.shape[0], k, W2.shape[1], _inter_of_w2(W2, weights), W2.shape[0], mode, device))
    _C.moe_fc2_finalize(
        arg(_as_bytes(A)), arg(_mx_bytes(W2, weights, "moe_fc2_finalize", "W2")), arg(expert_first_token_offset),
        arg(permuted_row_to_unpermuted_row),
        arg(out), k=k, scales=arg(scales), bias=arg(bias), apply_bias=apply_bias, shared_output=arg(shared_output),
        fill=fill, mode=mode, out_already_zeroed=out_already_zeroed, fp8=fp8, a_scales=arg(a_scales),
        w2_scales=arg(w2_scales), weights=weights,
        w2_mx_scales=arg(_mx_bytes(w2_mx_scales, weights, "moe_fc2_finalize", "w2_mx_scales", True)),
        workspace=arg(workspace), gemm_kernel=gemm_kernel, raster=raster, swizzle=swizzle,
        stream=stream_of(stream, out))
    return out


def _fc2_tokens(num_tokens, scales, shared_output=None):
    """The torch op's T: ``num_tokens``, or when it is -1 ``scales.shape[0]`` (else
    ``shared_output.shape[0]``)."""
    if num_tokens >= 0:
        return num_tokens
    if scales is None and shared_output is None:
        raise ValueError("moe_fc2_finalize: num_tokens: needed when scales and shared_output are None")
    return (scales if scales is not None else shared_output).shape[0]


if torch is not None:
    def _fc2_fake(A, W2, num_tokens, scales, shared_output, **_):
        return _new_fc2_out(A, W2, _fc2_tokens(num_tokens, scales, shared_output))

    @custom_op("moe_fc2_finalize", fake=_fc2_fake)
    def _moe_fc2_finalize_op(A: Tensor, W2: Tensor, expert_first_token_offset: Tensor,
                             permuted_row_to_unpermuted_row: Tensor, k: int, num_tokens: int = -1,
                             scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                             apply_bias: bool = _FC2.apply_bias, mode: str = _FC2.mode,
                             shared_output: Optional[Tensor] = None, fill: bool = _FC2.fill, fp8: str = _FC2.fp8,
                             a_scales: Optional[Tensor] = None, w2_scales: Optional[Tensor] = None,
                             weights: str = _FC2.weights, w2_mx_scales: Optional[Tensor] = None) -> Tensor:
        """flashmix.moe_fc2_finalize as a custom op: a fresh bf16 ``out`` ``[T, H]``. T is
        ``num_tokens``, or ``scales.shape[0]`` (else ``shared_output.shape[0]``) when
        ``num_tokens=-1``; with ``fill=False`` tokens without a local row are 0."""
        return moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, k=k,
                                num_tokens=_fc2_tokens(num_tokens, scales, shared_output), scales=scales, bias=bias,
                                apply_bias=apply_bias, shared_output=shared_output, fill=fill, mode=mode, fp8=fp8,
                                a_scales=a_scales, w2_scales=w2_scales, weights=weights, w2_mx_scales=w2_mx_scales)


# ---------------------------------------------------------------------------
# Router (spec §8)
# ---------------------------------------------------------------------------

#: The ``scoring`` values of moe_router and moe_forward (``MoeRouterScoring``'s to_string names).
ROUTER_SCORINGS = _C.ROUTER_SCORINGS

MoeRouterOutput = collections.namedtuple("MoeRouterOutput", ["token_selected_experts", "token_final_scales"])


def _new_router_outputs(logits, k):
    """Fresh (token_selected_experts int32 ``[T, k]``, token_final_scales float32 ``[T, k]``)."""
    T = logits.shape[0]
    return empty(logits, (T, k), "int32"), empty(logits, (T, k), "float32")


def moe_router(logits, k, *, scoring=_ROUTER.scoring, renormalize=_ROUTER.renormalize, correction_bias=None,
               n_group=_ROUTER.n_group, topk_group=_ROUTER.topk_group,
               routed_scaling_factor=_ROUTER.routed_scaling_factor, token_ids=None, hash_table=None,
               token_selected_experts=None, token_final_scales=None, enable_pdl=_ROUTER.enable_pdl,
               path=_ROUTER.path, generic_layout=_ROUTER.generic_layout, stream=None):
    """spec §8: router logits -> the k experts of each token and their weights.

    Args:
      logits: ``[T, E]`` float32 or bfloat16, dense rows (E in 1..512).
      k: experts per token, 1..16 and ``<= E``.
      scoring: "softmax" (Mixtral, Qwen3-MoE), "sigmoid" (DeepSeek-V3), "sqrtsoftplus" (DeepSeek-V4)
        or "softmax_after_topk" (gpt-oss) (ROUTER_SCORINGS).
      renormalize: divide the k weights by their sum (ignored by "softmax_after_topk").
      correction_bias: float32 ``[E]`` added to the scores for the choice only, or None.
      n_group, topk_group: group-limited choice (DeepSeek-V3: 8, 4); 1, 1 = none.
      routed_scaling_factor: multiplies every weight.
      token_ids (int32 or int64 ``[T]``) with hash_table (int32 ``[vocab_size, k]``): hash selection
        (spec §8.7, DeepSeek-V4's first layers: ``tid2eid``): token t's experts are
        ``hash_table[token_ids[t]]`` in that order instead of the top-k; the weights follow
        ``scoring`` / ``renormalize`` / ``routed_scaling_factor`` as usual. A token id outside
        ``[0, vocab_size)`` or an entry outside ``[0, E)`` gives that slot id -1 and weight 0. No
        correction_bias, no groups.
      token_selected_experts (int32 ``[T, k]``), token_final_scales (float32 ``[T, k]``): outputs,
        allocated when None.
      enable_pdl, path, generic_layout: launch options (GPU; identical results).
      stream: see the package docstring.

    Returns MoeRouterOutput(token_selected_experts, token_final_scales): ids in descending order of
    their selection value (ties: the lowest id; hash selection: the table's order), weights as spec §8.1.
    """
    fresh = _new_router_outputs(logits, k) if token_selected_experts is None or token_final_scales is None else None
    if token_selected_experts is None:
        token_selected_experts = fresh[0]
    elif len(token_selected_experts.shape) == 2 and token_selected_experts.shape[1] != k:
        raise ValueError(f"moe_router: token_selected_experts: must have k = {k} columns "
                         f"(got shape {tuple(token_selected_experts.shape)})")
    if token_final_scales is None:
        token_final_scales = fresh[1]
    _C.moe_router(
        arg(logits), arg(token_selected_experts), arg(token_final_scales), scoring=scoring, renormalize=renormalize,
        correction_bias=arg(correction_bias), n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, token_ids=arg(token_ids), hash_table=arg(hash_table),
        enable_pdl=enable_pdl, path=path, generic_layout=generic_layout, stream=stream_of(stream, logits))
    return MoeRouterOutput(token_selected_experts, token_final_scales)


if torch is not None:
    @custom_op("moe_router", fake=lambda logits, k, **_: _new_router_outputs(logits, k))
    def _moe_router_op(logits: Tensor, k: int, scoring: str = _ROUTER.scoring,
                       renormalize: bool = _ROUTER.renormalize, correction_bias: Optional[Tensor] = None,
                       n_group: int = _ROUTER.n_group, topk_group: int = _ROUTER.topk_group,
                       routed_scaling_factor: float = _ROUTER.routed_scaling_factor,
                       enable_pdl: bool = _ROUTER.enable_pdl, token_ids: Optional[Tensor] = None,
                       hash_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """flashmix.moe_router as a custom op: fresh (token_selected_experts int32 ``[T, k]``,
        token_final_scales float32 ``[T, k]``)."""
        return tuple(moe_router(logits, k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias,
                                n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                                token_ids=token_ids, hash_table=hash_table, enable_pdl=enable_pdl))


# ---------------------------------------------------------------------------
# FC1 with the gather and the gated activation fused (spec §9)
# ---------------------------------------------------------------------------

#: The ``activation`` values of moe_fc1 and moe_forward (``MoeActivation``'s to_string names).
FC1_ACTIVATIONS = _C.FC1_ACTIVATIONS
#: The ``layout`` values of moe_fc1 (``w1_layout`` of moe_forward; ``Fc1WeightLayout``'s names).
FC1_WEIGHT_LAYOUTS = _C.FC1_WEIGHT_LAYOUTS
#: The ``fp8`` values of moe_fc1 and moe_fc2_finalize (``MoeFp8Scaling``'s to_string names).
FP8_SCALINGS = _C.FP8_SCALINGS
#: The ``weights`` values of moe_fc1, moe_fc2_finalize, moe_forward and MoeLayer (``MoeWeightFormat``'s
#: to_string names): "dense" (bf16, or e4m3 with ``fp8``) and "mxfp4" (spec §13.7).
MOE_WEIGHT_FORMATS = _C.MOE_WEIGHT_FORMATS


def _fc1_tokens(x, k, num_tokens, x_permuted):
    """T: ``num_tokens``, or x's rows (token order), or x's rows over k (x_permuted: k*T rows)."""
    if num_tokens is not None and num_tokens >= 0:
        return num_tokens
    if not x_permuted:
        return x.shape[0]
    return x.shape[0] // k if k > 0 else 0  # k < 1: the library names k


def _new_fc1_out(x, w1, k, num_tokens):
    """A fresh bf16 ``[k*T, I]`` (I = w1.shape[1] / 2); rows past P are left as allocated."""
    return empty(x, (max(k, 0) * num_tokens, w1.shape[1] // 2), "bfloat16")


def moe_fc1(x, w1, expert_first_token_offset, permuted_row_to_unpermuted_row, *, k, bias=None, layout=_FC1.layout,
            activation=_FC1.activation, limit=_FC1.limit, alpha=_FC1.alpha, x_permuted=_FC1.x_permuted,
            fp8=_FC1.fp8, x_scales=None, w1_scales=None, weights=_FC1.weights, w1_mx_scales=None, num_tokens=None,
            out=None, out_scale_format=None, out_scales=None, enable_pdl=_FC1.enable_pdl, stream=None):
    """spec §9: FC1 of every local permuted row, the input gathered through the routing maps and the
    gated activation applied before the one rounding to bf16.

    ``out[p, i] = bf16(act(x[t] . W1[e, gate row i] + bias, x[t] . W1[e, up row i] + bias))`` for
    permuted row p of expert e, t = ``permuted_row_to_unpermuted_row[p] % T``.

    Args:
      x: bf16 ``[T, H]`` in token order (rows may be strided, a stride that is a multiple of 8); with
        ``x_permuted``, the caller's permuted copy ``[k*T, H]`` (build_moe_routing_maps'
        permuted_input) and row p reads ``x[p]``.
      w1: bf16 ``[E_local, 2I, H]``, dense (K-major rows).
      expert_first_token_offset, permuted_row_to_unpermuted_row: from build_moe_routing_maps.
      k: experts per token (1..16).
      bias: bf16 ``[E_local, 2I]`` in w1's row order, or None.
      layout: "gate_up" (rows ``[0, I)`` gate, ``[I, 2I)`` up: DeepSeek, Mixtral, Qwen) or
        "interleaved" (row 2i gate, 2i + 1 up: gpt-oss) (FC1_WEIGHT_LAYOUTS).
      activation: "swiglu" (``silu(g) * u``), "swiglu_oai" (gpt-oss: ``g' sigmoid(alpha g') (u' + 1)``,
        ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``) or "swiglu_clamped" (DeepSeek-V4:
        ``silu(min(g, limit)) * clamp(u, -limit, limit)``) (FC1_ACTIVATIONS).
      limit: the clamp limit; 0 = the activation's (7 for "swiglu_oai", 10 for "swiglu_clamped").
      alpha: "swiglu_oai"'s alpha; 0 = 1.702.
      fp8: "none" (bf16 x and w1), "block" or "tensor" (FP8_SCALINGS; spec §9.7, §11): x and w1 hold
        e4m3 values (``torch.float8_e4m3fn`` or uint8 bytes) and x_scales / w1_scales their float32
        scales: "block" ``[rows of x, H/128]`` and ``[E_local, ceil(2I/128), H/128]`` (H a multiple
        of 128), "tensor" ``[1]`` and ``[E_local]``.
      weights: "dense" (w1 bf16, or e4m3 with ``fp8``) or "mxfp4" (MOE_WEIGHT_FORMATS; spec §13.7): w1 is
        packed e2m1 ``[E_local, 2I, H/2]`` (``torch.float4_e2m1fn_x2`` or uint8) and w1_mx_scales its ue8m0
        scales ``[E_local, 2I, H/32]`` (``torch.float8_e8m0fnu`` or uint8), rows in ``layout``'s order, H a
        multiple of 128; ``fp8`` then picks x: "block" (W4A8: e4m3 x with x_scales ``[rows of x, H/128]``)
        or "none" (W4A16: bf16 x); no w1_scales.
      num_tokens: T (default: x's rows, or x's rows / k with ``x_permuted``).
      out: bf16 ``[>= k*T, I]``, dense; rows ``[0, P)`` are written, the rest left untouched;
        allocated (``[k*T, I]``, uninitialised) when None.
      out_scale_format: ``"float32"`` or ``"ue8m0"``: the FP8 output (spec §9.8; ``fp8="block"``,
        dense weights, I a multiple of 128): ``out`` then holds the rows' e4m3 codes
        (``torch.float8_e4m3fn`` or uint8 ``[>= k*T, I]``) and ``out_scales`` their 1 x 128 scales
        ``[>= k*T, I/128]`` (float32, or ``float8_e8m0fnu`` / uint8), bitwise ``quantize_fp8`` of the
        bf16 rows; both allocated when None. Giving ``out_scales`` implies ``"float32"``.
      enable_pdl: programmatic dependent launch (GPU).
      stream: see the package docstring.

    Returns ``out``: exactly the ``A`` that moe_fc2_finalize takes (with the FP8 output, ``(out,
    out_scales)``: its ``A`` and ``a_scales``). CPU arrays run the reference.
    """
    if out_scales is not None and out_scale_format is None:
        out_scale_format = "float32"
    q_out = out_scale_format is not None
    if out is None:
        out = _new_fc1_out(x, w1, k, _fc1_tokens(x, k, num_tokens, x_permuted))
        if q_out:
            out = empty(x, tuple(out.shape), _e4m3_dtype(x))
    if q_out and out_scales is None:
        out_scales = empty(x, (out.shape[0], out.shape[1] // 128), _scale_dtype(x, out_scale_format))
    _C.moe_fc1(
        arg(_as_bytes(x)), arg(_mx_bytes(w1, weights, "moe_fc1", "W1")), arg(expert_first_token_offset),
        arg(permuted_row_to_unpermuted_row),
        arg(_as_bytes(out)), k=k, num_tokens=-1 if num_tokens is None else num_tokens, bias=arg(bias), layout=layout,
        activation=activation, limit=limit, alpha=alpha, x_permuted=x_permuted, fp8=fp8, x_scales=arg(x_scales),
        w1_scales=arg(w1_scales), weights=weights,
        w1_mx_scales=arg(_mx_bytes(w1_mx_scales, weights, "moe_fc1", "w1_mx_scales", True)),
        out_scales=arg(_as_bytes(out_scales)), out_scale_format=out_scale_format or "float32", enable_pdl=enable_pdl,
        stream=stream_of(stream, out))
    return (out, out_scales) if q_out else out


if torch is not None:
    def _fc1_fake(x, w1, k, num_tokens, x_permuted, **_):
        return _new_fc1_out(x, w1, k, _fc1_tokens(x, k, num_tokens, x_permuted))

    @custom_op("moe_fc1", fake=_fc1_fake)
    def _moe_fc1_op(x: Tensor, w1: Tensor, expert_first_token_offset: Tensor, permuted_row_to_unpermuted_row: Tensor,
                    k: int, num_tokens: int = -1, bias: Optional[Tensor] = None, layout: str = _FC1.layout,
                    activation: str = _FC1.activation, limit: float = _FC1.limit, alpha: float = _FC1.alpha,
                    x_permuted: bool = _FC1.x_permuted, enable_pdl: bool = _FC1.enable_pdl, fp8: str = _FC1.fp8,
                    x_scales: Optional[Tensor] = None, w1_scales: Optional[Tensor] = None,
                    weights: str = _FC1.weights, w1_mx_scales: Optional[Tensor] = None) -> Tensor:
        """flashmix.moe_fc1 as a custom op: a fresh bf16 ``out`` ``[k*T, I]`` (``num_tokens=-1``: T
        from x). As in the C++ API only the first P rows (``expert_first_token_offset[-1]``, on the
        device) are written; the rest is unspecified."""
        return moe_fc1(x, w1, expert_first_token_offset, permuted_row_to_unpermuted_row, k=k,
                       num_tokens=None if num_tokens < 0 else num_tokens, bias=bias, layout=layout,
                       activation=activation, limit=limit, alpha=alpha, x_permuted=x_permuted, enable_pdl=enable_pdl,
                       fp8=fp8, x_scales=x_scales, w1_scales=w1_scales, weights=weights, w1_mx_scales=w1_mx_scales)


# ---------------------------------------------------------------------------
# The routed-expert layer in one call (spec §10)
# ---------------------------------------------------------------------------

#: The ``fc1_input`` values of moe_forward (``MoeFc1Input``'s to_string names, spec §10.3).
FC1_INPUTS = _C.FC1_INPUTS


def moe_forward_workspace_size(num_tokens, k, hidden, inter, num_experts_per_node, mode=_FORWARD.mode, *,
                               with_router=True, num_experts=None, start_expert_id=_FORWARD.start_expert_id,
                               fc1_input=_FORWARD.fc1_input, fp8=_FORWARD.fp8, weights=_FORWARD.weights):
    """Bytes of device workspace moe_forward needs: every intermediate (the router's choice, the
    routing maps, the FC1 rows ``[k*T, I]`` bf16, FC2's workspace, and x's permuted copy
    ``[k*T, H]`` bf16 where ``fc1_input`` resolves to "permuted_copy"). ``with_router``: routing by
    router_logits (a little more than with the caller's ids, which it also covers);
    ``num_experts``: the router's E (``fc1_input="auto"`` estimates the rows an expert as
    T * k / max(E, E_local), so it can change the size); ``fc1_input``: as moe_forward's (the size
    depends on it); ``fp8``: as moe_forward's (FP8 activations add x's and FC1's e4m3 rows and
    scales); ``weights``: as moe_forward's (``inter`` is I itself, not the packed width)."""
    return _C.moe_forward_workspace_size(num_tokens, k, hidden, inter, 0 if num_experts is None else num_experts,
                                         num_experts_per_node, start_expert_id, with_router, mode, fc1_input, fp8,
                                         weights)


def _new_forward_out(x, fill):
    """A fresh bf16 ``[T, H]`` out (H = x.shape[1]), zeroed when not filling."""
    return empty(x, (x.shape[0], x.shape[1]), "bfloat16", zero=not fill)


def _forward_workspace(x, w2, k, out, num_experts, start_expert_id, router_logits, mode, fc1_input, fp8,
                       weights=_FORWARD.weights):
    """A fresh workspace for a CUDA call (None on the CPU, or where the shapes are off: the binding
    then names the argument)."""
    if cuda_device(out) is None or len(x.shape) != 2 or len(w2.shape) != 3:
        return None
    return new_workspace(out, moe_forward_workspace_size(
        x.shape[0], k, w2.shape[1], _inter_of_w2(w2, weights), w2.shape[0], mode,
        with_router=router_logits is not None, num_experts=num_experts, start_expert_id=start_expert_id,
        fc1_input=fc1_input, fp8=fp8, weights=weights))


def moe_forward(x, w1, w2, *, k, router_logits=None, token_selected_experts=None, token_final_scales=None,
                scoring=_FORWARD.scoring, renormalize=_FORWARD.renormalize, correction_bias=None,
                n_group=_FORWARD.n_group, topk_group=_FORWARD.topk_group,
                routed_scaling_factor=_FORWARD.routed_scaling_factor, token_ids=None, hash_table=None,
                num_experts=None, start_expert_id=_FORWARD.start_expert_id, b1=None, b2=None,
                apply_b2=_FORWARD.apply_b2,
                w1_layout=_FORWARD.w1_layout, activation=_FORWARD.activation, limit=_FORWARD.limit,
                alpha=_FORWARD.alpha, fc1_input=_FORWARD.fc1_input, mode=_FORWARD.mode, shared_output=None,
                fill=_FORWARD.fill, out=None, workspace=None, selected_experts_out=None, final_scales_out=None,
                fp8=_FORWARD.fp8, w1_scales=None, w2_scales=None, weights=_FORWARD.weights, w1_mx_scales=None,
                w2_mx_scales=None, enable_pdl=_FORWARD.enable_pdl, stream=None):
    """spec §10: the routed-expert layer in one call: [router] -> routing maps -> FC1 + activation ->
    FC2 + finalize (+ shared_output), every stage on one stream, no host sync.

    Args:
      x: bf16 ``[T, H]`` in token order (rows may be strided, a stride that is a multiple of 8).
      w1: bf16 ``[E_local, 2I, H]``; w2: bf16 ``[E_local, H, I]`` (E_local, H, I from w2).
      k: experts per token (1..16).
      Routing, one of:
        router_logits: ``[T, E]`` float32 or bfloat16: the router runs (spec §8) with ``scoring``,
          ``renormalize``, ``correction_bias`` (float32 ``[E]``), ``n_group``, ``topk_group``,
          ``routed_scaling_factor`` and (hash selection, DeepSeek-V4's first layers) ``token_ids`` with
          ``hash_table``, as moe_router's; or
        token_selected_experts (int32 ``[T, k]``, global ids) and token_final_scales (float32
          ``[T, k]``, or None = every weight 1): the caller's router.
      num_experts: E (default: ``router_logits.shape[1]``; with the caller's ids, unused).
      start_expert_id: this rank holds experts ``[start_expert_id, start_expert_id + E_local)``.
      b1: bf16 ``[E_local, 2I]`` or None; b2: bf16 ``[E_local, H]`` or None (apply_b2=False ignores it:
        all but one tensor-parallel rank).
      w1_layout, activation, limit, alpha: FC1's, as moe_fc1's ``layout``, ``activation``, ``limit``,
        ``alpha``.
      fc1_input: what FC1 reads (spec §10.3, FC1_INPUTS): "gather" (x's rows gathered in the
        kernel), "permuted_copy" (the routing maps write x's permuted rows ``[k*T, H]`` into the
        workspace) or "auto" ("permuted_copy" when ``T*k >= 64*max(E, E_local)``, except with bf16
        weights and ``I <= 1024``; else "gather"). The result is the same bit for bit; the
        workspace size depends on it.
      mode: FC2's, as moe_fc2_finalize's (FC2_MODES).
      fp8: "none" (bf16 weights) or "block" (spec §10.4, FP8_SCALINGS): w1 and w2 hold e4m3 values
        (``torch.float8_e4m3fn`` or uint8 bytes) with float32 scales per 128 x 128 block, w1_scales
        ``[E_local, ceil(2I/128), H/128]`` and w2_scales ``[E_local, ceil(H/128), I/128]``
        (``quantize_fp8(w, block="128x128")`` makes both); x stays bf16 and the layer quantises it
        and FC1's output 1 x 128 in its workspace. H and I multiples of 128.
      weights: "dense" (w1, w2 bf16, or e4m3 with fp8 "block") or "mxfp4" (MOE_WEIGHT_FORMATS; spec
        §13.7): w1 packed e2m1 ``[E_local, 2I, H/2]`` and w2 ``[E_local, H, I/2]``
        (``torch.float4_e2m1fn_x2`` or uint8; E_local, H from w2, I = 2 * w2.shape[2]) with their ue8m0
        scales w1_mx_scales ``[E_local, 2I, H/32]`` and w2_mx_scales ``[E_local, H, I/32]``
        (``torch.float8_e8m0fnu`` or uint8; ``flashmix.stack_deepseek_v4_experts`` makes all four from
        DeepSeek-V4's checkpoint), H and I multiples of 128, converted in the kernels. ``fp8`` picks the
        activations: "block" (W4A8: x and FC1's output quantised 1 x 128, as the FP8 layer) or "none"
        (W4A16: bf16, as the bf16 layer); no w1_scales / w2_scales.
      shared_output: bf16 ``[T, >= H]`` added once to every token written (a shared expert's output or
        a residual), or None.
      fill: False = tokens without a local expert are left untouched (a fresh ``out`` is zeroed).
      out: bf16 ``[T, H]`` (rows may be strided); allocated when None.
      workspace: uint8 device buffer of moe_forward_workspace_size(...) bytes, 256-byte aligned;
        allocated when None.
      selected_experts_out (int32 ``[T, k]``), final_scales_out (float32 ``[T, k]``): with
        router_logits, where to keep the router's choice (None: not kept).
      enable_pdl: programmatic dependent launch between the stages (GPU).
      stream: see the package docstring.

    Returns ``out``. CPU arrays run the stages' references, chained (FC1's rows rounded to bf16 as on
    the GPU).
    """
    if out is None:
        out = _new_forward_out(x, fill)
    if workspace is None:
        workspace = _forward_workspace(x, w2, k, out, num_experts, start_expert_id, router_logits, mode, fc1_input,
                                       fp8, weights)
    _C.moe_forward(
        arg(x), arg(_mx_bytes(w1, weights, "moe_forward", "W1")), arg(_mx_bytes(w2, weights, "moe_forward", "W2")),
        arg(out), k=k, num_experts=0 if num_experts is None else num_experts,
        start_expert_id=start_expert_id, router_logits=arg(router_logits), scoring=scoring, renormalize=renormalize,
        correction_bias=arg(correction_bias), n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, token_ids=arg(token_ids), hash_table=arg(hash_table),
        token_selected_experts=arg(token_selected_experts),
        token_final_scales=arg(token_final_scales), selected_experts_out=arg(selected_experts_out),
        final_scales_out=arg(final_scales_out), b1=arg(b1), b2=arg(b2), apply_b2=apply_b2, w1_layout=w1_layout,
        activation=activation, limit=limit, alpha=alpha, fc1_input=fc1_input, mode=mode, fp8=fp8,
        w1_scales=arg(w1_scales), w2_scales=arg(w2_scales), weights=weights,
        w1_mx_scales=arg(_mx_bytes(w1_mx_scales, weights, "moe_forward", "w1_mx_scales", True)),
        w2_mx_scales=arg(_mx_bytes(w2_mx_scales, weights, "moe_forward", "w2_mx_scales", True)),
        shared_output=arg(shared_output), fill=fill, workspace=arg(workspace), enable_pdl=enable_pdl,
        stream=stream_of(stream, out))
    return out


if torch is not None:
    @custom_op("moe_forward", fake=lambda x, **_: _new_forward_out(x, True))
    def _moe_forward_op(x: Tensor, w1: Tensor, w2: Tensor, k: int, router_logits: Optional[Tensor] = None,
                        token_selected_experts: Optional[Tensor] = None, token_final_scales: Optional[Tensor] = None,
                        scoring: str = _FORWARD.scoring, renormalize: bool = _FORWARD.renormalize,
                        correction_bias: Optional[Tensor] = None, n_group: int = _FORWARD.n_group,
                        topk_group: int = _FORWARD.topk_group,
                        routed_scaling_factor: float = _FORWARD.routed_scaling_factor, num_experts: int = -1,
                        start_expert_id: int = _FORWARD.start_expert_id, b1: Optional[Tensor] = None,
                        b2: Optional[Tensor] = None, apply_b2: bool = _FORWARD.apply_b2,
                        w1_layout: str = _FORWARD.w1_layout, activation: str = _FORWARD.activation,
                        limit: float = _FORWARD.limit, alpha: float = _FORWARD.alpha,
                        fc1_input: str = _FORWARD.fc1_input, mode: str = _FORWARD.mode,
                        shared_output: Optional[Tensor] = None, fill: bool = _FORWARD.fill,
                        enable_pdl: bool = _FORWARD.enable_pdl, fp8: str = _FORWARD.fp8,
                        w1_scales: Optional[Tensor] = None, w2_scales: Optional[Tensor] = None,
                        weights: str = _FORWARD.weights, w1_mx_scales: Optional[Tensor] = None,
                        w2_mx_scales: Optional[Tensor] = None, token_ids: Optional[Tensor] = None,
                        hash_table: Optional[Tensor] = None) -> Tensor:
        """flashmix.moe_forward as a custom op: a fresh bf16 ``out`` ``[T, H]`` (``num_experts=-1``:
        from router_logits; with ``fill=False`` tokens without a local expert are 0). The workspace
        is allocated per call (from the graph's pool inside a capture)."""
        return moe_forward(x, w1, w2, k=k, router_logits=router_logits, token_selected_experts=token_selected_experts,
                           token_final_scales=token_final_scales, scoring=scoring, renormalize=renormalize,
                           correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=routed_scaling_factor, token_ids=token_ids, hash_table=hash_table,
                           num_experts=None if num_experts < 0 else num_experts, start_expert_id=start_expert_id,
                           b1=b1, b2=b2, apply_b2=apply_b2, w1_layout=w1_layout, activation=activation, limit=limit,
                           alpha=alpha, fc1_input=fc1_input, mode=mode, shared_output=shared_output, fill=fill,
                           enable_pdl=enable_pdl, fp8=fp8, w1_scales=w1_scales, w2_scales=w2_scales, weights=weights,
                           w1_mx_scales=w1_mx_scales, w2_mx_scales=w2_mx_scales)


# ---------------------------------------------------------------------------
# MoeLayer: a torch module over moe_forward
# ---------------------------------------------------------------------------

if torch is not None:
    __all__.append("MoeLayer")

    # The root mean square of an e2m1 code drawn uniformly (spec §13.1's 8 magnitudes, either sign):
    # MoeLayer's random MXFP4 weights take the scale that brings it to 1/sqrt(fan-in).
    _E2M1_RMS = (sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8) ** 0.5

    def _mxfp4_bytes(a, name, want, device):
        """An MXFP4 tensor (packed ``float4_e2m1fn_x2`` / ue8m0 ``float8_e8m0fnu`` / uint8 / int8 torch
        tensor, or a one-byte numpy array) as uint8 on ``device``, its shape checked against ``want``."""
        from .mxfp4 import _as_bytes as one_byte
        op = "MoeLayer.load_mxfp4_experts"
        b = one_byte(a, name, op)
        if not isinstance(b, torch.Tensor):
            b = torch.from_numpy(b)
        if tuple(b.shape) != tuple(want):
            raise ValueError(f"{op}: {name}: must have shape {tuple(want)} (got {tuple(b.shape)})")
        return b.to(device)

    class MoeLayer(torch.nn.Module):
        """The routed experts of a MoE block as a torch module (forward only): ``logits = x @ gate.T``
        in torch (bf16), then ``torch.ops.flashmix.moe_forward`` (router, routing maps, FC1 +
        activation, FC2 + finalize), so it compiles with torch.compile as one graph.

        Args:
          num_experts: E, the router's width; k: experts per token; hidden: H; inter: I (per expert).
          scoring, renormalize, n_group, topk_group, routed_scaling_factor: the router's (moe_router).
          activation, w1_layout, limit, alpha: FC1's (moe_fc1's activation, layout, limit, alpha).
          fc1_input: what FC1 reads, as moe_forward's (FC1_INPUTS).
          mode: FC2's (FC2_MODES).
          bias: give the experts biases ``b1`` ``[E_local, 2I]`` and ``b2`` ``[E_local, H]`` (gpt-oss).
          correction_bias: give the router a float32 ``correction_bias`` ``[E]`` buffer (DeepSeek-V3's
            e_score_correction_bias), zeros until loaded.
          hash_vocab_size: > 0: the router selects by token id (DeepSeek-V4's first layers, spec §8.7)
            from an int32 ``hash_table`` ``[hash_vocab_size, k]`` buffer (the checkpoint's ``tid2eid``;
            zeros until loaded), and ``forward`` takes the tokens' ids.
          num_local_experts, start_expert_id: this rank's experts (expert parallelism; default: all E).
            A token none of whose experts is here gets 0 (fill).
          dtype: the weights' dtype: bfloat16 (the kernels'); device: where they live.
          weights: "dense" (default) or "mxfp4" (MOE_WEIGHT_FORMATS): the experts' weights held as
            MXFP4 (spec §13.7: packed e2m1 bytes with ue8m0 scales per 32 of K, converted in the
            kernels; DeepSeek-V4's checkpoint format), H and I multiples of 128;
            ``load_mxfp4_experts`` takes them as they are stored.
          fp8: the activations (and, with dense weights, the weights): "none", or "block" (spec
            §10.4: x and FC1's output quantised 1 x 128 in the layer; dense weights held as e4m3 with
            128 x 128 block scales). None (default): "none" with dense weights, "block" with MXFP4
            weights (W4A8, the FP8 layer's activations); ``weights="mxfp4", fp8="none"`` is W4A16
            (bf16 activations). ``load_expert_weights`` quantises bf16 weights once or takes e4m3
            weights with their scales as given.

        Parameters (``requires_grad=False``: forward only): ``gate`` ``[E, H]``, ``w1``
        ``[E_local, 2I, H]``, ``w2`` ``[E_local, H, I]`` (``float8_e4m3fn`` with fp8; with MXFP4 uint8
        packed bytes ``[E_local, 2I, H/2]`` and ``[E_local, H, I/2]``), ``b1`` / ``b2`` (or None).
        Buffers: ``correction_bias`` (or None); ``hash_table`` (or None); with fp8 and dense weights ``w1_scales``
        ``[E_local, ceil(2I/128), H/128]`` and ``w2_scales`` ``[E_local, ceil(H/128), I/128]``; with
        MXFP4 uint8 ue8m0 ``w1_mx_scales`` ``[E_local, 2I, H/32]`` and ``w2_mx_scales``
        ``[E_local, H, I/32]``. ``forward(x, shared_output=None, token_ids=None)``: x bf16 ``[..., H]``
        -> bf16 ``[..., H]``; shared_output (bf16, x's shape) is added once to every token; token_ids
        (int32 / int64, x's shape without H) only, and always, with ``hash_vocab_size``.
        """

        def __init__(self, num_experts, k, hidden, inter, *, scoring=_FORWARD.scoring,
                     renormalize=_FORWARD.renormalize, activation=_FORWARD.activation, w1_layout=_FORWARD.w1_layout,
                     n_group=_FORWARD.n_group, topk_group=_FORWARD.topk_group,
                     routed_scaling_factor=_FORWARD.routed_scaling_factor, mode=_FORWARD.mode, limit=_FORWARD.limit,
                     alpha=_FORWARD.alpha, fc1_input=_FORWARD.fc1_input, bias=False, correction_bias=False,
                     num_local_experts=None, start_expert_id=_FORWARD.start_expert_id, dtype=None, device=None,
                     fp8=None, weights=_FORWARD.weights, hash_vocab_size=0):
            super().__init__()
            if weights not in MOE_WEIGHT_FORMATS:
                raise ValueError(f"MoeLayer: weights: must be one of {MOE_WEIGHT_FORMATS} (got {weights!r})")
            mx = weights == "mxfp4"
            if fp8 is None:
                fp8 = "block" if mx else _FORWARD.fp8
            if fp8 not in ("none", "block"):
                raise ValueError(f"MoeLayer: fp8: must be 'none' or 'block' (got {fp8!r})")
            if mx and (hidden % 128 or inter % 128):
                raise ValueError(f"MoeLayer: {'hidden' if hidden % 128 else 'inter'}: must be a multiple of 128 "
                                 f"with weights='mxfp4' (got hidden={hidden}, inter={inter})")
            self.fp8, self.weights = fp8, weights
            dtype = torch.bfloat16 if dtype is None else dtype
            if dtype != torch.bfloat16:
                raise ValueError(f"MoeLayer: dtype: must be torch.bfloat16, the kernels' (got {dtype})")
            E_local = num_experts if num_local_experts is None else num_local_experts
            self.num_experts, self.k, self.hidden, self.inter = num_experts, k, hidden, inter
            self.num_local_experts, self.start_expert_id = E_local, start_expert_id
            self.scoring, self.renormalize, self.n_group, self.topk_group = scoring, renormalize, n_group, topk_group
            self.routed_scaling_factor = routed_scaling_factor
            self.activation, self.w1_layout, self.limit, self.alpha = activation, w1_layout, limit, alpha
            self.fc1_input, self.mode = fc1_input, mode
            kw = dict(dtype=dtype, device=device)

            def weight(*shape):
                return torch.nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

            self.gate = weight(num_experts, hidden)
            if mx:
                u8 = dict(dtype=torch.uint8, device=device)
                self.w1 = torch.nn.Parameter(torch.empty(E_local, 2 * inter, hidden // 2, **u8), requires_grad=False)
                self.w2 = torch.nn.Parameter(torch.empty(E_local, hidden, inter // 2, **u8), requires_grad=False)
                self.register_buffer("w1_mx_scales", torch.empty(E_local, 2 * inter, hidden // 32, **u8))
                self.register_buffer("w2_mx_scales", torch.empty(E_local, hidden, inter // 32, **u8))
                self.w1_scales = self.w2_scales = None
            elif fp8 == "block":
                e4m3 = dict(dtype=torch.float8_e4m3fn, device=device)
                self.w1 = torch.nn.Parameter(torch.empty(E_local, 2 * inter, hidden, **e4m3), requires_grad=False)
                self.w2 = torch.nn.Parameter(torch.empty(E_local, hidden, inter, **e4m3), requires_grad=False)
                blocks = lambda n: -(-n // 128)  # noqa: E731
                f32 = dict(dtype=torch.float32, device=device)
                self.register_buffer("w1_scales", torch.ones(E_local, blocks(2 * inter), blocks(hidden), **f32))
                self.register_buffer("w2_scales", torch.ones(E_local, blocks(hidden), blocks(inter), **f32))
                self.w1_mx_scales = self.w2_mx_scales = None
            else:
                self.w1 = weight(E_local, 2 * inter, hidden)
                self.w2 = weight(E_local, hidden, inter)
                self.w1_scales = self.w2_scales = self.w1_mx_scales = self.w2_mx_scales = None
            self.b1 = weight(E_local, 2 * inter) if bias else None
            self.b2 = weight(E_local, hidden) if bias else None
            self.register_buffer("correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                                 if correction_bias else None)
            self.register_buffer("hash_table", torch.zeros(hash_vocab_size, k, dtype=torch.int32, device=device)
                                 if hash_vocab_size > 0 else None)
            self.reset_parameters()

        def reset_parameters(self):
            """Normal weights of standard deviation 1/sqrt(fan-in) (with fp8: drawn in bf16, then
            quantised; MXFP4: uniformly drawn e2m1 codes with one scale that gives them that root mean
            square), zero biases."""
            with torch.no_grad():
                torch.nn.init.normal_(self.gate, std=self.hidden ** -0.5)
                if self.weights == "mxfp4":
                    import math
                    for w, s, fan_in in ((self.w1, self.w1_mx_scales, self.hidden),
                                         (self.w2, self.w2_mx_scales, self.inter)):
                        w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device=w.device))
                        s.fill_(127 + round(math.log2(fan_in ** -0.5 / _E2M1_RMS)))
                elif self.fp8 == "none":
                    torch.nn.init.normal_(self.w1, std=self.hidden ** -0.5)
                    torch.nn.init.normal_(self.w2, std=self.inter ** -0.5)
                else:
                    kw = dict(dtype=torch.bfloat16, device=self.w1.device)
                    self.load_expert_weights(torch.randn(self.w1.shape, **kw) * self.hidden ** -0.5,
                                             torch.randn(self.w2.shape, **kw) * self.inter ** -0.5)
                for b in (self.b1, self.b2):
                    if b is not None:
                        b.zero_()

        def load_expert_weights(self, w1, w2, w1_scales=None, w2_scales=None):
            """Sets the experts' weights: bf16 ``w1`` ``[E_local, 2I, H]`` and ``w2`` ``[E_local, H, I]``
            (quantised once to e4m3 with 128 x 128 block scales when the layer is fp8), or, for an fp8
            layer, e4m3 weights with their float32 block scales, taken as given (e.g. DeepSeek's
            checkpoints). An MXFP4 layer takes its weights through ``load_mxfp4_experts``."""
            if self.weights == "mxfp4":
                raise ValueError("MoeLayer.load_expert_weights: w1: an MXFP4 layer (weights='mxfp4') takes its "
                                 "experts through load_mxfp4_experts")
            with torch.no_grad():
                if self.fp8 == "none":
                    if w1_scales is not None or w2_scales is not None:
                        raise ValueError("MoeLayer.load_expert_weights: w1_scales: a bf16 layer takes no scales")
                    self.w1.copy_(w1)
                    self.w2.copy_(w2)
                    return
                if (w1_scales is None) != (w2_scales is None):
                    raise ValueError("MoeLayer.load_expert_weights: w1_scales: give both weights' scales or neither")
                if w1_scales is None:  # bf16 weights: quantised here, once
                    q1, s1 = quantize_fp8(w1.to(self.w1.device, torch.bfloat16).contiguous(), block="128x128")
                    q2, s2 = quantize_fp8(w2.to(self.w2.device, torch.bfloat16).contiguous(), block="128x128")
                else:
                    q1, s1, q2, s2 = w1, w1_scales, w2, w2_scales
                self.w1.copy_(q1.view(torch.float8_e4m3fn) if q1.dtype == torch.uint8 else q1)
                self.w2.copy_(q2.view(torch.float8_e4m3fn) if q2.dtype == torch.uint8 else q2)
                self.w1_scales.copy_(s1)
                self.w2_scales.copy_(s2)

        def load_mxfp4_experts(self, w1, w1_scales, w2, w2_scales):
            """Sets the experts from MXFP4 weights (DeepSeek-V4; spec §13): packed e2m1 ``w1``
            ``[E_local, 2I, H/2]`` and ``w2`` ``[E_local, H, I/2]`` with their ue8m0 scales ``[E_local, 2I,
            H/32]`` and ``[E_local, H, I/32]`` (torch ``float4_e2m1fn_x2`` / ``float8_e8m0fnu`` / uint8
            tensors, or uint8 numpy arrays; ``flashmix.stack_deepseek_v4_experts`` makes them from the
            checkpoint).

            What the layer keeps follows its ``weights`` and ``fp8``: an MXFP4 layer
            (``weights="mxfp4"``) keeps the bytes as given and converts them in its kernels (W4A8 or
            W4A16); a dense layer converts them here, once: ``fp8="block"`` to e4m3 with 128 x 128 block
            scales (``mxfp4_to_fp8_block``: exact unless a block's scales spread more than 14 binades,
            spec §13.2), ``fp8="none"`` to bf16 (``mxfp4_to_bf16``, the dequantised values)."""
            E, H, I = self.num_local_experts, self.hidden, self.inter
            if self.weights == "mxfp4":
                with torch.no_grad():
                    for name, a, dst in (("w1", w1, self.w1), ("w1_scales", w1_scales, self.w1_mx_scales),
                                         ("w2", w2, self.w2), ("w2_scales", w2_scales, self.w2_mx_scales)):
                        dst.copy_(_mxfp4_bytes(a, name, dst.shape, dst.device))
                return
            from .fp8 import mxfp4_to_bf16, mxfp4_to_fp8_block
            dev = self.w1.device
            b1 = _mxfp4_bytes(w1, "w1", (E, 2 * I, H // 2), dev)
            c1 = _mxfp4_bytes(w1_scales, "w1_scales", (E, 2 * I, H // 32), dev)
            b2 = _mxfp4_bytes(w2, "w2", (E, H, I // 2), dev)
            c2 = _mxfp4_bytes(w2_scales, "w2_scales", (E, H, I // 32), dev)
            with torch.no_grad():
                if self.fp8 == "block":
                    q1, s1 = mxfp4_to_fp8_block(b1, c1, block="128x128")
                    q2, s2 = mxfp4_to_fp8_block(b2, c2, block="128x128")
                    self.load_expert_weights(q1, q2, w1_scales=s1, w2_scales=s2)
                else:
                    self.load_expert_weights(mxfp4_to_bf16(b1, c1), mxfp4_to_bf16(b2, c2))

        def extra_repr(self):
            return (f"num_experts={self.num_experts}, k={self.k}, hidden={self.hidden}, inter={self.inter}, "
                    f"experts=[{self.start_expert_id}, {self.start_expert_id + self.num_local_experts}), "
                    f"scoring={self.scoring!r}, activation={self.activation!r}, w1_layout={self.w1_layout!r}, "
                    f"fc1_input={self.fc1_input!r}, mode={self.mode!r}, fp8={self.fp8!r}, weights={self.weights!r}")

        def forward(self, x, shared_output=None, token_ids=None):
            if (token_ids is None) != (self.hash_table is None):
                raise ValueError("MoeLayer.forward: token_ids: " + (
                    "the layer selects by token id (hash_vocab_size > 0): give the tokens' ids"
                    if token_ids is None else "only for a layer that selects by token id (hash_vocab_size > 0)"))
            shape = x.shape
            x2 = x.reshape(-1, self.hidden)
            logits = x2 @ self.gate.t()
            ids = None if token_ids is None else token_ids.reshape(-1)
            shared = None if shared_output is None else shared_output.reshape(-1, self.hidden)
            out = torch.ops.flashmix.moe_forward(
                x2, self.w1, self.w2, self.k, router_logits=logits, scoring=self.scoring,
                renormalize=self.renormalize, correction_bias=self.correction_bias, n_group=self.n_group,
                topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                token_ids=ids, hash_table=self.hash_table,
                num_experts=self.num_experts, start_expert_id=self.start_expert_id, b1=self.b1, b2=self.b2,
                w1_layout=self.w1_layout, activation=self.activation, limit=self.limit, alpha=self.alpha,
                fc1_input=self.fc1_input, mode=self.mode, shared_output=shared, fp8=self.fp8,
                w1_scales=self.w1_scales, w2_scales=self.w2_scales, weights=self.weights,
                w1_mx_scales=self.w1_mx_scales, w2_mx_scales=self.w2_mx_scales)
            return out.reshape(shape)
