// mhc_pre (and mhc_project, and mhc_head: phi's n pre rows only, the other
// coefficients zero and no Sinkhorn) on Hopper for n = 4, with phi resident
// in registers:
//
//   h[b,m] = alpha_of(m) * (X[b] . phi[m]) / r[b] + bias[m],  r[b] = sqrt(|X[b]|^2 / K + eps)
//   F_pre[b,c] = sum_i H_pre[b,i] X[b,i,c]     (H_pre from h; Sinkhorn for H_res)
//
// Design: the projection is [B x K] . [K x N] with N = 24 tiny, so what
// limits it is how often phi is fetched, not FLOPs. A persistent cluster of
// 16 CTAs splits K: CTA j owns columns [j*S, j*S + S) of every stream
// (S = C/16) and keeps the bf16 hi/lo tensor-core B fragments of its phi
// slice in the registers of its 8 projection warps, loaded once per launch.
// X streams through a 3-stage shared-memory ring of 16-token tiles (TMA);
// per tile each CTA's partial projection is pushed into the other CTAs'
// shared memory (st.async) and every CTA sums the 16 ranks' partials in rank
// order, so all hold bitwise the same h (no atomics). The exchange, the pre
// mix and Sinkhorn overlap the next tile's mma.sync work: the roles below are
// decoupled by mbarriers.
//
// Roofline: X once from HBM, F_pre once, phi once per cluster (from L2): the
// floor is (X + F_pre) / copy bandwidth. mhc_pre B = 8192, n = 4, C = 7168:
// ~214 us on an H200, 1.55x the floor; the projection warps are bound by the
// mma.sync pipe and their share of the exchange and the mix. docs/mhc.md has
// the per-role cycle counts, the measurements behind the choices here and
// what was tried.
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes through the runtime (no libcuda link)
#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "common/launch.cuh"
#include "common/sm90.cuh"
#include "common/tma_host.h"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_fp8x_device.cuh"

namespace flashmix::mhc_detail {

namespace {

namespace cg = cooperative_groups;
using dev::named_bar_sync;
using dev::smem_u32;

constexpr int kClusterSize = 16;  // non-portable on Hopper; the launcher checks that one fits

// A zero run of phi (a CTA's slice of one coefficient and stream, at most
// 7168 / 16 fp32 columns): the source of mhc_head's coefficients past its n.
__device__ __align__(16) unsigned char kZeroPhiRun[7168 / kClusterSize * 4];
constexpr int kProjWarps = 8;    // hold phi; setmaxnreg kProjRegs
constexpr int kFinishWarps = 3;  // cluster sums, H_pre, part of the pre mix
constexpr int kThreads = (kProjWarps + kFinishWarps + 1) * 32;  // + 1 producer/Sinkhorn warp
constexpr int kProjRegs = 224, kFinishRegs = 56;  // 256*224 + 128*56 = 65536 registers
// Tokens of each tile the finish warps mix (the projection warps mix the
// others, a tile later): they share sub-partitions with the projection warps
// and mix in the issue slots the projection loop leaves idle, so the best
// split was found by a sweep (docs/mhc.md).
constexpr int kFinishMixRows = 8;
constexpr int kRows = 16;     // tokens per tile: the m16 of the mma
constexpr int kScratchStride = 20;  // floats per coefficient row of the per-warp scratch: fragment stores hit 32 banks
constexpr int kStages = 3;    // X tiles in the ring
constexpr int kMaxChunks = 7; // 64-column TMA boxes per CTA slice (C <= 7168)
constexpr int kMaxSteps = 2 * kMaxChunks; // k16 steps per warp, 2 per box: phi registers = kMaxSteps * k_tiles * 2 (* 2 for hi/lo)
constexpr int kPhiPad = 32;   // bytes after each coefficient's phi runs while phi passes through the ring

// Named barriers: 0 is __syncthreads.
constexpr int kBarProj = 1;    // the 8 projection warps
constexpr int kBarFinish = 2;  // the 3 finish warps

// One 64-column TMA box of a ring stage: n streams x kRows tokens x 128
// bytes (bf16), or x 64 bytes (the FP8 stream's e4m3 codes).
template <int kN, bool kFp8 = false>
constexpr int box_bytes() { return kN * kRows * (kFp8 ? 64 : 128); }

struct ResidentLayout {
  int slice = 0;        // columns per CTA (C / 16, a multiple of 64)
  int stage_bytes = 0;  // slice / 64 boxes of box_bytes<kN, kFp8>()
  int off_scratch = 0, off_recv_common = 0, off_recv_full = 0, off_tot = 0, off_hpre = 0, off_hsink = 0,
      off_post_coef = 0, total = 0;
  int off_scales = 0;  // the FP8 stream: [kStages][n][slice / 64][kRows] scales of each stage's boxes
};

// Sizes that follow from n.
template <int kN>
struct Dims {
  static constexpr int kCoef = kN * kN + 2 * kN;  // N coefficients: pre, post, res
  static constexpr int kKt = (kCoef + 7) / 8;     // n8 coefficient tiles
  static constexpr int kV = kCoef + 1;            // values per token: N projections + the sum of squares
  static constexpr int kCommon = kN + 1;          // pre coefficients + the sum of squares: every CTA needs them
  static constexpr int kFull = kCoef - kN;        // post and res coefficients: the tile's owner only
  static constexpr int kQ = kRows / 4;            // float4s per value
  static constexpr int kPostCoef = kN * kN + kN;  // mhc_post_pre: R (row i = output stream i) and H_post of a token
};

// ---------------------------------------------------------------------------
// Barriers

// Where use i of a ring of kDepth slots stands: its slot, and the parity of
// the phase that this use completes on the slot's barriers (each completes
// one phase per use of its slot, so the parity flips on every pass over the
// ring). A consumer waits for `phase` on the slot's 'full' barrier; a
// producer, before use i >= kDepth, waits for prev_phase() on the barrier
// that hands the slot back (the release of use i - kDepth).
template <int kDepth>
struct PipeState {
  static_assert(kDepth == 2 || kDepth == 3, "the rings here");
  int index;
  uint32_t phase;

  __device__ __forceinline__ static PipeState at(int i) {
    if constexpr (kDepth == 2) {
      return {i & 1, uint32_t(i >> 1) & 1u};
    } else {
      return {i % kDepth, uint32_t(i / kDepth) & 1u};
    }
  }
  __device__ __forceinline__ uint32_t prev_phase() const { return phase ^ 1u; }
};

// An mbarrier of this CTA's shared memory.
struct Mbar {
  uint32_t addr;  // shared address

  __device__ __forceinline__ explicit Mbar(uint64_t& bar) : addr(smem_u32(&bar)) {}
  __device__ __forceinline__ explicit Mbar(uint32_t a) : addr(a) {}
  // The k-th mbarrier after this one in an array.
  __device__ __forceinline__ Mbar operator+(int k) const { return Mbar(addr + 8u * uint32_t(k)); }
  __device__ __forceinline__ void init(int count) const { dev::mbar_init(addr, count); }
  // Spins until the phase of parity `phase` has completed (acquire, CTA scope).
  __device__ __forceinline__ void wait(uint32_t phase) const { dev::mbar_wait(addr, phase); }
  __device__ __forceinline__ void arrive() const { dev::mbar_arrive(addr); }
  // Arrives and raises the bytes the phase expects from asynchronous copies.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) const { dev::mbar_arrive_expect_tx(addr, bytes); }

  // Waits for a phase completed by release-arrivals from other CTAs.
  // Spinning with a cluster-scope acquire invalidates L1 on every poll
  // (CCTL.IVALL, measured as a large share of the stalls): poll at CTA
  // scope, then acquire once, for shared::cluster accesses only (no L1
  // invalidation).
  __device__ __forceinline__ void wait_cluster(uint32_t phase) const {
    dev::mbar_wait(addr, phase);
    asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;\n" ::: "memory");
  }

