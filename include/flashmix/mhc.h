// flashmix: mHC (manifold-constrained hyper-connections) forward, docs/spec.md §4.
//
// Layouts:
//   X      bf16 [B, n, C] contiguous, seen as [B, K] with K = n*C, stream-major: X[b, i*C + c]
//   phi    [N, K] row-major (K contiguous), fp32 or bf16, N = n*n + 2n
//   alpha  fp32 [3] (pre, post, res), device memory
//   bias   fp32 [N], device memory
//   coefficient order along N: [pre n | post n | res n*n], res row-major n x n
//
//   r[b]        = sqrt(sum_k X[b,k]^2 / K + eps_norm)
//   h[b, m]     = alpha_of(m) * (sum_k X[b,k] * phi[m,k]) / r[b] + bias[m]
//   H_pre[b,i]  = sigmoid(h[b,i]) + eps_pre
//   H_post[b,i] = post_mult * sigmoid(h[b,n+i])
//   H_res[b]    = Sinkhorn(h[b, 2n:] as n x n)  (row softmax + eps, column normalisation,
//                 then sinkhorn_iters - 1 rounds of row and column normalisation, each
//                 dividing by (sum + eps_sinkhorn))
//   F_pre[b,c]  = sum_i H_pre[b,i] * X[b,i,c]
//   X_next[b,i,c] = sum_j R[b,i,j] * X[b,j,c] + H_post[b,i] * F_out[b,c]
//                 R = H_res^T (res_layout deepseek) or H_res (row_mix, the seed's kernel)
//
// Every op: any n in [1, 8], any C that is a multiple of 8, B >= 0 (B == 0 launches
// nothing). GPU entry points are asynchronous on the given stream, never
// synchronise, and are safe to capture in a CUDA graph; all arguments are
// validated on the host (alpha and bias are never read on the host), and no
// output may overlap an input or another output (kInvalidArgument). The
// `_cpu` functions are the reference backend (host pointers, double
// accumulation, one rounding at the store) with the same validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "flashmix/dtype.h"
#include "flashmix/fp8.h"
#include "flashmix/status.h"

namespace flashmix {

constexpr int kMhcMaxStreams = 8;

enum class MhcResLayout {
  kDeepSeek,  // X_next[i] = sum_j H_res[j, i] * X[j]   (R = H_res^T)
  kRowMix,    // X_next[i] = sum_j H_res[i, j] * X[j]   (R = H_res, the seed's kernel)
};

// spec §4 parameters with DeepSeek's defaults. MhcParams::seed() is the seed
// document's setting: all eps 0 (plain exp-then-normalise Sinkhorn, no eps in r).
struct MhcParams {
  float eps_norm = 1e-6f;
  float eps_pre = 1e-6f;
  float post_mult = 2.0f;
  float eps_sinkhorn = 1e-6f;
  int sinkhorn_iters = 20;  // >= 1
  // Validated but not read by mhc_pre / mhc_activate: they always write H_res
  // row-major (untransposed). It is carried for the caller's mhc_post, which
  // takes its own MhcPostArgs::res_layout.
  MhcResLayout res_layout = MhcResLayout::kDeepSeek;

