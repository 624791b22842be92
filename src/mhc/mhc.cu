// mHC forward (spec §4): the memory-bound kernels, the portable projection
// and every public launcher. The Hopper single-pass mhc_pre lives in
// sm90_mhc_resident.cu (n = 4) and sm90_mhc_fused.cu (other shapes), small
// batches with a workspace in mhc_split.cu; this file falls back to the
// portable kernel elsewhere.
//
//   X_next[b,i,c] = sum_j R[b,i,j] X[b,j,c] + H_post[b,i] F_out[b,c]   (mhc_post)
//   F_pre[b,c]    = sum_i H_pre[b,i] X[b,i,c]                           (pre mix)
//   X[b,i,c]      = E[b,c]                                              (expand)
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "common/check.h"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "flashmix/mhc.h"
#include "mhc/mhc_boundary_args.h"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_fp8x_device.cuh"
#include "mhc/mhc_split_layout.h"

namespace flashmix {

namespace mhc_detail {
namespace {

using bf16 = __nv_bfloat16;
using V8 = dev::Vec<bf16, 8>;
constexpr int kThreads = 256;

__device__ __forceinline__ V8 pack(const float* f) {
  V8 v;
#pragma unroll
  for (int e = 0; e < 8; ++e) v.v[e] = __float2bfloat16_rn(f[e]);
  return v;
}

// Token b's mixing coefficients: H_res [n, n] and H_post [n].
template <int kN>
__device__ __forceinline__ void load_mix(const float* __restrict__ h_res, const float* __restrict__ h_post,
                                         long long b, float (&coef)[kN * kN], float (&post)[kN]) {
#pragma unroll
  for (int e = 0; e < kN * kN; ++e) coef[e] = __ldg(h_res + b * kN * kN + e);
#pragma unroll
  for (int i = 0; i < kN; ++i) post[i] = __ldg(h_post + b * kN + i);
}

// mhc_post. Roofline: per token X read once (2nC B), F_out once (2C B), X_next
// written once (2nC B); 2n FLOP per output element is far below the
// bandwidth bound. One thread per (token, 8 columns): n+1 16-byte loads in
// flight, n 16-byte streaming stores.
template <int kN, bool kTranspose>
__global__ void __launch_bounds__(128) mhc_post_kernel(const bf16* __restrict__ x, const bf16* __restrict__ f_out,
                                                       const float* __restrict__ h_post,
                                                       const float* __restrict__ h_res, bf16* __restrict__ x_next,
                                                       long long batch, int groups, int hidden) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int c = g * 8;
  // blockIdx.y walks the tokens: the coefficients are uniform across the block (broadcast loads).
  for (long long b = blockIdx.y; b < batch; b += gridDim.y) {
    const bf16* xr = x + b * kN * (long long)hidden + c;
    V8 xv[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) xv[j] = dev::load_stream<bf16, 8>(xr + (long long)j * hidden);
    const V8 fv = dev::load_stream<bf16, 8>(f_out + b * hidden + c);
    float coef[kN * kN], post[kN];
    load_mix(h_res, h_post, b, coef, post);
    float xf[kN][8], ff[8];
#pragma unroll
    for (int j = 0; j < kN; ++j) unpack8(xv[j], xf[j]);
    unpack8(fv, ff);
    bf16* outr = x_next + b * kN * (long long)hidden + c;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = post[i] * ff[e];
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const float rij = kTranspose ? coef[j * kN + i] : coef[i * kN + j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(rij, xf[j][e], acc[e]);
      }
      const V8 o = pack(acc);
      __stcs(reinterpret_cast<uint4*>(outr + (long long)i * hidden), *reinterpret_cast<const uint4*>(&o));  // written once, never re-read here
    }
  }
}

// mhc_post on the FP8 residual stream (spec §4.9). Roofline: per token the
// X codes (nC B) and scales (4nC/128 or nC/128 B) read once, F_out once (2C
// B), the X_next codes and scales written once. A thread per (token, 16
// channels), tokens along blockIdx.y, so a 128-channel scale block of a
// (token, stream) is 8 lanes: each lane makes its 16 fp32 X_next values
// (acc = H_post F_out, then fma(R_ij, X_j) for j = 0..n-1, spec §4.9's fixed
// order), the block's amax is a 3-step xor-shuffle max over the 8 lanes, and
// every lane divides its own values by the scale and stores 16 codes while
// the group's first lane stores the scale. No extra pass, no shared memory.
// `groups` = C / 16, a multiple of 8 (C % 128 == 0), so the lanes past the
// row leave in whole 8-lane groups. Against 8 channels a lane (a half-warp a
// block, the bf16 kernel's mapping): 271.0 vs 279.6 us fp32 scales, 287 vs
// 294 us ue8m0 (H100, B = 8192, n = 4, C = 7168, same process): the per-token
// work a lane repeats (n*n + n coefficient loads, n scale loads, the
// shuffles, the scale's reciprocal) covers twice the bytes. Registers: the
// n streams' 16 dequantised values stay live across the n outputs; free,
// ptxas takes 150 at n = 4 (12 warps an SM, ncu: 2.8 active warps a
// scheduler, 62 % issue, DRAM 64 %). Capped at 128 for n <= 4 (4 CTAs of 128;
// ptxas spills 32-36 bytes at n = 4): 270.4 -> 256.4 us (fp32 scales,
// deepseek layout, same process); at 102 or 85 registers the spills grow
// (306 / 379 us). Larger n keep the free count (a cap spills hundreds of
// bytes there).
template <int kN, bool kTranspose, ScaleFormat F>
__global__ void __launch_bounds__(128, kN <= 4 ? 4 : 1)
    mhc_post_fp8_kernel(const uint8_t* __restrict__ x, const void* __restrict__ x_scales,
                            const bf16* __restrict__ f_out, const float* __restrict__ h_post,
                            const float* __restrict__ h_res, uint8_t* __restrict__ x_next,
                            void* __restrict__ x_next_scales, long long batch, int groups, int hidden) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;  // whole 8-lane groups (groups % 8 == 0)
  const int c = g * 16;
  const int blocks = hidden / 128;
  const int kb = g >> 3;  // channels [128 kb, 128 kb + 128)
  const unsigned mask = 0xffu << (threadIdx.x & 24);
  const bool leader = (threadIdx.x & 7) == 0;
  for (long long b = blockIdx.y; b < batch; b += gridDim.y) {
    uint4 xq[kN];
    float xs[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) xq[j] = __ldcs(reinterpret_cast<const uint4*>(x + (b * kN + j) * hidden + c));
#pragma unroll
    for (int j = 0; j < kN; ++j) xs[j] = load_x_scale<F>(x_scales, (b * kN + j) * blocks + kb);
    const V8 f0 = dev::load_stream<bf16, 8>(f_out + b * hidden + c);
    const V8 f1 = dev::load_stream<bf16, 8>(f_out + b * hidden + c + 8);
    float coef[kN * kN], post[kN];
    load_mix(h_res, h_post, b, coef, post);
    float xlo[kN][8], xhi[kN][8], flo[8], fhi[8];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      dequant8(make_uint2(xq[j].x, xq[j].y), xs[j], xlo[j]);
      dequant8(make_uint2(xq[j].z, xq[j].w), xs[j], xhi[j]);
    }
    unpack8(f0, flo);
    unpack8(f1, fhi);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float rr[kN], alo[8], ahi[8];
#pragma unroll
      for (int j = 0; j < kN; ++j) rr[j] = kTranspose ? coef[j * kN + i] : coef[i * kN + j];
      post_fp8_values<kN>(xlo, flo, rr, post[i], alo);
      post_fp8_values<kN>(xhi, fhi, rr, post[i], ahi);
      uint32_t amax = max(fp8_dev::amax_bits_f32(alo), fp8_dev::amax_bits_f32(ahi));
#pragma unroll
      for (int off = 4; off >= 1; off >>= 1) amax = max(amax, __shfl_xor_sync(mask, amax, off));
      const fp8_dev::Scale sc = fp8_dev::block_scale_or_nan_f32<F>(amax);
      const bool nan_block = amax > fp8_dev::kF32Inf;
      uint4 q;
      fp8_dev::quantize8_f32<F>(alo, sc.s, nan_block, q.x, q.y);
      fp8_dev::quantize8_f32<F>(ahi, sc.s, nan_block, q.z, q.w);
      const long long row = b * kN + i;
      __stcs(reinterpret_cast<uint4*>(x_next + row * hidden + c), q);  // written once, never re-read here
      if (leader) fp8_dev::store_scale(x_next_scales, uint32_t(row * blocks + kb), sc.stored, F == ScaleFormat::kUE8M0);
    }
  }
}

