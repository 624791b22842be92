// dev::realign16, the 16-byte realignment the finalize uses for rows off the
// 16-byte grid, run on the host: for every element size and shift, the result
// is the 16 bytes that start `shift` elements into (lo, hi).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

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

namespace {

// A warp's run of vectors (lanes 0..last) stored into a row `shift` elements
// past a 16-byte boundary, lane by lane as the kernel does (prev = lane l-1's
// vector, what the shuffle gives): every column of the run holds its value,
// and no column outside the run is touched.
template <typename T>
void check_realigned_store(int shift, int last) {
  constexpr int V = 16 / sizeof(T);
  const int c = 2 * V;                    // the run's first column
  const int cols = c + (last + 3) * V;    // room after the run
  std::vector<uint8_t> mem((cols + V) * sizeof(T) + 16, 0xee);  // 0xee: untouched
  uint8_t* base = mem.data() + (16 - reinterpret_cast<uintptr_t>(mem.data()) % 16) % 16;
  T* row = reinterpret_cast<T*>(base) + shift;  // `shift` elements past a 16-byte boundary
  std::vector<dev::Vec<T, V>> vals(last + 1);
  for (int l = 0; l <= last; ++l)
    for (int e = 0; e < V; ++e) {
      const uint32_t bits = 0x1000u * uint32_t(l + 1) + uint32_t(e);
      std::memcpy(&vals[l].v[e], &bits, sizeof(T));
    }
  for (int l = 0; l <= last; ++l) {
    const dev::RealignedStore plan = dev::realigned_store(l, l == last, shift, V);
    if (plan.vector) {
      uint4 own, prev{};
      std::memcpy(&own, &vals[l], 16);
      if (l > 0) std::memcpy(&prev, &vals[l - 1], 16);
      const dev::Vec<T, V> chunk = shift == 0 ? vals[l] : dev::realign16<T, V>(prev, own, V - shift);
      T* dst = row + c + l * V - shift;
      ASSERT_EQ(reinterpret_cast<uintptr_t>(dst) % 16, 0u);
      std::memcpy(dst, &chunk, 16);
    }
    for (int e = plan.first; e < plan.last; ++e) row[c + l * V + e] = vals[l].v[e];
  }
  const uint8_t* first = reinterpret_cast<const uint8_t*>(row + c);
  const uint8_t* end = reinterpret_cast<const uint8_t*>(row + c + (last + 1) * V);
  for (const uint8_t* b = mem.data(); b < mem.data() + mem.size(); ++b)
    if (b < first || b >= end) ASSERT_EQ(*b, 0xee) << "byte outside the run written (shift " << shift << ")";
  for (int l = 0; l <= last; ++l)
    ASSERT_EQ(std::memcmp(row + c + l * V, &vals[l], 16), 0) << "lane " << l << ", shift " << shift;
}

}  // namespace

TEST(DeviceToolkit, RealignedStoresWriteTheRunAndNothingElse) {
  for (int last : {0, 1, 2, 17, 30}) {
    for (int shift = 0; shift < 8; ++shift) check_realigned_store<__nv_bfloat16>(shift, last);
    for (int shift = 0; shift < 4; ++shift) check_realigned_store<float>(shift, last);
  }
}
