// Device pieces shared by the mHC kernels: the activations with Sinkhorn for
// one token (spec §4), and the launch-side parameter block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/kernel_fit.h"
#include "common/vec.cuh"
#include "flashmix/mhc.h"

namespace flashmix::mhc_detail {

// Run-time parameters of the activations (a copy of MhcParams without the layout).
struct ActParams {
  float eps_pre = 0, post_mult = 2, eps_sinkhorn = 0;
  int sinkhorn_iters = 20;
};

inline ActParams act_params(const MhcParams& p) {
  return ActParams{p.eps_pre, p.post_mult, p.eps_sinkhorn, p.sinkhorn_iters};
}

__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + __expf(-v)); }
// The same with a fast division (~2 ulp): the coefficients on a kernel's critical path.
__device__ __forceinline__ float sigmoid_fast(float v) { return __fdividef(1.0f, 1.0f + __expf(-v)); }

// 8 bf16 values of X (one 16-byte vector) as floats (exact).
__device__ __forceinline__ void unpack8(const dev::Vec<__nv_bfloat16, 8>& v, float* f) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = __bfloat162float(v.v[e]);
}

// 1 / v from the MUFU alone (no denormal fix-up), v clamped to FLT_MIN first
// so the result stays finite.
__device__ __forceinline__ float rcp_norm(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaxf(v, 1.17549435e-38f)));
  return r;
}

// Sum of kLen values as a balanced tree (log2 depth instead of kLen - 1).
template <int kLen, int kStride>
__device__ __forceinline__ float tree_sum(const float* v) {
  if constexpr (kLen == 1) {
    return v[0];
  } else {
    constexpr int kHalf = kLen / 2;
    return tree_sum<kHalf, kStride>(v) + tree_sum<kLen - kHalf, kStride>(v + kHalf * kStride);
  }
}

// Sinkhorn on the n x n matrix K (row-major, in registers) in scaling-vector
// form: the matrix after any number of normalisations is diag(a) K diag(b),
// so a round updates the 2n scales instead of the n^2 entries. A row
// normalisation M / (row sums + eps) is a_i <- a_i / (a_i R_i + eps) with
// R_i = sum_j K_ij b_j; tracking abar = 1/a makes it abar_i <- R_i + eps*abar_i,
// an FMA chain, then one reciprocal (columns alike, with S_j = sum_i a_i K_ij).
// Per round (n = 4): 2n^2 FMAs and 2n reciprocals instead of 2n(n-1) adds,
// 2n^2 multiplies and 2n reciprocals (H200, one warp, 20 rounds: 3,760 ->
// 2,810 cycles at eps = 0, 3,720 -> 2,900 with eps). The first round is the
// column normalisation alone (spec §4); iters >= 1 (validated). Reciprocals
// straight from the MUFU (rcp.approx.ftz, ~1 ulp), their argument clamped to
// FLT_MIN so the scales stay finite. On return m holds a_i K_ij b_j.
template <int kN, bool kEps>
__device__ __forceinline__ void sinkhorn_scaled(float* m, float eps, int iters) {
  float a[kN], b[kN], abar[kN], bbar[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) {  // round 1: columns, with a = b = 1
    float s = tree_sum<kN, kN>(m + j);
    if constexpr (kEps) s += eps;
    bbar[j] = s;
    b[j] = rcp_norm(s);
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) a[i] = abar[i] = 1.0f;
  for (int it = 1; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float r = kEps ? fmaf(m[i * kN], b[0], eps * abar[i]) : m[i * kN] * b[0];
#pragma unroll
      for (int j = 1; j < kN; ++j) r = fmaf(m[i * kN + j], b[j], r);
      abar[i] = r;
      a[i] = rcp_norm(r);
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float s = kEps ? fmaf(a[0], m[j], eps * bbar[j]) : a[0] * m[j];
#pragma unroll
      for (int i = 1; i < kN; ++i) s = fmaf(a[i], m[i * kN + j], s);
      bbar[j] = s;
      b[j] = rcp_norm(s);
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) m[i * kN + j] = (a[i] * m[i * kN + j]) * b[j];
}

