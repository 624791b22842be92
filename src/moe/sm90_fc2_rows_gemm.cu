// FC2 grouped GEMM on sm_90a, our own kernel (Fc2GemmKernel::kRows; TMA +
// wgmma, no CUTLASS, always built): spec §3, per expert e,
//   out[t, h] += w[t, j] * (sum_i A[p, i] * W2[e, h, i] + bias[e, h])
// for its rows p (slot s = p2u[p], t = s % T, j = s / T), with the finalize
// in the epilogue (reduction adds into out or an fp32 accumulator, or rows
// stored for the deterministic / unfused modes: Fc2EpilogueOp).
//
// A tile is 128 output columns (H) x all rows of one expert (up to 272 with
// at most 256 experts, else 256; a larger expert is cut into equal chunks of
// at most 256), so an expert's W2 column slice is read from device memory
// once for all of its rows, and the wgmma N (the rows, 16..272 in steps of
// 16, one instantiation each; 272 as two wgmmas of 256 + 16 sharing one A
// fragment from registers) is sized per tile, so no MMA runs on padding rows
// (CUTLASS's grouped GEMM fixes the tile's row count at compile time). The
// product is computed transposed: D^T[h, row] = W2[e] (M = 128 H, K-major) x
// A_rows^T (N = rows, K-major), both operands by TMA with 128-byte swizzle.
//
// CTA: 12 warps, persistent (one CTA per SM, static round robin over the
// tiles: experts with the largest tiles first, then each expert's H slices,
// the chunks of one W2 slice side by side so they share it in L2). Warp 8
// issues the TMA loads into a 4-stage ring (W2 128 x 64 in one 3-D box, the
// rows in boxes of 128/64/32/16); warp 9 decodes the tiles and fills their
// tables (each row's destination row and weight, the slice's bias) up to two
// tiles ahead; warp 10 stores each stage's A scales (FP8 block scales,
// W4A8); warps 0-7, two warpgroups, each run wgmma m64nNk16 on 64 of
// the 128 columns, then the epilogue: w * (acc + bias) through shared memory
// (transposed so a thread holds 8 consecutive columns of one row) to 16-byte
// reduction adds / stores. Warps 8-11 give registers to the consumers
// (setmaxnreg 72 / 216). The schedule comes from expert_first_token_offset
// on the device: no host sync, capturable.
//
// Roofline: 2*P*H*I FLOPs; the DeepSeek-like EP rank (P = 8192, H = 7168,
// I = 2048) is 240 GFLOP, ~300 us at the ~800 TFLOP/s a dense cuBLAS GEMM
// reaches on an H200 (W2, 0.94 GB read once, is ~200 us of HBM bandwidth).
// Below N = 256 a tile's mainloop is bound by shared-memory bandwidth (TMA's
// writes plus the wgmmas' operand reads), not the MMA rate.
// FP8 (spec §3.5, Fc2In below): e4m3 A and W2 in the same 128-byte stages
// (128 of K a stage, TMA as bytes), m64nNk32 e4m3 wgmmas; block scales
// promote each K block of 128 into the fp32 accumulator (tiles of up to
// 128 rows), per-tensor scales
// multiply it once. The epilogue is the same.
// Current figure (H200, flashmix-bench against a dense cuBLAS GEMM of equal
// FLOPs): DeepSeek EP atomic ~1.31-1.38x dense, Mixtral-like ~1.17-1.22x,
// Qwen3-MoE-like ~1.57x. Design, profiles and measurements:
// docs/fc2_grouped_gemm.md. Cycle profile: -DFLASHMIX_FC2_PROFILE
// (sm90_fc2_rows_profile.cuh).
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "common/red.cuh"
#include "common/sm90.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/tma_host.h"
#include "moe/moe_fc2_internal.h"
#include "moe/sm90_expert_tiles.cuh"
#include "moe/sm90_fc2_rows_profile.cuh"
#include "moe/sm90_mx_decode.h"
#include "moe/sm90_mx_mainloop.cuh"

