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

}  // namespace flashmix
