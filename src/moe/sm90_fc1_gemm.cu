// FC1 grouped GEMM on sm_90a (TMA + wgmma + cp.async, no CUTLASS): spec §9,
// for every local permuted row p of expert e (t = p2u[p] % T),
//   out[p, i] = bf16(act(X[t] . W1[e, gate i] + b_g, X[t] . W1[e, up i] + b_u))
//
// Tiles and schedule: sm90_expert_tiles.cuh (shared with FC2): a tile is 64
// output columns i (128 W1 rows: their 64 gate and 64 up rows) x all rows of
// one expert (up to 256; larger experts in equal chunks), the wgmma N sized
// per tile. The product is computed transposed, D^T[w1 row, row] = W1[e]
// (M = 128, K = H contiguous) x X_rows^T (N = rows, K contiguous).
//
// Gate and up meet in one thread: the W1 tile lands in shared memory as 8
// blocks of 16 rows, each 8 gate rows then the 8 matching up rows (one 5-D
// TMA box: (K 64, row 8, gate/up 2, block 8, expert 1), the strides chosen by
// the layout, so both W1 layouts give the same tile). wgmma m64's thread
// holds accumulator rows r and r + 8 of its warp's 16: the gate and the up of
// one output column i, for the same token columns. The activation runs on the
// fp32 accumulators (+ bias) and rounds once.
//
// The gather: the rows operand is read from X [T, H] in token order through
// p2u by cp.async (16 bytes a thread, zero-filled past the chunk's rows and
// past H), written in TMA's 128-byte swizzle, so no permuted copy of X
// exists. Hopper's TMA has no row gather (one box per 128-byte row would be
// 256 TMA issues a stage); four loader warps take 4 rows x 128 bytes per
// instruction instead.
//
// CTA: 12 warps, persistent (one CTA per SM). Warps 8-11 load: lane 0 of warp
// 8 issues W1's TMA box, all 128 threads the rows' cp.asyncs, into a ring of
// 4 stages (tiles of up to 256 rows, or wide tiles) or 6 (up to 128
// rows; Fc1Cfg) (a stage completes on its mbarrier: the TMA bytes plus one
// noinc arrival per loader thread); warps 0-7, two consumer warpgroups, each run
// wgmma m64nNk16 on 64 of the tile's 128 W1 rows (= 32 output columns), then
// the epilogue: act through shared memory (64 rows a pass, transposed so a
// thread stores 16 consecutive bytes of one output row). setmaxnreg moves
// the loaders' registers to the consumers.
//
// The gather in bf16 takes wide tiles (Fc1Cfg<128, kBf16, false, true>, the
// block-FP8 wide tile's stage and orientation below, without promotion): a
// gathered row then feeds 256 W1 rows instead of 128.
//
// Status (H100, bench/results, docs/moe_fc1.md): correct on every tested
// shape; decode streams the used experts' W1 at ~1.0 of copy bandwidth. The
// compute-bound shapes run at 1.6-1.75x a dense cuBLAS GEMM of equal FLOPs
// with the gather (wide tiles; 2.25-2.9x transposed) and 1.2-1.65x from a
// permuted X (TMA row boxes; the issue's bounds: 1.10-1.40x). The gather's
// cp.async row loads are the bound of the transposed tile: the consumers
// wait on their stages (ncu: tensor pipe 28 % busy), and the same rows by
// TMA boxes, the 5-D weight box replaced, or the proxy fence removed showed
// it is the cp.async path alone (~10 bytes a clock an SM in flight).
//
// FP8 (spec §9.7; Fc1In): the same stages hold 128 e4m3 a row instead of 64
// bf16 (W1 and a permuted X travel as bytes), the MMAs are m64nNk32 e4m3.
// Block scales: the tile turns around (consume_tile_rows_m): the token rows
// are wgmma's M (64 a warpgroup), the 128 W1 rows its N, so a thread's
// accumulator rows are two tokens and each K block's partial sum is promoted
// into fp32 by one FFMA an element; the loaders store each stage's X scales
// beside its rows and the tile's W1 scales sit in shared memory, so the K
// loop reads no global memory (docs/moe_fc1.md). Per-tensor scales: the bf16
// mainloop, one multiply at the end. Block scales with experts of 256 rows
// and more take wide tiles (Fc1Cfg::kWide: 256 W1 rows a stage, the two
// slices' MMAs one after the other through one partial); their K loop is
// written for few instructions (warp-uniform stage index and descriptors,
// rows_m_mainloop). Status (H100, docs/moe_fc1.md): per-tensor from a
// permuted X 1.3-1.7x a dense FP8 GEMM; block scales 1.6-1.85x from a
// permuted X, 2.1-2.3x gathering (the transposed tile with the X scales
// copied into the stages by the loaders ran 3.4-5.3x); the consumers are
// issue- and latency-bound (ncu), not fed too slowly.
//
// MXFP4 W1 (spec §13.7; Fc1In::kMxfp4Fp8 / kMxfp4Bf16): the stages hold the
// packed bytes as TMA brings them (64 or 32 bytes a row, unswizzled) and
// the consumers convert them one stage ahead (sm90_mx_mainloop.cuh, shared
// with FC2). Status (H100): prefill within 1.15x the FP8 layer; decode
// bound by the 64-byte-row ring and the conversion's issue latency
// (docs/mxfp4.md §4.7).
//
// Roofline: 2 * P * 2I * H FLOPs; W1 (E * 2I * H bf16) and X's rows read,
// out (P * I bf16) written. The Mixtral-like case (P = 8192, H = 4096,
// I = 14336) is 1.9 TFLOP: compute bound; decode (P = 128 over 32 experts) is
// bound by reading the used experts' W1 at copy bandwidth.
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/red.cuh"
#include "common/sm90.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/tma_host.h"
#include "moe/fc1_activation.cuh"
#include "moe/sm90_expert_tiles.cuh"
#include "fp8/quantize_fp8_device.cuh"
#include "moe/sm90_fc1_gemm.h"
#include "moe/sm90_mx_decode.h"
#include "moe/sm90_mx_mainloop.cuh"