  static MhcParams seed() {
    MhcParams p;
    p.eps_norm = 0.0f;
    p.eps_pre = 0.0f;
    p.eps_sinkhorn = 0.0f;
    return p;
  }
};

// Shape shared by every op.
struct MhcShape {
  int64_t batch = 0;   // B, tokens (0 is valid)
  int n = 4;           // streams, 1..8
  int64_t hidden = 0;  // C, a positive multiple of 8
};

// How the residual stream X (and X_next) is stored (spec §4.9).
//   kBf16     bf16 [B, n*C] (every op)
//   kFp8E4m3  e4m3 codes [B, n*C] (one byte per element, the bf16 layout) plus
//             one scale per (token, stream, 128 channels), [B, n, C/128] dense,
//             float or ue8m0 by the op's x_scale_format; C % 128 == 0. An
//             element's value is fp32(e4m3(code) * scale). Taken by
//             mhc_expand, mhc_post, mhc_pre, mhc_post_pre, mhc_head and
//             mhc_post_head (their residual, x_scales, x_scale_format fields); the stages
//             (mhc_project, mhc_activate, mhc_pre_mix) stay bf16.
enum class MhcResidual : int { kBf16 = 0, kFp8E4m3 = 1 };
const char* to_string(MhcResidual residual);  // "bf16", "fp8_e4m3"

// Scales of an FP8 residual stream of `shape`: B * n * (C / 128) (spec §4.9;
// 0 for a hidden size that is not a multiple of 128).
inline int64_t mhc_x_scale_count(const MhcShape& shape) {
  return shape.hidden % 128 == 0 ? shape.batch * shape.n * (shape.hidden / 128) : 0;
}

// mhc_pre: X -> (F_pre, H_post, H_res) in one operation (X read from device memory once).
// The projection kernel of mhc_pre, mhc_project, mhc_head and the boundary ops. kAuto (the
// default) picks the first of these that takes the shape on the current
// device, in this order (docs/spec.md §4 states each one's conditions):
//   kResident     sm_90, n = 4, C a multiple of 1024 up to 7168; mhc_head on the bf16
//                 stream (its out bitwise mhc_pre's F_pre there); F_pre's epilogue as a
//                 pass after it; the FP8 residual stream for mhc_pre only (not the boundary)
//   kSplit        a workspace and 1 <= B <= kMhcSplitMaxBatch; F_pre's epilogue as a pass
//                 after it; bf16 stream only
//   kClusterTile  sm_90, a tile of 8-24 tokens of the shape fits in shared memory; F_pre's
//                 epilogue inside the kernel
//   kPortable     any GPU, any shape; no F_pre epilogue
// (F_pre epilogue: the norm / FP8 fields of MhcPreArgs and MhcPostPreArgs, spec §4.8. The
// pass needs the plain F_pre stored: f_pre given, or a workspace of
// mhc_epilogue_workspace_bytes; without either the resident and split kernels cannot
// take a call with the epilogue, and kAuto goes on to the cluster tiles.)
// Any other value pins that kernel: where it cannot take the shape the call
// fails with kNotSupported and says why, launching nothing. Results agree
// within the stated tolerance between kernels; each one is bitwise
// reproducible on its own.
enum class MhcPreKernel { kAuto, kResident, kSplit, kClusterTile, kPortable };
const char* to_string(MhcPreKernel kernel);

struct MhcPreArgs {
  MhcShape shape;
  const void* x = nullptr;      // bf16 [B, n*C], 16-byte aligned (kFp8E4m3: e4m3 codes)
  const void* phi = nullptr;    // [N, n*C], 16-byte aligned
  DType phi_dtype = DType::kFloat32;  // kFloat32 (tensor cores, better than TF32) or kBFloat16
  const float* alpha = nullptr; // [3] device
  const float* bias = nullptr;  // [N] device
  void* f_pre = nullptr;        // bf16 [B, C], 16-byte aligned
  float* h_post = nullptr;      // fp32 [B, n]
  float* h_res = nullptr;       // fp32 [B, n, n] (row-major H_res, before any transpose)
  MhcParams params;
  bool enable_pdl = true;       // programmatic dependent launch; results identical either way
  // With enable_pdl: read the weights (phi, alpha, bias) before the kernel
  // ahead of this one on the stream has finished, hiding their load behind
  // its tail (decode B = 16 on an H200: ~11.9 -> ~8.7 us). Set it only when that
  // kernel does not write them (inference weights); X is always read after.
  bool prefetch_weights = false;
  // Optional workspace for small batches (see mhc_workspace_bytes): with it,
  // B <= kMhcSplitMaxBatch runs on every SM in one launch (decode).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  MhcPreKernel kernel = MhcPreKernel::kAuto;  // which projection kernel (see MhcPreKernel)
  // The FP8 residual stream (spec §4.9; default kBf16, x_scales then null).
  // With kFp8E4m3, x is e4m3 codes [B, n*C] and x_scales their [B, n, C/128]
  // scales (C % 128 == 0), each element read as fp32(e4m3(code) * scale);
  // the cluster-tile and portable kernels take it (kResident / kSplit
  // pinned: kNotSupported).
  MhcResidual residual = MhcResidual::kBf16;
  const void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only)
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;
  // F_pre's epilogue (spec §4.8; defaults: off): the next sublayer's input
  // RMSNorm and an FP8 copy, as in MhcPostPreArgs: inside the cluster-tile
  // kernel, or as a pass after the resident or split kernel where the plain
  // F_pre can be kept (f_pre, or mhc_epilogue_workspace_bytes of workspace);
  // kPortable pinned: kNotSupported.
  const void* norm_weight = nullptr;
  DType norm_weight_dtype = DType::kBFloat16;
  float norm_eps = 1e-6f;
  void* f_pre_fp8 = nullptr;
  void* f_pre_scales = nullptr;
  ScaleFormat f_pre_scale_format = ScaleFormat::kFloat32;
};

