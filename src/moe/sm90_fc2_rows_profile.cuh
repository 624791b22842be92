// Per-tile cycle profile of our FC2 kernel (sm90_fc2_rows_gemm.cu), compiled
// in only with -DFLASHMIX_FC2_PROFILE (scripts/tuning/profile_bench.sh builds such a
// flashmix-bench; scripts/tuning/fc2_profile.py reads what it prints). In a release
// build every hook below is empty and the kernel compiles to the same code
// as without them.
//
// What the profiling build records (32-bit SM clock):
//  - per consumer warpgroup, for each of its first kTiles tiles, 8 words:
//    0 start, 1 first stage landed, 2 mainloop done, 3 row table ready,
//    4 epilogue done, 5 N, 6 cycles waiting for later stages, 7 cycles
//    issuing the epilogue's stores (bf16 outputs); and a last record (begin,
//    end, tiles). Stamped into shared memory, copied out per CTA at the end
//    (printing from the kernel would serialise the wgmma pipeline);
//  - the producer's side of a tile: the clock before it waits for the stage
//    of k-block 0, after issuing k-block 0, after issuing k-block 3 (or the
//    last).
// FLASHMIX_FC2_PROFILE_LAUNCH=n: the n-th launch in the process synchronises
// its stream and prints them to stderr, one line per CTA and warpgroup
// (FC2CTA cta wg cycles tiles), per producer tile (FC2P cta tile t0 t1 t2,
// relative to the warpgroup's begin) and per consumer tile (FC2T cta wg tile
// start d1 d2 d3 d4 N waited drained).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#ifdef FLASHMIX_FC2_PROFILE
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#endif