namespace flashmix {

namespace {

using namespace expert_tiles;

constexpr const char* kOp = "moe_fc1";

constexpr int kSliceW = 128;             // W1 rows a slice: 64 gate + 64 up (a narrow tile)
constexpr int kSliceOut = kSliceW / 2;  // output columns a slice
constexpr int kTileBytes = 128;       // K per stage: one 128-byte swizzled row (64 bf16, 128 e4m3)
constexpr int kScaleK = 128;          // FP8 block scales: K per block (spec §11)
// Epilogue staging per consumer warpgroup: its 32 output columns x 64 rows a
// pass, 40 bf16 (80 bytes) a row: a warp's scalar stores (4 rows x 8
// columns) fall in distinct banks.
constexpr int kEpiRows = 64;
constexpr int kEpiStride = 40;
constexpr int kEpiBytes = kEpiRows * kEpiStride * 2;
constexpr int kSmemLimit = 232448;

// What X and W1 hold (MoeFp8Scaling and MoeWeightFormat, resolved at the
// launch into the kernel's template): bf16, or e4m3 with block scales (the K
// sum promoted into fp32 every 128 of K) or per-tensor scales (applied once
// at the end); or MXFP4 W1 (packed e2m1 + ue8m0 scales, spec §13.7) that the
// consumers convert in shared memory, with e4m3 X and block scales (W4A8:
// promoted every 128 of K with each W1 row's group scale) or bf16 X (W4A16).
enum class Fc1In { kBf16, kFp8Block, kFp8Tensor, kMxfp4Fp8, kMxfp4Bf16 };

constexpr int kThreads = 384;  // warps 0-7 consumers, 8-11 loaders
constexpr int kLoaders = 128;

// The ring for tiles of up to kMaxRows_ rows: as many stages as fit beside
// the epilogue staging, the experts' tables and the barriers. 256 rows: 4
// stages of 48 KB; 128 rows: 6 of 32 KB (more bytes in flight, W1 slices
// read twice for experts of 129-256 rows, the second time from L2); wide
// tiles (128 rows, 256 W1 rows): 4 of 48 KB. With W4A8 and block
// FP8 a stage also holds the rows' X scales of its K block.
//
// MXFP4 W1: a stage holds the tile's packed rows as TMA writes them (128
// rows x 64 bytes for W4A8's 128 of K, x 32 bytes for W4A16's 64, no
// swizzle); each consumer warpgroup converts its 64 rows one stage ahead into
// one of its two converted tiles (64 rows x 128 bytes, 128-byte swizzle: the
// layout the wgmma reads), so the conversion overlaps the previous stage's
// MMAs.
//
// Wide tiles (kWide_; block-scaled FP8, and bf16 when gathering): a stage
// holds 256 W1 rows (128 output columns, two slices side by side) against
// the 128 token rows (the token rows as wgmma's M), so a byte brought from
// L2 feeds 1.37x the MMAs of the 128-row tile and a gathered row feeds 256
// W1 rows. Block FP8: each consumer warpgroup runs the two slices' MMAs one
// after the other into one 64-register partial (rows_m_mainloop); bf16: both
// slices' MMAs straight into the accumulators (rows_m_mainloop_bf16).
template <int kMaxRows_, Fc1In kIn_ = Fc1In::kBf16, bool kFp8Out_ = false, bool kWide_ = false>
struct Fc1Cfg {
  static constexpr int kMaxRows = kMaxRows_;
  static constexpr Fc1In kIn = kIn_;
  // Block-scaled FP8 and wide bf16 tiles take the token rows as wgmma's M
  // (consume_tile_rows_m); every other input the transposed tile.
  static constexpr bool kWide = kWide_;
  // W4A8 on wide tiles (kMxWide; docs/mxfp4.md §4.13): the consumer warps
  // convert each stage's packed W1 rows into e4m3 with one exponent per
  // 128 x 128 block (§13.3's group), each thread one row of the next K block
  // while the current one's first MMAs run, and run the block-FP8 wide
  // tile's K loop on the result; the loaders stage the rows' scale words and
  // the blocks' largest scales beside the X scales.
  static constexpr bool kMxWide = kIn_ == Fc1In::kMxfp4Fp8 && kWide_;
  static constexpr bool kRowsM = kIn == Fc1In::kFp8Block || (kIn == Fc1In::kBf16 && kWide) || kMxWide;
  static_assert(!kWide || kRowsM, "wide tiles take the token rows as M (block FP8 or bf16)");
  static constexpr bool kFp8Out = kFp8Out_;
  static constexpr int kTileW = kWide ? 2 * kSliceW : kSliceW;  // W1 rows a stage
  // Slices a tile covers: two with the FP8 output (spec §9.8; block scales
  // only: one 1 x 128 scale block of output columns) or wide tiles.
  static constexpr int kSlicesPerTile = kFp8Out_ || kWide ? 2 : 1;
  // Narrow tiles with the FP8 output run their two slices one after the
  // other (kPair); wide tiles hold both in one stage. Its own
  // instantiation, so the bf16-output kernels compile as they did without it.
  static constexpr int kPair = kFp8Out && !kWide ? 2 : 1;
  static_assert(!kFp8Out || kRowsM, "the FP8 output needs block scales (token rows as M)");
  // setmaxnreg (128 loaders x kLoaderRegs + 256 x kConsumerRegs <= 168 x
  // 384, what the CTA holds at launch): wide tiles' loaders need 64 with the
  // X scales' stores (56 spilled); their consumers fit 216 once the X scales
  // come with the stage.
  // kMxWide: 56 / 224 (the consumers hold 192 sums and convert; the
  // loaders' work an item is on the consumers' path: at 40 / 232, 76 bytes
  // of loader spill, FC1 took 301 us against 261, docs/mxfp4.md §4.13).
  static constexpr int kLoaderRegs = kMxWide ? 56 : kWide ? 64 : 72, kConsumerRegs = kMxWide ? 224 : 216;
  static constexpr bool kMx = kIn == Fc1In::kMxfp4Fp8 || kIn == Fc1In::kMxfp4Bf16;
  static constexpr bool kFp8 = kIn == Fc1In::kFp8Block || kIn == Fc1In::kFp8Tensor || kIn == Fc1In::kMxfp4Fp8;
  // X scales per row and K block, promoted every stage.
  static constexpr bool kXBlock = kIn == Fc1In::kFp8Block || kIn == Fc1In::kMxfp4Fp8;
  static constexpr int kTileK = kFp8 ? 128 : 64;  // elements of K a stage
  static constexpr int kWRowBytes = kMx ? kTileK / 2 : kTileBytes;  // bytes of a W1 row a stage
  static constexpr int kWCoordK = kMx ? kWRowBytes : kTileK;         // W1's TMA coordinate step a stage
  static constexpr int kWStage = kTileW * kWRowBytes;  // W1's bytes a stage
  static constexpr int kStageBytes = kWStage + kMaxRows * kTileBytes;
  static constexpr bool kStageScales = kXBlock;  // the loaders copy the X scales (W4A8, block FP8)
  static constexpr int kScaleBytes = kStageScales ? kMaxRows * 4 : 0;  // a stage's X scales
  // load_tiles' plain arrivals for the scale stores of a gathered X (a
  // permuted X's loaders arrive anyway): W4A8, each scale thread's own (what
  // racecheck credits); block FP8, one a loader warp after __syncwarp.
  static constexpr int kScaleArrivals = !kStageScales ? 0 : kRowsM ? kLoaders / 32 : kMaxRows;
  // The consumers' releases a stage: every thread where the transposed
  // tile's mainloop reads the staged X scales (W4A8: dev::release_stage),
  // else one a warp (block FP8 too: rows_m_mainloop says why).
  static constexpr int kEmptyArrivals = kStageScales && !kRowsM ? 256 : 8;
  static constexpr int kCvtTile = mx_mainloop::kCvtTile;          // a warpgroup's converted 64 rows
  // Converted W1: two per consumer warpgroup (transposed W4A8 tiles), or
  // two whole stages' 256 rows (kMxWide).
  static constexpr int kCvtBytes = kMxWide ? 2 * kTileW * kTileBytes : kMx ? 2 * 2 * kCvtTile : 0;
  static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned (128-byte swizzle)");
  static constexpr int kFixed =
      2 * kEpiBytes + kCvtBytes + 2 * (kFc1MaxExperts + 1) * 4 + kFc1MaxExperts * 2 + 8 + 1024 + (kMxWide ? 4 * 8 : 0);
  // kMxWide: a stage's 256 scale words and the two blocks' largest scales
  // (+ 1), kWordsStride words apart.
  static constexpr int kWordsStride = kTileW + 4;
  static constexpr int kWordsBytes = kMxWide ? kWordsStride * 4 : 0;
  static constexpr int kFit = (kSmemLimit - kFixed - 16 * 8) / (kStageBytes + kScaleBytes + kWordsBytes);
  // MXFP4's stages are small (8 or 4 KB of weights): up to 16 of them, so
  // decode keeps enough weight bytes in flight (tiles of 32 rows: 14 stages).
  static constexpr int kMaxStages = kMx ? 16 : 8;
  static constexpr int kStages = kFit > kMaxStages ? kMaxStages : kFit;
  static constexpr int kOffCvt = kStages * kStageBytes;
  static constexpr int kOffEpi = kOffCvt + kCvtBytes;
  static constexpr int kOffScales = kOffEpi + 2 * kEpiBytes;
  static constexpr int kOffWords = kOffScales + kStages * kScaleBytes;
  static constexpr int kOffRowOff = kOffWords + kStages * kWordsBytes;
  static constexpr int kOffTileStart = kOffRowOff + (kFc1MaxExperts + 1) * 4;
  static constexpr int kOffOrder = kOffTileStart + (kFc1MaxExperts + 1) * 4;  // uint16 [E]
  static constexpr int kOffBars = (kOffOrder + kFc1MaxExperts * 2 + 7) / 8 * 8;
  // kMxWide: the converted stages' full and empty barriers after the ring's.
  static constexpr int kSmemBytes = kOffBars + 2 * kStages * 8 + (kMxWide ? 4 * 8 : 0) + 1024;  // + alignment slack
  static_assert(kStages >= 4 && kSmemBytes <= kSmemLimit, "shared memory");
  // Block scales promote a K block's sum into a second fp32 accumulator:
  // 2 x N / 2 registers a thread, so tiles of at most 128 rows.
  static_assert(!kXBlock || kMaxRows <= 128, "block-scaled tiles hold at most 128 rows");
};

// The 128-row MMAs (slices) of a stage: 2 for wide tiles, else 1. (A
// variable template: as a member of every Fc1Cfg it drew nvcc's unused
// warning where only the rows_m path reads it.)
template <class Cfg>
constexpr int kHalves = Cfg::kTileW / kSliceW;

struct Fc1KernelParams {
  const uint8_t* X;     // bf16 or e4m3 rows
  int64_t x_row_bytes;  // bytes between X's rows
  int h_bytes;          // bytes of a row's H elements
  const int32_t* p2u;
  const int64_t* offsets;
  const __nv_bfloat16* bias;
  const float* x_scales;   // FP8: [X rows, H / 128] (block) or [1]
  const float* w_scales;   // FP8: [E, ceil(2I / 128), H / 128] (block) or [E]
  const uint8_t* w_mx_scales;  // MXFP4: ue8m0 [E, 2I, H / 32]
  __nv_bfloat16* out;
  int T, H, I, E;
  int slices, k_blocks;  // slices: the tiles over I (pairs of W1 slices with the FP8 output or wide tiles)
  int w_row_blocks;  // ceil(2I / 128)
  int act;  // MoeActivation
  float limit, alpha;
  bool x_permuted;   // X holds the permuted rows: loaded by TMA boxes, not gathered
  bool interleaved;  // bias and scale order (the weights' order is in the tensor map)
  // Last, so the fields above keep the offsets the kernels without the FP8
  // output were tuned with (moving them measurably slowed the gathered path).
  void* out_scales;  // FP8 output (spec §9.8): out holds e4m3 codes; null: bf16 rows
  bool out_ue8m0;
};

__device__ __forceinline__ uint32_t bar_at(uint32_t first, int i) { return first + 8 * i; }

// act(g, u) in fp32 (fc1_activation.cuh).
__device__ __forceinline__ float activate(const Fc1KernelParams& p, float g, float u) {
  return fc1_activate(p.act, p.limit, p.alpha, g, u);
}

// X's row of tile row r: the permuted row itself (a permuted X) or its token.
__device__ __forceinline__ int x_row(const Fc1KernelParams& p, const TileInfo& t, int r) {
  return p.x_permuted ? t.p0 + r : __ldg(p.p2u + t.p0 + r) % p.T;
}

// Tile row rs's X scale into stage s's scale slot (Cfg::kStageScales).
template <class Cfg>
__device__ __forceinline__ void store_stage_scale(uint32_t scales, int s, int rs, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scales + uint32_t(s * Cfg::kMaxRows + rs) * 4), "f"(v) : "memory");
}

// A stage from a permuted X (thread 0 of the loaders): the W1 box and the
// tile's token rows by TMA boxes of 64 / 16 rows, the byte count expected
// on the stage's full barrier first.
template <class Cfg>
__device__ __forceinline__ void issue_permuted_stage(uint32_t st, uint32_t full, const CUtensorMap* map_w,
                                                     const CUtensorMap* map_x64, const CUtensorMap* map_x16,
                                                     int kb, int hs, const TileInfo& t) {
  dev::mbar_arrive_expect_tx(full, Cfg::kWStage + uint32_t(t.n) * kTileBytes);
  dev::tma_load_5d(st, map_w, full, kb * Cfg::kWCoordK, 0, 0, hs * (Cfg::kTileW / 16), t.e);
  int r = 0;
  for (; r + 64 <= t.n; r += 64)
    dev::tma_load_2d(st + Cfg::kWStage + r * kTileBytes, map_x64, full, kb * Cfg::kTileK, t.p0 + r);
  for (; r < t.n; r += 16)
    dev::tma_load_2d(st + Cfg::kWStage + r * kTileBytes, map_x16, full, kb * Cfg::kTileK, t.p0 + r);
}

// The loader warps: W1's box by TMA (one thread), the tile's rows by cp.async
// (all 128: thread l takes 16-byte chunk l % 8 of rows l / 8 + 16 i) or, from
// a permuted X (consecutive rows), by TMA boxes of 64 / 16 rows. W4A8 and
// block FP8 (Cfg::kStageScales): thread (r0, q) also stores the X scale of
// the K block of row r0 + 16 q into the stage's scale slot, loaded before
// the wait for the stage and stored after the stage's copies are issued (by
// 4-byte cp.asyncs counted on the stage's barrier they made the
// block-scaled FP8 tile ~1.5x slower); a plain arrival on the full barrier
// releases the stores: every loader's own (a permuted X), and for a
// gathered X each scale thread's (W4A8) or one a warp after __syncwarp
// (block FP8; kScaleArrivals).
template <class Cfg>
__device__ __forceinline__ void load_tiles(const Fc1KernelParams& p, const CUtensorMap* map_w,
                                           const CUtensorMap* map_x64, const CUtensorMap* map_x16, uint32_t stages,
                                           uint32_t scales, uint32_t full0, uint32_t empty0, const int* tile_start,
                                           const int* row_off, const uint16_t* order) {
  constexpr bool kBlock = Cfg::kStageScales;  // the loaders copy the X scales
  const int l = threadIdx.x - 256;
  const int r0 = l >> 3, q = l & 7;
  const uint32_t swz = uint32_t((q ^ (r0 & 7)) << 4);  // 128-byte swizzle: (r0 + 16 i) % 8 == r0 % 8
  const int s_blocks = p.H / kScaleK;                  // X scales a row (block scales)
  const int rs = r0 + 16 * q;                          // the row whose X scale this thread stores
  const bool scale_thread = kBlock && q < Cfg::kMaxRows / 16;
  if (l == 0) dev::prefetch_tensor_map(map_w);
  const int total = tile_start[p.E];
  int s = 0;
  uint32_t ph = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const TileInfo t = decode_tile<Cfg::kMaxRows>(tile, tile_start, row_off, order, p.E);
    int src[Cfg::kMaxRows / 16];  // each of this thread's rows: its X row, -1 past the chunk
#pragma unroll
    for (int i = 0; i < Cfg::kMaxRows / 16; ++i) {
      const int r = r0 + 16 * i;
      src[i] = -1;
      if (r < t.rows) src[i] = x_row(p, t, r);
    }
    // W4A8: row rs's X scales (its X row; 0 past the chunk's rows).
    const float* srow = nullptr;
    if (scale_thread && rs < t.rows)
      srow = p.x_scales + int64_t(x_row(p, t, rs)) * s_blocks;
    // Narrow tiles with the FP8 output are two slices, K blocks of the first
    // then of the second (consume_tile_rows_m); else one box a stage.
    constexpr int pair = Cfg::kPair;
    for (int sub = 0; sub < pair; ++sub) {
      const int hs = t.hs * pair + sub;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        const float sv = srow != nullptr ? __ldg(srow + kb) : 0.f;
        dev::mbar_wait(bar_at(empty0, s), ph ^ 1);
        const uint32_t full = bar_at(full0, s);
        const uint32_t st = stages + uint32_t(s) * Cfg::kStageBytes;
        if (p.x_permuted) {
          if (l == 0) issue_permuted_stage<Cfg>(st, full, map_w, map_x64, map_x16, kb, hs, t);
          // The scale after the copies are issued (its load's latency off
          // the TMA's path); every loader's arrival releases it.
          if (scale_thread && rs < t.n) store_stage_scale<Cfg>(scales, s, rs, sv);
          dev::mbar_arrive(full);  // every loader thread, as the gather's count expects
        } else {
          if (l == 0) {
            dev::mbar_arrive_expect_tx(full, Cfg::kWStage);
            dev::tma_load_5d(st, map_w, full, kb * Cfg::kWCoordK, 0, 0, hs * (Cfg::kTileW / 16), t.e);
          }
          const int kbyte = kb * kTileBytes + 16 * q;
          const bool k_in = kbyte < p.h_bytes;
#pragma unroll
          for (int i = 0; i < Cfg::kMaxRows / 16; ++i) {
            const int r = r0 + 16 * i;
            if (r < t.n) {
              const bool live = src[i] >= 0 && k_in;
              const uint8_t* g = live ? p.X + int64_t(src[i]) * p.x_row_bytes + kbyte : p.X;
              dev::cp_async_16(st + Cfg::kWStage + uint32_t(r) * kTileBytes + swz, g, live ? 16 : 0);
            }
          }
          // The scale after the cp.asyncs, released by a plain arrival (the
          // cp.async arrival orders only the copies): one a warp for block
          // FP8, each scale thread's for W4A8 (kScaleArrivals).
          if constexpr (kBlock) {
            if (scale_thread && rs < t.n) store_stage_scale<Cfg>(scales, s, rs, sv);
            if constexpr (Cfg::kRowsM) {
              __syncwarp();
              if ((l & 31) == 0) dev::mbar_arrive(full);
            } else if (scale_thread) {
              dev::mbar_arrive(full);
            }
          }
          dev::cp_async_mbar_arrive_noinc(full);
        }
        if (++s == Cfg::kStages) {
          s = 0;
          ph ^= 1;
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---------------------------------------------------------------------------
// W4A8 on wide tiles (Cfg::kMxWide; docs/mxfp4.md §4.13). The loader
// warpgroup (warps 8-11) fills the ring as load_tiles does for a permuted X
// (thread 0 the TMA boxes: the stage's 256 packed W1 rows, 64 bytes each,
// unswizzled, then the token rows; thread l row l's X scale) and stages each
// row's scale word beside it. The consumers convert each stage's packed rows
// into one of two converted stages (256 rows x 128 e4m3 bytes, 128-byte
// swizzle, the rows in the stage's order: what the block-FP8 wide tile's
// wgmma reads as B), with one exponent per 128 x 128 block (§13.3's group:
// the gate rows of a wide tile are one 128-row block, its up rows another,
// for I % 128 == 0 and W1 gate rows then up rows), and run the block-FP8 K
// loop unchanged, with 2^E_G as the block's W1 scale. The values are then
// `mxfp4_to_fp8_block`'s (k128x128) bit for bit, and so is the result of
// the block-FP8 FC1 on that conversion.

// The largest finite scale byte of a word's four, plus one (0: none finite).
__device__ __forceinline__ int top_finite_plus1(uint32_t w) {
  int t = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int b = int((w >> (8 * i)) & 0xffu);
    if (b != int(kUe8m0NaN)) t = max(t, b + 1);
  }
  return t;
}

// One sub-block (16 packed bytes of stage row rr at raw) converted into
// the two 16-byte chunks of converted row rr at dst (128-byte swizzle). A
// warp's 32 rows: its stores, chunk (2 sub + h) ^ (rr % 8), fall in 8
// distinct bank groups; its loads, 64 bytes a row apart, in 2.
__device__ __forceinline__ void store_converted(uint32_t dst, int rr, int sub, const uint32_t (&o)[8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t q = uint32_t(((2 * sub + h) ^ (rr & 7)) << 4);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + uint32_t(rr) * kTileBytes + q),
                 "r"(o[4 * h]), "r"(o[4 * h + 1]), "r"(o[4 * h + 2]), "r"(o[4 * h + 3])
                 : "memory");
  }
}
__device__ __forceinline__ void load_packed(uint32_t raw, int rr, int sub, uint32_t (&w)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(raw + uint32_t(rr * 64 + 16 * sub)));
}
// The exact path, out of line (inlined, its code for every sub-block cost
// instruction fetch stalls; the table's path inline in convert_rows_mx).
__device__ __noinline__ void convert_piece_exact(uint32_t raw, uint32_t dst, int rr, int sub, int s, int ge) {
  uint32_t w[4], o[8];
  load_packed(raw, rr, sub, w);
  mx_subblock_to_e4m3(w, s, ge, o);
  store_converted(dst, rr, sub, o);
}

