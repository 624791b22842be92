// Test data for the mHC tests (CPU and GPU): random tokens, weights and
// parameters, and the element-wise comparisons with their stated tolerances.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "flashmix/mhc.h"

namespace flashmix::mhc_test {

inline uint64_t seed_for(const std::string& name) {
  // Fresh inputs per run unless FLASHMIX_TEST_SEED pins them; the seed is printed on failure.
  static const uint64_t base = [] {
    if (const char* s = std::getenv("FLASHMIX_TEST_SEED")) return uint64_t(std::strtoull(s, nullptr, 10));
    return uint64_t(std::random_device{}()) * uint64_t(0x9e3779b97f4a7c15ull);
  }();
  return base ^ std::hash<std::string>{}(name);
}

// Inputs of one mHC problem, on the host.
struct Problem {
  int64_t B = 0;
  int n = 4;
  int64_t C = 0;
  int N() const { return mhc_num_coefficients(n); }
  int64_t K() const { return n * C; }

  std::vector<uint16_t> x;       // bf16 [B, n*C]
  std::vector<float> phi_f32;    // [N, K]
  std::vector<uint16_t> phi_bf16;
  std::vector<float> alpha;      // [3]
  std::vector<float> bias;       // [N]
  std::vector<uint16_t> f_out;   // bf16 [B, C]
  std::vector<float> h_post;     // [B, n] (for post tests)
  std::vector<float> h_res;      // [B, n, n]
  uint64_t seed = 0;
};

inline uint16_t bf16(float v) { return host::float_to_bf16(v); }
inline float f32(uint16_t v) { return host::bf16_to_float(v); }

// Non-zero random data: X ~ U(-2, 2) (|x| >= 1e-3), phi scaled so that h is O(1),
// alpha in [0.5, 1.5], bias in [-1, 1], F_out ~ U(-2, 2); H_post in (0, 2) and a
// positive H_res with rows and columns near 1 for post-only tests.
inline Problem make_problem(int64_t B, int n, int64_t C, uint64_t seed) {
  Problem p;
  p.B = B; p.n = n; p.C = C; p.seed = seed;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto nonzero = [&](float scale) {
    float v = u(rng) * scale;
    if (std::fabs(v) < 1e-3f) v = v < 0 ? -1e-3f : 1e-3f;
    return v;
  };
  p.x.resize(size_t(B * p.K()));
  for (auto& v : p.x) v = bf16(nonzero(2.f));
  const float phi_scale = 1.5f * std::sqrt(3.f) / std::sqrt(float(p.K()));
  p.phi_f32.resize(size_t(p.N() * p.K()));
  p.phi_bf16.resize(p.phi_f32.size());
  for (size_t i = 0; i < p.phi_f32.size(); ++i) {
    p.phi_f32[i] = nonzero(phi_scale);
    p.phi_bf16[i] = bf16(p.phi_f32[i]);
  }
  p.alpha = {0.5f + 0.5f * (u(rng) + 1.f), 0.5f + 0.5f * (u(rng) + 1.f), 0.5f + 0.5f * (u(rng) + 1.f)};
  p.bias.resize(p.N());
  for (auto& v : p.bias) v = nonzero(1.f);
  p.f_out.resize(size_t(B * C));
  for (auto& v : p.f_out) v = bf16(nonzero(2.f));
  p.h_post.resize(size_t(B * n));
  for (auto& v : p.h_post) v = 1.f + 0.99f * u(rng);
  p.h_res.resize(size_t(B * n * n));
  for (auto& v : p.h_res) v = (1.f + 0.5f * u(rng)) / float(n);
  return p;
}

// bf16 outputs: one rounding of an fp32 sum against one rounding of a double
// sum: |got - ref| <= 2^-7 * scale + 1e-6, where scale = sum |terms| (so two
// bf16 ulps of the largest possible magnitude, plus accumulated fp32 error).
constexpr double kBf16RelTol = 1.0 / 128.0;
// fp32 coefficients (H_pre/H_post/H_res in [0, 2]): absolute 2e-4. The
// projection runs on tensor cores with phi split into bf16 hi + lo parts
// (about 16 significant bits, better than TF32's 11); Sinkhorn's 20 rounds
// amplify an O(1e-6) error in h to O(1e-5).
constexpr double kCoefAbsTol = 2e-4;
// h before the activations (stage 1): relative to sum |alpha * x * phi| / r + |bias|.
constexpr double kHRelTol = 1e-4;

// Seed-setting Sinkhorn written out as the seed document does it: exp, then
// iters x (row normalise, column normalise); independent of the library's reference.
inline std::vector<double> seed_sinkhorn(const double* logits, int n, int iters) {
  std::vector<double> m(n * n);
  for (int e = 0; e < n * n; ++e) m[e] = std::exp(logits[e]);
  for (int it = 0; it < iters; ++it) {
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < n; ++j) s += m[i * n + j];
      for (int j = 0; j < n; ++j) m[i * n + j] /= s;
    }
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int i = 0; i < n; ++i) s += m[i * n + j];
      for (int i = 0; i < n; ++i) m[i * n + j] /= s;
    }
  }
  return m;
}

}  // namespace flashmix::mhc_test