namespace flashmix {

namespace {

constexpr const char* kOp = "moe_fc2_finalize";

constexpr int kTileH = 128;      // output columns per tile: 2 consumer warpgroups x wgmma M = 64
constexpr int kTileBytes = 128;  // K per stage: one 128-byte swizzled row (64 bf16, 128 e4m3)
constexpr int kWideRows = 272;   // the row limit of the wide kernel (kWgmmaMaxN + one 16-row wgmma)
constexpr int kScaleK = 128;     // FP8 block scales: K per block (spec §11)
// Epilogue staging, per consumer warpgroup (its 64 columns x some rows):
// fp32 outputs 32 rows a pass, 68 floats a row (2 x 68 = 8 mod 32 banks: the
// scalar writes are conflict-free); bf16 outputs 64 rows a pass, 72 bf16 a
// row (144 bytes: the 8 rows of an stmatrix hit distinct banks).
constexpr int kEpiRows = 32;
constexpr int kEpiStride = 64 + 4;
constexpr int kEpiRowsBf16 = 64;
constexpr int kEpiStrideBf16 = 72;
constexpr int kEpiBytes = kEpiRows * kEpiStride * 4 > kEpiRowsBf16 * kEpiStrideBf16 * 2 ? kEpiRows * kEpiStride * 4
                                                                                      : kEpiRowsBf16 * kEpiStrideBf16 * 2;
// Warps 0-7: two consumer warpgroups; 8: TMA producer; 9: row tables; 10:
// the A scales (block scales), else idle; 11 idle (a whole third warpgroup,
// so setmaxnreg can move its registers to the consumers).
constexpr int kThreads = 384;
// setmaxnreg.inc takes registers from what the CTA holds (168 x 384 at
// launch): (168 - 72) x 128 >= (216 - 168) x 256.
constexpr int kProducerRegs = 72, kConsumerRegs = 216;
constexpr int kMaxExpertsOp = kFc2RowsMaxExperts;  // the most experts the 256-row kernel's tables hold
namespace prof = fc2_rows_prof;  // per-tile cycle stamps: empty hooks unless FLASHMIX_FC2_PROFILE
// kRowQuantum, kWgmmaMaxN (a tile above it takes two wgmmas), TileInfo and the
// schedule (sm90_expert_tiles.cuh, shared with FC1).
using namespace expert_tiles;

// Shared memory layout (from a 1024-byte aligned base): a 4-stage ring of
// W2 128 x 64 + up to kMaxRows rows x 64, the epilogue staging, the per-tile
// tables (two tiles), the experts' row offsets and first tiles, barriers
// (and in the profiling build the stamps).
// kMaxRows, the most rows a tile takes (wgmma's N; N / 2 fp32 accumulators
// per consumer thread): 272 (two wgmmas above 256 rows) where the experts'
// tables fit beside the larger stages (up to 256 experts, 128 in the
// profiling build), else 256. Larger tiles would need larger stages than 4
// fit (fewer, larger stages were slower: docs/fc2_grouped_gemm.md).
//
// What A and W2 hold (MoeFp8Scaling, resolved at the launch into the
// kernel's template): bf16, or e4m3 with block scales (each K block of 128
// summed by the FP8 MMA into a fresh accumulator, then promoted into the fp32
// one times its scales: the tile's 128 H columns are one W2 scale block, so
// one W2 scale a K block, times each row's A scale) or per-tensor scales
// (applied once at the end). The stages are the same bytes either way (128
// bytes of K a row); with block scales each stage also holds its rows' A
// scales of the K block, stored by the scale warp's 32 lanes (loaded
// before the wait for the stage, counted on its full barrier), and the K
// block's MMAs go into a second accumulator `part` (64 registers a thread):
// tiles of at most 128 rows. (Tiles of 256 promoted in two halves held
// 128 + 64 accumulator registers under the kernel's 168-register compile
// budget: ptxas spilled and serialised the wgmmas; 128-row tiles ran
// 11-15 % faster, H100 2026-11-27.)
// MXFP4 W2 (kMxfp4Fp8: e4m3 A with block scales, W4A8; kMxfp4Bf16: bf16 A,
// W4A16; spec §13.7): the stages hold W2's packed bytes (64 or 32 a row, no
// swizzle) and each consumer warpgroup converts its 64 H rows one stage ahead
// (sm90_mx_mainloop.cuh, shared with FC1); W4A8 promotes each K block with
// each H row's group scale times each row's A scale.
enum class Fc2In { kBf16, kFp8Block, kFp8Tensor, kMxfp4Fp8, kMxfp4Bf16 };

template <int kMaxRows_, Fc2In kIn_ = Fc2In::kBf16>
struct RowsCfg {
  static constexpr Fc2In kIn = kIn_;
  static constexpr bool kMx = kIn == Fc2In::kMxfp4Fp8 || kIn == Fc2In::kMxfp4Bf16;
  static constexpr bool kFp8 = kIn == Fc2In::kFp8Block || kIn == Fc2In::kFp8Tensor || kIn == Fc2In::kMxfp4Fp8;
  static constexpr bool kBlock = kIn == Fc2In::kFp8Block;  // a promotion every K block
  static constexpr bool kXBlock = kBlock || kIn == Fc2In::kMxfp4Fp8;  // A scales a row and K block
  static constexpr int kMaxRows = kMaxRows_;
  // MXFP4's stages hold 8 or 4 KB of weights: more of them (12 / 16 in
  // 32-row tiles for decode, 6 in 128-row tiles) keep the bytes in flight.
  // Block FP8 at decode (32-row tiles) likewise: 8 stages of 20 KB.
  static constexpr int kStages = !kMx ? (kBlock && kMaxRows <= 32 ? 8 : 4)
                                      : kMaxRows <= 32 ? (kFp8 ? 12 : 16) : kMaxRows <= 128 ? 6 : 4;
  // Block scales with the token rows as wgmma's M (consume_tile_block) need
  // two warpgroups of 64 rows: the 128-row tiles only.
  static constexpr bool kRowsMCapable = kBlock && kMaxRows == 128;
  static_assert(!kBlock || kMaxRows <= 128, "block-scaled tiles hold at most 128 rows (two accumulators)");
  static_assert(!kFp8 || kMaxRows <= kWgmmaMaxN, "FP8 tiles take one wgmma (no register-A FP8 path)");
  static_assert(!kMx || kMaxRows <= (kFp8 ? 128 : kWgmmaMaxN), "MXFP4 tiles: 128 rows (W4A8: two accumulators), 256");
  static constexpr int kFullArrivals = kXBlock ? 1 + 32 : 1;  // the TMA lane (+ the scale warp's 32 lanes)
  // The consumers' releases a stage: every thread where they read the staged A
  // scales (dev::release_stage), else one a warp (block scales with the token
  // rows as M too, though they read the staged scales: the FC1 tile that way
  // measured 12-25 % slower with every thread releasing, docs/moe_fc1.md).
  static constexpr int kEmptyArrivals = kXBlock ? 256 : 8;
  // The experts' tables fit beside the largest stages (272 rows) for up to
  // 256 experts.
  static constexpr int kMaxExperts = kMaxRows > kWgmmaMaxN ? prof::wide_max_experts(256) : kMaxExpertsOp;
  static constexpr int kRBytes = kMaxRows * kTileBytes;
  static constexpr int kTileK = kFp8 ? 128 : 64;  // elements of K a stage
  static constexpr int kWRowBytes = kMx ? kTileK / 2 : kTileBytes;  // bytes of a W2 row a stage
  static constexpr int kWCoordK = kMx ? kWRowBytes : kTileK;         // W2's TMA coordinate step a stage
  static constexpr int kWStage = kTileH * kWRowBytes;
  static constexpr int kStageBytes = kWStage + kRBytes;
  static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned (128-byte swizzle)");
  static constexpr int kScaleBytes = kXBlock ? kMaxRows * 4 : 0;  // a stage's A scales
  // Dense block scales: the A scales (times the W2 block scale) in a ring of
  // two rounds of the stages, slot s + kStages * phase, so that the
  // consumers release a stage before promoting from its scales: the producer
  // rewrites a slot only once the stage has been released twice since.
  static constexpr int kScaleSlots = kBlock ? 2 * kStages : kStages;
  static constexpr int kCvtTile = mx_mainloop::kCvtTile;
  static constexpr int kCvtBytes = kMx ? 2 * 2 * kCvtTile : 0;  // two converted tiles per consumer warpgroup
  static constexpr int kOffCvt = kStages * kStageBytes;
  static constexpr int kOffEpi = kOffCvt + kCvtBytes;
  static constexpr int kOffScales = kOffEpi + 2 * kEpiBytes;
  static constexpr int kOffTabRow = kOffScales + kScaleSlots * kScaleBytes;
  static constexpr int kOffTabW = kOffTabRow + 2 * kMaxRows * 4;
  static constexpr int kOffTabBias = kOffTabW + 2 * kMaxRows * 4;
  static constexpr int kOffRowOff = kOffTabBias + 2 * kTileH * 4;
  static constexpr int kOffTileStart = kOffRowOff + (kMaxExperts + 1) * 4;
  static constexpr int kOffOrder = kOffTileStart + (kMaxExperts + 1) * 4;  // uint16 [kMaxExperts]
  static constexpr int kOffTabInfo = (kOffOrder + kMaxExperts * 2 + 15) / 16 * 16;  // TileInfo [2]
  static constexpr int kOffBars = (kOffTabInfo + 2 * 32 + 7) / 8 * 8;
  static constexpr int kNumBars = 2 * kStages + 6;
  static constexpr int kOffProf = kOffBars + kNumBars * 8;
  static constexpr int kProfBytes = prof::kSmemBytes;  // 0 in a release build
  static constexpr int kSmemBytes = kOffBars + kNumBars * 8 + kProfBytes + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 232448, "shared memory");
};

struct RowsGemmParams : Fc2EpilogueParamsDevice {
  const float* a_scales;  // FP8: [capacity, I / 128] (block) or [1]
  const float* w_scales;  // FP8: [E, ceil(H / 128), I / 128] (block) or [E]
  const uint8_t* w_mx_scales;  // MXFP4: ue8m0 [E, H, I / 32]
  int i_blocks, h_blocks;  // FP8 block scales: I / 128, ceil(H / 128)
  int I;                   // K (MXFP4: the scale rows' length is I / 32)
  int E;
  int h_slices, k_blocks;
  bool plain_k1;  // kRedBf16, k == 1, out zeroed by the op: stores instead of reduction adds
  bool block_rows_m;  // block scales: token rows as wgmma's M (consume_tile_block), else W2 rows as M
};

struct Shared {
  uint32_t stages;  // shared address of stage 0
  float* a_sc;  // FP8 block scales: stage 0's A scales (the scale warp stores them)
  float* epi;
  int* tab_row;
  float* tab_w;
  float* tab_bias;
  TileInfo* tab_info;  // [2]: the tile of each table buffer
  uint32_t full, empty, tab_full, tab_empty, info_full;  // shared addresses of the first barrier of each kind
};

__device__ __forceinline__ uint32_t bar_at(uint32_t first, int i) { return first + 8 * i; }

// A producer's walk of the stage ring (the TMA lane's and the scale warp's,
// alike): stage s, bit j of `phases` stage j's phase. Token rows as M with
// block scales start every tile at stage 0 (rows_m_walk).
struct ProducerRing {
  int s = 0;
  uint32_t phases = 0;
  __device__ __forceinline__ uint32_t phase() const { return (phases >> s) & 1u; }
  __device__ __forceinline__ void next(int stages) {
    phases ^= 1u << s;
    if (++s == stages) s = 0;
  }
};

struct F32Group {
  float4 lo, hi;
};

// One 8-column group of row `row` of dst, fp32 (kRedFp32, kRowsFp32Scaled:
// workspace rows, 16-byte aligned).
__device__ __forceinline__ void store_group_f32(const RowsGemmParams& p, int64_t row, int col, const float4& x0,
                                                const float4& x1) {
  float* a = static_cast<float*>(p.dst) + row * p.dst_stride + col;
  if (p.op == int(Fc2EpilogueOp::kRedFp32)) {
    dev::red_add_f32x4(a, x0);
    dev::red_add_f32x4(a + 4, x1);
  } else {
    dev::st_global_v4(a, __float_as_uint(x0.x), __float_as_uint(x0.y), __float_as_uint(x0.z), __float_as_uint(x0.w));
    dev::st_global_v4(a + 4, __float_as_uint(x1.x), __float_as_uint(x1.y), __float_as_uint(x1.z),
                      __float_as_uint(x1.w));
  }
}

// One 8-column group of row `row` of dst, already bf16 (kRedBf16, kRowsBf16).
__device__ __forceinline__ void store_group_bf16(const RowsGemmParams& p, int64_t row, int col, const uint4& v) {
  __nv_bfloat16* a = static_cast<__nv_bfloat16*>(p.dst) + row * p.dst_stride + col;
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  const bool reduce = p.op == int(Fc2EpilogueOp::kRedBf16) && !p.plain_k1;
  if (p.vec16) {
    if (reduce) dev::red_add_bf16x8(a, u);
    else dev::st_global_v4(a, u[0], u[1], u[2], u[3]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (reduce)
        dev::red_add_bf16x2(a + 2 * i, u[i]);
      else
        *reinterpret_cast<uint32_t*>(a + 2 * i) = u[i];
    }
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The readers of one epilogue pass: 8 threads per staged row, one 8-column
// group each (kRowsPerPass * 8 / 128 groups a thread, all in one column
// group); rows past the chunk and columns past H are skipped. Every row
// index and staged value is loaded before the first store, so a thread's
// groups overlap instead of running one dependent chain each (a runtime
// loop over them did: ~700 cycles a 64-row pass with no stores at all).
template <int kRowsPerPass, class Load, class Store>
__device__ __forceinline__ void drain_pass(const RowsGemmParams& p, const TileInfo& t, const int* tab_row, int ps,
                                           int col0, int wt, Load&& load, Store&& store) {
  static_assert(kRowsPerPass * 8 % 128 == 0, "whole groups per thread");
  constexpr int kItems = kRowsPerPass * 8 / 128;
  const int v = wt & 7, col = col0 + 8 * v;
  int row[kItems];
  decltype(load(0, 0)) val[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int nl = (wt >> 3) + 16 * i, n = ps * kRowsPerPass + nl;
    row[i] = n < t.rows && col < p.H ? tab_row[n] : -1;
    val[i] = load(nl, v);  // the staging is in bounds whatever the row
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i)
    if (row[i] >= 0) store(row[i], col, val[i]);
}

// drain_pass over a bf16 staging (rows kEpiStrideBf16 apart, 16-byte groups
// stored as they are) and over an fp32 one (rows kEpiStride apart, 32-byte
// groups rounded at the store): every epilogue's two kinds of pass.
template <int kRowsPerPass>
__device__ __forceinline__ void drain_staged_bf16(const RowsGemmParams& p, const TileInfo& t, const int* tab_row,
                                                  int ps, int col0, int wt, const uint16_t* staged) {
  drain_pass<kRowsPerPass>(
      p, t, tab_row, ps, col0, wt,
      [&](int nl, int v) { return *reinterpret_cast<const uint4*>(staged + nl * kEpiStrideBf16 + 8 * v); },
      [&](int row, int col, const uint4& x) { store_group_bf16(p, row, col, x); });
}

template <int kRowsPerPass>
__device__ __forceinline__ void drain_staged_f32(const RowsGemmParams& p, const TileInfo& t, const int* tab_row,
                                                 int ps, int col0, int wt, const float* staged) {
  drain_pass<kRowsPerPass>(
      p, t, tab_row, ps, col0, wt,
      [&](int nl, int v) {
        const float* x = staged + nl * kEpiStride + 8 * v;
        return F32Group{*reinterpret_cast<const float4*>(x), *reinterpret_cast<const float4*>(x + 4)};
      },
      [&](int row, int col, const F32Group& x) { store_group_f32(p, row, col, x.lo, x.hi); });
}

// FP8 block scales: a K block's 4 k32 MMAs into a fresh `part`, waited for
// (both block-scaled tiles; expert_tiles' k_block_mmas), then promoted into
// the accumulators times the staged scale (the A scale times the W2 block
// scale).
template <int N>
__device__ __forceinline__ void fresh_k_block(float (&part)[N / 2], uint64_t da, uint64_t db) {
  dev::fence_operands(part);
  dev::wgmma_fence();
  k_block_mmas<true, N>(part, da, db, false);
  dev::wgmma_commit();
  dev::wgmma_wait<0>();
  dev::fence_operands(part);
}

// A consumer warpgroup's whole tile: mainloop over K, then the epilogue.
// N <= 256: one wgmma m64nNk16 per k16 step, both operands from shared
// memory. N > 256: two per step (rows 0..255 and 256..N-1) on one A fragment
// that the warp loads by ldmatrix, so W2's tile is read from shared memory
// once, not once per wgmma (with both from shared memory the tile ran at the
// shared-memory bandwidth model's rate; docs/fc2_grouped_gemm.md).
// FP8: m64nNk32 e4m3 wgmmas (N <= 256), see Fc2In.
template <class Cfg, int N, bool kBf16Out>
__device__ __forceinline__ void consume_tile(const RowsGemmParams& p, const Shared& sh, const TileInfo& t, int wg,
                                             int& s, uint32_t& ph, int it, const prof::ConsumerLog& log) {
  constexpr int kMaxRows = Cfg::kMaxRows;
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const int lane = threadIdx.x & 31;
  const uint32_t a_off = uint32_t(wg) * 64 * 128;  // this warpgroup's 64 H rows of the W2 tile
  prof::TileClock clk;
  if constexpr (Cfg::kMx) {
    // The converter's row: H row 128 hs + 64 wg + (thread % 128) / 2; the
    // promotion's: this thread's two accumulator rows (columns hl, hl + 8 of
    // the epilogue).
    namespace mx = mx_mainloop;
    const mx::Ring ring{sh.stages, Cfg::kStageBytes, Cfg::kWStage, Cfg::kStages,
                        sh.stages + uint32_t(Cfg::kOffCvt + wg * 2 * Cfg::kCvtTile), sh.full, sh.empty, sh.a_sc,
                        kMaxRows, 1 + wg};
    const int h0 = t.hs * kTileH + wg * 64;
    const int hc = h0 + ((threadIdx.x & 127) >> 1);
    const int hp = h0 + 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2);
    const int64_t e_row0 = int64_t(t.e) * p.H;
    mx::Rows rows{};
    rows.convert = hc < p.H ? mx::scale_row(p.w_mx_scales, e_row0 + hc, p.I) : nullptr;
    if (Cfg::kFp8) {
      rows.lo = hp < p.H ? mx::scale_row(p.w_mx_scales, e_row0 + hp, p.I) : nullptr;
      rows.hi = hp + 8 < p.H ? mx::scale_row(p.w_mx_scales, e_row0 + hp + 8, p.I) : nullptr;
    }
    clk.before_stage_wait();
    mx::mainloop<Cfg::kFp8, N>(ring, rows, p.k_blocks, wg, s, ph, acc);
    clk.mainloop_done(log, it);
  } else if constexpr (Cfg::kBlock) {
    // Each stage's K block into `part` (fresh), promoted into acc times the
    // tile's W2 block scale and each row's A scale (acc[4j + 0 / 2]: row
    // 8j + 2 (lane % 4), acc[4j + 1 / 3]: the next row; spec §11.4). (The
    // two warpgroups once took turns on the tensor cores through named
    // barriers, so that one's promotion overlapped the other's MMAs: 7-10 %
    // slower than letting both issue freely, H100 A/B 2026-11-27.)
    // The staged scales are the A scales times the W2 block scale (the
    // producer's), in a ring two rounds deep: the stage is released once its
    // MMAs are done, before the promotion reads them.
    float part[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) part[i] = 0.f;
    const int c2 = 2 * (lane & 3);
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      clk.before_stage_wait();
      dev::mbar_wait(bar_at(sh.full, s), ph);
      clk.after_stage_wait(log, it, kb);
      const uint32_t st = sh.stages + uint32_t(s) * Cfg::kStageBytes;
      const uint64_t da = dev::wgmma_desc_k_sw128(st + a_off), db = dev::wgmma_desc_k_sw128(st + Cfg::kWStage);
      const float* sx = sh.a_sc + (s + Cfg::kStages * int(ph)) * kMaxRows;
      fresh_k_block<N>(part, da, db);
      dev::release_stage<Cfg::kXBlock>(bar_at(sh.empty, s));
      promote_k_block<N>(acc, part, 1.f, 1.f, sx, c2);  // the W2 scale is in sx already
      if (++s == Cfg::kStages) {
        s = 0;
        ph ^= 1;
      }
    }
    clk.mainloop_done(log, it);
  } else {
    // N > 256: the row this lane addresses for ldmatrix.x4 (matrices: rows 0-7 /
    // 8-15 of the warp's 16, k 0-7 / 8-15 of the step) and its 16-byte chunk.
    const int lm_row = ((threadIdx.x >> 5) & 3) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const uint32_t lm_off = a_off + uint32_t(lm_row) * 128;
    const int lm_hi = lane >> 4, lm_x = lm_row & 7;  // 128-byte swizzle: chunk q sits at q ^ (row % 8)
    int prev = -1;
    // N > 256: a commit group per k16 step, two steps' A fragments alternating
    // (a step's registers are rewritten two steps later, after the wait for its
    // group), so the accumulators and fragments fit with the epilogue's registers.
    uint32_t fa[2][4];
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      clk.before_stage_wait();
      dev::mbar_wait(bar_at(sh.full, s), ph);
      clk.after_stage_wait(log, it, kb);
      const uint32_t st = sh.stages + uint32_t(s) * Cfg::kStageBytes;
      const uint64_t db = dev::wgmma_desc_k_sw128(st + Cfg::kWStage);
      if constexpr (N <= kWgmmaMaxN) {
        const uint64_t da = dev::wgmma_desc_k_sw128(st + a_off);
        dev::fence_operands(acc);
        dev::wgmma_fence();
#pragma unroll
        for (int j = 0; j < kTileBytes / 32; ++j) {  // 32 bytes of K a wgmma (k16 bf16, k32 e4m3)
          if constexpr (Cfg::kFp8)
            dev::WgmmaFp8<N>::mma(acc, da + 2 * j, db + 2 * j, 1);
          else
            dev::Wgmma<N>::mma(acc, da + 2 * j, db + 2 * j, 1);
        }
        dev::wgmma_commit();
        dev::fence_operands(acc);
        dev::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
      } else {
#pragma unroll
        for (int j = 0; j < kTileBytes / 32; ++j) {
          uint32_t(&f)[4] = fa[j & 1];
          dev::ldmatrix_x4(f, st + lm_off + uint32_t(((2 * j + lm_hi) ^ lm_x) << 4));
          dev::fence_operands(acc);
          dev::wgmma_fence();
          dev::WgmmaRS<kWgmmaMaxN>::mma(*reinterpret_cast<float(*)[kWgmmaMaxN / 2]>(acc), f, db + 2 * j, 1);
          // B's rows 256.. start 256 x 128 bytes further.
          dev::WgmmaRS<N - kWgmmaMaxN>::mma(*reinterpret_cast<float(*)[(N - kWgmmaMaxN) / 2]>(acc + kWgmmaMaxN / 2),
                                            f, db + 2 * j + (kWgmmaMaxN * 128 >> 4), 1);
          dev::wgmma_commit();
          dev::fence_operands(acc);
          dev::wgmma_wait<1>();  // at j = 0: the previous stage's last group is done
        }
      }
      if (prev >= 0) {
        __syncwarp();
        if (lane == 0) dev::mbar_arrive(bar_at(sh.empty, prev));
      }
      prev = s;
      if (++s == Cfg::kStages) {
        s = 0;
        ph ^= 1;
      }
    }
    dev::wgmma_wait<0>();
    dev::fence_operands(acc);
    clk.mainloop_done(log, it);
    __syncwarp();
    if (lane == 0) dev::mbar_arrive(bar_at(sh.empty, prev));
    if constexpr (Cfg::kIn == Fc2In::kFp8Tensor) {
      const float scale = __ldg(p.a_scales) * __ldg(p.w_scales + t.e);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[i] *= scale;
    }
  }

