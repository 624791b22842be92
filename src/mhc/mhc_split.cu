// mhc_pre / mhc_project / mhc_head for small batches (B <= kMhcSplitMaxBatch),
// when the caller passes a workspace: the projection spread over the whole GPU
// in one launch.
//
//   h[b, m] = alpha_of(m) * (sum_k X[b,k] phi[m,k]) / r[b] + bias[m],  r[b] = sqrt(sum_k X[b,k]^2 / K + eps_norm)
//   F_pre[b, c] = sum_i H_pre[b, i] X[b, i, c]                          (spec §4)
//
// Why: at decode sizes the op is latency, and reading phi is its largest
// step (N x K fp32: 2.75 MB at n = 4, 18.4 MB at n = 8, C = 7168). The
// cluster-tile kernel fetches all of it through one 8-CTA cluster; here up to
// one CTA per SM takes 8-column groups of every stream for all B tokens, so
// phi streams in at the whole GPU's rate. Roofline (B = 16, n = 8, C = 7168,
// H200): 18.4 MB phi + 1.8 MB X, ~5 us at the copy rate; the rest is
// latency. Measured (H200, graph replays, docs/mhc.md): n = 8 103 -> 26 us;
// at n = 4 the resident kernel stays faster (10.6 vs 11.2 us), so mhc_pre
// tries it first.
//
// Steps, one CTA (512 threads) per column slice:
//   1. phi's slice (fp32 in shared memory), alpha and bias, X's slice of every token.
//   2. Partial sums of the N coefficients and the sum of squares (FFMA in
//      fp32: phi is used exactly, no tensor-core split), reduced over the
//      warps in a fixed order, stored to the workspace.
//   3. A grid barrier (all CTAs are resident: at most one per SM, and the
//      launcher checks one fits).
//   4. Every CTA sums the pre coefficients and the sums of squares of all
//      tokens over the CTAs in a fixed order (bitwise the same in every CTA)
//      and mixes its own columns; CTA b (the owner of token b) meanwhile sums
//      token b's other coefficients on its other half and runs the
//      activations + Sinkhorn (mhc_pre) or writes h and r (mhc_project).
// No atomics on values: the output is bitwise reproducible.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "flashmix/mhc.h"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_split_layout.h"

namespace flashmix::mhc_detail {
namespace {

using bf16 = __nv_bfloat16;
using V8 = dev::Vec<bf16, 8>;
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kMaxItems = kMhcSplitMaxBatch * (kMhcMaxStreams + 1);  // pre sums of all tokens

// Rows of phi in shared memory: N rounded up to the 8 coefficient groups of
// the projection lanes (the rows past N are zeros). Kernel and launcher.
constexpr int kCoefGroups = 8;
__host__ __device__ constexpr int split_phi_rows(int n) {
  return (n * n + 2 * n + kCoefGroups - 1) / kCoefGroups * kCoefGroups;
}

struct SplitArgs {
  float* ws_pre;            // [ctas][B][n+1]
  float* ws_rest;           // [B][rest_stride]: [ctas][N-n] per token
  unsigned* bar_count;      // arrivals of the current barrier (0 when idle)
  unsigned* bar_gen;        // generation, bumped by the last arrival
  int ctas;
  int cpg;                  // 8-column groups per CTA (the last CTA may have fewer)
  int x_row;                // shared-memory row of one token's slice, in bf16 elements
  int phi_row;              // shared-memory row of phi's slice, in floats
  int pre_floats;           // size of ws_pre, a multiple of 4
  int rest_stride;          // floats per token in ws_rest, a multiple of 4
  float inv_k;              // 1 / K
};

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA of the grid arrives; returns once all have. `gen0` is the
// generation word as read after the grid dependency (this launch cannot bump
// it before every CTA has arrived, and the launch before bumped it before it
// finished). Each arrival is a release (the CTA's global writes, ordered
// before it by the block barrier, go with it) and an acquire; the last one
// resets the counter (nobody touches it again in this launch, and the next
// launch starts after this one ends) and publishes the new generation with a
// release store; the others acquire it. Callers' global writes before it are
// visible to every CTA after it.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen, unsigned gen0, unsigned ctas) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned arrived;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(count) : "memory");
    if (arrived == ctas - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(count) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gen), "r"(gen0 + 1) : "memory");
    } else {
      while (ld_acquire_gpu(gen) == gen0) {
      }
    }
  }
  __syncthreads();
}