// Expand onto the FP8 residual stream (spec §4.9): the bf16 post kernel's
// mapping (a lane 8 channels, a half-warp one 128-channel block), each block
// of the embedding quantised once from its fp32 values (exact from bf16) by
// quantize_fp8's rule and its codes and scale stored to every stream.
// Roofline: E read once (2C B), X written once (nC + 4nC/128 B).
template <int kN, ScaleFormat F>
__global__ void __launch_bounds__(128) mhc_expand_fp8_kernel(const bf16* __restrict__ emb, uint8_t* __restrict__ x,
                                                             void* __restrict__ x_scales, long long batch, int groups,
                                                             int hidden) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;  // a whole half-warp (groups % 16 == 0)
  const int c = g * 8;
  const int blocks = hidden / 128;
  const int kb = g >> 4;
  const unsigned half_mask = 0xffffu << (threadIdx.x & 16);
  const bool leader = (threadIdx.x & 15) == 0;
  for (long long b = blockIdx.y; b < batch; b += gridDim.y) {
    float f[8];
    unpack8(dev::load_stream<bf16, 8>(emb + b * hidden + c), f);
    uint2 q;
    const fp8_dev::Scale sc = quantize_block_lane<F>(f, half_mask, q);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const long long row = b * kN + i;
      __stcs(reinterpret_cast<uint2*>(x + row * hidden + c), q);
      if (leader) fp8_dev::store_scale(x_scales, uint32_t(row * blocks + kb), sc.stored, F == ScaleFormat::kUE8M0);
    }
  }
}

// Pre mix alone. Roofline: X read once, F_pre written once.
template <int kN>
__global__ void __launch_bounds__(kThreads) mhc_pre_mix_kernel(const bf16* __restrict__ x, const float* __restrict__ h_pre,
                                                               bf16* __restrict__ f_pre, long long total, int groups,
                                                               int hidden) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const long long b = idx / groups;
  const int c = int(idx - b * groups) * 8;
  const bf16* xr = x + b * kN * (long long)hidden + c;
  V8 xv[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) xv[j] = dev::load_stream<bf16, 8>(xr + (long long)j * hidden);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float w = __ldg(h_pre + b * kN + j);
    float xf[8];
    unpack8(xv[j], xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(w, xf[e], acc[e]);
  }
  dev::store<bf16, 8>(f_pre + b * hidden + c, pack(acc));
}

// Expand. Roofline: E read once (2C B), X written once (2nC B).
template <int kN>
__global__ void __launch_bounds__(kThreads) mhc_expand_kernel(const bf16* __restrict__ emb, bf16* __restrict__ x,
                                                              long long total, int groups, int hidden) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const long long b = idx / groups;
  const int c = int(idx - b * groups) * 8;
  const V8 v = dev::load_stream<bf16, 8>(emb + b * hidden + c);
#pragma unroll
  for (int i = 0; i < kN; ++i) dev::store<bf16, 8>(x + (b * kN + i) * (long long)hidden + c, v);
}

// Activations + Sinkhorn, one thread per token. Roofline: (N + n*n + 2n)*4
// bytes per token; the Sinkhorn rounds are the latency, not the bandwidth.
template <int kN>
__global__ void __launch_bounds__(128) mhc_activate_kernel(const float* __restrict__ h, float* __restrict__ h_pre,
                                                           float* __restrict__ h_post, float* __restrict__ h_res,
                                                           long long batch, ActParams p) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (b >= batch) return;
  constexpr int kCoef = kN * kN + 2 * kN;
  float hv[kCoef], pre[kN], post[kN], res[kN * kN];
#pragma unroll
  for (int m = 0; m < kCoef; ++m) hv[m] = h[b * kCoef + m];
  activate_token<kN>(hv, p, pre, post, res);
#pragma unroll
  for (int i = 0; i < kN; ++i) h_pre[b * kN + i] = pre[i];
#pragma unroll
  for (int i = 0; i < kN; ++i) h_post[b * kN + i] = post[i];
#pragma unroll
  for (int e = 0; e < kN * kN; ++e) h_res[b * kN * kN + e] = res[e];
}

template <typename PhiT> __device__ __forceinline__ void load_phi8(const PhiT* p, float* f);
template <> __device__ __forceinline__ void load_phi8<float>(const float* p, float* f) {
  const auto v = dev::load_ro<float, 8>(p);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = v.v[e];
}
template <> __device__ __forceinline__ void load_phi8<bf16>(const bf16* p, float* f) {
  unpack8(dev::load_ro<bf16, 8>(p), f);
}

// Eight elements of X from flat index e (a multiple of 8) as floats: bf16
// (exact), or on the FP8 stream each fp32(e4m3(code) * scale) (spec §4.9).
template <bool kFp8>
__device__ __forceinline__ void load_x8(const ProjectParams& p, long long e, float* f) {
  if constexpr (kFp8) {
    const uint2 c = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(p.x) + e));
    dequant8(c, load_x_scale_ro(p.x_scales, e / 128, p.x_ue8m0), f);
  } else {
    unpack8(dev::load_ro<bf16, 8>(p.x + e), f);
  }
}

