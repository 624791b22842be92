// The device arithmetic of quantize_fp8's blocks (spec §11.3, §12.1), shared
// by every kernel that must match it bit for bit (quantize_fp8 itself, the
// FP8 copy of F_pre in mhc_pre / mhc_post_pre, the FP8 residual stream's
// X_next in mhc_post, spec §4.9): a block's amax on the bf16 (or fp32) bits,
// its scale, the e4m3 conversion of a chunk of eight bf16 (or fp32) values.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "flashmix/fp8.h"

namespace flashmix::fp8_dev {

constexpr uint32_t kAbsMask = 0x7fff7fffu;  // two bf16 magnitudes
constexpr uint32_t kBf16Inf = 0x7f80u;      // amax bits above this: a NaN in the block
constexpr uint8_t kE4m3NaN = 0x7f;

// Eight consecutive bf16 (as four words, the first element in the low half of w[0]).
struct Chunk {
  uint32_t w[4];
};

// The largest bf16 magnitude of a chunk, as bits (0..0x7fff).
__device__ __forceinline__ uint32_t chunk_amax_bits(const Chunk& c) {
  uint32_t m = __vmaxu2(__vmaxu2(c.w[0] & kAbsMask, c.w[1] & kAbsMask), __vmaxu2(c.w[2] & kAbsMask, c.w[3] & kAbsMask));
  return max(m & 0xffffu, m >> 16);
}

// A block's scale, from its amax bits (not NaN): the divisor s and what is
// stored (the float's bits, or the ue8m0 byte).
struct Scale {
  float s;
  uint32_t stored;
};

// A block's scale from its amax as a float (>= 0, not NaN). s = 1 where
// fp32(amax / 448) is 0: amax == 0 for bf16 blocks (the smallest bf16
// magnitude divided by 448 is still a subnormal float); for fp32 blocks (the
// FP8 residual stream's X_next, spec §4.9) also amax below about 2^-141.
template <ScaleFormat F>
__device__ __forceinline__ Scale block_scale_of(float amax) {
  const float r = __fdiv_rn(amax, 448.0f);
  if (r == 0.0f) return {1.0f, F == ScaleFormat::kUE8M0 ? 127u : __float_as_uint(1.0f)};
  if constexpr (F == ScaleFormat::kFloat32) {
    return {r, __float_as_uint(r)};
  } else {
    // The exponent of the smallest power of two >= r: r's own exponent, one
    // more unless r is a power of two; for a subnormal r = m 2^-149,
    // -149 + ceil(log2 m). +inf counts as 2^128. Clamped to [-127, 127].
    const uint32_t bits = __float_as_uint(r);
    const int biased = int(bits >> 23), mant = int(bits & 0x7fffff);
    int e;
    if (biased == 0xff) e = 128;
    else if (biased == 0) e = -149 + (32 - __clz(mant - 1));
    else e = biased - 127 + (mant != 0);
    e = min(127, max(-127, e));
    const uint32_t b = uint32_t(e + 127);
    // 2^(b - 127): a normal float's exponent field, or 2^-127 (subnormal) for b = 0.
    return {__uint_as_float(b ? b << 23 : 0x00400000u), b};
  }
}

// A block's scale from its bf16 amax bits (not NaN).
template <ScaleFormat F>
__device__ __forceinline__ Scale block_scale(uint32_t amax_bits) {
  return block_scale_of<F>(__uint_as_float(amax_bits << 16));
}

__device__ __forceinline__ void store_scale(void* scales, uint32_t index, uint32_t stored, bool ue8m0) {
  if (ue8m0) static_cast<uint8_t*>(scales)[index] = uint8_t(stored);
  else static_cast<uint32_t*>(scales)[index] = stored;
}

// Division by one block's scale s, bitwise __fdiv_rn(x, s) (the IEEE
// quotient the spec's e4m3 conversion starts from), in 5 instructions a
// value instead of div.rn's ~10 and its range checks: with r = RN(1/s) once
// per block, y0 = RN(x r) is within 1.5 ulp of x/s; one correction with the
// exact residual (x - y0 s in one fma) makes y1 faithful (within an ulp);
// then RN(y1 + r (x - y1 s)) is RN(x/s) (Markstein's theorem: r = RN(1/s),
// y1 faithful, the residual exact) as long as nothing under- or overflows.
// Here |x| <= 448 s (x is in the block), so with s in [2^-60, 2^100] every
// quotient that can round to a non-zero e4m3 comes from x >= 2^-71 with
// normal residuals; other scales (and NaN, inf, 0) take __fdiv_rn. The
// result takes x's sign (the fma sums give +0 for x = -0).
struct ScaleDivisor {
  float s, r;  // the scale and RN(1/s)
  bool fast;   // s in [2^-60, 2^100]
  // x / s where `fast` holds.
  __device__ __forceinline__ float fast_div(float x) const {
    const float y0 = __fmul_rn(x, r);
    const float y1 = __fmaf_rn(__fmaf_rn(-y0, s, x), r, y0);
    // x / s has x's sign (s > 0); the fma sums lose a zero's (-0 + +0 = +0).
    return copysignf(__fmaf_rn(__fmaf_rn(-y1, s, x), r, y1), x);
  }
};
__device__ __forceinline__ ScaleDivisor scale_divisor(float s) {
  return {s, __fdiv_rn(1.0f, s), s >= 0x1p-60f && s <= 0x1p100f};
}

// Two e4m3 of quotients v0, v1 (v0 in the low byte), saturating. A NaN
// quotient (inf / inf, only off the fast path) gets the NaN byte with no sign
// (the CPU's NaN would carry one).
template <bool kMayBeNaN>
__device__ __forceinline__ uint32_t e4m3_pair(float v0, float v1) {
  uint32_t p = __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
  if constexpr (kMayBeNaN) {
    if (v0 != v0) p = (p & 0xff00u) | kE4m3NaN;
    if (v1 != v1) p = (p & 0x00ffu) | (uint32_t(kE4m3NaN) << 8);
  }
  return p;
}

// The scale of a block from its amax bits, NaN blocks included (scale NaN:
// the float bits 0x7fc00000 or the ue8m0 byte 255; s is then unused).
template <ScaleFormat F>
__device__ __forceinline__ Scale block_scale_or_nan(uint32_t amax_bits) {
  return amax_bits > kBf16Inf ? Scale{0.0f, F == ScaleFormat::kUE8M0 ? 255u : 0x7fc00000u} : block_scale<F>(amax_bits);
}

// The same from the amax of fp32 values, as the bits of |x| (a NaN block
// when above the bits of +inf).
constexpr uint32_t kF32Inf = 0x7f800000u;
template <ScaleFormat F>
__device__ __forceinline__ Scale block_scale_or_nan_f32(uint32_t amax_bits) {
  return amax_bits > kF32Inf ? Scale{0.0f, F == ScaleFormat::kUE8M0 ? 255u : 0x7fc00000u}
                             : block_scale_of<F>(__uint_as_float(amax_bits));
}

// The largest |x| of eight fp32 values, as bits (NaN above +inf's bits).
__device__ __forceinline__ uint32_t amax_bits_f32(const float* v) {
  uint32_t m = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) m = max(m, __float_as_uint(v[e]) & 0x7fffffffu);
  return m;
}

