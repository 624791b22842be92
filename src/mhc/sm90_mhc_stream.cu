// mhc_pre (and mhc_project) for larger batches when the caller passes a
// workspace: one CTA per 64-column slice of every stream (G = C / 64 CTAs,
// 112 at C = 7168), X streamed through in chunks of 64 tokens, the partial
// projections exchanged through the workspace.
//
//   h[b,m] = alpha_of(m) * (X[b] . phi[m]) / r[b] + bias[m],  r[b] = sqrt(|X[b]|^2 / K + eps)
//   F_pre[b,c] = sum_i H_pre[b,i] X[b,i,c]     (H_pre from h; Sinkhorn for H_res)
//
// Why (n = 4, C = 7168, B = 8192; docs/mhc.md): the resident kernel splits K
// over a 16-CTA cluster and pays, per 16-token tile, a partial sum over 8
// warps and 400 st.async pushes into 16 CTAs; its warps were bound by those
// steps, not by HBM (1.6x the floor). Here K is split over G CTAs instead
// and a chunk is 64 tokens: a CTA's slice of phi (64 columns x 4 streams, 24
// KB as hi/lo fragments) sits in its projection warps' registers, each warp
// runs a whole 16-token tile over half the slice (no cross-warp reduction
// but one pair add), and the exchange is one 112-byte record per (token,
// CTA) written to the workspace (L2) plus one counter per chunk. The tile's
// owner CTA (token b: CTA b mod G) sums the G records in a fixed order,
// publishes H_pre, and every CTA mixes its columns from the chunk still in
// shared memory: X is read from HBM once. A 6-stage ring of chunks (32 KB
// each) keeps ~8 us of exchange latency in flight.
//
// Roles (512 threads, 4 warpgroups):
//   warps 0-7   projection (setmaxnreg 160): warp w takes tokens 16 (w % 4)..
//               of the chunk over streams 2 (w / 4), 2 (w / 4) + 1; the pair
//               (w, w + 4) adds in smem (fixed order), warp w writes the records;
//               thread 0 then counts the chunk's arrival (release).
//   warps 8-11  mix (setmaxnreg 72): wait for the chunk's H_pre count, mix
//               64 tokens x 64 columns, release the stage.
//   warp 12     producer (setmaxnreg 120, as the owners): one 3-D TMA box
//               (64 columns x 64 tokens x 4 streams) per chunk.
//   warps 13-15 owners (setmaxnreg 120): for each owned token, wait for the
//               chunk's G arrivals, sum the pre coefficients and the sum of
//               squares (pass 1), publish H_pre, sum the other coefficients
//               (pass 2), release the records, then the activations and
//               Sinkhorn (or h and r for mhc_project).
// No atomics on values: sums in fixed orders, bitwise reproducible. The
// counters are left at zero by the last CTA to leave.
#include <cuda.h>
#include <cuda_bf16.h>

#include <map>
#include <mutex>

#include "common/launch.cuh"
#include "common/sm90.cuh"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_split_layout.h"
#include "mhc/sm90_mhc_tma.h"