  // Epilogue.
  const int b = it & 1;
  dev::mbar_wait(bar_at(sh.tab_full, b), (it >> 1) & 1);
  log.stamp_clock(it, 3);
  const int q = (threadIdx.x >> 5) & 3, g = lane >> 2, c4 = lane & 3;
  const int hl = 16 * q + g;  // this thread's columns within the warpgroup's 64: hl and hl + 8
  const float bias0 = sh.tab_bias[b * kTileH + wg * 64 + hl];
  const float bias1 = sh.tab_bias[b * kTileH + wg * 64 + hl + 8];
  const int* tab_row = sh.tab_row + b * kMaxRows;
  const float* tab_w = sh.tab_w + b * kMaxRows;
  float* stg = reinterpret_cast<float*>(reinterpret_cast<char*>(sh.epi) + wg * kEpiBytes);
  const int wt = threadIdx.x & 127;
  const int col0 = t.hs * kTileH + wg * 64;
  if constexpr (kBf16Out) {
    // w * (acc + bias) rounded to bf16 and stored transposed by stmatrix:
    // one x4 per 16 rows x the warp's 16 columns; lane L addresses row L % 8
    // of matrix L / 8 (rows j and j + 1 of the fragment, columns +0 / +8).
    uint16_t* stg16 = reinterpret_cast<uint16_t*>(stg);
    const int mi = lane >> 3, mr = lane & 7;
    const uint32_t st_addr = dev::smem_u32(stg16 + ((mi >> 1) * 8 + mr) * kEpiStrideBf16 + 16 * q + (mi & 1) * 8);
    constexpr int kPasses = (N + kEpiRowsBf16 - 1) / kEpiRowsBf16;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
#pragma unroll
      for (int jj = 0; jj < kEpiRowsBf16 / 8; jj += 2) {
        const int j = ps * (kEpiRowsBf16 / 8) + jj;
        if (j < N / 8) {  // N is a multiple of 16: j + 1 < N / 8 too
          const int n0 = ps * kEpiRowsBf16 + jj * 8 + 2 * c4;
          const float w0 = tab_w[n0], w1 = tab_w[n0 + 1], w2 = tab_w[n0 + 8], w3 = tab_w[n0 + 9];
          const uint32_t r0 = pack_bf16x2(w0 * (acc[4 * j + 0] + bias0), w1 * (acc[4 * j + 1] + bias0));
          const uint32_t r1 = pack_bf16x2(w0 * (acc[4 * j + 2] + bias1), w1 * (acc[4 * j + 3] + bias1));
          const uint32_t r2 = pack_bf16x2(w2 * (acc[4 * j + 4] + bias0), w3 * (acc[4 * j + 5] + bias0));
          const uint32_t r3 = pack_bf16x2(w2 * (acc[4 * j + 6] + bias1), w3 * (acc[4 * j + 7] + bias1));
          asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                           st_addr + uint32_t(jj * 8 * kEpiStrideBf16 * 2)),
                       "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                       : "memory");
        }
      }
      dev::named_bar_sync(1 + wg, 128);
      clk.before_drain();
      drain_staged_bf16<kEpiRowsBf16>(p, t, tab_row, ps, col0, wt, stg16);
      clk.after_drain();
      dev::named_bar_sync(1 + wg, 128);
    }
  } else {
    constexpr int kPasses = (N + kEpiRows - 1) / kEpiRows;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
#pragma unroll
      for (int jj = 0; jj < kEpiRows / 8; ++jj) {
        const int j = ps * (kEpiRows / 8) + jj;
        if (j < N / 8) {
          const int nl = jj * 8 + 2 * c4;
          const float w0 = tab_w[ps * kEpiRows + nl], w1 = tab_w[ps * kEpiRows + nl + 1];
          stg[nl * kEpiStride + hl] = w0 * (acc[4 * j + 0] + bias0);
          stg[(nl + 1) * kEpiStride + hl] = w1 * (acc[4 * j + 1] + bias0);
          stg[nl * kEpiStride + hl + 8] = w0 * (acc[4 * j + 2] + bias1);
          stg[(nl + 1) * kEpiStride + hl + 8] = w1 * (acc[4 * j + 3] + bias1);
        }
      }
      dev::named_bar_sync(1 + wg, 128);
      drain_staged_f32<kEpiRows>(p, t, tab_row, ps, col0, wt, stg);
      dev::named_bar_sync(1 + wg, 128);
    }
  }
  clk.epilogue_done(log, it);
  // Every thread that read the tile's table (and its TileInfo) arrives: a
  // single lane after __syncwarp orders the same, but compute-sanitizer's
  // racecheck only credits an arrive to the thread that made it.
  dev::mbar_arrive(bar_at(sh.tab_empty, b));
}