  // Arrives on this mbarrier in every CTA of the cluster (the same address
  // there), with release semantics at cluster scope. Called by a whole warp:
  // lane r arrives in CTA r, so the 16 remote arrivals travel at once (one
  // lane issuing them in turn waits out each one's round trip).
  //
  // What is released is this CTA's shared memory (the receive buffer, read
  // by every finish thread before the named barrier ahead of the call): a
  // release fence restricted to shared::cta, then relaxed remote arrivals.
  // An arrive with .release.cluster compiles to MEMBAR.ALL.GPU, which waits
  // for every earlier memory operation of the warp, its global F_pre stores
  // included.
  __device__ __forceinline__ void arrive_cluster_all(int lane) const {
    asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
    if (lane < kClusterSize) {
      uint32_t remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(lane));
      asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
    }
  }
};

// Every mbarrier of the kernel (static shared memory): what completes a
// phase, who waits for it.
struct Barriers {
  // X of ring stage s landed (the producer's expect_tx + the TMA bytes).
  // In a CTA's first kStages tiles each 64-column box has its own, so the
  // projection starts on the first box while the others are in flight;
  // later tiles use [s][0] for the whole stage.
  uint64_t full[kStages][kMaxChunks];
  uint64_t stage_empty[kStages];  // every warp that reads the stage is done: the producer may refill it
  // Per tile parity (the exchange and H_pre are double-buffered):
  uint64_t recv_full[2];   // the 16 ranks' pushes to this CTA landed (its expect_tx + the st.async bytes)
  uint64_t recv_free[2];   // every CTA has summed what it received: the projection warps may push again
  uint64_t hpre_ready[2];  // H_pre published
  uint64_t hpre_free[2];   // every projection warp is done mixing with it
  // Per parity of the count of owned tiles: the owner's h stash for the Sinkhorn warp.
  uint64_t sink_full[2], sink_empty[2];
  uint64_t phi_full;  // phi's slice landed in the (still empty) ring
  uint64_t phi_free;  // every projection warp has its fragments: the ring is X's
  // mhc_post_pre only: per ring stage, the tile's post coefficients are in
  // shared memory (every producer lane arrives), and the stage holds X_next
  // (every finish thread arrives after its part of the post). On the FP8
  // stream (no fused post here) coef_full says the stage's scales are in.
  uint64_t coef_full[kStages];
  uint64_t xform_full[kStages];

  // By one thread, before the cluster barrier that publishes them.
  __device__ __forceinline__ void init() {
    for (int s = 0; s < kStages; ++s) {
      for (int ch = 0; ch < kMaxChunks; ++ch) Mbar(full[s][ch]).init(1);  // the producer's expect_tx
      Mbar(stage_empty[s]).init(kProjWarps + kFinishWarps);  // every warp that reads the stage, done
    }
    for (int b = 0; b < 2; ++b) {
      Mbar(recv_full[b]).init(1);             // the receiver's expect_tx; the bytes come by st.async
      Mbar(recv_free[b]).init(kClusterSize);  // every CTA has summed what it received
      // H_pre and the h stash: every thread that wrote them (and every
      // lane of the Sinkhorn warp that read the stash) arrives itself: a
      // release per accessing thread, which is what racecheck needs to see
      // the ordering. The mix's release of H_pre stays one lane per warp.
      Mbar(hpre_ready[b]).init(kFinishWarps * 32);
      Mbar(hpre_free[b]).init(kProjWarps);
      Mbar(sink_full[b]).init(kFinishWarps * 32);
      Mbar(sink_empty[b]).init(32);
    }
    for (int s = 0; s < kStages; ++s) {
      Mbar(coef_full[s]).init(32);  // every producer lane's cp.async.mbarrier.arrive.noinc
      Mbar(xform_full[s]).init(kFinishWarps * 32);
    }
    Mbar(phi_full).init(1);           // the producer's expect_tx
    Mbar(phi_free).init(kProjWarps);  // every projection warp has its fragments
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;\n" ::: "memory");
  }
};

// ---------------------------------------------------------------------------
// Data movement

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

// A bulk copy of `bytes` from global memory to shared address `dst`,
// completing them on the mbarrier `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, int bytes, const Mbar& bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar.addr)
               : "memory");
}

// ---------------------------------------------------------------------------
// Profiling hooks (FLASHMIX_MHC_PROFILE; nothing in the shipped build): a
// timeline of tile 0 in CTA 0 (globaltimer ns, and clock64 beside each stamp
// to tell latency from frequency) and per-phase cycle counts of a few warps.
// The hooks' bodies exist in the device pass of a profiling build only.
#if defined(FLASHMIX_MHC_PROFILE) && defined(__CUDA_ARCH__)
#define FM_PROFILE_DEVICE 1
__shared__ unsigned long long fm_stamps[24];
__shared__ long long fm_cycles[24];
#endif

__device__ __forceinline__ void stamp(int idx, bool cond) {
#ifdef FM_PROFILE_DEVICE
  if (cond) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns)::"memory");
    fm_stamps[idx] = ns;
    fm_cycles[idx] = clock64();
  }
#endif
}

// Cycles spent in each phase of a role's loop: mark(k) adds the time since
// the previous mark to phase k.
struct PhaseClock {
#ifdef FM_PROFILE_DEVICE
  long long sum[8];
  long long t0;
  __device__ __forceinline__ PhaseClock() : sum{}, t0(clock64()) {}
  __device__ __forceinline__ void mark(int k) {
    const long long t1 = clock64();
    sum[k] += t1 - t0;
    t0 = t1;
  }
  __device__ __forceinline__ long long per(int k, int n) const { return n ? sum[k] / n : 0; }
#else
  __device__ __forceinline__ void mark(int) {}
#endif
};

__device__ __forceinline__ void report_projection(const PhaseClock& c, bool cond, int rank, int warp, int tiles) {
#ifdef FM_PROFILE_DEVICE
  if (cond)
    printf("prof rank %d warp %d tiles %d | waitX %lld proj %lld scratch+free %lld reduce %lld arrive %lld | "
           "mix: wait %lld math %lld bar+issue %lld\n",
           rank, warp, tiles, c.per(0, tiles), c.per(1, tiles), c.per(2, tiles), c.per(3, tiles), c.per(4, tiles),
           c.per(5, tiles), c.per(6, tiles), c.per(7, tiles));
#endif
}

__device__ __forceinline__ void report_finish(const PhaseClock& c, bool cond, int rank, int tiles) {
#ifdef FM_PROFILE_DEVICE
  if (cond)
    printf("prof-finish rank %d tiles %d | wait-recv %lld sums %lld bar+waits %lld hpre %lld bar+release %lld mix %lld\n",
           rank, tiles, c.per(0, tiles), c.per(1, tiles), c.per(2, tiles), c.per(3, tiles), c.per(4, tiles),
           c.per(5, tiles));
#endif
}

__device__ __forceinline__ void report_producer(const PhaseClock& c, bool cond, int rank, int tiles, int owned) {
#ifdef FM_PROFILE_DEVICE
  if (cond)
    printf("prof-producer rank %d tiles %d owned %d | wait-empty+issue %lld (per tile) | wait-h %lld sinkhorn %lld (per "
           "owned tile)\n",
           rank, tiles, owned, c.per(0, tiles), c.per(1, owned), c.per(2, owned));
#endif
}

__device__ __forceinline__ void report_timeline(bool cond) {
#ifdef FM_PROFILE_DEVICE
  if (!cond) return;
  printf("timeline ns: phi %llu | X %llu | proj %llu | sent %llu | fin-ready %llu | hpre %llu | finmix %llu | "
         "projmix %llu | sinkhorn %llu..%llu | exit %llu (from cluster wait; entry->wait %llu)\n",
         fm_stamps[2] - fm_stamps[1], fm_stamps[3] - fm_stamps[1], fm_stamps[4] - fm_stamps[1],
         fm_stamps[5] - fm_stamps[1], fm_stamps[6] - fm_stamps[1], fm_stamps[7] - fm_stamps[1],
         fm_stamps[8] - fm_stamps[1], fm_stamps[9] - fm_stamps[1], fm_stamps[12] - fm_stamps[1],
         fm_stamps[10] - fm_stamps[1], fm_stamps[11] - fm_stamps[1], fm_stamps[1] - fm_stamps[0]);
  auto c = [&](int i) { return fm_cycles[i] - fm_cycles[1]; };
  printf("cycles: phi %lld | X %lld | proj %lld | scratch %lld | bar1 %lld | sent %lld || fin-ready %lld | sums %lld | "
         "bar+free %lld | hpre-loop %lld | hpre %lld | finmix %lld || sink-wait %lld | h-loaded %lld | act %lld | "
         "stored %lld\n",
         c(2), c(3), c(4), c(17), c(18), c(5), c(6), c(14), c(15), c(16), c(7), c(8), c(12), c(13), c(19), c(10));
#endif
}

// ---------------------------------------------------------------------------
// Shared memory as typed pointers: the dynamic part carved up by
// ResidentLayout (offsets from the host, resident_layout() below), the ring
// first, 1024-byte aligned (the 128-byte TMA swizzle repeats every 8 lines);
// alpha and bias in static shared memory.
template <int kN>
struct ResidentSmem {
  static constexpr int kCoef = Dims<kN>::kCoef;
  uint32_t ring;            // the X ring, [kStages][slice / 64 boxes] (phi's slice passes through it once first)
  unsigned char* ring_ptr;  // the same, generic
  float* scratch;           // [kProjWarps][kV][kScratchStride]: each projection warp's partials of a tile
  // What the peers push: per tile parity, [rank][kCommon][kRows] (the pre
  // coefficients and the sum of squares, every CTA); [rank][kFull][kRows]
  // (the other coefficients, the tile's owner only; one buffer: a CTA owns
  // every 16th tile, and recv_free orders it like the common part).
  float* recv_common;
  float* recv_owner;
  float* tot;         // [kV][kRows]: the tile's sums over the cluster
  float* hpre;        // [2][kRows][kN]: H_pre, per tile parity
  float* hsink;       // [2][kRows][kCoef]: h of the owned tiles, for the Sinkhorn warp
  float* post_coef;   // mhc_post_pre: [kStages][kRows][kPostCoef], per ring stage
  uint32_t* scales;   // the FP8 stream: [kStages][n][slice / 64][kRows], each box's block scale word (load_scales)
  float* coef_alpha;  // [kCoef]: alpha_of(m), loaded once
  float* coef_bias;   // [kCoef]: bias[m]

