// The MXFP4 element conversions of spec §13, for the kernels: e2m1 codes
// (eight a 32-bit word of packed bytes, element i at bits 4i: the low nibble
// of each byte is the even element) times a power of two, to e4m3 or bf16.
// __host__ __device__, so the CPU tests run these same functions against the
// host references (tests/cpu/test_mxfp4_conversion.cu); the conversion
// inside the W4A8 GEMMs is to use them too (docs/mxfp4.md §4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "mxfp4/mxfp4_internal.h"

namespace flashmix {

namespace mxfp4_detail {

__host__ __device__ __forceinline__ float as_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

__host__ __device__ __forceinline__ uint32_t as_bits(__nv_bfloat162 h) {
  uint32_t u;
#ifdef __CUDA_ARCH__
  u = *reinterpret_cast<const uint32_t*>(&h);
#else
  std::memcpy(&u, &h, 4);
#endif
  return u;
}

}  // namespace mxfp4_detail

// fp32 bits of e2m1(code) * 2^d (code in the low 4 bits; kMxfp4MinShift <= d
// <= 6): magnitude 0.5 is 2^-1; 1, 1.5, 2, 3, 4, 6 are (1 + m/2) 2^(x - 1)
// for the exponent field x = code >> 1 & 3 and mantissa bit m. Always a
// normal float (or +-0): no rounding.
__host__ __device__ __forceinline__ uint32_t e2m1_shifted_bits(uint32_t code, int d) {
  const uint32_t sign = (code & 8u) << 28, mag = code & 7u;
  if (mag == 0) return sign;
  if (mag == 1) return sign | (uint32_t(126 + d) << 23);
  return sign | (uint32_t(126 + int(mag >> 1) + d) << 23) | ((mag & 1u) << 22);
}

// The eight elements of a packed word times 2^d as e4m3 bytes (nearest, ties
// to even, satfinite; one rounding from the exact fp32 value), element 0 in
// the low byte of lo.
__host__ __device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t packed, int d, uint32_t& lo, uint32_t& hi) {
  uint32_t pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float v0 = mxfp4_detail::as_float(e2m1_shifted_bits(packed >> (8 * i), d));
    const float v1 = mxfp4_detail::as_float(e2m1_shifted_bits(packed >> (8 * i + 4), d));
    pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
  }
  lo = pairs[0] | (pairs[1] << 16);
  hi = pairs[2] | (pairs[3] << 16);
}

// 2^e as a float, e in [-149, 127] (a subnormal below -126).
__host__ __device__ __forceinline__ float exp2_float(int e) {
  return mxfp4_detail::as_float(e >= -126 ? uint32_t(e + 127) << 23 : 1u << (e + 149));
}

// The eight elements of a packed word times `scale` (a power of two) as bf16:
// the fp32 product is exact (or +-inf past the range), rounded once. Element
// 0 in the low half of out[0].
__host__ __device__ __forceinline__ void e2m1x8_to_bf16(uint32_t packed, float scale, uint32_t (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float v0 = mxfp4_detail::as_float(e2m1_shifted_bits(packed >> (8 * i), 0)) * scale;
    const float v1 = mxfp4_detail::as_float(e2m1_shifted_bits(packed >> (8 * i + 4), 0)) * scale;
    out[i] = mxfp4_detail::as_bits(__floats2bfloat162_rn(v0, v1));  // v0 in the low half
  }
}


// ---------------------------------------------------------------------------
// The W4A8 GEMMs' conversion (spec §13.2 with 1 x 128 groups: one W row's
// four sub-blocks of a K block of 128; docs/mxfp4.md §4).

// The group exponent E_G = e_max - 6 of one row's K block from its four
// scale bytes (byte i of the little-endian word = sub-block i); 0 when all
// four are NaN (255).
__host__ __device__ __forceinline__ int mx_group_exp(uint32_t scale_word) {
  int top = -1;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = int((scale_word >> (8 * i)) & 0xffu);
    if (s != kUe8m0NaN && s > top) top = s;
  }
  return top < 0 ? 0 : top - 127 - kMxfp4Fp8TopShift;
}

// The fast path's range: every e2m1 value times 2^d is a normal e4m3 (or
// +-0) for -5 <= d <= 6 (0.5 * 2^-5 = 2^-6, e4m3's smallest normal), i.e. a
// sub-block at most 11 binades below its group's largest.
constexpr int kMxfp4FastMinShift = -5;

__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  // PTX prmt (default mode): result byte i = byte (s >> 4i) & 7 of {y, x}
  // (x bytes 0-3, y 4-7); selector bit 3 (sign replication) is never set here.
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
#endif
}

// The e4m3 byte of every e2m1 magnitude code 0..7 shifted by d (the fast
// path's table, d in [-5, 6]): (mag << 2) + 0x30 is e2m1's value as e4m3
// for mag >= 2 (exponent field + 6, mantissa bit moved up), 0.5 is 0x30, 0
// is 0; a shift adds d to every nonzero byte's exponent field. No byte
// borrows or carries: 0x30 - 5 * 8 >= 0x08, 0x4c + 6 * 8 = 0x7c.
struct E4m3Table {
  uint32_t lo, hi;  // codes 0-3, 4-7
};
__host__ __device__ __forceinline__ E4m3Table e4m3_table(int d) {
  const uint32_t step = uint32_t(d * 8);
  return {0x3c383000u + step * 0x01010100u, 0x4c484440u + step * 0x01010101u};
}