// Portable projection (any sm_80+ GPU, any shape): one block per token. X is
// read from device memory once for the projection and once more for the pre
// mix (an L2 hit in practice: the row was read microseconds earlier); phi is
// read from L2 by every block, so at large B this is bound by L2 bandwidth
// (N*K*4 bytes per token). The sm_90a cluster kernel replaces it where it fits.
// kFp8: X is the FP8 residual stream (mhc_pre, mhc_head).
template <int kN, typename PhiT, bool kFp8>
__global__ void __launch_bounds__(kThreads) mhc_project_rows_kernel(ProjectParams p) {
  constexpr int kMaxCoef = kN * kN + 2 * kN;
  __shared__ float red[kMaxCoef + 1][kThreads / 32];
  __shared__ float coef[kMaxCoef + 1];
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const long long b = blockIdx.x;
  const int num_coef = p.num_coef;
  const long long xr = b * p.k_len;  // the token's first element
  const PhiT* phi = static_cast<const PhiT*>(p.phi);
  float acc[kMaxCoef];
#pragma unroll
  for (int m = 0; m < kMaxCoef; ++m) acc[m] = 0.f;
  float sq = 0.f;
  for (int k = threadIdx.x * 8; k < p.k_len; k += kThreads * 8) {
    float xf[8];
    load_x8<kFp8>(p, xr + k, xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) sq = fmaf(xf[e], xf[e], sq);
#pragma unroll
    for (int m = 0; m < kMaxCoef; ++m) {
      if (m < num_coef) {
        float pf[8];
        load_phi8<PhiT>(phi + (long long)m * p.k_len + k, pf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m] = fmaf(xf[e], pf[e], acc[m]);
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < kMaxCoef; ++m) {
    const float s = dev::warp_sum(acc[m]);
    if (lane == 0) red[m][warp] = s;
  }
  {
    const float s = dev::warp_sum(sq);
    if (lane == 0) red[kMaxCoef][warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float ss = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) ss += red[kMaxCoef][w];
    const float r = sqrtf(ss / float(p.k_len) + p.eps_norm);
    float h[kMaxCoef];
#pragma unroll
    for (int m = 0; m < kMaxCoef; ++m) {
      float s = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) s += red[m][w];
      const int ai = p.mode == ProjectMode::kHead ? 0 : alpha_index(m, kN);
      h[m] = m < num_coef ? __ldg(p.alpha + ai) * s / r + __ldg(p.bias + m) : 0.f;
    }
    if (p.mode == ProjectMode::kProject) {
#pragma unroll
      for (int m = 0; m < kMaxCoef; ++m)
        if (m < num_coef) p.h[b * num_coef + m] = h[m];
      p.r[b] = r;
    } else if (p.mode == ProjectMode::kHead) {
#pragma unroll
      for (int i = 0; i < kN; ++i) coef[i] = sigmoidf_(h[i]) + p.act.eps_pre;
    } else {
      float pre[kN], post[kN], res[kN * kN];
      activate_token<kN>(h, p.act, pre, post, res);
#pragma unroll
      for (int i = 0; i < kN; ++i) coef[i] = pre[i];
#pragma unroll
      for (int i = 0; i < kN; ++i) p.h_post[b * kN + i] = post[i];
#pragma unroll
      for (int e = 0; e < kN * kN; ++e) p.h_res[b * kN * kN + e] = res[e];
    }
  }
  if (p.mode == ProjectMode::kProject) return;  // uniform across the block
  __syncthreads();
  for (int c = threadIdx.x * 8; c < p.hidden; c += kThreads * 8) {
    float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float xf[8];
      load_x8<kFp8>(p, xr + (long long)i * p.hidden + c, xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = fmaf(coef[i], xf[e], out[e]);
    }
    dev::store<bf16, 8>(p.f_out + b * p.hidden + c, pack(out));
  }
}

unsigned grid_for(long long total, int threads) { return unsigned((total + threads - 1) / threads); }

// The element-wise ops (pre mix, expand): one thread per (token, 8 columns),
// 128-thread blocks for small totals. `launch(kn, grid, block, total,
// groups)` launches the n-specialised kernel and returns its error.
template <typename Launch>
Status launch_per_group(const MhcShape& s, const char* op, Launch&& launch) {
  const int groups = int(s.hidden / 8);
  const long long total = s.batch * groups;
  const int threads = total < 64LL * 1024 ? 128 : kThreads;
  cudaError_t err = cudaSuccess;
  dispatch_n(s.n, [&](auto kn) { err = launch(kn, dim3(grid_for(total, threads)), dim3(threads), total, groups); });
  if (err != cudaSuccess) return detail::cuda_status(err, op, "kernel launch");
  return detail::check_launch(op);
}

// The bf16 post kernel's mapping (and the FP8 expand's): 128-thread
// blocks across C (a thread 8 columns), tokens along blockIdx.y. `launch(kn,
// grid, groups)` launches the n-specialised kernel and returns its error.
template <typename Launch>
Status launch_per_token_row(const MhcShape& s, const char* op, Launch&& launch) {
  const int groups = int(s.hidden / 8);
  const dim3 grid(unsigned((groups + 127) / 128), unsigned(std::min<int64_t>(s.batch, 65535)));
  cudaError_t err = cudaSuccess;
  dispatch_n(s.n, [&](auto kn) { err = launch(kn, grid, groups); });
  if (err != cudaSuccess) return detail::cuda_status(err, op, "kernel launch");
  return detail::check_launch(op);
}

// The portable projection kernel: any GPU, any shape; one CTA per token.
cudaError_t portable_project(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                             bool dry_run, const char** why_not) {
  if (p.has_post()) return not_supported(why_not, "portable: no fused post (mhc_post_pre)");
  if (p.has_epilogue()) return not_supported(why_not, "portable: no F_pre norm / FP8 epilogue");
  if (dry_run) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_n(n, [&](auto kn) {
    constexpr int kN = decltype(kn)::value;
    auto kernel = phi_is_f32 ? (p.fp8x ? mhc_project_rows_kernel<kN, float, true>
                                       : mhc_project_rows_kernel<kN, float, false>)
                             : (p.fp8x ? mhc_project_rows_kernel<kN, bf16, true>
                                       : mhc_project_rows_kernel<kN, bf16, false>);
    err = dev::launch(kernel, dim3(unsigned(p.batch)), dim3(kThreads), 0, stream, pdl, p);
  });
  return err;
}

// The projection kernels, in the order the automatic choice tries them
// (measured on an H100, docs/mhc.md): the resident kernel first (every batch
// size of the shapes it takes), then the split kernel for the small batches
// of every other shape, where the cluster-tile kernel would fetch all of phi
// through 8 SMs (n = 8, B = 16: 28 against 108 us), the cluster tiles for
// the rest of sm_90, the portable kernel everywhere else. With a workspace
// and B <= kSplitFirstMaxBatch the split kernel goes first: at n = 4,
// C = 7168 it is ahead of the resident kernel at B = 1 and 16 (mhc_pre and
// mhc_post_pre) and behind it at B = 32 (docs/mhc.md, "Decode").
struct ProjectCandidate {
  MhcPreKernel kernel;
  ProjectLauncher launch;
};
constexpr ProjectCandidate kProjectKernels[] = {
    {MhcPreKernel::kResident, sm90_mhc_project_resident},
    {MhcPreKernel::kSplit, mhc_split_project},
    {MhcPreKernel::kClusterTile, sm90_mhc_project_fused},
    {MhcPreKernel::kPortable, portable_project},
};
constexpr ProjectCandidate kProjectKernelsSplitFirst[] = {
    {MhcPreKernel::kSplit, mhc_split_project},
    {MhcPreKernel::kResident, sm90_mhc_project_resident},
    {MhcPreKernel::kClusterTile, sm90_mhc_project_fused},
    {MhcPreKernel::kPortable, portable_project},
};
constexpr long long kSplitFirstMaxBatch = 16;

// Picks the projection kernel for `p` on the current device: the pinned one
// (kNotSupported with its reason where it cannot take the shape) or the
// first candidate that can. `reason` says why, naming each kernel passed over.
Status choose_project_kernel(const ProjectParams& p, int n, bool f32, MhcPreKernel pinned, const char* op,
                             const ProjectCandidate** chosen, std::string* reason) {
  std::string why;
  const bool split_first = p.workspace != nullptr && p.batch <= kSplitFirstMaxBatch;
  for (const ProjectCandidate& c : split_first ? kProjectKernelsSplitFirst : kProjectKernels) {
    if (pinned != MhcPreKernel::kAuto && c.kernel != pinned) continue;
    const char* why_not = "cannot take this shape";
    const cudaError_t err = c.launch(p, n, f32, nullptr, false, /*dry_run=*/true, &why_not);
    if (err == cudaSuccess) {
      *chosen = &c;
      if (reason != nullptr)
        *reason = pinned != MhcPreKernel::kAuto ? detail::concat(to_string(c.kernel), ": pinned by args.kernel")
                                                : detail::concat(why, to_string(c.kernel), ": takes the shape");
      return Status::Ok();
    }
    if (err != cudaErrorNotSupported) return detail::cuda_status(err, op, "kernel choice");
    if (pinned != MhcPreKernel::kAuto)
      return Status(StatusCode::kNotSupported,
                    detail::concat(op, ": kernel: ", to_string(pinned), " cannot take this shape here (", why_not,
                                   ")"));
    why += detail::concat(why_not, "; ");
  }
  return Status(StatusCode::kNotSupported, detail::concat(op, ": no projection kernel takes this shape (", why, ")"));
}

// Where F_pre's epilogue pass finds the plain F_pre: f_pre, else the
// scratch in the caller's workspace; null where the workspace is absent or
// smaller than mhc_epilogue_workspace_bytes.
__nv_bfloat16* epilogue_target(void* f_pre, void* workspace, size_t bytes, const MhcShape& s) {
  if (f_pre != nullptr) return static_cast<__nv_bfloat16*>(f_pre);
  return static_cast<__nv_bfloat16*>(workspace_scratch(workspace, bytes, mhc_epilogue_workspace_bytes(s), s));
}

// A projection kernel, and how F_pre's epilogue (spec §4.8) runs with it:
// inside the kernel (the cluster tiles) or, for the kernels without it
// (resident, split), as a pass after it (launch_f_pre_epilogue_pass) over
// the plain F_pre the kernel stores to `f_plain` (f_pre, or the workspace's
// scratch).
struct ProjectPlan {
  const ProjectCandidate* c = nullptr;
  bool pass = false;
  __nv_bfloat16* f_plain = nullptr;
};

// choose_project_kernel with the epilogue rule: where the call has an
// epilogue and somewhere to keep the plain F_pre, the kernel the call
// without the epilogue would take (pinned or not), if it is the resident or
// split kernel, with the pass after it; otherwise the kernel for the call
// as it is (the cluster tiles for an epilogue).
Status plan_project(const ProjectParams& p, int n, bool f32, MhcPreKernel pinned, const char* op, ProjectPlan* plan,
                    std::string* reason) {
  *plan = ProjectPlan{};
  if (p.mode == ProjectMode::kPre && p.has_epilogue()) {
    __nv_bfloat16* target = epilogue_target(p.f_out, p.workspace, p.workspace_bytes, {p.batch, n, p.hidden});
    if (target != nullptr || p.batch == 0) {  // (B = 0: the choice as with work; nothing runs)
      ProjectParams plain = p;
      plain.epi = PreEpilogue{};
      plain.f_out = target;
      const ProjectCandidate* c = nullptr;
      std::string why;
      const Status s = choose_project_kernel(plain, n, f32, pinned, op, &c, &why);
      if (!s.ok() && s.code() != StatusCode::kNotSupported) return s;
      // A pinned resident or split kernel that cannot take the plain call:
      // its own reason (not the epilogue's).
      if (!s.ok() && (pinned == MhcPreKernel::kResident || pinned == MhcPreKernel::kSplit)) return s;
      if (s.ok() && (c->kernel == MhcPreKernel::kResident || c->kernel == MhcPreKernel::kSplit)) {
        *plan = ProjectPlan{c, true, target};
        if (reason != nullptr)
          *reason = detail::concat(why, "; F_pre's epilogue as a pass after it, over the plain F_pre in ",
                                   p.f_out != nullptr ? "f_pre" : "the workspace's scratch");
        return Status::Ok();
      }
    }
  }
  return choose_project_kernel(p, n, f32, pinned, op, &plan->c, reason);
}

// Runs the projection kernel that plan_project picks (and the epilogue's
// pass after it).
Status launch_project(const ProjectParams& p, int n, DType phi_dtype, MhcPreKernel pinned, cudaStream_t stream,
                      bool pdl, const char* op) {
  const bool f32 = phi_dtype == DType::kFloat32;
  ProjectPlan plan;
  FM_RETURN_IF_ERROR(plan_project(p, n, f32, pinned, op, &plan, nullptr));
  ProjectParams q = p;
  if (plan.pass) {
    q.epi = PreEpilogue{};
    q.f_out = plan.f_plain;
  }
  const char* why_not = "cannot take this shape";
  cudaError_t err = plan.c->launch(q, n, f32, stream, pdl, /*dry_run=*/false, &why_not);
  if (err == cudaErrorNotSupported)
    return Status(StatusCode::kNotSupported, detail::concat(op, ": ", to_string(plan.c->kernel), ": ", why_not));
  if (err != cudaSuccess) return detail::cuda_status(err, op, "kernel launch");
  FM_RETURN_IF_ERROR(detail::check_launch(op));
  if (!plan.pass) return Status::Ok();
  err = launch_f_pre_epilogue_pass(p.epi, plan.f_plain, p.f_out, p.batch, p.hidden, stream, pdl);
  if (err != cudaSuccess) return detail::cuda_status(err, op, "epilogue pass launch");
  return detail::check_launch(op);
}

// What every projection op (pre, project, head) passes the same way.
template <typename Args>
ProjectParams base_params(const Args& a) {
  ProjectParams p;
  p.x = static_cast<const bf16*>(a.x);
  p.phi = a.phi;
  p.alpha = a.alpha;
  p.bias = a.bias;
  p.batch = a.shape.batch;
  p.hidden = int(a.shape.hidden);
  p.k_len = int(a.shape.hidden * a.shape.n);
  p.workspace = a.workspace;
  p.workspace_bytes = a.workspace_bytes;
  return p;
}

// The FP8 residual stream's fields (mhc_pre, mhc_post_pre, mhc_head; spec §4.9).
template <typename Args>
void set_residual(ProjectParams& p, const Args& a) {
  p.fp8x = a.residual == MhcResidual::kFp8E4m3;
  p.x_scales = p.fp8x ? a.x_scales : nullptr;
  p.x_ue8m0 = a.x_scale_format == ScaleFormat::kUE8M0;
}

// The fused post's fields (mhc_post_pre, mhc_post_head): this layer's post,
// whose X_next the projection kernel makes from X_L (ProjectParams::x).
template <typename Args>
void set_post(ProjectParams& p, const Args& a) {
  p.post.fused = true;
  p.post.f_out = static_cast<const bf16*>(a.f_out);
  p.post.h_post = a.h_post;
  p.post.h_res = a.h_res;
  p.post.x_next = static_cast<bf16*>(a.x_next);
  p.post.transpose = a.res_layout == MhcResLayout::kDeepSeek;
  p.post.x_next_scales = a.x_next_scales;
}

// The kernel a projection op would run for `p` here, and why (host only):
// the *_kernel_choice entry points, after validating their arguments.
Status project_kernel_choice(const ProjectParams& p, int n, DType phi_dtype, MhcPreKernel pinned, const char* op,
                             MhcPreKernel* kernel, std::string* reason) {
  return detail::without_cuda_error_left(op, [&]() -> Status {
    ProjectPlan plan;
    std::string why;
    FM_RETURN_IF_ERROR(plan_project(p, n, phi_dtype == DType::kFloat32, pinned, op, &plan, &why));
    *kernel = plan.c->kernel;
    if (reason != nullptr) *reason = why;
    return Status::Ok();
  });
}

}  // namespace

}  // namespace mhc_detail