  __device__ __forceinline__ ResidentSmem(unsigned char* smem, const ResidentLayout& L, float* coef)
      : ring((smem_u32(smem) + 1023u) & ~1023u),
        ring_ptr(smem + (ring - smem_u32(smem))),
        scratch(reinterpret_cast<float*>(smem + L.off_scratch)),
        recv_common(reinterpret_cast<float*>(smem + L.off_recv_common)),
        recv_owner(reinterpret_cast<float*>(smem + L.off_recv_full)),
        tot(reinterpret_cast<float*>(smem + L.off_tot)),
        hpre(reinterpret_cast<float*>(smem + L.off_hpre)),
        hsink(reinterpret_cast<float*>(smem + L.off_hsink)),
        post_coef(reinterpret_cast<float*>(smem + L.off_post_coef)),
        scales(reinterpret_cast<uint32_t*>(smem + L.off_scales)),
        coef_alpha(coef),
        coef_bias(coef + kCoef) {}
};

// ---------------------------------------------------------------------------
// The kernel's roles (384 threads, three warpgroups):
//   warps 0-7  projection (setmaxnreg 224): phi resident in registers; per
//              tile: wait for X, mma, partials summed over the 8 warps and
//              pushed (st.async, counted on the receiver's recv_full): the
//              pre coefficients and the sum of squares to every CTA, the
//              others to the tile's owner; then the pre mix of tokens 0-7 of
//              the previous tile. Pushed (one-way) rather than pulled by
//              each CTA: a DSMEM load is a round trip.
//   warps 8-10 finish (setmaxnreg 56): wait recv_full, sum the 16 ranks'
//              partials (local shared memory, rank order), publish H_pre,
//              release the receive buffer (recv_free in every CTA), mix
//              tokens 8-15 (kFinishMixRows). The tile's owner CTA
//              (tile % 16) also stashes h for warp 11.
//   warp 11    producer and Sinkhorn (setmaxnreg 56): lane 0 refills a ring
//              stage once every warp that reads it has arrived on
//              stage_empty; the warp runs the activations + Sinkhorn of the
//              owned tiles' 16 tokens, one per lane, off the critical path.
// Each role is called only from its branch of the kernel, after that
// branch's setmaxnreg: ptxas ignores a setmaxnreg.inc when code that needs
// more registers is reachable after a dec.
//
// kPost (mhc_post_pre): the ring is filled with X_L (the same TMA boxes);
// the producer also brings the tile's post coefficients into shared memory
// (post_coef, coef_full) and prefetches its F_out rows into L2; the finish
// warps turn the stage into X_next in place, one tile ahead (post_tile:
// mhc_post's arithmetic, each word stored once to x_next) and release it on
// xform_full, which the projection warps wait for instead of the TMA. The
// rest of the kernel is unchanged, so the projection, the exchange, Sinkhorn
// and the mix see bitwise the values mhc_pre would read from X_next.
//
// kFp8 (the FP8 residual stream, spec §4.9; mhc_pre only, no fused post):
// the ring holds e4m3 codes, boxes of 64 columns as 64-byte lines (64-byte
// swizzle), and beside each stage the tile's block scales (the producer
// warp, on coef_full). A projection warp's two k16 steps of a box are its
// 32 columns in a permuted k order, the same in phi's registers (see
// phi_to_registers), so a thread reads 8 consecutive codes of a token in
// one shared load; the codes are exact in bf16, and each box's partial sums
// (a box lies in one 128-column block) are scaled by the token's block
// scale into the accumulators. The sums of squares come from the codes too
// (s^2 * sum code^2). The mix reads each element as fp32(code * scale).
template <int kN, bool kF32, bool kPost, bool kFp8, bool kUe8m0>
struct ResidentCta {
  static constexpr int kCoef = Dims<kN>::kCoef, kKt = Dims<kN>::kKt, kV = Dims<kN>::kV,
                       kCommon = Dims<kN>::kCommon, kFull = Dims<kN>::kFull, kQ = Dims<kN>::kQ,
                       kChunkBytes = box_bytes<kN, kFp8>();
  static_assert(!(kFp8 && kPost), "the FP8 stream's boundary runs on the cluster tiles");
  static constexpr int kPhiEsz = kF32 ? 4 : 2;

  const ProjectParams& p;
  const ResidentLayout& L;
  const CUtensorMap* x_map;
  Barriers& bar;

  const ResidentSmem<kN> sm;

  // This CTA's tiles (tile j of the cluster: rows row0(j) .. + 16) and
  // columns [c0, c0 + slice) of every stream.
  int rank, cluster_id, num_clusters, my_tiles;
  int hidden, slice, c0;
  int tid, lane, warp;
  int phi_m_bytes;  // phi's run of one coefficient in the ring, with its padding

  __device__ __forceinline__ ResidentCta(const ProjectParams& p_, const ResidentLayout& L_, const CUtensorMap* x_map_,
                                         unsigned char* smem, Barriers& bar_, float* coef)
      : p(p_), L(L_), x_map(x_map_), bar(bar_), sm(smem, L_, coef) {
    rank = int(cg::this_cluster().block_rank());
    cluster_id = int(blockIdx.x) / kClusterSize;
    num_clusters = int(gridDim.x) / kClusterSize;
    const long long num_tiles = (p.batch + kRows - 1) / kRows;
    my_tiles = cluster_id < num_tiles ? int((num_tiles - 1 - cluster_id) / num_clusters + 1) : 0;
    hidden = p.hidden;
    slice = L.slice;
    c0 = rank * slice;
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    phi_m_bytes = kN * slice * kPhiEsz + kPhiPad;
  }

  __device__ __forceinline__ long long row0(int j) const { return (cluster_id + (long long)j * num_clusters) * kRows; }

