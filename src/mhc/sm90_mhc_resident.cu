// mhc_pre (and mhc_project) on Hopper with phi resident in registers: a
// persistent cluster of 16 CTAs splits K across its CTAs, each CTA loads its
// slice of phi ONCE per launch into the tensor-core B fragments of its warps,
// and X streams through in 16-token tiles.
//
//   h[b,m] = alpha_of(m) * (X[b] . phi[m]) / r[b] + bias[m],  r[b] = sqrt(|X[b]|^2 / K + eps)
//   F_pre[b,c] = sum_i H_pre[b,i] X[b,i,c]     (H_pre from h; Sinkhorn for H_res)
//
// Why this shape (n = 4, C = 7168: K = 28672, N = 24 coefficients):
// the projection is [B x K] . [K x N] with N tiny, so what limits it is not
// FLOPs but how often each phi byte is fetched. A tile kernel that re-reads
// phi (2.75 MB as bf16 hi + lo) for every tile of rows moves more phi through
// L2 than X through HBM (the cluster-tile kernel in sm90_mhc_fused.cu: 7.6x
// the floor). Here phi never moves after the prologue: CTA j of a cluster of
// 16 owns columns [j*S, j*S + S) of every stream (S = C/16, K/16 = 1792 of K)
// and the 172 KB of hi/lo B fragments for them sit in its 8 projection
// warps' registers (168 per thread). Shared memory is left to X: a 3-stage
// ring of 16-token tiles (57 KB each) filled by 3-D TMA boxes (phi's fp32
// slice, exactly the ring's size at n = 4, passes through it once first).
//
// Per tile each projection warp runs 14 k16 steps (one ldmatrix.x4 of X, 6
// mma for hi/lo x 3 coefficient tiles, 2 mma whose diagonals are the sums
// of squares), the 8 warps' partials are summed in smem (fixed order) and
// pushed to the other CTAs' shared memory (st.async), each CTA summing the
// 16 ranks' partials in rank order, so all hold bitwise the same h (no
// atomics). The roles below are decoupled by mbarriers so the cluster
// exchange, the mix and Sinkhorn overlap the tensor-core work of the next
// tile.
//
// Bytes: X once from HBM, F_pre once, phi once per cluster (7 x 2.75 MB of
// L2 reads in all): the floor is (X + F_pre) / copy bandwidth. Reached
// (H200, B = 8192, 2026-11-24): 1.55-1.57x the floor, ~4.9x faster than the
// cluster-tile kernel; the projection warps are bound by the mma.sync pipe,
// the cross-warp sums and pushes and the mix's ALU work (docs/mhc.md has the
// per-phase cycle counts, an ncu breakdown and what was tried).
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes through the runtime (no libcuda link)
#include <cuda_bf16.h>

#include <map>
#include <mutex>

#include "common/launch.cuh"
#include "common/sm90.cuh"
#include "common/tma_host.h"
#include "mhc/mhc_device.cuh"

namespace flashmix::mhc_detail {

namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;
using dev::cluster_arrive;
using dev::cluster_wait;
using dev::ldmatrix_x4;
using dev::mbar_arrive_expect_tx;
using dev::mbar_init;
using dev::mbar_wait;
using dev::smem_u32;

constexpr int kClusterSize = 16;  // non-portable on Hopper; the launcher checks that one fits
constexpr int kProjWarps = 8;    // hold phi; setmaxnreg kProjRegs
constexpr int kFinishWarps = 3;  // cluster sums, H_pre, part of the pre mix
constexpr int kThreads = (kProjWarps + kFinishWarps + 1) * 32;  // + 1 producer/Sinkhorn warp
constexpr int kProjRegs = 224, kFinishRegs = 56;  // 256*224 + 128*56 = 65536 registers
// Tokens of each tile the finish warps mix (the projection warps mix the
// rest). H200, B = 8192, with the box-by-box projection loop: 10 -> 253 us
// (the finish warps were the bottleneck), 8 -> 234, 6 -> 232, 4 -> 232-234,
// 2 -> 241 us. (With the older per-step-address loop: 8 -> 269, 10 -> 267,
// 12 -> 281 us.)
// With the restricted release fence (mbar_arrive_cluster_all) the finish
// warps mix faster and take more: same call, 6 -> 8 tokens, B = 8192
// 217.3-218.0 -> 213.2-213.8 us, decode unchanged (10.65 / 10.61 us; 10
// tokens: 213.3-213.6 / 10.58).
constexpr int kFinishMixRows = 8;
constexpr int kRows = 16;     // tokens per tile: the m16 of the mma
constexpr int kScratchStride = 20;  // floats per coefficient row of the per-warp scratch: fragment stores hit 32 banks
constexpr int kStages = 3;    // X tiles in the ring
constexpr int kMaxChunks = 7; // 64-column TMA boxes per CTA slice (C <= 7168)
constexpr int kMaxSteps = 2 * kMaxChunks; // k16 steps per warp, 2 per box: phi registers = kMaxSteps * k_tiles * 2 (* 2 for hi/lo)
constexpr int kPhiPad = 32;   // bytes after each coefficient's phi runs while phi passes through the ring

// One 64-column TMA box of a ring stage: n streams x kRows tokens x 128 bytes.
template <int kN>
constexpr int box_bytes() { return kN * kRows * 128; }

struct ResidentLayout {
  int slice = 0;        // columns per CTA (C / 16, a multiple of 64)
  int stage_bytes = 0;  // slice / 64 boxes of box_bytes<kN>()
  int off_scratch = 0, off_recv_common = 0, off_recv_full = 0, off_tot = 0, off_hpre = 0, off_hsink = 0,
      total = 0;
};

// Sum in rank order of the kClusterSize float4s at `first`, `first + stride`,
// ... (shared memory of this CTA, where the peers pushed them). All loads are
// issued before the first add.
__device__ __forceinline__ float4 rank_sum4(const float* first, int stride) {
  float4 v[kClusterSize];
#pragma unroll
  for (int rk = 0; rk < kClusterSize; ++rk) v[rk] = *reinterpret_cast<const float4*>(first + rk * stride);
  float4 s = v[0];
#pragma unroll
  for (int rk = 1; rk < kClusterSize; ++rk) {
    s.x += v[rk].x;
    s.y += v[rk].y;
    s.z += v[rk].z;
    s.w += v[rk].w;
  }
  return s;
}

// Stores v into the shared memory of CTA `rank` of the cluster, at the
// address `local` has here, and counts its 16 bytes on that CTA's mbarrier
// at `bar` (its address here): a one-way push, no round trip.
__device__ __forceinline__ void push4(uint32_t local, uint32_t bar, int rank, float4 v) {
  uint32_t remote, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   remote),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
               : "memory");
}