// Token rows as M with block scales: every tile starts at stage 0 of the
// ring, whose walk over one tile's K blocks is unrolled (rows_m_block_loop):
// f(j, kb, ph) for each K block kb, on stage j (a constant once unrolled) of
// phase ph, then the stage's phase bit flipped.
template <class Cfg, class F>
__device__ __forceinline__ void rows_m_walk(const RowsGemmParams& p, uint32_t& phases, F&& f) {
  constexpr int kStages = Cfg::kStages;
#pragma unroll 1
  for (int kb0 = 0; kb0 < p.k_blocks; kb0 += kStages) {
#pragma unroll
    for (int j = 0; j < kStages; ++j) {
      if (kb0 + j < p.k_blocks) {
        f(j, kb0 + j, (phases >> j) & 1u);
        phases ^= 1u << j;
      }
    }
  }
}

// The K loop of the token-rows-as-M block tiles (consume_tile_block),
// written for few instructions a K block (as FC1's rows_m_mainloop,
// docs/moe_fc1.md): in this mode every tile starts at stage 0 of the ring
// (the producer leaves the rest of a round unused at a tile's end), so the
// loop is unrolled over the ring's stages and a K block's stage is a
// constant: its barriers, scale slots and wgmma descriptors are stage 0's
// plus constants (uniform registers, no per-block address arithmetic), and
// the warpgroup (kWg) is one too. Bit j of `phases` is stage j's phase.
// Each K block: wait for its stage, its four k32 MMAs into a fresh `part`,
// the stage released, then acc += part x (A scale x W2 block scale) for the
// thread's two rows (the scale warp stages the products, two rounds deep).
template <class Cfg, int kWg>
__device__ __forceinline__ void rows_m_block_loop(const RowsGemmParams& p, const Shared& sh, float (&acc)[kTileH / 2],
                                                  uint32_t& phases, int r_lo, int it, const prof::ConsumerLog& log,
                                                  prof::TileClock& clk) {
  constexpr int N = kTileH, kStages = Cfg::kStages;
  float part[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) part[i] = 0.f;
  const uint64_t da0 = dev::wgmma_desc_k_sw128(sh.stages + uint32_t(Cfg::kWStage + kWg * 64 * kTileBytes));
  const uint64_t db0 = dev::wgmma_desc_k_sw128(sh.stages);
  const float* sx0 = sh.a_sc + r_lo;
  rows_m_walk<Cfg>(p, phases, [&](int j, int kb, uint32_t ph) {
    clk.before_stage_wait();
    dev::mbar_wait(bar_at(sh.full, j), ph);
    clk.after_stage_wait(log, it, kb);
    const float* sx = sx0 + (j + kStages * int(ph)) * Cfg::kMaxRows;
    const float sa = sx[0], sb = sx[8];
    const uint64_t step = uint64_t(j) * (Cfg::kStageBytes / 16);  // a constant once unrolled
    fresh_k_block<N>(part, da0 + step, db0 + step);
    dev::release_stage_elect(bar_at(sh.empty, j));  // the stage is free: promote from registers
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      acc[4 * i + 0] = fmaf(part[4 * i + 0], sa, acc[4 * i + 0]);
      acc[4 * i + 1] = fmaf(part[4 * i + 1], sa, acc[4 * i + 1]);
      acc[4 * i + 2] = fmaf(part[4 * i + 2], sb, acc[4 * i + 2]);
      acc[4 * i + 3] = fmaf(part[4 * i + 3], sb, acc[4 * i + 3]);
    }
  });
}