  // ---- The ring ----
  // One stage = one tile: slice/64 chunks of 64 columns, each [n streams]
  // [16 tokens][64 columns] as 128-byte lines with the TMA's 128-byte
  // swizzle (16-byte unit u of line l sits at u ^ (l & 7)); the line of
  // (stream i, token r) is 16i + r, so the 8 tokens an ldmatrix reads hit 8
  // different bank groups. One TMA box per chunk (a bulk copy per (token,
  // stream) costs more issue than the box). Warp w's k16 steps go box by box,
  // 2 per box (a box has n * 4 = 16 steps, 8 warps): step s is box s / 2,
  // stream w / 2, columns 64 (s / 2) + 16 (2 (w % 2) + s % 2) of the slice.
  // Byte offset of (token row, stream i, col: a multiple of 8 in the slice).
  __device__ __forceinline__ static uint32_t x_offset(int row, int i, int col) {
    const int line = i * kRows + row;
    return uint32_t((col >> 6) * kChunkBytes + line * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4));
  }
  // kFp8: the same for a code (col any column of the slice): 64-byte lines,
  // the TMA's 64-byte swizzle (16-byte unit u of line l at u ^ ((l >> 1) & 3)).
  __device__ __forceinline__ static uint32_t q_offset(int row, int i, int col) {
    const int line = i * kRows + row;
    return uint32_t((col >> 6) * kChunkBytes + line * 64 + ((((col & 63) >> 4) ^ ((line >> 1) & 3)) << 4) +
                    (col & 15));
  }
  // kFp8: the scale of (token row, stream i, box c) in stage `stage`'s table.
  __device__ __forceinline__ const uint32_t* scale_table(int stage) const {
    return sm.scales + stage * kN * (slice / 64) * kRows;
  }

  // phi's slice goes through the (still empty) ring once, before any X: the
  // run of coefficient m, stream i (slice columns) sits at m * phi_m_bytes +
  // i * slice * esz; the 32 bytes of padding per m put the 8 coefficient
  // rows a fragment load touches in different banks. n = 4 fp32:
  // 24 x 4 x slice x 4 bytes = the ring's 3 x 16 x 4 x slice x 2 bytes.
  // The 96 bulk copies are spread over the 128 threads of the finish and
  // producer warps, one each (their issue is serial within a warp). Thread 0
  // of the 128 (the producer's lane 0) sets the expected bytes; a copy
  // completing before that leaves the phase pending (its arrival is still
  // missing), so the order does not matter.
  __device__ __forceinline__ void load_phi(int t128) {
    const Mbar full(bar.phi_full);
    if (t128 == 0) full.arrive_expect_tx(uint32_t(kCoef * kN * slice * kPhiEsz));
    for (int run = t128; run < kCoef * kN; run += (kFinishWarps + 1) * 32) {
      const int m = run / kN, i = run - m * kN;
      // (mhc_head: phi has the n pre rows only; the others come from zeros.)
      const unsigned char* src =
          m < p.num_coef
              ? static_cast<const unsigned char*>(p.phi) + ((long long)m * p.k_len + (long long)i * hidden + c0) * kPhiEsz
              : kZeroPhiRun;
      bulk_load(sm.ring + m * phi_m_bytes + i * slice * kPhiEsz, src, slice * kPhiEsz, full);
    }
  }

  // Tile j into ring stage j % kStages (the producer's lane 0). Per-box
  // barriers in the CTA's first kStages tiles (see Barriers::full).
  __device__ __forceinline__ void load_tile(int j) {
    const long long tile = cluster_id + (long long)j * num_clusters;
    const int stage = PipeState<kStages>::at(j).index;
    const bool per_box = j < kStages;
    if (!per_box) Mbar(bar.full[stage][0]).arrive_expect_tx(uint32_t(L.stage_bytes));
    for (int ch = 0; ch < slice / 64; ++ch) {
      const Mbar box(bar.full[stage][per_box ? ch : 0]);
      if (per_box) box.arrive_expect_tx(uint32_t(kChunkBytes));
      dev::tma_load_3d(sm.ring + stage * L.stage_bytes + ch * kChunkBytes, x_map, box.addr, c0 + ch * 64,
                       int(tile * kRows), 0);
    }
  }

  // kFp8: tile t's block scales into its stage's table (the producer warp,
  // every lane, after lane 0's wait for the stage), one 32-bit word per
  // (stream, box, token), by 4-byte cp.async that holds no registers (a
  // load-then-store version at setmaxnreg 56 serialised the loads: ~1.5 us
  // a tile): a float scale as it is, or for ue8m0 the aligned word holding
  // the scale's byte (C % 1024 == 0 makes a (token, stream)'s C/128 bytes a
  // multiple of 8, so that word is in the same row; scale_value picks the
  // byte). Rows past B get zeros (cp.async with no source bytes). A ue8m0
  // array that is not 4-byte aligned takes loads and stores instead, the
  // byte put where scale_value reads it. Completes on coef_full.
  __device__ __forceinline__ void load_scales(int t) {
    const PipeState<kStages> x = PipeState<kStages>::at(t);
    const long long r0 = row0(t);
    const int boxes = slice / 64, blocks = hidden / 128, n_vals = kN * boxes * kRows;
    uint32_t* dst = sm.scales + x.index * n_vals;
    const unsigned char* base = static_cast<const unsigned char*>(p.x_scales);
    const Mbar full(bar.coef_full[x.index]);
    if (!p.x_ue8m0 || (reinterpret_cast<uintptr_t>(base) & 3) == 0) {
#pragma unroll 1
      for (int e = lane; e < n_vals; e += 32) {
        const int ib = e / kRows, row = e - ib * kRows, i = ib / boxes, c = ib - i * boxes;
        const long long b = r0 + row;
        const long long idx = (b * kN + i) * blocks + (c0 + 64 * c) / 128;
        const bool live = b < p.batch;
        const unsigned char* src = !live ? base : p.x_ue8m0 ? base + (idx & ~3LL) : base + idx * 4;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst + e)), "l"(src),
                     "r"(live ? 4 : 0)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full.addr) : "memory");
    } else {
#pragma unroll 1
      for (int e = lane; e < n_vals; e += 32) {
        const int ib = e / kRows, row = e - ib * kRows, i = ib / boxes, c = ib - i * boxes;
        const long long b = r0 + row;
        const int blk = (c0 + 64 * c) / 128;
        dst[e] = b < p.batch ? uint32_t(__ldg(base + (b * kN + i) * blocks + blk)) << (8 * (blk & 3)) : 0u;
      }
      full.arrive();
    }
  }

  // kFp8: the value of a scale-table word of box c (load_scales).
  __device__ __forceinline__ float scale_value(uint32_t w, int c) const {
    if constexpr (!kUe8m0) return __uint_as_float(w);
    else return ue8m0_value((w >> (8 * (((c0 + 64 * c) >> 7) & 3))) & 0xffu);
  }

  // ---- The pre mix ----
  // F_pre for tokens [row_begin, row_begin + rows) of a tile whose X is in
  // ring stage `xs`, this CTA's columns, H_pre from `hp`; thread t of
  // `threads` takes (token, 8 columns) items t, t + threads, ... (one
  // division per call, not per item; H_pre of a token as one float4).
  // kFp8: `sc` is the stage's scale table.
  __device__ __forceinline__ void mix_rows(const unsigned char* xs, const uint32_t* sc, const float* hp, long long row0,
                                           int row_begin, int rows, int t, int threads) {
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
        if constexpr (kFp8) {
          float f[8];
          dequant8(*reinterpret_cast<const uint2*>(xs + q_offset(row, i, col)),
                   scale_value(sc[(i * (slice / 64) + (col >> 6)) * kRows + row], col >> 6), f);
#pragma unroll
          for (int e = 0; e < 8; ++e) out[e] = fmaf(w[i], f[e], out[e]);
        } else {
          const uint4 raw = *reinterpret_cast<const uint4*>(xs + x_offset(row, i, col));
          const uint32_t x4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            out[2 * e] = fmaf(w[i], __uint_as_float(x4[e] << 16), out[2 * e]);
            out[2 * e + 1] = fmaf(w[i], __uint_as_float(x4[e] & 0xffff0000u), out[2 * e + 1]);
          }
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
  }

  // ---- The post (kPost) ----
  // Byte offset in a ring stage of 32-bit word w (columns 2w, 2w + 1) of
  // 64-column box ch, (token row, stream i): the TMA's swizzle (x_offset).
  __device__ __forceinline__ static uint32_t x_word_offset(int row, int i, int ch, int w) {
    const int line = i * kRows + row;
    return uint32_t(ch * kChunkBytes + line * 128 + (((w >> 2) ^ (row & 7)) << 4) + (w & 3) * 4);
  }

  // Tile t's post coefficients into post_coef[stage] (the producer warp, every
  // lane; R already in the orientation of res_layout: row i makes stream i)
  // by 4-byte cp.async, which holds no registers and does not stall the
  // producer (values through registers spilled at 56), completing on
  // coef_full; and the tile's F_out rows toward L2 for post_tile's loads.
  // Rows past B are not brought (post_tile does not make them: their ring
  // lines keep the TMA's zeros).
  __device__ __forceinline__ void load_post_coefs(int t) {
    const PipeState<kStages> x = PipeState<kStages>::at(t);
    const long long r0 = row0(t);
    const PostInput& po = p.post;
    constexpr int kPc = Dims<kN>::kPostCoef, kVals = kRows * kPc;
    const uint32_t cf = smem_u32(sm.post_coef + x.index * kVals);
#pragma unroll 1
    for (int e = lane; e < kVals; e += 32) {
      const int row = e / kPc, m = e - row * kPc;
      const long long b = r0 + row;
      if (b < p.batch) {
        const int i = m / kN, j = m - i * kN;  // m < n*n: R[i][j]; else H_post[m - n*n]
        const float* src = m < kN * kN ? po.h_res + b * kN * kN + (po.transpose ? j * kN + i : i * kN + j)
                                       : po.h_post + b * kN + (m - kN * kN);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(cf + 4u * uint32_t(e)), "l"(src) : "memory");
      }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(Mbar(bar.coef_full[x.index]).addr)
                 : "memory");
    if (lane < kRows && r0 + lane < p.batch)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(po.f_out + (r0 + lane) * hidden + c0),
                   "r"(slice * 2)
                   : "memory");
  }

  // Tile j's ring stage from X_L to X_next, in place (the finish warps, ft:
  // 0 .. 95): warp w takes tokens w, w + 3, ...; lane l word l of each
  // 64-column box of every stream: the n words of X_L and F_out's word in,
  // the n words of X_next out, to the ring and once to x_next (a warp
  // stores 128 contiguous bytes).
  __device__ __forceinline__ void post_tile(int j, int ft) {
    const PipeState<kStages> x = PipeState<kStages>::at(j);
    const int chunks = slice / 64;
    // F_out's lines of a row toward L1 (lane ch: box ch's 128 bytes), a row
    // ahead of its loads and the first before the waits below: one row's
    // latency overlaps the previous row's work. A prefetch holds no register
    // (F words held a row ahead spilled at 56).
    auto prefetch_f = [&](long long b) {
      if (lane < chunks && b < p.batch)
        asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p.post.f_out + b * hidden + c0 + lane * 64));
    };
    prefetch_f(row0(j) + (ft >> 5));
    if (j < kStages) {  // per-box barriers in the first tiles (Barriers::full)
      for (int ch = 0; ch < chunks; ++ch) Mbar(bar.full[x.index][ch]).wait(x.phase);
    } else {
      Mbar(bar.full[x.index][0]).wait(x.phase);
    }
    Mbar(bar.coef_full[x.index]).wait(x.phase);
    const long long r0 = row0(j);
    const int rows = int(min(static_cast<long long>(kRows), p.batch - r0));
    unsigned char* xs = sm.ring_ptr + x.index * L.stage_bytes;
    const float* cf = sm.post_coef + x.index * kRows * Dims<kN>::kPostCoef;
    const PostInput& po = p.post;