// mhc_post: X_next = R * X + H_post * F_out in one pass.
struct MhcPostArgs {
  MhcShape shape;
  const void* x = nullptr;       // bf16 [B, n*C] (kFp8E4m3: e4m3 codes [B, n*C])
  const void* f_out = nullptr;   // bf16 [B, C]
  const float* h_post = nullptr; // fp32 [B, n]
  const float* h_res = nullptr;  // fp32 [B, n, n]
  void* x_next = nullptr;        // bf16 [B, n*C] (kFp8E4m3: e4m3 codes); must not overlap any input
  MhcResLayout res_layout = MhcResLayout::kDeepSeek;
  bool enable_pdl = true;
  // The FP8 residual stream (spec §4.9; default kBf16, the scale pointers
  // then null). With kFp8E4m3 both X and X_next are e4m3 codes with one
  // scale per (token, stream, 128 channels), C % 128 == 0: X_next is made in
  // fp32 in a fixed order (acc = H_post * F_out, then acc = fma(R_ij, X_j, acc)
  // for j = 0..n-1) and each 128-channel block quantised as quantize_fp8's
  // 1 x 128 rule (spec §12.1) in the same pass, with no bf16 rounding between.
  MhcResidual residual = MhcResidual::kBf16;
  const void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only)
  void* x_next_scales = nullptr;   // [B, n, C/128] float or uint8 (kFp8E4m3 only)
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;  // of x_scales and x_next_scales
};

// Stage 1: the projection with the sum of squares: h (before the activations,
// alpha/r/bias applied) and r.
struct MhcProjectArgs {
  MhcShape shape;
  const void* x = nullptr;
  const void* phi = nullptr;
  DType phi_dtype = DType::kFloat32;
  const float* alpha = nullptr;  // [3] device
  const float* bias = nullptr;   // [N] device
  float* h = nullptr;            // fp32 [B, N]
  float* r = nullptr;            // fp32 [B]
  float eps_norm = 1e-6f;
  bool enable_pdl = true;
  bool prefetch_weights = false;  // as in MhcPreArgs
  void* workspace = nullptr;      // as in MhcPreArgs
  size_t workspace_bytes = 0;
  MhcPreKernel kernel = MhcPreKernel::kAuto;  // which projection kernel (see MhcPreKernel)
};

// Stage 2: the activations and Sinkhorn: h -> H_pre, H_post, H_res.
struct MhcActivateArgs {
  MhcShape shape;               // hidden is not used (may be any value >= 0)
  const float* h = nullptr;     // fp32 [B, N]
  float* h_pre = nullptr;       // fp32 [B, n]
  float* h_post = nullptr;      // fp32 [B, n]
  float* h_res = nullptr;       // fp32 [B, n, n]
  MhcParams params;             // eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters
  bool enable_pdl = true;
};