// Named barriers: 0 is __syncthreads.
constexpr int kBarProj = 1;    // the 8 projection warps
constexpr int kBarFinish = 2;  // the 3 finish warps

using dev::mbar_arrive;
using dev::named_bar_sync;

// Arrives on the mbarrier at shared address `bar` in every CTA of the
// cluster, with release semantics at cluster scope. Called by a whole warp:
// lane r arrives in CTA r, so the 16 remote arrivals travel at once (one lane
// issuing them in turn waits out each one's round trip: ~16 x 1 us per
// tile, measured as the dominant cost).
//
// What is released is this CTA's shared memory (the receive buffer, read by
// every finish thread before the named barrier ahead of the call): a release
// fence restricted to shared::cta, then relaxed remote arrivals. An arrive
// with .release.cluster compiles to MEMBAR.ALL.GPU, which waits for every
// earlier memory operation of the warp, its global F_pre stores included:
// ~2 % of the kernel's stall samples, all on this one warp (ncu, H200); with
// the restricted fence the finish warps' mix of 6 tokens went 2,650 -> 1,800
// cycles a tile (profiling build).
__device__ __forceinline__ void mbar_arrive_cluster_all(uint32_t bar, int lane) {
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
  if (lane < kClusterSize) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(lane));
    asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
  }
}

// Waits for a phase completed by release-arrivals from other CTAs. Spinning
// with a cluster-scope acquire invalidates L1 on every poll (CCTL.IVALL: 16%
// of the stall samples, measured); poll at CTA scope, then acquire once.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  mbar_wait(bar, parity);
  // Acquire for shared::cluster accesses only: no L1 invalidation.
  asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;\n" ::: "memory");
}

// FLASHMIX_MHC_PROFILE: a timeline of tile 0 in CTA 0 (globaltimer, ns).
#ifdef FLASHMIX_MHC_PROFILE
__shared__ unsigned long long fm_stamps[24];
__shared__ long long fm_cycles[24];  // clock64 beside each stamp: the SM clock, to tell latency from frequency
#define FM_STAMP(idx, cond)                                              \
  if (cond) {                                                            \
    unsigned long long ns;                                               \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns) :: "memory");   \
    fm_stamps[idx] = ns;                                                 \
    fm_cycles[idx] = clock64();                                          \
  }
#else
#define FM_STAMP(idx, cond)
#endif

