// Device pieces shared by the mHC kernels: the activations with Sinkhorn for
// one token (SPEC §4), and the launch-side parameter block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

// 1 / v from the MUFU alone (no denormal fix-up), v clamped to FLT_MIN
// first unless the caller knows v >= FLT_MIN.
template <bool kClamp>
__device__ __forceinline__ float rcp_norm(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(kClamp ? fmaxf(v, 1.17549435e-38f) : v));
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

// Sinkhorn rounds on the n x n matrix m (row-major, in registers): the first
// round is the column normalisation alone, then rows and columns alternate.
template <int kN, bool kEps, bool kClamp>
__device__ __forceinline__ void sinkhorn_rounds(float* m, float eps, int iters) {
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float s = tree_sum<kN, 1>(m + i * kN);
        if constexpr (kEps) s += eps;
        const float inv = rcp_norm<kClamp>(s);
#pragma unroll
        for (int j = 0; j < kN; ++j) m[i * kN + j] *= inv;
      }
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float s = tree_sum<kN, kN>(m + j);
      if constexpr (kEps) s += eps;
      const float inv = rcp_norm<kClamp>(s);
#pragma unroll
      for (int i = 0; i < kN; ++i) m[i * kN + j] *= inv;
    }
  }
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
  // The rounds are a serial chain (20 by default, each a row and a column
  // normalisation), the last step of mhc_pre's critical path at decode
  // sizes, so each normalisation is kept short: sums as a tree, the
  // reciprocal straight from the MUFU (rcp.approx.ftz: ~1 ulp, no denormal
  // fix-up; a sum that could be below FLT_MIN is clamped to it so the result
  // stays finite), no eps add when eps is 0 and no clamp when eps >= FLT_MIN
  // (uniform branches; H200, one warp: 150 cycles a round at eps = 0).
  if (p.eps_sinkhorn == 0.0f) {
    sinkhorn_rounds<kN, false, true>(m, 0.0f, p.sinkhorn_iters);
  } else if (p.eps_sinkhorn >= 1.17549435e-38f) {
    sinkhorn_rounds<kN, true, false>(m, p.eps_sinkhorn, p.sinkhorn_iters);
  } else {
    sinkhorn_rounds<kN, true, true>(m, p.eps_sinkhorn, p.sinkhorn_iters);
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
};

// sm_90a cluster kernel (sm90_mhc_fused.cu). Returns cudaErrorNotSupported
// (launching nothing) when the shape does not fit it; the caller then falls
// back to the portable kernel. With dry_run it only answers whether it would
// launch (used by the tests to make sure the fast path is the one tested).
cudaError_t sm90_mhc_project_fused(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                   bool dry_run = false);

// sm_90a kernel with phi resident in registers (sm90_mhc_resident.cu): n = 4,
// C a multiple of 1024 up to 7168, modes kPre and kProject. Same contract as
// sm90_mhc_project_fused; tried first.
cudaError_t sm90_mhc_project_resident(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                      bool dry_run = false);

// Which projection kernel launch_project uses. kAuto: the resident kernel,
// else the cluster-tile kernel, else the portable one. The others pin one
// kernel (falling back to the portable kernel where it does not fit), so
// the tests can check each on the same shapes. Process-wide, not thread-safe:
// a test hook.
enum class ProjectKernel { kAuto, kClusterTiles, kPortable };
void set_project_kernel_for_testing(ProjectKernel k);

}  // namespace flashmix::mhc_detail