// Warpgroup 1 on a chunk of at most 64 rows: each of the tile's stages
// waited for and released, in the same unrolled order.
template <class Cfg>
__device__ __forceinline__ void rows_m_block_idle(const RowsGemmParams& p, const Shared& sh, uint32_t& phases) {
  rows_m_walk<Cfg>(p, phases, [&](int j, int, uint32_t ph) {
    dev::mbar_wait(bar_at(sh.full, j), ph);
    dev::release_stage_elect(bar_at(sh.empty, j));
  });
}

// FP8 block scales, with the token rows as wgmma's M (as FC1's block mode,
// docs/moe_fc1.md): warpgroup wg takes the tile's rows 64 wg .. 64 wg + 63
// (A: the stage's row operand) against all 128 H rows of the W2 tile (B,
// N = 128). A thread's accumulator rows are two tokens, one A scale each,
// and the tile's 128 H columns are one W2 scale block, so each K block's
// partial sum is promoted by one FFMA an element with two scale products
// (the K loop: rows_m_block_loop; `phases` is the ring's state in this mode).
// The epilogue: the warpgroup that owns a pass's rows stages them across
// both warpgroups' buffers (each buffer one warpgroup's 64 H columns, the
// transposed tile's layout), then each warpgroup drains its own columns as
// consume_tile's epilogue does (named barrier kRowsMBar, both warpgroups).
constexpr int kRowsMBar = 3;
template <class Cfg, bool kBf16Out>
__device__ __forceinline__ void consume_tile_block(const RowsGemmParams& p, const Shared& sh, const TileInfo& t,
                                                   int wg, uint32_t& phases, int it, const prof::ConsumerLog& log) {
  constexpr int kMaxRows = Cfg::kMaxRows;
  constexpr int N = kTileH;
  static_assert(kMaxRows == 128, "two warpgroups of 64 rows");
  const int lane = threadIdx.x & 31, q = (threadIdx.x >> 5) & 3;
  const int rl = 16 * q + (lane >> 2);  // this thread's rows within its warpgroup's 64: rl, rl + 8
  const int r_lo = 64 * wg + rl;
  const bool active = 64 * wg < t.n;  // warpgroup 1 idles in the mainloop on chunks of at most 64 rows
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  prof::TileClock clk;
  if (wg == 0)
    rows_m_block_loop<Cfg, 0>(p, sh, acc, phases, r_lo, it, log, clk);
  else if (active)
    rows_m_block_loop<Cfg, 1>(p, sh, acc, phases, r_lo, it, log, clk);
  else
    rows_m_block_idle<Cfg>(p, sh, phases);
  clk.mainloop_done(log, it);

  // Epilogue. acc[4j + 0 / 1]: row rl, H columns 8j + c2 / + 1 of the tile;
  // acc[4j + 2 / 3]: row rl + 8.
  const int b = it & 1;
  dev::mbar_wait(bar_at(sh.tab_full, b), (it >> 1) & 1);
  log.stamp_clock(it, 3);
  const int c2 = 2 * (lane & 3);
  const int* tab_row = sh.tab_row + b * kMaxRows;
  const float wa = sh.tab_w[b * kMaxRows + r_lo], wb = sh.tab_w[b * kMaxRows + r_lo + 8];
  const float* bias = sh.tab_bias + b * kTileH;
  const int wt = threadIdx.x & 127;
  const int col0 = t.hs * kTileH + wg * 64;  // the 64 H columns this warpgroup drains
  char* epi = reinterpret_cast<char*>(sh.epi);
  if constexpr (kBf16Out) {
    // A pass is one warpgroup's 64 rows (kEpiRowsBf16).
    uint16_t* mine = reinterpret_cast<uint16_t*>(epi + wg * kEpiBytes);
    for (int ps = 0; ps * 64 < t.n; ++ps) {
      if (wg == ps) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const int col = 8 * j + c2;
          uint16_t* stg = reinterpret_cast<uint16_t*>(epi + (col >> 6) * kEpiBytes) + (col & 63);
          const float b0 = bias[col], b1 = bias[col + 1];
          *reinterpret_cast<uint32_t*>(stg + rl * kEpiStrideBf16) =
              pack_bf16x2(wa * (acc[4 * j + 0] + b0), wa * (acc[4 * j + 1] + b1));
          *reinterpret_cast<uint32_t*>(stg + (rl + 8) * kEpiStrideBf16) =
              pack_bf16x2(wb * (acc[4 * j + 2] + b0), wb * (acc[4 * j + 3] + b1));
        }
      }
      dev::named_bar_sync(kRowsMBar, 256);
      drain_staged_bf16<kEpiRowsBf16>(p, t, tab_row, ps, col0, wt, mine);
      dev::named_bar_sync(kRowsMBar, 256);
    }
  } else {
    // A pass is 32 rows (kEpiRows): two warps of one warpgroup stage them.
    const float* mine = reinterpret_cast<const float*>(epi + wg * kEpiBytes);
    for (int ps = 0; ps * kEpiRows < t.n; ++ps) {
      if (wg == (ps >> 1) && (q >> 1) == (ps & 1)) {
        const int nl = rl - 32 * (ps & 1);
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const int col = 8 * j + c2;
          float* stg = reinterpret_cast<float*>(epi + (col >> 6) * kEpiBytes) + (col & 63);
          const float b0 = bias[col], b1 = bias[col + 1];
          stg[nl * kEpiStride] = wa * (acc[4 * j + 0] + b0);
          stg[nl * kEpiStride + 1] = wa * (acc[4 * j + 1] + b1);
          stg[(nl + 8) * kEpiStride] = wb * (acc[4 * j + 2] + b0);
          stg[(nl + 8) * kEpiStride + 1] = wb * (acc[4 * j + 3] + b1);
        }
      }
      dev::named_bar_sync(kRowsMBar, 256);
      drain_staged_f32<kEpiRows>(p, t, tab_row, ps, col0, wt, mine);
      dev::named_bar_sync(kRowsMBar, 256);
    }
  }
  clk.epilogue_done(log, it);
  dev::mbar_arrive(bar_at(sh.tab_empty, b));
}

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    fc2_rows_gemm_kernel(const __grid_constant__ RowsGemmParams p, const __grid_constant__ CUtensorMap map_w,
                         const __grid_constant__ CUtensorMap map_a128, const __grid_constant__ CUtensorMap map_a64,
                         const __grid_constant__ CUtensorMap map_a32, const __grid_constant__ CUtensorMap map_a16) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = dev::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* sm = smem_raw + (base - raw);
  Shared sh;
  sh.stages = base;
  constexpr int kMaxRows = Cfg::kMaxRows;
  constexpr int kStages = Cfg::kStages;
  sh.a_sc = reinterpret_cast<float*>(sm + Cfg::kOffScales);
  sh.epi = reinterpret_cast<float*>(sm + Cfg::kOffEpi);
  sh.tab_row = reinterpret_cast<int*>(sm + Cfg::kOffTabRow);
  sh.tab_w = reinterpret_cast<float*>(sm + Cfg::kOffTabW);
  sh.tab_bias = reinterpret_cast<float*>(sm + Cfg::kOffTabBias);
  int* row_off = reinterpret_cast<int*>(sm + Cfg::kOffRowOff);
  int* tile_start = reinterpret_cast<int*>(sm + Cfg::kOffTileStart);
  uint16_t* order = reinterpret_cast<uint16_t*>(sm + Cfg::kOffOrder);
  sh.tab_info = reinterpret_cast<TileInfo*>(sm + Cfg::kOffTabInfo);
  sh.full = base + Cfg::kOffBars;
  sh.empty = sh.full + 8 * kStages;
  sh.tab_full = sh.empty + 8 * kStages;
  sh.tab_empty = sh.tab_full + 16;
  sh.info_full = sh.tab_empty + 16;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int E = p.E;
  const bool rows_m = Cfg::kRowsMCapable && p.block_rows_m;  // consume_tile_block: one release a warp
  for (int e = tid; e <= E; e += kThreads) row_off[e] = int(p.offsets[e]);
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      dev::mbar_init(bar_at(sh.full, i), Cfg::kFullArrivals);
      dev::mbar_init(bar_at(sh.empty, i), rows_m ? 8 : Cfg::kEmptyArrivals);
    }
    for (int i = 0; i < 2; ++i) {
      dev::mbar_init(bar_at(sh.tab_full, i), 32);  // every lane of the table warp
      dev::mbar_init(bar_at(sh.tab_empty, i), 256);  // every consumer thread
      dev::mbar_init(bar_at(sh.info_full, i), 1);  // lane 0 of the table warp, once the tile is decoded
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) build_schedule<kMaxRows>(row_off, E, p.h_slices, tile_start, order);
  __syncthreads();

  // Each role's code sits inside its setmaxnreg branch: ptxas ignores the
  // instruction when code needing more registers is reachable after it.
  if (warp >= 8) {
    dev::setmaxnreg_dec<kProducerRegs>();
    const int total = tile_start[E];  // read after setmaxnreg: a value live across it is spilled
    if (warp == 8) {
      // TMA producer: lane 0.
      if (lane == 0) {
        dev::prefetch_tensor_map(&map_w);
        dev::prefetch_tensor_map(&map_a128);
        ProducerRing ring;
        prof::ProducerLog plog;
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
          const TileInfo t = decode_tile<kMaxRows>(tile, tile_start, row_off, order, E);
          if (rows_m) ring.s = 0;
          for (int kb = 0; kb < p.k_blocks; ++kb) {
            const int s = ring.s;
            plog.before_stage_wait(kb);
            dev::mbar_wait(bar_at(sh.empty, s), ring.phase() ^ 1u);
            const uint32_t full = bar_at(sh.full, s);
            dev::mbar_arrive_expect_tx(full, Cfg::kWStage + uint32_t(t.n) * kTileBytes);
            const uint32_t st = sh.stages + uint32_t(s) * Cfg::kStageBytes;
            dev::tma_load_3d(st, &map_w, full, kb * Cfg::kWCoordK, t.hs * kTileH, t.e);
            const uint32_t rows_dst = st + Cfg::kWStage;
            const CUtensorMap* row_maps[4] = {&map_a128, &map_a64, &map_a32, &map_a16};  // boxes of 128 >> i rows
            int r = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i)
              for (; r + (128 >> i) <= t.n; r += 128 >> i)
                dev::tma_load_2d(rows_dst + r * kTileBytes, row_maps[i], full, kb * Cfg::kTileK, t.p0 + r);
            plog.after_issue(kb, p.k_blocks);
            ring.next(kStages);
          }
          plog.next_tile();
        }
      }
    } else if (Cfg::kXBlock && warp == 10) {
      // The A scales of each stage's rows (block scales, W4A8), a warp of its
      // own beside the TMA lane: lane l stores rows l + 32 i's scales of the
      // K block (dense block scales: times the tile's W2 block scale, so the
      // consumers' promotion is one FFMA an element) and arrives on the
      // stage's full barrier (33 arrivals: these 32 and the TMA lane's). The
      // loads are issued before the wait for the stage, their latency behind
      // it. Every row of the slot is stored, 0 past the chunk's (the
      // token-rows-as-M tile reads 64 rows a warpgroup, past a short chunk's
      // N). (Until 2026-11-28 the TMA warp's 32 lanes did this between its
      // issues: ~150 instructions a K block on one warp, which ncu showed
      // busy ~80 % of the kernel while the consumers waited on their full
      // barriers; until 2026-11-27 by 4-byte cp.asyncs.)
      ProducerRing ring;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const TileInfo t = decode_tile<kMaxRows>(tile, tile_start, row_off, order, E);
        if (rows_m) ring.s = 0;
        const float* w_row = Cfg::kBlock ? p.w_scales + (int64_t(t.e) * p.h_blocks + t.hs) * p.i_blocks : nullptr;
        const float* a_row[kMaxRows / 32];
#pragma unroll
        for (int i = 0; i < kMaxRows / 32; ++i) {
          const int r = lane + 32 * i;
          a_row[i] = r < t.rows ? p.a_scales + int64_t(t.p0 + r) * p.i_blocks : nullptr;
        }
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          float sc[kMaxRows / 32];
          const float w_s = Cfg::kBlock ? __ldg(w_row + kb) : 1.f;
#pragma unroll
          for (int i = 0; i < kMaxRows / 32; ++i) sc[i] = a_row[i] != nullptr ? __ldg(a_row[i] + kb) : 0.f;
          const int s = ring.s;
          const uint32_t ph = ring.phase();
          dev::mbar_wait(bar_at(sh.empty, s), ph ^ 1u);
          float* dst = sh.a_sc + (s + (Cfg::kBlock ? kStages * int(ph) : 0)) * kMaxRows;
#pragma unroll
          for (int i = 0; i < kMaxRows / 32; ++i) dst[lane + 32 * i] = Cfg::kBlock ? sc[i] * w_s : sc[i];
          dev::mbar_arrive(bar_at(sh.full, s));  // release: the stores above are seen by the stage's waiters
          ring.next(kStages);
        }
      }
    } else if (warp == 9) {
      // Per-tile tables, two tiles ahead of the consumers.
      const int op = p.op;
      int it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x, ++it) {
        const int b = it & 1;
        dev::mbar_wait(bar_at(sh.tab_empty, b), ((it >> 1) & 1) ^ 1);
        const TileInfo t = decode_tile<kMaxRows>(tile, tile_start, row_off, order, E);
        if (lane == 0) {
          sh.tab_info[b] = t;
          dev::mbar_arrive(bar_at(sh.info_full, b));
        }
        // All of a tile's loads issued before any is used (two round trips,
        // not one per 32 rows: a serial loop here made the consumers wait for
        // the table on short tiles).
        constexpr int kPer = (kMaxRows + 31) / 32;
        const bool rows_only = op == int(Fc2EpilogueOp::kRowsBf16);
        int tok[kPer];  // each row's slot, then its token
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int n = lane + 32 * i;
          tok[i] = n < t.rows && !rows_only ? __ldg(p.p2u + t.p0 + n) : 0;
        }
        float w[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int n = lane + 32 * i;
          w[i] = 0.f;
          if (n < t.rows) {
            const int j = tok[i] / p.T;
            tok[i] -= j * p.T;
            w[i] = rows_only || p.scales == nullptr ? 1.f : __ldg(p.scales + int64_t(tok[i]) * p.k + j);
          }
        }
        float bv[kTileH / 32];
