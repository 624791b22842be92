// mhc_pre / mhc_post_pre / mhc_project / mhc_head for small batches
// (B <= kMhcSplitMaxBatch), when the caller passes a workspace: the
// projection spread over the whole GPU in one launch.
//
//   h[b, m] = alpha_of(m) * (sum_k X[b,k] phi[m,k]) / r[b] + bias[m],  r[b] = sqrt(sum_k X[b,k]^2 / K + eps_norm)
//   F_pre[b, c] = sum_i H_pre[b, i] X[b, i, c]                          (spec §4)
//
// Why: at decode sizes the op is latency, and reading phi is its largest
// step (N x K fp32: 2.75 MB at n = 4, 18.4 MB at n = 8, C = 7168). The
// cluster-tile kernel fetches all of it through one 8-CTA cluster; here up to
// one CTA per SM takes 8-column groups of every stream for all B tokens, so
// phi streams in at the whole GPU's rate. Measured (H100, graph replays,
// docs/mhc.md "Decode"): B = 16, n = 4, C = 7168: 10.15 us (the resident
// kernel 11.35), mhc_post_pre 11.15 (20.05); n = 8: 27.5 (108.6).
//
// Steps, one CTA (512 threads) per column slice, CTAs in clusters of
// kSplitCluster (sm_90; one CTA a cluster elsewhere):
//   1. phi's slice (fp32 in shared memory), alpha and bias, X's slice of
//      every token. mhc_post_pre: X is X_L; with F_out's slice and the
//      tokens' H_post, H_res the CTA makes its slice of X_next in place
//      (mhc_post's arithmetic) and stores it once.
//   2. Partial sums of the N coefficients and the sum of squares on the
//      tensor cores (phi in three bf16 pieces: all its 24 bits), reduced
//      over the warps in a fixed order into shared memory.
//   3. The cluster's sums: after a cluster barrier, rank r adds items r,
//      r + 8, ... over the 8 ranks' shared memory (DSMEM, in rank order) and
//      publishes them in the cluster's record in the workspace, each value
//      with this launch's tag in the same 8-byte word (no fence, no barrier).
//   4. Every CTA reads the pre coefficients and sums of squares of all
//      tokens from every record, spinning on a word until its tag is this
//      launch's, and sums them in record order (bitwise the same in every
//      CTA); the owner of token b (CTA b) reads token b's other coefficients
//      in the same pass. Then the CTA mixes its own columns while the
//      owner's last warp runs the activations + Sinkhorn (mhc_pre) or writes
//      h and r (mhc_project).
// The tag is the epoch word + 1, read after the grid dependency; CTA 0 bumps
// the epoch once it has seen every record (so every CTA has read it). All
// CTAs must be resident at once: the launcher checks the clusters fit.
// No atomics on values: the output is bitwise reproducible.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/mma_sync.cuh"
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
constexpr int kGatherThreads = 256;  // threads that gather the pre items (with their splits)
constexpr int kSplitCluster = 8;     // CTAs a cluster on sm_90

// Rows of phi in shared memory: N rounded up to whole mma tiles of 8
// coefficients (the rows past N are zeros). Kernel and launcher.
constexpr int kCoefGroups = 8;
__host__ __device__ constexpr int split_phi_rows(int n) {
  return (n * n + 2 * n + kCoefGroups - 1) / kCoefGroups * kCoefGroups;
}

// Phase stamps for bench/probes/mhc_split_trace.cu (compiled out unless it
// defines FLASHMIX_MHC_SPLIT_TRACE): thread 0 and the owner warp's lane 0
// (thread kThreads - 32) keep the global timer at the kernel's steps in
// shared memory (no global store, so no fence waits on them) and write them
// out at the end.
#ifdef FLASHMIX_MHC_SPLIT_TRACE
__device__ unsigned long long g_split_trace[kSplitMaxCtas][32];
#define SPLIT_TRACE_DECL __shared__ unsigned long long s_trace[32];
#define SPLIT_STAMP(i)                                                                  \
  do {                                                                                \
    if (threadIdx.x == 0 || threadIdx.x == kThreads - 32) {                           \
      unsigned long long gt;                                                          \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));                          \
      s_trace[2 * (i) + (threadIdx.x != 0)] = gt;                                     \
      if (threadIdx.x == 0) s_trace[20 + (i)] = clock64();                            \
    }                                                                                 \
  } while (0)