// The largest byte of four words (255 where any holds the NaN scale):
// even and odd bytes as 16-bit lanes through __vmaxu2 (one max.u16x2 on
// sm_90; sm90_mx_decode.cu's top_byte, one word at a time).
__device__ __forceinline__ int max_byte4(const uint32_t (&w)[4]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) m = __vmaxu2(__vmaxu2(m, w[i] & 0x00ff00ffu), (w[i] >> 8) & 0x00ff00ffu);
  return int(max(m & 0xffffu, m >> 16));
}

// E_G of a block (spec §13.2) from its largest finite scale byte + 1 (0:
// none finite, E_G = 0).
__device__ __forceinline__ int block_group_exp(int top_plus1) {
  return top_plus1 == 0 ? 0 : top_plus1 - 1 - 127 - kMxfp4Fp8TopShift;
}

// A block's largest finite scale (+ 1; 0: none finite) for a whole warp,
// whose lanes hold the words of rows lane + 32 i: bytewise maxima, then one
// redux. A NaN byte (255) would win the bytewise maximum: where the warp
// sees one (rare), each word's finite bytes are taken one by one instead.
__device__ __forceinline__ int block_top(const uint32_t (&w)[4]) {
  int t = max_byte4(w);
  if (__any_sync(0xffffffffu, t == int(kUe8m0NaN))) {
    t = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) t = max(t, top_finite_plus1(w[i]));
  } else {
    ++t;
  }
  return int(__reduce_max_sync(0xffffffffu, uint32_t(t)));
}

// Cfg::kMxWide's loaders: the ring as load_tiles fills it for a permuted X
// (thread 0 the TMA boxes: 256 packed W1 rows and the token rows; thread l
// row l's X scale), and beside each stage the scale words of its 256 rows
// (thread l: stage rows l and l + 128) and, from warps 0 and 1, the two blocks'
// largest finite scales (+ 1; 0: none), which the converting consumers
// read after the stage's full barrier. Every global load of an item is
// issued before the wait for its stage.
template <class Cfg>
__device__ __forceinline__ void load_tiles_mx_wide(const Fc1KernelParams& p, const CUtensorMap* map_w,
                                                 const CUtensorMap* map_x64, const CUtensorMap* map_x16,
                                                 uint32_t stages, uint32_t scales, uint32_t* words, uint32_t full0,
                                                 uint32_t empty0, const int* tile_start, const int* row_off,
                                                 const uint16_t* order) {
  const int l = threadIdx.x - 256, lane = l & 31;
  const int kbs = p.H / kScaleK;
  const int gu = (l >> 3) & 1;
  const uint32_t* mx_sc = reinterpret_cast<const uint32_t*>(p.w_mx_scales);
  const int total = tile_start[p.E];
  if (l == 0) dev::prefetch_tensor_map(map_w);
  int s = 0;
  uint32_t ph = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const TileInfo t = decode_tile<Cfg::kMaxRows>(tile, tile_start, row_off, order, p.E);
    const int64_t gate0 = int64_t(t.e) * 2 * p.I + 128 * t.hs;
    const uint32_t* own = mx_sc + (gate0 + (gu ? p.I : 0) + 8 * (l >> 4) + (l & 7)) * kbs;
    const uint32_t* blk = mx_sc + (gate0 + lane) * kbs;  // warps 0 / 1: rows lane + 32 i of the gate / up block
    const float* srow = l < t.rows ? p.x_scales + int64_t(t.p0 + l) * kbs : nullptr;
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const float sv = srow != nullptr ? __ldg(srow + kb) : 0.f;
      const uint32_t w0 = __ldg(own + kb), w1 = __ldg(own + 64 * int64_t(kbs) + kb);
      uint32_t bw[4];  // warp 0: the gate block's words, warp 1: the up block's
      if (l < 64) {
#pragma unroll
        for (int i = 0; i < 4; ++i) bw[i] = __ldg(blk + ((l >= 32 ? p.I : 0) + 32 * i) * int64_t(kbs) + kb);
      }
      dev::mbar_wait(bar_at(empty0, s), ph ^ 1);
      const uint32_t full = bar_at(full0, s);
      const uint32_t st = stages + uint32_t(s) * Cfg::kStageBytes;
      if (l == 0) issue_permuted_stage<Cfg>(st, full, map_w, map_x64, map_x16, kb, t.hs, t);
      if (l < t.n) store_stage_scale<Cfg>(scales, s, l, sv);
      uint32_t* sw = words + s * Cfg::kWordsStride;
      sw[l] = w0;
      sw[l + 128] = w1;
      if (l < 64) {  // the blocks' largest finite scales: warp 0 the gate's, warp 1 the up's
        const int top = block_top(bw);
        if (lane == 0) sw[Cfg::kTileW + (l >> 5)] = uint32_t(top);
      }
      dev::mbar_arrive(full);  // every loader thread, after its stores (the barrier counts kLoaders + 1)
      if (++s == Cfg::kStages) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

// This thread's W1 rows (the gate and the up of output column i; spec §9.2).
struct GateUpRows {
  int gate, up;
};
__device__ __forceinline__ GateUpRows gate_up_rows(const Fc1KernelParams& p, int i) {
  return p.interleaved ? GateUpRows{2 * i, 2 * i + 1} : GateUpRows{i, p.I + i};
}

// ---------------------------------------------------------------------------
// MXFP4 W1 (Fc1In::kMxfp4Fp8 / kMxfp4Bf16; spec §13.7, docs/mxfp4.md §4).

// The W1 row of tile row j (0..127) of slice hs: the tile is 8 blocks of 16
// rows, each 8 gate rows then their 8 up rows (the 5-D box's order); -1 past I.
__device__ __forceinline__ int tile_w1_row(const Fc1KernelParams& p, int hs, int j) {
  const int i = hs * kSliceOut + 8 * (j >> 4) + (j & 7);
  if (i >= p.I) return -1;
  const GateUpRows rows = gate_up_rows(p, i);
  return (j & 8) ? rows.up : rows.gate;
}

// A consumer warpgroup's mainloop over H with MXFP4 W1 (sm90_mx_mainloop.cuh):
// the converter's row is tile row 64 wg + (thread % 128) / 2, the
// promotion's the gate and the up row of this thread's output column.
template <class Cfg, int N>
__device__ __forceinline__ void mainloop_mx(const Fc1KernelParams& p, const TileInfo& t, uint32_t stages,
                                            const float* scales, uint32_t full0, uint32_t empty0, int wg, int& s,
                                            uint32_t& ph, float (&acc)[N / 2]) {
  namespace mx = mx_mainloop;
  const mx::Ring ring{stages, Cfg::kStageBytes, Cfg::kWStage, Cfg::kStages,
                      stages + uint32_t(Cfg::kOffCvt + wg * 2 * Cfg::kCvtTile), full0, empty0, scales,
                      Cfg::kMaxRows, 1 + wg};
  const int crow = tile_w1_row(p, t.hs, 64 * wg + ((threadIdx.x & 127) >> 1));
  const int i = t.hs * kSliceOut + 32 * wg + 8 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
  const GateUpRows prow = gate_up_rows(p, i < p.I ? i : 0);
  const int64_t e_row0 = int64_t(t.e) * 2 * p.I;
  mx::Rows rows{};
  rows.convert = crow >= 0 ? mx::scale_row(p.w_mx_scales, e_row0 + crow, p.H) : nullptr;
  if (Cfg::kFp8 && i < p.I) {
    rows.lo = mx::scale_row(p.w_mx_scales, e_row0 + prow.gate, p.H);
    rows.hi = mx::scale_row(p.w_mx_scales, e_row0 + prow.up, p.H);
  }
  mx::mainloop<Cfg::kFp8, N>(ring, rows, p.k_blocks, wg, s, ph, acc);
}

// A consumer warpgroup's mainloop over H: acc[N / 2] of this thread (rows
// gate / up of its output column, columns the tile's rows; see the
// epilogue), in fp32 and, for FP8, dequantised.
template <class Cfg, int N>
__device__ __forceinline__ void mainloop_dense(const Fc1KernelParams& p, const TileInfo& t, uint32_t stages,
                                         const float* scales, uint32_t full0, uint32_t empty0, int wg, int& s,
                                         uint32_t& ph, float (&acc)[N / 2]) {
  const int lane = threadIdx.x & 31;
  const uint32_t a_off = uint32_t(wg) * 64 * kTileBytes;  // this warpgroup's 64 W1 rows of the tile
#pragma unroll
  for (int k = 0; k < N / 2; ++k) acc[k] = 0.f;
  int prev = -1;
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    dev::mbar_wait(bar_at(full0, s), ph);
    if (!p.x_permuted) dev::fence_proxy_async_shared();  // the rows came through the generic proxy (cp.async)
    const uint32_t st = stages + uint32_t(s) * Cfg::kStageBytes;
    dev::fence_operands(acc);
    dev::wgmma_fence();
    k_block_mmas<Cfg::kFp8, N>(acc, dev::wgmma_desc_k_sw128(st + a_off), dev::wgmma_desc_k_sw128(st + Cfg::kWStage), true);
    dev::wgmma_commit();
    dev::fence_operands(acc);
    dev::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
    if (prev >= 0) {
      __syncwarp();
      if (lane == 0) dev::mbar_arrive(bar_at(empty0, prev));
    }
    prev = s;
    if (++s == Cfg::kStages) {
      s = 0;
      ph ^= 1;
    }
  }
  dev::wgmma_wait<0>();
  dev::fence_operands(acc);
  __syncwarp();
  if (lane == 0 && prev >= 0) dev::mbar_arrive(bar_at(empty0, prev));
  if constexpr (Cfg::kIn == Fc1In::kFp8Tensor) {
    const float scale = __ldg(p.x_scales) * __ldg(p.w_scales + t.e);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) acc[k] *= scale;
  }
}