// Eight codes of a packed word through the table (element 0 in lo's low
// byte), signs from each nibble's bit 3: bitwise e2m1x8_to_e4m3(packed, d)
// for d in [-5, 6] (then every value is exact in e4m3). Per four elements:
// one prmt looks up the magnitudes; a second gathers the bytes whose top bit
// is an element's sign (element 2i's in packed << 4, element 2i + 1's in
// packed), and one lop3 ORs those top bits in: 9 instructions for eight.
__host__ __device__ __forceinline__ void e2m1x8_to_e4m3_table(uint32_t packed, const E4m3Table& t, uint32_t& lo,
                                                             uint32_t& hi) {
  const uint32_t mag = packed & 0x77777777u, p4 = packed << 4;
  lo = byte_perm(t.lo, t.hi, mag) | (byte_perm(p4, packed, 0x5140u) & 0x80808080u);
  hi = byte_perm(t.lo, t.hi, mag >> 16) | (byte_perm(p4, packed, 0x7362u) & 0x80808080u);
}

// W4A16's table: the bf16 of every e2m1 magnitude code 0..7 times `scale`
// (a power of two; one sub-block's), each rounded once from the exact fp32
// product as e2m1x8_to_bf16 rounds it, split into the entries' low bytes
// (lo_a: codes 0-3, lo_b: 4-7) and high bytes (hi_a, hi_b) for byte_perm.
struct Bf16Table {
  uint32_t lo_a, lo_b, hi_a, hi_b;
};
__host__ __device__ __forceinline__ Bf16Table bf16_table(float scale) {
  using mxfp4_detail::as_bits;
  const uint32_t w0 = as_bits(__floats2bfloat162_rn(0.0f * scale, 0.5f * scale));
  const uint32_t w1 = as_bits(__floats2bfloat162_rn(1.0f * scale, 1.5f * scale));
  const uint32_t w2 = as_bits(__floats2bfloat162_rn(2.0f * scale, 3.0f * scale));
  const uint32_t w3 = as_bits(__floats2bfloat162_rn(4.0f * scale, 6.0f * scale));
  return {byte_perm(w0, w1, 0x6420u), byte_perm(w2, w3, 0x6420u), byte_perm(w0, w1, 0x7531u),
          byte_perm(w2, w3, 0x7531u)};
}

// The table of a sub-block's ue8m0 scale byte: NaN (255) gives a NaN
// (0x7fc0, its sign from the code) for every code, as spec §13.1 rules.
__host__ __device__ __forceinline__ Bf16Table bf16_table_ue8m0(int s) {
  return s == kUe8m0NaN ? Bf16Table{0xc0c0c0c0u, 0xc0c0c0c0u, 0x7f7f7f7fu, 0x7f7f7f7fu}
                        : bf16_table(exp2_float(s - 127));
}

// Eight codes of a packed word through the bf16 table (element 0 in the low
// half of out[0]), each sign ORed into its high byte: bitwise
// e2m1x8_to_bf16(packed, scale) for the table's scale (a sign flips a
// rounded value exactly; -0 stays -0). Per four elements: two prmt look up
// the low and high bytes, a third gathers the signs (as in
// e2m1x8_to_e4m3_table), one lop3 merges them and two prmt interleave the
// bytes into bf16 pairs: 15 instructions for eight, against ~13 an element
// for the arithmetic form.
__host__ __device__ __forceinline__ void e2m1x8_to_bf16_table(uint32_t packed, const Bf16Table& t,
                                                             uint32_t (&out)[4]) {
  const uint32_t mag = packed & 0x77777777u, p4 = packed << 4, mag_hi = mag >> 16;
  const uint32_t lo0 = byte_perm(t.lo_a, t.lo_b, mag);
  const uint32_t hi0 = byte_perm(t.hi_a, t.hi_b, mag) | (byte_perm(p4, packed, 0x5140u) & 0x80808080u);
  const uint32_t lo1 = byte_perm(t.lo_a, t.lo_b, mag_hi);
  const uint32_t hi1 = byte_perm(t.hi_a, t.hi_b, mag_hi) | (byte_perm(p4, packed, 0x7362u) & 0x80808080u);
  out[0] = byte_perm(lo0, hi0, 0x5140u);
  out[1] = byte_perm(lo0, hi0, 0x7362u);
  out[2] = byte_perm(lo1, hi1, 0x5140u);
  out[3] = byte_perm(lo1, hi1, 0x7362u);
}

// One 32-element sub-block (16 packed bytes, scale byte s) of a group with
// exponent E_G as 32 e4m3 bytes (out[0]: elements 0-15): NaN for s = 255,
// the table for a shift in the fast range, else e2m1x8_to_e4m3 (subnormal
// or rounded results, §13.2). Bitwise the reference's q.
__host__ __device__ __forceinline__ void mx_subblock_to_e4m3(const uint32_t (&packed)[4], int s, int group_exp,
                                                            uint32_t (&out)[8]) {
  if (s == kUe8m0NaN) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = 0x7f7f7f7fu;
    return;
  }
  const int d = s - 127 - group_exp;  // <= 6
  if (d >= kMxfp4FastMinShift) {
    const E4m3Table t = e4m3_table(d);
#pragma unroll
    for (int i = 0; i < 4; ++i) e2m1x8_to_e4m3_table(packed[i], t, out[2 * i], out[2 * i + 1]);
  } else {
    const int dc = d > kMxfp4MinShift ? d : kMxfp4MinShift;
#pragma unroll
    for (int i = 0; i < 4; ++i) e2m1x8_to_e4m3(packed[i], dc, out[2 * i], out[2 * i + 1]);
  }
}

}  // namespace flashmix
