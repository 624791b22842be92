// Host code only (runs without a GPU): the element conversions the MXFP4
// kernels run (src/mxfp4/mxfp4_convert.cuh, __host__ __device__) against
// the host references the CPU backend uses: every code at every position of
// a packed word, every shift d the kernels can pass (-30..6) to e4m3, every
// scale byte to bf16. On the GPU the same code rounds with
// cvt.rn.satfinite.e4m3x2.f32 / cvt.rn.bf16x2.f32, which the GPU tests check
// through the ops, byte for byte.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "mxfp4/mxfp4_convert.cuh"

using namespace flashmix;

namespace {

// A word whose eight elements hold code c at element `at` and code 0x3 elsewhere.
uint32_t word_with(uint32_t c, int at) {
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i) w |= (i == at ? c : 0x3u) << (4 * i);
  return w;
}

uint8_t byte_of(uint32_t lo, uint32_t hi, int i) { return uint8_t((i < 4 ? lo : hi) >> (8 * (i % 4))); }

}  // namespace

TEST(Mxfp4Conversion, ShiftedBitsAreTheExactValue) {
  for (uint32_t c = 0; c < 16; ++c)
    for (int d = kMxfp4MinShift; d <= 6; ++d) {
      const float v = mxfp4_detail::as_float(e2m1_shifted_bits(c, d));
      const float want = std::ldexp(host::e2m1_to_float(uint8_t(c)), d);
      EXPECT_EQ(v, want) << "code " << c << " d " << d;
      EXPECT_EQ(std::signbit(v), c >= 8) << "code " << c << " d " << d;
    }
}

// The word's element order is the packed bytes' (little-endian loads): element
// i is byte i/2's low nibble for even i, matching host::e2m1_code_at.
TEST(Mxfp4Conversion, WordElementOrderIsTheBytesOrder) {
  const uint8_t bytes[4] = {0x21, 0x43, 0x65, 0x87};
  uint32_t w;
  std::memcpy(&w, bytes, 4);
  uint32_t lo, hi;
  e2m1x8_to_e4m3(w, 0, lo, hi);
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(byte_of(lo, hi, i), host::float_to_e4m3(host::e2m1_to_float(host::e2m1_code_at(bytes, i)))) << i;
}

TEST(Mxfp4Conversion, E4m3OfEveryCodePositionAndShiftMatchesTheHostEncoder) {
  int64_t checked = 0;
  for (uint32_t c = 0; c < 16; ++c)
    for (int at = 0; at < 8; ++at)
      for (int d = kMxfp4MinShift; d <= 6; ++d) {
        uint32_t lo, hi;
        e2m1x8_to_e4m3(word_with(c, at), d, lo, hi);
        for (int i = 0; i < 8; ++i) {
          const uint32_t code = i == at ? c : 0x3u;
          const uint8_t want = host::float_to_e4m3(std::ldexp(host::e2m1_to_float(uint8_t(code)), d));
          ASSERT_EQ(byte_of(lo, hi, i), want) << "code " << code << " at " << i << " d " << d;
          ++checked;
        }
      }
  EXPECT_EQ(checked, 16 * 8 * 37 * 8);
}

TEST(Mxfp4Conversion, Bf16OfEveryCodePositionAndScaleByteMatchesTheHostEncoder) {
  for (uint32_t c = 0; c < 16; ++c)
    for (int at = 0; at < 8; at += 3)
      for (int s = 0; s < 255; ++s) {
        uint32_t out[4];
        e2m1x8_to_bf16(word_with(c, at), exp2_float(s - 127), out);
        for (int i = 0; i < 8; ++i) {
          const uint32_t code = i == at ? c : 0x3u;
          const uint16_t got = uint16_t(out[i / 2] >> (16 * (i % 2)));
          const uint16_t want = host::float_to_bf16(host::e2m1_to_float(uint8_t(code)) * host::ue8m0_to_float(uint8_t(s)));
          ASSERT_EQ(got, want) << "code " << code << " at " << i << " s " << s;
        }
      }
}

TEST(Mxfp4Conversion, Exp2FloatCoversTheBlockScales) {
  for (int e = -149; e <= 127; ++e) EXPECT_EQ(exp2_float(e), std::ldexp(1.0f, e)) << e;
}