// Roles (384 threads, three warpgroups):
//   warps 0-7  projection: phi resident in registers (setmaxnreg 224); per
//              tile: wait for X, mma, partials summed over the 8 warps and
//              pushed (st.async, counted on the receiver's recv_full[tile &
//              1]): the pre coefficients and the sum of squares to every
//              CTA, the others to the tile's owner; then the pre mix of
//              tokens 0-7 of the previous tile. Pushing (one-way) instead of
//              each CTA pulling 16 peers' partials (a DSMEM round trip, ~500
//              cycles, twice per float4 at 56 registers) took 1,200 cycles
//              off a decode tile's chain (H200, measured).
//   warps 8-10 finish (setmaxnreg 56): wait recv_full, sum the 16 ranks'
//              partials (local shared memory, rank order), publish H_pre,
//              release the receive buffer (recv_free in every CTA), mix
//              tokens 8-15 (kFinishMixRows).
//              The tile's owner CTA (tile % 16) also stashes h for warp 11.
//   warp 11    producer and Sinkhorn: lane 0 refills a ring stage once every
//              warp that reads it has arrived on stage_empty; the warp runs
//              the activations + Sinkhorn of the owned tiles' 16 tokens, one
//              per lane, off the critical path.
template <int kN, bool kF32>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_mhc_resident_kernel(ProjectParams p, ResidentLayout L, const __grid_constant__ CUtensorMap x_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kCoef = kN * kN + 2 * kN;
  constexpr int kKt = (kCoef + 7) / 8;  // n8 coefficient tiles
  constexpr int kV = kCoef + 1;         // values per token: N projections + the sum of squares
  constexpr int kCommon = kN + 1;       // pre coefficients + the sum of squares: every CTA needs them
  constexpr int kFull = kCoef - kN;     // post and res coefficients: the tile's owner only
  constexpr int kQ = kRows / 4;         // float4s per value
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kStages][kMaxChunks], stage_empty[kStages], recv_full[2], recv_free[2], hpre_ready[2],
      hpre_free[2], sink_full[2], sink_empty[2], phi_full, phi_free;
  __shared__ float coef_alpha[kCoef], coef_bias[kCoef];  // alpha_of(m) and bias[m], loaded once
  float* scratch = reinterpret_cast<float*>(smem + L.off_scratch);  // [warp][kV][kScratchStride]
  // What the peers push: per tile parity, [rank][kCommon][kRows] (the pre
  // coefficients and the sum of squares, every CTA); [rank][kFull][kRows]
  // (the other coefficients, the tile's owner only; one buffer: a CTA owns
  // every 16th tile, and recv_free orders it like the common part).
  float* recv_common = reinterpret_cast<float*>(smem + L.off_recv_common);
  float* recv_full_buf = reinterpret_cast<float*>(smem + L.off_recv_full);
  float* tot = reinterpret_cast<float*>(smem + L.off_tot);          // [kV][kRows]
  float* hpre = reinterpret_cast<float*>(smem + L.off_hpre);        // [2][kRows][kN]
  float* hsink = reinterpret_cast<float*>(smem + L.off_hsink);      // [2][kRows][kCoef]

  const int rank = int(cg::this_cluster().block_rank());
  const int cluster_id = int(blockIdx.x) / kClusterSize;
  const int num_clusters = int(gridDim.x) / kClusterSize;
  const long long num_tiles = (p.batch + kRows - 1) / kRows;
  const int my_tiles = cluster_id < num_tiles ? int((num_tiles - 1 - cluster_id) / num_clusters + 1) : 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hidden = p.hidden, slice = L.slice;
  const int c0 = rank * slice;
  // The ring is 1024-byte aligned: the 128-byte TMA swizzle repeats every 8 lines.
  const uint32_t ring = (smem_u32(smem) + 1023u) & ~1023u;
  unsigned char* ring_ptr = smem + (ring - smem_u32(smem));

  FM_STAMP(0, tid == 0)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (int ch = 0; ch < kMaxChunks; ++ch) mbar_init(smem_u32(&full[s][ch]), 1);  // the producer's expect_tx
      mbar_init(smem_u32(&stage_empty[s]), kProjWarps + kFinishWarps);  // every warp that reads the stage, done
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(smem_u32(&recv_full[b]), 1);            // the receiver's expect_tx; the bytes come by st.async
      mbar_init(smem_u32(&recv_free[b]), kClusterSize);  // every CTA has summed what it received
      // H_pre and the h stash: every thread that wrote them (and every
      // lane of the Sinkhorn warp that read the stash) arrives itself: a
      // release per accessing thread, which is what racecheck needs to see
      // the ordering. The mix's release of H_pre stays one lane per warp.
      mbar_init(smem_u32(&hpre_ready[b]), kFinishWarps * 32);
      mbar_init(smem_u32(&hpre_free[b]), kProjWarps);
      mbar_init(smem_u32(&sink_full[b]), kFinishWarps * 32);
      mbar_init(smem_u32(&sink_empty[b]), 32);
    }
    mbar_init(smem_u32(&phi_full), 1);            // the producer's expect_tx
    mbar_init(smem_u32(&phi_free), kProjWarps);   // every projection warp has its fragments
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // Every CTA's barriers are initialised before any peer may arrive on them.
  cluster_arrive();
  cluster_wait();

  // With prefetch_weights (the caller's promise that the kernel before this
  // one on the stream does not write phi, alpha or bias), the weights are
  // read before the grid dependency is resolved, overlapping that kernel's
  // tail; every role waits for it before its first touch of X or of an
  // output. Without, everything waits here.
  if (!p.prefetch_weights) dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  FM_STAMP(1, tid == 0)

  // Ring layout (one stage = one tile): S/64 chunks of 64 columns, each
  // [n streams][16 tokens][64 columns] as 128-byte lines with the TMA's
  // 128-byte swizzle (16-byte unit u of line l sits at u ^ (l & 7)); the
  // line of (stream i, token r) is 16i + r, so the 8 tokens an ldmatrix
  // reads hit 8 different bank groups. One TMA box per chunk: 7 copies per
  // tile at C = 7168 (one bulk copy per (token, stream) cost ~140 cycles of
  // issue each, 64 per tile, measured). In a CTA's first kStages tiles
  // each box has its own mbarrier, so the projection starts on the first
  // box while the others are in flight (a decode launch has one tile).
  // Warp w's k16 steps go box by box, 2 per box (a box has n * 4 = 16 steps,
  // 8 warps): step s is box s / 2, stream w / 2, columns
  // 64 (s / 2) + 16 (2 (w % 2) + s % 2) of the slice.
  constexpr int kChunkBytes = box_bytes<kN>();
  auto x_offset = [&](int row, int i, int col) -> uint32_t {  // col: multiple of 8 within the slice
    const int line = i * kRows + row;
    return uint32_t((col >> 6) * kChunkBytes + line * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4));
  };
  // phi's slice goes through the (still empty) ring once, before any X:
  // the run of coefficient m, stream i (slice columns) sits at
  // m * phi_m_bytes + i * slice * esz; the 32 bytes of padding per m put the
  // 8 coefficient rows a fragment load touches in different banks. n = 4
  // fp32: 24 x 4 x slice x 4 bytes = the ring's 3 x 16 x 4 x slice x 2 bytes.
  constexpr int kPhiEsz = kF32 ? 4 : 2;
  const int phi_m_bytes = kN * slice * kPhiEsz + kPhiPad;
  // The 96 bulk copies are spread over the 128 threads of the finish and
  // producer warps, one each: their issue is serial within a warp (~55
  // cycles apiece), and 96 from one warp took 2.7 us of a decode launch
  // (measured). Thread 0 of the 128 (the producer's lane 0) sets the
  // expected bytes; a copy completing before that leaves the phase pending
  // (its arrival is still missing), so the order does not matter.
  auto issue_phi = [&](int t128) {
    const uint32_t bar = smem_u32(&phi_full);
    if (t128 == 0) mbar_arrive_expect_tx(bar, uint32_t(kCoef * kN * slice * kPhiEsz));
    for (int run = t128; run < kCoef * kN; run += (kFinishWarps + 1) * 32) {
      const int m = run / kN, i = run - m * kN;
      const unsigned char* src =
          static_cast<const unsigned char*>(p.phi) + ((long long)m * p.k_len + (long long)i * hidden + c0) * kPhiEsz;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
              ring + m * phi_m_bytes + i * slice * kPhiEsz),
          "l"(src), "r"(slice * kPhiEsz), "r"(bar)
          : "memory");
    }
  };

  // The producer (lane 0 of the Sinkhorn warp) loads tile j into stage j % kStages.
  auto issue_tile = [&](int j) {
    const long long tile = cluster_id + (long long)j * num_clusters;
    const int stage = j % kStages;
    const bool per_box = j < kStages;  // see the projection warps' wait
    if (!per_box) mbar_arrive_expect_tx(smem_u32(&full[stage][0]), uint32_t(L.stage_bytes));
    for (int ch = 0; ch < slice / 64; ++ch) {
      const uint32_t bar = smem_u32(&full[stage][per_box ? ch : 0]);
      if (per_box) mbar_arrive_expect_tx(bar, uint32_t(kChunkBytes));
      dev::tma_load_3d(ring + stage * L.stage_bytes + ch * kChunkBytes, &x_map, bar, c0 + ch * 64, int(tile * kRows),
                       0);
    }
  };

  // F_pre for tokens [row_begin, row_begin + rows) of a tile whose X is in
  // ring stage `xs`, this CTA's columns, H_pre from `hp`; thread t of
  // `threads` takes (token, 8 columns) items t, t + threads, ... (one
  // division per call, not per item; H_pre of a token as one float4).
  auto mix_rows = [&](const unsigned char* xs, const float* hp, long long row0, int row_begin, int rows, int t,
                      int threads) {
    const int groups = slice / 8;
    const int row_step = threads / groups, group_step = threads - row_step * groups;
    int row = row_begin + t / groups, group = t - (t / groups) * groups;
    for (int it = t; it < rows * groups; it += threads) {  // a counted loop: the compiler overlaps items
      const long long b = row0 + row;
      if (b >= p.batch) break;  // rows ascend
      const int col = group * 8;
      const float4 w4 = *reinterpret_cast<const float4*>(hp + row * kN);
      static_assert(kN == 4, "H_pre of a token is one float4");
      const float w[4] = {w4.x, w4.y, w4.z, w4.w};
      float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const uint4 raw = *reinterpret_cast<const uint4*>(xs + x_offset(row, i, col));
        const uint32_t x4[4] = {raw.x, raw.y, raw.z, raw.w};
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
      *reinterpret_cast<uint4*>(p.f_out + b * hidden + c0 + col) = o;
      row += row_step;
      group += group_step;
      if (group >= groups) group -= groups, ++row;
    }
  };

  if (warp < kProjWarps) {
    // ---------------- projection warps ----------------
    dev::setmaxnreg_inc<kProjRegs>();

    // phi -> registers, once: warp w owns its 2 k16 steps of every box
    // (see the ring layout). B fragment of coefficient tile kt: rows (k)
    // 2t, 2t+1 and 2t+8, 2t+9 of column (coefficient) kt*8 + g.
    const int g = lane >> 2, t = lane & 3;
    static_assert(kN * 4 == 2 * kProjWarps, "a box's n * 4 k16 steps, 2 per projection warp");
    const int my_steps = 2 * (slice / 64);  // <= kMaxSteps (launcher)
    const int step_stream = warp >> 1, step_col = 32 * (warp & 1);  // + 64 (s / 2) + 16 (s % 2)
    uint32_t bhi[kMaxSteps][kKt][2];
    uint32_t blo[kF32 ? kMaxSteps : 1][kKt][2];
    mbar_wait(smem_u32(&phi_full), 0u);
#pragma unroll
    for (int s = 0; s < kMaxSteps; ++s) {
      const int i = step_stream;
      const int col = 64 * (s >> 1) + step_col + 16 * (s & 1) + 2 * t;  // within the slice
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const int m = kt * 8 + g;
        const bool ok = s < my_steps && m < kCoef;
        const unsigned char* run = ring_ptr + m * phi_m_bytes + (i * slice + col) * kPhiEsz;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kF32) {
            const float2 v = ok ? *reinterpret_cast<const float2*>(run + 8 * h * kPhiEsz) : make_float2(0.f, 0.f);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
            const float2 hf = __bfloat1622float2(hi);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x - hf.x, v.y - hf.y);
            bhi[s][kt][h] = *reinterpret_cast<const uint32_t*>(&hi);
            blo[s][kt][h] = *reinterpret_cast<const uint32_t*>(&lo);
          } else {
            bhi[s][kt][h] = ok ? *reinterpret_cast<const uint32_t*>(run + 8 * h * kPhiEsz) : 0u;
          }
        }
      }
    }
    // The ring is X's from here on.
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&phi_free));
    dev::grid_dependency_wait();  // before X (prefetch_weights; a no-op otherwise)
    // ldmatrix.x4 lane address: rows (lane & 7) + 8 * ((lane >> 3) & 1), k offset 8 * (lane >> 4).
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_kofs = (lane >> 4) * 8;
    const uint32_t a_off_even = x_offset(a_row, step_stream, step_col + a_kofs);  // box 0, step 0
    const uint32_t a_off_odd = x_offset(a_row, step_stream, step_col + 16 + a_kofs);  // box 0, step 1
    FM_STAMP(2, tid == 0)

    // FLASHMIX_MHC_PROFILE: per-phase cycle counts of warps 0 and 1 of two
    // CTAs, printed at the end (a profiling build, never the shipped one).