namespace flashmix::mhc_detail {

namespace {

using bf16 = __nv_bfloat16;
using dev::ldmatrix_x4;
using dev::mbar_arrive_expect_tx;
using dev::mbar_init;
using dev::mbar_wait;
using dev::smem_u32;

constexpr int kN = 4;
constexpr int kCoef = kN * kN + 2 * kN;  // 24
constexpr int kKt = kCoef / 8;           // n8 coefficient tiles
constexpr int kTok = kStreamChunk;       // 64 tokens per chunk
constexpr int kStages = 6;
constexpr int kSlots = kStreamSlots;
constexpr int kRec = kStreamRecord;
constexpr int kProjWarps = 8, kMixWarps = 4, kOwnerWarps = 3;
constexpr int kThreads = 512;
constexpr int kProjRegs = 160, kMixRegs = 72, kOwnerRegs = 120;  // 256*160 + 128*72 + 128*120 = 65536
constexpr int kStageBytes = kN * kTok * 128;                     // [stream][token][64 columns]: 32 KB
constexpr int kSteps = kN * 64 / 16 / 2;                         // k16 steps per projection warp (half the slice)
constexpr int kPairVals = 20;                                    // 12 accumulators + 8 sums-of-squares fragments
constexpr int kBarMix = 5;                                       // named barriers 1-4: the pairs; 5: the mix warps
// The producer issues chunk c's X once this CTA has mixed chunk c - kMixLag:
// the mix re-reads X from L2, so this bounds the X in L2 awaiting its mix
// (kMixLag chunks x 64 tokens x K x 2 bytes: 29 MB at C = 7168).
constexpr int kMixLag = 8;
static_assert(kCoef % 8 == 0, "n = 4: three whole coefficient tiles");

struct StreamArgs {
  unsigned* done;      // CTAs that have left (the last one resets the workspace)
  unsigned* released;  // [chunks] owners done with the chunk's records
  float* hpre;         // [B][4], encoded
  float* part;         // [kSlots][kTok][G][kRec], encoded
  int ctas;            // G
  int chunks;
  float inv_k;
};

__device__ __forceinline__ void named_bar(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void mbar_arrive_local(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Counts one arrival on a workspace counter, releasing this thread's earlier
// accesses (and, through the warp barrier before it, its warp's).
__device__ __forceinline__ void count_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

// Values exchanged through the workspace carry their own "written" flag: a
// written word is never 0. enc flips the sign bit of v + 0 (which turns -0
// into +0, so no value encodes to 0; NaN stays NaN); dec undoes it. Readers
// poll the words themselves (one L2 round trip once they land) instead of a
// counter that the writer would have to release after a fence (two more).
__device__ __forceinline__ uint32_t enc(float v) { return __float_as_uint(__fadd_rn(v, 0.0f)) ^ 0x80000000u; }
__device__ __forceinline__ float dec(uint32_t w) { return __uint_as_float(w ^ 0x80000000u); }
__device__ __forceinline__ uint4 ld_poll(const float* p) {  // relaxed, GPU scope: from L2, re-read every call
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ bool written(const uint4& v) { return v.x != 0u && v.y != 0u && v.z != 0u && v.w != 0u; }

// L2 eviction policies: X's TMA loads stay (evict_last) until the mix has
// re-read them (evict_first, as the F_pre stores).
__device__ __forceinline__ uint64_t l2_policy_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t l2_policy_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 ld_x(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void st_out(void* p, const uint4& v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}

__device__ __forceinline__ uint32_t ld_poll1(const float* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The owner's reads of one token's records, CTAs lane, lane + 32, ... (< G)
// in kBatch-CTA batches: polled until every word read is written, summed in
// CTA order, then zeroed for the ring's next lap. Pass 1: the pre
// coefficients (floats 0-3) into v[0..3] and the sum of squares (float 4)
// into v[4]; pass 2: the other coefficients (floats 8-27) into v[0..19].
template <bool kPass1, int kBatch>
__device__ __forceinline__ void take_records(float* recs, int G, int lane, float (&v)[kPass1 ? 5 : 20]) {
  constexpr int kF4 = kPass1 ? 1 : 5;  // 16-byte words per record (+ the sum of squares in pass 1)
  constexpr int kFirst = kPass1 ? 0 : 8;
#pragma unroll 1
  for (int u0 = 0; 32 * u0 < G; u0 += kBatch) {
    uint4 a[kBatch][kF4];
    uint32_t sq[kBatch];
    bool ok;
    do {
      ok = true;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int gg = lane + 32 * (u0 + u);
        if (gg < G) {
#pragma unroll
          for (int f = 0; f < kF4; ++f) {
            a[u][f] = ld_poll(recs + gg * kRec + kFirst + 4 * f);
            ok = ok && written(a[u][f]);
          }
          if (kPass1) {
            sq[u] = ld_poll1(recs + gg * kRec + kN);
            ok = ok && sq[u] != 0u;
          }
        }
      }
      if (!ok) __nanosleep(128);
    } while (!ok);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int gg = lane + 32 * (u0 + u);
      if (gg < G) {
#pragma unroll
        for (int f = 0; f < kF4; ++f) {
          v[4 * f] += dec(a[u][f].x);
          v[4 * f + 1] += dec(a[u][f].y);
          v[4 * f + 2] += dec(a[u][f].z);
          v[4 * f + 3] += dec(a[u][f].w);
          *reinterpret_cast<uint4*>(recs + gg * kRec + kFirst + 4 * f) = make_uint4(0, 0, 0, 0);
        }
        if (kPass1) {
          v[4] += dec(sq[u]);
          recs[gg * kRec + kN] = 0.f;
        }
      }
    }
  }
}

template <bool kF32>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_mhc_stream_kernel(ProjectParams p, StreamArgs s, const __grid_constant__ CUtensorMap x_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  __shared__ float coef_alpha[kCoef], coef_bias[kCoef];
  __shared__ __align__(16) float pair_buf[2][kProjWarps / 2][32][kPairVals];  // [chunk & 1][tile][lane][values]
  __shared__ __align__(16) float hpre_s[2][kTok][kN];  // [chunk & 1]: H_pre of the chunk's tokens, decoded
  __shared__ int mixed;                                 // chunks this CTA has mixed (the producer's throttle)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = s.ctas, cta = int(blockIdx.x), nch = s.chunks;
  const int C = p.hidden, K = p.k_len;
  const long long B = p.batch;
  const int c0 = cta * 64;  // this CTA's columns of every stream
  const uint32_t ring = (smem_u32(smem) + 1023u) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
  auto valid_of = [&](int c) { const long long left = B - (long long)c * kTok; return int(left < kTok ? left : kTok); };

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(smem_u32(&full[st]), 1);                         // the producer's expect_tx
      mbar_init(smem_u32(&empty[st]), kProjWarps);  // every warp that reads the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // Weights may be read before the grid dependency with prefetch_weights
  // (the caller's promise); everything else waits for it.
  if (!p.prefetch_weights) dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  if (tid == 0) mixed = 0;
  if (tid < kCoef) {
    coef_alpha[tid] = __ldg(p.alpha + alpha_index(tid, kN));
    coef_bias[tid] = __ldg(p.bias + tid);
  }
  __syncthreads();

  if (warp < kProjWarps) {
    // ---------------- projection ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kProjRegs));
    const int tile = warp & 3, half = warp >> 2;
    const int g = lane >> 2, t = lane & 3;
    // phi's B fragments for this warp's 8 k16 steps: step s covers stream
    // 2 half + s / 4, columns 16 (s % 4) .. + 15 of the slice; fragment rows
    // (k) 2t, 2t+1 and 2t+8, 2t+9, column (coefficient) 8 kt + g.
    uint32_t bhi[kSteps][kKt][2];
    uint32_t blo[kF32 ? kSteps : 1][kKt][2];
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const long long k = (long long)(2 * half + st / 4) * C + c0 + 16 * (st % 4) + 2 * t;
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const long long at = (long long)(kt * 8 + g) * K + k;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if constexpr (kF32) {
            const float2 v = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(p.phi) + at + 8 * hh));
            const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
            const float2 hf = __bfloat1622float2(hi);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x - hf.x, v.y - hf.y);
            bhi[st][kt][hh] = *reinterpret_cast<const uint32_t*>(&hi);
            blo[st][kt][hh] = *reinterpret_cast<const uint32_t*>(&lo);
          } else {
            bhi[st][kt][hh] = __ldg(reinterpret_cast<const unsigned*>(static_cast<const bf16*>(p.phi) + at + 8 * hh));
          }
        }
      }
    }
    dev::grid_dependency_wait();  // before the workspace and X (a no-op unless prefetch_weights)
    // ldmatrix.x4 lane address: token row (lane & 7) + 8 ((lane >> 3) & 1) of
    // the tile, k offset 8 (lane >> 4); line = stream * 64 + token, 16-byte
    // unit u of a line at u ^ (line & 7).
    const int a_row = tile * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    uint32_t u_off[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      u_off[q] = uint32_t((2 * half * kTok + a_row) * 128 + (((2 * q + (lane >> 4)) ^ (a_row & 7)) << 4));

#pragma unroll 1
    for (int c = 0; c < nch; ++c) {
      const int stage = c % kStages, slot = c % kSlots;
      // The producer issued this chunk's X only once the owners of chunk
      // c - kSlots were done with the record slot (released): the stage's
      // full barrier carries that ordering here.
      mbar_wait(smem_u32(&full[stage]), uint32_t(c / kStages) & 1u);
      float acc[kKt][4], sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[kt][e] = 0.f;
      const uint32_t base = ring + stage * kStageBytes;
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        uint32_t a[4];
        ldmatrix_x4(a, base + u_off[st % 4] + (st / 4) * kTok * 128);
        // Sums of squares as the diagonals of X_tile X_tile^T (8 tokens per mma).
        dev::mma_bf16_16816(sq_lo, a, a[0], a[2]);
        dev::mma_bf16_16816(sq_hi, a, a[1], a[3]);
#pragma unroll
        for (int kt = 0; kt < kKt; ++kt) {
          dev::mma_bf16_16816(acc[kt], a, bhi[st][kt][0], bhi[st][kt][1]);
          if constexpr (kF32) dev::mma_bf16_16816(acc[kt], a, blo[st][kt][0], blo[st][kt][1]);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive_local(smem_u32(&empty[stage]));  // ldmatrix is synchronous: the reads are done
      float* pb = &pair_buf[c & 1][tile][lane][0];
      if (half == 1) {
        float4* o = reinterpret_cast<float4*>(pb);
        o[0] = make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
        o[1] = make_float4(acc[1][0], acc[1][1], acc[1][2], acc[1][3]);
        o[2] = make_float4(acc[2][0], acc[2][1], acc[2][2], acc[2][3]);
        o[3] = make_float4(sq_lo[0], sq_lo[1], sq_lo[2], sq_lo[3]);
        o[4] = make_float4(sq_hi[0], sq_hi[1], sq_hi[2], sq_hi[3]);
        named_bar(1 + tile, 64);
        continue;
      }
      named_bar(1 + tile, 64);  // the other half's values are in pair_buf (double-buffered by chunk parity)
      {
        const float4* o = reinterpret_cast<const float4*>(pb);
        float4 v;
#pragma unroll
        for (int kt = 0; kt < kKt; ++kt) {
          v = o[kt];
          acc[kt][0] += v.x, acc[kt][1] += v.y, acc[kt][2] += v.z, acc[kt][3] += v.w;
        }
        v = o[3];
        sq_lo[0] += v.x, sq_lo[1] += v.y, sq_lo[2] += v.z, sq_lo[3] += v.w;
        v = o[4];
        sq_hi[0] += v.x, sq_hi[1] += v.y, sq_hi[2] += v.z, sq_hi[3] += v.w;
      }
      // Records of the chunk's valid tokens (an owner reads and zeroes each):
      // coefficient m at m (m < 4) or m + 4; the sum of squares at 4.
      const int valid = valid_of(c), r_lo = tile * 16 + g, r_hi = r_lo + 8;
      uint32_t* rec0 = reinterpret_cast<uint32_t*>(s.part) + ((long long)(slot * kTok + r_lo) * G + cta) * kRec;
      uint32_t* rec8 = rec0 + 8LL * G * kRec;
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const int m = kt * 8 + 2 * t, at = m < kN ? m : m + 4;
        if (r_lo < valid) *reinterpret_cast<uint2*>(rec0 + at) = make_uint2(enc(acc[kt][0]), enc(acc[kt][1]));
        if (r_hi < valid) *reinterpret_cast<uint2*>(rec8 + at) = make_uint2(enc(acc[kt][2]), enc(acc[kt][3]));
      }
      // Diagonal: token g < 8 is D[g][g] of sq_lo (lane 4g + g/2, element g & 1);
      // token 8 + g is D[8+g][g] of sq_hi (same lane, element 2 + (g & 1)).
      if (t == (g >> 1)) {
        if (r_lo < valid) rec0[kN] = enc((g & 1) ? sq_lo[1] : sq_lo[0]);
        if (r_hi < valid) rec8[kN] = enc((g & 1) ? sq_hi[3] : sq_hi[2]);
      }
    }
  } else if (warp < kProjWarps + kMixWarps) {
    // ---------------- mix ----------------
    // X comes from L2 (left there by the TMA with evict_last), not from the
    // ring: a stage is free as soon as the projection has read it, and the
    // ring only has to cover X's HBM latency, not the exchange's.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kMixRegs));
    dev::grid_dependency_wait();
    const int mt = tid - kProjWarps * 32;  // 0..127
    const int unit = mt & 7, r0 = mt >> 3;  // 8 columns (one 16-byte unit), tokens r0, r0 + 16, ...
    const uint64_t pol_first = l2_policy_first();
    constexpr int kItems = kTok / 16;
#pragma unroll 1
    for (int c = 0; c < nch; ++c) {
      const int valid = valid_of(c);
      if (p.mode == ProjectMode::kPre) {
        // Warp 0 of the mix polls the chunk's H_pre (2 tokens per lane)
        // until every owner wrote it, and hands it over in shared memory.
        float(*hs)[kN] = hpre_s[c & 1];
        if (mt < 32) {
          const float* hp = s.hpre + (long long)c * kTok * 4;
          uint4 w[2];
          bool ok;
          do {
            ok = true;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int r = lane + 32 * j;
              w[j] = r < valid ? ld_poll(hp + r * 4) : make_uint4(1, 1, 1, 1);
              ok = ok && written(w[j]);
            }
            if (!ok) __nanosleep(64);
          } while (!__all_sync(0xffffffffu, ok));
#pragma unroll
          for (int j = 0; j < 2; ++j)
            *reinterpret_cast<float4*>(hs[lane + 32 * j]) = make_float4(dec(w[j].x), dec(w[j].y), dec(w[j].z), dec(w[j].w));
        }
        named_bar(kBarMix, kMixWarps * 32);
        const bf16* xc = p.x + (long long)c * kTok * K + c0 + unit * 8;
#pragma unroll
        for (int it = 0; it < kItems; it += 2) {
          uint4 raw[2][kN];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int r = r0 + 16 * (it + u);
#pragma unroll
            for (int i = 0; i < kN; ++i)
              raw[u][i] = r < valid ? ld_x(xc + (long long)r * K + i * C, pol_first) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int r = r0 + 16 * (it + u);
            if (r >= valid) break;
            const float4 w4 = *reinterpret_cast<const float4*>(hs[r]);
            const float w[4] = {w4.x, w4.y, w4.z, w4.w};
            float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < kN; ++i) {
              const uint32_t x4[4] = {raw[u][i].x, raw[u][i].y, raw[u][i].z, raw[u][i].w};
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                out[2 * e] = fmaf(w[i], __uint_as_float(x4[e] << 16), out[2 * e]);
                out[2 * e + 1] = fmaf(w[i], __uint_as_float(x4[e] & 0xffff0000u), out[2 * e + 1]);
              }
            }
            uint4 o;
            uint32_t* ov = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const __nv_bfloat162 v = __floats2bfloat162_rn(out[2 * e], out[2 * e + 1]);
              ov[e] = *reinterpret_cast<const uint32_t*>(&v);
            }
            st_out(p.f_out + ((long long)c * kTok + r) * C + c0 + unit * 8, o, pol_first);
          }
        }
      }
      // This CTA has mixed chunk c (the producer's throttle; hpre_s[c & 1]
      // is reused two chunks on, after the barrier of chunk c + 1).
      named_bar(kBarMix, kMixWarps * 32);
      if (mt == 0) {
        asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"(smem_u32(&mixed)), "r"(c + 1) : "memory");
      }
    }
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kOwnerRegs));
    dev::grid_dependency_wait();
    if (warp == kProjWarps + kMixWarps) {
      // ---------------- producer ----------------
      if (lane == 0) {
        const uint64_t pol_last = l2_policy_last();
        for (int c = 0; c < nch; ++c) {
          const int stage = c % kStages;
          if (c >= kMixLag) {  // this CTA has mixed chunk c - kMixLag (its X may leave L2)
            int done;
            do {
              asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(done) : "r"(smem_u32(&mixed)) : "memory");
            } while (done < c - kMixLag + 1);
          }
          if (c >= kStages) mbar_wait(smem_u32(&empty[stage]), uint32_t(c / kStages - 1) & 1u);
          // The record slot chunk c will write: its owners of chunk c - kSlots
          // have read and zeroed it (acquire; passed on by the full barrier).
          if (c >= kSlots) {
            const unsigned* rel = s.released + (c - kSlots);
            const unsigned need = unsigned(valid_of(c - kSlots));
            while (ld_acquire_gpu(rel) < need) __nanosleep(64);
          }
          const uint32_t bar = smem_u32(&full[stage]);
          mbar_arrive_expect_tx(bar, uint32_t(kStageBytes));
          asm volatile(
              "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
              "[%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(ring + stage * kStageBytes),
              "l"(reinterpret_cast<uint64_t>(&x_map)), "r"(c0), "r"(c * kTok), "r"(0), "r"(bar), "l"(pol_last)
              : "memory");
        }
      }
    } else {
      // ---------------- owners ----------------
      // Token b = c * kTok + i belongs to CTA b mod G; the owner warps take
      // this CTA's tokens in turn. Per token: the pre coefficients and the
      // sum of squares (pass 1) -> H_pre, published at once; the other
      // coefficients (pass 2); h stashed in lane (count % 32), and the
      // activations + Sinkhorn run 32 tokens at a time, one per lane, off
      // the path H_pre takes.
      const int ow = warp - (kProjWarps + kMixWarps + 1);
      int q = 0, stashed = 0;
      float stash[kCoef];
      long long stash_b = 0;
      auto flush = [&] {
        if (lane < stashed) {
          float pre[kN], post[kN], res[kN * kN];
          activate_token<kN>(stash, p.act, pre, post, res);
          *reinterpret_cast<float4*>(p.h_post + stash_b * kN) = make_float4(post[0], post[1], post[2], post[3]);
#pragma unroll
          for (int e = 0; e < kN * kN; e += 4)
            *reinterpret_cast<float4*>(p.h_res + stash_b * kN * kN + e) =
                make_float4(res[e], res[e + 1], res[e + 2], res[e + 3]);
        }
        stashed = 0;
      };
#pragma unroll 1
      for (int c = 0; c < nch; ++c) {
        const int valid = valid_of(c), slot = c % kSlots;
        int i = cta - int((long long)c * kTok % G);
        if (i < 0) i += G;
#pragma unroll 1
        for (; i < valid; i += G, ++q) {
          if (q % kOwnerWarps != ow) continue;
          const long long b = (long long)c * kTok + i;
          float* recs = s.part + (long long)(slot * kTok + i) * G * kRec;
          // Lane l sums CTAs l, l + 32, ... in order, then a butterfly:
          // every lane ends with the same fixed-order totals.
          float v1[kN + 1] = {0, 0, 0, 0, 0};
          take_records<true, 4>(recs, G, lane, v1);
#pragma unroll
          for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
            for (int e = 0; e < kN + 1; ++e) v1[e] += __shfl_xor_sync(0xffffffffu, v1[e], m);
          const float r = sqrtf(v1[kN] * s.inv_k + p.eps_norm);
          if (p.mode == ProjectMode::kPre && lane == 0) {
            uint4 hp;
            hp.x = enc(sigmoid_fast(coef_alpha[0] * __fdividef(v1[0], r) + coef_bias[0]) + p.act.eps_pre);
            hp.y = enc(sigmoid_fast(coef_alpha[1] * __fdividef(v1[1], r) + coef_bias[1]) + p.act.eps_pre);
            hp.z = enc(sigmoid_fast(coef_alpha[2] * __fdividef(v1[2], r) + coef_bias[2]) + p.act.eps_pre);
            hp.w = enc(sigmoid_fast(coef_alpha[3] * __fdividef(v1[3], r) + coef_bias[3]) + p.act.eps_pre);
            *reinterpret_cast<uint4*>(s.hpre + b * 4) = hp;
          }
          float v2[kCoef - kN];
#pragma unroll
          for (int e = 0; e < kCoef - kN; ++e) v2[e] = 0.f;
          take_records<false, 2>(recs, G, lane, v2);
          __syncwarp();
          if (lane == 0) count_release(s.released + c);  // this token's records are read and zeroed
#pragma unroll
          for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
            for (int e = 0; e < kCoef - kN; ++e) v2[e] += __shfl_xor_sync(0xffffffffu, v2[e], m);
          if (p.mode == ProjectMode::kProject) {
            float raw = 0.f;  // lane m writes h[m] (selected, not indexed: v1 and v2 stay in registers)
#pragma unroll
            for (int m = 0; m < kCoef; ++m) raw = lane == m ? (m < kN ? v1[m] : v2[m - kN]) : raw;
            if (lane < kCoef) p.h[b * kCoef + lane] = coef_alpha[lane] * __fdividef(raw, r) + coef_bias[lane];
            if (lane == 0) p.r[b] = r;
            continue;
          }
          if (lane == stashed) {
#pragma unroll
            for (int m = 0; m < kCoef; ++m)
              stash[m] = coef_alpha[m] * __fdividef(m < kN ? v1[m] : v2[m - kN], r) + coef_bias[m];
            stash_b = b;
          }
          if (++stashed == 32) flush();
        }
      }
      if (stashed > 0) flush();
    }
  }

  // The last CTA to leave resets the counters and H_pre (every CTA's polls
  // are done by then; the owners zeroed the records they read).
  __syncwarp();
  __syncthreads();
  unsigned prev = 0;
  if (tid == 0)
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(prev) : "l"(s.done) : "memory");
  if (__syncthreads_or(tid == 0 && prev == unsigned(G - 1))) {
    for (int idx = tid; idx < nch; idx += kThreads) s.released[idx] = 0u;
    for (long long idx = tid; idx < B; idx += kThreads)
      *reinterpret_cast<uint4*>(s.hpre + idx * 4) = make_uint4(0, 0, 0, 0);
    if (tid == 0) *s.done = 0u;
  }