#define SPLIT_TRACE_FLUSH()                                                           \
  do {                                                                                \
    if (threadIdx.x == 0 || threadIdx.x == kThreads - 32)                             \
      for (int q = threadIdx.x != 0; q < 32; q += 2) g_split_trace[blockIdx.x][q] = s_trace[q]; \
  } while (0)
#else
#define SPLIT_TRACE_DECL
#define SPLIT_STAMP(i) \
  do {                 \
  } while (0)
#define SPLIT_TRACE_FLUSH() \
  do {                      \
  } while (0)
#endif

struct SplitArgs {
  unsigned long long* rec;  // [records][rec_stride] tagged words (mhc_split_layout.h)
  unsigned* epoch;          // launches so far; this launch's tag is epoch + 1
  int records;              // gridDim.x / cluster
  int cluster;              // kSplitCluster (sm_90) or 1 (no cluster)
  int rec_stride;           // 8-byte words per record
  int cpg;                  // 8-column groups per CTA (the last CTAs may have fewer or none)
  int kk;                   // n * cpg * 8 rounded up to the k16 steps
  int x_row;                // shared-memory row of one token's slice, in bf16 elements
  int phi_row;              // shared-memory row of phi's slice, in floats
  float inv_k;              // 1 / K
};

__device__ __forceinline__ unsigned ld_relaxed_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_word(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// One record word: the value and the tag in one single-copy-atomic 8-byte store.
__device__ __forceinline__ void st_word(unsigned long long* p, float v, unsigned tag) {
  const unsigned long long w = (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

// Cluster pieces (sm_90 only; the launcher clusters the kernel only where
// its image was built for sm_90, so elsewhere they are never reached).
__device__ __forceinline__ void cl_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned cl_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
// The float at the same shared-memory offset as `p` in the CTA of rank `rank`.
__device__ __forceinline__ float ld_peer(const float* p, unsigned rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
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

// Two fp32 values as kP bf16 pairs whose sum is the pair (each piece the
// rounded remainder of the ones before: 3 pieces carry all 24 bits).
template <int kP>
__device__ __forceinline__ void split_pieces(float2 v, uint32_t (&out)[kP]) {
  float x = v.x, y = v.y;
#pragma unroll
  for (int pc = 0; pc < kP; ++pc) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);  // low half: x (the even k)
    out[pc] = *reinterpret_cast<const uint32_t*>(&h);
    if (pc + 1 < kP) {
      x -= __low2float(h);  // exact
      y -= __high2float(h);
    }
  }
}

// The runs gather_sum splits the records into: as many as kGatherThreads
// threads give each pre item, at most one a record.
__host__ __device__ constexpr int gather_splits(int pre_items, int records) {
  return pre_items >= kGatherThreads ? 1 : (kGatherThreads / pre_items < records ? kGatherThreads / pre_items : records);
}
// Sums `items` values over the workspace's records in record order: value
// `it` of record r is the word at rec[r * stride + word(it)], taken once its
// tag is `tag` (spinning until it is). `splits` contiguous runs of records
// (gather_splits of the pre items: the same in every CTA, so the sums are
// bitwise the same everywhere), up to 8 loads in flight per thread, then the
// runs in order. Every thread of the group calls it; out[items] (shared
// memory) is complete when it returns.
template <typename WordOf>
__device__ __forceinline__ void gather_sum(const unsigned long long* rec, int stride, int records, int items,
                                           int splits, WordOf word, unsigned tag, float* tmp, float* out,
                                           const Group& grp) {
  for (int idx = grp.tid(); idx < items * splits; idx += grp.threads) {
    const int it = idx % items, sp = idx / items;
    const int r0 = sp * records / splits, r1 = (sp + 1) * records / splits;
    const unsigned long long* p = rec + word(it);
    float sum = 0.f;
    for (int r = r0; r < r1; r += 8) {
      unsigned long long w[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (r + u < r1) w[u] = ld_word(p + (long long)(r + u) * stride);
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (r + u < r1) {
          while (unsigned(w[u] >> 32) != tag) w[u] = ld_word(p + (long long)(r + u) * stride);
          sum += __uint_as_float(unsigned(w[u]));
        }
    }
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
  // The projection's tiles: kMt tiles of 16 tokens (X's rows past B are
  // zeros), kNt tiles of 8 coefficients (phi's rows past N are zeros).
  constexpr int kTokP = kTok < 16 ? 16 : kTok, kMt = kTokP / 16;
  constexpr int kRows = split_phi_rows(kN);
  constexpr int kNt = kRows / 8;
  constexpr int kPieces = std::is_same_v<PhiT, float> ? 3 : 1;
  // The gather's runs: (pre items + rest) x splits <= 256 + 256 n (see gather_splits).
  __shared__ float s_tmp[kGatherThreads * (kN + 1)];
  __shared__ float s_part[kTok * (kMaxCoef + 1)];  // [B][N+1]: this CTA's partial sums (its peers read them)
  __shared__ float s_sum[kMaxItems + kMaxCoef];    // [B][n+1] pre coefficients + sum of squares, then the owner's rest
  __shared__ float s_hpre[kMhcSplitMaxBatch][kN];
  __shared__ float s_h[kMaxCoef];
  __shared__ unsigned s_tag;
  __shared__ float s_mix[kTok][kN * kN + kN];  // mhc_post_pre: token b's H_res (row-major), then H_post
  SPLIT_TRACE_DECL
  __shared__ float s_alpha[3], s_bias[kMaxCoef];  // weights, loaded with phi (no latency at the end)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);  // [kTokP][x_row]
  float* region = reinterpret_cast<float*>(smem + kTokP * s.x_row * 2);  // phi [kRows][phi_row], later the warps' sums

  const int g = blockIdx.x;
  const int C = p.hidden, K = p.k_len, ncoef = p.num_coef, B = int(p.batch);
  const int j0 = g * s.cpg, cw = max(0, min(s.cpg, C / 8 - j0));  // this CTA's 8-column groups (maybe none)
  const int chunks = kN * cw;                                     // (stream, column group) pairs
  const int krow = s.phi_row;
  const int slots = ncoef + 1;

  SPLIT_STAMP(0);
  // Columns this CTA does not load (a short or empty last slice, the k16
  // steps' padding) must be zeros in both operands.
  if (cw < s.cpg || s.kk != kN * s.cpg * 8) {
    uint4* z = reinterpret_cast<uint4*>(smem);
    const int words = (kTokP * s.x_row * 2 + kRows * krow * 4) / 16;
    for (int w = threadIdx.x; w < words; w += kThreads) z[w] = make_uint4(0, 0, 0, 0);
    __syncthreads();
  }
  // 1. phi's slice (weights: before the dependency when the caller allows it), then X's.
  // Thread t copies chunk t % chunks of rows t / chunks, + row_step, ...
  // (chunks <= kThreads: the launcher checks), so no division per copy.
  const int cchunks = max(chunks, 1);
  const int row_step = kThreads / cchunks, my_chunk = threadIdx.x % cchunks;
  const int first_row = chunks > 0 && threadIdx.x < row_step * chunks ? threadIdx.x / chunks : 1 << 20;  // the rest copy nothing
  const int my_i = my_chunk / max(cw, 1), my_j = my_chunk - my_i * cw;  // (no copies when cw == 0)
  const int my_off = (my_i * s.cpg + my_j) * 8;                           // in a shared-memory row
  const long long my_src = (long long)my_i * C + (j0 + my_j) * 8;         // in a global row
  // fp32 phi by cp.async; bf16 phi widened to fp32 through registers with 4
  // rows' loads in flight. (Issuing the loads a thread waits for -- bias,
  // alpha, the epoch word -- after its copies instead of before made no
  // measured difference: docs/mhc.md.)
  auto load_phi = [&] {
    const PhiT* phi = static_cast<const PhiT*>(p.phi);
    if constexpr (std::is_same_v<PhiT, float>) {
      for (int m = first_row; m < kRows; m += row_step) {
        float* dst = region + m * krow + my_off;
        if (m >= ncoef) {  // rows past N: zeros, so the projection loop needs no guard
          *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
          *reinterpret_cast<float4*>(dst + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
          continue;
        }
        const PhiT* src = phi + (long long)m * K + my_src;
        dev::cp_async16(dst, src);
        dev::cp_async16(dst + 4, src + 4);
      }
    } else {  // bf16 phi, widened to fp32: 4 rows' loads in flight at a time
      for (int m0 = first_row; m0 < kRows; m0 += 4 * row_step) {
        dev::Vec<bf16, 8> v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int m = m0 + u * row_step;
          if (m < ncoef) v[u] = dev::load_ro<bf16, 8>(phi + (long long)m * K + my_src);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int m = m0 + u * row_step;
          if (m >= kRows) break;
          float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // rows past N: zeros
          if (m < ncoef) unpack8(v[u], f);
          float* dst = region + m * krow + my_off;
          *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
          *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
        }
      }
    }
  };
  auto load_weights = [&] {
    if (threadIdx.x < ncoef) s_bias[threadIdx.x] = __ldg(p.bias + threadIdx.x);
    if (threadIdx.x < (p.mode == ProjectMode::kHead ? 1 : 3)) s_alpha[threadIdx.x] = __ldg(p.alpha + threadIdx.x);
  };
  if (p.prefetch_weights) {
    load_weights();
    load_phi();
  }
  dev::grid_dependency_wait();
  if (threadIdx.x == 0) s_tag = ld_relaxed_gpu(s.epoch) + 1u;
  if (!p.prefetch_weights) {
    load_weights();
    load_phi();
  }
  for (int b = first_row; b < kTokP; b += row_step) {
    bf16* dst = xs + b * s.x_row + my_off;
    if (b < B)
      dev::cp_async16(dst, p.x + (long long)b * K + my_src);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);  // padding tokens: zeros, never stored
  }
  // mhc_post_pre: F_out's slice [B][cw groups] beside X's rows and the
  // tokens' H_res, H_post (X above is then X_L).
  const bool post = p.has_post();
  bf16* fs = reinterpret_cast<bf16*>(region + kRows * krow);  // [kTok][cpg * 8], after phi's rows
  if (post) {
    for (int idx = threadIdx.x; idx < B * cw; idx += kThreads) {
      const int b = idx / cw, j = idx - b * cw;
      dev::cp_async16(fs + (b * s.cpg + j) * 8, p.post.f_out + (long long)b * C + (j0 + j) * 8);
    }
    for (int idx = threadIdx.x; idx < B * (kN * kN + kN); idx += kThreads) {
      const int b = idx / (kN * kN + kN), e = idx - b * (kN * kN + kN);
      s_mix[b][e] = e < kN * kN ? p.post.h_res[(long long)b * kN * kN + e] : p.post.h_post[(long long)b * kN + e - kN * kN];
    }
  }
  dev::cp_async_commit();
  dev::cp_async_wait<0>();
  __syncthreads();
  if (post) {
    // X_next = R X_L + H_post F_out for this slice, in place, and once to
    // x_next (where given): mhc_post's arithmetic (post_mix_pair), so the projection below
    // sees bitwise what mhc_pre would read back. A thread per (token, 8 columns).
    for (int idx = threadIdx.x; idx < B * cw; idx += kThreads) {
      const int b = idx / cw, j = idx - b * cw;
      uint4 xv[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) xv[i] = *reinterpret_cast<const uint4*>(xs + b * s.x_row + (i * s.cpg + j) * 8);
      const uint4 fv = *reinterpret_cast<const uint4*>(fs + (b * s.cpg + j) * 8);
      const uint32_t* fw = reinterpret_cast<const uint32_t*>(&fv);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float r[kN];
#pragma unroll
        for (int jj = 0; jj < kN; ++jj) r[jj] = p.post.transpose ? s_mix[b][jj * kN + i] : s_mix[b][i * kN + jj];
        const float hp = s_mix[b][kN * kN + i];
        uint4 o;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          uint32_t xw[kN];
#pragma unroll
          for (int jj = 0; jj < kN; ++jj) xw[jj] = reinterpret_cast<const uint32_t*>(&xv[jj])[w];
          ow[w] = post_mix_pair<kN>(xw, fw[w], r, hp);
        }
        *reinterpret_cast<uint4*>(xs + b * s.x_row + (i * s.cpg + j) * 8) = o;
        if (p.post.x_next != nullptr)  // mhc_post_head may leave X_next on chip
          __stcs(reinterpret_cast<uint4*>(p.post.x_next + (long long)b * K + (long long)i * C + (j0 + j) * 8), o);
      }
    }
    __syncthreads();
  }
  SPLIT_STAMP(1);

  // 2. Partial sums on the tensor cores (mma.sync m16n8k16, fp32
  // accumulators): A = X's slice (16 tokens a tile, exact in bf16), B = phi
  // split into bf16 pieces (fp32: hi + mid + lo, 24 significant bits, i.e.
  // phi as it is; bf16 phi: one piece), the sums of squares from X X^T's
  // diagonal (two more MMAs a tile). Warp w takes k16 steps w, w + 16, ...;
  // the warps' sums are added in warp order.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int steps = s.kk / 16;
  float acc[kMt][kNt][4], sq[kMt][2][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) sq[mt][h][e] = 0.f;
  }
  for (int st = warp; st < steps; st += kWarps) {
    const int kb = st * 16;
    uint32_t a[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      dev::ldmatrix_x4(a[mt], dev::smem_u32(xs + (mt * 16 + (lane & 15)) * s.x_row + kb + (lane >> 4) * 8));
      dev::mma_bf16_16816(sq[mt][0], a[mt], a[mt][0], a[mt][2]);  // X X^T, columns = tokens 0-7 of the tile
      dev::mma_bf16_16816(sq[mt][1], a[mt], a[mt][1], a[mt][3]);  // tokens 8-15
    }
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const float* prow = region + (nt * 8 + gq) * krow + kb + 2 * tq;
      const float2 v0 = *reinterpret_cast<const float2*>(prow);
      const float2 v1 = *reinterpret_cast<const float2*>(prow + 8);
      uint32_t b0[kPieces], b1[kPieces];
      split_pieces<kPieces>(v0, b0);
      split_pieces<kPieces>(v1, b1);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int pc = 0; pc < kPieces; ++pc) dev::mma_bf16_16816(acc[mt][nt], a[mt], b0[pc], b1[pc]);
    }
  }
  __syncthreads();  // phi_s is done with: the region now holds the warps' sums
  SPLIT_STAMP(7);
  float* red = region;  // [used warps][kTokP][slots]
  const int used = min(steps, kWarps);
  if (warp < used) {
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      float* row0 = red + (warp * kTokP + mt * 16 + gq) * slots;
      float* row1 = row0 + 8 * slots;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int m = nt * 8 + 2 * tq;
        if (m < ncoef) row0[m] = acc[mt][nt][0], row1[m] = acc[mt][nt][2];
        if (m + 1 < ncoef) row0[m + 1] = acc[mt][nt][1], row1[m + 1] = acc[mt][nt][3];
      }
      if (tq == gq >> 1) {  // the diagonal of X X^T: this lane holds token gq's and gq + 8's
        row0[ncoef] = sq[mt][0][gq & 1];
        row1[ncoef] = sq[mt][1][2 + (gq & 1)];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < B * slots; idx += kThreads) {
    const int b = idx / slots, v = idx - b * slots;
    float sum = 0.f;
    for (int w = 0; w < used; ++w) sum += red[(w * kTokP + b) * slots + v];
    s_part[idx] = sum;
  }
  __syncthreads();

  // 3. The cluster's sums of each item, published in its record.
  SPLIT_STAMP(2);
  const unsigned tag = s_tag;
  const int pre_items = B * (kN + 1), rest = ncoef - kN;
  // Item (b, v) of s_part -> its word in a record: pre coefficients and the
  // sum of squares of every token first, then the other coefficients.
  auto word_of_part = [&](int it) {
    const int b = it / slots, v = it - b * slots;
    return v < kN ? b * (kN + 1) + v : v == ncoef ? b * (kN + 1) + kN : pre_items + b * rest + (v - kN);
  };
  const bool clustered = s.cluster > 1;  // kSplitCluster CTAs a cluster, or none
  if (clustered) {                       // every rank's s_part is complete
    cl_arrive();
    cl_wait();
  }
  {
    const int cl = clustered ? kSplitCluster : 1, rank = clustered ? int(cl_rank()) : 0;
    unsigned long long* my_rec = s.rec + (long long)(g / cl) * s.rec_stride;
    for (int it = rank + cl * int(threadIdx.x); it < B * slots; it += cl * kThreads) {
      float v;
      if (clustered) {
        float part[kSplitCluster];
#pragma unroll
        for (int rk = 0; rk < kSplitCluster; ++rk) part[rk] = ld_peer(s_part + it, unsigned(rk));
        v = part[0];
#pragma unroll
        for (int rk = 1; rk < kSplitCluster; ++rk) v += part[rk];  // rank order
      } else {
        v = s_part[it];
      }
      st_word(my_rec + word_of_part(it), v, tag);
    }
  }
  // Done with the peers' s_part; the matching wait ends the kernel. (A
  // relaxed arrive here measured 1.1 us slower on an H100: 11.4 against
  // 10.15 us at B = 16, n = 4, C = 7168.)
  if (clustered) cl_arrive();
  SPLIT_STAMP(3);
  dev::allow_dependents_launch();

  // 4. Every record's pre items (all tokens) and, in the owner of token g,
  // token g's other coefficients: one pass, summed in record order.
  const bool owner = p.mode != ProjectMode::kHead && g < B;
  const int splits = gather_splits(pre_items, s.records);
  const Group all{0, kThreads, 0};
  {
    const int own_b = owner ? g : 0;
    auto word = [&](int it) { return it < pre_items ? it : pre_items + own_b * rest + (it - pre_items); };
    gather_sum(s.rec, s.rec_stride, s.records, pre_items + (owner ? rest : 0), splits, word, tag, s_tmp, s_sum,
               all);
  }
  SPLIT_STAMP(4);
  // CTA 0 has now seen a word of every record, so every CTA has read the
  // epoch (before its cluster's first barrier): the next launch's tag.
  if (g == 0 && threadIdx.x == 0) asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(s.epoch), "r"(tag) : "memory");

  // The pre path (every CTA but in stage 1): H_pre of every token, then the
  // mix of this CTA's columns from the slice of X still in shared memory. In
  // an owner CTA the last warp makes token g's coefficients meanwhile.
  const Group pre_grp = owner ? Group{0, kThreads - 32, 1} : all;
  if (p.mode != ProjectMode::kProject && (!owner || threadIdx.x < kThreads - 32)) {
    for (int b = pre_grp.tid(); b < B; b += pre_grp.threads) {
      // Fast division and sigmoid (as the resident kernel): H_pre within ~2 ulp.
      const float r = sqrtf(s_sum[b * (kN + 1) + kN] * s.inv_k + p.eps_norm);
#pragma unroll
      for (int i = 0; i < kN; ++i)
        s_hpre[b][i] = sigmoid_fast(s_alpha[0] * __fdividef(s_sum[b * (kN + 1) + i], r) + s_bias[i]) + p.act.eps_pre;
    }
    pre_grp.sync();
    SPLIT_STAMP(5);
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
    SPLIT_STAMP(6);
  }
  if (owner && threadIdx.x >= kThreads - 32) {
    // The owner warp: token g (its other coefficients gathered above), then
    // tokens g + grid, ... (more tokens than CTAs: tiny C), each gathered here.
    const Group own{kThreads - 32, 32, 2};
    const int lane = int(threadIdx.x) & 31;
    for (int b = g; b < B; b += int(gridDim.x)) {
      const float* rest_sum = s_sum + pre_items;
      if (b != g) {
        auto word = [&](int it) { return pre_items + b * rest + it; };
        gather_sum(s.rec, s.rec_stride, s.records, rest, splits, word, tag, s_tmp, s_sum + pre_items, own);
      }
      const float r = sqrtf(s_sum[b * (kN + 1) + kN] * s.inv_k + p.eps_norm);
      for (int m = lane; m < kMaxCoef; m += 32) {  // h, a lane per coefficient
        const float raw = m < kN ? s_sum[b * (kN + 1) + m] : rest_sum[m - kN];
        const float h = s_alpha[alpha_index(m, kN)] * __fdividef(raw, r) + s_bias[m];
        if (p.mode == ProjectMode::kProject) p.h[(long long)b * kMaxCoef + m] = h;
        s_h[m] = h;
      }
      __syncwarp();
      if (lane == 0) {
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
      __syncwarp();
    }
    SPLIT_STAMP(8);
  }
  SPLIT_TRACE_FLUSH();
  if (clustered) cl_wait();  // no peer reads this CTA's s_part any more
}

