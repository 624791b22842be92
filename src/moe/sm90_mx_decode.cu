// MXFP4 expert GEMMs for decode (spec §13.7; docs/mxfp4.md §4.8): FC1 with
// the gather and the activation fused, FC2 with the finalize fused, when the
// experts hold a few rows each and the layer is bound by streaming the used
// experts' packed weights.
//
// Why not the TMA + wgmma kernels: their weight tile goes global -> shared
// (TMA) -> converted -> shared -> wgmma, and at decode the conversion's
// round trip through shared memory and its barriers sat on the critical path
// (docs/mxfp4.md §4.7). Here the weights go from global memory straight into
// registers, are converted there, and feed mma.sync as its A operand; the
// few token rows are the B operand (n = 8), read from global memory (L2)
// into registers as well. No shared memory on the K loop, no barriers.
//
// The product is computed transposed, D^T[weight row, token] = W[e] x X^T.
// mma.sync gives the 4 threads of a quad fixed K columns; since a dot
// product does not care in which order its K terms come, K is permuted the
// same way in A and B so that thread q of a quad holds the 32 consecutive
// elements [32 q, 32 q + 32) of each K block of 128: exactly one MXFP4
// sub-block, i.e. one 16-byte load and one scale byte per weight row. MMA j
// of a K block takes that thread's elements [4 j, 4 j + 4) in both operands
// (m16n8k16: f16 for W4A8, whose e4m3 values widen exactly, since Hopper's
// mma.sync has no e4m3 inputs; bf16 for W4A16).
//
// Work: an item is (expert e, chunk of 8 of its rows, kTiles m16 tiles of
// weight rows: FC1 the gate and the up rows of its output columns, FC2 H
// columns), one warp an item over the whole K, two K blocks of loads in
// flight; the epilogue runs on the C fragments (FC1: the gate and up of a
// column meet in one thread). The items are numbered chunk by chunk (an
// expert's chunks in order, each chunk's column blocks fastest) from
// expert_first_token_offset on the device, and each warp takes one
// contiguous range. An expert of more than 8 rows reads its weights once per
// chunk (the later reads mostly from L2), which is why mx_decode_applies
// keeps this kernel to few rows.
//
// Two kernels share this scheme and its helpers: mx_decode_kernel (a warp an
// item, mma.sync: W4A16, and W4A8 where the warpgroup kernel's token stage
// does not fit in shared memory, K above ~27 K) and mx_decode_wg_kernel
// (W4A8: a warpgroup an item of four warps' rows, wgmma m64n8k32 e4m3 with
// the converted rows as A from registers and the chunk's tokens as B from
// shared memory; section "W4A8 on wgmma" below).
//
// Numerics: W4A8 as the TMA kernels: each row's K block converted to e4m3
// relative to its group exponent E_G (the same conversion functions), the
// block's MMAs summed fresh and promoted into fp32 with 2^E_G times the
// token's scale; W4A16 converts to bf16 with the whole scale and accumulates
// in fp32. The sums run in a different order than the TMA kernels' (not
// bitwise equal to them; bitwise repeatable run to run).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/mma_sync.cuh"
#include "common/red.cuh"
#include "common/sm90.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/vec.cuh"
#include "moe/fc1_activation.cuh"
#include "moe/sm90_mx_decode.h"
#include "mxfp4/mxfp4_convert.cuh"
#include "mxfp4/mxfp4_internal.h"

namespace flashmix {

namespace {

constexpr int kWarps = 12;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 8;       // token rows of an item: the MMAs' n
// m16 tiles of weight rows an item. H100, V4-Flash EP-8 decode: 2 tiles and
// 12 warps (155 registers) 106.8 us at T = 16, 269 us at T = 64; 1 tile and
// 16 warps (128) 120.5 / 252.7 us: more warps, less ILP each.
constexpr int kTiles = 2;
constexpr int kMaxExperts = 1024;
constexpr int kKBlock = 128;    // K a step: one ue8m0 scale word a weight row

struct DecodeParams {
  const uint8_t* W;     // packed e2m1 [E, w_rows, K / 2]
  const uint8_t* w_sc;  // ue8m0 [E, w_rows, K / 32]
  int64_t w_rows;       // rows of one expert's matrix: 2I (FC1) or H (FC2)
  int K;                // H (FC1) or I (FC2), a multiple of 128
  const uint8_t* X;     // the token rows: e4m3 (W4A8) or bf16 (W4A16)
  int64_t x_row_bytes;
  bool x_gather;          // FC1 from a token-order X: row p2u[p] % T; else row p
  const float* x_scales;  // W4A8: [X rows, K / 128]
  const int64_t* offsets;
  const int32_t* p2u;
  int T, E;
  int n_cols;      // output columns: I (FC1) or H (FC2)
  int col_blocks;  // items a chunk: ceil(n_cols / columns an item)
  // FC1
  const __nv_bfloat16* fc1_bias;  // [E, 2I] in W1's row order, or null
  int act;
  float limit, alpha;
  bool interleaved;
  __nv_bfloat16* fc1_out;  // [P, I]
  // W4A8 on wgmma: the L2 prefetch of the weight rows, in K blocks beyond the
  // register loads (-1: none).
  int wg_prefetch;
  // FC2
  Fc2EpilogueParamsDevice epi;
  bool plain_k1;
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Word i of a thread's token elements (static i after unrolling).
template <int N>
__device__ __forceinline__ uint32_t word(const uint4 (&v)[N], int i) {
  return word(v[i >> 2], i & 3);
}

// Where this thread reads for the current item. Tile t, half h: weight row
// g + 8 h of the item's m16 tile t.
struct Lanes {
  const uint8_t* w;   // the expert's packed rows + 16 q
  const uint8_t* sc;  // the expert's scale rows
  int row[kTiles][2];  // the rows within the expert (-1: past the matrix)
  int row_bytes;      // K / 2 (a row's scale bytes: K / 32 = row_bytes / 16)
};
// The chunk's tokens as this thread sees them (the same for all its items).
struct Tokens {
  const uint8_t* x;    // token g's row + its quad share (null: no such token)
  const float* xs[2];  // W4A8: tokens 2q and 2q + 1's scale rows (null: no such token)
};

// One K block of loads.
template <bool kFp8>
struct Step {
  uint4 w[kTiles][2];      // tile t, half h: 16 packed bytes = the row's 32 elements
  uint32_t sw[kTiles][2];  // the rows' scale words (the K block's four sub-blocks)
  uint4 x[kFp8 ? 2 : 4];  // token g's 32 elements of the block
  float xs[2];            // W4A8: tokens 2q, 2q + 1's scales of the block
};

template <bool kFp8>
__device__ __forceinline__ void load_step(const Lanes& l, const Tokens& tk, int kb, Step<kFp8>& s) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = l.row[t][h];
      s.w[t][h] = r >= 0 ? __ldg(reinterpret_cast<const uint4*>(l.w + r * l.row_bytes) + 4 * kb)
                         : make_uint4(0u, 0u, 0u, 0u);
      // Past the matrix: zeros with scale 1.
      s.sw[t][h] = r >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(l.sc + r * (l.row_bytes / 16)) + kb)
                          : 0x7f7f7f7fu;
    }
#pragma unroll
  for (int i = 0; i < (kFp8 ? 2 : 4); ++i)
    s.x[i] = tk.x ? __ldg(reinterpret_cast<const uint4*>(tk.x) + (kFp8 ? 8 : 16) * kb + i) : make_uint4(0u, 0u, 0u, 0u);
  if constexpr (kFp8) {
#pragma unroll
    for (int c = 0; c < 2; ++c) s.xs[c] = tk.xs[c] ? __ldg(tk.xs[c] + kb) : 0.f;
  }
}

