// dev::realign16, the 16-byte realignment the finalize uses for rows off the
// 16-byte grid, run on the host: for every element size and shift, the result
// is the 16 bytes that start `shift` elements into (lo, hi).
#include <gtest/gtest.h>

#include <cstring>

#include "common/vec.cuh"

using namespace flashmix;

namespace {

template <typename T>
void check_every_shift() {
  constexpr int V = 16 / sizeof(T);
  uint8_t bytes[32];
  for (int i = 0; i < 32; ++i) bytes[i] = uint8_t(0x11 * (i % 15) + i);  // distinct bytes
  uint4 lo, hi;
  std::memcpy(&lo, bytes, 16);
  std::memcpy(&hi, bytes + 16, 16);
  for (int shift = 0; shift < V; ++shift) {
    const dev::Vec<T, V> got = dev::realign16<T, V>(lo, hi, shift);
    EXPECT_EQ(std::memcmp(&got, bytes + shift * sizeof(T), 16), 0) << "element size " << sizeof(T) << ", shift "
                                                                    << shift;
  }
}

}  // namespace

TEST(DeviceToolkit, Realign16TakesTheBytesStartingShiftElementsIn) {
  check_every_shift<__nv_bfloat16>();
  check_every_shift<__half>();
  check_every_shift<float>();
}