// A consumer warpgroup's mainloop over H, dense or MXFP4 W1.
template <class Cfg, int N>
__device__ __forceinline__ void mainloop(const Fc1KernelParams& p, const TileInfo& t, uint32_t stages,
                                         const float* scales, uint32_t full0, uint32_t empty0, int wg, int& s,
                                         uint32_t& ph, float (&acc)[N / 2]) {
  if constexpr (Cfg::kMx)
    mainloop_mx<Cfg, N>(p, t, stages, scales, full0, empty0, wg, s, ph, acc);
  else
    mainloop_dense<Cfg, N>(p, t, stages, scales, full0, empty0, wg, s, ph, acc);
}

// A consumer warpgroup's tile: the mainloop over H, then act and the stores.
template <class Cfg, int N>
__device__ __forceinline__ void consume_tile(const Fc1KernelParams& p, const TileInfo& t, uint32_t stages,
                                             const float* scales, uint32_t full0, uint32_t empty0, uint16_t* stg,
                                             int wg, int& s, uint32_t& ph) {
  float acc[N / 2];
  mainloop<Cfg, N>(p, t, stages, scales, full0, empty0, wg, s, ph, acc);

  // Epilogue. This thread's accumulator rows: gate g_row and up g_row + 8 of
  // block 4 wg + q, i.e. output column il = 8 (4 wg + q) + lane / 4 of the tile.
  const int lane = threadIdx.x & 31;
  const int q = (threadIdx.x >> 5) & 3, g = lane >> 2, c4 = lane & 3;
  const int col = 8 * q + g;  // within the warpgroup's 32
  const int i = t.hs * kSliceOut + 32 * wg + col;
  float bg = 0.f, bu = 0.f;
  if (p.bias != nullptr && i < p.I) {
    const __nv_bfloat16* b = p.bias + int64_t(t.e) * 2 * p.I;
    const GateUpRows rows = gate_up_rows(p, i);
    bg = __bfloat162float(b[rows.gate]);
    bu = __bfloat162float(b[rows.up]);
  }
  const int wt = threadIdx.x & 127;
  const int out_col = t.hs * kSliceOut + 32 * wg + 8 * (wt & 3);
  constexpr int kPasses = (N + kEpiRows - 1) / kEpiRows;
#pragma unroll
  for (int ps = 0; ps < kPasses; ++ps) {
#pragma unroll
    for (int jj = 0; jj < kEpiRows / 8; ++jj) {
      const int j = ps * (kEpiRows / 8) + jj;
      if (j < N / 8) {
        const int nl = jj * 8 + 2 * c4;
        const float v0 = activate(p, acc[4 * j + 0] + bg, acc[4 * j + 2] + bu);
        const float v1 = activate(p, acc[4 * j + 1] + bg, acc[4 * j + 3] + bu);
        stg[nl * kEpiStride + col] = __bfloat16_as_ushort(__float2bfloat16_rn(v0));
        stg[(nl + 1) * kEpiStride + col] = __bfloat16_as_ushort(__float2bfloat16_rn(v1));
      }
    }
    dev::named_bar_sync(1 + wg, 128);
    // 64 rows x 4 chunks of 16 bytes: two a thread.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int nl = (wt >> 2) + 32 * h, n = ps * kEpiRows + nl;
      if (n < t.rows && out_col < p.I) {
        const uint4 v = *reinterpret_cast<const uint4*>(stg + nl * kEpiStride + 8 * (wt & 3));
        dev::st_global_v4(p.out + int64_t(t.p0 + n) * p.I + out_col, v.x, v.y, v.z, v.w);
      }
    }
    dev::named_bar_sync(1 + wg, 128);
  }
}

// A slice's W1 block scales (block-scaled FP8): the gate rows of a slice
// lie in one 128-row block, the up rows in one or (I % 64 != 0, gate-then-up
// layout) two; bit m of up_hi: the up rows of columns 8m.. are in the second.
struct SliceScales {
  const float* g;
  const float* u;
  const float* u1;
  uint32_t up_hi;
};
__device__ __forceinline__ SliceScales slice_scales(const Fc1KernelParams& p, int e, int i0) {
  const int kbs = p.H / kScaleK;
  const float* sw = p.w_scales + int64_t(e) * p.w_row_blocks * kbs;
  const GateUpRows first = gate_up_rows(p, i0);
  SliceScales r;
  r.g = sw + (first.gate / kScaleK) * kbs;
  r.u = sw + (first.up / kScaleK) * kbs;
  r.up_hi = 0;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int i = min(i0 + 8 * m, p.I - 1);
    if (gate_up_rows(p, i).up / kScaleK != first.up / kScaleK) r.up_hi |= 1u << m;
  }
  r.u1 = r.up_hi ? r.u + kbs : r.u;
  return r;
}

// Element group m (n8 blocks 2m: gate, 2m + 1: up) of a K block's partial
// promoted: rows a (r_lo) and b (r_lo + 8) of the gate columns times ag / bg,
// of the up columns times au / bu (each the row's X scale times the block's
// W1 scale).
__device__ __forceinline__ void promote_group(float (&acc)[kSliceW / 2], const float (&part)[kSliceW / 2], int m,
                                              float ag, float bg, float au, float bu) {
  acc[8 * m + 0] = fmaf(part[8 * m + 0], ag, acc[8 * m + 0]);
  acc[8 * m + 1] = fmaf(part[8 * m + 1], ag, acc[8 * m + 1]);
  acc[8 * m + 2] = fmaf(part[8 * m + 2], bg, acc[8 * m + 2]);
  acc[8 * m + 3] = fmaf(part[8 * m + 3], bg, acc[8 * m + 3]);
  acc[8 * m + 4] = fmaf(part[8 * m + 4], au, acc[8 * m + 4]);
  acc[8 * m + 5] = fmaf(part[8 * m + 5], au, acc[8 * m + 5]);
  acc[8 * m + 6] = fmaf(part[8 * m + 6], bu, acc[8 * m + 6]);
  acc[8 * m + 7] = fmaf(part[8 * m + 7], bu, acc[8 * m + 7]);
}

// The consumers' named barrier around the W1 scales' copy (0: __syncthreads,
// 1 and 2: the transposed tile's epilogue).
constexpr int kScaleBar = 3;

// One K block of the slices' MMAs and promotions (rows_m_mainloop): stage s
// (its descriptors da, db: warp-uniform), the block's W1 scale products
// already read. kOneUp: every up row of every slice in one scale block (the
// promotion takes four products and no select an element group).
template <class Cfg, bool kOneUp>
__device__ __forceinline__ void rows_m_k_block(float (&acc)[kHalves<Cfg>][kSliceW / 2], float (&part)[kSliceW / 2],
                                               uint64_t da, uint64_t db, uint32_t empty, bool gathered,
                                               const float (&gs)[kHalves<Cfg>], const float (&us0)[kHalves<Cfg>],
                                               const float (&us1)[kHalves<Cfg>], float xa, float xb,
                                               const uint32_t (&up_hi)[kHalves<Cfg>]) {
  constexpr int N = kSliceW, H2 = kHalves<Cfg>;
#pragma unroll
  for (int h = 0; h < H2; ++h) {
    if (h == 0 && gathered) dev::fence_proxy_async_shared();  // the rows came through the generic proxy (cp.async)
    dev::wgmma_fence();
    k_block_mmas<true, N>(part, da, db + uint64_t(h * kSliceW * kTileBytes / 16), false);
    dev::wgmma_commit();
    dev::wgmma_wait<0>();
    dev::fence_operands(part);
    // The stage is free: promote from registers. One arrival a warp after
    // __syncwarp, though the threads read the staged X scales: every
    // thread's arrival (dev::release_stage<true>, what racecheck credits)
    // measured 12-25 % slower here (docs/moe_fc1.md).
    if (h == H2 - 1) dev::release_stage_elect(empty);
    const float ag = xa * gs[h], bg = xb * gs[h];
    if constexpr (kOneUp) {
      // (Without the promotion the same schedule ran ~40 % faster: its
      // instructions, not the MMAs, set the pace; docs/moe_fc1.md.)
      const float au = xa * us0[h], bu = xb * us0[h];
#pragma unroll
      for (int m = 0; m < 8; ++m) promote_group(acc[h], part, m, ag, bg, au, bu);
    } else {
      const float au0 = xa * us0[h], au1 = xa * us1[h];
      const float bu0 = xb * us0[h], bu1 = xb * us1[h];
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const bool hi = (up_hi[h] >> m) & 1u;
        promote_group(acc[h], part, m, ag, bg, hi ? au1 : au0, hi ? bu1 : bu0);
      }
    }
  }
}

// An idle consumer warpgroup's part of a token-rows-as-M tile: wait for each
// of the tile's stages and release it.
template <class Cfg>
__device__ __forceinline__ void release_tile_stages(const Fc1KernelParams& p, uint32_t full0, uint32_t empty0, int& s,
                                                    uint32_t& ph) {
#pragma unroll 1
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    dev::mbar_wait(bar_at(full0, s), ph);
    dev::release_stage_elect(bar_at(empty0, s));
    if (++s == Cfg::kStages) {
      s = 0;
      ph ^= 1;
    }
  }
}

// Wide bf16 tiles (Cfg::kRowsM with bf16 X and W1): the same stage as the
// block-FP8 wide tile (the warpgroup's 64 token rows as A against the
// stage's 256 W1 rows as B, two m64n128 chains) but no promotion: the MMAs
// accumulate into acc[h] directly and run one stage deep (the previous
// stage is released once its MMAs are done), as the transposed tile's
// mainloop_dense does. A gathered token row feeds 256 W1 rows (the
// transposed tile: 128), so the gather moves half the bytes a FLOP.
template <class Cfg>
__device__ __forceinline__ void rows_m_mainloop_bf16(const Fc1KernelParams& p, uint32_t stages, uint32_t full0,
                                                     uint32_t empty0, int wg, int& s, uint32_t& ph, bool active,
                                                     float (&acc)[kHalves<Cfg>][kSliceW / 2]) {
  constexpr int N = kSliceW, H2 = kHalves<Cfg>;
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
#pragma unroll
    for (int h = 0; h < H2; ++h) acc[h][k] = 0.f;
  }
  if (!active) {  // warpgroup 1 on a chunk of at most 64 rows
    release_tile_stages<Cfg>(p, full0, empty0, s, ph);
    return;
  }
  const uint64_t da0 = dev::wgmma_desc_k_sw128(stages + uint32_t(Cfg::kWStage + wg * 64 * kTileBytes));
  const uint64_t db0 = dev::wgmma_desc_k_sw128(stages);
  const bool gathered = !p.x_permuted;
  int prev = -1;
#pragma unroll 1
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    dev::mbar_wait(bar_at(full0, s), ph);
    if (gathered) dev::fence_proxy_async_shared();  // the rows came through the generic proxy (cp.async)
    const uint64_t step = uint64_t(uint32_t(s) * uint32_t(Cfg::kStageBytes / 16));
#pragma unroll
    for (int h = 0; h < H2; ++h) dev::fence_operands(acc[h]);
    dev::wgmma_fence();