// A sub-block outside the table's range (a NaN scale, or a sub-block more
// than 11 binades below its group's largest): rare, kept out of line so the
// K loop's registers stay for the loads in flight.
__device__ __noinline__ void subblock_to_e4m3_rare(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int s,
                                                   int group_exp, uint32_t* out) {
  const uint32_t w[4] = {w0, w1, w2, w3};
  uint32_t o[8];
  mx_subblock_to_e4m3(w, s, group_exp, o);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = o[i];
}

// A sub-block on the table path: every value exact in e4m3 at shift d.
__device__ __forceinline__ void subblock_to_e4m3_fast(const uint4& w, int d, uint32_t (&o)[8]) {
  const E4m3Table t = e4m3_table(d);
#pragma unroll
  for (int i = 0; i < 4; ++i) e2m1x8_to_e4m3_table(word(w, i), t, o[2 * i], o[2 * i + 1]);
}

// A sub-block by the exact rule (out of line).
__device__ __forceinline__ void subblock_to_e4m3_exact(const uint4& w, int s, int group_exp, uint32_t (&o)[8]) {
  uint32_t r[8];
  subblock_to_e4m3_rare(w.x, w.y, w.z, w.w, s, group_exp, r);
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = r[i];
}

// mx_subblock_to_e4m3 with the table path inline.
__device__ __forceinline__ void subblock_to_e4m3(const uint4& w, int s, int group_exp, uint32_t (&o)[8]) {
  const int d = s - 127 - group_exp;
  if (s != kUe8m0NaN && d >= kMxfp4FastMinShift) subblock_to_e4m3_fast(w, d, o);
  else subblock_to_e4m3_exact(w, s, group_exp, o);
}

// Four e4m3 bytes as two f16x2 (bytes 0, 1 and 2, 3); exact.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// D += A (16 x 16 f16) x B (16 x 8 f16), fp32 accumulators.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The K block's MMAs into acc[t] (the C fragments of the two m16 tiles).
// W4A8: Hopper's mma.sync has no e4m3 inputs (ptxas would widen every MMA's
// operands itself), so the e4m3 codes are widened to f16 here, exactly, the
// token's once for both tiles; MMA j takes e4m3 word j of the thread's 32
// elements (its values 4 j .. 4 j + 3) in A and in B.
// E_G of a row's K block (mx_group_exp): the largest of its four scale
// bytes (top_byte: two max steps, E_G + 127 + 6 where no byte is NaN); a
// word holding a NaN byte takes the exact rule.
__device__ __forceinline__ int top_byte(uint32_t w) {
  const uint32_t m2 = __vmaxu2(w & 0x00ff00ffu, (w >> 8) & 0x00ff00ffu);
  return int(max(m2 & 0xffffu, m2 >> 16));
}
__device__ __forceinline__ int group_exp(uint32_t w) {
  const int top = top_byte(w);
  return top == kUe8m0NaN ? mx_group_exp(w) : top - 127 - kMxfp4Fp8TopShift;
}