using namespace mhc_detail;

namespace {

// F_pre's epilogue fields (mhc_pre, mhc_post_pre), spec §4.8.
template <typename Args>
PreEpilogue epilogue_params(const Args& a) {
  PreEpilogue e;
  e.norm_weight = a.norm_weight;
  e.norm_f32 = a.norm_weight_dtype == DType::kFloat32;
  e.norm_eps = a.norm_eps;
  e.q = static_cast<uint8_t*>(a.f_pre_fp8);
  e.scales = a.f_pre_scales;
  e.ue8m0 = a.f_pre_scale_format == ScaleFormat::kUE8M0;
  return e;
}

// mhc_pre's parameters on any Args with its fields (mhc_pre, mhc_post_pre),
// the coefficients written to `h_post` and `h_res`.
template <typename Args>
ProjectParams pre_params_of(const Args& a, float* h_post, float* h_res) {
  ProjectParams p = base_params(a);
  p.f_out = static_cast<bf16*>(a.f_pre);
  p.h_post = h_post;
  p.h_res = h_res;
  p.num_coef = mhc_num_coefficients(a.shape.n);
  p.eps_norm = a.params.eps_norm;
  p.act = act_params(a.params);
  p.mode = ProjectMode::kPre;
  p.prefetch_weights = a.prefetch_weights && a.enable_pdl;
  p.epi = epilogue_params(a);
  set_residual(p, a);
  return p;
}

ProjectParams pre_params(const MhcPreArgs& a) { return pre_params_of(a, a.h_post, a.h_res); }

// mhc_head's parameters (mhc_head, mhc_post_head).
template <typename Args>
ProjectParams head_params(const Args& a) {
  ProjectParams p = base_params(a);
  p.f_out = static_cast<bf16*>(a.out);
  p.num_coef = a.shape.n;
  p.eps_norm = a.eps_norm;
  p.act.eps_pre = a.eps_pre;
  p.mode = ProjectMode::kHead;
  set_residual(p, a);
  return p;
}

}  // namespace