#pragma unroll 1
    for (int row = ft >> 5; row < rows; row += kFinishWarps) {
      const long long b = r0 + row;
      prefetch_f(row + kFinishWarps < rows ? b + kFinishWarps : p.batch);
      const __nv_bfloat16* frow = po.f_out + b * hidden + c0 + 2 * lane;
      uint32_t f[kMaxChunks];
#pragma unroll
      for (int ch = 0; ch < kMaxChunks; ++ch)
        f[ch] = ch < chunks ? __ldg(reinterpret_cast<const unsigned int*>(frow + ch * 64)) : 0u;
      // The token's coefficients come from shared memory per use (broadcast
      // float4 loads): held in registers across the boxes they spilled at 56.
      const float* crow = cf + row * Dims<kN>::kPostCoef;
      static_assert(kN == 4, "a row of R, and H_post, as one float4 each");
      // Per stream, box 0's addresses; box ch adds an immediate (kChunkBytes
      // in the ring, 64 columns in x_next): 28 addresses kept live spilled.
      uint32_t xo[kN];
      unsigned int* op[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        xo[i] = x_word_offset(row, i, 0, lane);
        op[i] = reinterpret_cast<unsigned int*>(po.x_next + (b * kN + i) * (long long)hidden + c0 + 2 * lane);
      }
#pragma unroll
      for (int ch = 0; ch < kMaxChunks; ++ch) {
        if (ch < chunks) {
          uint32_t xw[kN];
#pragma unroll
          for (int i = 0; i < kN; ++i) xw[i] = *reinterpret_cast<const uint32_t*>(xs + xo[i] + ch * kChunkBytes);
#pragma unroll
          for (int i = 0; i < kN; ++i) {
            const float4 r4 = *reinterpret_cast<const float4*>(crow + i * kN);
            const float rr[kN] = {r4.x, r4.y, r4.z, r4.w};
            const uint32_t o = post_mix_pair<kN>(xw, f[ch], rr, crow[kN * kN + i]);
            *reinterpret_cast<uint32_t*>(xs + xo[i] + ch * kChunkBytes) = o;
            __stcs(op[i] + ch * 32, o);
          }
        }
      }
    }
    // These generic-proxy writes come before the TMA's refill of the stage.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    Mbar(bar.xform_full[x.index]).arrive();
  }

  // =========================================================================
  // Projection warps (0-7)

  // This warp's B fragments of phi: its 2 k16 steps of every box (see the
  // ring), hi and (fp32 phi) lo. Coefficient tile kt: rows (k) 2t, 2t+1 and
  // 2t+8, 2t+9 of column (coefficient) kt*8 + g.
  struct PhiFrags {
    uint32_t hi[kMaxSteps][kKt][2];
    uint32_t lo[kF32 ? kMaxSteps : 1][kKt][2];
  };

  // phi -> registers, once, out of the ring; then the ring is X's.
  __device__ __forceinline__ void phi_to_registers(PhiFrags& phi, int g, int t, int my_steps, int step_stream,
                                                   int step_col) {
    Mbar(bar.phi_full).wait(0u);
#pragma unroll
    for (int s = 0; s < kMaxSteps; ++s) {
      const int i = step_stream;
      // Within the slice. kFp8's k order: step s & 1 takes columns
      // 8t + 4 (s & 1) + {0, 1} (h = 0) and + {2, 3} (h = 1) of the warp's 32.
      const int col = kFp8 ? 64 * (s >> 1) + step_col + 8 * t + 4 * (s & 1)
                           : 64 * (s >> 1) + step_col + 16 * (s & 1) + 2 * t;
      constexpr int kHalfCols = kFp8 ? 2 : 8;  // h = 1's column offset
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const int m = kt * 8 + g;
        const bool ok = s < my_steps && m < kCoef;
        const unsigned char* run = sm.ring_ptr + m * phi_m_bytes + (i * slice + col) * kPhiEsz;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kF32) {
            const float2 v =
                ok ? *reinterpret_cast<const float2*>(run + kHalfCols * h * kPhiEsz) : make_float2(0.f, 0.f);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
            const float2 hf = __bfloat1622float2(hi);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x - hf.x, v.y - hf.y);
            phi.hi[s][kt][h] = *reinterpret_cast<const uint32_t*>(&hi);
            phi.lo[s][kt][h] = *reinterpret_cast<const uint32_t*>(&lo);
          } else {
            phi.hi[s][kt][h] = ok ? *reinterpret_cast<const uint32_t*>(run + kHalfCols * h * kPhiEsz) : 0u;
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) Mbar(bar.phi_free).arrive();
  }

  // One k16 step s of a tile, A from the ring at `a_addr`. The sums of
  // squares on the tensor cores too: X_tile . X_tile^T restricted to 8 tokens
  // per mma; its diagonal is |x_r|^2 (exact bf16 products, fp32
  // accumulation), 2 mma per step instead of 16 ALU instructions. hi and lo
  // into one accumulator (fewer registers than two).
  __device__ __forceinline__ static void mma_step(const PhiFrags& phi, int s, uint32_t a_addr, float (&acc)[kKt][4],
                                                  float (&sq_lo)[4], float (&sq_hi)[4]) {
    uint32_t a[4];
    dev::ldmatrix_x4(a, a_addr);
    dev::mma_bf16_16816(sq_lo, a, a[0], a[2]);  // B = rows 0-7 of A, transposed
    dev::mma_bf16_16816(sq_hi, a, a[1], a[3]);  // B = rows 8-15 of A, transposed
#pragma unroll
    for (int kt = 0; kt < kKt; ++kt) {
      dev::mma_bf16_16816(acc[kt], a, phi.hi[s][kt][0], phi.hi[s][kt][1]);
      if constexpr (kF32) dev::mma_bf16_16816(acc[kt], a, phi.lo[s][kt][0], phi.lo[s][kt][1]);
    }
  }

  // This warp's partials of the tile in ring stage `x`: box by box, step s's
  // address an immediate offset from the lane's even- or odd-step address
  // (an address computed per step gets rematerialised by ptxas before every
  // ldmatrix at 224 registers). `per_box`: wait for each box's own barrier.
  __device__ __forceinline__ void project_tile(const PhiFrags& phi, const PipeState<kStages>& x, bool per_box,
                                               int my_steps, uint32_t a_off_even, uint32_t a_off_odd,
                                               float (&acc)[kKt][4], float (&sq_lo)[4], float (&sq_hi)[4]) {
    const uint32_t a_stage = sm.ring + x.index * L.stage_bytes;
    const uint32_t a_even = a_stage + a_off_even, a_odd = a_stage + a_off_odd;
    // Box c's barrier as an immediate offset from box 0's too (indexed as
    // full[x.index][c], ptxas spilled 4 bytes at fp32 phi).
    const Mbar box0(bar.full[x.index][0]);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      if (c < my_steps / 2) {
        if (per_box) (box0 + c).wait(x.phase);  // box c landed
        mma_step(phi, 2 * c, a_even + c * kChunkBytes, acc, sq_lo, sq_hi);
        mma_step(phi, 2 * c + 1, a_odd + c * kChunkBytes, acc, sq_lo, sq_hi);
      }
    }
  }

  // kFp8: this warp's partials of the tile in ring stage `x`, box by box:
  // rows g and g + 8 of its 32 columns as 8 codes each (q_off: box 0, row g;
  // row g + 8 is 8 lines on, 512 bytes, the same swizzle), their box's
  // scales s_g, s_g8; both k16 steps into `part` from zero, then
  // acc += part * s of the row (C rows g: e = 0, 1; g + 8: e = 2, 3), and
  // sq[0], sq[1] += s^2 * (the codes' sum of squares) of rows g, g + 8.
  __device__ __forceinline__ void project_tile_fp8(const PhiFrags& phi, const PipeState<kStages>& x, bool per_box,
                                                   int my_steps, uint32_t q_off, const uint32_t* sc,
                                                   float (&acc)[kKt][4], float (&sq)[2]) {
    const uint32_t a_row = sm.ring + x.index * L.stage_bytes + q_off;
    const Mbar box0(bar.full[x.index][0]);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      if (c < my_steps / 2) {
        if (per_box) (box0 + c).wait(x.phase);  // box c landed
        uint2 q_g, q_g8;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(q_g.x), "=r"(q_g.y) : "r"(a_row + c * kChunkBytes));
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(q_g8.x), "=r"(q_g8.y)
                     : "r"(a_row + c * kChunkBytes + 8 * 64));
        uint32_t f_g[4], f_g8[4];
        const float ss_g = e4m3x8_to_bf16_frags(q_g, f_g), ss_g8 = e4m3x8_to_bf16_frags(q_g8, f_g8);
        const float s_g = scale_value(sc[c * kRows], c), s_g8 = scale_value(sc[c * kRows + 8], c);
        sq[0] = fmaf(s_g * s_g, ss_g, sq[0]);
        sq[1] = fmaf(s_g8 * s_g8, ss_g8, sq[1]);