#pragma unroll
    for (int h = 0; h < H2; ++h)
      k_block_mmas<false, N>(acc[h], da0 + step, db0 + step + uint64_t(h * kSliceW * kTileBytes / 16), true);
    dev::wgmma_commit();
#pragma unroll
    for (int h = 0; h < H2; ++h) dev::fence_operands(acc[h]);
    dev::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
    if (prev >= 0) dev::release_stage_elect(bar_at(empty0, prev));
    prev = s;
    if (++s == Cfg::kStages) {
      s = 0;
      ph ^= 1;
    }
  }
  dev::wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < H2; ++h) dev::fence_operands(acc[h]);
  if (prev >= 0) dev::release_stage_elect(bar_at(empty0, prev));
}

// The block-scaled wide tile's sums before its first K block.
template <class Cfg>
__device__ __forceinline__ void zero_sums(float (&acc)[kHalves<Cfg>][kSliceW / 2], float (&part)[kSliceW / 2]) {
#pragma unroll
  for (int k = 0; k < kSliceW / 2; ++k) {
#pragma unroll
    for (int h = 0; h < kHalves<Cfg>; ++h) acc[h][k] = 0.f;
    part[k] = 0.f;
  }
}

// Cfg::kMxWide: the consumers convert (thread t of the 256: stage row t, its
// four sub-blocks) into converted stage n % 2; item n + 1's rows while item
// n's first slice's MMAs run (a tile's first item before its loop). Both
// warpgroups convert, so each waits for both halves (cvt_full counts the
// eight warps) and for the other's release of the stage it rewrites
// (cvt_empty). The loaders stage the rows' scale words and the blocks'
// largest scales beside each stage (load_tiles_mx_wide).
template <class Cfg>
__device__ __forceinline__ void convert_rows_mx(uint32_t stages, const uint32_t* words, int s, int c,
                                                uint32_t cvt_full) {
  const int rr = threadIdx.x;  // 0..255
  const uint32_t* sw = words + s * Cfg::kWordsStride;
  const uint32_t w = sw[rr];
  const int ge = block_group_exp(int(sw[Cfg::kTileW + ((rr >> 3) & 1)]));
  const uint32_t raw = stages + uint32_t(s) * Cfg::kStageBytes;
  const uint32_t dst = stages + uint32_t(Cfg::kOffCvt + c * Cfg::kTileW * kTileBytes);
  bool fast = true;
#pragma unroll
  for (int sub = 0; sub < 4; ++sub) {
    const int b = int((w >> (8 * sub)) & 0xffu);
    fast = fast && b != int(kUe8m0NaN) && b - 127 - ge >= kMxfp4FastMinShift;
  }
  if (__all_sync(0xffffffffu, fast)) {
    // One sub-block at a time: the consumers hold 192 sums meanwhile.
#pragma unroll
    for (int sub = 0; sub < 4; ++sub) {
      uint32_t q[4], o[8];
      load_packed(raw, rr, sub, q);
      const E4m3Table t = e4m3_table(int((w >> (8 * sub)) & 0xffu) - 127 - ge);
#pragma unroll
      for (int i = 0; i < 4; ++i) e2m1x8_to_e4m3_table(q[i], t, o[2 * i], o[2 * i + 1]);
      store_converted(dst, rr, sub, o);
    }
  } else {
#pragma unroll 1
    for (int sub = 0; sub < 4; ++sub) convert_piece_exact(raw, dst, rr, sub, int((w >> (8 * sub)) & 0xffu), ge);
  }
  dev::fence_proxy_async_shared();  // the converted rows to the async proxy (both warpgroups' wgmma)
  dev::release_stage_elect(cvt_full);
}

template <class Cfg>
__device__ __forceinline__ void rows_m_mainloop_mx(const Fc1KernelParams& p, uint32_t stages, uint32_t full0,
                                                      uint32_t empty0, int wg, int& s, uint32_t& ph, int r_lo,
                                                      bool active, float (&acc)[kHalves<Cfg>][kSliceW / 2],
                                                      const float* xsc, const uint32_t* words, int& n_cvt) {
  constexpr int N = kSliceW, H2 = kHalves<Cfg>;
  static_assert(H2 == 2, "wide tiles");
  const uint32_t cfull0 = full0 + 16 * Cfg::kStages, cempty0 = cfull0 + 16;
  float part[N / 2];
  zero_sums<Cfg>(acc, part);
  const uint64_t da0 = dev::wgmma_desc_k_sw128(stages + uint32_t(Cfg::kWStage + wg * 64 * kTileBytes));
  const uint64_t dc0 = dev::wgmma_desc_k_sw128(stages + uint32_t(Cfg::kOffCvt));
  const float* xs = xsc + r_lo;
  // The tile's first item, converted before its loop.
  {
    const int c = n_cvt & 1;
    dev::mbar_wait(bar_at(full0, s), ph);
    dev::mbar_wait(cempty0 + 8 * c, ((n_cvt >> 1) & 1) ^ 1);
    convert_rows_mx<Cfg>(stages, words, s, c, cfull0 + 8 * c);
    dev::mbar_wait(cfull0 + 8 * c, (n_cvt >> 1) & 1);
  }
  // Item n + 1 (stage s1, converted stage c1): wait for its rows and for
  // both warpgroups' release of c1 (item n - 1), convert this thread's row.
  // Item n + 1 sits in ring stage s1 (phase ph1) and converted stage
  // (n + 1) % 2.
  const auto next_stage = [&](int& s1, uint32_t& ph1) {
    s1 = s + 1 == Cfg::kStages ? 0 : s + 1;
    ph1 = s + 1 == Cfg::kStages ? ph ^ 1 : ph;
  };
  const auto convert_next = [&](int s1, uint32_t ph1) {
    const int n1 = n_cvt + 1, c1 = n1 & 1;
    dev::mbar_wait(bar_at(full0, s1), ph1);
    dev::mbar_wait(cempty0 + 8 * c1, ((n1 >> 1) & 1) ^ 1);
    convert_rows_mx<Cfg>(stages, words, s1, c1, cfull0 + 8 * c1);
  };
  const auto release_item = [&] {
    dev::release_stage_elect(bar_at(empty0, s));
    dev::release_stage_elect(cempty0 + 8 * (n_cvt & 1));
  };
  // Both warpgroups' halves of item n + 1 converted; on to it.
  const auto to_next = [&](bool next, int s1, uint32_t ph1) {
    const int n1 = n_cvt + 1;
    if (next) dev::mbar_wait(cfull0 + 8 * (n1 & 1), (n1 >> 1) & 1);
    s = s1;
    ph = ph1;
    n_cvt = n1;
  };
  if (!active) {  // warpgroup 1 on a chunk of at most 64 rows: it converts its half all the same
#pragma unroll 1
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      int s1;
      uint32_t ph1;
      next_stage(s1, ph1);
      const bool next = kb + 1 < p.k_blocks;
      if (next) convert_next(s1, ph1);
      release_item();
      to_next(next, s1, ph1);
    }
    return;
  }
#pragma unroll 1
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    const int c = n_cvt & 1;
    int s1;
    uint32_t ph1;
    next_stage(s1, ph1);
    const bool next = kb + 1 < p.k_blocks;
    const uint64_t step = uint64_t(uint32_t(s) * uint32_t(Cfg::kStageBytes / 16));
    const uint64_t cstep = uint64_t(uint32_t(c) * uint32_t(Cfg::kTileW * kTileBytes / 16));
    const uint32_t* sw = words + s * Cfg::kWordsStride;
    const float gs = exp2_float(block_group_exp(int(sw[Cfg::kTileW])));
    const float us = exp2_float(block_group_exp(int(sw[Cfg::kTileW + 1])));
    const float xa = xs[s * Cfg::kMaxRows], xb = xs[s * Cfg::kMaxRows + 8];
    const float ag = xa * gs, bg = xb * gs, au = xa * us, bu = xb * us;
    dev::wgmma_fence();
    k_block_mmas<true, N>(part, da0 + step, dc0 + cstep, false);
    dev::wgmma_commit();
    if (next) convert_next(s1, ph1);  // while the first slice's MMAs run
    dev::wgmma_wait<0>();
    dev::fence_operands(part);
#pragma unroll
    for (int m = 0; m < 8; ++m) promote_group(acc[0], part, m, ag, bg, au, bu);
    dev::wgmma_fence();
    k_block_mmas<true, N>(part, da0 + step, dc0 + cstep + uint64_t(kSliceW * kTileBytes / 16), false);
    dev::wgmma_commit();
    dev::wgmma_wait<0>();
    dev::fence_operands(part);
    release_item();
#pragma unroll
    for (int m = 0; m < 8; ++m) promote_group(acc[1], part, m, ag, bg, au, bu);
    to_next(next, s1, ph1);
  }
}

// Block-scaled FP8 with the token rows as wgmma's M (Cfg::kRowsM): below,
// the mainloop over H of the kHalves<Cfg> slices hs, hs + 1, .. a stage
// holds: acc[h] = the fp32 sums of the thread's 2 rows x 32 W1 rows (16
// gate / up column pairs) of slice hs + h, promoted per K block. A wide
// stage's two slices run one after the other through one partial (a second
// would not fit the registers): the MMAs of the first, its promotion, then
// the second's; the other consumer warpgroup's MMAs fill the tensor pipe
// meanwhile. A slice's MMAs and promotion are the same in wide and narrow
// tiles, so both give the same bits (spec §9.8's FP8 output, from narrow
// tiles, is tested bitwise against bf16 rows that may come from wide ones).
//
// The loop is written for few instructions a K block (DeepGEMM's loop issues
// ~14 besides its MMAs and FFMAs; docs/moe_fc1.md): the tile, the warpgroup
// and so the stage index are warp-uniform (the caller passes them through
// __shfl_sync), so the descriptors are uniform registers advanced by
// constants; the slices' scale layout is decided once a tile (kOneUp); an
// idle warpgroup runs a loop of its own; a K block's gate and up W1 scales
// are one shared load (16 bytes wide, 8 narrow), the up rows' second-block
// scales a second one only where kOneUp is false.
// (The loop of consume_tile_rows_m below.)
template <class Cfg>
__device__ __forceinline__ void rows_m_mainloop(const Fc1KernelParams& p, const TileInfo& t, int hs,
                                                uint32_t stages, uint32_t full0, uint32_t empty0, int wg, int& s,
                                                uint32_t& ph, int r_lo, bool active,
                                                float (&acc)[kHalves<Cfg>][kSliceW / 2], float* wsc,
                                                const float* xsc, const uint32_t* words, int& n_cvt) {
  constexpr int N = kSliceW, H2 = kHalves<Cfg>;
  if constexpr (Cfg::kIn == Fc1In::kBf16) {
    rows_m_mainloop_bf16<Cfg>(p, stages, full0, empty0, wg, s, ph, active, acc);
    return;
  } else if constexpr (Cfg::kMxWide) {
    rows_m_mainloop_mx<Cfg>(p, stages, full0, empty0, wg, s, ph, r_lo, active, acc, xsc, words, n_cvt);
    return;
  }
  const int kbs = p.H / kScaleK;
  SliceScales sw[H2];
#pragma unroll
  for (int h = 0; h < H2; ++h)  // (a wide tile's second slice may lie past I: its W1 rows read as zeros)
    sw[h] = slice_scales(p, t.e, H2 > 1 ? min((hs + h) * kSliceOut, p.I - 1) : (hs + h) * kSliceOut);
  // The slices' W1 scales of every K block into shared memory, read after
  // each stage's barrier: wsc[2 H2 kb + 2 h + j] (j: gate, up) and, past
  // those 2 H2 kbs, wsc[2 H2 kbs + H2 kb + h] (the up rows' second block).
  // Both consumer warpgroups copy, between two syncs of theirs (the first:
  // the previous call's readers are done).
  dev::named_bar_sync(kScaleBar, 256);
  for (int i = threadIdx.x; i < 3 * H2 * kbs; i += 256) {
    const bool second = i >= 2 * H2 * kbs;
    const int j = second ? 2 : i % 2;
    const int h = second ? (i - 2 * H2 * kbs) % H2 : (i / 2) % H2;
    const int kb = second ? (i - 2 * H2 * kbs) / H2 : i / (2 * H2);
    const SliceScales q = h > 0 ? sw[H2 - 1] : sw[0];  // sw[h] (H2 <= 2) without a runtime index into registers
    wsc[i] = __ldg((j == 0 ? q.g : j == 1 ? q.u : q.u1) + kb);
  }
  dev::named_bar_sync(kScaleBar, 256);
  float part[N / 2];
  zero_sums<Cfg>(acc, part);
  if (!active) {  // warpgroup 1 on a chunk of at most 64 rows
    release_tile_stages<Cfg>(p, full0, empty0, s, ph);
    return;
  }
  // Stage 0's descriptors (this warpgroup's 64 token rows; the stage's W1
  // rows); stage s adds s kStageBytes / 16 to each.
  const uint64_t da0 = dev::wgmma_desc_k_sw128(stages + uint32_t(Cfg::kWStage + wg * 64 * kTileBytes));
  const uint64_t db0 = dev::wgmma_desc_k_sw128(stages);
  // The X scales of this thread's two rows come with each stage (the
  // loaders store them, Cfg::kStageScales; rows past the chunk's read 0 or
  // stale values, whose outputs are not stored).
  const float* xs = xsc + r_lo;
  const bool gathered = !p.x_permuted;
  uint32_t up_hi[H2];
#pragma unroll
  for (int h = 0; h < H2; ++h) up_hi[h] = sw[h].up_hi;
  const auto run = [&](auto one_up) {
    constexpr bool kOneUp = decltype(one_up)::value;
    const float* wu1 = wsc + 2 * H2 * kbs;  // the second up block's scales
#pragma unroll 1
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      float gs[H2], us0[H2], us1[H2];
      if constexpr (H2 == 2) {  // gs0, us0_0, gs1, us0_1
        const float4 v = reinterpret_cast<const float4*>(wsc)[kb];
        gs[0] = v.x, us0[0] = v.y, gs[H2 - 1] = v.z, us0[H2 - 1] = v.w;
      } else {  // gs, us0
        const float2 v = reinterpret_cast<const float2*>(wsc)[kb];
        gs[0] = v.x, us0[0] = v.y;
      }
#pragma unroll
      for (int h = 0; h < H2; ++h) us1[h] = kOneUp ? 0.f : wu1[H2 * kb + h];
      dev::mbar_wait(bar_at(full0, s), ph);
      const float xa = xs[s * Cfg::kMaxRows], xb = xs[s * Cfg::kMaxRows + 8];
      const uint64_t step = uint64_t(uint32_t(s) * uint32_t(Cfg::kStageBytes / 16));
      rows_m_k_block<Cfg, kOneUp>(acc, part, da0 + step, db0 + step, bar_at(empty0, s), gathered, gs, us0, us1, xa,
                                  xb, up_hi);
      if (++s == Cfg::kStages) {
        s = 0;
        ph ^= 1;
      }
    }
  };
  bool one_up = true;