#ifdef FLASHMIX_MHC_PROFILE
    long long prof[8] = {};
    long long t0 = clock64();
#define FM_PROF(k) { const long long t1 = clock64(); prof[k] += t1 - t0; t0 = t1; }
#else
#define FM_PROF(k)
#endif
    // F_pre of tile jj for this CTA's columns, out of the ring, once the
    // finish warps have published its H_pre; then the stage and the H_pre
    // buffer are released and the stage refilled with tile jj + kStages.
    auto mix = [&](int jj) {
      mbar_wait(smem_u32(&hpre_ready[jj & 1]), uint32_t(jj >> 1) & 1u);
      FM_PROF(5)
      const long long row0 = (cluster_id + (long long)jj * num_clusters) * kRows;
      const unsigned char* xs = ring_ptr + (jj % kStages) * L.stage_bytes;
      const float* hp = hpre + (jj & 1) * kRows * kN;
      mix_rows(xs, hp, row0, 0, kRows - kFinishMixRows, tid, kProjWarps * 32);
      FM_PROF(6)
      // This warp is done with the stage (its projection reads were behind
      // the tile's block barriers; its mix just now) and with H_pre. One
      // lane releases both: an arrive per lane on hpre_free made ptxas spill
      // at setmaxnreg 224 and cost decode 0.44 us (docs/mhc.md).
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(smem_u32(&hpre_free[jj & 1]));
        mbar_arrive(smem_u32(&stage_empty[jj % kStages]));
      }
      FM_PROF(7)
    };

