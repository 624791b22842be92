// Test data shared by the CPU and GPU tests: a seeded random source, host
// tensors of any DType, and MoE routings with their maps built on the host
// straight from spec §1 (independent of the library's routing code).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "flashmix/dtype.h"
#include "flashmix/moe.h"

namespace flashmix::testing {

// A fresh seed per run, printed by the test so a failure can be replayed
// (set FLASHMIX_TEST_SEED to force one).
uint64_t test_seed();

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen_); }
  std::mt19937_64& gen() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// A host buffer of `count` elements of `dtype`.
struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType t, int64_t count) : dtype(t), bytes(size_t(count) * dtype_size(t)) {}
  int64_t count() const { return int64_t(bytes.size() / dtype_size(dtype)); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  double get(int64_t i) const { return host::load_as_double(bytes.data(), dtype, i); }
  void set(int64_t i, double v) { host::store_from_double(bytes.data(), dtype, i, v); }
  void fill_random(Rng& rng, float lo = -1.0f, float hi = 1.0f) {
    for (int64_t i = 0; i < count(); ++i) set(i, rng.uniform(lo, hi));
  }
  // A byte pattern no kernel writes by accident: NaN in every float type.
  void poison() { std::fill(bytes.begin(), bytes.end(), uint8_t(0xff)); }
};

// FP8 test data (spec §11). Quantises `rows` rows of `cols` floats (cols %
// 128 == 0 with blocks) as spec §11.3: blocks of block_rows x 128, fp32
// scales [ceil(rows / block_rows), cols / 128]; block_rows = 0: one scale
// for all (per tensor). The e4m3 rounding is host_fp8.h's.
inline void quantize_e4m3(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t block_rows,
                          std::vector<uint8_t>& q, std::vector<float>& scales) {
  const int64_t rb = block_rows ? block_rows : std::max<int64_t>(1, rows), cb = block_rows ? 128 : cols;
  const int64_t nrb = (rows + rb - 1) / rb, ncb = cols / cb;
  q.assign(size_t(rows * cols), 0);
  scales.assign(size_t(std::max<int64_t>(1, nrb * ncb)), 1.f);
  for (int64_t br = 0; br < nrb; ++br)
    for (int64_t bc = 0; bc < ncb; ++bc) {
      float amax = 0.f;
      for (int64_t r = br * rb; r < std::min(rows, (br + 1) * rb); ++r)
        for (int64_t i = bc * cb; i < (bc + 1) * cb; ++i) amax = std::max(amax, std::fabs(x[r * cols + i]));
      const float sc = amax == 0.f ? 1.f : amax / 448.f;
      scales[br * ncb + bc] = sc;
      for (int64_t r = br * rb; r < std::min(rows, (br + 1) * rb); ++r)
        for (int64_t i = bc * cb; i < (bc + 1) * cb; ++i) q[r * cols + i] = host::float_to_e4m3(x[r * cols + i] / sc);
    }
}

// Uniform in [-scale, scale]; with `outliers`, every 61st channel 100 x larger.
inline std::vector<float> random_with_outliers(Rng& rng, int64_t rows, int64_t cols, float scale, bool outliers) {
  std::vector<float> v(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i)
      v[r * cols + i] = rng.uniform(-scale, scale) * (outliers && i % 61 == 7 ? 100.f : 1.f);
  return v;
}

// A top-k routing and its maps (spec §1), built on the host.
struct Routing {
  int64_t T = 0;
  int k = 0;
  int start = 0, local = 0;
  std::vector<int32_t> experts;    // [T, k]
  std::vector<int32_t> u2p;        // [k*T], -1 for non-local slots
  std::vector<int32_t> p2u;        // [P], capacity k*T (the ops size it so)
  std::vector<int64_t> offsets;    // [local + 1]
  int64_t P() const { return offsets.empty() ? 0 : offsets.back(); }
};

// Builds the maps for given experts: local rows grouped by expert, within an
// expert ordered by j*T + t.
inline Routing build_routing(int64_t T, int k, int start, int local, std::vector<int32_t> experts) {
  Routing r;
  r.T = T;
  r.k = k;
  r.start = start;
  r.local = local;
  r.experts = std::move(experts);
  r.u2p.assign(size_t(k * T), -1);
  r.p2u.reserve(size_t(std::max<int64_t>(1, k * T)));  // the ops check a [k*T] range for overlaps
  std::vector<std::vector<int32_t>> per_expert(local);
  for (int j = 0; j < k; ++j)
    for (int64_t t = 0; t < T; ++t) {
      const int e = r.experts[t * k + j];
      if (e >= start && e < start + local) per_expert[e - start].push_back(int32_t(j * T + t));
    }
  r.offsets.assign(local + 1, 0);
  for (int e = 0; e < local; ++e) {
    r.offsets[e + 1] = r.offsets[e] + int64_t(per_expert[e].size());
    for (int32_t u : per_expert[e]) {
      r.u2p[u] = int32_t(r.p2u.size());
      r.p2u.push_back(u);
    }
  }
  return r;
}

// Each token picks k distinct experts of `total` uniformly (with repeats
// allowed only when total < k).
inline Routing random_routing(Rng& rng, int64_t T, int k, int total, int start, int local) {
  std::vector<int32_t> experts(size_t(T * k));
  std::vector<int32_t> ids(total);
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    if (total >= k) {
      for (int j = 0; j < k; ++j) std::swap(ids[j], ids[j + rng.integer(0, total - 1 - j)]);
      for (int j = 0; j < k; ++j) experts[t * k + j] = ids[j];
    } else {
      for (int j = 0; j < k; ++j) experts[t * k + j] = int32_t(rng.integer(0, total - 1));
    }
  }
  return build_routing(T, k, start, local, std::move(experts));
}

// The FC2 epilogue mode's name, as the tests trace it and the bench names its cases.
inline const char* fc2_mode_name(Fc2Mode m) {
  switch (m) {
    case Fc2Mode::kAtomic: return "atomic";
    case Fc2Mode::kAtomicFp32: return "atomic_fp32";
    case Fc2Mode::kDeterministic: return "deterministic";
    case Fc2Mode::kUnfused: return "unfused";
  }
  return "?";
}

// The pinnable FC2 GEMM kernels (Fc2GemmKernel without kAuto).
constexpr Fc2GemmKernel kFc2GemmKernels[] = {Fc2GemmKernel::kRows, Fc2GemmKernel::kCutlassCooperative,
                                             Fc2GemmKernel::kCutlassPingpong};

// An Fc2GemmKernel from its to_string name ("auto", "rows", ...); false for
// any other text.
inline bool parse_fc2_gemm_kernel(const char* name, size_t len, Fc2GemmKernel* kernel) {
  for (Fc2GemmKernel k : {Fc2GemmKernel::kAuto, Fc2GemmKernel::kRows, Fc2GemmKernel::kCutlassCooperative,
                          Fc2GemmKernel::kCutlassPingpong}) {
    const char* n = to_string(k);
    if (std::strlen(n) == len && std::strncmp(n, name, len) == 0) {
      *kernel = k;
      return true;
    }
  }
  return false;
}
inline bool parse_fc2_gemm_kernel(const char* name, Fc2GemmKernel* kernel) {
  return parse_fc2_gemm_kernel(name, std::strlen(name), kernel);
}

}  // namespace flashmix::testing
