// FP8 test data shared by the CPU and GPU tests: bf16 inputs shaped like
// what gets quantised in a model (activations and weights with a few
// outlier channels), and a brute-force e4m3 rounding to check the host
// encoder against.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/host_dtype.h"
#include "common/test_data.h"

namespace flashmix::testing {

// bf16 bits of `batch` matrices [rows, cols] laid out with `stride` elements
// between rows and `batch_stride` between matrices (the buffer holds
// (batch - 1) * batch_stride + (rows - 1) * stride + cols elements, plus
// `lead` elements before the first). Values: uniform in [-1, 1) times a
// per-row magnitude 2^u (u uniform in [-12, 12]), with about one column in
// 50 a hundred times larger (outlier channels, the same columns in every
// row); about one 128-column block in 40 is all zeros. Elements outside the
// matrices (row padding, the lead) hold NaN: read by mistake, they turn a
// block's scale into NaN.
inline std::vector<uint16_t> random_fp8_input(Rng& rng, int64_t batch, int64_t rows, int64_t cols, int64_t stride,
                                              int64_t batch_stride, int64_t lead = 0) {
  const int64_t extent = (batch == 0 || rows == 0) ? 0 : (batch - 1) * batch_stride + (rows - 1) * stride + cols;
  std::vector<uint16_t> x(size_t(lead + extent), host::float_to_bf16(std::numeric_limits<float>::quiet_NaN()));
  std::vector<float> channel(size_t(cols), 1.0f);
  for (auto& c : channel)
    if (rng.integer(0, 49) == 0) c = 100.0f;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      const float magnitude = std::ldexp(1.0f, int(rng.integer(-12, 12)));
      for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        const bool zero = rng.integer(0, 39) == 0;
        for (int64_t c = c0; c < c0 + 128; ++c)
          x[size_t(lead + b * batch_stride + r * stride + c)] =
              host::float_to_bf16(zero ? 0.0f : rng.uniform(-1.0f, 1.0f) * magnitude * channel[size_t(c)]);
      }
    }
  return x;
}

// The e4m3 byte nearest to f by exhaustive search over the 127 non-negative
// finite values (ties: the even byte, i.e. the even mantissa), saturating
// beyond 448; NaN -> 0x7f with f's sign. Independent of host::float_to_e4m3.
inline uint8_t brute_force_e4m3(float f) {
  const bool neg = std::signbit(f);
  if (std::isnan(f)) return uint8_t((neg ? 0x80 : 0) | 0x7f);
  const double a = std::fabs(double(f));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int b = 0; b <= 0x7e; ++b) {
    const int exp = b >> 3, mant = b & 7;
    const double v = exp == 0 ? std::ldexp(double(mant), -9) : std::ldexp(double(8 + mant), exp - 10);
    const double err = std::fabs(a - v);
    if (err < best_err || (err == best_err && (b & 1) == 0)) {
      best = b;
      best_err = err;
    }
  }
  if (a > 448.0) best = 0x7e;
  return uint8_t((neg ? 0x80 : 0) | best);
}

}  // namespace flashmix::testing