#pragma unroll
        for (int i = 0; i < kTileH / 32; ++i) {
          const int col = t.hs * kTileH + lane + 32 * i;
          bv[i] = p.bias != nullptr && !rows_only && col < p.H ? __bfloat162float(p.bias[int64_t(t.e) * p.H + col])
                                                               : 0.f;
        }
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int n = lane + 32 * i;
          if (n < t.n) {
            const int pr = t.p0 + n;
            const int row = n >= t.rows ? -1
                            : rows_only || op == int(Fc2EpilogueOp::kRowsFp32Scaled) ? pr
                                                                                    : tok[i];
            sh.tab_row[b * kMaxRows + n] = row;
            sh.tab_w[b * kMaxRows + n] = w[i];
          }
        }
#pragma unroll
        for (int i = 0; i < kTileH / 32; ++i) sh.tab_bias[b * kTileH + lane + 32 * i] = bv[i];
        dev::mbar_arrive(bar_at(sh.tab_full, b));
      }
    }
  } else {
    dev::setmaxnreg_inc<kConsumerRegs>();
    const int total = tile_start[E];
    // Consumer warpgroups 0 and 1.
    const int wg = warp / 4;
    const prof::ConsumerLog log(sm + Cfg::kOffProf, wg);
    const bool bf16_out = p.op == int(Fc2EpilogueOp::kRedBf16) || p.op == int(Fc2EpilogueOp::kRowsBf16);
    int s = 0, it = 0;
    uint32_t ph = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x, ++it) {
      log.stamp_clock(it, 0);
      // The tile, from the table warp (up to two tiles ahead; its row table
      // is waited for before the epilogue).
      dev::mbar_wait(bar_at(sh.info_full, it & 1), (it >> 1) & 1);
      const TileInfo t = sh.tab_info[it & 1];
      log.stamp(it, 5, uint32_t(t.n));
      bool done = false;
      if constexpr (Cfg::kRowsMCapable) {
        if (p.block_rows_m) {
          if (bf16_out)
            consume_tile_block<Cfg, true>(p, sh, t, wg, ph, it, log);
          else
            consume_tile_block<Cfg, false>(p, sh, t, wg, ph, it, log);
          done = true;
        }
      }
      if (!done) {
        switch (t.n / kRowQuantum) {
#define FLASHMIX_FC2_ROWS_CASE(K) \
  case K:                                                                             \
    if constexpr (K * kRowQuantum <= kMaxRows) {                                      \
      if (bf16_out)                                                                   \
        consume_tile<Cfg, K * kRowQuantum, true>(p, sh, t, wg, s, ph, it, log);       \
      else                                                                            \
        consume_tile<Cfg, K * kRowQuantum, false>(p, sh, t, wg, s, ph, it, log);      \
    }                                                                                 \
    break;
          FLASHMIX_FC2_ROWS_CASE(1)
          FLASHMIX_FC2_ROWS_CASE(2)
          FLASHMIX_FC2_ROWS_CASE(3)
          FLASHMIX_FC2_ROWS_CASE(4)
          FLASHMIX_FC2_ROWS_CASE(5)
          FLASHMIX_FC2_ROWS_CASE(6)
          FLASHMIX_FC2_ROWS_CASE(7)
          FLASHMIX_FC2_ROWS_CASE(8)
          FLASHMIX_FC2_ROWS_CASE(9)
          FLASHMIX_FC2_ROWS_CASE(10)
          FLASHMIX_FC2_ROWS_CASE(11)
          FLASHMIX_FC2_ROWS_CASE(12)
          FLASHMIX_FC2_ROWS_CASE(13)
          FLASHMIX_FC2_ROWS_CASE(14)
          FLASHMIX_FC2_ROWS_CASE(15)
          FLASHMIX_FC2_ROWS_CASE(16)
          FLASHMIX_FC2_ROWS_CASE(17)
          default:
            break;
#undef FLASHMIX_FC2_ROWS_CASE
        }
      }
      log.stamp_clock(it, 4);
    }
    log.finish(it, wg);
  }
}