#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      const int stage = j % kStages;
      const uint32_t full_parity = uint32_t(j / kStages) & 1u;
      // The first kStages tiles (issued at the start, X cold) are waited
      // for box by box; later ones, issued a tile or more ahead, on one
      // barrier (a wait per box cost B = 8192 264 -> 277 us, H200).
      const bool per_box = j < kStages;
      if (!per_box) mbar_wait(smem_u32(&full[stage][0]), full_parity);
      FM_STAMP(3, tid == 0 && j == 0)
      FM_PROF(0)
      // Partial projection of tile j over this warp's k steps; hi and lo
      // into one accumulator (12 registers fewer than two; B = 8192 233.7 ->
      // 229.8 us, H200 same-run A/B).
      float acc[kKt][4];
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[kt][e] = 0.f;
      // Sums of squares on the tensor cores too: X_tile . X_tile^T restricted
      // to 8 tokens per mma; its diagonal is |x_r|^2 (exact bf16 products,
      // fp32 accumulation), 2 mma per step instead of 16 ALU instructions.
      float sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};  // tokens 0-7, 8-15
      const uint32_t a_stage = ring + stage * L.stage_bytes;
      auto step = [&](int s, uint32_t a_addr) {
        uint32_t a[4];
        ldmatrix_x4(a, a_addr);
        dev::mma_bf16_16816(sq_lo, a, a[0], a[2]);  // B = rows 0-7 of A, transposed
        dev::mma_bf16_16816(sq_hi, a, a[1], a[3]);  // B = rows 8-15 of A, transposed
#pragma unroll
        for (int kt = 0; kt < kKt; ++kt) {
          dev::mma_bf16_16816(acc[kt], a, bhi[s][kt][0], bhi[s][kt][1]);
          if constexpr (kF32) dev::mma_bf16_16816(acc[kt], a, blo[s][kt][0], blo[s][kt][1]);
        }
      };
      // Box by box; step s's address is an immediate offset from the lane's
      // even- or odd-step address (computing x_offset per step, ptxas
      // rematerialised it from SR_TID and the constant bank before every
      // ldmatrix at 224 registers: ncu). With this loop the projection
      // warps leave fewer idle issue slots to the finish warps on their
      // sub-partitions, so those mix fewer tokens (kFinishMixRows).
      const uint32_t a_even = a_stage + a_off_even, a_odd = a_stage + a_off_odd;
      const uint32_t full_bar = smem_u32(&full[stage][0]);
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c < my_steps / 2) {
          if (per_box) mbar_wait(full_bar + 8 * c, full_parity);  // box c landed
          step(2 * c, a_even + c * kChunkBytes);
          step(2 * c + 1, a_odd + c * kChunkBytes);
        }
      }
      FM_STAMP(4, tid == 0 && j == 0)
      FM_PROF(1)
      // This CTA's partials of tile j: per warp into scratch (once every
      // warp is done reading the previous tile's), then summed over the
      // warps in a fixed order and pushed once every CTA has released its
      // receive buffer of this parity (tile j - 2).
      named_bar_sync(kBarProj, kProjWarps * 32);
      float* my = scratch + warp * kV * kScratchStride;
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const int m = kt * 8 + 2 * t;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int mm = m + (e & 1), row = g + 8 * (e >> 1);
          if (mm < kCoef) my[mm * kScratchStride + row] = acc[kt][e];
        }
      }
      // Diagonal: token g < 8 is D[g][g] of sq_lo (lane 4g + g/2, element g & 1);
      // token 8 + g is D[8+g][g] of sq_hi (same lane, element 2 + (g & 1)).
      if (t == (g >> 1)) {
        my[kCoef * kScratchStride + g] = (g & 1) ? sq_lo[1] : sq_lo[0];
        my[kCoef * kScratchStride + g + 8] = (g & 1) ? sq_hi[3] : sq_hi[2];
      }
      if (j >= 2) mbar_wait_cluster(smem_u32(&recv_free[j & 1]), uint32_t((j - 2) >> 1) & 1u);
      FM_PROF(2)
      FM_STAMP(17, tid == 0 && j == 0)
      named_bar_sync(kBarProj, kProjWarps * 32);  // scratch written
      FM_STAMP(18, tid == 0 && j == 0)
      FM_PROF(3)
      // Sum over the 8 warps and push, per (value, 4 tokens) float4: the
      // common ones to all 16 CTAs (each of the 16 threads of one float4
      // sums it itself, in the same order, and pushes it to one CTA), the
      // rest to the owner. Position [parity][this rank][value][tokens].
      {
        const int owner_rank = j % kClusterSize;
        const uint32_t bar = smem_u32(&recv_full[j & 1]);
        constexpr int kCommonPushes = kCommon * kQ * kClusterSize;
        auto warp_sum = [&](int m, int r4) {
          float4 v = *reinterpret_cast<const float4*>(scratch + m * kScratchStride + r4 * 4);
#pragma unroll
          for (int w = 1; w < kProjWarps; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(scratch + (w * kV + m) * kScratchStride + r4 * 4);
            v.x += x.x;
            v.y += x.y;
            v.z += x.z;
            v.w += x.w;
          }
          return v;
        };
        // An item's sum and destination; a thread sums both of its items
        // before it pushes either (a remote store holds the warp ~200
        // cycles at issue, measured: back to back they overlap).
        auto item = [&](int it, float4& v, uint32_t& dst, int& dest) {
          if (it < kCommonPushes) {
            dest = it % kClusterSize;
            const int q = it / kClusterSize, cv = q / kQ, r4 = q - cv * kQ;  // q: (common value, 4 tokens)
            v = warp_sum(cv < kN ? cv : kCoef, r4);
            dst = smem_u32(recv_common + (((j & 1) * kClusterSize + rank) * kCommon + cv) * kRows + r4 * 4);
          } else {
            dest = owner_rank;
            const int q = it - kCommonPushes, fv = q / kQ, r4 = q - fv * kQ;
            v = warp_sum(kN + fv, r4);
            dst = smem_u32(recv_full_buf + (rank * kFull + fv) * kRows + r4 * 4);
          }
        };
        constexpr int kItems = kCommonPushes + kFull * kQ;
        static_assert(kItems > kProjWarps * 32 && kItems <= 2 * kProjWarps * 32, "one or two items per thread");
        float4 v0, v1 = make_float4(0.f, 0.f, 0.f, 0.f);
        uint32_t d0 = 0, d1 = 0;
        int r0 = 0, r1 = 0;
        const bool second = tid + kProjWarps * 32 < kItems;
        item(tid, v0, d0, r0);
        if (second) item(tid + kProjWarps * 32, v1, d1, r1);
        push4(d0, bar, r0, v0);
        if (second) push4(d1, bar, r1, v1);
      }
      FM_STAMP(5, tid == 0 && j == 0)
      FM_PROF(4)
      // The pre mix of the previous tile (its H_pre is being made by the
      // finish warps while this tile's projection ran), then its ring stage
      // is refilled. Stage-1 (kProject) has no mix: this tile's stage is free now.
      if (p.mode == ProjectMode::kProject) {
        if (lane == 0) mbar_arrive(smem_u32(&stage_empty[j % kStages]));  // no mix: the stage is free
      } else if (j > 0) {
        mix(j - 1);
      }
    }
    if (p.mode != ProjectMode::kProject && my_tiles > 0) mix(my_tiles - 1);
    FM_STAMP(9, tid == 0)