// The launch's shape: CTAs, their column groups, the records and shared memory.
struct SplitPlan {
  int cpg = 0, ctas = 0, grid = 0, kk = 0;
  size_t smem = 0;
};
SplitPlan split_plan(int groups, int target, int cluster, int n, int tok, int num_coef, bool post) {
  SplitPlan pl;
  pl.cpg = (groups + target - 1) / target;
  pl.ctas = (groups + pl.cpg - 1) / pl.cpg;
  pl.grid = (pl.ctas + cluster - 1) / cluster * cluster;  // CTAs past ctas hold no columns
  pl.kk = (n * pl.cpg * 8 + 15) / 16 * 16;
  const int tok_p = std::max(tok, 16);
  const int x_row = pl.kk + 8, phi_row = pl.kk + 4;  // + 16 bytes: rows start on different banks
  const size_t x_bytes = size_t(tok_p) * x_row * 2;
  // phi's rows, then (mhc_post_pre) F_out's slice of every token.
  const size_t phi_bytes = size_t(split_phi_rows(n)) * phi_row * 4 + (post ? size_t(tok) * pl.cpg * 8 * 2 : 0);
  const size_t red_bytes = size_t(kThreads / 32) * tok_p * (num_coef + 1) * 4;
  pl.smem = x_bytes + std::max(phi_bytes, red_bytes);
  return pl;
}

