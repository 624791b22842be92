// Host code only (runs without a GPU): CUDA's own float -> e4m3 conversion
// (cuda_fp8.h's software path, which is also what a kernel built for a GPU
// below sm_89 runs instead of cvt.rn.satfinite.e4m3x2.f32) against the
// host encoder the CPU reference uses, on every e4m3 midpoint, its
// neighbours, and a spread of floats across the exponent range.
#include <cmath>
#include <limits>
#include <vector>

#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "common/host_fp8.h"
#include "common/test_data.h"

using namespace flashmix;

TEST(HostFp8, MatchesCudasSatfiniteConversion) {
  std::vector<float> values = {0.0f, 448.0f, 464.0f, 500.0f, 1e30f, std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(), 1e-39f};
  for (int b = 0; b < 0x7e; ++b) {
    const float mid = 0.5f * (host::e4m3_to_float(uint8_t(b)) + host::e4m3_to_float(uint8_t(b + 1)));
    values.push_back(host::e4m3_to_float(uint8_t(b)));
    values.push_back(mid);
    values.push_back(std::nextafter(mid, 0.0f));
    values.push_back(std::nextafter(mid, 1e9f));
  }
  flashmix::testing::Rng rng(flashmix::testing::test_seed());
  for (int i = 0; i < 50000; ++i) values.push_back(std::ldexp(rng.uniform(0.5f, 1.0f), int(rng.integer(-40, 12))));
  int64_t bad = 0;
  for (float v : values)
    for (float s : {v, -v}) {
      const uint8_t cuda = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
      const uint8_t ours = host::float_to_e4m3(s);
      if (cuda != ours && ++bad <= 10) ADD_FAILURE() << "value " << s << ": cuda 0x" << std::hex << int(cuda) << " ours 0x" << int(ours);
    }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(__nv_cvt_float_to_fp8(std::nanf(""), __NV_SATFINITE, __NV_E4M3) & 0x7f, 0x7f);
}