#ifdef FLASHMIX_MHC_PROFILE
    if (cluster_id == 0 && rank < 2 && tid < 64 && lane == 0 && my_tiles > 0)
      printf("prof rank %d warp %d tiles %d | waitX %lld proj %lld scratch+free %lld reduce %lld arrive %lld | "
             "mix: wait %lld math %lld bar+issue %lld\n",
             rank, warp, my_tiles, prof[0] / my_tiles, prof[1] / my_tiles, prof[2] / my_tiles, prof[3] / my_tiles,
             prof[4] / my_tiles, prof[5] / my_tiles, prof[6] / my_tiles, prof[7] / my_tiles);
#endif
  } else if (warp < kProjWarps + kFinishWarps) {
    // ---------------- finish warps ----------------
    dev::setmaxnreg_dec<kFinishRegs>();
    const int ft = tid - kProjWarps * 32;
    issue_phi(32 + ft);
    // The coefficients' alpha and bias, once (while phi loads), not per tile.
    for (int m = ft; m < kCoef; m += kFinishWarps * 32) {
      coef_alpha[m] = __ldg(p.alpha + alpha_index(m, kN));
      coef_bias[m] = __ldg(p.bias + m);
    }
    dev::grid_dependency_wait();  // before any output (prefetch_weights; a no-op otherwise)
    named_bar_sync(kBarFinish, kFinishWarps * 32);
#ifdef FLASHMIX_MHC_PROFILE
    long long prof[8] = {};
    long long t0 = clock64();
#endif
    int owned = 0;
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      const long long row0 = (cluster_id + (long long)j * num_clusters) * kRows;
      const bool owner = rank == j % kClusterSize;  // H_post/H_res (or h, r) of this tile
      // The bytes this CTA receives for tile j: the common values from
      // every rank, and the rest too when it owns the tile. The peers'
      // pushes may land before this expectation is set (the transaction
      // count goes negative meanwhile); the phase needs both.
      if (ft == 0)
        mbar_arrive_expect_tx(smem_u32(&recv_full[j & 1]),
                              uint32_t(kClusterSize * (kCommon + (owner ? kFull : 0)) * kRows * 4));
      mbar_wait(smem_u32(&recv_full[j & 1]), uint32_t(j >> 1) & 1u);
      FM_PROF(0)
      FM_STAMP(6, ft == 0 && j == 0)
      // The sums over the 16 ranks, 4 tokens per float4, in rank order:
      // the common values (every CTA) and the others (the owner).
      const int nq = (owner ? kV : kCommon) * kQ;
      for (int q = ft; q < nq; q += kFinishWarps * 32) {
        const int i = q / kQ, r4 = q - i * kQ;  // i < kCommon: common value i; else full value i - kCommon
        float4 sum;
        int m;
        if (i < kCommon) {
          m = i < kN ? i : kCoef;
          sum = rank_sum4(recv_common + ((j & 1) * kClusterSize * kCommon + i) * kRows + r4 * 4, kCommon * kRows);
        } else {
          m = kN + (i - kCommon);
          sum = rank_sum4(recv_full_buf + (i - kCommon) * kRows + r4 * 4, kFull * kRows);
        }
        *reinterpret_cast<float4*>(tot + m * kRows + r4 * 4) = sum;
      }
      FM_STAMP(14, ft == 0 && j == 0)
      FM_PROF(1)
      named_bar_sync(kBarFinish, kFinishWarps * 32);  // tot written; every read of recv[j & 1] done
      FM_STAMP(15, ft == 0 && j == 0)
      const int slot = owned & 1;
      if (owner && p.mode == ProjectMode::kPre && owned >= 2)
        mbar_wait(smem_u32(&sink_empty[slot]), uint32_t((owned - 2) >> 1) & 1u);
      if (p.mode == ProjectMode::kPre && j >= 2) mbar_wait(smem_u32(&hpre_free[j & 1]), uint32_t((j - 2) >> 1) & 1u);
      FM_PROF(2)
      float* hp = hpre + (j & 1) * kRows * kN;
      // h, H_pre (and the owner's stash for Sinkhorn): thread (row, g)
      // takes coefficients 4g .. 4g + 3 of one token, one r per thread;
      // a non-owner needs only the pre coefficients (g = 0). One pass.
      const float inv_k = 1.0f / float(p.k_len);
      constexpr int kGroups = kCoef / 4;
      static_assert(kCoef % 4 == 0 && kN == 4 && kRows * kGroups <= kFinishWarps * 32, "one pass of (row, group)");
      const int hrow = ft / kGroups, hg = ft - hrow * kGroups;
      if (hrow < kRows && (owner || hg == 0)) {
        const float r = sqrtf(tot[kCoef * kRows + hrow] * inv_k + p.eps_norm);
        const long long b = row0 + hrow;
        float hv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = hg * 4 + e;
          hv[e] = coef_alpha[m] * __fdividef(tot[m * kRows + hrow], r) + coef_bias[m];
        }
        if (p.mode == ProjectMode::kProject) {
          if (owner && b < p.batch) {
#pragma unroll
            for (int e = 0; e < 4; ++e) p.h[b * kCoef + hg * 4 + e] = hv[e];
            if (hg == 0) p.r[b] = r;
          }
        } else {
          if (hg == 0) {
#pragma unroll
            for (int e = 0; e < 4; ++e) hp[hrow * kN + e] = sigmoid_fast(hv[e]) + p.act.eps_pre;
          }
          if (owner) {
#pragma unroll
            for (int e = 0; e < 4; ++e) hsink[(slot * kRows + hrow) * kCoef + hg * 4 + e] = hv[e];
          }
        }
      }
      FM_STAMP(16, ft == 0 && j == 0)
      FM_PROF(3)
      named_bar_sync(kBarFinish, kFinishWarps * 32);
      if (p.mode == ProjectMode::kPre) {
        mbar_arrive(smem_u32(&hpre_ready[j & 1]));
        if (owner) mbar_arrive(smem_u32(&sink_full[slot]));
      }
      FM_STAMP(7, ft == 0 && j == 0)
      FM_PROF(4)
      // The receive buffer is free again (its reads were before the first
      // barrier above); released after H_pre, which is what the cluster waits for.
      if (ft < 32) mbar_arrive_cluster_all(smem_u32(&recv_free[j & 1]), lane);
      owned += owner;
      // The last kFinishMixRows tokens of the tile are mixed here, at once
      // (the projection warps, one tile behind, take the others): the
      // finish warps are otherwise idle half the time (measured).
      if (p.mode == ProjectMode::kPre) {
        mix_rows(ring_ptr + (j % kStages) * L.stage_bytes, hp, row0, kRows - kFinishMixRows, kFinishMixRows, ft,
                 kFinishWarps * 32);
        __syncwarp();
      }
      FM_STAMP(8, ft == 0 && j == 0)
      FM_PROF(5)
      if (lane == 0) mbar_arrive(smem_u32(&stage_empty[j % kStages]));
    }