template <int kN, typename PhiT, int kTok>
cudaError_t launch_split(const ProjectParams& p, const detail::DeviceProps& dev, cudaStream_t stream, bool pdl,
                         bool dry_run, const char** why_not) {
  auto kernel = mhc_split_kernel<kN, PhiT, kTok>;
  const void* key = detail::kernel_key(kernel);
  const int groups = p.hidden / 8, B = int(p.batch);
  // Clusters where the kernel was built for sm_90 (its cluster code compiles
  // to nothing below; PTX JIT-compiled from an older target has none).
  int ptx = 0;
  if (detail::kernel_ptx_version(key, &ptx) != cudaSuccess)
    return not_supported(why_not, "split: no kernel image for this device");
  const int cluster = dev.cc_major >= 9 && ptx >= 90 ? kSplitCluster : 1;
  // Every CTA must be resident at once (they wait for each other's records):
  // start from one CTA per SM; if fewer clusters of this size fit, take fewer.
  int target = std::max(cluster, std::min(dev.sms, kSplitMaxCtas) / cluster * cluster);
  SplitPlan pl;
  for (int attempt = 0;; ++attempt) {
    pl = split_plan(groups, target, cluster, kN, kTok, p.num_coef, p.has_post());
    if (pl.smem > size_t(dev.smem_optin)) return not_supported(why_not, "split: its tile does not fit in shared memory");
    if (kN * pl.cpg > kThreads)  // a thread per (stream, column group) when copying
      return not_supported(why_not, "split: C too large for one CTA per SM");
    int resident = 0;
    if (cluster > 1) {
      int clusters = 0;
      if (detail::active_clusters(key, kThreads, pl.smem, cluster, &clusters) != cudaSuccess) clusters = 0;
      resident = clusters * cluster;
    } else {
      int per_sm = 0;
      if (detail::blocks_per_sm(key, kThreads, pl.smem, &per_sm) != cudaSuccess) per_sm = 0;
      resident = per_sm * dev.sms;
    }
    if (pl.grid <= resident) break;
    if (resident < cluster || attempt == 8)
      return not_supported(why_not, "split: its CTAs (with their shared memory) cannot all be resident on this device");
    // Fewer CTAs (each with more columns, so more shared memory): at least
    // one cluster fewer each round.
    target = std::min(target - cluster, resident / cluster * cluster);
  }
  const SplitWorkspaceLayout l = split_workspace_layout(pl.grid / cluster, B, p.num_coef);
  if (l.bytes > p.workspace_bytes)  // validated for kSplitMaxCtas records: not reached
    return not_supported(why_not, "split: the workspace is smaller than this device needs");
  if (dry_run) return cudaSuccess;
  SplitArgs s;
  auto* ws = static_cast<unsigned char*>(p.workspace);
  s.epoch = reinterpret_cast<unsigned*>(ws);
  s.rec = reinterpret_cast<unsigned long long*>(ws + l.rec_offset);
  s.records = pl.grid / cluster;
  s.cluster = cluster;
  s.rec_stride = int(l.rec_stride);
  s.cpg = pl.cpg;
  s.kk = pl.kk;
  s.x_row = pl.kk + 8;
  s.phi_row = pl.kk + 4;
  s.inv_k = 1.0f / float(p.k_len);
  if (cluster == 1) return dev::launch(kernel, dim3(unsigned(pl.grid)), dim3(kThreads), pl.smem, stream, pdl, p, s);
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t config =
      dev::cluster_launch_config(attr, dim3(unsigned(pl.grid)), dim3(kThreads), pl.smem, stream, cluster, pdl);
  return cudaLaunchKernelEx(&config, kernel, p, s);
}

}  // namespace

