// Host-side FP8 helpers written from docs/spec.md §11 (OCP e4m3, ue8m0
// scales), with no CUDA header: the CPU references and the tests of every
// FP8 op use these, so they share no conversion code with the kernels.
//
// e4m3 (torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; no infinities; S.1111.111 is NaN; largest finite 448 (0x7e);
// smallest subnormal 2^-9.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flashmix::host {

constexpr float kE4m3Max = 448.0f;

// The value of an e4m3 byte (NaN for 0x7f / 0xff).
inline float e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 0x7;
  float v;
  if (exp == 0xf && mant == 0x7) v = std::numeric_limits<float>::quiet_NaN();
  else if (exp == 0) v = std::ldexp(float(mant), -9);  // subnormal (or zero): mant * 2^-9
  else v = std::ldexp(float(8 + mant), exp - 7 - 3);   // (1 + mant/8) * 2^(exp - 7)
  return (b & 0x80) ? -v : v;
}

// float -> e4m3: rounded to the nearest e4m3 value, ties to an even
// mantissa; magnitudes beyond 448 (infinity included) saturate to +-448
// (satfinite); NaN gives the NaN byte with the input's sign (0x7f / 0xff).
// A value that rounds to zero keeps its sign (0x00 / 0x80).
inline uint8_t float_to_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(f);
  if (a > kE4m3Max) return uint8_t(sign | 0x7e);
  // The quantum of a's binade: 2^(e - 3) for a normal e4m3 exponent e >= -6,
  // 2^-9 below 2^-6 (subnormals). a / quantum is exact (a power-of-two
  // scaling of a float that stays in range); nearbyint rounds it to an
  // integer n, ties to even (the default rounding mode), and n's low bit is
  // the mantissa's low bit, so that is ties-to-even on the mantissa.
  int e = a >= std::ldexp(1.0f, -6) ? std::ilogb(a) : -6;
  const float n = std::nearbyint(std::ldexp(a, 3 - e));  // 8 <= n <= 16 (normal), 0 <= n <= 8 (below 2^-6)
  // Byte = ((e + 7) << 3) + (n - 8): n = 16 carries into the exponent, and
  // below 2^-6 (e = -6) it reduces to n itself (n = 8 is the smallest normal).
  return uint8_t(sign | uint8_t(((e + 7) << 3) + int(n) - 8));
}

// The value of a ue8m0 scale byte: 2^(b - 127); 255 is NaN.
inline float ue8m0_to_float(uint8_t b) {
  return b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, int(b) - 127);
}

// spec §11.3, kUE8M0: the exponent of the smallest power of two >= r (r > 0,
// not NaN; +inf counts as 2^128), clamped to [-127, 127], as the stored byte
// (exponent + 127, so 0..254).
inline uint8_t ue8m0_byte_at_least(float r) {
  int e;
  if (std::isinf(r)) {
    e = 128;
  } else {
    int ex;
    const float m = std::frexp(r, &ex);  // r = m * 2^ex, 0.5 <= m < 1 (subnormals too)
    e = m == 0.5f ? ex - 1 : ex;         // a power of two is its own ceiling
  }
  e = e < -127 ? -127 : e > 127 ? 127 : e;
  return uint8_t(e + 127);
}

}  // namespace flashmix::host
