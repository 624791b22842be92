"""torch custom ops over flashmix: torch.ops.flashmix.{finalize_moe_routing, mhc_pre, mhc_post}.

Functional (outputs are fresh tensors, inputs are not written), with fake
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
from . import finalize_moe_routing as _finalize_moe_routing
from . import mhc_post as _mhc_post
from . import mhc_pre as _mhc_pre


@torch.library.custom_op("flashmix::finalize_moe_routing", mutates_args=())
def finalize_moe_routing(expanded_permuted_rows: Tensor, unpermuted_row_to_permuted_row: Tensor,
                         token_selected_experts: Tensor, num_experts_per_node: int, start_expert_id: int = 0,
                         scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                         shared_output: Optional[Tensor] = None, hidden: int = -1,
                         out_dtype: Optional[torch.dtype] = None, fill: bool = True,
                         permuted_row_to_unpermuted_row: Optional[Tensor] = None,
                         expert_first_token_offset: Optional[Tensor] = None, enable_pdl: bool = True) -> Tensor:
    """flashmix.finalize_moe_routing as a custom op; returns a fresh ``out`` ``[T, H]``
    (``hidden=-1``: H = padded_H; with ``fill=False`` tokens without a local slot are 0)."""
    return _finalize_moe_routing(
        expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts,
        num_experts_per_node=num_experts_per_node, start_expert_id=start_expert_id, scales=scales, bias=bias,
        shared_output=shared_output, hidden=None if hidden < 0 else hidden, out_dtype=out_dtype, fill=fill,
        permuted_row_to_unpermuted_row=permuted_row_to_unpermuted_row,
        expert_first_token_offset=expert_first_token_offset, enable_pdl=enable_pdl)


@finalize_moe_routing.register_fake
def _(expanded_permuted_rows, unpermuted_row_to_permuted_row, token_selected_experts, num_experts_per_node,
      start_expert_id=0, scales=None, bias=None, shared_output=None, hidden=-1, out_dtype=None, fill=True,
      permuted_row_to_unpermuted_row=None, expert_first_token_offset=None, enable_pdl=True):
    H = expanded_permuted_rows.shape[1] if hidden < 0 else hidden
    dtype = expanded_permuted_rows.dtype if out_dtype is None else out_dtype
    return expanded_permuted_rows.new_empty((token_selected_experts.shape[0], H), dtype=dtype)


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
    n = _streams_from_coefficients(phi.shape[0], "mhc_pre", "phi")
    B, C = x.shape[0], _mhc_hidden(x, n, "mhc_pre")
    return (x.new_empty((B, C), dtype=torch.bfloat16), x.new_empty((B, n), dtype=torch.float32),
            x.new_empty((B, n, n), dtype=torch.float32))


@torch.library.custom_op("flashmix::mhc_post", mutates_args=())
def mhc_post(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, res_layout: str = "deepseek",
             enable_pdl: bool = True) -> Tensor:
    """flashmix.mhc_post as a custom op: a fresh X_next of X's shape."""
    return _mhc_post(x, f_out, h_post, h_res, res_layout=res_layout, enable_pdl=enable_pdl)


@mhc_post.register_fake
def _(x, f_out, h_post, h_res, res_layout="deepseek", enable_pdl=True):
    return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