// W2 as a 3-D tensor (I, H, E): boxes of 64 x 128 x 1, so rows past H read as
// zeros; the permuted rows A as (I, capacity) in boxes of 64 x {128,64,32,16}.
bool encode_maps(const Sm90Fc2GemmParams& p, CUtensorMap& w, CUtensorMap (&a)[4]) {
  const detail::TensorMapEncodeTiled encode = detail::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint32_t elem[3] = {1, 1, 1};
  // e4m3 travels as bytes: boxes of 128 bytes of K either way.
  const bool fp8 = p.fp8 != MoeFp8Scaling::kNone;
  const cuuint64_t es = fp8 ? 1 : 2;
  const CUtensorMapDataType dtype = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint32_t box_k = cuuint32_t(kTileBytes / es);
  if (p.weights == MoeWeightFormat::kMxfp4) {
    // Packed bytes (I / 2 a row), boxes of 64 (W4A8) or 32 (W4A16) bytes x 128 rows, unswizzled.
    const cuuint64_t row = cuuint64_t(p.I) / 2;
    const cuuint64_t dims[3] = {row, cuuint64_t(p.H), cuuint64_t(p.E)};
    const cuuint64_t strides[2] = {row, cuuint64_t(p.H) * row};
    const cuuint32_t box[3] = {fp8 ? 64u : 32u, kTileH, 1};
    if (encode(&w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(p.W2), dims, strides, box, elem,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return false;
  } else {
    const cuuint64_t dims[3] = {cuuint64_t(p.I), cuuint64_t(p.H), cuuint64_t(p.E)};
    const cuuint64_t strides[2] = {cuuint64_t(p.I) * es, cuuint64_t(p.H) * p.I * es};
    const cuuint32_t box[3] = {box_k, kTileH, 1};
    if (encode(&w, dtype, 3, const_cast<void*>(p.W2), dims, strides, box, elem,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return false;
  }
  const cuuint64_t dims[2] = {cuuint64_t(p.I), cuuint64_t(std::max<int64_t>(1, int64_t(p.T) * p.k))};
  const cuuint64_t strides[1] = {cuuint64_t(p.I) * es};
  const cuuint32_t rows[4] = {128, 64, 32, 16};
  for (int i = 0; i < 4; ++i) {
    const cuuint32_t box[2] = {box_k, rows[i]};
    if (encode(&a[i], dtype, 2, const_cast<void*>(p.A), dims, strides, box, elem,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return false;
  }
  return true;
}

template <class Cfg>
Status launch_fp8(const Sm90Fc2GemmParams& p, const RowsGemmParams& k, const CUtensorMap& w,
                  const CUtensorMap (&a)[4], cudaStream_t stream) {
  const auto kernel = fc2_rows_gemm_kernel<Cfg>;
  int max_dynamic = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::prepare_kernel(detail::kernel_key(kernel), false, &max_dynamic),
                                         kOp, "kernel attributes"));
  FM_REQUIRE_SUPPORTED(Cfg::kSmemBytes <= max_dynamic, kOp, "device", "the rows kernel needs ", Cfg::kSmemBytes,
                       " bytes of shared memory per block; this device allows ", max_dynamic);
  kernel<<<p.sm_count, kThreads, Cfg::kSmemBytes, stream>>>(k, w, a[0], a[1], a[2], a[3]);
  prof::after_launch(stream, p.sm_count);
  return detail::check_launch(kOp);
}

}  // namespace

Status sm90_fc2_run_rows(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
  // The shapes it takes (E <= kMaxExpertsOp, T * k < 2^31) are checked where
  // the kernel is chosen (moe_fc2_dispatch.cpp). MXFP4 at decode: the kernel
  // that converts in registers (sm90_mx_decode.cu).
  if (p.weights == MoeWeightFormat::kMxfp4 && mx_decode_applies(p.T, p.k, p.E, p.H, p.I))
    return sm90_fc2_run_mx_decode(p, stream);
  CUtensorMap w, a[4];
  FM_REQUIRE_SUPPORTED(encode_maps(p, w, a), kOp, "A", "TMA descriptors could not be encoded");
  const int es = p.fp8 != MoeFp8Scaling::kNone ? 1 : 2;  // bytes an element of A and W2
  RowsGemmParams k{};
  static_cast<Fc2EpilogueParamsDevice&>(k) = fc2_epilogue_params(p);
  k.a_scales = p.a_scales;
  k.w_scales = p.w2_scales;
  k.w_mx_scales = p.w2_mx_scales;
  k.i_blocks = p.I / kScaleK;
  k.I = p.I;
  k.h_blocks = (p.H + kScaleK - 1) / kScaleK;
  k.E = p.E;
  k.h_slices = (p.H + kTileH - 1) / kTileH;
  k.k_blocks = (p.I * es + kTileBytes - 1) / kTileBytes;
  k.plain_k1 = p.op == Fc2EpilogueOp::kRedBf16 && p.k == 1 && !p.add_to_out;
  // Block scales, which way round (same-process A/Bs on H100s, two runs each,
  // bench/results/ab/fc2-fp8-rows-m-20261127/): token rows as wgmma's M
  // promote with one FFMA an element but pad a chunk to 64 rows a warpgroup;
  // W2 rows as M pad it to 16. Experts averaging 1024 rows (Mixtral): 1077 ->
  // 1032 us atomic, 1211 -> 1131 deterministic with token rows as M (with the
  // A scales staged in shared memory, on another H100: 1118 -> 996);
  // averaging 256 (DeepSeek-EP, Qwen3): 2-17 % slower. Token rows as M once
  // experts average more than 512 rows (T k / E_local, as FC1's rule).
  // FLASHMIX_FC2_FP8_ROWS_M=0|1 pins one (the A/B).
  static const int pinned_rows_m = [] {
    const char* e = std::getenv("FLASHMIX_FC2_FP8_ROWS_M");
    return e ? (std::atoi(e) != 0 ? 1 : 0) : -1;
  }();
  k.block_rows_m = pinned_rows_m >= 0 ? pinned_rows_m == 1 : int64_t(p.T) * p.k > int64_t(512) * p.E;

  // FP8: block scales in tiles of up to 128 rows (two accumulators), per
  // tensor up to 256 (one wgmma a k32 step).
  if (p.weights == MoeWeightFormat::kMxfp4) {
    // Decode (experts averaging at most 32 rows): 32-row tiles with a deep
    // ring of small stages (see RowsCfg); else 128 (W4A8) or 256 rows.
    using Mx16 = RowsCfg<kWgmmaMaxN, Fc2In::kMxfp4Bf16>;
    const bool rows32 = int64_t(p.T) * p.k <= int64_t(32) * p.E;
    if (p.fp8 == MoeFp8Scaling::kBlock)
      return rows32 ? launch_fp8<RowsCfg<32, Fc2In::kMxfp4Fp8>>(p, k, w, a, stream)
                    : launch_fp8<RowsCfg<128, Fc2In::kMxfp4Fp8>>(p, k, w, a, stream);
    if (rows32) return launch_fp8<RowsCfg<32, Fc2In::kMxfp4Bf16>>(p, k, w, a, stream);
    return p.E <= Mx16::kMaxExperts ? launch_fp8<Mx16>(p, k, w, a, stream)
                                    : launch_fp8<RowsCfg<128, Fc2In::kMxfp4Bf16>>(p, k, w, a, stream);
  }
  if (p.fp8 == MoeFp8Scaling::kBlock) {
    // Decode (decode_sized, W2 rows as M): 32-row tiles,
    // whose 20 KB stages keep 8 x 16 KB of W2 in flight (4 x 16 KB with
    // 128-row tiles). FLASHMIX_FC2_ROWS=32|128 pins either.
    static const int pinned_rows = [] {
      const char* e = std::getenv("FLASHMIX_FC2_ROWS");
      return e ? std::atoi(e) : 0;
    }();
    const bool decode = !k.block_rows_m && (pinned_rows ? pinned_rows == 32 : decode_sized(p.T, p.k, p.E));
    return decode ? launch_fp8<RowsCfg<32, Fc2In::kFp8Block>>(p, k, w, a, stream)
                  : launch_fp8<RowsCfg<128, Fc2In::kFp8Block>>(p, k, w, a, stream);
  }
  if (p.fp8 == MoeFp8Scaling::kTensor)
    return launch_fp8<RowsCfg<kWgmmaMaxN, Fc2In::kFp8Tensor>>(p, k, w, a, stream);

  // Tiles of up to 272 rows where the experts' tables fit beside their stages.
  const bool wide = p.E <= RowsCfg<kWideRows>::kMaxExperts;
  const auto kernel = wide ? fc2_rows_gemm_kernel<RowsCfg<kWideRows>> : fc2_rows_gemm_kernel<RowsCfg<kWgmmaMaxN>>;
  const int smem = wide ? RowsCfg<kWideRows>::kSmemBytes : RowsCfg<kWgmmaMaxN>::kSmemBytes;
  int max_dynamic = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::prepare_kernel(detail::kernel_key(kernel), false, &max_dynamic),
                                         kOp, "kernel attributes"));
  FM_REQUIRE_SUPPORTED(smem <= max_dynamic, kOp, "device", "the rows kernel needs ", smem,
                       " bytes of shared memory per block; this device allows ", max_dynamic);
  kernel<<<p.sm_count, kThreads, smem, stream>>>(k, w, a[0], a[1], a[2], a[3]);
  prof::after_launch(stream, p.sm_count);  // profiling build: prints the launch FLASHMIX_FC2_PROFILE_LAUNCH names
  return detail::check_launch(kOp);
}

}  // namespace flashmix