#endif
}

constexpr size_t kDynamicSmem = size_t(kStages) * kStageBytes + 1024;  // + the ring's alignment

template <bool kF32>
cudaError_t launch_stream(const ProjectParams& p, cudaStream_t stream, bool pdl, bool dry_run) {
  const int G = p.hidden / 64;
  const StreamWorkspaceLayout l = stream_workspace_layout(G, p.batch);
  if (p.workspace_bytes < l.bytes) return cudaErrorNotSupported;  // validated against mhc_workspace_bytes: not reached
  auto kernel = sm90_mhc_stream_kernel<kF32>;
  // Function attributes, not stream work (capture-safe), once per device:
  // every CTA must be resident at once (they wait on each other's records).
  static std::mutex mutex;
  static std::map<int, int> max_ctas;  // device -> CTAs that fit at once (0: none)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = max_ctas.find(device);
    if (it == max_ctas.end()) {
      int sms = 0, per_sm = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDynamicSmem)) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kDynamicSmem) != cudaSuccess) {
        (void)cudaGetLastError();
        sms = per_sm = 0;
      }
      it = max_ctas.emplace(device, sms * per_sm).first;
    }
    if (G > it->second) return cudaErrorNotSupported;
  }
  if (dry_run) return cudaSuccess;
  CUtensorMap x_map;
  if (!encode_x_map(p, kN, kTok, x_map)) return cudaErrorNotSupported;
  StreamArgs s;
  auto* ws = static_cast<unsigned char*>(p.workspace);
  s.done = reinterpret_cast<unsigned*>(ws);
  s.released = reinterpret_cast<unsigned*>(ws + l.released_offset);
  s.hpre = reinterpret_cast<float*>(ws + l.hpre_offset);
  s.part = reinterpret_cast<float*>(ws + l.part_offset);
  s.ctas = G;
  s.chunks = int(l.chunks);
  s.inv_k = 1.0f / float(p.k_len);
  return dev::launch(kernel, dim3(unsigned(G)), dim3(kThreads), kDynamicSmem, stream, pdl, p, s, x_map);
}

}  // namespace

cudaError_t sm90_mhc_project_stream(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                    bool dry_run) {
  if (p.workspace == nullptr || p.mode == ProjectMode::kHead || !stream_takes_shape(p.batch, n, p.hidden))
    return cudaErrorNotSupported;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  if (major != 9 || minor != 0) return cudaErrorNotSupported;  // built for sm_90a only
  return phi_is_f32 ? launch_stream<true>(p, stream, pdl, dry_run) : launch_stream<false>(p, stream, pdl, dry_run);
}

}  // namespace flashmix::mhc_detail
