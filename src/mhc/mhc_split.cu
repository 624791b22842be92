// mhc_pre / mhc_project / mhc_head for small batches (B <= kMhcSplitMaxBatch),
// when the caller passes a workspace: the projection spread over the whole GPU
// in one launch.
//
//   h[b, m] = alpha_of(m) * (sum_k X[b,k] phi[m,k]) / r[b] + bias[m],  r[b] = sqrt(sum_k X[b,k]^2 / K + eps_norm)
//   F_pre[b, c] = sum_i H_pre[b, i] X[b, i, c]                          (SPEC §4)
//
// Why: at decode sizes the op is a latency problem, and the largest step is
// reading phi (N x K fp32: 2.75 MB at n = 4, C = 7168). A 16-CTA cluster (the
// resident kernel) reads it at ~16 SMs' fetch rate (~2 us) and then needs the
// cluster's steps after it; here each of up to one CTA per SM takes 8-column
// groups of every stream (all B tokens), so phi's slice is ~21 KB per CTA.
// Roofline (B = 16, n = 4, C = 7168, H200): bytes 2.75 MB phi + 0.92 MB X +
// 0.23 MB F_pre, ~1 us at the copy rate; the rest is latency: one grid-wide
// exchange of the partial sums through the workspace.
//
// Steps, one CTA (256 threads) per column slice:
//   1. phi's slice (fp32 in shared memory) and X's slice of every token.
//   2. Partial sums of the N coefficients and the sum of squares (FFMA in
//      fp32: phi is used exactly, no tensor-core split), reduced over the 8
//      warps in a fixed order, stored to the workspace.
//   3. A grid barrier (all CTAs are resident: at most one per SM, and the
//      launcher checks one fits).
//   4. Every CTA sums the pre coefficients and the sums of squares of all
//      tokens over the CTAs in a fixed order (bitwise the same in every CTA)
//      and mixes its own columns; CTA b (the owner of token b) also sums
//      token b's other coefficients and runs the activations + Sinkhorn
//      (mhc_pre) or writes h and r (mhc_project).
// No atomics on values: the output is bitwise reproducible.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "common/launch.cuh"
#include "common/vec.cuh"
#include "flashmix/mhc.h"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_split_layout.h"

