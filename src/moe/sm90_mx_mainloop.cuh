// The consumer mainloop of our grouped GEMMs (FC1 and FC2, sm_90a) over
// MXFP4 weights (spec §13.7; design: docs/mxfp4.md §4). The weight operand
// (128 rows a tile, M) arrives by TMA as its packed e2m1 bytes, unswizzled:
// 64 bytes a row a stage for W4A8 (128 of K, e4m3 activations), 32 for W4A16
// (64 of K, bf16 activations). Each consumer warpgroup converts its 64 rows
// into a tile of its own (64 rows x 128 bytes, 128-byte swizzle: what the
// wgmma reads), one stage ahead, so the conversion of stage kb + 1 overlaps
// stage kb's MMAs (two converted tiles a warpgroup):
//
//   wait full[s0]; convert s0 -> tile 0
//   for kb: fence.proxy.async; warpgroup barrier; MMAs(tile b, rows of s)
//           wait full[s + 1]; convert s + 1 -> tile b ^ 1     (while the MMAs run)
//           wait MMAs; W4A8: promote part into acc; release s
//
// W4A8 (§13.2 with 1 x 128 groups): a row's four scales of a K block fold
// into the e4m3 codes (mx_subblock_to_e4m3) and its group scale 2^E_G is
// applied at the block's promotion with each activation row's scale, as the
// FP8 block path promotes. W4A16: a sub-block's whole scale is applied in
// the conversion to bf16 (exact unless bf16 overflows), one fp32 accumulator.
//
// The accumulator layout is wgmma m64's: this thread holds rows r and r + 8
// of its warp's 16 (of the warpgroup's 64), columns 8 j + 2 (lane % 4) + {0,
// 1}; the caller names the weight rows behind them (FC1: the gate and the up
// row of one output column; FC2: two H rows).
#pragma once

#include <cstdint>

#include "common/sm90.cuh"
#include "common/sm90_wgmma.cuh"
#include "moe/sm90_expert_tiles.cuh"
#include "mxfp4/mxfp4_convert.cuh"

namespace flashmix::mx_mainloop {

constexpr int kRowBytes = 128;           // a converted row (and an activation row) a stage: 128-byte swizzle
constexpr int kCvtTile = 64 * kRowBytes;  // a warpgroup's converted 64 rows

// Packed bytes of a weight row a stage.
template <bool kFp8>
constexpr int packed_row_bytes() {
  return kFp8 ? 64 : 32;
}

// A weight row's scale bytes as 32-bit words (word kb: the four sub-blocks of
// K block kb of 128).
__device__ __forceinline__ const uint32_t* scale_row(const uint8_t* scales, int64_t row, int K) {
  return reinterpret_cast<const uint32_t*>(scales + row * (K / 32));
}

// The scale word stage kb needs (W4A8: K block kb; W4A16: 64 of K a stage,
// bytes 2 kb % 4 and + 1 of word kb / 2). A null row (a weight row past the
// matrix, whose codes are TMA's zero fill) reads as scale 127.
template <bool kFp8>
__device__ __forceinline__ uint32_t scale_word(const uint32_t* row, int kb) {
  if (row == nullptr) return 0x7f7f7f7fu;
  return __ldg(row + (kFp8 ? kb : kb >> 1));
}

// This thread's share of converting a stage's packed rows (the warpgroup's
// 64, at `raw`) into the converted tile `dst`: row cj = (thread % 128) / 2,
// half ch = thread % 2, with its row's scale word. W4A8: 32 packed bytes (two
// sub-blocks) -> 64 e4m3 bytes; W4A16: 16 packed bytes (one sub-block) -> 32
// bf16.
template <bool kFp8>
__device__ __forceinline__ void convert(uint32_t raw, uint32_t dst, uint32_t word, int kb) {
  const int wt = threadIdx.x & 127, cj = wt >> 1, ch = wt & 1;
  const uint32_t out_row = dst + uint32_t(cj) * kRowBytes;
  const int x = cj & 7;  // 128-byte swizzle: chunk q of row cj sits at q ^ (cj % 8)
  if constexpr (kFp8) {
    const int group_exp = mx_group_exp(word);
    // The two 16-byte loads in an order that keeps a quarter warp's on distinct banks.
    const int first = (cj >> 1) & 1;
#pragma unroll
    for (int c0 = 0; c0 < 2; ++c0) {
      const int sub = 2 * ch + (c0 ^ first);  // sub-block of the K block
      uint32_t w[4];
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "r"(raw + uint32_t(cj * 64 + 16 * sub)));
      uint32_t o[8];
      mx_subblock_to_e4m3(w, int((word >> (8 * sub)) & 0xffu), group_exp, o);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q = 2 * sub + h;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(out_row + uint32_t((q ^ x) << 4)),
                     "r"(o[4 * h]), "r"(o[4 * h + 1]), "r"(o[4 * h + 2]), "r"(o[4 * h + 3])
                     : "memory");
      }
    }
  } else {
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(raw + uint32_t(cj * 32 + 16 * ch)));
    const int sb = int((word >> (8 * (2 * (kb & 1) + ch))) & 0xffu);
    const Bf16Table table = bf16_table_ue8m0(sb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t o[4];
      e2m1x8_to_bf16_table(w[i], table, o);
      const int q = 4 * ch + i;
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(out_row + uint32_t((q ^ x) << 4)), "r"(o[0]),
                   "r"(o[1]), "r"(o[2]), "r"(o[3])
                   : "memory");
    }
  }
}