cudaError_t mhc_split_project(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                              bool dry_run, const char** why_not) {
  if (p.has_epilogue()) return not_supported(why_not, "split: no F_pre norm / FP8 epilogue in the kernel (a pass after it needs f_pre or a workspace of mhc_epilogue_workspace_bytes)");
  if (p.fp8x) return not_supported(why_not, "split: bf16 residual stream only (the FP8 stream runs on the cluster-tile and portable kernels)");
  if (p.workspace == nullptr) return not_supported(why_not, "split: needs a workspace (mhc_workspace_bytes)");
  if (p.batch < 1 || p.batch > kMhcSplitMaxBatch) return not_supported(why_not, "split: B must be 1..32");
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return not_supported(why_not, "no usable CUDA device");
  const int B = int(p.batch);
  const int tok = B <= 8 ? 8 : B <= 16 ? 16 : 32;
  cudaError_t err = cudaErrorNotSupported;
  dispatch_n(n, [&](auto kn) {
    constexpr int kN = decltype(kn)::value;
    auto go = [&](auto tok_c) {
      constexpr int kTok = decltype(tok_c)::value;
      err = phi_is_f32 ? launch_split<kN, float, kTok>(p, dev, stream, pdl, dry_run, why_not)
                       : launch_split<kN, bf16, kTok>(p, dev, stream, pdl, dry_run, why_not);
    };
    if (tok == 8) go(std::integral_constant<int, 8>{});
    else if (tok == 16) go(std::integral_constant<int, 16>{});
    else go(std::integral_constant<int, 32>{});
  });
  return err;
}

}  // namespace flashmix::mhc_detail