template <bool kFp8>
__device__ __forceinline__ void compute_step(const Step<kFp8>& s, int q, float (&acc)[kTiles][4]) {
  if constexpr (kFp8) {
    uint32_t b[16];  // the token's e4m3 as f16, once for both tiles
#pragma unroll
    for (int j = 0; j < 8; ++j) e4m3x4_to_f16(word(s.x, j), b[2 * j], b[2 * j + 1]);
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const int e0 = group_exp(s.sw[t][0]), e1 = group_exp(s.sw[t][1]);
      uint32_t o0[8], o1[8];
      subblock_to_e4m3(s.w[t][0], int((s.sw[t][0] >> (8 * q)) & 0xffu), e0, o0);
      subblock_to_e4m3(s.w[t][1], int((s.sw[t][1] >> (8 * q)) & 0xffu), e1, o1);
      // Two accumulator chains (even and odd MMAs), summed in that order.
      float pa[4] = {0.f, 0.f, 0.f, 0.f}, pb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t a0, a1, a2, a3;
        e4m3x4_to_f16(o0[j], a0, a2);
        e4m3x4_to_f16(o1[j], a1, a3);
        mma_f16_16816(j & 1 ? pb : pa, a0, a1, a2, a3, b[2 * j], b[2 * j + 1]);
      }
      const float g0 = exp2_float(e0), g1 = exp2_float(e1);
      acc[t][0] = fmaf(pa[0] + pb[0], g0 * s.xs[0], acc[t][0]);
      acc[t][1] = fmaf(pa[1] + pb[1], g0 * s.xs[1], acc[t][1]);
      acc[t][2] = fmaf(pa[2] + pb[2], g1 * s.xs[0], acc[t][2]);
      acc[t][3] = fmaf(pa[3] + pb[3], g1 * s.xs[1], acc[t][3]);
    }
  } else {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const int b0 = int((s.sw[t][0] >> (8 * q)) & 0xffu), b1 = int((s.sw[t][1] >> (8 * q)) & 0xffu);
      const Bf16Table t0 = bf16_table_ue8m0(b0), t1 = bf16_table_ue8m0(b1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // packed word i: elements [8 i, 8 i + 8), MMAs 2 i and 2 i + 1
        uint32_t o0[4], o1[4];
        e2m1x8_to_bf16_table(word(s.w[t][0], i), t0, o0);
        e2m1x8_to_bf16_table(word(s.w[t][1], i), t1, o1);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * i + jj;
          const uint32_t a[4] = {o0[2 * jj], o1[2 * jj], o0[2 * jj + 1], o1[2 * jj + 1]};
          dev::mma_bf16_16816(acc[t], a, word(s.x, 2 * j), word(s.x, 2 * j + 1));
        }
      }
    }
  }
}

template <bool kFc1>
struct ItemShape {
  // Output columns an item: FC1 a tile's rows g its gate rows, g + 8 its up
  // rows (or with two tiles, tile 0 gate, tile 1 up); FC2 16 a tile.
  static constexpr int kCols = kFc1 ? 8 * kTiles : 16 * kTiles;
};

// This thread's weight rows of the item of expert e whose first output column
// is col0 (the warp's first, on the warpgroup kernel). FC2's tile t starts
// tile_rows * t rows further: 16 (m16 tiles) or 64 (a warpgroup's m64 tiles,
// of which the warp holds 16 rows).
template <bool kFc1>
__device__ __forceinline__ Lanes item_lanes(const DecodeParams& p, int e, int col0, int tile_rows, int g, int q) {
  Lanes l;
  l.row_bytes = p.K / 2;
  const int64_t first = int64_t(e) * p.w_rows;  // the expert's first row
  l.w = p.W + first * l.row_bytes + 16 * q;
  l.sc = p.w_sc + first * (p.K / 32);
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kFc1) {
        // Output column j: its gate row (u = 0) or its up row (u = 1).
        const int j = kTiles == 1 ? col0 + g : col0 + g + 8 * h, u = kTiles == 1 ? h : t;
        l.row[t][h] = j >= p.n_cols ? -1 : p.interleaved ? 2 * j + u : j + u * p.n_cols;
      } else {
        const int row = col0 + tile_rows * t + g + 8 * h;
        l.row[t][h] = row < p.n_cols ? row : -1;
      }
    }
  return l;
}

// X's row of the chunk's n-th token row: gathered (token p2u[p] % T) or permuted (row p).
__device__ __forceinline__ int64_t chunk_x_row(const DecodeParams& p, int p0, int n) {
  return p.x_gather ? p.p2u[p0 + n] % p.T : int64_t(p0) + n;
}

// The chunk's token rows p0 .. p0 + rows - 1 as this thread reads them.
template <bool kFp8>
__device__ __forceinline__ Tokens chunk_tokens(const DecodeParams& p, int p0, int rows, int g, int q) {
  auto x_row = [&](int n) { return chunk_x_row(p, p0, n); };
  Tokens tk;
  tk.x = g < rows ? p.X + x_row(g) * p.x_row_bytes + q * (kFp8 ? 32 : 64) : nullptr;
#pragma unroll
  for (int c = 0; c < 2; ++c)
    tk.xs[c] = kFp8 && 2 * q + c < rows ? p.x_scales + x_row(2 * q + c) * (p.K / kKBlock) : nullptr;
  return tk;
}

// FC1: out[p, j] = bf16(act(gate + b_g, up + b_u)) from the C fragments: the
// gate tile's and the up tile's element c are the same (column, token).
__device__ __forceinline__ void fc1_epilogue(const DecodeParams& p, const float (&acc)[kTiles][4], int e, int p0,
                                             int rows, int col0, int g, int q) {
  const __nv_bfloat16* b = p.fc1_bias != nullptr ? p.fc1_bias + int64_t(e) * 2 * p.n_cols : nullptr;
#pragma unroll
  for (int c = 0; c < (kTiles == 1 ? 2 : 4); ++c) {
    const int j = col0 + g + 8 * (c >> 1), n = 2 * q + (c & 1);
    if (j >= p.n_cols || n >= rows) continue;
    float gate = acc[0][c], up = kTiles == 1 ? acc[0][2 + c] : acc[kTiles - 1][c];
    if (b != nullptr) {
      gate += __bfloat162float(b[p.interleaved ? 2 * j : j]);
      up += __bfloat162float(b[p.interleaved ? 2 * j + 1 : p.n_cols + j]);
    }
    p.fc1_out[int64_t(p0 + n) * p.n_cols + j] = __float2bfloat16_rn(fc1_activate(p.act, p.limit, p.alpha, gate, up));
  }
}

