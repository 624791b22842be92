// Host-side MXFP4 helpers written from docs/spec.md §13.1, with no CUDA
// header: the CPU references and the tests use these, so they share no
// conversion code with the kernels.
#pragma once

#include <cstdint>

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

}  // namespace flashmix::host
