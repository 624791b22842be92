// Internal to the mHC ops: a boundary op's halves (mhc_post_pre, mhc_post_head;
// spec §4.7, §4.10) as the single ops' arguments. The GPU's two-launch paths
// (mhc.cu, MhcBoundaryPath::kPostThenPre) and the CPU references
// (mhc_cpu.cpp) run the boundary as these two calls.
#pragma once

#include "flashmix/mhc.h"

namespace flashmix {

// This layer's post, writing X_next to `x_next` (and its scales on the FP8
// stream to `x_next_scales`).
template <typename Args>
MhcPostArgs boundary_post_args(const Args& a, void* x_next, void* x_next_scales) {
  MhcPostArgs post;
  post.shape = a.shape;
  post.x = a.x;
  post.f_out = a.f_out;
  post.h_post = a.h_post;
  post.h_res = a.h_res;
  post.x_next = x_next;
  post.res_layout = a.res_layout;
  post.enable_pdl = a.enable_pdl;
  post.residual = a.residual;
  post.x_scales = a.x_scales;
  post.x_next_scales = x_next_scales;
  post.x_scale_format = a.x_scale_format;
  return post;
}

// mhc_post_pre's next pre on the stored X_next (x_next, x_next_scales), with
// every other field of the boundary's and the projection kernel `kernel`.
inline MhcPreArgs boundary_pre_args(const MhcPostPreArgs& a, MhcPreKernel kernel) {
  MhcPreArgs pre;
  pre.shape = a.shape;
  pre.x = a.x_next;
  pre.phi = a.phi;
  pre.phi_dtype = a.phi_dtype;
  pre.alpha = a.alpha;
  pre.bias = a.bias;
  pre.f_pre = a.f_pre;
  pre.h_post = a.h_post_next;
  pre.h_res = a.h_res_next;
  pre.params = a.params;
  pre.enable_pdl = a.enable_pdl;
  pre.prefetch_weights = a.prefetch_weights;
  pre.workspace = a.workspace;
  pre.workspace_bytes = a.workspace_bytes;
  pre.kernel = kernel;
  pre.residual = a.residual;
  pre.x_scales = a.x_next_scales;
  pre.x_scale_format = a.x_scale_format;
  pre.norm_weight = a.norm_weight;
  pre.norm_weight_dtype = a.norm_weight_dtype;
  pre.norm_eps = a.norm_eps;
  pre.f_pre_fp8 = a.f_pre_fp8;
  pre.f_pre_scales = a.f_pre_scales;
  pre.f_pre_scale_format = a.f_pre_scale_format;
  return pre;
}

// mhc_post_head's head on the stored X_next (x_next, x_next_scales), with
// every other field of the boundary's and the projection kernel `kernel`.
inline MhcHeadArgs boundary_head_args(const MhcPostHeadArgs& a, const void* x_next, const void* x_next_scales,
                                      MhcPreKernel kernel) {
  MhcHeadArgs head;
  head.shape = a.shape;
  head.x = x_next;
  head.phi = a.phi;
  head.phi_dtype = a.phi_dtype;
  head.alpha = a.alpha;
  head.bias = a.bias;
  head.out = a.out;
  head.eps_norm = a.eps_norm;
  head.eps_pre = a.eps_pre;
  head.enable_pdl = a.enable_pdl;
  head.workspace = a.workspace;
  head.workspace_bytes = a.workspace_bytes;
  head.kernel = kernel;
  head.residual = a.residual;
  head.x_scales = x_next_scales;
  head.x_scale_format = a.x_scale_format;
  return head;
}

}  // namespace flashmix