#pragma unroll
  for (int h = 0; h < H2; ++h) one_up = one_up && up_hi[h] == 0;
  if (one_up)
    run(std::true_type{});
  else
    run(std::false_type{});
}

// The biases of output columns i and i + 1 (gate and up; 0 without bias).
__device__ __forceinline__ void pair_bias(const Fc1KernelParams& p, const TileInfo& t, int i, float& bg0, float& bg1,
                                          float& bu0, float& bu1) {
  bg0 = bg1 = bu0 = bu1 = 0.f;
  if (p.bias == nullptr) return;
  const __nv_bfloat16* b = p.bias + int64_t(t.e) * 2 * p.I;
  const GateUpRows r0 = gate_up_rows(p, i), r1 = gate_up_rows(p, i + 1);
  bg0 = __bfloat162float(b[r0.gate]);
  bu0 = __bfloat162float(b[r0.up]);
  bg1 = __bfloat162float(b[r1.gate]);
  bu1 = __bfloat162float(b[r1.up]);
}

// act(gate + b, up + b) of element group m's column pair (i0 + 8m + c2, + 1)
// for the thread's row rr (0: r_lo, 1: r_lo + 8), rounded to bf16: the
// gate sums acc[8m + 2rr], + 1, the up sums acc[8m + 4 + 2rr], + 1.
__device__ __forceinline__ __nv_bfloat162 activated_pair(const Fc1KernelParams& p, const float (&acc)[kSliceW / 2],
                                                         int m, int rr, float bg0, float bg1, float bu0, float bu1) {
  return __floats2bfloat162_rn(activate(p, acc[8 * m + 2 * rr] + bg0, acc[8 * m + 4 + 2 * rr] + bu0),
                               activate(p, acc[8 * m + 1 + 2 * rr] + bg1, acc[8 * m + 5 + 2 * rr] + bu1));
}

// act(gate + b, up + b) of a slice's output columns i0 + 8m + c2, + 1 (m =
// 0..7) for the thread's rows r_lo (v[2m], v[2m + 1]) and r_lo + 8 (v[16 +
// 2m], ...), each rounded to bf16 (packed pairs: v2[m] row a, v2[8 + m] row
// b). The FP8 output's (I % 128 == 0: every column is in).
__device__ __forceinline__ void rows_m_activations(const Fc1KernelParams& p, const TileInfo& t, int i0,
                                                   const float (&acc)[kSliceW / 2], __nv_bfloat162 (&v2)[16]) {
  const int c2 = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    float bg0, bg1, bu0, bu1;
    pair_bias(p, t, i0 + 8 * m + c2, bg0, bg1, bu0, bu1);
    v2[m] = activated_pair(p, acc, m, 0, bg0, bg1, bu0, bu1);
    v2[8 + m] = activated_pair(p, acc, m, 1, bg0, bg1, bu0, bu1);
  }
}

// The FP8 output of one row's 128-column block (spec §9.8): the bf16 values
// this thread holds (slice 0's lo[0..7], slice 1's hi[0..7], column pairs
// i0 + 8m + c2 of each slice) with the other three lanes of its quad holding
// the rest; quantised as quantize_fp8 does (fp8_dev): amax on the bf16 bits
// (quad max), the scale, e4m3 pairs stored as 2-byte words; lane c2 = 0
// stores the scale. Every lane of the warp calls it (the quad shuffles);
// only `live` rows store.
template <ScaleFormat F>
__device__ __forceinline__ void rows_m_store_fp8_row(const Fc1KernelParams& p, int64_t row, int blk, bool live,
                                                     const __nv_bfloat162 (&lo)[8], const __nv_bfloat162 (&hi)[8]) {
  using namespace fp8_dev;
  const int c2 = 2 * (threadIdx.x & 3);
  uint32_t amax = 0;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const uint32_t a = __vmaxu2(*reinterpret_cast<const uint32_t*>(&lo[m]) & kAbsMask,
                                *reinterpret_cast<const uint32_t*>(&hi[m]) & kAbsMask);
    amax = max(amax, max(a & 0xffffu, a >> 16));
  }
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  if (!live) return;
  const bool nan_block = amax > kBf16Inf;
  const Scale sc = block_scale_or_nan<F>(amax);
  uint8_t* q = reinterpret_cast<uint8_t*>(p.out) + row * p.I + int64_t(blk) * 128 + c2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const __nv_bfloat162(&v)[8] = half ? hi : lo;
#pragma unroll
    for (int g = 0; g < 2; ++g) {  // four column pairs (eight values) at a time
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(v[4 * g + j]);
        f[2 * j] = x.x;
        f[2 * j + 1] = x.y;
      }
      uint32_t b0, b1;
      quantize8_f32<F>(f, sc.s, nan_block, b0, b1);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w = (j < 2 ? b0 : b1) >> (16 * (j & 1));
        *reinterpret_cast<uint16_t*>(q + 64 * half + 8 * (4 * g + j)) = uint16_t(w);
      }
    }
  }
  if (c2 == 0) {
    const int64_t at = row * (p.I / 128) + blk;
    if constexpr (F == ScaleFormat::kUE8M0)
      static_cast<uint8_t*>(p.out_scales)[at] = uint8_t(sc.stored);
    else
      static_cast<uint32_t*>(p.out_scales)[at] = sc.stored;
  }
}

// bf16 out: act(gate + b, up + b) of a slice's output columns i0 + 8m + c2,
// + 1 for the thread's live rows (r_lo: row_a, r_lo + 8: row_b), stored as
// pairs (rows past the chunk take no activation).
__device__ __forceinline__ void rows_m_store_bf16(const Fc1KernelParams& p, const TileInfo& t, int i0,
                                                  const float (&acc)[kSliceW / 2], int r_lo, bool row_a,
                                                  bool row_b) {
  const int c2 = 2 * (threadIdx.x & 3);
  __nv_bfloat16* out_a = p.out + int64_t(t.p0 + r_lo) * p.I;
  __nv_bfloat16* out_b = out_a + int64_t(8) * p.I;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int i = i0 + 8 * m + c2;
    if (i >= p.I) continue;  // I % 8 == 0: i and i + 1 are both in or both out
    float bg0, bg1, bu0, bu1;
    pair_bias(p, t, i, bg0, bg1, bu0, bu1);
    if (row_a) *reinterpret_cast<__nv_bfloat162*>(out_a + i) = activated_pair(p, acc, m, 0, bg0, bg1, bu0, bu1);
    if (row_b) *reinterpret_cast<__nv_bfloat162*>(out_b + i) = activated_pair(p, acc, m, 1, bg0, bg1, bu0, bu1);
  }
}

// The FP8 output of a tile's 128-column scale block for the thread's rows
// r_lo (row_a) and r_lo + 8 (row_b): `first` and `second` are the two
// 64-column slices' bf16 activations (rows_m_activations). Every lane
// shuffles (rows past the chunk included); only live rows store.
__device__ __forceinline__ void rows_m_store_fp8(const Fc1KernelParams& p, const TileInfo& t, int r_lo, bool row_a,
                                                 bool row_b, const __nv_bfloat162 (&first)[16],
                                                 const __nv_bfloat162 (&second)[16]) {
  const __nv_bfloat162(&a0)[8] = *reinterpret_cast<const __nv_bfloat162(*)[8]>(&first[0]);
  const __nv_bfloat162(&a1)[8] = *reinterpret_cast<const __nv_bfloat162(*)[8]>(&second[0]);
  const __nv_bfloat162(&b0)[8] = *reinterpret_cast<const __nv_bfloat162(*)[8]>(&first[8]);
  const __nv_bfloat162(&b1)[8] = *reinterpret_cast<const __nv_bfloat162(*)[8]>(&second[8]);
  const int64_t ra = int64_t(t.p0 + r_lo), rb = ra + 8;
  if (p.out_ue8m0) {
    rows_m_store_fp8_row<ScaleFormat::kUE8M0>(p, ra, t.hs, row_a, a0, a1);
    rows_m_store_fp8_row<ScaleFormat::kUE8M0>(p, rb, t.hs, row_b, b0, b1);
  } else {
    rows_m_store_fp8_row<ScaleFormat::kFloat32>(p, ra, t.hs, row_a, a0, a1);
    rows_m_store_fp8_row<ScaleFormat::kFloat32>(p, rb, t.hs, row_b, b0, b1);
  }
}