// FC2: the finalize of Fc2EpilogueOp from the C fragments. Columns h and
// h + 1 of a token sit in lanes g and g + 1 (4 lanes apart): the even-g lane
// takes its neighbour's value and writes the pair.
__device__ __forceinline__ void fc2_epilogue(const DecodeParams& p, const float (&acc)[kTiles][4], int e, int p0,
                                             int rows, int col0, int tile_rows, int g, int q) {
  float nb[kTiles][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int c = 0; c < 4; ++c) nb[t][c] = __shfl_down_sync(0xffffffffu, acc[t][c], 4);
  if (g & 1) return;
  const Fc2EpilogueParamsDevice& ep = p.epi;
#pragma unroll
  for (int c2 = 0; c2 < 2; ++c2) {  // token 2q + c2
    const int n = 2 * q + c2;
    if (n >= rows) continue;
    const int prow = p0 + n;
    float w = 1.f;
    int tok = 0;
    if (ep.op != int(Fc2EpilogueOp::kRowsBf16)) {
      const int s = p.p2u[prow];
      tok = s % ep.T;
      if (ep.scales != nullptr) w = ep.scales[int64_t(tok) * ep.k + s / ep.T];
    }
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int c = 2 * hh + c2;
        const int h = col0 + tile_rows * t + g + 8 * hh;
        if (h >= p.n_cols) continue;  // H is even: h + 1 < H too
        float v0 = acc[t][c], v1 = nb[t][c];
        if (ep.op == int(Fc2EpilogueOp::kRowsBf16)) {
          __nv_bfloat16* d = static_cast<__nv_bfloat16*>(ep.dst) + int64_t(prow) * ep.dst_stride + h;
          *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(v0, v1);
          continue;
        }
        if (ep.bias != nullptr) {
          const __nv_bfloat162 bb = *reinterpret_cast<const __nv_bfloat162*>(ep.bias + int64_t(e) * ep.H + h);
          v0 += __low2float(bb);
          v1 += __high2float(bb);
        }
        v0 *= w;
        v1 *= w;
        if (ep.op == int(Fc2EpilogueOp::kRedBf16)) {
          __nv_bfloat16* d = static_cast<__nv_bfloat16*>(ep.dst) + int64_t(tok) * ep.dst_stride + h;
          const __nv_bfloat162 x = __floats2bfloat162_rn(v0, v1);
          if (p.plain_k1) *reinterpret_cast<__nv_bfloat162*>(d) = x;
          else dev::red_add_bf16x2(d, *reinterpret_cast<const uint32_t*>(&x));
        } else if (ep.op == int(Fc2EpilogueOp::kRedFp32)) {
          dev::red_add_f32x2(static_cast<float*>(ep.dst) + int64_t(tok) * ep.dst_stride + h, v0, v1);
        } else {  // kRowsFp32Scaled
          *reinterpret_cast<float2*>(static_cast<float*>(ep.dst) + int64_t(prow) * ep.dst_stride + h) =
              make_float2(v0, v1);
        }
      }
  }
}

// Every expert's rows (s_off: the offsets, as int) and first chunk of 8 rows
// (s_first: the prefix of ceil(rows / 8)), in shared memory, after the
// kernel ahead (PDL) has written the routing maps. Ends in __syncthreads.
__device__ __forceinline__ void chunk_table(const DecodeParams& p, int* s_off, int* s_first) {
  const int tid = threadIdx.x, lane = tid & 31;
  dev::grid_dependency_wait();  // the routing maps and the token rows may come from the kernel ahead
  for (int e = tid; e <= p.E; e += blockDim.x) s_off[e] = int(p.offsets[e]);
  __syncthreads();
  if (tid < 32) {
    int run = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
      const int e = e0 + lane;
      int c = e < p.E ? (s_off[e + 1] - s_off[e] + kChunk - 1) / kChunk : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, c, d);
        if (lane >= d) c += y;
      }
      if (e < p.E) s_first[e + 1] = run + c;
      run += __shfl_sync(0xffffffffu, c, 31);
    }
    if (lane == 0) s_first[0] = 0;
  }
  __syncthreads();
}

// The expert of chunk gc: the last whose first chunk is <= gc (a non-empty one).
__device__ __forceinline__ int chunk_expert(const int* s_first, int E, int gc) {
  int lo = 0, hi = E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (s_first[mid] <= gc) lo = mid;
    else hi = mid;
  }
  return lo;
}