// Where the mainloop reads and what it is told about its rows.
struct Ring {
  uint32_t stages;       // shared address of stage 0 (weights at +0, activation rows at + w_stage)
  int stage_bytes, w_stage, num_stages;
  uint32_t cvt;          // this warpgroup's two converted tiles
  uint32_t full0, empty0;  // the stages' barriers (8 bytes apart); empty counts a consumer warp's
                           // arrival, W4A8 each consumer thread's (dev::release_stage)
  const float* x_scales;  // W4A8: the stages' activation-row scales, max_rows floats a stage
  int max_rows;
  int bar_id;             // the warpgroup's named barrier (128 threads)
};
struct Rows {
  const uint32_t* convert;  // the converter's weight row (scale words), null past the matrix
  const uint32_t* lo;       // W4A8: the promotion's accumulator rows r and r + 8
  const uint32_t* hi;
};

template <bool kFp8, int N>
__device__ __forceinline__ void mainloop(const Ring& r, const Rows& rows, int k_blocks, int wg, int& s, uint32_t& ph,
                                         float (&acc)[N / 2]) {
  const int lane = threadIdx.x & 31;
  const uint32_t raw_off = uint32_t(wg) * 64 * packed_row_bytes<kFp8>();  // this warpgroup's 64 packed rows
  const int c2 = 2 * (lane & 3);
#pragma unroll
  for (int k = 0; k < N / 2; ++k) acc[k] = 0.f;
  float part[kFp8 ? N / 2 : 1];
#pragma unroll
  for (int k = 0; k < (kFp8 ? N / 2 : 1); ++k) part[k] = 0.f;

  // The scale words, kPre stages ahead of their use (an L2 or DRAM round
  // trip each; on an H100 no faster than one stage ahead: 104 vs 106 us for
  // FC1 at V4-Flash decode): q[0] is the next one used, shifted down a place
  // each stage.
  constexpr int kPre = 4;
  uint32_t cq[kPre], lq[kPre], hq[kPre];
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    cq[i] = i < k_blocks ? scale_word<kFp8>(rows.convert, i) : 0u;
    lq[i] = kFp8 && i < k_blocks ? scale_word<kFp8>(rows.lo, i) : 0u;
    hq[i] = kFp8 && i < k_blocks ? scale_word<kFp8>(rows.hi, i) : 0u;
  }
  auto next_convert_word = [&](int kb_next) {  // cq[0] is consumed: shift, fetch kb_next + kPre - 1
    const uint32_t w = cq[0];
#pragma unroll
    for (int i = 0; i + 1 < kPre; ++i) cq[i] = cq[i + 1];
    const int f = kb_next + kPre - 1;
    cq[kPre - 1] = f < k_blocks ? scale_word<kFp8>(rows.convert, f) : 0u;
    return w;
  };
  dev::mbar_wait(r.full0 + 8 * s, ph);
  convert<kFp8>(r.stages + uint32_t(s * r.stage_bytes) + raw_off, r.cvt, next_convert_word(1), 0);
  int b = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    // The converted tile b (and rows that came through cp.async) to the async proxy.
    dev::fence_proxy_async_shared();
    dev::named_bar_sync(r.bar_id, 128);
    const uint32_t st = r.stages + uint32_t(s * r.stage_bytes);
    const uint64_t da = dev::wgmma_desc_k_sw128(r.cvt + uint32_t(b * kCvtTile));
    const uint64_t db = dev::wgmma_desc_k_sw128(st + uint32_t(r.w_stage));
    if constexpr (kFp8) {
      dev::wgmma_fence();
      expert_tiles::k_block_mmas<kFp8, N>(part, da, db, false);
    } else {
      dev::fence_operands(acc);
      dev::wgmma_fence();
      expert_tiles::k_block_mmas<kFp8, N>(acc, da, db, true);
    }
    dev::wgmma_commit();
    int s1 = s + 1;
    uint32_t ph1 = ph;
    if (s1 == r.num_stages) {
      s1 = 0;
      ph1 ^= 1;
    }
    if (kb + 1 < k_blocks) {  // the next stage converted while the MMAs run
      dev::mbar_wait(r.full0 + 8 * s1, ph1);
      const uint32_t cw = next_convert_word(kb + 2);
      convert<kFp8>(r.stages + uint32_t(s1 * r.stage_bytes) + raw_off, r.cvt + uint32_t((b ^ 1) * kCvtTile), cw,
                    kb + 1);
    }
    if constexpr (kFp8) {
      dev::wgmma_wait<0>();
      dev::fence_operands(part);
      const float l_s = exp2_float(mx_group_exp(lq[0])), h_s = exp2_float(mx_group_exp(hq[0]));
#pragma unroll
      for (int i = 0; i + 1 < kPre; ++i) {
        lq[i] = lq[i + 1];
        hq[i] = hq[i + 1];
      }
      if (kb + kPre < k_blocks) {
        lq[kPre - 1] = scale_word<kFp8>(rows.lo, kb + kPre);
        hq[kPre - 1] = scale_word<kFp8>(rows.hi, kb + kPre);
      }
      expert_tiles::promote_k_block<N>(acc, part, l_s, h_s, r.x_scales + s * r.max_rows, c2);
    } else {
      dev::fence_operands(acc);
      dev::wgmma_wait<0>();
      dev::fence_operands(acc);
    }
    dev::release_stage<kFp8>(r.empty0 + 8 * s);  // W4A8: the staged X scales were read
    s = s1;
    ph = ph1;
    b ^= 1;
  }
}

}  // namespace flashmix::mx_mainloop