// Stage 3: the pre mix: F_pre[b, c] = sum_i H_pre[b, i] * X[b, i, c].
struct MhcPreMixArgs {
  MhcShape shape;
  const void* x = nullptr;       // bf16 [B, n*C]
  const float* h_pre = nullptr;  // fp32 [B, n]
  void* f_pre = nullptr;         // bf16 [B, C]
  bool enable_pdl = true;
};

// mhc_head (before the final LM head): the pre mix only, with phi [n, K]:
//   h[b,i] = alpha[0] * (X[b] . phi[i]) / r[b] + bias[i];  out[b,c] = sum_i (sigmoid(h[b,i]) + eps_pre) X[b,i,c]
struct MhcHeadArgs {
  MhcShape shape;
  const void* x = nullptr;
  const void* phi = nullptr;       // [n, K]
  DType phi_dtype = DType::kFloat32;
  const float* alpha = nullptr;    // [1] device (alpha_pre)
  const float* bias = nullptr;     // [n] device
  void* out = nullptr;             // bf16 [B, C]
  float eps_norm = 1e-6f;
  float eps_pre = 1e-6f;
  bool enable_pdl = true;
  void* workspace = nullptr;       // as in MhcPreArgs
  size_t workspace_bytes = 0;
  MhcPreKernel kernel = MhcPreKernel::kAuto;  // which projection kernel (see MhcPreKernel)
  // The FP8 residual stream, as in MhcPreArgs (spec §4.9).
  MhcResidual residual = MhcResidual::kBf16;
  const void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only)
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;
};

// How mhc_post_pre runs (spec §4.7):
//   kFused        one kernel: the projection kernel (MhcPostPreArgs::kernel)
//                 makes X_next on chip from X and F_out; X_next written once,
//                 never read back
//   kPostThenPre  mhc_post writes X_next, then mhc_pre (pinned to `kernel`,
//                 with the same workspace, epilogue and FP8 stream) reads it
//                 back: two launches, X_next's bytes read once more
//   kAuto         with F_pre's epilogue (norm_weight or f_pre_fp8) and the
//                 plain F_pre kept (f_pre given, or mhc_epilogue_workspace_bytes
//                 of workspace): the path and kernel of the call without the
//                 epilogue where that kernel is the resident or split one (the
//                 epilogue then a pass after it: 1812 against 659 us at
//                 B = 8192, 41.5 against 15.5 us at decode B = 16); else as
//                 follows. kFused where `kernel` is pinned, F_pre's epilogue
//                 is on (in the cluster tiles) or
//                 the fused op's own kernel choice is the split kernel (a
//                 workspace and B <= 16; or B <= kMhcSplitMaxBatch where the
//                 resident kernel cannot take the shape: not measured against
//                 the two launches); else kPostThenPre with mhc_pre's own
//                 choice. Measured on an H100 (docs/mhc.md): without the
//                 epilogue the fused resident and cluster-tile kernels are
//                 slower than the two launches on every shape measured
//                 (B = 8192: 888 against 570 us; B = 256 / 1024 / 2048: 48 /
//                 134 / 241 against 29 / 87 / 156 us; decode B = 16 without a
//                 workspace: 20.1 against 13.6 us; the FP8 stream: 1455
//                 against 557 us), the split kernel faster (11.1 against
//                 12.6 us), and with the epilogue in the cluster tiles fused
//                 (1817 against 1954 us).
// Either path's results are bitwise those of mhc_post then mhc_pre pinned
// to the projection kernel mhc_post_pre_kernel_choice reports.
enum class MhcBoundaryPath { kAuto, kFused, kPostThenPre };
const char* to_string(MhcBoundaryPath path);