Status mhc_pre_kernel_choice(const MhcPreArgs& a, MhcPreKernel* kernel, std::string* reason) {
  constexpr const char* kOp = "mhc_pre_kernel_choice";
  FM_REQUIRE(kernel != nullptr, kOp, "kernel", "must not be null");
  FM_RETURN_IF_ERROR(validate_mhc_pre(a));
  return project_kernel_choice(pre_params(a), a.shape.n, a.phi_dtype, a.kernel, kOp, kernel, reason);
}

Status mhc_pre(const MhcPreArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_pre";
  return detail::gpu_entry(kOp, validate_mhc_pre(a), stream, a.shape.batch == 0, [&]() -> Status {
    return launch_project(pre_params(a), a.shape.n, a.phi_dtype, a.kernel, stream, a.enable_pdl, kOp);
  });
}

namespace {

ProjectParams post_pre_params(const MhcPostPreArgs& a) {
  ProjectParams p = pre_params_of(a, a.h_post_next, a.h_res_next);  // x is X_L: the kernels make X_next from it
  set_post(p, a);
  return p;
}

// The boundary's path and projection kernel (MhcBoundaryPath states the
// rule; validated arguments, host only).
Status choose_post_pre_path(const MhcPostPreArgs& a, const char* op, MhcBoundaryPath* path, MhcPreKernel* kernel,
                            std::string* reason) {
  ProjectPlan plan;
  std::string why;
  const bool f32 = a.phi_dtype == DType::kFloat32;
  const int n = a.shape.n;
  const bool epilogue = a.norm_weight != nullptr || a.f_pre_fp8 != nullptr;
  if (epilogue && a.path == MhcBoundaryPath::kAuto &&
      (a.shape.batch == 0 || epilogue_target(a.f_pre, a.workspace, a.workspace_bytes, a.shape) != nullptr)) {
    // F_pre's epilogue as a pass: the path and kernel of the call without it,
    // where that kernel is the resident or split one (plan_project then
    // adds the pass to whichever launch runs the pre).
    MhcPostPreArgs plain = a;
    plain.norm_weight = nullptr;
    plain.f_pre_fp8 = nullptr;
    plain.f_pre_scales = nullptr;
    MhcBoundaryPath plain_path = MhcBoundaryPath::kAuto;
    MhcPreKernel plain_kernel = MhcPreKernel::kAuto;
    std::string plain_why;
    const Status s = choose_post_pre_path(plain, op, &plain_path, &plain_kernel, &plain_why);
    if (!s.ok() && s.code() != StatusCode::kNotSupported) return s;
    if (s.ok() && (plain_kernel == MhcPreKernel::kResident || plain_kernel == MhcPreKernel::kSplit)) {
      *path = plain_path;
      *kernel = plain_kernel;
      if (reason != nullptr)
        *reason = detail::concat(plain_why, "; F_pre's epilogue as a pass after it, over the plain F_pre in ",
                                 a.f_pre != nullptr ? "f_pre" : "the workspace's scratch");
      return Status::Ok();
    }
  }
  if (a.path == MhcBoundaryPath::kFused ||
      (a.path == MhcBoundaryPath::kAuto && (a.kernel != MhcPreKernel::kAuto || epilogue))) {
    FM_RETURN_IF_ERROR(plan_project(post_pre_params(a), n, f32, a.kernel, op, &plan, &why));
    *path = MhcBoundaryPath::kFused;
    *kernel = plan.c->kernel;
    if (reason != nullptr) {
      const char* because = a.path == MhcBoundaryPath::kFused    ? "fused: pinned by args.path; "
                            : a.kernel != MhcPreKernel::kAuto ? "fused: args.kernel pinned; "
                                                              : "fused: F_pre's epilogue in the cluster tiles "
                                                                "(no pass: no resident or split kernel for "
                                                                "the call, or f_pre null without the epilogue "
                                                                "workspace); ";
      *reason = detail::concat(because, why);
    }
    return Status::Ok();
  }
  if (a.path == MhcBoundaryPath::kAuto) {
    // The split kernel fused, where it takes the call.
    std::string split_why;
    const Status s = plan_project(post_pre_params(a), n, f32, MhcPreKernel::kAuto, op, &plan, &split_why);
    if (!s.ok() && s.code() != StatusCode::kNotSupported) return s;
    if (s.ok() && plan.c->kernel == MhcPreKernel::kSplit) {
      *path = MhcBoundaryPath::kFused;
      *kernel = plan.c->kernel;
      if (reason != nullptr) *reason = detail::concat("fused: the split kernel takes it; ", split_why);
      return Status::Ok();
    }
  }
  const MhcPreKernel pre_kernel = a.path == MhcBoundaryPath::kPostThenPre ? a.kernel : MhcPreKernel::kAuto;
  const MhcPreArgs pre = boundary_pre_args(a, pre_kernel);
  FM_RETURN_IF_ERROR(plan_project(pre_params(pre), n, f32, pre_kernel, op, &plan, &why));
  *path = MhcBoundaryPath::kPostThenPre;
  *kernel = plan.c->kernel;
  if (reason != nullptr)
    *reason = detail::concat(a.path == MhcBoundaryPath::kPostThenPre
                                 ? "post then pre: pinned by args.path; "
                                 : "post then pre: no split kernel for the call, and the fused resident and "
                                   "cluster-tile kernels measured slower than the two launches; ",
                             "the pre: ", why);
  return Status::Ok();
}

}  // namespace

