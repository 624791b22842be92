// Host code only (runs without a GPU): the element conversions the MXFP4
// kernels run (src/mxfp4/mxfp4_convert.cuh, __host__ __device__) against
// the host references the CPU backend uses: every code at every position of
// a packed word, every shift d the kernels can pass (-30..6) to e4m3, every
// scale byte to bf16. On the GPU the same code rounds with
// cvt.rn.satfinite.e4m3x2.f32 / cvt.rn.bf16x2.f32, which the GPU tests check
// through the ops, byte for byte.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "common/test_data.h"
#include "mxfp4/mxfp4_convert.cuh"

using namespace flashmix;
using namespace flashmix::testing;

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

// W4A16's table path: bitwise e2m1x8_to_bf16 for every finite scale byte, on
// every code (both signs) at every position and on random words.
TEST(Mxfp4Conversion, Bf16TablePathMatchesTheArithmeticPathBitwise) {
  Rng rng(test_seed());
  int64_t checked = 0;
  for (int s = 0; s < 255; ++s) {
    const float scale = exp2_float(s - 127);
    const Bf16Table t = bf16_table(scale);
    auto same = [&](uint32_t w) {
      uint32_t a[4], b[4];
      e2m1x8_to_bf16(w, scale, a);
      e2m1x8_to_bf16_table(w, t, b);
      for (int i = 0; i < 4; ++i) ASSERT_EQ(a[i], b[i]) << std::hex << "word " << w << std::dec << " s " << s;
      ++checked;
    };
    for (uint32_t c = 0; c < 16; ++c)
      for (int at = 0; at < 8; ++at) same(word_with(c, at));
    for (int i = 0; i < 200; ++i) same(uint32_t(rng.integer(0, 0xffffffffll)));
  }
  EXPECT_EQ(checked, 255 * (16 * 8 + 200));
  // A NaN scale byte: every element a NaN, whatever its code and sign.
  const Bf16Table nan = bf16_table_ue8m0(kUe8m0NaN);
  for (int i = 0; i < 2000; ++i) {
    uint32_t o[4];
    e2m1x8_to_bf16_table(i < 16 ? 0x11111111u * uint32_t(i) : uint32_t(rng.integer(0, 0xffffffffll)), nan, o);
    for (int j = 0; j < 8; ++j) {
      const uint32_t h = (o[j / 2] >> (16 * (j % 2))) & 0x7fffu;
      ASSERT_TRUE(h > 0x7f80u) << std::hex << h;
    }
  }
  EXPECT_EQ(bf16_table_ue8m0(127).lo_a, bf16_table(1.0f).lo_a);
}

TEST(Mxfp4Conversion, Exp2FloatCoversTheBlockScales) {
  for (int e = -149; e <= 127; ++e) EXPECT_EQ(exp2_float(e), std::ldexp(1.0f, e)) << e;
}

// The W4A8 GEMMs' table path (spec §13.7): bitwise e2m1x8_to_e4m3 for every
// shift it takes (-5..6) on every code at every position and random words.
TEST(Mxfp4Conversion, TablePathMatchesTheCvtPathBitwise) {
  Rng rng(test_seed());
  for (int d = kMxfp4FastMinShift; d <= 6; ++d) {
    const E4m3Table t = e4m3_table(d);
    auto same = [&](uint32_t w) {
      uint32_t lo, hi, lo2, hi2;
      e2m1x8_to_e4m3(w, d, lo, hi);
      e2m1x8_to_e4m3_table(w, t, lo2, hi2);
      ASSERT_EQ(lo, lo2) << std::hex << "word " << w << std::dec << " d " << d;
      ASSERT_EQ(hi, hi2) << std::hex << "word " << w << std::dec << " d " << d;
    };
    for (uint32_t c = 0; c < 16; ++c)
      for (int at = 0; at < 8; ++at) same(word_with(c, at));
    for (int i = 0; i < 20000; ++i) same(uint32_t(rng.integer(0, 0xffffffffll)));
  }
}

// The group exponent: the largest finite scale byte - 127 - 6; NaN bytes left
// out; 0 when all four are NaN.
TEST(Mxfp4Conversion, GroupExponentOfAWord) {
  EXPECT_EQ(mx_group_exp(0x7f7f7f7fu), 127 - 127 - 6);
  EXPECT_EQ(mx_group_exp(0x10207f05u), 127 - 133);
  EXPECT_EQ(mx_group_exp(0xff00ff01u), 1 - 133);
  EXPECT_EQ(mx_group_exp(0xffffffffu), 0);
  EXPECT_EQ(mx_group_exp(0xfe000000u), 254 - 133);
}

// The kernels' sub-block conversion times 2^E_G is the reference's W4A8
// value (host_mxfp4.h, written from the spec) for every element, on rows
// whose four scales spread 0..22 binades (fast path, subnormal path, the
// rounding past 14) and NaN scales.
TEST(Mxfp4Conversion, SubBlockConversionIsTheReferenceW4A8Value) {
  Rng rng(test_seed() ^ 0x4a8);
  int64_t checked = 0;
  for (int row = 0; row < 4000; ++row) {
    uint8_t packed[64], sc[4];
    for (uint8_t& b : packed) b = uint8_t(rng.integer(0, 255));
    const int top = int(rng.integer(20, 254)), spread = int(rng.integer(0, 22));
    for (uint8_t& s : sc) s = uint8_t(std::max(0, top - int(rng.integer(0, spread))));
    if (row % 17 == 0) sc[rng.integer(0, 3)] = 255;
    uint32_t word;
    std::memcpy(&word, sc, 4);
    const int ge = mx_group_exp(word);
    for (int sub = 0; sub < 4; ++sub) {
      uint32_t w[4], o[8];
      std::memcpy(w, packed + 16 * sub, 16);
      mx_subblock_to_e4m3(w, sc[sub], ge, o);
      for (int i = 0; i < 32; ++i) {
        const uint8_t q = uint8_t(o[i / 4] >> (8 * (i % 4)));
        const double got = double(host::e4m3_to_float(q)) * std::ldexp(1.0, ge);
        const double want = host::mxfp4_w4a8_value(packed, sc, 32 * sub + i);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << "row " << row << " element " << 32 * sub + i;
        } else {
          ASSERT_EQ(got, want) << "row " << row << " element " << 32 * sub + i << " spread " << spread;
          ASSERT_EQ(std::signbit(got), std::signbit(want));
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4000 * 128);
}