namespace flashmix::mhc_detail {
namespace {

using bf16 = __nv_bfloat16;
using V8 = dev::Vec<bf16, 8>;
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxItems = kMhcSplitMaxBatch * (kMhcMaxStreams + 1);  // pre sums of all tokens

struct SplitArgs {
  float* ws_pre;            // [ctas][B][n+1]
  float* ws_rest;           // [B][rest_stride]: [ctas][N-n] per token
  unsigned* bar_count;      // arrivals of the current barrier (0 when idle)
  unsigned* bar_gen;        // generation, bumped by the last arrival
  int ctas;
  int cpg;                  // 8-column groups per CTA (the last CTA may have fewer)
  int x_row;                // shared-memory row of one token's slice, in bf16 elements
  int pre_floats;           // size of ws_pre, a multiple of 4
  int rest_stride;          // floats per token in ws_rest, a multiple of 4
};

__device__ __forceinline__ void unpack8(const V8& v, float* f) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = __bfloat162float(v.v[e]);
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA of the grid arrives; returns once all have. The counter is back
// at 0 afterwards, so the next launch on the same workspace starts clean.
// Callers' global writes before it are visible to every CTA after it.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen, unsigned ctas) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g0 = ld_acquire_gpu(gen);  // read before arriving: the barrier cannot complete without us
    if (atomicAdd(count, 1u) == ctas - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      while (ld_acquire_gpu(gen) == g0) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Copies `words` 16-byte words from global to shared memory (L2 only: the
// values were written by other SMs during this launch).
__device__ __forceinline__ void copy_words(float* dst, const float* src, int words) {
  for (int w = threadIdx.x; w < words; w += kThreads) dev::cp_async16(dst + 4 * w, src + 4 * w);
  dev::cp_async_commit();
}

// Sums `items` values over the ctas' records (record g at in + g * items) in
// a fixed order: `splits` contiguous runs of CTAs, then the runs in order.
// Every thread of the CTA calls it; out[items] in shared memory afterwards.
__device__ __forceinline__ void sum_over_ctas(const float* in, int items, int ctas, float* tmp, float* out) {
  const int splits = max(1, min(kThreads / items, ctas));
  for (int idx = threadIdx.x; idx < items * splits; idx += kThreads) {
    const int it = idx % items, sp = idx / items;
    const int g0 = sp * ctas / splits, g1 = (sp + 1) * ctas / splits;
    float sum = 0.f;
    for (int gg = g0; gg < g1; ++gg) sum += in[gg * items + it];
    tmp[sp * items + it] = sum;
  }
  __syncthreads();
  for (int it = threadIdx.x; it < items; it += kThreads) {
    float sum = tmp[it];
    for (int sp = 1; sp < splits; ++sp) sum += tmp[sp * items + it];
    out[it] = sum;
  }
  __syncthreads();
}

template <int kN, typename PhiT, int kTok>
__global__ void __launch_bounds__(kThreads, 1) mhc_split_kernel(ProjectParams p, SplitArgs s) {
  constexpr int kMaxCoef = kN * kN + 2 * kN;
  constexpr int kLaneSplit = 32 / kTok;  // lanes that share a token split its coefficients
  constexpr int kAcc = (kMaxCoef + kLaneSplit - 1) / kLaneSplit;
  constexpr int kRows = kAcc * kLaneSplit;  // phi rows in shared memory, zero past N
  __shared__ float s_tmp[kMaxItems > kThreads ? kMaxItems : kThreads];
  __shared__ float s_sum[kMaxItems];           // [B][n+1]: pre coefficients, then the sum of squares
  __shared__ float s_hpre[kMhcSplitMaxBatch][kN];
  __shared__ float s_r[kMhcSplitMaxBatch];
  __shared__ float s_rest[kMaxCoef];
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);  // [kTok][x_row]
  float* region = reinterpret_cast<float*>(smem + ((kTok * s.x_row * 2 + 15) / 16) * 16);

  const int g = blockIdx.x;
  const int C = p.hidden, K = p.k_len, ncoef = p.num_coef, B = int(p.batch);
  const int j0 = g * s.cpg, cw = min(s.cpg, C / 8 - j0);  // this CTA's 8-column groups
  const int chunks = kN * cw;                            // (stream, column group) pairs
  const int krow = kN * s.cpg * 8;                       // phi_s row, floats
  const int slots = ncoef + 1;

  // 1. phi's slice (weights: before the dependency when the caller allows it), then X's.
  auto load_phi = [&] {
    const PhiT* phi = static_cast<const PhiT*>(p.phi);
    const int total = kRows * chunks;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int m = idx / chunks, q = idx - m * chunks, i = q / cw, j = q - i * cw;
      const PhiT* src = phi + (long long)m * K + (long long)i * C + (j0 + j) * 8;
      float* dst = region + m * krow + (i * s.cpg + j) * 8;
      if (m >= ncoef) {  // rows past N: zeros, so the projection loop needs no guard
        *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      } else if constexpr (std::is_same_v<PhiT, float>) {
        dev::cp_async16(dst, src);
        dev::cp_async16(dst + 4, src + 4);
      } else {
        float f[8];
        unpack8(dev::load_ro<bf16, 8>(src), f);
        *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
  };
  if (p.prefetch_weights) load_phi();
  dev::grid_dependency_wait();
  if (!p.prefetch_weights) load_phi();
  for (int idx = threadIdx.x; idx < kTok * chunks; idx += kThreads) {
    const int b = idx / chunks, q = idx - b * chunks, i = q / cw, j = q - i * cw;
    bf16* dst = xs + b * s.x_row + (i * s.cpg + j) * 8;
    if (b < B)
      dev::cp_async16(dst, p.x + (long long)b * K + (long long)i * C + (j0 + j) * 8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);  // padding tokens: zeros, never stored
  }
  dev::cp_async_commit();
  dev::cp_async_wait<0>();
  __syncthreads();

  // 2. Partial sums: lane = (token, which of kLaneSplit coefficient subsets); warp w takes chunks w, w + 8, ...
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tb = lane % kTok, ms = lane / kTok;
  float acc[kAcc];
#pragma unroll
  for (int a = 0; a < kAcc; ++a) acc[a] = 0.f;
  float sq = 0.f;
  for (int q = warp; q < chunks; q += kWarps) {
    const int i = q / cw, j = q - i * cw, off = (i * s.cpg + j) * 8;
    float xf[8];
    unpack8(*reinterpret_cast<const V8*>(xs + tb * s.x_row + off), xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) sq = fmaf(xf[e], xf[e], sq);
#pragma unroll
    for (int a = 0; a < kAcc; ++a) {
      const float* row = region + (ms + a * kLaneSplit) * krow + off;
      const float4 p0 = *reinterpret_cast<const float4*>(row);
      const float4 p1 = *reinterpret_cast<const float4*>(row + 4);
      float t = acc[a];
      t = fmaf(xf[0], p0.x, t);
      t = fmaf(xf[1], p0.y, t);
      t = fmaf(xf[2], p0.z, t);
      t = fmaf(xf[3], p0.w, t);
      t = fmaf(xf[4], p1.x, t);
      t = fmaf(xf[5], p1.y, t);
      t = fmaf(xf[6], p1.z, t);
      acc[a] = fmaf(xf[7], p1.w, t);
    }
  }
  __syncthreads();  // phi_s is done with: the region now holds the warps' sums
  float* red = region;  // [kWarps][kTok][slots]
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    const int m = ms + a * kLaneSplit;
    if (m < ncoef) red[(warp * kTok + tb) * slots + m] = acc[a];
  }
  if (ms == 0) red[(warp * kTok + tb) * slots + ncoef] = sq;
  __syncthreads();
  for (int idx = threadIdx.x; idx < B * slots; idx += kThreads) {
    const int b = idx / slots, v = idx - b * slots;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * kTok + b) * slots + v];
    if (v < kN)
      s.ws_pre[(g * B + b) * (kN + 1) + v] = sum;
    else if (v == ncoef)
      s.ws_pre[(g * B + b) * (kN + 1) + kN] = sum;
    else
      s.ws_rest[b * s.rest_stride + g * (ncoef - kN) + (v - kN)] = sum;
  }

