// The host conversions the reference relies on, against values worked out by hand.
#include <cmath>
#include <gtest/gtest.h>

#include "common/host_dtype.h"

using namespace flashmix::host;

TEST(HostDtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (down).
  EXPECT_EQ(float_to_bf16(1.0f + 0.00390625f), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (up).
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0.00390625f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(0x3f82), 1.015625f);
}

TEST(HostDtype, Fp16RoundTripsAndRounds) {
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(-2.5f), 0xc100);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(70000.0f), 0x7c00);       // overflow: inf
  EXPECT_EQ(float_to_fp16(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_fp16(1.0f + 0.00048828125f), 0x3c00);  // 1 + 2^-11: tie, to even
  EXPECT_EQ(fp16_to_float(0x3555), 0.33325195f);
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(float_to_fp16(fp16_to_float(uint16_t(h))), h);
}