#ifdef FLASHMIX_MHC_PROFILE
    if (cluster_id == 0 && rank < 2 && ft == 0 && my_tiles > 0)
      printf("prof-finish rank %d tiles %d | wait-recv %lld sums %lld bar+waits %lld hpre %lld bar+release %lld mix %lld\n",
             rank, my_tiles, prof[0] / my_tiles, prof[1] / my_tiles, prof[2] / my_tiles, prof[3] / my_tiles,
             prof[4] / my_tiles, prof[5] / my_tiles);
#endif
  } else {
    // ---------------- producer + Sinkhorn warp ----------------
    dev::setmaxnreg_dec<kFinishRegs>();
    issue_phi(lane);
    dev::grid_dependency_wait();  // before X and any output (prefetch_weights; a no-op otherwise)
    if (lane == 0) {
      mbar_wait(smem_u32(&phi_free), 0u);
      for (int j = 0; j < min(my_tiles, kStages); ++j) issue_tile(j);
    }
#ifdef FLASHMIX_MHC_PROFILE
    long long prof[8] = {};
    long long t0 = clock64();
#endif
    int owned = 0;
#pragma unroll 1
    for (int t = kStages; t < my_tiles + kStages; ++t) {
      // Refill: tile t goes where tile t - kStages was, once all 8
      // projection warps are done with it.
      if (t < my_tiles && lane == 0) {
        mbar_wait(smem_u32(&stage_empty[(t - kStages) % kStages]), uint32_t((t - kStages) / kStages) & 1u);
        issue_tile(t);
      }
      FM_PROF(0)
      __syncwarp();
      // Sinkhorn of tile o = t - kStages when this CTA owns it: its h was
      // stashed about when the projection warps released its stage.
      const int o = t - kStages;
      if (p.mode != ProjectMode::kPre || o % kClusterSize != rank) continue;
      const int slot = owned & 1;
      mbar_wait(smem_u32(&sink_full[slot]), uint32_t(owned >> 1) & 1u);
      FM_STAMP(12, lane == 0 && o == 0)
      FM_PROF(1)
      const long long b = (cluster_id + (long long)o * num_clusters) * kRows + lane;
      if (lane < kRows && b < p.batch) {
        float h[kCoef], pre[kN], post[kN], res[kN * kN];
#pragma unroll
        for (int m = 0; m < kCoef; ++m) h[m] = hsink[(slot * kRows + lane) * kCoef + m];
        FM_STAMP(13, lane == 0 && o == 0)
        activate_token<kN>(h, p.act, pre, post, res);
        FM_STAMP(19, lane == 0 && o == 0)
        if (((reinterpret_cast<uintptr_t>(p.h_post) | reinterpret_cast<uintptr_t>(p.h_res)) & 15) == 0) {
          *reinterpret_cast<float4*>(p.h_post + b * kN) = make_float4(post[0], post[1], post[2], post[3]);
#pragma unroll
          for (int e = 0; e < kN * kN; e += 4)
            *reinterpret_cast<float4*>(p.h_res + b * kN * kN + e) = make_float4(res[e], res[e + 1], res[e + 2], res[e + 3]);
        } else {
#pragma unroll
          for (int i = 0; i < kN; ++i) p.h_post[b * kN + i] = post[i];
#pragma unroll
          for (int e = 0; e < kN * kN; ++e) p.h_res[b * kN * kN + e] = res[e];
        }
      }
      __syncwarp();
      FM_STAMP(10, lane == 0 && o == 0)
      FM_PROF(2)
      mbar_arrive(smem_u32(&sink_empty[slot]));
      ++owned;
    }
#ifdef FLASHMIX_MHC_PROFILE
    if (cluster_id == 0 && rank < 2 && lane == 0 && my_tiles > 0)
      printf("prof-producer rank %d tiles %d owned %d | wait-empty+issue %lld (per tile) | wait-h %lld sinkhorn %lld (per owned tile)\n",
             rank, my_tiles, owned, prof[0] / my_tiles, owned ? prof[1] / owned : 0, owned ? prof[2] / owned : 0);
#endif
  }
  // No CTA leaves while a peer may still read its partials or arrive on its barriers.
  __syncwarp();
  cluster_arrive();
  cluster_wait();
  FM_STAMP(11, tid == 0)