template <bool kFp8, bool kFc1>
__global__ void __launch_bounds__(kThreads, 1) mx_decode_kernel(const DecodeParams p) {
  __shared__ int s_off[kMaxExperts + 1];
  __shared__ int s_first[kMaxExperts + 1];  // each expert's first chunk (prefix of ceil(rows / 8))
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;

  chunk_table(p, s_off, s_first);

  // This warp's items: one contiguous range of all (chunk, column block)
  // pairs, column blocks fastest.
  const int64_t items = int64_t(s_first[p.E]) * p.col_blocks;
  const int64_t warps = int64_t(gridDim.x) * kWarps, gw = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t i_begin = items * gw / warps, i_end = items * (gw + 1) / warps;
  const int kbs = p.K / kKBlock;
  int gc = int(i_begin / p.col_blocks), cb = int(i_begin % p.col_blocks);  // chunk and column block
  int e = 0, p0 = 0, rows = 0, tokens_gc = -1;
  Tokens tk{};
  for (int64_t it = i_begin; it < i_end; ++it) {
    if (gc != tokens_gc) {  // a new chunk: its expert (the last whose first chunk is <= gc, a non-empty one)
      e = chunk_expert(s_first, p.E, gc);
      p0 = s_off[e] + (gc - s_first[e]) * kChunk;
      rows = min(kChunk, s_off[e + 1] - p0);
      tk = chunk_tokens<kFp8>(p, p0, rows, g, q);
      tokens_gc = gc;
    }
    const int col0 = cb * ItemShape<kFc1>::kCols;
    const Lanes l = item_lanes<kFc1>(p, e, col0, 16, g, q);
    if (++cb == p.col_blocks) {
      cb = 0;
      ++gc;
    }

    // The whole K: two K blocks of loads in flight.
    float acc[kTiles][4] = {};
    Step<kFp8> s0, s1;
    load_step(l, tk, 0, s0);
    if (kbs > 1) load_step(l, tk, 1, s1);
    for (int kb = 0; kb < kbs; kb += 2) {
      compute_step(s0, q, acc);
      if (kb + 2 < kbs) load_step(l, tk, kb + 2, s0);
      if (kb + 1 < kbs) {
        compute_step(s1, q, acc);
        if (kb + 3 < kbs) load_step(l, tk, kb + 3, s1);
      }
    }
    if constexpr (kFc1) fc1_epilogue(p, acc, e, p0, rows, col0, g, q);
    else fc2_epilogue(p, acc, e, p0, rows, col0, 16, g, q);
  }
}

// ---------------------------------------------------------------------------
// W4A8 on wgmma: a warpgroup an item.
//
// Each warp holds the rows of the kernel above (two m16 tiles: FC1 the gate
// and the up rows of 16 columns, FC2 16 H rows each), converts them the same
// way, and the warpgroup's four warps together multiply the two m64 tiles
// with wgmma m64n8k32 e4m3, A (the converted rows) from registers and B (the
// chunk's 8 token rows) from shared memory, staged once a chunk. That drops
// mma.sync's widening of both operands to f16 (Hopper's mma.sync has no e4m3
// inputs) and the tokens' registers. An item: 64 output columns (FC1) or 128
// H rows (FC2) of one chunk; the warpgroups take contiguous item ranges.
constexpr int kWgThreads = 128;
// Warpgroups a CTA at most: 3 at <= 168 registers (4 spill at 128; H200:
// 89.4 / 196 us against 86.5 / 195 at T = 16 / 64).
constexpr int kMaxWgs = 3;
// The L2 prefetch distance of the weight rows, in K blocks beyond the
// register loads' two (a prefetch takes a 128-byte line, two K blocks;
// FLASHMIX_MX_WG_PREFETCH overrides it, -1: none). H200, V4-Flash EP-8
// decode, T = 16 / 64 (docs/mxfp4.md §4.11): 0 76.1 / 162.2 us, 2 78.3 /
// 173.0, 4 82.2 / 187.3, none 87.3 / 199.8.
constexpr int kWgPrefetch = 0;

// B's layout. wgmma's A fragment gives thread q of a quad the K columns
// {4q .. 4q+3} and {16+4q .. 16+4q+3} of k32 step j; the thread's converted
// words o[2j], o[2j+1] are the elements [8j, 8j+4) and [8j+4, 8j+8) of its
// sub-block q. So in a K block the physical column 32j + 16u + 4q + b holds
// the logical element 32q + 8j + 4u + b, and the tokens are stored in that
// order: K-major without swizzle, core matrix c (physical columns [16c,
// 16c+16) of the 8 tokens, 16 bytes a token) at 128c bytes; step j of K
// block kb spans core matrices 8kb + 2j and 8kb + 2j + 1 (leading byte
// offset 128). After the codes: the tokens' scales, [8][K / 128] floats.
__host__ __device__ constexpr size_t wg_stage_bytes(int K) {
  return (size_t(8) * K + size_t(8) * (K / kKBlock) * sizeof(float) + 127) / 128 * 128;
}

__device__ __forceinline__ uint64_t wg_b_desc(uint32_t addr) {
  // Put together from its 32-bit halves: from the same value as 64-bit
  // shifts and ors ptxas emitted 16 more instructions in the two kernels.
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(((addr & 0x3FFFF) >> 4) | ((128 >> 4) << 16)), "r"(128 >> 4));
  return d;
}

// The shared memory of a CTA: the chunk tables (E + 1 ints twice), then a
// token stage a warpgroup.
__host__ __device__ constexpr size_t wg_tables_bytes(int E) { return (size_t(8) * (E + 1) + 127) / 128 * 128; }
__host__ __device__ constexpr size_t wg_smem_bytes(int E, int K, int wgs) {
  return wg_tables_bytes(E) + size_t(wgs) * wg_stage_bytes(K);
}

// The warp's four weight rows of an item as pointers at K block kb (the K
// loop advances them once a round of two blocks, so that each load is the
// pointer plus a constant). A row past the matrix reads the expert's row 0
// instead: its outputs are never stored, and no load is predicated.
struct WgRows {
  const uint4* w[kTiles][2];      // the row's 16 bytes of K block kb at w + 4 * kb
  const uint32_t* sc[kTiles][2];  // its scale word at sc + kb
};

__device__ __forceinline__ WgRows wg_rows(const Lanes& l) {
  WgRows r;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = max(l.row[t][h], 0);
      r.w[t][h] = reinterpret_cast<const uint4*>(l.w + int64_t(row) * l.row_bytes);
      r.sc[t][h] = reinterpret_cast<const uint32_t*>(l.sc + int64_t(row) * (l.row_bytes / 16));
    }
  return r;
}