// mhc_post_pre: a layer boundary in one operation, this layer's mhc_post
// followed by the next sublayer's mhc_pre:
//   X_next = R * X + H_post * F_out                       (mhc_post, res_layout)
//   (F_pre, H_post_next, H_res_next) = mhc_pre(X_next)    (phi, alpha, bias, params of the next pre)
// On the fused path X is read once and X_next written once; the next pre's
// projection, sum of squares and mix use X_next as it is made on chip
// (bf16-rounded, exactly the values stored), never read back (`path` says
// when the two-launch path runs instead). Bitwise equal to mhc_post then
// mhc_pre pinned to the same projection kernel (spec §4.7). Fused kernels:
// kResident (n = 4, C a multiple of 1024 up to 7168, F_pre's epilogue as a
// pass after it, bf16 stream), kSplit (a workspace, 1 <= B <= kMhcSplitMaxBatch,
// the epilogue as a pass, bf16 stream) and kClusterTile (the rest of sm_90,
// the epilogue inside it, and the FP8 residual stream); kAuto picks them in that order
// (the split kernel first with a workspace and B <= 16: spec §4.6); kPortable
// has no fused form (kNotSupported on the fused path). On the post-then-pre
// path `kernel` is the pre's, as MhcPreArgs::kernel (any of them).
struct MhcPostPreArgs {
  MhcShape shape;
  // This layer's post (inputs).
  const void* x = nullptr;        // bf16 [B, n*C], X_L (kFp8E4m3: e4m3 codes)
  const void* f_out = nullptr;    // bf16 [B, C], the sublayer's output
  const float* h_post = nullptr;  // fp32 [B, n]
  const float* h_res = nullptr;   // fp32 [B, n, n]
  MhcResLayout res_layout = MhcResLayout::kDeepSeek;  // of this post (as MhcPostArgs::res_layout)
  // The next pre's weights.
  const void* phi = nullptr;      // [N, n*C], 16-byte aligned
  DType phi_dtype = DType::kFloat32;
  const float* alpha = nullptr;   // [3] device
  const float* bias = nullptr;    // [N] device
  // Outputs.
  void* x_next = nullptr;         // bf16 [B, n*C], X_{L+1} (kFp8E4m3: e4m3 codes)
  void* f_pre = nullptr;          // bf16 [B, C]
  float* h_post_next = nullptr;   // fp32 [B, n]
  float* h_res_next = nullptr;    // fp32 [B, n, n] (row-major, untransposed, as mhc_pre)
  MhcParams params;               // of the next pre (params.res_layout validated, not read, as in mhc_pre)
  bool enable_pdl = true;
  bool prefetch_weights = false;  // as in MhcPreArgs: phi, alpha, bias only (never X, F_out, H_post, H_res)
  // As in MhcPreArgs (mhc_workspace_bytes(shape)): with it and a small batch
  // the split kernel can run the boundary (each CTA makes X_next for its own
  // column slice, then projects it).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  MhcPreKernel kernel = MhcPreKernel::kAuto;  // kAuto, kResident, kSplit or kClusterTile (kFused);
                                              // with kPostThenPre: mhc_pre's kernel (any)
  MhcBoundaryPath path = MhcBoundaryPath::kAuto;  // fused or post then pre (see MhcBoundaryPath)
  // The FP8 residual stream (spec §4.9; default kBf16, the scale pointers
  // then null). With kFp8E4m3, x and x_next are e4m3 codes with their
  // scales: X_next is made and quantised exactly as mhc_post on this stream
  // makes it (its codes and scales bitwise), and the next pre reads those
  // stored values. Fused: the cluster-tile kernel only (kResident pinned:
  // kNotSupported); post then pre: mhc_pre's kernels for the FP8 stream.
  MhcResidual residual = MhcResidual::kBf16;
  const void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only), X_L's
  void* x_next_scales = nullptr;   // [B, n, C/128] (kFp8E4m3 only), X_{L+1}'s
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;  // of x_scales and x_next_scales

  // F_pre's epilogue (spec §4.8), for the next sublayer's input; every field
  // off by default (then F_pre is exactly as above). Let v = F_pre rounded to
  // bf16 as stored. With norm_weight (the sublayer's input RMSNorm):
  //   f_pre[b, c] = bf16( v[b, c] * rsqrt(mean_c v[b, :]^2 + norm_eps) * norm_weight[c] )
  // in fp32, one rounding; otherwise f_pre = v. With f_pre_fp8: that bf16
  // f_pre quantised to e4m3 with 1 x 128 blocks, bitwise quantize_fp8's
  // (spec §11, §12), C a multiple of 128. f_pre may then be null (only the
  // FP8 copy is written). The cluster-tile kernel runs the epilogue inside;
  // after the resident or split kernel it is a pass of its own over the
  // plain F_pre, kept in f_pre or (f_pre null) in the workspace's scratch
  // (mhc_epilogue_workspace_bytes). Same arithmetic either way but for the
  // order of the norm's fp32 sum of squares.
  const void* norm_weight = nullptr;           // [C], bf16 or fp32, 16-byte aligned; null: no norm
  DType norm_weight_dtype = DType::kBFloat16;  // kBFloat16 or kFloat32
  float norm_eps = 1e-6f;                      // finite, >= 0
  void* f_pre_fp8 = nullptr;                   // e4m3 [B, C], 16-byte aligned; null: no FP8 output
  void* f_pre_scales = nullptr;                // [B, C/128] float or uint8 (with f_pre_fp8)
  ScaleFormat f_pre_scale_format = ScaleFormat::kFloat32;
};