#ifdef FLASHMIX_MHC_PROFILE
  if (tid == 0 && blockIdx.x == 0)
    printf("timeline ns: phi %llu | X %llu | proj %llu | sent %llu | fin-ready %llu | hpre %llu | finmix %llu | "
           "projmix %llu | sinkhorn %llu..%llu | exit %llu (from cluster wait; entry->wait %llu)\n",
           fm_stamps[2] - fm_stamps[1], fm_stamps[3] - fm_stamps[1], fm_stamps[4] - fm_stamps[1],
           fm_stamps[5] - fm_stamps[1], fm_stamps[6] - fm_stamps[1], fm_stamps[7] - fm_stamps[1],
           fm_stamps[8] - fm_stamps[1], fm_stamps[9] - fm_stamps[1], fm_stamps[12] - fm_stamps[1], fm_stamps[10] - fm_stamps[1],
           fm_stamps[11] - fm_stamps[1], fm_stamps[1] - fm_stamps[0]);
  if (tid == 0 && blockIdx.x == 0) {
    auto c = [&](int i) { return fm_cycles[i] - fm_cycles[1]; };
    printf("cycles: phi %lld | X %lld | proj %lld | scratch %lld | bar1 %lld | sent %lld || fin-ready %lld | sums %lld | "
           "bar+free %lld | hpre-loop %lld | hpre %lld | finmix %lld || sink-wait %lld | h-loaded %lld | act %lld | "
           "stored %lld\n",
           c(2), c(3), c(4), c(17), c(18), c(5), c(6), c(14), c(15), c(16), c(7), c(8), c(12), c(13), c(19), c(10));
  }
#endif
#endif
}

// X as a 3-D tensor (columns, tokens, streams) with boxes of
// 64 columns x 16 tokens x n streams, 128-byte swizzle; tokens past B read
// as zeros. Host-only work (capture-safe), done per launch because X moves.
bool encode_x_map(const ProjectParams& p, int n, CUtensorMap& map) {
  const detail::TensorMapEncodeTiled encode = detail::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(p.hidden), cuuint64_t(p.batch), cuuint64_t(n)};
  const cuuint64_t strides[2] = {cuuint64_t(p.k_len) * 2, cuuint64_t(p.hidden) * 2};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, cuuint32_t(kRows), cuuint32_t(n)};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<__nv_bfloat16*>(p.x), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kN>
ResidentLayout resident_layout(int hidden) {
  constexpr int kV = kN * kN + 2 * kN + 1;
  ResidentLayout L;
  L.slice = hidden / kClusterSize;
  L.stage_bytes = L.slice / 64 * box_bytes<kN>();
  int off = kStages * L.stage_bytes + 1024 + (kV - 1) * kPhiPad;  // + the ring's alignment, + phi's padding
  L.off_scratch = off;
  off += kProjWarps * kV * kScratchStride * 4;
  L.off_recv_common = off;
  off += 2 * kClusterSize * (kN + 1) * kRows * 4;
  L.off_recv_full = off;
  off += kClusterSize * (kV - 1 - kN) * kRows * 4;
  L.off_tot = off;
  off += kV * kRows * 4;
  L.off_hpre = off;
  off += 2 * kRows * kN * 4;
  L.off_hsink = off;
  off += 2 * kRows * (kV - 1) * 4;
  L.total = off;
  return L;
}

template <int kN, bool kF32>
cudaError_t launch_resident(const ProjectParams& p, cudaStream_t stream, bool pdl, bool dry_run,
                            const char** why_not) {
  if (p.hidden % (kClusterSize * 64) != 0)  // whole 64-column TMA boxes per CTA
    return not_supported(why_not, "resident: C must be a multiple of 1024");
  const ResidentLayout L = resident_layout<kN>(p.hidden);
  if (L.slice / 64 > kMaxChunks)  // a barrier per box, 2 k16 steps per warp and box
    return not_supported(why_not, "resident: C above 7168 (phi's slice would not fit in registers)");
  auto kernel = sm90_mhc_resident_kernel<kN, kF32>;
  int clusters = 0;
  if (detail::active_clusters(detail::kernel_key(kernel), kThreads, size_t(L.total), kClusterSize, &clusters) !=
          cudaSuccess ||
      clusters < 1)
    return not_supported(why_not, "resident: a cluster of 16 such CTAs does not fit on this device");
  if (dry_run) return cudaSuccess;
  CUtensorMap x_map;
  if (!encode_x_map(p, kN, x_map)) return not_supported(why_not, "resident: X's TMA descriptor could not be encoded");
  const long long tiles = (p.batch + kRows - 1) / kRows;
  const long long grid_clusters = std::min<long long>(clusters, tiles);
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t config = dev::cluster_launch_config(attr, dim3(unsigned(grid_clusters * kClusterSize)),
                                                         dim3(kThreads), size_t(L.total), stream, kClusterSize, pdl);
  return cudaLaunchKernelEx(&config, kernel, p, L, x_map);
}

}  // namespace

cudaError_t sm90_mhc_project_resident(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                      bool dry_run, const char** why_not) {
  if (n != 4) return not_supported(why_not, "resident: n must be 4");
  if (p.mode == ProjectMode::kHead) return not_supported(why_not, "resident: not for mhc_head");
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return not_supported(why_not, "no usable CUDA device");
  if (dev.cc_major != 9 || dev.cc_minor != 0)  // built for sm_90a only
    return not_supported(why_not, "resident: needs an sm_90 GPU");
  return phi_is_f32 ? launch_resident<4, true>(p, stream, pdl, dry_run, why_not)
                    : launch_resident<4, false>(p, stream, pdl, dry_run, why_not);
}

}  // namespace flashmix::mhc_detail