__device__ __forceinline__ void wg_advance(WgRows& r, int blocks) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.w[t][h] += 4 * blocks;
      r.sc[t][h] += blocks;
    }
}

// K block kb + off of every row into the stage (off: a constant after
// unrolling, an immediate in the loads).
__device__ __forceinline__ void wg_load(const WgRows& r, int off, Step<true>& s) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s.w[t][h] = __ldg(r.w[t][h] + 4 * off);
      s.sw[t][h] = __ldg(r.sc[t][h] + off);
    }
}

// The chunk's token rows p0 .. p0 + rows - 1 into tok / xs (zeros past
// `rows`), by the warpgroup's 128 threads (t: the thread's index in it).
__device__ __forceinline__ void wg_stage_tokens(const DecodeParams& p, int p0, int rows, uint8_t* tok, float* xs,
                                                int t) {
  const int kbs = p.K / kKBlock, per_token = 8 * kbs;  // 16-byte pieces of a token row
  auto x_row = [&](int n) { return chunk_x_row(p, p0, n); };
  for (int u = t; u < 8 * per_token; u += kWgThreads) {
    const int n = u / per_token, r = u - n * per_token, kb = r >> 3, q = (r >> 1) & 3, half = r & 1;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (n < rows)
      v = __ldg(reinterpret_cast<const uint4*>(p.X + x_row(n) * p.x_row_bytes + kb * kKBlock + 32 * q + 16 * half));
    // Word i: logical elements 32q + 16 half + 4i .. + 3 -> core matrix 8kb + 4 half + i, at 4q in token n's row.
    uint8_t* d = tok + (8 * kb + 4 * half) * 128 + 16 * n + 4 * q;
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint32_t*>(d + 128 * i) = word(v, i);
  }
  for (int u = t; u < per_token; u += kWgThreads) {  // 8 tokens x kbs scales
    const int n = u / kbs, kb = u - n * kbs;
    xs[u] = n < rows ? __ldg(p.x_scales + x_row(n) * kbs + kb) : 0.f;
  }
}

// The four wgmmas of tile t's K block (k32 steps j): A the converted rows
// (rows g: o_g, g + 8: o_g8), B the tokens' core matrices from b_addr.
__device__ __forceinline__ void wg_tile_mmas(float (&part)[4], const uint32_t (&o_g)[8], const uint32_t (&o_g8)[8],
                                             uint32_t b_addr) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a[4] = {o_g[2 * j], o_g8[2 * j], o_g[2 * j + 1], o_g8[2 * j + 1]};
    dev::WgmmaFp8RS<8>::mma(part, a, wg_b_desc(b_addr + 256 * j), j);
  }
}

// One K block: the rows converted, the stage refilled with K block kb +
// next when `reload` (its registers are free once converted, and the loads
// fly during the MMAs), 2 x 4 wgmmas into fresh partials, promoted into acc
// with 2^E_G times the token's scale. Whether every row's sub-block takes
// the table (no NaN scale, at most 11 binades below its group's largest,
// 2^E_G a normal float) is decided once for the four rows; the exact
// conversion (out of line) takes the K block otherwise.
__device__ __forceinline__ void wg_k_block(Step<true>& s, const WgRows& r, int next, bool reload, int q, uint32_t b_addr,
                                           float xs0, float xs1, float (&part)[kTiles][4], float (&acc)[kTiles][4]) {
  uint32_t o[kTiles][2][8];
  int top[kTiles][2], d[kTiles][2];
  float gs[kTiles][2];  // 2^E_G
  bool fast = true;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sq = int((s.sw[t][h] >> (8 * q)) & 0xffu);
      top[t][h] = top_byte(s.sw[t][h]);
      // The table's range, and 2^E_G a normal float (E_G = top - 127 - 6 >= -126).
      fast = fast && top[t][h] != kUe8m0NaN && top[t][h] - sq <= kMxfp4Fp8TopShift - kMxfp4FastMinShift &&
             top[t][h] >= kMxfp4Fp8TopShift + 1;
      d[t][h] = sq - top[t][h] + kMxfp4Fp8TopShift;
    }
  // Decided for the whole warp (and rarely false): a divergent branch here
  // would make ptxas serialise the wgmmas that read these registers.
  if (__all_sync(0xffffffffu, fast)) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        subblock_to_e4m3_fast(s.w[t][h], d[t][h], o[t][h]);
        gs[t][h] = __int_as_float((top[t][h] - kMxfp4Fp8TopShift) << 23);
      }
  } else {
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ge = mx_group_exp(s.sw[t][h]);
        subblock_to_e4m3_exact(s.w[t][h], int((s.sw[t][h] >> (8 * q)) & 0xffu), ge, o[t][h]);
        gs[t][h] = exp2_float(ge);
      }
  }
  if (reload) wg_load(r, next, s);  // the registers are free once converted: the loads fly during the MMAs
  dev::wgmma_fence();
  wg_tile_mmas(part[0], o[0][0], o[0][1], b_addr);
  wg_tile_mmas(part[1], o[1][0], o[1][1], b_addr);
  dev::wgmma_commit();
  dev::wgmma_wait<0>();
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    dev::fence_operands(part[t]);
    const float g0 = gs[t][0], g1 = gs[t][1];
    acc[t][0] = fmaf(part[t][0], g0 * xs0, acc[t][0]);
    acc[t][1] = fmaf(part[t][1], g0 * xs1, acc[t][1]);
    acc[t][2] = fmaf(part[t][2], g1 * xs0, acc[t][2]);
    acc[t][3] = fmaf(part[t][3], g1 * xs1, acc[t][3]);
  }
}