// mhc_post_head: the last layer boundary in one operation, the last
// layer's mhc_post followed by mhc_head (before the final norm and LM head):
//   X_next = R * X + H_post * F_out                 (mhc_post, res_layout)
//   out    = mhc_head(X_next)                       (phi [n, K], alpha[0], bias [n], eps_norm, eps_pre)
// X is read once; X_next is made on chip (bf16-rounded, or on the FP8
// stream quantised, exactly the values mhc_post stores) and the head's
// projection, sum of squares and mix use those values. x_next is optional:
// null (the usual case: nothing reads the last residual after the head)
// and X_next never reaches memory; given, it is written once. Bitwise equal
// to mhc_post then mhc_head pinned to the same projection kernel (spec
// §4.10). Fused kernels: kSplit (a workspace, 1 <= B <= kMhcSplitMaxBatch,
// bf16 stream) and kClusterTile (sm_90, both streams); kAuto takes the split
// kernel first with a workspace and B <= 16 (spec §4.6). kResident and
// kPortable have no fused post here (kNotSupported on the fused path).
// `path` (MhcBoundaryPath; kPostThenPre here means mhc_post writing x_next,
// then mhc_head reading it back, so it needs x_next): kAuto takes the two
// launches where x_next is given, no kernel is pinned, the fused op's own
// choice is not the split kernel and the head on X_next runs on the
// resident kernel (H100, B = 8192: 589 against 1,214 us fused with X_next
// stored, 1,041 without); with x_next null it does the same where the
// workspace holds a scratch for X_next (mhc_post_head_workspace_bytes);
// fused otherwise. `kernel` = kResident with kAuto: the two launches (the
// resident kernel has no fused post).
struct MhcPostHeadArgs {
  MhcShape shape;
  // The last layer's post (inputs).
  const void* x = nullptr;        // bf16 [B, n*C], X_L (kFp8E4m3: e4m3 codes)
  const void* f_out = nullptr;    // bf16 [B, C], the sublayer's output
  const float* h_post = nullptr;  // fp32 [B, n]
  const float* h_res = nullptr;   // fp32 [B, n, n]
  MhcResLayout res_layout = MhcResLayout::kDeepSeek;  // of this post (as MhcPostArgs::res_layout)
  // The head's weights (as MhcHeadArgs).
  const void* phi = nullptr;      // [n, n*C], 16-byte aligned
  DType phi_dtype = DType::kFloat32;
  const float* alpha = nullptr;   // [1] device (alpha_pre)
  const float* bias = nullptr;    // [n] device
  // Outputs.
  void* out = nullptr;            // bf16 [B, C]
  void* x_next = nullptr;         // optional: bf16 [B, n*C], X_{L+1} (kFp8E4m3: e4m3 codes); null: not stored
  float eps_norm = 1e-6f;
  float eps_pre = 1e-6f;
  bool enable_pdl = true;
  void* workspace = nullptr;      // as in MhcPreArgs (mhc_workspace_bytes(shape))
  size_t workspace_bytes = 0;
  MhcPreKernel kernel = MhcPreKernel::kAuto;  // fused: kAuto, kSplit or kClusterTile; two launches: the head's
  MhcBoundaryPath path = MhcBoundaryPath::kAuto;  // fused or post then head (kPostThenPre: x_next needed)
  // The FP8 residual stream (spec §4.9), as in MhcPostPreArgs; x_next_scales
  // is given exactly when x_next is.
  MhcResidual residual = MhcResidual::kBf16;
  const void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only), X_L's
  void* x_next_scales = nullptr;   // [B, n, C/128] (kFp8E4m3 with x_next only), X_{L+1}'s
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;  // of x_scales and x_next_scales
};

