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
#include "common/red.cuh"
#include "common/sm90.cuh"
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

// mx_subblock_to_e4m3 with the table path inline.
__device__ __forceinline__ void subblock_to_e4m3(const uint4& w, int s, int group_exp, uint32_t (&o)[8]) {
  const int d = s - 127 - group_exp;
  if (s != kUe8m0NaN && d >= kMxfp4FastMinShift) {
    const E4m3Table t = e4m3_table(d);
#pragma unroll
    for (int i = 0; i < 4; ++i) e2m1x8_to_e4m3_table(word(w, i), t, o[2 * i], o[2 * i + 1]);
  } else {
    uint32_t r[8];
    subblock_to_e4m3_rare(w.x, w.y, w.z, w.w, s, group_exp, r);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = r[i];
  }
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
// bytes by two max steps; a word holding a NaN byte takes the exact rule.
__device__ __forceinline__ int group_exp(uint32_t w) {
  const uint32_t m2 = __vmaxu2(w & 0x00ff00ffu, (w >> 8) & 0x00ff00ffu);
  const int top = int(max(m2 & 0xffffu, m2 >> 16));
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
      const float sc0 = exp2_float(b0 - 127), sc1 = exp2_float(b1 - 127);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // packed word i: elements [8 i, 8 i + 8), MMAs 2 i and 2 i + 1
        uint32_t o0[4], o1[4];
        e2m1x8_to_bf16(word(s.w[t][0], i), sc0, o0);
        e2m1x8_to_bf16(word(s.w[t][1], i), sc1, o1);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (b0 == kUe8m0NaN) o0[c] = 0x7fc07fc0u;
          if (b1 == kUe8m0NaN) o1[c] = 0x7fc07fc0u;
        }
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
// is col0.
template <bool kFc1>
__device__ __forceinline__ Lanes item_lanes(const DecodeParams& p, int e, int col0, int g, int q) {
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
        const int row = col0 + 16 * t + g + 8 * h;
        l.row[t][h] = row < p.n_cols ? row : -1;
      }
    }
  return l;
}

// The chunk's token rows p0 .. p0 + rows - 1 as this thread reads them.
template <bool kFp8>
__device__ __forceinline__ Tokens chunk_tokens(const DecodeParams& p, int p0, int rows, int g, int q) {
  auto x_row = [&](int n) -> int64_t { return p.x_gather ? p.p2u[p0 + n] % p.T : int64_t(p0) + n; };
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
                                             int rows, int col0, int g, int q) {
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
        const int h = col0 + 16 * t + g + 8 * hh;
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

template <bool kFp8, bool kFc1>
__global__ void __launch_bounds__(kThreads, 1) mx_decode_kernel(const DecodeParams p) {
  __shared__ int s_off[kMaxExperts + 1];
  __shared__ int s_first[kMaxExperts + 1];  // each expert's first chunk (prefix of ceil(rows / 8))
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;

  dev::grid_dependency_wait();  // the routing maps and the token rows may come from the kernel ahead
  for (int e = tid; e <= p.E; e += kThreads) s_off[e] = int(p.offsets[e]);
  __syncthreads();
  if (warp == 0) {
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
      int lo = 0, hi = p.E;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_first[mid] <= gc) lo = mid;
        else hi = mid;
      }
      e = lo;
      p0 = s_off[e] + (gc - s_first[e]) * kChunk;
      rows = min(kChunk, s_off[e + 1] - p0);
      tk = chunk_tokens<kFp8>(p, p0, rows, g, q);
      tokens_gc = gc;
    }
    const int col0 = cb * ItemShape<kFc1>::kCols;
    const Lanes l = item_lanes<kFc1>(p, e, col0, g, q);
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
    else fc2_epilogue(p, acc, e, p0, rows, col0, g, q);
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

}  // namespace

bool mx_decode_applies(int64_t T, int k, int E, int64_t rows, int64_t K) {
  if (rows * (K / 2) > INT32_MAX) return false;
  const char* pin = std::getenv("FLASHMIX_MX_DECODE");
  if (pin != nullptr && *pin != '\0') return std::atoi(pin) != 0;
  return T * k <= int64_t(16) * E;
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
  return fp8 ? launch<true, false>(d, p.sm_count, false, kOp, stream)
             : launch<false, false>(d, p.sm_count, false, kOp, stream);
}

}  // namespace flashmix