// h: the N = n*n + 2n coefficients of one token (alpha, r and bias applied).
// Writes H_pre, H_post and H_res (row-major n x n). Everything stays in
// registers: n is a compile-time constant and every loop is unrolled. Fast
// reciprocals and exp (2 ulp): the Sinkhorn rounds are a serial latency
// chain on the critical path of mhc_pre.
template <int kN>
__device__ __forceinline__ void activate_token(const float* h, const ActParams& p, float* pre, float* post,
                                               float* res) {
#pragma unroll
  for (int i = 0; i < kN; ++i) pre[i] = sigmoidf_(h[i]) + p.eps_pre;
#pragma unroll
  for (int i = 0; i < kN; ++i) post[i] = p.post_mult * sigmoidf_(h[kN + i]);
  float m[kN * kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {  // softmax over the row, + eps
    float mx = h[2 * kN + i * kN];
#pragma unroll
    for (int j = 1; j < kN; ++j) mx = fmaxf(mx, h[2 * kN + i * kN + j]);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      m[i * kN + j] = __expf(h[2 * kN + i * kN + j] - mx);
      s += m[i * kN + j];
    }
    const float inv = __fdividef(1.0f, s);
#pragma unroll
    for (int j = 0; j < kN; ++j) m[i * kN + j] = m[i * kN + j] * inv + p.eps_sinkhorn;
  }
  // The rounds are a serial chain (20 by default), the last step of
  // mhc_pre's critical path at decode sizes: scaling-vector form (above),
  // no eps terms when eps is 0 (a uniform branch).
  if (p.eps_sinkhorn == 0.0f) {
    sinkhorn_scaled<kN, false>(m, 0.0f, p.sinkhorn_iters);
  } else {
    sinkhorn_scaled<kN, true>(m, p.eps_sinkhorn, p.sinkhorn_iters);
  }
#pragma unroll
  for (int e = 0; e < kN * kN; ++e) res[e] = m[e];
}

// alpha index of coefficient m: pre, post or res.
__device__ __forceinline__ int alpha_index(int m, int n) { return m < n ? 0 : (m < 2 * n ? 1 : 2); }

// Calls f(std::integral_constant<int, n>) for n in [1, 8].
template <typename F>
void dispatch_n(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// What the fused projection kernels produce after the projection.
enum class ProjectMode : int {
  kPre = 0,      // F_pre, H_post, H_res (mhc_pre)
  kProject = 1,  // h and r (stage 1)
  kHead = 2,     // the pre mix only, with N = n (mhc_head)
};

// mhc_post_pre / mhc_post_head: the previous layer's post fused in front of
// the projection. The projection kernel's X (ProjectParams::x) is then X_L,
// and what it projects and mixes is X_next = R X_L + H_post F_out, made on
// chip with the arithmetic of mhc_post (post_mix_pair below), stored once to
// x_next where that is given (always for mhc_post_pre; optional for
// mhc_post_head).
struct PostInput {
  bool fused = false;                    // mhc_post_pre / mhc_post_head (false: plain mhc_pre / project / head)
  const __nv_bfloat16* f_out = nullptr;  // [B, C]
  const float* h_post = nullptr;         // [B, n]
  const float* h_res = nullptr;          // [B, n, n]
  __nv_bfloat16* x_next = nullptr;       // [B, n*C] (FP8 stream: e4m3 codes); null: X_next not stored
  void* x_next_scales = nullptr;         // FP8 stream: [B, n, C/128], X_next's scales (with x_next)
  bool transpose = true;                 // res_layout kDeepSeek: R = H_res^T
};

// Two columns of X_next[i] from the n streams' bf16 pairs `x` (one 32-bit
// word each: low half the even column) and F_out's pair `f`, with
// R[i][j] = r[j] and H_post[i] = post: bitwise what mhc_post_kernel stores
// (post * f first, then one fmaf per stream in order j = 0..n-1, rounded once).
template <int kN>
__device__ __forceinline__ uint32_t post_mix_pair(const uint32_t* x, uint32_t f, const float* r, float post) {
  float lo = post * __uint_as_float(f << 16), hi = post * __uint_as_float(f & 0xffff0000u);
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    lo = fmaf(r[j], __uint_as_float(x[j] << 16), lo);
    hi = fmaf(r[j], __uint_as_float(x[j] & 0xffff0000u), hi);
  }
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// F_pre's epilogue (spec §4.8; mhc_pre and mhc_post_pre, kPre only): the
// next sublayer's input RMSNorm and an FP8 copy (1 x 128 blocks, bitwise
// quantize_fp8's). ProjectParams::f_out may then be null (FP8 copy only).
// The cluster-tile kernel (sm90_mhc_fused.cu) runs it inside; after the
// resident or split kernel it is a pass of its own (launch_f_pre_epilogue_pass,
// chosen in mhc.cu's plan_project), the kernel then seeing no epilogue.
struct PreEpilogue {
  const void* norm_weight = nullptr;  // [C] bf16 or fp32; null: no norm
  bool norm_f32 = false;
  float norm_eps = 0;
  uint8_t* q = nullptr;               // e4m3 [B, C]; null: no FP8 copy
  void* scales = nullptr;             // [B, C/128] float or uint8
  bool ue8m0 = false;
  __host__ __device__ bool any() const { return norm_weight != nullptr || q != nullptr; }
};

// 8 columns of the norm's weight, as floats (F_pre's epilogue: the cluster
// tiles' and the pass's).
template <bool kWeightF32>
__device__ __forceinline__ void load_weight8(const PreEpilogue& e, int c, float* w) {
  if constexpr (kWeightF32) {
    const float* wp = static_cast<const float*>(e.norm_weight) + c;
    const float4 a = __ldg(reinterpret_cast<const float4*>(wp)), b = __ldg(reinterpret_cast<const float4*>(wp + 4));
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(e.norm_weight) + c));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      w[2 * k] = f.x;
      w[2 * k + 1] = f.y;
    }
  }
}

