// The device toolkit's Hopper half: cluster barriers, mbarriers, TMA (and,
// from mma_sync.cuh, shared-memory addresses, ldmatrix, bf16 mma.sync), as
// used by the sm_90a kernels. Include from sm_90a translation units only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/mma_sync.cuh"

namespace flashmix::dev {

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrives once on the mbarrier at shared address `bar` and raises the bytes
// the current phase expects from asynchronous copies (TMA / bulk copies).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Spins until the phase with the given parity of the mbarrier at shared
// address `bar` has completed (acquire at CTA scope).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// A consumer warp frees a ring stage on its empty barrier. kEveryThread: each
// thread arrives (the barrier counts 32 a warp), for stages whose shared
// memory the threads read with plain loads that a producer rewrites with plain
// stores (staged scales): lane 0 after __syncwarp orders the same under the
// PTX memory model, but compute-sanitizer's racecheck credits an arrive only
// to the thread that made it. Otherwise lane 0 arrives (one a warp).
template <bool kEveryThread>
__device__ __forceinline__ void release_stage(uint32_t bar) {
  if constexpr (kEveryThread) {
    mbar_arrive(bar);
  } else {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
  }
}

// The same release as release_stage<false> (the warp's accesses ordered
// by __syncwarp, one arrival a warp), the arriving lane chosen by
// elect.sync: no lane index to recompute in a loop that has none at hand.
__device__ __forceinline__ void release_stage_elect(uint32_t bar) {
  __syncwarp();
  asm volatile(
      "{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
// Moves registers between warpgroups (every warp of the warpgroup executes
// it): ptxas allocates up to the new count in the code that follows.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// TMA tile loads into this CTA's shared memory, completing `bytes` on the
// mbarrier at `bar`. `map` is the generic address of a CUtensorMap kernel
// parameter (__grid_constant__). Coordinates are elements, innermost first.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// 16 bytes global -> shared by cp.async (L2 only), the first src_bytes of them
// read and the rest zero-filled (0: all zeros, src not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4 bytes global -> shared by cp.async (through L1), the first src_bytes of
// them read and the rest zero-filled.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Arrives on the mbarrier at `bar` once all of this thread's earlier
// cp.async copies have landed; the arrival is counted in the barrier's
// expected count (noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's view of shared memory written through the generic
// proxy (st.shared, cp.async) before its later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// wgmma operand descriptor of a K-major tile in shared memory written by TMA
// with 128-byte swizzle: rows of 64 bf16 (128 bytes), 8-row groups 1024 bytes
// apart (the stride byte offset), the tile 1024-byte aligned. The k16 step j
// of a 64-wide row starts 32*j bytes further (add 2*j to the descriptor).
__device__ __forceinline__ uint64_t wgmma_desc_k_sw128(uint32_t smem_addr) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins accumulator registers in program order around asynchronous wgmma:
// the compiler must not read or move them across this point.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace flashmix::dev