  // 3. Every CTA's partial sums are in the workspace after this.
  grid_barrier(s.bar_count, s.bar_gen, unsigned(s.ctas));
  dev::allow_dependents_launch();

  // 4. Pre coefficients and sums of squares of every token, summed over the CTAs.
  // The owner's other coefficients come in the same round trip (behind the pre block).
  const int items = B * (kN + 1);
  float* rest_in = region + s.pre_floats;
  copy_words(region, s.ws_pre, s.pre_floats / 4);
  if (p.mode != ProjectMode::kHead && g < B) copy_words(rest_in, s.ws_rest + g * s.rest_stride, s.rest_stride / 4);
  dev::cp_async_wait<0>();
  __syncthreads();
  sum_over_ctas(region, items, s.ctas, s_tmp, s_sum);
  for (int b = threadIdx.x; b < B; b += kThreads) {
    const float r = sqrtf(s_sum[b * (kN + 1) + kN] / float(K) + p.eps_norm);
    s_r[b] = r;
    if (p.mode != ProjectMode::kProject) {
      const float alpha = __ldg(p.alpha);
#pragma unroll
      for (int i = 0; i < kN; ++i)
        s_hpre[b][i] = sigmoidf_(alpha * s_sum[b * (kN + 1) + i] / r + __ldg(p.bias + i)) + p.act.eps_pre;
    }
  }
  __syncthreads();

  // The pre mix of this CTA's columns, from the slice of X still in shared memory.
  if (p.mode != ProjectMode::kProject) {
    for (int idx = threadIdx.x; idx < B * cw; idx += kThreads) {
      const int b = idx / cw, j = idx - b * cw;
      float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float xf[8];
        unpack8(*reinterpret_cast<const V8*>(xs + b * s.x_row + (i * s.cpg + j) * 8), xf);
        const float w = s_hpre[b][i];
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = fmaf(w, xf[e], out[e]);
      }
      V8 o;
#pragma unroll
      for (int e = 0; e < 8; ++e) o.v[e] = __float2bfloat16_rn(out[e]);
      dev::store<bf16, 8>(p.f_out + (long long)b * C + (j0 + j) * 8, o);
    }
  }
  if (p.mode == ProjectMode::kHead) return;