// Copies `words` 16-byte words from global to shared memory (L2 only: the
// values were written by other SMs during this launch).
__device__ __forceinline__ void copy_words(float* dst, const float* src, int words) {
  for (int w = threadIdx.x; w < words; w += kThreads) dev::cp_async16(dst + 4 * w, src + 4 * w);
  dev::cp_async_commit();
}

// A group of `threads` threads (from thread `first`, whole warps) that
// synchronises on its own named barrier `bar` (1..15), or the whole CTA (bar 0).
struct Group {
  int first, threads, bar;
  __device__ int tid() const { return int(threadIdx.x) - first; }
  __device__ void sync() const {
    if (bar == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(threads) : "memory");
  }
};

// Sums `items` values over the ctas' records (value it of record g at
// in[g * stride + it]) in a fixed order: `splits` contiguous runs of CTAs,
// then the runs in order. Every thread of the group calls it; out[items] (in
// shared memory) is complete when it returns.
__device__ __forceinline__ void sum_over_ctas(const float* in, int stride, int items, int ctas, float* tmp,
                                              float* out, const Group& grp) {
  const int splits = max(1, min(grp.threads / items, ctas));
  for (int idx = grp.tid(); idx < items * splits; idx += grp.threads) {
    const int it = idx % items, sp = idx / items;
    const int g0 = sp * ctas / splits, g1 = (sp + 1) * ctas / splits;
    float sum = 0.f;
#pragma unroll 8
    for (int gg = g0; gg < g1; ++gg) sum += in[gg * stride + it];  // in order; the loads run ahead
    tmp[sp * items + it] = sum;
  }
  grp.sync();
  for (int it = grp.tid(); it < items; it += grp.threads) {
    float sum = tmp[it];
    for (int sp = 1; sp < splits; ++sp) sum += tmp[sp * items + it];
    out[it] = sum;
  }
  grp.sync();
}

