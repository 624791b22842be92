#include "common/test_data.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace flashmix::testing {

uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* s = std::getenv("FLASHMIX_TEST_SEED")) return uint64_t(std::strtoull(s, nullptr, 10));
    return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  static bool printed = false;
  if (!printed) {
    printed = true;
    std::printf("[flashmix] test seed %llu (FLASHMIX_TEST_SEED to replay)\n", (unsigned long long)seed);
  }
  return seed;
}

}  // namespace flashmix::testing