#pragma unroll
        for (int kt = 0; kt < kKt; ++kt) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t a[4] = {f_g[2 * h], f_g8[2 * h], f_g[2 * h + 1], f_g8[2 * h + 1]};
            dev::mma_bf16_16816(part, a, phi.hi[2 * c + h][kt][0], phi.hi[2 * c + h][kt][1]);
            if constexpr (kF32) dev::mma_bf16_16816(part, a, phi.lo[2 * c + h][kt][0], phi.lo[2 * c + h][kt][1]);
          }
          acc[kt][0] = fmaf(part[0], s_g, acc[kt][0]);
          acc[kt][1] = fmaf(part[1], s_g, acc[kt][1]);
          acc[kt][2] = fmaf(part[2], s_g8, acc[kt][2]);
          acc[kt][3] = fmaf(part[3], s_g8, acc[kt][3]);
        }
      }
    }
  }

  // This warp's partials into its scratch rows [kV][kScratchStride].
  __device__ __forceinline__ void stash_partials(const float (&acc)[kKt][4], const float (&sq_lo)[4],
                                                 const float (&sq_hi)[4], int g, int t) {
    float* my = sm.scratch + warp * kV * kScratchStride;
#pragma unroll
    for (int kt = 0; kt < kKt; ++kt) {
      const int m = kt * 8 + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int mm = m + (e & 1), row = g + 8 * (e >> 1);
        if (mm < kCoef) my[mm * kScratchStride + row] = acc[kt][e];
      }
    }
    if constexpr (kFp8) {
      // sq_lo[0], sq_lo[1]: this thread's sums of squares of tokens g, g + 8
      // over its columns; summed over the quad (t) in a fixed order.
      float a = sq_lo[0], b = sq_lo[1];
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      b += __shfl_xor_sync(0xffffffffu, b, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      b += __shfl_xor_sync(0xffffffffu, b, 2);
      if (t == 0) {
        my[kCoef * kScratchStride + g] = a;
        my[kCoef * kScratchStride + g + 8] = b;
      }
    } else {
      // Diagonal: token g < 8 is D[g][g] of sq_lo (lane 4g + g/2, element g & 1);
      // token 8 + g is D[8+g][g] of sq_hi (same lane, element 2 + (g & 1)).
      if (t == (g >> 1)) {
        my[kCoef * kScratchStride + g] = (g & 1) ? sq_lo[1] : sq_lo[0];
        my[kCoef * kScratchStride + g + 8] = (g & 1) ? sq_hi[3] : sq_hi[2];
      }
    }
  }

  // This CTA's partials of tile j: the 8 warps' scratch summed in a fixed
  // order per (value, 4 tokens) float4 and pushed into the receive buffers
  // of parity `buf`: the common ones to all 16 CTAs (each of the 16 threads
  // of one float4 sums it itself, in the same order, and pushes it to one
  // CTA), the rest to the owner. Position [parity][this rank][value][tokens].
  __device__ __forceinline__ void push_partials(int j, const PipeState<2>& buf) {
    const int owner_rank = j % kClusterSize;
    const uint32_t recv_bar = Mbar(bar.recv_full[buf.index]).addr;
    constexpr int kCommonPushes = kCommon * kQ * kClusterSize;
    auto warp_sum = [&](int m, int r4) {
      float4 v = *reinterpret_cast<const float4*>(sm.scratch + m * kScratchStride + r4 * 4);
#pragma unroll
      for (int w = 1; w < kProjWarps; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(sm.scratch + (w * kV + m) * kScratchStride + r4 * 4);
        v.x += x.x;
        v.y += x.y;
        v.z += x.z;
        v.w += x.w;
      }
      return v;
    };
    // An item's sum and destination; a thread sums both of its items
    // before it pushes either (a remote store holds the warp at issue:
    // back to back they overlap).
    auto item = [&](int it, float4& v, uint32_t& dst, int& dest) {
      if (it < kCommonPushes) {
        dest = it % kClusterSize;
        const int q = it / kClusterSize, cv = q / kQ, r4 = q - cv * kQ;  // q: (common value, 4 tokens)
        v = warp_sum(cv < kN ? cv : kCoef, r4);
        dst = smem_u32(sm.recv_common + ((buf.index * kClusterSize + rank) * kCommon + cv) * kRows + r4 * 4);
      } else {
        dest = owner_rank;
        const int q = it - kCommonPushes, fv = q / kQ, r4 = q - fv * kQ;
        v = warp_sum(kN + fv, r4);
        dst = smem_u32(sm.recv_owner + (rank * kFull + fv) * kRows + r4 * 4);
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
    push4(d0, recv_bar, r0, v0);
    if (second) push4(d1, recv_bar, r1, v1);
  }

  // F_pre of tile j's tokens 0-7 for this CTA's columns, out of the ring,
  // once the finish warps have published its H_pre; then the stage and the
  // H_pre buffer are released.
  __device__ __forceinline__ void projection_mix(int j, PhaseClock& clock) {
    const PipeState<kStages> x = PipeState<kStages>::at(j);
    const PipeState<2> buf = PipeState<2>::at(j);
    Mbar(bar.hpre_ready[buf.index]).wait(buf.phase);
    clock.mark(5);
    const unsigned char* xs = sm.ring_ptr + x.index * L.stage_bytes;
    const float* hp = sm.hpre + buf.index * kRows * kN;
    mix_rows(xs, scale_table(x.index), hp, row0(j), 0, kRows - kFinishMixRows, tid, kProjWarps * 32);
    clock.mark(6);
    // This warp is done with the stage (its projection reads were behind
    // the tile's block barriers; its mix just now) and with H_pre. One lane
    // releases both: an arrive per lane on hpre_free made ptxas spill at
    // setmaxnreg 224 (docs/mhc.md).
    __syncwarp();
    if (lane == 0) {
      Mbar(bar.hpre_free[buf.index]).arrive();
      Mbar(bar.stage_empty[x.index]).arrive();
    }
    clock.mark(7);
  }

  __device__ __forceinline__ void projection() {
    const int g = lane >> 2, t = lane & 3;
    static_assert(kN * 4 == 2 * kProjWarps, "a box's n * 4 k16 steps, 2 per projection warp");
    const int my_steps = 2 * (slice / 64);  // <= kMaxSteps (launcher)
    const int step_stream = warp >> 1, step_col = 32 * (warp & 1);  // + 64 (s / 2) + 16 (s % 2)
    PhiFrags phi;
    phi_to_registers(phi, g, t, my_steps, step_stream, step_col);
    dev::grid_dependency_wait();  // before X (prefetch_weights; a no-op otherwise)
    // ldmatrix.x4 lane address: rows (lane & 7) + 8 * ((lane >> 3) & 1), k offset 8 * (lane >> 4).
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_kofs = (lane >> 4) * 8;
    const uint32_t a_off_even = x_offset(a_row, step_stream, step_col + a_kofs);       // box 0, step 0
    const uint32_t a_off_odd = x_offset(a_row, step_stream, step_col + 16 + a_kofs);  // box 0, step 1
    const uint32_t q_off = q_offset(g, step_stream, step_col + 8 * t);               // kFp8: box 0, row g
    stamp(2, tid == 0);

    PhaseClock clock;
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      const PipeState<kStages> x = PipeState<kStages>::at(j);
      // The first kStages tiles (issued at the start, X cold) are waited
      // for box by box; later ones, issued a tile or more ahead, on one
      // barrier (a wait per box on every tile was slower).
      const bool per_box = !kPost && j < kStages;
      if constexpr (kPost) {
        Mbar(bar.xform_full[x.index]).wait(x.phase);  // the stage holds X_next
      } else {
        if (!per_box) Mbar(bar.full[x.index][0]).wait(x.phase);
      }
      if constexpr (kFp8) Mbar(bar.coef_full[x.index]).wait(x.phase);  // the stage's scales
      stamp(3, tid == 0 && j == 0);
      clock.mark(0);
      float acc[kKt][4];
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[kt][e] = 0.f;
      float sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};  // tokens 0-7, 8-15
      if constexpr (kFp8) {  // sq_lo[0], sq_lo[1]: tokens g, g + 8 (this thread's columns)
        float sq2[2] = {0.f, 0.f};
        project_tile_fp8(phi, x, per_box, my_steps, q_off,
                         scale_table(x.index) + step_stream * (slice / 64) * kRows + g, acc, sq2);
        sq_lo[0] = sq2[0];
        sq_lo[1] = sq2[1];
      } else {
        project_tile(phi, x, per_box, my_steps, a_off_even, a_off_odd, acc, sq_lo, sq_hi);
      }
      stamp(4, tid == 0 && j == 0);
      clock.mark(1);
      // This CTA's partials of tile j: per warp into scratch (once every
      // warp is done reading the previous tile's), then summed over the
      // warps and pushed once every CTA has released its receive buffer of
      // this parity (tile j - 2).
      named_bar_sync(kBarProj, kProjWarps * 32);
      stash_partials(acc, sq_lo, sq_hi, g, t);
      const PipeState<2> buf = PipeState<2>::at(j);
      if (j >= 2) Mbar(bar.recv_free[buf.index]).wait_cluster(buf.prev_phase());
      clock.mark(2);
      stamp(17, tid == 0 && j == 0);
      named_bar_sync(kBarProj, kProjWarps * 32);  // scratch written
      stamp(18, tid == 0 && j == 0);
      clock.mark(3);
      push_partials(j, buf);
      stamp(5, tid == 0 && j == 0);
      clock.mark(4);
      // The pre mix of the previous tile (its H_pre is being made by the
      // finish warps while this tile's projection ran), which releases its
      // stage. Stage 1 (kProject) has no mix: this tile's stage is free now.
      if (p.mode == ProjectMode::kProject) {
        if (lane == 0) Mbar(bar.stage_empty[x.index]).arrive();
      } else if (j > 0) {
        projection_mix(j - 1, clock);
      }
    }
    if (p.mode != ProjectMode::kProject && my_tiles > 0) projection_mix(my_tiles - 1, clock);
    stamp(9, tid == 0);
    report_projection(clock, cluster_id == 0 && rank < 2 && tid < 64 && lane == 0 && my_tiles > 0, rank, warp,
                      my_tiles);
  }

  // =========================================================================
  // Finish warps (8-10); ft: 0 .. 95

  // Tile j's sums over the 16 ranks into tot, 4 tokens per float4, in rank
  // order: the common values (every CTA) and the others (the owner).
  __device__ __forceinline__ void sum_ranks(const PipeState<2>& buf, bool owner, int ft) {
    const int nq = (owner ? kV : kCommon) * kQ;
    for (int q = ft; q < nq; q += kFinishWarps * 32) {
      const int i = q / kQ, r4 = q - i * kQ;  // i < kCommon: common value i; else full value i - kCommon
      float4 sum;
      int m;
      if (i < kCommon) {
        m = i < kN ? i : kCoef;
        sum = rank_sum4(sm.recv_common + (buf.index * kClusterSize * kCommon + i) * kRows + r4 * 4, kCommon * kRows);
      } else {
        m = kN + (i - kCommon);
        sum = rank_sum4(sm.recv_owner + (i - kCommon) * kRows + r4 * 4, kFull * kRows);
      }
      *reinterpret_cast<float4*>(sm.tot + m * kRows + r4 * 4) = sum;
    }
  }

  // h from the sums, in one pass: thread (row, g) takes coefficients
  // 4g .. 4g + 3 of one token, one r per thread; a non-owner needs only the
  // pre coefficients (g = 0). kPre: H_pre into hp, and the owner's h into
  // the stash `slot`; kHead: H_pre into hp only (no Sinkhorn); kProject: the
  // owner writes h and r.
  __device__ __forceinline__ void publish_h(long long row0, bool owner, int slot, float* hp, int ft) {
    const float inv_k = 1.0f / float(p.k_len);
    constexpr int kGroups = kCoef / 4;
    static_assert(kCoef % 4 == 0 && kN == 4 && kRows * kGroups <= kFinishWarps * 32, "one pass of (row, group)");
    const int hrow = ft / kGroups, hg = ft - hrow * kGroups;
    if (hrow < kRows && (owner || hg == 0)) {
      const float r = sqrtf(sm.tot[kCoef * kRows + hrow] * inv_k + p.eps_norm);
      const long long b = row0 + hrow;
      float hv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = hg * 4 + e;
        hv[e] = sm.coef_alpha[m] * __fdividef(sm.tot[m * kRows + hrow], r) + sm.coef_bias[m];
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
        if (owner && p.mode == ProjectMode::kPre) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sm.hsink[(slot * kRows + hrow) * kCoef + hg * 4 + e] = hv[e];
        }
      }
    }
  }

  __device__ __forceinline__ void finish() {
    const int ft = tid - kProjWarps * 32;
    load_phi(32 + ft);
    // The coefficients' alpha and bias, once (while phi loads), not per tile.
    for (int m = ft; m < kCoef; m += kFinishWarps * 32) {  // (mhc_head: alpha [1], bias [n])
      sm.coef_alpha[m] = m < p.num_coef ? __ldg(p.alpha + alpha_index(m, kN)) : 0.f;
      sm.coef_bias[m] = m < p.num_coef ? __ldg(p.bias + m) : 0.f;
    }
    dev::grid_dependency_wait();  // before any output (prefetch_weights; a no-op otherwise)
    named_bar_sync(kBarFinish, kFinishWarps * 32);
    if constexpr (kPost) {
      if (my_tiles > 0) post_tile(0, ft);
    }
    PhaseClock clock;
    int owned = 0;  // tiles this CTA owned so far
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      // The post of the next tile first: the projection warps wait for it.
      if constexpr (kPost) {
        if (j + 1 < my_tiles) post_tile(j + 1, ft);
      }
      const long long row0_j = row0(j);
      const bool owner = rank == j % kClusterSize;  // H_post/H_res (or h, r) of this tile
      const PipeState<2> buf = PipeState<2>::at(j);
      // The bytes this CTA receives for tile j: the common values from
      // every rank, and the rest too when it owns the tile. The peers'
      // pushes may land before this expectation is set (the transaction
      // count goes negative meanwhile); the phase needs both.
      const Mbar recv(bar.recv_full[buf.index]);
      if (ft == 0) recv.arrive_expect_tx(uint32_t(kClusterSize * (kCommon + (owner ? kFull : 0)) * kRows * 4));
      recv.wait(buf.phase);
      clock.mark(0);
      stamp(6, ft == 0 && j == 0);
      sum_ranks(buf, owner, ft);
      stamp(14, ft == 0 && j == 0);
      clock.mark(1);
      named_bar_sync(kBarFinish, kFinishWarps * 32);  // tot written; every read of the receive buffer done
      stamp(15, ft == 0 && j == 0);
      // The stash slot (after its previous use's Sinkhorn) and H_pre buffer
      // (after tile j - 2's mix) are free.
      const PipeState<2> sink = PipeState<2>::at(owned);
      if (owner && p.mode == ProjectMode::kPre && owned >= 2) Mbar(bar.sink_empty[sink.index]).wait(sink.prev_phase());
      if (p.mode != ProjectMode::kProject && j >= 2) Mbar(bar.hpre_free[buf.index]).wait(buf.prev_phase());
      clock.mark(2);
      float* hp = sm.hpre + buf.index * kRows * kN;
      publish_h(row0_j, owner, sink.index, hp, ft);
      stamp(16, ft == 0 && j == 0);
      clock.mark(3);
      named_bar_sync(kBarFinish, kFinishWarps * 32);
      if (p.mode != ProjectMode::kProject) Mbar(bar.hpre_ready[buf.index]).arrive();
      if (p.mode == ProjectMode::kPre && owner) Mbar(bar.sink_full[sink.index]).arrive();
      stamp(7, ft == 0 && j == 0);
      clock.mark(4);
      // The receive buffer is free again (its reads were before the first
      // barrier above); released after H_pre, which is what the cluster waits for.
      if (ft < 32) Mbar(bar.recv_free[buf.index]).arrive_cluster_all(lane);
      owned += owner;
      // The last kFinishMixRows tokens of the tile are mixed here, at once
      // (the projection warps, one tile behind, take the others).
      const int stage = PipeState<kStages>::at(j).index;
      // kFp8: the stage's scales are visible to these warps too (their
      // stores were released on coef_full; the phase completed long ago).
      if constexpr (kFp8) Mbar(bar.coef_full[stage]).wait(PipeState<kStages>::at(j).phase);
      if (p.mode != ProjectMode::kProject) {
        mix_rows(sm.ring_ptr + stage * L.stage_bytes, scale_table(stage), hp, row0_j, kRows - kFinishMixRows,
                 kFinishMixRows, ft, kFinishWarps * 32);
        __syncwarp();
      }
      stamp(8, ft == 0 && j == 0);
      clock.mark(5);
      if (lane == 0) Mbar(bar.stage_empty[stage]).arrive();
    }
    report_finish(clock, cluster_id == 0 && rank < 2 && ft == 0 && my_tiles > 0, rank, my_tiles);
  }

  // =========================================================================
  // Producer and Sinkhorn warp (11)

  // Activations + Sinkhorn of owned tile o, one token per lane, h from
  // stash `slot`; H_post and H_res out.
  __device__ __forceinline__ void sinkhorn_tile(int o, int slot) {
    const long long b = row0(o) + lane;
    if (lane < kRows && b < p.batch) {
      float h[kCoef], pre[kN], post[kN], res[kN * kN];
#pragma unroll
      for (int m = 0; m < kCoef; ++m) h[m] = sm.hsink[(slot * kRows + lane) * kCoef + m];
      stamp(13, lane == 0 && o == 0);
      activate_token<kN>(h, p.act, pre, post, res);
      stamp(19, lane == 0 && o == 0);
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
  }

  __device__ __forceinline__ void producer() {
    load_phi(lane);
    dev::grid_dependency_wait();  // before X and any output (prefetch_weights; a no-op otherwise)
    if (lane == 0) {
      Mbar(bar.phi_free).wait(0u);
      for (int j = 0; j < min(my_tiles, kStages); ++j) load_tile(j);
    }
    if constexpr (kPost) {
      for (int j = 0; j < min(my_tiles, kStages); ++j) load_post_coefs(j);
    }
    if constexpr (kFp8) {
      for (int j = 0; j < min(my_tiles, kStages); ++j) load_scales(j);
    }
    PhaseClock clock;
    int owned = 0;  // tiles this CTA owned so far
#pragma unroll 1
    for (int t = kStages; t < my_tiles + kStages; ++t) {
      // Refill: tile t goes where tile t - kStages was, once every warp
      // that reads it is done with it.
      if (t < my_tiles && lane == 0) {
        const PipeState<kStages> x = PipeState<kStages>::at(t);
        Mbar(bar.stage_empty[x.index]).wait(x.prev_phase());
        load_tile(t);
      }
      clock.mark(0);
      __syncwarp();
      if constexpr (kPost) {
        if (t < my_tiles) load_post_coefs(t);  // after lane 0's wait: the stage's coefficients are free too
      }
      if constexpr (kFp8) {
        if (t < my_tiles) load_scales(t);  // likewise the stage's scales
      }
      // Sinkhorn of tile o = t - kStages when this CTA owns it: its h was
      // stashed about when the projection warps released its stage.
      const int o = t - kStages;
      if (p.mode != ProjectMode::kPre || o % kClusterSize != rank) continue;
      const PipeState<2> sink = PipeState<2>::at(owned);
      Mbar(bar.sink_full[sink.index]).wait(sink.phase);
      stamp(12, lane == 0 && o == 0);
      clock.mark(1);
      sinkhorn_tile(o, sink.index);
      __syncwarp();
      stamp(10, lane == 0 && o == 0);
      clock.mark(2);
      Mbar(bar.sink_empty[sink.index]).arrive();
      ++owned;
    }
    report_producer(clock, cluster_id == 0 && rank < 2 && lane == 0 && my_tiles > 0, rank, my_tiles, owned);
  }
};