// Eight fp32 values' e4m3 bytes, v[0] in the low byte of lo (all NaN for a
// NaN block): the quotients by the block's scale (one branch for the eight,
// ScaleDivisor), then the conversion. On the fast path every value is finite
// (a NaN or infinite value makes a NaN or infinite scale), so no quotient is
// NaN. A ue8m0 scale is a power of two: r = 1/s is exact, so x * r is the
// exact quotient before its one rounding, i.e. RN(x / s) (x's sign kept, -0
// included), one multiply instead of fast_div's five. (A run-time test for a
// power of two on the float32 format cost that format 5 %: the format is a
// template parameter.)
template <ScaleFormat F>
__device__ __forceinline__ void quantize8_f32(const float* v, float s, bool nan_block, uint32_t& lo, uint32_t& hi) {
  if (nan_block) {
    lo = hi = 0x7f7f7f7fu;
    return;
  }
  const ScaleDivisor d = scale_divisor(s);
  float q[8];
  if (d.fast) {
    if constexpr (F == ScaleFormat::kUE8M0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = __fmul_rn(v[e], d.r);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = d.fast_div(v[e]);
    }
    lo = e4m3_pair<false>(q[0], q[1]) | (e4m3_pair<false>(q[2], q[3]) << 16);
    hi = e4m3_pair<false>(q[4], q[5]) | (e4m3_pair<false>(q[6], q[7]) << 16);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = __fdiv_rn(v[e], s);
    lo = e4m3_pair<true>(q[0], q[1]) | (e4m3_pair<true>(q[2], q[3]) << 16);
    hi = e4m3_pair<true>(q[4], q[5]) | (e4m3_pair<true>(q[6], q[7]) << 16);
  }
}

// The chunk's eight e4m3 bytes (all NaN for a NaN block): its bf16 values
// (exact in fp32) through quantize8_f32.
template <ScaleFormat F>
__device__ __forceinline__ void quantize_chunk(const Chunk& c, float s, bool nan_block, uint32_t& lo, uint32_t& hi) {
  float v[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(c.w[k] << 16);
    v[2 * k + 1] = __uint_as_float(c.w[k] & 0xffff0000u);
  }
  quantize8_f32<F>(v, s, nan_block, lo, hi);
}

// One 1 x 128 block held by a team of lanes (`team`: their mask), each lane
// N of its 8-value chunks (quantize_fp8's 1 x 128 layout, also the routing's
// FP8 expansion): the block's amax over the team, its scale (NaN blocks
// included) and the lane's e4m3 codes, q[i] those of chunk i.
template <ScaleFormat F, int N>
__device__ __forceinline__ Scale quantize_team_block(const Chunk (&c)[N], unsigned team, uint2 (&q)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, chunk_amax_bits(c[i]));
  const uint32_t amax = __reduce_max_sync(team, m);
  const Scale s = block_scale_or_nan<F>(amax);
#pragma unroll
  for (int i = 0; i < N; ++i) quantize_chunk<F>(c[i], s.s, amax > kBf16Inf, q[i].x, q[i].y);
  return s;
}

}  // namespace flashmix::fp8_dev