// F_pre's norm on one 8-column chunk (bf16 in a uint4), the same arithmetic
// wherever it runs: the chunk's squares added into `sum` (fp32, in column
// order), and the normed chunk bf16((v * inv) * w) for the columns' weights w.
__device__ __forceinline__ float chunk_sum_sq(const uint4& raw, float sum) {
  const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(v[k]);
    sum = fmaf(f.x, f.x, sum);
    sum = fmaf(f.y, f.y, sum);
  }
  return sum;
}
__device__ __forceinline__ uint4 normed_chunk(const uint4& raw, float inv, const float (&w)[8]) {
  const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
  uint4 o;
  __nv_bfloat162* ov = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(v[k]);
    ov[k] = __floats2bfloat162_rn((f.x * inv) * w[2 * k], (f.y * inv) * w[2 * k + 1]);
  }
  return o;
}

// Arguments of a projection kernel (fused or fallback).
struct ProjectParams {
  const __nv_bfloat16* x = nullptr;
  const void* phi = nullptr;
  const float* alpha = nullptr;
  const float* bias = nullptr;
  __nv_bfloat16* f_out = nullptr;  // F_pre (kPre) or out (kHead)
  float* h_post = nullptr;
  float* h_res = nullptr;
  float* h = nullptr;  // kProject
  float* r = nullptr;  // kProject
  long long batch = 0;
  int hidden = 0;       // C
  int k_len = 0;        // K = n*C
  int num_coef = 0;     // N (n*n + 2n, or n for the head)
  float eps_norm = 0;
  ActParams act;
  ProjectMode mode = ProjectMode::kPre;
  // phi, alpha and bias may be read before the grid dependency (PDL) is
  // resolved (MhcPreArgs::prefetch_weights). Kernels that do not use it
  // wait first, which is always correct.
  bool prefetch_weights = false;
  // The caller's workspace (MhcPreArgs::workspace): null, or at least
  // mhc_workspace_bytes(shape) bytes, zero when idle.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // mhc_post_pre (kPre) and mhc_post_head (kHead); a flag, not a pointer,
  // so the kernel choice is the same at B = 0 (no buffers).
  PostInput post;
  __host__ __device__ bool has_post() const { return post.fused; }
  PreEpilogue epi;
  __host__ __device__ bool has_epilogue() const { return epi.any(); }
  // The FP8 residual stream (spec §4.9; mhc_pre, mhc_post_pre, mhc_head):
  // x (and post.x_next) then point at e4m3 codes [B, n*C], one byte an
  // element, and x_scales at X's [B, n, C/128] scales, float or ue8m0.
  bool fp8x = false;
  const void* x_scales = nullptr;
  bool x_ue8m0 = false;
};

// The projection kernels' launchers (mhc_pre, mhc_project, mhc_head), one
// per kernel. Each returns cudaErrorNotSupported, launching nothing and
// setting *why_not (when not null) to a short reason, when it cannot take
// the shape on the current device; with dry_run it only answers that
// question. Which one runs is decided once, in choose_project_kernel
// (mhc.cu).
inline cudaError_t not_supported(const char** why_not, const char* why) {
  if (why_not != nullptr) *why_not = why;
  return cudaErrorNotSupported;
}
using ProjectLauncher = cudaError_t (*)(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream,
                                        bool pdl, bool dry_run, const char** why_not);

// sm_90a, phi resident in registers across a 16-CTA cluster
// (sm90_mhc_resident.cu): n = 4, C a multiple of 1024 up to 7168, mhc_pre and
// mhc_project.
cudaError_t sm90_mhc_project_resident(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                      bool dry_run, const char** why_not);

// Small batches with the caller's workspace (mhc_split.cu): B <= 32, one CTA
// per SM, each a slice of the columns, the partial sums exchanged through the
// workspace. Any GPU (FFMA only).
cudaError_t mhc_split_project(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                              bool dry_run, const char** why_not);

// sm_90a cluster tiles (sm90_mhc_fused.cu): 8-CTA clusters over tiles of
// 8-24 tokens, any n and C that fit.
cudaError_t sm90_mhc_project_fused(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                   bool dry_run, const char** why_not);

// F_pre's epilogue as a pass of its own (mhc_epilogue_pass.cu), after a
// projection kernel without it (resident, split) wrote the plain bf16 F_pre
// to `f` [B, C]: per token the norm (e.norm_weight) into `f_normed` (may be
// `f`; null: not stored) and the FP8 copy (e.q, e.scales) of the normed or
// plain row, bitwise as the cluster tiles compute them from the same F_pre
// but for the order of the sum of squares. Nothing is launched for B = 0 or
// without an epilogue.
cudaError_t launch_f_pre_epilogue_pass(const PreEpilogue& e, const __nv_bfloat16* f, __nv_bfloat16* f_normed,
                                       long long batch, int hidden, cudaStream_t stream, bool pdl);

}  // namespace flashmix::mhc_detail