template <bool kFc1>
struct WgItemShape {
  // Output columns a warpgroup item: four warps' (ItemShape) side by side,
  // FC2's as two m64 tiles.
  static constexpr int kCols = 4 * ItemShape<kFc1>::kCols;
  static constexpr int kTileRows = kFc1 ? 16 : 64;
};

// Up to kMaxWgs warpgroups a CTA (fewer where their token stages do not
// fit), each on its own items and token stage. (One warpgroup a CTA, three
// CTAs an SM, keeps every wgmma descriptor on the uniform datapath but was
// slower where a warpgroup takes several items: H200, T = 64, 186.5-191.8
// against 162-173 us.)
template <bool kFc1>
__global__ void __launch_bounds__(kWgThreads* kMaxWgs, 1) mx_decode_wg_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t wg_smem[];
  int* s_off = reinterpret_cast<int*>(wg_smem);
  int* s_first = s_off + p.E + 1;
  const int n_wg = int(blockDim.x) / kWgThreads;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / kWgThreads, 0);
  const int wt = int(threadIdx.x) % kWgThreads, wq = wt >> 5;
  const int lane = wt & 31, g = lane >> 2, q = lane & 3;
  const int kbs = p.K / kKBlock;
  uint8_t* tok = wg_smem + wg_tables_bytes(p.E) + size_t(wg) * wg_stage_bytes(p.K);
  float* xs = reinterpret_cast<float*>(tok + size_t(8) * p.K);
  const uint32_t tok_addr = dev::smem_u32(tok);
  auto wg_sync = [&] { dev::named_bar_sync(1 + wg, kWgThreads); };

  chunk_table(p, s_off, s_first);

  const int64_t items = int64_t(s_first[p.E]) * p.col_blocks;
  const int64_t wgs = int64_t(gridDim.x) * n_wg, gw = int64_t(blockIdx.x) * n_wg + wg;
  const int64_t i_begin = items * gw / wgs, i_end = items * (gw + 1) / wgs;
  int gc = int(i_begin / p.col_blocks), cb = int(i_begin % p.col_blocks);
  int e = 0, p0 = 0, rows = 0, tokens_gc = -1;
  float part[kTiles][4] = {};
  for (int64_t it = i_begin; it < i_end; ++it) {
    const bool new_chunk = gc != tokens_gc;
    if (new_chunk) {
      e = chunk_expert(s_first, p.E, gc);
      p0 = s_off[e] + (gc - s_first[e]) * kChunk;
      rows = min(kChunk, s_off[e + 1] - p0);
    }
    const int col0 = cb * WgItemShape<kFc1>::kCols + 16 * wq;  // this warp's first column (FC2: row of tile 0)
    const Lanes l = item_lanes<kFc1>(p, e, col0, WgItemShape<kFc1>::kTileRows, g, q);
    // The item's first two K blocks are requested before anything waits (the
    // token stage below, a chain of dependent loads, runs in their shadow).
    Step<true> s0, s1;
    WgRows r = wg_rows(l);
    wg_load(r, 0, s0);
    if (kbs > 1) wg_load(r, 1, s1);
    // Lane (g, q) prefetches into L2 the 128-byte line (two K blocks) of row
    // (tile q / 2, half q % 2) of the warp's 32.
    const int pf_row = l.row[q >> 1][q & 1];
    const uint8_t* pf = pf_row >= 0 && p.wg_prefetch >= 0 ? l.w - 16 * q + int64_t(pf_row) * l.row_bytes : nullptr;
    const int pf_ahead = 2 + max(p.wg_prefetch, 0);
    if (new_chunk) {
      wg_sync();  // every wgmma on the previous chunk's tokens has been waited for
      wg_stage_tokens(p, p0, rows, tok, xs, wt);
      dev::fence_proxy_async_shared();
      wg_sync();
      tokens_gc = gc;
    }
    if (++cb == p.col_blocks) {
      cb = 0;
      ++gc;
    }

    float acc[kTiles][4] = {};
    const float* xq = xs + 2 * q * kbs;
    for (int kb = 0; kb < kbs; kb += 2) {  // r at K block kb; the stage holds kb and kb + 1
      if (pf != nullptr && kb + pf_ahead < kbs) dev::prefetch_l2(pf + 64 * (kb + pf_ahead));
      wg_k_block(s0, r, 2, kb + 2 < kbs, q, tok_addr + 1024u * kb, xq[kb], xq[kbs + kb], part, acc);
      if (kb + 1 < kbs)
        wg_k_block(s1, r, 3, kb + 3 < kbs, q, tok_addr + 1024u * (kb + 1), xq[kb + 1], xq[kbs + kb + 1], part, acc);
      wg_advance(r, 2);
    }
    if constexpr (kFc1) fc1_epilogue(p, acc, e, p0, rows, col0, g, q);
    else fc2_epilogue(p, acc, e, p0, rows, col0, WgItemShape<kFc1>::kTileRows, g, q);
  }
}

template <bool kFp8, bool kFc1>
Status launch(const DecodeParams& d, int sm_count, bool pdl, const char* op, cudaStream_t stream) {
  const auto kernel = mx_decode_kernel<kFp8, kFc1>;
  int per_sm = 0;
  FM_RETURN_IF_ERROR(
      detail::cuda_status(detail::blocks_per_sm(detail::kernel_key(kernel), kThreads, 0, &per_sm), op,
                          "kernel attributes"));
  FM_REQUIRE_SUPPORTED(per_sm > 0, op, "device", "the MXFP4 decode kernel does not fit on this device");
  FM_RETURN_IF_ERROR(detail::cuda_status(
      dev::launch(kernel, dim3(unsigned(sm_count * per_sm)), dim3(kThreads), 0, stream, pdl, d), op,
      "kernel launch"));
  return Status::Ok();
}