template <int kN, typename PhiT, int kTok>
__global__ void __launch_bounds__(kThreads, 1) mhc_split_kernel(ProjectParams p, SplitArgs s) {
  constexpr int kMaxCoef = kN * kN + 2 * kN;
  // Projection lanes: 4 token groups x 8 coefficient groups; a lane takes
  // kTpl tokens (tg, tg + 4, ...) and every 8th coefficient, so each 16-byte
  // load of phi (from shared memory) feeds kTpl tokens and each load of X
  // feeds kAcc coefficients. 32 tokens: the warps split into two halves of
  // 16 tokens each (kTpl <= 4 keeps the accumulators in registers at n = 8).
  constexpr int kHalves = kTok > 16 ? 2 : 1;
  constexpr int kTpl = kTok / kHalves / 4, kMs = kCoefGroups;
  constexpr int kRows = split_phi_rows(kN);  // phi rows in shared memory, zero past N
  constexpr int kAcc = kRows / kMs;
  __shared__ float s_tmp[kMaxItems > kThreads ? kMaxItems : kThreads];  // the pre path's partial sums
  __shared__ float s_tmp_own[kThreads];                                   // the owner's
  __shared__ float s_sum[kMaxItems];           // [B][n+1]: pre coefficients, then the sum of squares
  __shared__ float s_hpre[kMhcSplitMaxBatch][kN];
  __shared__ float s_own[kN + 1];                  // the owned token's pre coefficients and sum of squares
  __shared__ float s_rest[kMaxCoef];
  __shared__ float s_h[kMaxCoef];
  __shared__ float s_alpha[3], s_bias[kMaxCoef];  // weights, loaded with phi (no latency at the end)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);  // [kTok][x_row]
  float* region = reinterpret_cast<float*>(smem + ((kTok * s.x_row * 2 + 15) / 16) * 16);

  const int g = blockIdx.x;
  const int C = p.hidden, K = p.k_len, ncoef = p.num_coef, B = int(p.batch);
  const int j0 = g * s.cpg, cw = min(s.cpg, C / 8 - j0);  // this CTA's 8-column groups
  const int chunks = kN * cw;                            // (stream, column group) pairs
  const int krow = s.phi_row;
  const int slots = ncoef + 1;

  // 1. phi's slice (weights: before the dependency when the caller allows it), then X's.
  // Thread t copies chunk t % chunks of rows t / chunks, + row_step, ...
  // (chunks <= kThreads: the launcher checks), so no division per copy.
  const int row_step = kThreads / chunks, my_chunk = threadIdx.x % chunks;
  const int first_row = threadIdx.x < row_step * chunks ? threadIdx.x / chunks : 1 << 20;  // the rest copy nothing
  const int my_i = my_chunk / cw, my_j = my_chunk - my_i * cw;
  const int my_off = (my_i * s.cpg + my_j) * 8;                           // in a shared-memory row
  const long long my_src = (long long)my_i * C + (j0 + my_j) * 8;         // in a global row
  auto load_phi = [&] {
    if (threadIdx.x < ncoef) s_bias[threadIdx.x] = __ldg(p.bias + threadIdx.x);
    if (threadIdx.x < (p.mode == ProjectMode::kHead ? 1 : 3)) s_alpha[threadIdx.x] = __ldg(p.alpha + threadIdx.x);
    const PhiT* phi = static_cast<const PhiT*>(p.phi);
    for (int m = first_row; m < kRows; m += row_step) {
      float* dst = region + m * krow + my_off;
      if (m >= ncoef) {  // rows past N: zeros, so the projection loop needs no guard
        *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
        continue;
      }
      const PhiT* src = phi + (long long)m * K + my_src;
      if constexpr (std::is_same_v<PhiT, float>) {
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
  const unsigned gen0 = threadIdx.x == 0 ? ld_relaxed_gpu(s.bar_gen) : 0u;  // in flight during the loads
  if (!p.prefetch_weights) load_phi();
  for (int b = first_row; b < kTok; b += row_step) {
    bf16* dst = xs + b * s.x_row + my_off;
    if (b < B)
      dev::cp_async16(dst, p.x + (long long)b * K + my_src);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);  // padding tokens: zeros, never stored
  }
  dev::cp_async_commit();
  dev::cp_async_wait<0>();
  __syncthreads();

  // 2. Partial sums. Warp w takes the tokens of half w % kHalves and chunks
  // w / kHalves + i * kWarps / kHalves; a chunk in two halves of 4 columns
  // (fewer live registers).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int half = warp % kHalves, tg = half * 16 + lane / kMs, ms = lane % kMs;
  float acc[kAcc][kTpl], sq[kTpl];
#pragma unroll
  for (int t = 0; t < kTpl; ++t) {
    sq[t] = 0.f;
#pragma unroll
    for (int a = 0; a < kAcc; ++a) acc[a][t] = 0.f;
  }
  for (int q = warp / kHalves; q < chunks; q += kWarps / kHalves) {
    const int i = q / cw, j = q - i * cw, off = (i * s.cpg + j) * 8;
#pragma unroll
    for (int h = 0; h < 8; h += 4) {
      float xv[kTpl][4];
#pragma unroll
      for (int t = 0; t < kTpl; ++t) {  // 4 bf16 -> fp32 exactly (a shift, a mask)
        const uint2 raw = *reinterpret_cast<const uint2*>(xs + (tg + 4 * t) * s.x_row + off + h);
        xv[t][0] = __uint_as_float(raw.x << 16);
        xv[t][1] = __uint_as_float(raw.x & 0xffff0000u);
        xv[t][2] = __uint_as_float(raw.y << 16);
        xv[t][3] = __uint_as_float(raw.y & 0xffff0000u);
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[t] = fmaf(xv[t][e], xv[t][e], sq[t]);
      }
#pragma unroll
      for (int a = 0; a < kAcc; ++a) {
        const float4 pv = *reinterpret_cast<const float4*>(region + (ms + a * kMs) * krow + off + h);
#pragma unroll
        for (int t = 0; t < kTpl; ++t) {
          float v = fmaf(xv[t][0], pv.x, acc[a][t]);
          v = fmaf(xv[t][1], pv.y, v);
          v = fmaf(xv[t][2], pv.z, v);
          acc[a][t] = fmaf(xv[t][3], pv.w, v);
        }
      }
    }
  }
  __syncthreads();  // phi_s is done with: the region now holds the warps' sums
  float* red = region;  // [kWarps][kTok][slots]
#pragma unroll
  for (int t = 0; t < kTpl; ++t) {
    float* row = red + (warp * kTok + tg + 4 * t) * slots;
#pragma unroll
    for (int a = 0; a < kAcc; ++a) {
      const int m = ms + a * kMs;
      if (m < ncoef) row[m] = acc[a][t];
    }
    if (ms == 0) row[ncoef] = sq[t];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < B * slots; idx += kThreads) {
    const int b = idx / slots, v = idx - b * slots;
    float sum = 0.f;
#pragma unroll
    for (int w = b / 16 % kHalves; w < kWarps; w += kHalves) sum += red[(w * kTok + b) * slots + v];
    if (v < kN)
      s.ws_pre[(g * B + b) * (kN + 1) + v] = sum;
    else if (v == ncoef)
      s.ws_pre[(g * B + b) * (kN + 1) + kN] = sum;
    else
      s.ws_rest[b * s.rest_stride + g * (ncoef - kN) + (v - kN)] = sum;
  }

  // 3. Every CTA's partial sums are in the workspace after this.
  grid_barrier(s.bar_count, s.bar_gen, gen0, unsigned(s.ctas));
  dev::allow_dependents_launch();

  // 4. The blocks every CTA needs (all tokens' pre coefficients and sums of
  // squares) and, for the owner of token g, its other coefficients: one round trip.
  const int items = B * (kN + 1);
  const int rest = ncoef - kN;
  float* rest_in = region + s.pre_floats;
  const bool owner = p.mode != ProjectMode::kHead && g < B;
  copy_words(region, s.ws_pre, s.pre_floats / 4);
  if (owner) copy_words(rest_in, s.ws_rest + g * s.rest_stride, s.rest_stride / 4);
  dev::cp_async_wait<0>();
  __syncthreads();

  // The pre path (every CTA but in stage 1): H_pre of every token, then the
  // mix of this CTA's columns from the slice of X still in shared memory. In
  // an owner CTA it takes half the warps, and the other half makes token g's
  // coefficients at the same time (the two are the kernel's last steps).
  const Group all{0, kThreads, 0};
  const Group pre_grp = owner ? Group{0, kThreads / 2, 1} : all;
  const Group own_grp{kThreads / 2, kThreads / 2, 2};
  if (p.mode != ProjectMode::kProject && (!owner || threadIdx.x < kThreads / 2)) {
    sum_over_ctas(region, items, items, s.ctas, s_tmp, s_sum, pre_grp);
    for (int b = pre_grp.tid(); b < B; b += pre_grp.threads) {
      // Fast division and sigmoid (as the resident kernel): H_pre within ~2 ulp.
      const float r = sqrtf(s_sum[b * (kN + 1) + kN] * s.inv_k + p.eps_norm);
#pragma unroll
      for (int i = 0; i < kN; ++i)
        s_hpre[b][i] = sigmoid_fast(s_alpha[0] * __fdividef(s_sum[b * (kN + 1) + i], r) + s_bias[i]) + p.act.eps_pre;
    }
    pre_grp.sync();
    for (int idx = pre_grp.tid(); idx < B * cw; idx += pre_grp.threads) {
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
  if (!owner) return;

  // The owner of token b (CTA b mod ctas): its coefficients summed over the
  // CTAs, then the activations with Sinkhorn (mhc_pre) or h and r
  // (mhc_project). Token g on the owner half (the whole CTA in stage 1);
  // further tokens (more tokens than CTAs: tiny C) on the whole CTA.
  for (int b = g; b < B; b += s.ctas) {
    const Group grp = b == g && p.mode != ProjectMode::kProject ? own_grp : all;
    if (b != g) {
      __syncthreads();  // both halves are done with the previous token
      copy_words(rest_in, s.ws_rest + b * s.rest_stride, s.rest_stride / 4);
      dev::cp_async_wait<0>();
      __syncthreads();
    }
    if (grp.bar == 0 || threadIdx.x >= kThreads / 2) {
      sum_over_ctas(region + b * (kN + 1), items, kN + 1, s.ctas, s_tmp_own, s_own, grp);  // pre + sum of squares
      sum_over_ctas(rest_in, rest, rest, s.ctas, s_tmp_own, s_rest, grp);
      const float r = sqrtf(s_own[kN] * s.inv_k + p.eps_norm);
      for (int m = grp.tid(); m < kMaxCoef; m += grp.threads) {  // h, a thread per coefficient
        const float raw = m < kN ? s_own[m] : s_rest[m - kN];
        const float h = s_alpha[alpha_index(m, kN)] * __fdividef(raw, r) + s_bias[m];
        if (p.mode == ProjectMode::kProject) p.h[(long long)b * kMaxCoef + m] = h;
        s_h[m] = h;
      }
      grp.sync();
      if (grp.tid() == 0) {
        if (p.mode == ProjectMode::kProject) {
          p.r[b] = r;
        } else {
          float h[kMaxCoef];
#pragma unroll
          for (int m = 0; m < kMaxCoef; ++m) h[m] = s_h[m];
          float pre[kN], post[kN], res[kN * kN];
          activate_token<kN>(h, p.act, pre, post, res);
#pragma unroll
          for (int i = 0; i < kN; ++i) p.h_post[(long long)b * kN + i] = post[i];
#pragma unroll
          for (int e = 0; e < kN * kN; ++e) p.h_res[(long long)b * kN * kN + e] = res[e];
        }
      }
      grp.sync();
    }
  }
}

template <int kN, typename PhiT, int kTok>
cudaError_t launch_split(const ProjectParams& p, const SplitArgs& s, size_t smem, cudaStream_t stream, bool pdl,
                         bool dry_run, const char** why_not) {
  auto kernel = mhc_split_kernel<kN, PhiT, kTok>;
  // The grid barrier needs every CTA resident: one per SM must fit.
  int per_sm = 0;
  if (detail::blocks_per_sm(detail::kernel_key(kernel), kThreads, smem, &per_sm) != cudaSuccess || per_sm < 1)
    return not_supported(why_not, "split: a CTA of this size does not fit on an SM of this device");
  if (dry_run) return cudaSuccess;
  return dev::launch(kernel, dim3(unsigned(s.ctas)), dim3(kThreads), smem, stream, pdl, p, s);
}

}  // namespace

cudaError_t mhc_split_project(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                              bool dry_run, const char** why_not) {
  if (p.has_post()) return not_supported(why_not, "split: no fused post (mhc_post_pre)");
  if (p.has_epilogue()) return not_supported(why_not, "split: no F_pre norm / FP8 epilogue");
  if (p.fp8x) return not_supported(why_not, "split: bf16 residual stream only (the FP8 stream runs on the cluster-tile and portable kernels)");
  if (p.workspace == nullptr) return not_supported(why_not, "split: needs a workspace (mhc_workspace_bytes)");
  if (p.batch < 1 || p.batch > kMhcSplitMaxBatch) return not_supported(why_not, "split: B must be 1..32");
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return not_supported(why_not, "no usable CUDA device");
  const int groups = p.hidden / 8;
  const int target = std::min(dev.sms, kSplitMaxCtas);
  const int cpg = (groups + target - 1) / target;
  const int ctas = (groups + cpg - 1) / cpg;
  const int B = int(p.batch);
  const SplitWorkspaceLayout l = split_workspace_layout(ctas, B, n, p.num_coef);
  if (l.bytes > p.workspace_bytes)  // validated for kSplitMaxCtas: not reached
    return not_supported(why_not, "split: the workspace is smaller than this device needs");
  const int tok = B <= 8 ? 8 : B <= 16 ? 16 : 32;
  SplitArgs s;
  auto* ws = static_cast<unsigned char*>(p.workspace);
  s.bar_count = reinterpret_cast<unsigned*>(ws);
  s.bar_gen = reinterpret_cast<unsigned*>(ws + 128);
  s.ws_pre = reinterpret_cast<float*>(ws + l.pre_offset);
  s.ws_rest = reinterpret_cast<float*>(ws + l.rest_offset);
  s.ctas = ctas;
  s.cpg = cpg;
  s.x_row = n * cpg * 8 + 8;    // + 16 bytes: the tokens' rows start on different banks
  s.phi_row = n * cpg * 8 + 4;  // + 16 bytes: the 8 rows a warp reads hit different banks
  s.pre_floats = int(l.pre_floats);
  s.rest_stride = int(l.rest_floats);
  s.inv_k = 1.0f / float(p.k_len);
  const size_t x_bytes = (size_t(tok) * s.x_row * 2 + 15) / 16 * 16;
  const size_t phi_bytes = size_t(split_phi_rows(n)) * s.phi_row * 4;
  const size_t red_bytes = size_t(kThreads / 32) * tok * (p.num_coef + 1) * 4;
  const size_t in_bytes = size_t(l.pre_floats + l.rest_floats) * 4;
  const size_t smem = x_bytes + std::max({phi_bytes, red_bytes, in_bytes});
  if (smem > size_t(dev.smem_optin)) return not_supported(why_not, "split: its tile does not fit in shared memory");
  if (n * cpg > kThreads)  // a thread per (stream, column group) when copying
    return not_supported(why_not, "split: C too large for one CTA per SM");
  cudaError_t err = cudaErrorNotSupported;
  dispatch_n(n, [&](auto kn) {
    constexpr int kN = decltype(kn)::value;
    auto go = [&](auto tok_c) {
      constexpr int kTok = decltype(tok_c)::value;
      err = phi_is_f32 ? launch_split<kN, float, kTok>(p, s, smem, stream, pdl, dry_run, why_not)
                       : launch_split<kN, bf16, kTok>(p, s, smem, stream, pdl, dry_run, why_not);
    };
    if (tok == 8) go(std::integral_constant<int, 8>{});
    else if (tok == 16) go(std::integral_constant<int, 16>{});
    else go(std::integral_constant<int, 32>{});
  });
  return err;
}

}  // namespace flashmix::mhc_detail