// kUe8m0: the FP8 stream's scales are ue8m0 (p.x_ue8m0; a template
// parameter so the projection decodes them without a branch).
template <int kN, bool kF32, bool kPost, bool kFp8, bool kUe8m0>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_mhc_resident_kernel(ProjectParams p, ResidentLayout L, const __grid_constant__ CUtensorMap x_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Barriers bars;
  __shared__ float coef[2 * Dims<kN>::kCoef];  // alpha_of(m), then bias[m]
  ResidentCta<kN, kF32, kPost, kFp8, kUe8m0> cta(p, L, &x_map, smem, bars, coef);

  stamp(0, threadIdx.x == 0);
  if (threadIdx.x == 0) bars.init();
  // Every CTA's barriers are initialised before any peer may arrive on them.
  dev::cluster_arrive();
  dev::cluster_wait();

  // With prefetch_weights (the caller's promise that the kernel before this
  // one on the stream does not write phi, alpha or bias), the weights are
  // read before the grid dependency is resolved, overlapping that kernel's
  // tail; every role waits for it before its first touch of X or of an
  // output. Without, everything waits here.
  if (!p.prefetch_weights) dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  stamp(1, threadIdx.x == 0);

  const int warp = threadIdx.x >> 5;
  if (warp < kProjWarps) {
    dev::setmaxnreg_inc<kProjRegs>();
    cta.projection();
  } else if (warp < kProjWarps + kFinishWarps) {
    dev::setmaxnreg_dec<kFinishRegs>();
    cta.finish();
  } else {
    dev::setmaxnreg_dec<kFinishRegs>();
    cta.producer();
  }
  // No CTA leaves while a peer may still read its partials or arrive on its barriers.
  __syncwarp();
  dev::cluster_arrive();
  dev::cluster_wait();
  stamp(11, threadIdx.x == 0);
  report_timeline(threadIdx.x == 0 && blockIdx.x == 0);
#endif
}

