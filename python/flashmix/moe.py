"""MoE: the routing maps (spec §1), the finalize (spec §2) and the FC2 grouped
GEMM with the finalize fused (spec §3) of docs/spec.md -- each function with
its torch custom op and shape function beside it.

Keyword defaults are the library's (the Args initialisers of
include/flashmix/moe.h, read through ``_C.moe_defaults()``); the binding
(python/src/moe.cpp) takes every argument explicitly.
"""
import collections

from ._common import _C, arg, cuda_device, defaults, dtype_name, empty, new_workspace, stream_of, torch

__all__ = [
    "build_moe_routing_maps", "build_moe_routing_maps_workspace_size", "RoutingMaps",
    "finalize_moe_routing", "debug_check_finalize_moe_routing_indices",
    "moe_fc2_finalize", "moe_fc2_finalize_workspace_size", "FC2_MODES", "FC2_GEMM_KERNELS",
]

if torch is not None:
    from ._torch_ops import Optional, Tensor, Tuple, custom_op

_DEFAULTS = defaults(_C.moe_defaults())
_ROUTING = _DEFAULTS["build_moe_routing_maps"]
_FINALIZE = _DEFAULTS["finalize_moe_routing"]
_FC2 = _DEFAULTS["moe_fc2_finalize"]

RoutingMaps = collections.namedtuple(
    "RoutingMaps", ["expert_first_token_offset", "permuted_row_to_unpermuted_row",
                    "unpermuted_row_to_permuted_row", "permuted_input"])


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
                           unpermuted_row_to_permuted_row=None, permuted_input=None, workspace=None,
                           enable_pdl=_ROUTING.enable_pdl, single_block_max_slots=_ROUTING.single_block_max_slots,
                           stream=None):
    """spec §1: the routing maps of this rank's slots (and optionally the gathered input rows).

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
    if expert_first_token_offset is None:
        expert_first_token_offset = _new_offsets(ex, num_experts_per_node)
    if permuted_row_to_unpermuted_row is None:
        permuted_row_to_unpermuted_row = _new_slot_map(ex)
    if unpermuted_row_to_permuted_row is None:
        unpermuted_row_to_permuted_row = _new_slot_map(ex)
    if input is not None and permuted_input is None:
        permuted_input = _new_permuted_input(input, ex)
    if workspace is None and cuda_device(ex) is not None:
        workspace = new_workspace(ex, _C.build_moe_routing_maps_workspace_size(
            ex.shape[0], ex.shape[1], num_experts_per_node, start_expert_id, single_block_max_slots))
    _C.build_moe_routing_maps(
        arg(ex), arg(expert_first_token_offset), arg(permuted_row_to_unpermuted_row),
        arg(unpermuted_row_to_permuted_row), num_experts_per_node=num_experts_per_node,
        start_expert_id=start_expert_id, input=arg(input), permuted_input=arg(permuted_input),
        workspace=arg(workspace), enable_pdl=enable_pdl, single_block_max_slots=single_block_max_slots,
        stream=stream_of(stream, ex))
    return RoutingMaps(expert_first_token_offset, permuted_row_to_unpermuted_row, unpermuted_row_to_permuted_row,
                       permuted_input)


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
                         chunks_per_token=_FINALIZE.chunks_per_token, stream=None):
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
      enable_pdl, threads_per_block, vectors_per_thread, chunks_per_token: launch options (GPU;
        zeros: chosen by shape).
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
        vectors_per_thread=vectors_per_thread, chunks_per_token=chunks_per_token, stream=stream_of(stream, out))
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


def _new_fc2_out(A, W2, num_tokens):
    return empty(A, (num_tokens, W2.shape[1]), "bfloat16")


def moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, *, k, num_tokens=None,
                     scales=None, bias=None, apply_bias=_FC2.apply_bias, mode=_FC2.mode, out=None,
                     out_already_zeroed=_FC2.out_already_zeroed, workspace=None, gemm_kernel=_FC2.gemm_kernel,
                     raster=_FC2.raster, swizzle=_FC2.swizzle, stream=None):
    """spec §3: the FC2 grouped GEMM with the finalize fused into its epilogue (sm_90a).

    ``out[t, :] = sum over local slots (t, j): scales[t, j] * (A[p] @ W2[e]^T + bias[e])``

    Args:
      A: bf16 ``[k*T capacity, I]`` FC1 activations in permuted order (first P rows used).
      W2: bf16 ``[E_local, H, I]``.
      expert_first_token_offset, permuted_row_to_unpermuted_row: from build_moe_routing_maps.
      k: experts per token; num_tokens: T (default: ``out.shape[0]``, else ``scales.shape[0]``).
      scales: float32 ``[T, k]`` or None; bias: bf16 ``[E_local, H]`` or None; apply_bias=False
        ignores it (all but one tensor-parallel rank).
      mode: "atomic", "atomic_fp32", "deterministic" (bitwise reproducible) or "unfused" (FC2_MODES).
      out: bf16 ``[T, H]`` (rows may be strided, even stride); allocated when None.
      out_already_zeroed: "atomic" only: ``out`` holds zeros (or a residual to add to) already.
      workspace: uint8 device buffer of moe_fc2_finalize_workspace_size(...) bytes, 256-byte
        aligned; allocated when None.
      gemm_kernel: the GEMM under the epilogue, one of FC2_GEMM_KERNELS: "auto" (the library's
        choice), or pinned: "rows" (flashmix's own), "cutlass_cooperative" or "cutlass_pingpong"
        (builds with CUTLASS only: NotImplementedError otherwise).
      raster, swizzle: tuning of the CUTLASS kernels (zeros: chosen by shape).

    Returns ``out``. CPU arrays run the reference (any mode).
    """
    if out is None:
        if out_already_zeroed:
            raise ValueError("moe_fc2_finalize: out: out_already_zeroed=True needs the caller's out")
        if num_tokens is None:
            if scales is None:
                raise ValueError("moe_fc2_finalize: num_tokens: needed to allocate out (no out, no scales)")
            num_tokens = scales.shape[0]
        out = _new_fc2_out(A, W2, num_tokens)
    device = cuda_device(out)
    if workspace is None and device is not None:
        workspace = new_workspace(out, _C.moe_fc2_finalize_workspace_size(
            out.shape[0], k, W2.shape[1], W2.shape[2], W2.shape[0], mode, device))
    _C.moe_fc2_finalize(
        arg(A), arg(W2), arg(expert_first_token_offset), arg(permuted_row_to_unpermuted_row), arg(out), k=k,
        scales=arg(scales), bias=arg(bias), apply_bias=apply_bias, mode=mode,
        out_already_zeroed=out_already_zeroed, workspace=arg(workspace), gemm_kernel=gemm_kernel, raster=raster,
        swizzle=swizzle, stream=stream_of(stream, out))
    return out


def _fc2_tokens(num_tokens, scales):
    """The torch op's T: ``num_tokens``, or ``scales.shape[0]`` when it is -1."""
    if num_tokens >= 0:
        return num_tokens
    if scales is None:
        raise ValueError("moe_fc2_finalize: num_tokens: needed when scales is None")
    return scales.shape[0]


if torch is not None:
    def _fc2_fake(A, W2, num_tokens, scales, **_):
        return _new_fc2_out(A, W2, _fc2_tokens(num_tokens, scales))

    @custom_op("moe_fc2_finalize", fake=_fc2_fake)
    def _moe_fc2_finalize_op(A: Tensor, W2: Tensor, expert_first_token_offset: Tensor,
                             permuted_row_to_unpermuted_row: Tensor, k: int, num_tokens: int = -1,
                             scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                             apply_bias: bool = _FC2.apply_bias, mode: str = _FC2.mode) -> Tensor:
        """flashmix.moe_fc2_finalize as a custom op: a fresh bf16 ``out`` ``[T, H]``. T is
        ``num_tokens``, or ``scales.shape[0]`` when ``num_tokens=-1``."""
        return moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, k=k,
                                num_tokens=_fc2_tokens(num_tokens, scales), scales=scales, bias=bias,
                                apply_bias=apply_bias, mode=mode)
