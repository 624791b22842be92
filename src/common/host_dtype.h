// Host-side conversions between float and the 16-bit storage formats, written
// from the IEEE-754 / bfloat16 definitions (round to nearest, ties to even).
// The CPU reference and the tests use these instead of CUDA's headers, so the
// reference does not share conversion code with the kernels.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#include "flashmix/dtype.h"

namespace flashmix::host {

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu))  // NaN: keep it quiet
    return uint16_t((b >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((b >> 16) & 1u);
  return uint16_t((b + rounding) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  int exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  return bits_to_float(sign | (uint32_t(exp - 15 + 127) << 23) | (mant << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t b = float_to_bits(f);
  uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  uint32_t abs = b & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: inf
  int exp = int(abs >> 23) - 127;
  if (exp < -14) {  // subnormal half (or zero): round abs/2^-24 to an integer, ties to even
    float scaled = bits_to_float(abs) * 16777216.0f;  // exact: multiply by 2^24
    float r = std::nearbyint(scaled);                 // default rounding mode: ties to even
    return uint16_t(sign | uint16_t(r));
  }
  uint32_t mant = abs & 0x7fffffu;
  uint32_t half = (uint32_t(exp + 15) << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // carries into the exponent correctly
  return uint16_t(sign | half);
}

// Reads element i of a buffer of dtype t as a double.
inline double load_as_double(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return std::nan("");
}

// Rounds v once to dtype t and stores it as element i.
inline void store_from_double(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(base)[i] = float(v); break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_fp16(float(v)); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(float(v)); break;
  }
}

}  // namespace flashmix::host