// X as a 3-D tensor (columns, tokens, streams) with boxes of
// 64 columns x 16 tokens x n streams, 128-byte swizzle; tokens past B read
// as zeros. Host-only work (capture-safe), done per launch because X moves.
// The FP8 stream (p.fp8x): the e4m3 codes, one byte an element, 64-byte
// lines with the 64-byte swizzle.
bool encode_x_map(const ProjectParams& p, int n, CUtensorMap& map) {
  const detail::TensorMapEncodeTiled encode = detail::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t esz = p.fp8x ? 1 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(p.hidden), cuuint64_t(p.batch), cuuint64_t(n)};
  const cuuint64_t strides[2] = {cuuint64_t(p.k_len) * esz, cuuint64_t(p.hidden) * esz};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, cuuint32_t(kRows), cuuint32_t(n)};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(&map, p.fp8x ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                const_cast<__nv_bfloat16*>(p.x), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                p.fp8x ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kN>
ResidentLayout resident_layout(int hidden, bool post, bool fp8) {
  constexpr int kV = kN * kN + 2 * kN + 1;
  ResidentLayout L;
  L.slice = hidden / kClusterSize;
  L.stage_bytes = L.slice / 64 * (fp8 ? box_bytes<kN, true>() : box_bytes<kN>());
  // phi's slice passes through the ring first (fp32: exactly the bf16 ring;
  // the FP8 ring is half of it, so the region keeps phi's size).
  const int ring = std::max(kStages * L.stage_bytes, (kV - 1) * kN * L.slice * 4);
  int off = ring + 1024 + (kV - 1) * kPhiPad;  // + the ring's alignment, + phi's padding
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
  L.off_post_coef = off;  // 16-byte aligned: every term above is
  if (post) off += kStages * kRows * Dims<kN>::kPostCoef * 4;
  L.off_scales = off;
  if (fp8) off += kStages * kN * (L.slice / 64) * kRows * 4;
  L.total = off;
  return L;
}

template <int kN, bool kF32, bool kPost, bool kFp8, bool kUe8m0 = false>
cudaError_t launch_resident(const ProjectParams& p, cudaStream_t stream, bool pdl, bool dry_run,
                            const char** why_not) {
  if (p.hidden % (kClusterSize * 64) != 0)  // whole 64-column TMA boxes per CTA
    return not_supported(why_not, "resident: C must be a multiple of 1024");
  const ResidentLayout L = resident_layout<kN>(p.hidden, kPost, kFp8);
  if (L.slice / 64 > kMaxChunks)  // a barrier per box, 2 k16 steps per warp and box
    return not_supported(why_not, "resident: C above 7168 (phi's slice would not fit in registers)");
  auto kernel = sm90_mhc_resident_kernel<kN, kF32, kPost, kFp8, kUe8m0>;
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
  if (p.mode == ProjectMode::kHead && p.fp8x)
    return not_supported(why_not, "resident: mhc_head on the bf16 stream only");
  if (p.has_post() && p.mode != ProjectMode::kPre) return not_supported(why_not, "resident: a fused post only before a pre");
  if (p.has_epilogue())
    return not_supported(why_not, "resident: no F_pre norm / FP8 epilogue in the kernel (a pass after it needs f_pre or a workspace of mhc_epilogue_workspace_bytes; else the cluster tiles run them)");
  if (p.fp8x && p.has_post())
    return not_supported(why_not, "resident: the FP8 stream's boundary runs on the cluster-tile kernel");
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return not_supported(why_not, "no usable CUDA device");
  if (dev.cc_major != 9 || dev.cc_minor != 0)  // built for sm_90a only
    return not_supported(why_not, "resident: needs an sm_90 GPU");
  if (p.has_post())
    return phi_is_f32 ? launch_resident<4, true, true, false>(p, stream, pdl, dry_run, why_not)
                      : launch_resident<4, false, true, false>(p, stream, pdl, dry_run, why_not);
  if (p.fp8x && p.x_ue8m0)
    return phi_is_f32 ? launch_resident<4, true, false, true, true>(p, stream, pdl, dry_run, why_not)
                      : launch_resident<4, false, false, true, true>(p, stream, pdl, dry_run, why_not);
  if (p.fp8x)
    return phi_is_f32 ? launch_resident<4, true, false, true>(p, stream, pdl, dry_run, why_not)
                      : launch_resident<4, false, false, true>(p, stream, pdl, dry_run, why_not);
  return phi_is_f32 ? launch_resident<4, true, false, false>(p, stream, pdl, dry_run, why_not)
                    : launch_resident<4, false, false, false>(p, stream, pdl, dry_run, why_not);
}

}  // namespace flashmix::mhc_detail
