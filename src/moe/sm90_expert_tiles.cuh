// The tile schedule of our grouped GEMMs (FC1 and FC2, sm_90a): a tile is one
// slice of an expert's weight (128 weight rows: H columns for FC2, gate + up
// rows for FC1; FC1's wide block-FP8 tiles and its FP8 output take two
// slices a tile) times all of the expert's rows (up to kMaxRows; a larger
// expert is cut into equal chunks of at most kWgmmaMaxN), so a weight slice is
// read from device memory once for all of its expert's rows, and the wgmma N
// (the rows, rounded up to kRowQuantum) is sized per tile.
//
// The schedule is built on the device from expert_first_token_offset (no host
// sync): experts ordered by tile N, largest first (so the CTAs' last
// round-robin rounds take the short tiles), each expert's tiles slice by
// slice, the chunks of a slice side by side (they share its weight slice in
// L2). A persistent CTA takes tiles blockIdx.x, + gridDim.x, ...
#pragma once

#include <cstdint>

#include "common/sm90_wgmma.cuh"

namespace flashmix::expert_tiles {

constexpr int kRowQuantum = 16;  // N is a multiple of this
constexpr int kWgmmaMaxN = 256;  // the most rows one wgmma takes

struct TileInfo {
  int e, hs;  // the expert and the weight slice
  int p0;     // first permuted row of the chunk
  int rows;   // rows of the chunk
  int n;      // rows rounded up to kRowQuantum: the wgmma N
};

__device__ __forceinline__ int round_rows(int r) { return (r + kRowQuantum - 1) / kRowQuantum * kRowQuantum; }

// Chunks of an expert of R rows: one tile if it fits in kMaxRows, else equal
// chunks of at most min(kMaxRows, kWgmmaMaxN). (kMaxRows above 256 is for the experts just
// past 256 rows, which would otherwise be two tiles of ~136 rows; larger
// experts keep chunks of at most 256: 4 x 258 rows instead of 5 x 206 lost to
// the wave quantisation on the Mixtral-like FC2 shape.)
template <int kMaxRows>
__device__ __forceinline__ int row_chunks(int R) {
  constexpr int kChunk = kMaxRows < kWgmmaMaxN ? kMaxRows : kWgmmaMaxN;
  return R <= 0 ? 0 : R <= kMaxRows ? 1 : (R + kChunk - 1) / kChunk;
}

// The wgmma N of an expert's tiles (0 for an empty expert).
template <int kMaxRows>
__device__ __forceinline__ int tile_n(int R) {
  const int chunks = row_chunks<kMaxRows>(R);
  return chunks == 0 ? 0 : round_rows((R + chunks - 1) / chunks);
}

// Tile `tile` of the schedule built by build_schedule.
template <int kMaxRows>
__device__ __forceinline__ TileInfo decode_tile(int tile, const int* tile_start, const int* row_off,
                                                const uint16_t* order, int E) {
  int lo = 0, hi = E - 1;  // the last position whose first tile is <= tile (empty experts share it)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int e = order[lo];
  const int local = tile - tile_start[lo];
  const int R = row_off[e + 1] - row_off[e];
  const int chunks = row_chunks<kMaxRows>(R);
  const int per = (R + chunks - 1) / chunks;
  const int c = local % chunks;
  TileInfo t;
  t.e = e;
  t.hs = local / chunks;
  t.p0 = row_off[e] + c * per;
  t.rows = min(per, R - c * per);
  t.n = round_rows(per);
  return t;
}

// One warp: from row_off[0..E] (shared memory), the expert order (by tile N,
// largest first: a stable counting sort over N / 16, whose keys present are a
// bit mask, so decode-sized batches take one or two passes) and
// tile_start[0..E] (exclusive scan of chunks x slices in that order;
// tile_start[E] is the tile count). Both in shared memory; the caller syncs.
template <int kMaxRows>
__device__ __forceinline__ void build_schedule(const int* row_off, int E, int slices, int* tile_start,
                                               uint16_t* order) {
  static_assert(kMaxRows / kRowQuantum < 32, "keys fit a 32-bit mask");
  const int lane = threadIdx.x & 31;
  // The keys wait in tile_start, which the scan below fills afterwards.
  uint32_t present = 0;
  for (int e = lane; e < E; e += 32) {
    const int key = tile_n<kMaxRows>(row_off[e + 1] - row_off[e]) / kRowQuantum;
    tile_start[e] = key;
    present |= 1u << key;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) present |= __shfl_xor_sync(~0u, present, d);
  int pos = 0;
  while (present != 0) {
    const int key = 31 - __clz(present);
    present &= ~(1u << key);
    for (int b0 = 0; b0 < E; b0 += 32) {
      const int e = b0 + lane;
      const bool mine = e < E && tile_start[e] == key;  // this lane's own key from above
      const uint32_t ballot = __ballot_sync(~0u, mine);
      if (mine) order[pos + __popc(ballot & ((1u << lane) - 1))] = uint16_t(e);
      pos += __popc(ballot);
    }
  }
  __syncwarp();
  int carry = 0;
  for (int b0 = 0; b0 < E; b0 += 32) {
    const int i = b0 + lane;
    int v = 0;
    if (i < E) {
      const int e = order[i];
      v = row_chunks<kMaxRows>(row_off[e + 1] - row_off[e]) * slices;
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(~0u, v, d);
      if (lane >= d) v += u;
    }
    if (i < E) tile_start[i + 1] = carry + v;
    carry += __shfl_sync(~0u, v, 31);
  }
  if (lane == 0) tile_start[0] = 0;
}

// One stage's MMAs over a K block of 128 bytes a row: 4 steps of 32 bytes of
// K (m64nNk32 e4m3 or m64nNk16 bf16), both operands from shared memory;
// `accumulate` false starts the accumulator afresh.
template <bool kFp8, int N>
__device__ __forceinline__ void k_block_mmas(float (&acc)[N / 2], uint64_t da, uint64_t db, bool accumulate) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (kFp8)
      dev::WgmmaFp8<N>::mma(acc, da + 2 * j, db + 2 * j, accumulate || j > 0);
    else
      dev::Wgmma<N>::mma(acc, da + 2 * j, db + 2 * j, accumulate || j > 0);
  }
}

// Block scales: a K block's partial sums `part` promoted into the fp32
// accumulator (spec §11.4). In wgmma m64's layout this thread's rows r and
// r + 8 take the weight scales lo_s and hi_s, its columns 8 j + c2 and + 1
// the activation rows' scales sx[8 j + c2], sx[8 j + c2 + 1].
template <int N>
__device__ __forceinline__ void promote_k_block(float (&acc)[N / 2], const float (&part)[N / 2], float lo_s,
                                                float hi_s, const float* sx, int c2) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const float2 x = *reinterpret_cast<const float2*>(sx + 8 * j + c2);
    acc[4 * j + 0] = fmaf(part[4 * j + 0], lo_s * x.x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], lo_s * x.y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], hi_s * x.x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], hi_s * x.y, acc[4 * j + 3]);
  }
}

}  // namespace flashmix::expert_tiles