  // The owner of token b (CTA b mod ctas): its other coefficients, then the
  // activations with Sinkhorn (mhc_pre) or h and r (mhc_project).
  const int rest = ncoef - kN;
  for (int b = g; b < B; b += s.ctas) {
    if (b != g) {  // more tokens than CTAs (tiny C): the next owned token's block
      copy_words(rest_in, s.ws_rest + b * s.rest_stride, s.rest_stride / 4);
      dev::cp_async_wait<0>();
      __syncthreads();
    }
    sum_over_ctas(rest_in, rest, s.ctas, s_tmp, s_rest);
    if (threadIdx.x == 0) {
      const float r = s_r[b];
      float h[kMaxCoef];
#pragma unroll
      for (int m = 0; m < kMaxCoef; ++m) {
        const float raw = m < kN ? s_sum[b * (kN + 1) + m] : s_rest[m - kN];
        h[m] = __ldg(p.alpha + alpha_index(m, kN)) * raw / r + __ldg(p.bias + m);
      }
      if (p.mode == ProjectMode::kProject) {
#pragma unroll
        for (int m = 0; m < kMaxCoef; ++m) p.h[(long long)b * kMaxCoef + m] = h[m];
        p.r[b] = r;
      } else {
        float pre[kN], post[kN], res[kN * kN];
        activate_token<kN>(h, p.act, pre, post, res);
#pragma unroll
        for (int i = 0; i < kN; ++i) p.h_post[(long long)b * kN + i] = post[i];
#pragma unroll
        for (int e = 0; e < kN * kN; ++e) p.h_res[(long long)b * kN * kN + e] = res[e];
      }
    }
    __syncthreads();  // rest_in and s_tmp are reused by the next owned token
  }
}

template <int kN, typename PhiT, int kTok>
cudaError_t launch_split(const ProjectParams& p, const SplitArgs& s, size_t smem, cudaStream_t stream, bool pdl,
                         bool dry_run) {
  auto kernel = mhc_split_kernel<kN, PhiT, kTok>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorNotSupported;  // the grid barrier needs every CTA resident
  if (dry_run) return cudaSuccess;
  return dev::launch(kernel, dim3(unsigned(s.ctas)), dim3(kThreads), smem, stream, pdl, p, s);
}

}  // namespace

cudaError_t mhc_split_project(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                              bool dry_run) {
  if (p.workspace == nullptr || p.batch < 1 || p.batch > kMhcSplitMaxBatch) return cudaErrorNotSupported;
  int device = 0, sms = 0, smem_max = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return cudaErrorNotSupported;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return cudaErrorNotSupported;
  const int groups = p.hidden / 8;
  const int target = std::min(sms, kSplitMaxCtas);
  const int cpg = (groups + target - 1) / target;
  const int ctas = (groups + cpg - 1) / cpg;
  const int B = int(p.batch);
  const SplitWorkspaceLayout l = split_workspace_layout(ctas, B, n, p.num_coef);
  if (l.bytes > p.workspace_bytes) return cudaErrorNotSupported;  // validated for kSplitMaxCtas: not reached
  const int tok = B <= 8 ? 8 : B <= 16 ? 16 : 32;
  SplitArgs s;
  auto* ws = static_cast<unsigned char*>(p.workspace);
  s.bar_count = reinterpret_cast<unsigned*>(ws);
  s.bar_gen = reinterpret_cast<unsigned*>(ws + 128);
  s.ws_pre = reinterpret_cast<float*>(ws + l.pre_offset);
  s.ws_rest = reinterpret_cast<float*>(ws + l.rest_offset);
  s.ctas = ctas;
  s.cpg = cpg;
  s.x_row = n * cpg * 8 + 8;  // + 16 bytes: the tokens' rows start on different banks
  s.pre_floats = int(l.pre_floats);
  s.rest_stride = int(l.rest_floats);
  const size_t x_bytes = (size_t(tok) * s.x_row * 2 + 15) / 16 * 16;
  const int lane_split = 32 / tok, max_coef = n * n + 2 * n;
  const int rows = (max_coef + lane_split - 1) / lane_split * lane_split;  // the kernel's kRows
  const size_t phi_bytes = size_t(rows) * n * cpg * 8 * 4;
  const size_t red_bytes = size_t(kThreads / 32) * tok * (p.num_coef + 1) * 4;
  const size_t in_bytes = size_t(l.pre_floats + l.rest_floats) * 4;
  const size_t smem = x_bytes + std::max({phi_bytes, red_bytes, in_bytes});
  if (smem > size_t(smem_max)) return cudaErrorNotSupported;
  cudaError_t err = cudaErrorNotSupported;
  dispatch_n(n, [&](auto kn) {
    constexpr int kN = decltype(kn)::value;
    auto go = [&](auto tok_c) {
      constexpr int kTok = decltype(tok_c)::value;
      err = phi_is_f32 ? launch_split<kN, float, kTok>(p, s, smem, stream, pdl, dry_run)
                       : launch_split<kN, bf16, kTok>(p, s, smem, stream, pdl, dry_run);
    };
    if (tok == 8) go(std::integral_constant<int, 8>{});
    else if (tok == 16) go(std::integral_constant<int, 16>{});
    else go(std::integral_constant<int, 32>{});
  });
  return err;
}

}  // namespace flashmix::mhc_detail