// mhc_expand: embedding [B, C] -> X [B, n, C] with n copies.
struct MhcExpandArgs {
  MhcShape shape;
  const void* embedding = nullptr;  // bf16 [B, C]
  void* x = nullptr;                // bf16 [B, n*C] (kFp8E4m3: e4m3 codes [B, n*C])
  bool enable_pdl = true;
  // The FP8 residual stream (spec §4.9; default kBf16, x_scales then null).
  // With kFp8E4m3 (C % 128 == 0) each 128-channel block of the embedding is
  // quantised by quantize_fp8's 1 x 128 rule (spec §12.1) and its codes and
  // scale written to every stream.
  MhcResidual residual = MhcResidual::kBf16;
  void* x_scales = nullptr;  // [B, n, C/128] float or uint8 (kFp8E4m3 only)
  ScaleFormat x_scale_format = ScaleFormat::kFloat32;
};

// N = n*n + 2n.
inline int mhc_num_coefficients(int n) { return n * n + 2 * n; }

// Small batches (decode). mhc_pre, mhc_post_pre, mhc_post_head, mhc_project, mhc_head
// take an optional workspace (CUB style: ask the size, pass the buffer).
// With it and 1 <= B <= kMhcSplitMaxBatch the projection runs on up to one
// CTA per SM (clusters of 8 on sm_90), each a slice of the columns of every
// stream for all tokens, in one launch: the clusters publish their partial
// sums in the workspace as tagged words that every CTA reads back (summed
// in a fixed order: bitwise reproducible). kAuto takes it first for B <= 16;
// for 16 < B <= 32 mhc_pre and mhc_post_pre keep the resident kernel where
// it takes the shape (n = 4, C a multiple of 1024 up to 7168) and use the
// split kernel for the other shapes, whose small batches otherwise run on
// one 8-CTA cluster (docs/mhc.md "Decode" has the measurements). Rules:
//   - size: mhc_workspace_bytes(shape) (0 where the path does not apply:
//     B == 0 or B > kMhcSplitMaxBatch; a workspace is then ignored);
//     16-byte aligned; it must not overlap any input or output;
//   - zero it once before its first use (cudaMemset); every launch leaves it
//     ready for the next (its first word counts the launches; each launch's
//     words carry that count + 1 as their tag), so it serves any number of
//     launches, shapes and graph replays;
//   - one launch at a time per workspace: launches on different streams that
//     may overlap need different workspaces;
//   - the launch takes up to one CTA per SM, all resident together: do not
//     share the GPU with work that holds SMs until this launch finishes.
constexpr int kMhcSplitMaxBatch = 32;
size_t mhc_workspace_bytes(const MhcShape& shape);

// F_pre's epilogue (the norm / FP8 fields of MhcPreArgs and MhcPostPreArgs,
// spec §4.8) runs inside the cluster-tile kernel, or as a pass of its own
// over F_pre after the resident or split kernel (kAuto takes that where the
// call without the epilogue would run on one of them: the cluster tiles are
// several times slower, docs/mhc.md). The pass reads the plain F_pre back,
// so it needs it stored: in f_pre when the caller gives f_pre, else in a
// scratch in the workspace, which then must be at least this size (the
// split kernel's part first, then 2 B C bytes; 0 for B == 0). With f_pre
// null and a smaller (or no) workspace, the epilogue stays on the cluster
// tiles. The scratch adds nothing to the workspace's other rules above.
size_t mhc_epilogue_workspace_bytes(const MhcShape& shape);

