// Host-side MXFP4 helpers written from docs/spec.md §13.1, with no CUDA
// header: the CPU references and the tests use these, so they share no
// conversion code with the kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/host_dtype.h"
#include "common/host_fp8.h"

namespace flashmix::host {

// The value of an e2m1 code (its low 4 bits): bit 3 sign, bits 2-1 exponent
// (bias 1), bit 0 mantissa. Code 8 is -0.
inline float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

// Element k's code in a row of packed bytes: the low nibble holds the even element.
inline uint8_t e2m1_code_at(const uint8_t* packed_row, int64_t k) {
  const uint8_t b = packed_row[k / 2];
  return (k % 2 == 0) ? uint8_t(b & 0x0f) : uint8_t(b >> 4);
}

// The value the W4A8 GEMMs multiply for element k of an MXFP4 row (spec
// §13.7): the row's four scales of k's block of 128 are one group (§13.2,
// 1 x 128): E_G = e_max - 6 (0 when none is finite), q = e4m3(e2m1 * 2^(e -
// E_G)) (NaN for a NaN scale), value q * 2^E_G. Equals the dequantised
// value wherever the row's four scales spread at most 14 binades.
inline double mxfp4_w4a8_value(const uint8_t* packed_row, const uint8_t* scale_row, int64_t k) {
  const int64_t g0 = k / 128 * 4;
  int top = -1;
  for (int64_t g = g0; g < g0 + 4; ++g)
    if (scale_row[g] != 255) top = std::max(top, int(scale_row[g]));
  const int group_exp = top < 0 ? 0 : top - 127 - 6;
  const uint8_t s = scale_row[k / 32];
  if (s == 255) return std::numeric_limits<double>::quiet_NaN();
  // e2m1 * 2^d is exact in double for every d; the one rounding is to e4m3.
  const double shifted = std::ldexp(double(e2m1_to_float(e2m1_code_at(packed_row, k))), int(s) - 127 - group_exp);
  return double(e4m3_to_float(float_to_e4m3(float(shifted)))) * std::ldexp(1.0, group_exp);
}

// The value the W4A16 GEMMs multiply: bf16 of the dequantised value (§13.4;
// NaN for a NaN scale, +-inf where it overflows bf16).
inline double mxfp4_w4a16_value(const uint8_t* packed_row, const uint8_t* scale_row, int64_t k) {
  const uint8_t s = scale_row[k / 32];
  if (s == 255) return std::numeric_limits<double>::quiet_NaN();
  const double v = std::ldexp(double(e2m1_to_float(e2m1_code_at(packed_row, k))), int(s) - 127);
  return double(bf16_to_float(float_to_bf16(float(v))));
}

}  // namespace flashmix::host