// Block scales with the token rows as wgmma's M: the stage's row operand
// (A, 64 rows a consumer warpgroup: tile rows 64 wg ..) against the stage's
// 128 or (wide) 256 W1 rows (B, N = 128 an MMA). A thread's accumulator rows
// are two tokens (one X scale each) and its columns come in n8 blocks
// alternating gate / up (the 5-D box's order: block 2m holds the gate rows
// of output columns 8m..8m+7, block 2m + 1 their up rows), so the promotion
// is one FFMA an element with six scale products a K block and slice, where
// the transposed tile needs a product per element. The same thread holds the
// gate and the up of its output columns: the activation needs no exchange.
// bf16 out: stored as pairs per slice. FP8 out (narrow tiles): the tile's
// two slices one after the other, the first slice's bf16 activations kept in
// registers, then each row's 128-column block is quantised
// (rows_m_store_fp8_row).
template <class Cfg>
__device__ __forceinline__ void consume_tile_rows_m(const Fc1KernelParams& p, const TileInfo& t, uint32_t stages,
                                                    uint32_t full0, uint32_t empty0, int wg, int& s, uint32_t& ph,
                                                    float* wsc, const float* xsc, const uint32_t* words,
                                                    int& n_cvt) {
  const int lane = threadIdx.x & 31;
  const int r_lo = 64 * wg + 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2);  // tile rows r_lo and r_lo + 8
  const bool active = 64 * wg < t.n;  // warpgroup 1 idles on chunks of at most 64 rows (t, wg: warp-uniform)
  const bool row_a = r_lo < t.rows, row_b = r_lo + 8 < t.rows;
  float acc[kHalves<Cfg>][kSliceW / 2];
  if constexpr (Cfg::kPair == 1) {
    rows_m_mainloop<Cfg>(p, t, t.hs * kHalves<Cfg>, stages, full0, empty0, wg, s, ph, r_lo, active, acc, wsc, xsc,
                         words, n_cvt);
    if (!active) return;
    if constexpr (Cfg::kFp8Out) {
      // Wide tiles with the FP8 output: the stage's two slices are the
      // tile's 128-column scale block.
      __nv_bfloat162 first[16], second[16];
      rows_m_activations(p, t, 2 * t.hs * kSliceOut, acc[0], first);
      rows_m_activations(p, t, (2 * t.hs + 1) * kSliceOut, acc[1], second);
      rows_m_store_fp8(p, t, r_lo, row_a, row_b, first, second);
    } else {
#pragma unroll
      for (int h = 0; h < kHalves<Cfg>; ++h)
        rows_m_store_bf16(p, t, (t.hs * kHalves<Cfg> + h) * kSliceOut, acc[h], r_lo, row_a, row_b);
    }
  } else {
    __nv_bfloat162 first[16], second[16];
    rows_m_mainloop<Cfg>(p, t, 2 * t.hs, stages, full0, empty0, wg, s, ph, r_lo, active, acc, wsc, xsc, words,
                         n_cvt);
    if (active) rows_m_activations(p, t, 2 * t.hs * kSliceOut, acc[0], first);
    rows_m_mainloop<Cfg>(p, t, 2 * t.hs + 1, stages, full0, empty0, wg, s, ph, r_lo, active, acc, wsc, xsc, words,
                         n_cvt);
    if (!active) return;
    rows_m_activations(p, t, (2 * t.hs + 1) * kSliceOut, acc[0], second);
    rows_m_store_fp8(p, t, r_lo, row_a, row_b, first, second);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    fc1_gemm_kernel(const __grid_constant__ Fc1KernelParams p, const __grid_constant__ CUtensorMap map_w,
                    const __grid_constant__ CUtensorMap map_x64, const __grid_constant__ CUtensorMap map_x16) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = dev::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* sm = smem_raw + (base - raw);
  int* row_off = reinterpret_cast<int*>(sm + Cfg::kOffRowOff);
  int* tile_start = reinterpret_cast<int*>(sm + Cfg::kOffTileStart);
  uint16_t* order = reinterpret_cast<uint16_t*>(sm + Cfg::kOffOrder);
  const float* scales = reinterpret_cast<const float*>(sm + Cfg::kOffScales);
  const uint32_t full0 = base + Cfg::kOffBars, empty0 = full0 + 8 * Cfg::kStages;

  const int tid = threadIdx.x, warp = tid >> 5;
  if (tid == 0) {
    for (int i = 0; i < Cfg::kStages; ++i) {
      // Each loader's arrival (the gather's by cp.async), the TMA thread's,
      // and a gathered stage's scale stores' (W4A8, block FP8).
      dev::mbar_init(bar_at(full0, i), kLoaders + 1 + (p.x_permuted ? 0 : Cfg::kScaleArrivals));
      dev::mbar_init(bar_at(empty0, i), Cfg::kEmptyArrivals);
    }
    if constexpr (Cfg::kMxWide) {  // the converted stages' full and empty barriers: one arrival a consumer warp
      for (int i = 0; i < 2; ++i) {
        dev::mbar_init(full0 + 16 * Cfg::kStages + 8 * i, 8);
        dev::mbar_init(full0 + 16 * Cfg::kStages + 16 + 8 * i, 8);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  dev::grid_dependency_wait();  // the routing maps and X may come from the kernel ahead
  for (int e = tid; e <= p.E; e += kThreads) row_off[e] = int(p.offsets[e]);
  __syncthreads();
  if (warp == 0) build_schedule<Cfg::kMaxRows>(row_off, p.E, p.slices, tile_start, order);
  __syncthreads();

  // Each role's code sits inside its setmaxnreg branch (ptxas ignores the
  // instruction when code needing more registers is reachable after it).
  if (warp >= 8) {
    dev::setmaxnreg_dec<Cfg::kLoaderRegs>();
    if constexpr (Cfg::kMxWide)
      load_tiles_mx_wide<Cfg>(p, &map_w, &map_x64, &map_x16, base, base + Cfg::kOffScales,
                            reinterpret_cast<uint32_t*>(sm + Cfg::kOffWords), full0, empty0, tile_start, row_off,
                            order);
    else
      load_tiles<Cfg>(p, &map_w, &map_x64, &map_x16, base, base + Cfg::kOffScales, full0, empty0, tile_start,
                      row_off, order);
  } else {
    dev::setmaxnreg_inc<Cfg::kConsumerRegs>();
    // The warpgroup, the tile count and each tile through __shfl_sync: the
    // compiler then knows them warp-uniform (they come from threadIdx and
    // shared memory), so the ring's stage index and the descriptors built
    // from it live in uniform registers (rows_m_mainloop).
    const int wg = __shfl_sync(~0u, warp / 4, 0);
    uint16_t* stg = reinterpret_cast<uint16_t*>(sm + Cfg::kOffEpi + wg * kEpiBytes);
    const int total = __shfl_sync(~0u, tile_start[p.E], 0);
    int s = 0, n_cvt = 0;
    uint32_t ph = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      TileInfo t = decode_tile<Cfg::kMaxRows>(tile, tile_start, row_off, order, p.E);
      if constexpr (Cfg::kRowsM) {
        t.e = __shfl_sync(~0u, t.e, 0);
        t.hs = __shfl_sync(~0u, t.hs, 0);
        t.p0 = __shfl_sync(~0u, t.p0, 0);
        t.rows = __shfl_sync(~0u, t.rows, 0);
        t.n = __shfl_sync(~0u, t.n, 0);
        // The W1 scales in the epilogue staging, which this tile does not use.
        consume_tile_rows_m<Cfg>(p, t, base, full0, empty0, wg, s, ph, reinterpret_cast<float*>(sm + Cfg::kOffEpi),
                                 scales,
                                 reinterpret_cast<const uint32_t*>(sm + Cfg::kOffWords),
                                 n_cvt);
      } else {
        switch (t.n / kRowQuantum) {
#define FLASHMIX_FC1_CASE(K)                                                                \
  case K:                                                                                   \
    if constexpr (K * kRowQuantum <= Cfg::kMaxRows)                                         \
      consume_tile<Cfg, K * kRowQuantum>(p, t, base, scales, full0, empty0, stg, wg, s, ph); \
    break;
          FLASHMIX_FC1_CASE(1)
          FLASHMIX_FC1_CASE(2)
          FLASHMIX_FC1_CASE(3)
          FLASHMIX_FC1_CASE(4)
          FLASHMIX_FC1_CASE(5)
          FLASHMIX_FC1_CASE(6)
          FLASHMIX_FC1_CASE(7)
          FLASHMIX_FC1_CASE(8)
          FLASHMIX_FC1_CASE(9)
          FLASHMIX_FC1_CASE(10)
          FLASHMIX_FC1_CASE(11)
          FLASHMIX_FC1_CASE(12)
          FLASHMIX_FC1_CASE(13)
          FLASHMIX_FC1_CASE(14)
          FLASHMIX_FC1_CASE(15)
          FLASHMIX_FC1_CASE(16)
#undef FLASHMIX_FC1_CASE
          default:
            break;
        }
      }
    }
  }
}

// W1 as a 5-D tensor (K = H, row in block 8, gate/up 2, block I / 8, expert):
// a box (128 bytes of K, 8, 2, 8, 1) is 8 blocks of 8 gate rows then their 8
// up rows, whichever the layout (only the strides differ). Blocks past I read
// as zeros. e4m3 travels as bytes.
// MXFP4 W1 travels as its packed bytes (H / 2 a row), in boxes of 64 (W4A8:
// 128 of K) or 32 bytes (W4A16: 64 of K) a row, unswizzled.
bool encode_w1(const Sm90Fc1Params& p, int box_rows, CUtensorMap& w) {
  const detail::TensorMapEncodeTiled encode = detail::tensor_map_encoder();
  if (encode == nullptr) return false;
  const bool fp8 = p.fp8 != MoeFp8Scaling::kNone;
  const bool mx = p.weights == MoeWeightFormat::kMxfp4;
  const bool bytes = fp8 || mx;  // the map's elements are bytes
  const cuuint64_t H = cuuint64_t(p.H), I = cuuint64_t(p.I);
  const cuuint64_t row = mx ? H / 2 : H * (fp8 ? 1 : 2);  // bytes a W1 row
  const bool inter = p.layout == Fc1WeightLayout::kInterleaved;
  const cuuint64_t dims[5] = {mx ? H / 2 : H, 8, 2, I / 8, cuuint64_t(p.E)};
  // Strides (bytes) of dims 1..4: row in block, gate/up, block, expert.
  const cuuint64_t strides[4] = {inter ? 2 * row : row, inter ? row : I * row, inter ? 16 * row : 8 * row,
                                 2 * I * row};
  const cuuint32_t inner = mx ? (fp8 ? 64 : 32) : (fp8 ? kTileBytes : kTileBytes / 2);
  const cuuint32_t box[5] = {inner, 8, 2, cuuint32_t(box_rows / 16), 1};
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  return encode(&w, bytes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5,
                const_cast<void*>(p.W1), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                mx ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A permuted X as a 2-D tensor (H, k*T) in boxes of 128 bytes x 64 or 16
// rows (rows past k*T and columns past H read as zeros).
bool encode_x_permuted(const Sm90Fc1Params& p, CUtensorMap& x64, CUtensorMap& x16) {
  const detail::TensorMapEncodeTiled encode = detail::tensor_map_encoder();
  if (encode == nullptr) return false;
  const bool fp8 = p.fp8 != MoeFp8Scaling::kNone;
  const cuuint64_t dims[2] = {cuuint64_t(p.H), cuuint64_t(int64_t(p.T) * p.k)};
  const cuuint64_t strides[1] = {cuuint64_t(p.x_stride) * (fp8 ? 1 : 2)};
  const cuuint32_t elem[2] = {1, 1};
  for (int i = 0; i < 2; ++i) {
    const cuuint32_t box[2] = {cuuint32_t(fp8 ? kTileBytes : kTileBytes / 2), cuuint32_t(i == 0 ? 64 : 16)};
    if (encode(i == 0 ? &x64 : &x16, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
               const_cast<void*>(p.X), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return false;
  }
  return true;
}

template <class Cfg>
Status launch(const Sm90Fc1Params& p, const Fc1KernelParams& k, const CUtensorMap& w, const CUtensorMap& x64,
              const CUtensorMap& x16, cudaStream_t stream) {
  const auto kernel = fc1_gemm_kernel<Cfg>;
  int max_dynamic = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(
      detail::prepare_kernel(detail::kernel_key(kernel), false, &max_dynamic), kOp, "kernel attributes"));
  FM_REQUIRE_SUPPORTED(Cfg::kSmemBytes <= max_dynamic, kOp, "device", "the FC1 kernel needs ", Cfg::kSmemBytes,
                       " bytes of shared memory per block; this device allows ", max_dynamic);
  Fc1KernelParams kp = k;
  kp.slices = (k.slices + Cfg::kSlicesPerTile - 1) / Cfg::kSlicesPerTile;  // tiles over I
  FM_RETURN_IF_ERROR(detail::cuda_status(
      dev::launch(kernel, dim3(unsigned(p.sm_count)), dim3(kThreads), Cfg::kSmemBytes, stream, p.pdl, kp, w, x64,
                  x16),
      kOp, "kernel launch"));
  return Status::Ok();
}

}  // namespace

// Block-scaled FP8 (bf16 or FP8 out): wide tiles (256 W1 rows a stage) once
// T k >= 256 E_local (measured faster at 256 and 1024 rows an expert,
// slower at decode sizes; 32-255 not measured). They halve the tiles,
// which decode needs to keep its SMs streaming W1. Like the ring's rule
// below, T k / E_local overstates the rows an expert under expert
// parallelism (most slots are not local): a rank may take wide tiles at
// well under 256 rows an expert. FLASHMIX_FC1_WIDE=0|1 pins it, read on
// every call (the A/B, bench/results/ab/fc1-fp8-wide*; the tests). With the
// FP8 output the tile's two slices are one 128-column scale block.
// bf16 takes wide tiles (token rows as M) whenever it gathers: a gathered
// row then feeds 256 W1 rows instead of 128, and the gather's cp.asyncs,
// not the MMAs, bound the transposed tile (H200, same process: gathered
// Mixtral 5727-6622 -> 3569-3988 us, DeepSeek-EP 1568 -> 1035, Qwen3 677
// -> 448, decode T16 435 -> 414). From a permuted X it stays transposed
// (wide: 5-8 % slower, its W1 read twice for experts of 129-256 rows;
// bench/results/ab/fc1-bf16-wide-*; docs/moe_fc1.md).
bool sm90_fc1_wide_tiles(MoeFp8Scaling fp8, MoeWeightFormat weights, bool x_permuted, int64_t T, int k, int E) {
  const char* pin_wide = std::getenv("FLASHMIX_FC1_WIDE");
  const bool pinned_wide = pin_wide != nullptr && *pin_wide != '\0';
  const bool dense_w1 = weights == MoeWeightFormat::kDense;
  const bool wide_fp8 = fp8 == MoeFp8Scaling::kBlock && dense_w1;
  const bool wide_bf16 = fp8 == MoeFp8Scaling::kNone && dense_w1;
  const bool wide_by_rule = (wide_fp8 && T * k >= int64_t(256) * E) || (wide_bf16 && !x_permuted);
  return (wide_fp8 || wide_bf16) && (pinned_wide ? std::atoi(pin_wide) != 0 : wide_by_rule);
}

// W4A8 on wide tiles (Fc1Cfg::kMxWide, docs/mxfp4.md §4.13): where a wide
// tile's gate rows and its up rows are each one 128 x 128 block of W1 (gate
// rows then up rows, I % 128 == 0), X is permuted (the loaders bring its
// rows by TMA boxes: no gather) and experts average more than 32 rows (below, the
// 32-row W4A8 tile or the decode kernel; FLASHMIX_FC1_ROWS=32 pins those).
// FLASHMIX_FC1_MX_WIDE=0 pins the transposed W4A8 tile (the A/B), read on
// every call. moe_fc1's validation and moe_forward ask too: the FP8 output
// with MXFP4 weights is written by these tiles only.
bool sm90_fc1_mx_wide_tiles(MoeFp8Scaling fp8, MoeWeightFormat weights, bool x_permuted, bool interleaved,
                            int64_t I, int64_t T, int k, int E) {
  const char* pin = std::getenv("FLASHMIX_FC1_MX_WIDE");
  if (pin != nullptr && *pin != '\0' && std::atoi(pin) == 0) return false;
  const char* rows = std::getenv("FLASHMIX_FC1_ROWS");
  const bool rows32 = rows != nullptr && *rows != '\0' ? std::atoi(rows) == 32 : T * k <= int64_t(32) * E;
  return weights == MoeWeightFormat::kMxfp4 && fp8 == MoeFp8Scaling::kBlock && x_permuted && !interleaved &&
         I % kScaleK == 0 && !rows32;
}

Status sm90_fc1_run(const Sm90Fc1Params& p, cudaStream_t stream) {
  // MXFP4 at decode: the kernel that converts in registers (sm90_mx_decode.cu).
  if (p.weights == MoeWeightFormat::kMxfp4 && mx_decode_applies(p.T, p.k, p.E, 2 * int64_t(p.I), p.H))
    return sm90_fc1_run_mx_decode(p, stream);
  const bool wide = sm90_fc1_wide_tiles(p.fp8, p.weights, p.x_permuted, p.T, p.k, p.E);
  static const int pinned = [] {
    const char* e = std::getenv("FLASHMIX_FC1_ROWS");
    return e ? std::atoi(e) : 0;
  }();
  const int64_t slots = int64_t(p.T) * p.k;
  // MXFP4: tiles of 32 rows while experts average at most 32 rows (below).
  const bool rows32 = pinned ? pinned == 32 : slots <= int64_t(32) * p.E;
  const bool mx_wide = sm90_fc1_mx_wide_tiles(p.fp8, p.weights, p.x_permuted,
                                              p.layout == Fc1WeightLayout::kInterleaved, p.I, p.T, p.k, p.E);
  // Block scales: the tile's W1 scales (3 a slice and K block) sit in the
  // epilogue staging (validate_moe_fc1 holds H to kFc1BlockMaxHidden).
  static_assert(kFc1BlockMaxHidden / kScaleK * 3 * 2 * 4 <= 2 * kEpiBytes &&
                    (kFc1BlockMaxHidden / kScaleK + 1) * 3 * 2 * 4 > 2 * kEpiBytes,
                "kFc1BlockMaxHidden is the most H whose W1 scales fit the epilogue staging");
  CUtensorMap w;
  FM_REQUIRE_SUPPORTED(encode_w1(p, wide || mx_wide ? 2 * kSliceW : kSliceW, w), kOp, "W1",
                       "its TMA descriptor could not be encoded");
  CUtensorMap x64 = w, x16 = w;  // used only with a permuted X
  if (p.x_permuted)
    FM_REQUIRE_SUPPORTED(encode_x_permuted(p, x64, x16), kOp, "X", "its TMA descriptors could not be encoded");
  const int esize = p.fp8 != MoeFp8Scaling::kNone ? 1 : 2;
  Fc1KernelParams k{};
  k.X = static_cast<const uint8_t*>(p.X);
  k.x_row_bytes = p.x_stride * esize;
  k.h_bytes = p.H * esize;
  k.p2u = p.p2u;
  k.offsets = p.offsets;
  k.bias = static_cast<const __nv_bfloat16*>(p.bias);
  k.x_scales = p.x_scales;
  k.w_scales = p.w1_scales;
  k.w_mx_scales = p.w1_mx_scales;
  k.out = static_cast<__nv_bfloat16*>(p.out);
  k.out_scales = p.out_scales;
  k.out_ue8m0 = p.out_ue8m0;
  k.T = p.T;
  k.H = p.H;
  k.I = p.I;
  k.E = p.E;
  // The FP8 output (block scales only; I % 128 == 0): a tile runs both
  // 64-column slices of a 128-column scale block, one after the other.
  k.slices = (p.I + kSliceOut - 1) / kSliceOut;  // W1 slices; tiles take Cfg::kSlicesPerTile of them (launch)
  k.k_blocks = (k.h_bytes + kTileBytes - 1) / kTileBytes;
  k.w_row_blocks = (2 * p.I + kScaleK - 1) / kScaleK;
  k.act = int(p.activation);
  k.limit = p.limit;
  k.alpha = p.alpha;
  k.x_permuted = p.x_permuted;
  k.interleaved = p.layout == Fc1WeightLayout::kInterleaved;
  // The ring (measured on an H100, bench/results/ab/fc1-rows-*.json): tiles of
  // up to 128 rows in 6 stages, or up to 256 rows in 4 (W1 slices read once
  // per 256 rows). Gathering, 128 while experts average at most 512 rows
  // (Qwen3-like 785 -> 688 us, DeepSeek-EP decode 652 -> 595 us: more bytes
  // in flight for the cp.async rows; Mixtral-like 5954 -> 5328 us with 256).
  // bf16 from a permuted X (TMA boxes), 256 once experts average more than
  // 128 rows (DeepSeek-EP 1301 -> 1044 us, Qwen3 and Mixtral unchanged;
  // decode keeps 128: 584 vs 600 us; bench/results/ab/fc1-permuted-rows-*.json);
  // FP8 per-tensor keeps the 512 rule (not measured at 128-512 rows). "Rows
  // an expert" is T k / E_local: every slot over the local experts, which
  // overstates it under expert parallelism (most slots are not local).
  // FLASHMIX_FC1_ROWS=128|256 pins one (the A/B). Block-scaled FP8 holds two
  // accumulators: 128 rows, or 64 for decode_sized calls (one consumer
  // warpgroup's M; the other idles), whose smaller stages keep more of W1 in
  // flight and whose MMAs pad a chunk of a few tokens to 64 rows instead of
  // 128. FLASHMIX_FC1_ROWS=64|128 pins one.
  const bool permuted_bf16 = p.x_permuted && p.fp8 == MoeFp8Scaling::kNone;
  const bool rows128 = pinned ? pinned == 128 : slots <= int64_t(permuted_bf16 ? 128 : 512) * p.E;
  if (p.weights == MoeWeightFormat::kMxfp4) {
    // Decode (experts averaging at most 32 rows): tiles of 32 rows, whose
    // small stages let 14 (W4A8) or 16 (W4A16) of them keep the weights'
    // bytes in flight (with 128-row stages, 7 x 8 KB streamed the used
    // experts' packed bytes at ~0.3 of copy on an H100). Else W4A8 in 128-row
    // tiles (two accumulators) or wide tiles (mx_wide_tiles), W4A16 as bf16.
    if (mx_wide) {
      return p.out_scales != nullptr ? launch<Fc1Cfg<128, Fc1In::kMxfp4Fp8, true, true>>(p, k, w, x64, x16, stream)
                                     : launch<Fc1Cfg<128, Fc1In::kMxfp4Fp8, false, true>>(p, k, w, x64, x16, stream);
    }
    if (p.fp8 == MoeFp8Scaling::kBlock)
      return rows32 ? launch<Fc1Cfg<32, Fc1In::kMxfp4Fp8>>(p, k, w, x64, x16, stream)
                    : launch<Fc1Cfg<128, Fc1In::kMxfp4Fp8>>(p, k, w, x64, x16, stream);
    if (rows32) return launch<Fc1Cfg<32, Fc1In::kMxfp4Bf16>>(p, k, w, x64, x16, stream);
    return rows128 ? launch<Fc1Cfg<128, Fc1In::kMxfp4Bf16>>(p, k, w, x64, x16, stream)
                   : launch<Fc1Cfg<256, Fc1In::kMxfp4Bf16>>(p, k, w, x64, x16, stream);
  }
  switch (p.fp8) {
    case MoeFp8Scaling::kBlock:
      if (wide)
        return p.out_scales != nullptr ? launch<Fc1Cfg<128, Fc1In::kFp8Block, true, true>>(p, k, w, x64, x16, stream)
                                       : launch<Fc1Cfg<128, Fc1In::kFp8Block, false, true>>(p, k, w, x64, x16, stream);
      if (pinned ? pinned == 64 : decode_sized(p.T, p.k, p.E))
        return p.out_scales != nullptr ? launch<Fc1Cfg<64, Fc1In::kFp8Block, true>>(p, k, w, x64, x16, stream)
                                       : launch<Fc1Cfg<64, Fc1In::kFp8Block>>(p, k, w, x64, x16, stream);
      return p.out_scales != nullptr ? launch<Fc1Cfg<128, Fc1In::kFp8Block, true>>(p, k, w, x64, x16, stream)
                                     : launch<Fc1Cfg<128, Fc1In::kFp8Block>>(p, k, w, x64, x16, stream);
    case MoeFp8Scaling::kTensor:
      return rows128 ? launch<Fc1Cfg<128, Fc1In::kFp8Tensor>>(p, k, w, x64, x16, stream)
                     : launch<Fc1Cfg<256, Fc1In::kFp8Tensor>>(p, k, w, x64, x16, stream);
    case MoeFp8Scaling::kNone:
      if (wide) return launch<Fc1Cfg<128, Fc1In::kBf16, false, true>>(p, k, w, x64, x16, stream);
      break;
  }
  return rows128 ? launch<Fc1Cfg<128>>(p, k, w, x64, x16, stream) : launch<Fc1Cfg<256>>(p, k, w, x64, x16, stream);
}

}  // namespace flashmix
