"""torch custom ops over flashmix: torch.ops.flashmix.{build_moe_routing_maps, finalize_moe_routing,
moe_fc2_finalize, mhc_expand, mhc_pre, mhc_pre_with_workspace, mhc_post, mhc_head} -- a whole MoE layer's end
and a whole mHC
model (expand at the embedding, pre/post around every sublayer, head before the LM head) in compiled code.

Functional (outputs are fresh tensors, inputs are not written; the one
exception, mhc_pre_with_workspace, declares its workspace mutated: the
kernel uses it and leaves it zeroed), with fake
implementations (shape functions), so they trace under torch.compile (one
graph node each, no graph break) and work inside CUDA graphs (the real
implementation allocates from the current stream's pool and launches on the
current stream). Forward only: no autograd formula is registered.
Imported by flashmix/__init__.py when torch is importable.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _mhc_hidden, _streams_from_coefficients
from . import build_moe_routing_maps as _build_moe_routing_maps
from . import finalize_moe_routing as _finalize_moe_routing
from . import mhc_expand as _mhc_expand
from . import mhc_head as _mhc_head
from . import mhc_post as _mhc_post
from . import mhc_pre as _mhc_pre
from . import moe_fc2_finalize as _moe_fc2_finalize


@torch.library.custom_op("flashmix::build_moe_routing_maps", mutates_args=())
def build_moe_routing_maps(token_selected_experts: Tensor, num_experts_per_node: int, start_expert_id: int = 0,
                           input: Optional[Tensor] = None,
                           enable_pdl: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """flashmix.build_moe_routing_maps as a custom op: (expert_first_token_offset int64 ``[E_local + 1]``,
    permuted_row_to_unpermuted_row int32 ``[k*T]``, unpermuted_row_to_permuted_row int32 ``[k*T]``,
    permuted_input ``[k*T, H]``). As in the C++ API, P = ``expert_first_token_offset[-1]`` (on the
    device) and only the first P entries of permuted_row_to_unpermuted_row and rows of
    permuted_input are written; the rest is unspecified. Without ``input``, permuted_input is an
    empty ``[0, 0]`` tensor."""
    maps = _build_moe_routing_maps(token_selected_experts, num_experts_per_node=num_experts_per_node,
                                   start_expert_id=start_expert_id, input=input, enable_pdl=enable_pdl)
    permuted = maps.permuted_input if input is not None else token_selected_experts.new_empty((0, 0))
    return (maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row,
            maps.unpermuted_row_to_permuted_row, permuted)


@build_moe_routing_maps.register_fake
def _(token_selected_experts, num_experts_per_node, start_expert_id=0, input=None, enable_pdl=True):
    slots = token_selected_experts.shape[0] * token_selected_experts.shape[1]
    ex = token_selected_experts
    return (ex.new_empty((num_experts_per_node + 1,), dtype=torch.int64), ex.new_empty((slots,)),
            ex.new_empty((slots,)),
            input.new_empty((slots, input.shape[1])) if input is not None else ex.new_empty((0, 0)))


@torch.library.custom_op("flashmix::moe_fc2_finalize", mutates_args=())
def moe_fc2_finalize(A: Tensor, W2: Tensor, expert_first_token_offset: Tensor, permuted_row_to_unpermuted_row: Tensor,
                     k: int, num_tokens: int = -1, scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                     apply_bias: bool = True, mode: str = "atomic") -> Tensor:
    """flashmix.moe_fc2_finalize as a custom op: a fresh bf16 ``out`` ``[T, H]``. T is ``num_tokens``,
    or ``scales.shape[0]`` when ``num_tokens=-1``."""
    return _moe_fc2_finalize(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, k=k,
                             num_tokens=_fc2_tokens(num_tokens, scales), scales=scales, bias=bias,
                             apply_bias=apply_bias, mode=mode)


def _fc2_tokens(num_tokens, scales):
    if num_tokens >= 0:
        return num_tokens
    if scales is None:
        raise ValueError("moe_fc2_finalize: num_tokens: needed when scales is None")
    return scales.shape[0]


@moe_fc2_finalize.register_fake
def _(A, W2, expert_first_token_offset, permuted_row_to_unpermuted_row, k, num_tokens=-1, scales=None, bias=None,
      apply_bias=True, mode="atomic"):
    return A.new_empty((_fc2_tokens(num_tokens, scales), W2.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("flashmix::mhc_expand", mutates_args=())
def mhc_expand(embedding: Tensor, n: int, enable_pdl: bool = True) -> Tensor:
    """flashmix.mhc_expand as a custom op: a fresh X bf16 ``[B, n, C]`` holding n copies of the embedding."""
    return _mhc_expand(embedding, n=n, enable_pdl=enable_pdl)


@mhc_expand.register_fake
def _(embedding, n, enable_pdl=True):
    return embedding.new_empty((embedding.shape[0], n, embedding.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("flashmix::mhc_head", mutates_args=())
def mhc_head(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, eps_norm: float = 1e-6, eps_pre: float = 1e-6,
             enable_pdl: bool = True) -> Tensor:
    """flashmix.mhc_head as a custom op: a fresh bf16 ``[B, C]`` (phi ``[n, n*C]``)."""
    return _mhc_head(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, enable_pdl=enable_pdl)


@mhc_head.register_fake
def _(x, phi, alpha, bias, eps_norm=1e-6, eps_pre=1e-6, enable_pdl=True):
    return x.new_empty((x.shape[0], _mhc_hidden(x, phi.shape[0], "mhc_head")), dtype=torch.bfloat16)


@torch.library.custom_op("flashmix::finalize_moe_routing", mutates_args=())
def finalize_moe_routing(expanded_permuted_rows: Tensor, unpermuted_row_to_permuted_row: Tensor,
                         token_selected_experts: Tensor, num_experts_per_node: int, start_expert_id: int = 0,
                         scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                         shared_output: Optional[Tensor] = None, hidden: int = -1,
                         out_dtype: Optional[torch.dtype] = None, fill: bool = True,
                         permuted_row_to_unpermuted_row: Optional[Tensor] = None,
                         expert_first_token_offset: Optional[Tensor] = None, enable_pdl: bool = True,
                         prefetch_indices: bool = False) -> Tensor:
    """flashmix.finalize_moe_routing as a custom op; returns a fresh ``out`` ``[T, H]``
    (``hidden=-1``: H = padded_H; with ``fill=False`` tokens without a local slot are 0;
    ``prefetch_indices`` as in flashmix.finalize_moe_routing)."""
    return _finalize_moe_routing(
        expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts,
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=scales, bias=bias,
        shared_output=shared_output, hidden=None if hidden < 0 else hidden, out_dtype=out_dtype, fill=fill,
        permuted_row_to_unpermuted_row=permuted_row_to_unpermuted_row,
        expert_first_token_offset=expert_first_token_offset, enable_pdl=enable_pdl,
        prefetch_indices=prefetch_indices)


@finalize_moe_routing.register_fake
def _(expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts, num_experts_per_node,
      start_expert_id=0, scales=None, bias=None, shared_output=None, hidden=-1, out_dtype=None, fill=True,
      permuted_row_to_unpermuted_row=None, expert_first_token_offset=None, enable_pdl=True, prefetch_indices=False):
    H = expanded_permuted_rows.shape[1] if hidden < 0 else hidden
    dtype = expanded_permuted_rows.dtype if out_dtype is None else out_dtype
    return expanded_permuted_rows.new_empty((token_selected_experts.shape[0], H), dtype=dtype)


def _mhc_pre_outputs_like(x, phi):
    """The shapes of mhc_pre's outputs (f_pre bf16 [B, C], h_post fp32 [B, n], h_res fp32 [B, n, n]),
    for the fake implementations."""
    n = _streams_from_coefficients(phi.shape[0], "mhc_pre", "phi")
    B, C = x.shape[0], _mhc_hidden(x, n, "mhc_pre")
    return (x.new_empty((B, C), dtype=torch.bfloat16), x.new_empty((B, n), dtype=torch.float32),
            x.new_empty((B, n, n), dtype=torch.float32))


@torch.library.custom_op("flashmix::mhc_pre", mutates_args=())
def mhc_pre(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, eps_norm: float = 1e-6, eps_pre: float = 1e-6,
            post_mult: float = 2.0, eps_sinkhorn: float = 1e-6, sinkhorn_iters: int = 20, enable_pdl: bool = True,
            prefetch_weights: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """flashmix.mhc_pre as a custom op: (f_pre bf16 [B, C], h_post fp32 [B, n], h_res fp32 [B, n, n])."""
    out = _mhc_pre(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                   eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                   prefetch_weights=prefetch_weights)
    return tuple(out)


@mhc_pre.register_fake
def _(x, phi, alpha, bias, eps_norm=1e-6, eps_pre=1e-6, post_mult=2.0, eps_sinkhorn=1e-6, sinkhorn_iters=20,
      enable_pdl=True, prefetch_weights=False):
    return _mhc_pre_outputs_like(x, phi)


# A separate op rather than an optional argument of mhc_pre: torch 2.11's
# functionalization fails (IndexError under torch.compile) on an Optional
# tensor in mutates_args when the caller leaves it None.
@torch.library.custom_op("flashmix::mhc_pre_with_workspace", mutates_args=("workspace",))
def mhc_pre_with_workspace(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, workspace: Tensor,
                           eps_norm: float = 1e-6, eps_pre: float = 1e-6, post_mult: float = 2.0,
                           eps_sinkhorn: float = 1e-6, sinkhorn_iters: int = 20, enable_pdl: bool = True,
                           prefetch_weights: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """flashmix.mhc_pre with the small-batch workspace (uint8 ``[mhc_workspace_bytes(B, n, C)]``,
    zeroed once by the caller; left zeroed) as a custom op; outputs as mhc_pre."""
    out = _mhc_pre(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                   eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                   prefetch_weights=prefetch_weights, workspace=workspace)
    return tuple(out)


@mhc_pre_with_workspace.register_fake
def _(x, phi, alpha, bias, workspace, eps_norm=1e-6, eps_pre=1e-6, post_mult=2.0, eps_sinkhorn=1e-6,
      sinkhorn_iters=20, enable_pdl=True, prefetch_weights=False):
    return _mhc_pre_outputs_like(x, phi)


@torch.library.custom_op("flashmix::mhc_post", mutates_args=())
def mhc_post(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, res_layout: str = "deepseek",
             enable_pdl: bool = True) -> Tensor:
    """flashmix.mhc_post as a custom op: a fresh X_next of X's shape."""
    return _mhc_post(x, f_out, h_post, h_res, res_layout=res_layout, enable_pdl=enable_pdl)


@mhc_post.register_fake
def _(x, f_out, h_post, h_res, res_layout="deepseek", enable_pdl=True):
    return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