Status mhc_post_pre_path_choice(const MhcPostPreArgs& a, MhcBoundaryPath* path, MhcPreKernel* kernel,
                                std::string* reason) {
  constexpr const char* kOp = "mhc_post_pre_path_choice";
  FM_REQUIRE(path != nullptr, kOp, "path", "must not be null");
  FM_RETURN_IF_ERROR(validate_mhc_post_pre(a));
  return detail::without_cuda_error_left(kOp, [&]() -> Status {
    MhcPreKernel k = MhcPreKernel::kAuto;
    FM_RETURN_IF_ERROR(choose_post_pre_path(a, kOp, path, &k, reason));
    if (kernel != nullptr) *kernel = k;
    return Status::Ok();
  });
}

Status mhc_post_pre_kernel_choice(const MhcPostPreArgs& a, MhcPreKernel* kernel, std::string* reason) {
  constexpr const char* kOp = "mhc_post_pre_kernel_choice";
  FM_REQUIRE(kernel != nullptr, kOp, "kernel", "must not be null");
  MhcBoundaryPath path = MhcBoundaryPath::kAuto;
  FM_RETURN_IF_ERROR(validate_mhc_post_pre(a));
  return detail::without_cuda_error_left(kOp, [&]() -> Status {
    return choose_post_pre_path(a, kOp, &path, kernel, reason);
  });
}

// The layer boundary: mhc_post fused in front of the next mhc_pre's
// projection kernel, which makes X_next on chip from X_L and F_out instead
// of reading it; or the two ops one after the other (MhcBoundaryPath).
Status mhc_post_pre(const MhcPostPreArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_post_pre";
  return detail::gpu_entry(kOp, validate_mhc_post_pre(a), stream, a.shape.batch == 0, [&]() -> Status {
    MhcBoundaryPath path = MhcBoundaryPath::kAuto;
    MhcPreKernel kernel = MhcPreKernel::kAuto;
    FM_RETURN_IF_ERROR(choose_post_pre_path(a, kOp, &path, &kernel, nullptr));
    if (path == MhcBoundaryPath::kFused)
      return launch_project(post_pre_params(a), a.shape.n, a.phi_dtype, kernel, stream, a.enable_pdl, kOp);
    // Both launches' arguments are checked before the first (each op's own
    // rules; the pre's kernel takes the call), so a refusal writes nothing;
    // an error of the second launch itself (a TMA descriptor the device
    // refuses, say) comes after X_next is written. Errors name this op.
    const MhcPostArgs post = boundary_post_args(a, a.x_next, a.x_next_scales);
    const MhcPreArgs pre = boundary_pre_args(a, kernel);
    auto named = [&](const Status& s) {
      return s.ok() ? s : Status(s.code(), detail::concat(kOp, " (post then pre): ", s.message()));
    };
    FM_RETURN_IF_ERROR(named(validate_mhc_post(post)));
    FM_RETURN_IF_ERROR(named(validate_mhc_pre(pre)));
    FM_RETURN_IF_ERROR(named(mhc_post(post, stream)));
    return named(mhc_pre(pre, stream));
  });
}