// W4A8 on the warpgroup kernel, with as many warpgroups a CTA (up to 3) as
// their token stages fit in shared memory; *launched false (nothing done)
// where not even one fits (K above ~27 K), or FLASHMIX_MX_DECODE_WG=0 pins
// the mma.sync kernel (the A/B).
template <bool kFc1>
Status launch_wg(DecodeParams d, int sm_count, bool pdl, const char* op, cudaStream_t stream, bool* launched) {
  *launched = false;
  const char* pin = std::getenv("FLASHMIX_MX_DECODE_WG");
  if (pin != nullptr && *pin != '\0' && std::atoi(pin) == 0) return Status::Ok();
  // Tuning knobs for the A/B, not an API.
  const char* pf = std::getenv("FLASHMIX_MX_WG_PREFETCH");
  d.wg_prefetch = pf != nullptr && *pf != '\0' ? std::atoi(pf) : kWgPrefetch;
  d.col_blocks = (d.n_cols + WgItemShape<kFc1>::kCols - 1) / WgItemShape<kFc1>::kCols;
  const auto kernel = mx_decode_wg_kernel<kFc1>;
  for (int n = kMaxWgs; n >= 1; --n) {
    const size_t smem = wg_smem_bytes(d.E, d.K, n);
    int per_sm = 0;
    FM_RETURN_IF_ERROR(detail::cuda_status(
        detail::blocks_per_sm(detail::kernel_key(kernel), n * kWgThreads, smem, &per_sm), op, "kernel attributes"));
    if (per_sm == 0) continue;
    FM_RETURN_IF_ERROR(detail::cuda_status(
        dev::launch(kernel, dim3(unsigned(sm_count * per_sm)), dim3(n * kWgThreads), smem, stream, pdl, d), op,
        "kernel launch"));
    *launched = true;
    return Status::Ok();
  }
  return Status::Ok();
}

}  // namespace

bool mx_decode_applies(int64_t T, int k, int E, int64_t rows, int64_t K) {
  if (rows * (K / 2) > INT32_MAX) return false;
  const char* pin = std::getenv("FLASHMIX_MX_DECODE");
  if (pin != nullptr && *pin != '\0') return std::atoi(pin) != 0;
  return decode_sized(T, k, E);
}

Status sm90_fc1_run_mx_decode(const Sm90Fc1Params& p, cudaStream_t stream) {
  const bool fp8 = p.fp8 == MoeFp8Scaling::kBlock;
  DecodeParams d{};
  d.W = static_cast<const uint8_t*>(p.W1);
  d.w_sc = p.w1_mx_scales;
  d.w_rows = 2 * int64_t(p.I);
  d.K = p.H;
  d.X = static_cast<const uint8_t*>(p.X);
  d.x_row_bytes = p.x_stride * (fp8 ? 1 : 2);
  d.x_gather = !p.x_permuted;
  d.x_scales = p.x_scales;
  d.offsets = p.offsets;
  d.p2u = p.p2u;
  d.T = p.T;
  d.E = p.E;
  d.n_cols = p.I;
  d.col_blocks = (p.I + ItemShape<true>::kCols - 1) / ItemShape<true>::kCols;
  d.fc1_bias = static_cast<const __nv_bfloat16*>(p.bias);
  d.act = int(p.activation);
  d.limit = p.limit;
  d.alpha = p.alpha;
  d.interleaved = p.layout == Fc1WeightLayout::kInterleaved;
  d.fc1_out = static_cast<__nv_bfloat16*>(p.out);
  constexpr const char* kOp = "moe_fc1";
  if (fp8) {
    bool launched = false;
    FM_RETURN_IF_ERROR(launch_wg<true>(d, p.sm_count, p.pdl, kOp, stream, &launched));
    if (launched) return Status::Ok();
  }
  return fp8 ? launch<true, true>(d, p.sm_count, p.pdl, kOp, stream)
             : launch<false, true>(d, p.sm_count, p.pdl, kOp, stream);
}

Status sm90_fc2_run_mx_decode(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
  const bool fp8 = p.fp8 == MoeFp8Scaling::kBlock;
  DecodeParams d{};
  d.W = static_cast<const uint8_t*>(p.W2);
  d.w_sc = p.w2_mx_scales;
  d.w_rows = p.H;
  d.K = p.I;
  d.X = static_cast<const uint8_t*>(p.A);
  d.x_row_bytes = int64_t(p.I) * (fp8 ? 1 : 2);
  d.x_gather = false;
  d.x_scales = p.a_scales;
  d.offsets = p.offsets;
  d.p2u = p.p2u;
  d.T = p.T;
  d.E = p.E;
  d.n_cols = p.H;
  d.col_blocks = (p.H + ItemShape<false>::kCols - 1) / ItemShape<false>::kCols;
  d.epi = fc2_epilogue_params(p);
  d.plain_k1 = p.op == Fc2EpilogueOp::kRedBf16 && p.k == 1 && !p.add_to_out;
  constexpr const char* kOp = "moe_fc2_finalize";
  if (fp8) {
    bool launched = false;
    FM_RETURN_IF_ERROR(launch_wg<false>(d, p.sm_count, false, kOp, stream, &launched));
    if (launched) return Status::Ok();
  }
  return fp8 ? launch<true, false>(d, p.sm_count, false, kOp, stream)
             : launch<false, false>(d, p.sm_count, false, kOp, stream);
}

}  // namespace flashmix