// mhc_post_head's two-launch path (MhcPostHeadArgs::path) writes X_next and
// reads it back: to x_next, or with x_next null to a scratch in the
// workspace, which then must be at least this size (the split kernel's part
// first, then 2 B n C bytes for the bf16 X_next; 0 for B == 0). With it kAuto
// takes the two launches without x_next too (H100, B = 8192: 590 against
// 1,033 us fused).
size_t mhc_post_head_workspace_bytes(const MhcShape& shape);

// GPU entry points (device pointers).
Status mhc_pre(const MhcPreArgs& args, cudaStream_t stream);
// The projection kernel mhc_pre would run for `args` on the current device,
// and why (host only: validates args, launches nothing). With args.kernel
// pinned to a kernel that cannot take the shape: kNotSupported and the reason.
Status mhc_pre_kernel_choice(const MhcPreArgs& args, MhcPreKernel* kernel, std::string* reason);
Status mhc_post(const MhcPostArgs& args, cudaStream_t stream);
Status mhc_project(const MhcProjectArgs& args, cudaStream_t stream);
Status mhc_activate(const MhcActivateArgs& args, cudaStream_t stream);
Status mhc_pre_mix(const MhcPreMixArgs& args, cudaStream_t stream);
Status mhc_head(const MhcHeadArgs& args, cudaStream_t stream);
// The projection kernel mhc_head would run for `args` here, and why (host only).
Status mhc_head_kernel_choice(const MhcHeadArgs& args, MhcPreKernel* kernel, std::string* reason);
Status mhc_expand(const MhcExpandArgs& args, cudaStream_t stream);
Status mhc_post_pre(const MhcPostPreArgs& args, cudaStream_t stream);
// The projection kernel mhc_post_pre would run for `args` here (fused, or
// the pre's after mhc_post), and why (host only).
Status mhc_post_pre_kernel_choice(const MhcPostPreArgs& args, MhcPreKernel* kernel, std::string* reason);
// The path (never kAuto) and projection kernel mhc_post_pre would run for
// `args` here, and why (host only; `kernel` and `reason` may be null).
Status mhc_post_pre_path_choice(const MhcPostPreArgs& args, MhcBoundaryPath* path, MhcPreKernel* kernel,
                                std::string* reason);
Status mhc_post_head(const MhcPostHeadArgs& args, cudaStream_t stream);
// The projection kernel mhc_post_head would run for `args` here, and why (host only).
Status mhc_post_head_kernel_choice(const MhcPostHeadArgs& args, MhcPreKernel* kernel, std::string* reason);

// CPU reference backend (host pointers).
Status mhc_pre_cpu(const MhcPreArgs& args);
Status mhc_post_cpu(const MhcPostArgs& args);
Status mhc_project_cpu(const MhcProjectArgs& args);
Status mhc_activate_cpu(const MhcActivateArgs& args);
Status mhc_pre_mix_cpu(const MhcPreMixArgs& args);
Status mhc_head_cpu(const MhcHeadArgs& args);
Status mhc_expand_cpu(const MhcExpandArgs& args);
Status mhc_post_pre_cpu(const MhcPostPreArgs& args);
Status mhc_post_head_cpu(const MhcPostHeadArgs& args);

// Host-side validation shared by both backends (no device access).
Status validate_mhc_pre(const MhcPreArgs& args);
Status validate_mhc_post(const MhcPostArgs& args);
Status validate_mhc_project(const MhcProjectArgs& args);
Status validate_mhc_activate(const MhcActivateArgs& args);
Status validate_mhc_pre_mix(const MhcPreMixArgs& args);
Status validate_mhc_head(const MhcHeadArgs& args);
Status validate_mhc_expand(const MhcExpandArgs& args);
Status validate_mhc_post_pre(const MhcPostPreArgs& args);
Status validate_mhc_post_head(const MhcPostHeadArgs& args);

}  // namespace flashmix