namespace {

// The last boundary (spec §4.10): the head's projection kernel with the post
// in front, X_next stored only where the caller gives x_next.
ProjectParams post_head_params(const MhcPostHeadArgs& a) {
  ProjectParams p = head_params(a);  // x is X_L: the kernels make X_next from it
  set_post(p, a);
  return p;
}

}  // namespace

namespace {

// Where mhc_post_head's two-launch path keeps X_next: x_next, or (bf16
// stream) the workspace's scratch (mhc_post_head_workspace_bytes); null: nowhere.
void* post_head_x_next(const MhcPostHeadArgs& a) {
  if (a.x_next != nullptr) return a.x_next;
  // (B = 0: a workspace counts as holding it, so the choice is that of B > 0; nothing runs.)
  if (a.residual != MhcResidual::kBf16) return nullptr;
  if (a.shape.batch == 0) return a.workspace;
  return workspace_scratch(a.workspace, a.workspace_bytes, mhc_post_head_workspace_bytes(a.shape), a.shape);
}

// The two-launch path's head on X_next at `x_next`; with X_next in the
// workspace's scratch the head keeps only the split kernel's part of it.
MhcHeadArgs post_head_head_args(const MhcPostHeadArgs& a, void* x_next, MhcPreKernel kernel) {
  MhcHeadArgs head = boundary_head_args(a, x_next, a.x_next_scales, kernel);
  if (a.x_next == nullptr) {
    head.workspace_bytes = mhc_workspace_bytes(a.shape);
    if (head.workspace_bytes == 0) head.workspace = nullptr;
  }
  return head;
}

// mhc_post_head's path and projection kernel (MhcPostHeadArgs::path states
// the rule; validated arguments, host only).
Status choose_post_head_path(const MhcPostHeadArgs& a, const char* op, MhcBoundaryPath* path, MhcPreKernel* kernel,
                             std::string* reason) {
  const bool f32 = a.phi_dtype == DType::kFloat32;
  const int n = a.shape.n;
  void* const x_next = post_head_x_next(a);
  ProjectPlan plan;
  std::string why;
  // (kResident pinned with kAuto: the two launches, the fused post having no resident form.)
  const bool resident_pinned = a.path == MhcBoundaryPath::kAuto && a.kernel == MhcPreKernel::kResident;
  if (a.path == MhcBoundaryPath::kPostThenPre || (resident_pinned && x_next != nullptr) ||
      (a.path == MhcBoundaryPath::kAuto && a.kernel == MhcPreKernel::kAuto && x_next != nullptr)) {
    bool two = a.path == MhcBoundaryPath::kPostThenPre || resident_pinned;
    if (!two) {  // kAuto: the fused split kernel where it takes the call, else the head on the resident kernel
      std::string fused_why;
      const Status s = plan_project(post_head_params(a), n, f32, MhcPreKernel::kAuto, op, &plan, &fused_why);
      if (!s.ok() && s.code() != StatusCode::kNotSupported) return s;
      if (!s.ok() || plan.c->kernel != MhcPreKernel::kSplit) {
        const MhcHeadArgs head = post_head_head_args(a, x_next, MhcPreKernel::kAuto);
        const Status h = plan_project(head_params(head), n, f32, MhcPreKernel::kAuto, op, &plan, &why);
        if (!h.ok() && h.code() != StatusCode::kNotSupported) return h;
        two = h.ok() && plan.c->kernel == MhcPreKernel::kResident;
      }
    } else {
      const MhcHeadArgs head = post_head_head_args(a, x_next, a.kernel);
      FM_RETURN_IF_ERROR(plan_project(head_params(head), n, f32, a.kernel, op, &plan, &why));
    }
    if (two) {
      *path = MhcBoundaryPath::kPostThenPre;
      *kernel = plan.c->kernel;
      if (reason != nullptr)
        *reason = detail::concat(a.path == MhcBoundaryPath::kPostThenPre ? "post then head: pinned by args.path; "
                                 : resident_pinned ? "post then head: args.kernel pins the resident kernel "
                                                     "(no fused post before its head); "
                                     : a.x_next != nullptr
                                         ? "post then head: x_next given and the head on the resident kernel "
                                           "(the fused post has no resident form); "
                                         : "post then head: X_next in the workspace's scratch and the head on the "
                                           "resident kernel (the fused post has no resident form); ",
                                 "the head: ", why);
      return Status::Ok();
    }
  }
  FM_RETURN_IF_ERROR(plan_project(post_head_params(a), n, f32, a.kernel, op, &plan, &why));
  *path = MhcBoundaryPath::kFused;
  *kernel = plan.c->kernel;
  if (reason != nullptr) *reason = detail::concat("fused; ", why);
  return Status::Ok();
}

}  // namespace

Status mhc_post_head_kernel_choice(const MhcPostHeadArgs& a, MhcPreKernel* kernel, std::string* reason) {
  constexpr const char* kOp = "mhc_post_head_kernel_choice";
  FM_REQUIRE(kernel != nullptr, kOp, "kernel", "must not be null");
  FM_RETURN_IF_ERROR(validate_mhc_post_head(a));
  return detail::without_cuda_error_left(kOp, [&]() -> Status {
    MhcBoundaryPath path = MhcBoundaryPath::kAuto;
    return choose_post_head_path(a, kOp, &path, kernel, reason);
  });
}

// The last boundary: the post fused in front of the head's projection
// kernel, or mhc_post writing x_next then mhc_head reading it back.
Status mhc_post_head(const MhcPostHeadArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_post_head";
  return detail::gpu_entry(kOp, validate_mhc_post_head(a), stream, a.shape.batch == 0, [&]() -> Status {
    MhcBoundaryPath path = MhcBoundaryPath::kAuto;
    MhcPreKernel kernel = MhcPreKernel::kAuto;
    FM_RETURN_IF_ERROR(choose_post_head_path(a, kOp, &path, &kernel, nullptr));
    if (path == MhcBoundaryPath::kFused)
      return launch_project(post_head_params(a), a.shape.n, a.phi_dtype, kernel, stream, a.enable_pdl, kOp);
    // Both launches' arguments are checked before the first (as mhc_post_pre's).
    // X_next in x_next or the workspace's scratch (post_head_head_args).
    void* const x_next = post_head_x_next(a);
    const MhcPostArgs post = boundary_post_args(a, x_next, a.x_next_scales);
    const MhcHeadArgs head = post_head_head_args(a, x_next, kernel);
    auto named = [&](const Status& s) {
      return s.ok() ? s : Status(s.code(), detail::concat(kOp, " (post then head): ", s.message()));
    };
    FM_RETURN_IF_ERROR(named(validate_mhc_post(post)));
    FM_RETURN_IF_ERROR(named(validate_mhc_head(head)));
    FM_RETURN_IF_ERROR(named(mhc_post(post, stream)));
    return named(mhc_head(head, stream));
  });
}