namespace flashmix::fc2_rows_prof {

#ifdef FLASHMIX_FC2_PROFILE

constexpr int kTiles = 12;  // tiles stamped per warpgroup
constexpr int kCtas = 256;  // CTAs whose stamps are kept
// Shared memory for the stamps: per consumer warpgroup, kTiles + 1 records of 8 words.
constexpr int kSmemBytes = 2 * (kTiles + 1) * 8 * 4;
// The 272-row kernel's expert tables shrink from 256 to 128 to make room for them.
constexpr int wide_max_experts(int) { return 128; }

__device__ uint32_t g_tiles[kCtas][2][kTiles + 1][8];
__device__ uint32_t g_producer[kCtas][kTiles][4];

// A consumer warpgroup's stamps (in shared memory until finish()).
struct ConsumerLog {
  uint32_t* smem;
  uint32_t begin;
  __device__ __forceinline__ ConsumerLog(uint8_t* prof_smem, int wg)
      : smem(reinterpret_cast<uint32_t*>(prof_smem) + wg * (kTiles + 1) * 8), begin(uint32_t(clock())) {}
  __device__ __forceinline__ void stamp(int it, int slot, uint32_t value) const {
    if ((threadIdx.x & 127) == 0 && it < kTiles) smem[it * 8 + slot] = value;
  }
  __device__ __forceinline__ void stamp_clock(int it, int slot) const { stamp(it, slot, uint32_t(clock())); }
  // After the last tile: the warpgroup's stamps to device memory.
  __device__ __forceinline__ void finish(int tiles, int wg) const {
    if ((threadIdx.x & 127) == 0 && blockIdx.x < kCtas) {
      uint32_t* last = smem + kTiles * 8;
      last[0] = begin;
      last[1] = uint32_t(clock());
      last[2] = uint32_t(tiles);
      for (int i = 0; i < min(tiles, kTiles) * 8; ++i) (&g_tiles[blockIdx.x][wg][0][0])[i] = smem[i];
      for (int i = 0; i < 3; ++i) g_tiles[blockIdx.x][wg][kTiles][i] = last[i];
    }
  }
};

// One tile of a consumer warpgroup: the mainloop's waits for the full
// barriers, the epilogue's store passes.
struct TileClock {
  uint32_t w0 = 0, waited = 0, d0 = 0, drained = 0;
  __device__ __forceinline__ void before_stage_wait() { w0 = uint32_t(clock()); }
  __device__ __forceinline__ void after_stage_wait(const ConsumerLog& log, int it, int kb) {
    const uint32_t w1 = uint32_t(clock());
    if (kb == 0) log.stamp(it, 1, w1); else waited += w1 - w0;
  }
  __device__ __forceinline__ void mainloop_done(const ConsumerLog& log, int it) const {
    log.stamp_clock(it, 2);
    log.stamp(it, 6, waited);
  }
  __device__ __forceinline__ void before_drain() { d0 = uint32_t(clock()); }
  __device__ __forceinline__ void after_drain() { drained += uint32_t(clock()) - d0; }
  __device__ __forceinline__ void epilogue_done(const ConsumerLog& log, int it) const { log.stamp(it, 7, drained); }
};

// The TMA producer's side (one thread).
struct ProducerLog {
  int tile = 0;
  __device__ __forceinline__ void before_stage_wait(int kb) const {
    if (kb == 0 && tile < kTiles && blockIdx.x < kCtas) g_producer[blockIdx.x][tile][0] = uint32_t(clock());
  }
  __device__ __forceinline__ void after_issue(int kb, int k_blocks) const {
    if ((kb == 0 || kb == min(3, k_blocks - 1)) && tile < kTiles && blockIdx.x < kCtas)
      g_producer[blockIdx.x][tile][kb == 0 ? 1 : 2] = uint32_t(clock());
  }
  __device__ __forceinline__ void next_tile() { ++tile; }
};

// After a launch: the launch FLASHMIX_FC2_PROFILE_LAUNCH names prints its
// stamps (a host sync of `stream`).
inline void after_launch(cudaStream_t stream, int sm_count) {
  static int launches = 0;
  const char* env = std::getenv("FLASHMIX_FC2_PROFILE_LAUNCH");
  if (env == nullptr || ++launches != std::atoi(env)) return;
  static uint32_t h[kCtas][2][kTiles + 1][8];
  static uint32_t pr[kCtas][kTiles][4];
  cudaStreamSynchronize(stream);
  cudaMemcpyFromSymbol(h, g_tiles, sizeof(h));
  cudaMemcpyFromSymbol(pr, g_producer, sizeof(pr));
  for (int c = 0; c < std::min(sm_count, kCtas); ++c)
    for (int wg = 0; wg < 2; ++wg) {
      const uint32_t* last = h[c][wg][kTiles];
      const int tiles = std::min<int>(int(last[2]), kTiles);
      std::fprintf(stderr, "FC2CTA %d %d %u %u\n", c, wg, last[1] - last[0], last[2]);
      if (wg == 0)
        for (int i = 0; i < tiles; ++i)
          std::fprintf(stderr, "FC2P %d %d %d %d %d\n", c, i, int(pr[c][i][0] - last[0]), int(pr[c][i][1] - last[0]),
                       int(pr[c][i][2] - last[0]));
      for (int i = 0; i < tiles; ++i) {
        const uint32_t* v = h[c][wg][i];
        std::fprintf(stderr, "FC2T %d %d %d %u %u %u %u %u %u %u %u\n", c, wg, i, v[0] - last[0], v[1] - v[0],
                     v[2] - v[1], v[3] - v[2], v[4] - v[3], v[5], v[6], v[7]);
      }
    }
}

#else  // release: no stamps, no shared memory, every hook empty

constexpr int kSmemBytes = 0;
constexpr int wide_max_experts(int release) { return release; }

struct ConsumerLog {
  __device__ __forceinline__ ConsumerLog(uint8_t*, int) {}
  __device__ __forceinline__ void stamp(int, int, uint32_t) const {}
  __device__ __forceinline__ void stamp_clock(int, int) const {}
  __device__ __forceinline__ void finish(int, int) const {}
};

struct TileClock {
  __device__ __forceinline__ void before_stage_wait() {}
  __device__ __forceinline__ void after_stage_wait(const ConsumerLog&, int, int) {}
  __device__ __forceinline__ void mainloop_done(const ConsumerLog&, int) const {}
  __device__ __forceinline__ void before_drain() {}
  __device__ __forceinline__ void after_drain() {}
  __device__ __forceinline__ void epilogue_done(const ConsumerLog&, int) const {}
};

struct ProducerLog {
  __device__ __forceinline__ void before_stage_wait(int) const {}
  __device__ __forceinline__ void after_issue(int, int) const {}
  __device__ __forceinline__ void next_tile() {}
};

inline void after_launch(cudaStream_t, int) {}

#endif

}  // namespace flashmix::fc2_rows_prof