Status mhc_project(const MhcProjectArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_project";
  return detail::gpu_entry(kOp, validate_mhc_project(a), stream, a.shape.batch == 0, [&]() -> Status {
    ProjectParams p = base_params(a);
    p.h = a.h;
    p.r = a.r;
    p.num_coef = mhc_num_coefficients(a.shape.n);
    p.eps_norm = a.eps_norm;
    p.mode = ProjectMode::kProject;
    p.prefetch_weights = a.prefetch_weights && a.enable_pdl;
    return launch_project(p, a.shape.n, a.phi_dtype, a.kernel, stream, a.enable_pdl, kOp);
  });
}

Status mhc_head_kernel_choice(const MhcHeadArgs& a, MhcPreKernel* kernel, std::string* reason) {
  constexpr const char* kOp = "mhc_head_kernel_choice";
  FM_REQUIRE(kernel != nullptr, kOp, "kernel", "must not be null");
  FM_RETURN_IF_ERROR(validate_mhc_head(a));
  return project_kernel_choice(head_params(a), a.shape.n, a.phi_dtype, a.kernel, kOp, kernel, reason);
}

Status mhc_head(const MhcHeadArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_head";
  return detail::gpu_entry(kOp, validate_mhc_head(a), stream, a.shape.batch == 0, [&]() -> Status {
    return launch_project(head_params(a), a.shape.n, a.phi_dtype, a.kernel, stream, a.enable_pdl, kOp);
  });
}

Status mhc_post(const MhcPostArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_post";
  return detail::gpu_entry(kOp, validate_mhc_post(a), stream, a.shape.batch == 0, [&]() -> Status {
    const bool tr = a.res_layout == MhcResLayout::kDeepSeek;
    if (a.residual == MhcResidual::kFp8E4m3) {  // spec §4.9
      const bool ue8m0 = a.x_scale_format == ScaleFormat::kUE8M0;
      const int groups = int(a.shape.hidden / 16);
      const int threads = groups % 128 == 0 ? 128 : 64;  // C = 7168: 448 lanes, 7 CTAs of 64
      const dim3 grid(unsigned((groups + threads - 1) / threads), unsigned(std::min<int64_t>(a.shape.batch, 65535)));
      cudaError_t err = cudaSuccess;
      dispatch_n(a.shape.n, [&](auto kn) {
        constexpr int kN = decltype(kn)::value;
        constexpr ScaleFormat kF32 = ScaleFormat::kFloat32, kE8 = ScaleFormat::kUE8M0;
        auto kernel = tr ? (ue8m0 ? mhc_post_fp8_kernel<kN, true, kE8> : mhc_post_fp8_kernel<kN, true, kF32>)
                         : (ue8m0 ? mhc_post_fp8_kernel<kN, false, kE8> : mhc_post_fp8_kernel<kN, false, kF32>);
        err = dev::launch(kernel, grid, dim3(threads), 0, stream, a.enable_pdl, static_cast<const uint8_t*>(a.x),
                          a.x_scales, static_cast<const bf16*>(a.f_out), a.h_post, a.h_res,
                          static_cast<uint8_t*>(a.x_next), a.x_next_scales, (long long)a.shape.batch, groups,
                          int(a.shape.hidden));
      });
      if (err != cudaSuccess) return detail::cuda_status(err, kOp, "kernel launch");
      return detail::check_launch(kOp);
    }
    return launch_per_token_row(a.shape, kOp, [&](auto kn, dim3 grid, int groups) {
      constexpr int kN = decltype(kn)::value;
      auto kernel = tr ? mhc_post_kernel<kN, true> : mhc_post_kernel<kN, false>;
      return dev::launch(kernel, grid, dim3(128), 0, stream, a.enable_pdl, static_cast<const bf16*>(a.x),
                         static_cast<const bf16*>(a.f_out), a.h_post, a.h_res, static_cast<bf16*>(a.x_next),
                         (long long)a.shape.batch, groups, int(a.shape.hidden));
    });
  });
}

Status mhc_pre_mix(const MhcPreMixArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_pre_mix";
  return detail::gpu_entry(kOp, validate_mhc_pre_mix(a), stream, a.shape.batch == 0, [&]() -> Status {
    return launch_per_group(a.shape, kOp, [&](auto kn, dim3 grid, dim3 block, long long total, int groups) {
      return dev::launch(mhc_pre_mix_kernel<decltype(kn)::value>, grid, block, 0, stream, a.enable_pdl,
                         static_cast<const bf16*>(a.x), a.h_pre, static_cast<bf16*>(a.f_pre), total, groups,
                         int(a.shape.hidden));
    });
  });
}

Status mhc_expand(const MhcExpandArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_expand";
  return detail::gpu_entry(kOp, validate_mhc_expand(a), stream, a.shape.batch == 0, [&]() -> Status {
    if (a.residual == MhcResidual::kFp8E4m3) {  // spec §4.9
      const bool ue8m0 = a.x_scale_format == ScaleFormat::kUE8M0;
      return launch_per_token_row(a.shape, kOp, [&](auto kn, dim3 grid, int groups) {
        constexpr int kN = decltype(kn)::value;
        auto kernel = ue8m0 ? mhc_expand_fp8_kernel<kN, ScaleFormat::kUE8M0>
                            : mhc_expand_fp8_kernel<kN, ScaleFormat::kFloat32>;
        return dev::launch(kernel, grid, dim3(128), 0, stream, a.enable_pdl, static_cast<const bf16*>(a.embedding),
                           static_cast<uint8_t*>(a.x), a.x_scales, (long long)a.shape.batch, groups,
                           int(a.shape.hidden));
      });
    }
    return launch_per_group(a.shape, kOp, [&](auto kn, dim3 grid, dim3 block, long long total, int groups) {
      return dev::launch(mhc_expand_kernel<decltype(kn)::value>, grid, block, 0, stream, a.enable_pdl,
                         static_cast<const bf16*>(a.embedding), static_cast<bf16*>(a.x), total, groups,
                         int(a.shape.hidden));
    });
  });
}

Status mhc_activate(const MhcActivateArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mhc_activate";
  return detail::gpu_entry(kOp, validate_mhc_activate(a), stream, a.shape.batch == 0, [&]() -> Status {
    cudaError_t err = cudaSuccess;
    const ActParams p = act_params(a.params);
    dispatch_n(a.shape.n, [&](auto kn) {
      constexpr int kN = decltype(kn)::value;
      err = dev::launch(mhc_activate_kernel<kN>, dim3(grid_for(a.shape.batch, 128)), dim3(128), 0, stream, a.enable_pdl,
                        a.h, a.h_pre, a.h_post, a.h_res, (long long)a.shape.batch, p);
    });
    if (err != cudaSuccess) return detail::cuda_status(err, kOp, "kernel launch");
    return detail::check_launch(kOp);
  });
}

}  // namespace flashmix
