// MXFP4 (spec §13): the host e2m1 helpers, the CPU references of
// mxfp4_to_bf16 and mxfp4_to_fp8_block against values worked from the spec
// (every code in every nibble position, every scale byte, spreads 0..20 with
// the inexact ones found and bounded, NaN scales, partial row blocks and
// batches), their validation, the DeepSeek-V4 expert loader on a small
// synthetic checkpoint, and converted experts through the FP8 and bf16
// layers. The GPU tests hold the kernels to these references byte for byte.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "common/mxfp4_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "flashmix/mxfp4.h"

using namespace flashmix;
using namespace flashmix::testing;
using flashmix::host::bf16_to_float;
using flashmix::host::e2m1_to_float;
using flashmix::host::e4m3_to_float;

namespace {

constexpr uint8_t kPoison = 0xa5;

// The magnitudes of spec §13.1's table, by code & 7.
constexpr double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

// W[n, k] in double, straight from spec §13.1 (NaN for scale 255).
double dequant(const Mxfp4Data& d, int64_t cols, int64_t row, int64_t k) {
  const uint8_t byte = d.w[size_t(row * (cols / 2) + k / 2)];
  const uint8_t code = (k % 2 == 0) ? (byte & 0xf) : (byte >> 4);
  const uint8_t s = d.scales[size_t(row * (cols / 32) + k / 32)];
  if (s == 255) return std::numeric_limits<double>::quiet_NaN();
  const double v = (code & 8) ? -kE2m1[code & 7] : kE2m1[code & 7];
  return std::ldexp(v, int(s) - 127);
}

// One mxfp4_to_fp8_block_cpu call on host buffers, outputs poisoned first.
struct Fp8Run {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  Status status;
  Fp8Run(const Mxfp4Data& d, int64_t batch, int64_t rows, int64_t cols) {
    const int64_t rb = (rows + 127) / 128;
    q.assign(size_t(batch * rows * cols), kPoison);
    scales.assign(size_t(batch * rb * (cols / 128)), -1.0f);
    Mxfp4ToFp8BlockArgs a;
    a.w = d.w.data();
    a.w_scales = d.scales.data();
    a.q = q.data();
    a.q_scales = scales.data();
    a.batch = batch;
    a.rows = rows;
    a.cols = cols;
    status = mxfp4_to_fp8_block_cpu(a);
  }
  // The dequantised value of element (row of the whole batch, k).
  double value(int64_t rows, int64_t cols, int64_t row, int64_t k) const {
    const int64_t b = row / rows, r = row % rows, rb = (rows + 127) / 128;
    const float s = scales[size_t((b * rb + r / 128) * (cols / 128) + k / 128)];
    return double(e4m3_to_float(q[size_t(row * cols + k)])) * double(s);
  }
};

struct Bf16Run {
  std::vector<uint16_t> out;
  Status status;
  Bf16Run(const Mxfp4Data& d, int64_t batch, int64_t rows, int64_t cols) {
    out.assign(size_t(batch * rows * cols), 0xa5a5);
    Mxfp4ToBf16Args a;
    a.w = d.w.data();
    a.w_scales = d.scales.data();
    a.out = out.data();
    a.batch = batch;
    a.rows = rows;
    a.cols = cols;
    status = mxfp4_to_bf16_cpu(a);
  }
};

// A row of K = 32 whose element k holds code k / 2: every code, at an even
// and at an odd position (low and high nibble).
std::vector<uint8_t> every_code_in_both_nibbles() {
  std::vector<uint8_t> row(16);
  for (int j = 0; j < 16; ++j) row[size_t(j)] = uint8_t(j | (j << 4));
  return row;
}

}  // namespace

// ---------------------------------------------------------------------------
// The format (spec §13.1)
// ---------------------------------------------------------------------------

TEST(Mxfp4Format, E2m1CodesDecodeAsTheTable) {
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(uint8_t(c));
    EXPECT_EQ(std::fabs(v), float(kE2m1[c & 7])) << "code " << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << "code " << c;
  }
}

TEST(Mxfp4Format, TheLowNibbleHoldsTheEvenElement) {
  const uint8_t row[2] = {0x2d, 0x07};  // elements 0..3: codes 0xd, 0x2, 0x7, 0x0
  EXPECT_EQ(host::e2m1_code_at(row, 0), 0xd);
  EXPECT_EQ(host::e2m1_code_at(row, 1), 0x2);
  EXPECT_EQ(host::e2m1_code_at(row, 2), 0x7);
  EXPECT_EQ(host::e2m1_code_at(row, 3), 0x0);
  EXPECT_EQ(e2m1_to_float(0xd), -3.0f);
}

// ---------------------------------------------------------------------------
// mxfp4_to_bf16 (spec §13.4)
// ---------------------------------------------------------------------------

TEST(Mxfp4ToBf16Cpu, EveryCodeInEveryNibbleAtUnitScale) {
  Mxfp4Data d;
  d.w = every_code_in_both_nibbles();
  d.scales = {127};
  Bf16Run t(d, 1, 1, 32);
  ASSERT_TRUE(t.status.ok()) << t.status.message();
  for (int k = 0; k < 32; ++k) {
    const int code = k / 2;
    EXPECT_EQ(t.out[size_t(k)], host::float_to_bf16(e2m1_to_float(uint8_t(code)))) << "element " << k;
  }
  EXPECT_EQ(t.out[16], 0x8000);  // code 8 at an even position: -0
  EXPECT_EQ(t.out[17], 0x8000);
  EXPECT_EQ(bf16_to_float(t.out[31]), -6.0f);
}

// Every scale byte 0..254 with every code: exact, except s = 254 with
// |e2m1| >= 2 and s = 253 with |e2m1| >= 4, which overflow to +-inf.
TEST(Mxfp4ToBf16Cpu, EveryScaleByteIsExactUnlessItOverflowsBf16) {
  const int64_t rows = 255;
  Mxfp4Data d;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<uint8_t> row = every_code_in_both_nibbles();
    d.w.insert(d.w.end(), row.begin(), row.end());
    d.scales.push_back(uint8_t(r));
  }
  Bf16Run t(d, 1, rows, 32);
  ASSERT_TRUE(t.status.ok()) << t.status.message();
  int overflows = 0;
  for (int64_t s = 0; s < rows; ++s)
    for (int64_t k = 0; k < 32; ++k) {
      const double want = dequant(d, 32, s, k), mag = kE2m1[(k / 2) & 7];
      const uint16_t got = t.out[size_t(s * 32 + k)];
      const bool overflow = (s == 254 && mag >= 2) || (s == 253 && mag >= 4);
      if (overflow) {
        ++overflows;
        EXPECT_TRUE(std::isinf(bf16_to_float(got))) << "s " << s << " k " << k;
        EXPECT_EQ(std::signbit(bf16_to_float(got)), want < 0) << "s " << s << " k " << k;
      } else {
        EXPECT_EQ(double(bf16_to_float(got)), want) << "s " << s << " k " << k;
        EXPECT_EQ(std::signbit(bf16_to_float(got)), std::signbit(want)) << "s " << s << " k " << k;
      }
    }
  EXPECT_EQ(overflows, 2 * 8 + 2 * 4);  // both signs, both nibbles: {2, 3, 4, 6} at 254, {4, 6} at 253
  EXPECT_EQ(double(bf16_to_float(t.out[2])), std::ldexp(0.5, -127));  // s = 0, code 1: 2^-128, a bf16 subnormal
}

TEST(Mxfp4ToBf16Cpu, NaNScaleGivesNaNForItsSubBlockOnly) {
  Rng rng(test_seed());
  Mxfp4Data d = random_mxfp4(rng, 1, 2, 96);
  d.scales[4] = 255;  // row 1, second sub-block
  Bf16Run t(d, 1, 2, 96);
  ASSERT_TRUE(t.status.ok());
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t k = 0; k < 96; ++k) {
      const uint16_t got = t.out[size_t(r * 96 + k)];
      if (r == 1 && k / 32 == 1) EXPECT_EQ(got, 0x7fc0) << k;
      else EXPECT_EQ(double(bf16_to_float(got)), dequant(d, 96, r, k)) << r << ", " << k;
    }
}

// ---------------------------------------------------------------------------
// mxfp4_to_fp8_block (spec §13.2, §13.3)
// ---------------------------------------------------------------------------

// Spread 0 (one scale for the block): the top shift 6 puts 6 at 384, 0.5 at
// 32; every code in both nibbles exact, and the block scale 2^(e - 6).
TEST(Mxfp4ToFp8BlockCpu, EveryCodeInEveryNibbleAtSpreadZero) {
  Mxfp4Data d;
  for (int g = 0; g < 4; ++g) {
    const std::vector<uint8_t> row = every_code_in_both_nibbles();
    d.w.insert(d.w.end(), row.begin(), row.end());
    d.scales.push_back(130);
  }
  Fp8Run t(d, 1, 1, 128);
  ASSERT_TRUE(t.status.ok()) << t.status.message();
  EXPECT_EQ(t.scales[0], std::ldexp(1.0f, 130 - 127 - 6));
  for (int k = 0; k < 128; ++k) {
    const int code = (k % 32) / 2;
    const float want_q = e2m1_to_float(uint8_t(code)) * 64.0f;
    EXPECT_EQ(t.q[size_t(k)], host::float_to_e4m3(want_q)) << "element " << k;
    EXPECT_EQ(e4m3_to_float(t.q[size_t(k)]), want_q) << "element " << k;  // exact
    EXPECT_EQ(t.value(1, 128, 0, k), dequant(d, 128, 0, k));
  }
  EXPECT_EQ(t.q[7 * 2], 0x7c);  // 6 * 64 = 384: e4m3 exponent 8, mantissa 4 (1.5)
  EXPECT_EQ(t.q[8 * 2], 0x80);  // -0
}

// Spread delta = e_max - e for delta = 0..20, every code in both nibbles:
// exact for delta <= 14; beyond, exactly spec §13.2's table (in units of the
// element's own scale) and within 2^(e_max - 16).
TEST(Mxfp4ToFp8BlockCpu, SpreadsUpTo14AreExactAndBeyondFollowTheTable) {
  // Dequantised magnitude in units of 2^e, by spread (15..18) and code & 7 (1..7).
  const double table[4][8] = {{0, 0, 1, 2, 2, 3, 4, 6},
                              {0, 0, 0, 2, 2, 4, 4, 6},
                              {0, 0, 0, 0, 0, 4, 4, 8},
                              {0, 0, 0, 0, 0, 0, 0, 8}};
  const int top = 150;  // the block's largest scale byte, on row 0's first sub-block
  const int64_t rows = 21, cols = 128;
  Mxfp4Data d;
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < 4; ++g) {
      const std::vector<uint8_t> row = every_code_in_both_nibbles();
      d.w.insert(d.w.end(), row.begin(), row.end());
      d.scales.push_back(uint8_t(top - r));  // row r: spread r on every sub-block
    }
  Fp8Run t(d, 1, rows, cols);
  ASSERT_TRUE(t.status.ok()) << t.status.message();
  EXPECT_EQ(t.scales[0], std::ldexp(1.0f, top - 127 - 6));
  const double bound = std::ldexp(1.0, top - 127 - 16);
  int inexact_found = 0, inexact_expected = 0;
  for (int64_t spread = 0; spread < rows; ++spread)
    for (int64_t k = 0; k < cols; ++k) {
      const int code = int((k % 32) / 2), mag = code & 7;
      const double want = dequant(d, cols, spread, k), got = t.value(rows, cols, spread, k);
      const uint8_t q = t.q[size_t(spread * cols + k)];
      EXPECT_EQ(std::signbit(e4m3_to_float(q)), code >= 8) << "spread " << spread << " code " << code;  // signs kept
      EXPECT_LE(std::fabs(got - want), bound) << "spread " << spread << " code " << code;
      if (got != want) ++inexact_found;
      if (spread <= 14) {
        EXPECT_EQ(got, want) << "spread " << spread << " code " << code;
        continue;
      }
      const double unit = std::ldexp(1.0, top - int(spread) - 127);
      const double want_mag = spread <= 18 ? table[spread - 15][mag] : 0.0;
      EXPECT_EQ(std::fabs(got), want_mag * unit) << "spread " << spread << " code " << code;
      if (want_mag != kE2m1[mag]) ++inexact_expected;
    }
  // Found: exactly the bold entries of the table (both signs, both nibbles, four sub-blocks).
  EXPECT_EQ(inexact_found, inexact_expected);
  // Per spread 15..20: 2, 4, 6, 7, 7, 7 magnitudes, times 2 signs, 2 nibbles, 4 sub-blocks.
  EXPECT_EQ(inexact_expected, 16 * (2 + 4 + 6 + 7 + 7 + 7));
}

// The block scale is 2^(e_max - 6) over every row and sub-block of the
// 128 x 128 block (a partial last row block included), never across
// matrices; a batch gives each matrix what converting it alone gives.
TEST(Mxfp4ToFp8BlockCpu, BlockScaleIsTheBlockMaxAndBlocksNeverCrossMatrices) {
  Rng rng(test_seed());
  const int64_t E = 3, N = 130, K = 256;
  Mxfp4Data d = random_mxfp4(rng, E, N, K);
  d.scales[size_t((1 * N + 129) * (K / 32) + 5)] = 200;  // expert 1, the partial row block, column block 1
  Fp8Run all(d, E, N, K);
  ASSERT_TRUE(all.status.ok());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t rb = 0; rb < 2; ++rb)
      for (int64_t cb = 0; cb < 2; ++cb) {
        int top = -1;
        for (int64_t r = rb * 128; r < std::min<int64_t>(N, rb * 128 + 128); ++r)
          for (int64_t g = cb * 4; g < cb * 4 + 4; ++g) top = std::max(top, int(d.scales[size_t((e * N + r) * 8 + g)]));
        EXPECT_EQ(all.scales[size_t((e * 2 + rb) * 2 + cb)], std::ldexp(1.0f, top - 127 - 6)) << e << rb << cb;
      }
    Mxfp4Data one;
    one.w.assign(d.w.begin() + e * N * K / 2, d.w.begin() + (e + 1) * N * K / 2);
    one.scales.assign(d.scales.begin() + e * N * K / 32, d.scales.begin() + (e + 1) * N * K / 32);
    Fp8Run alone(one, 1, N, K);
    ASSERT_TRUE(alone.status.ok());
    EXPECT_TRUE(std::equal(alone.q.begin(), alone.q.end(), all.q.begin() + e * N * K)) << "expert " << e;
    EXPECT_TRUE(std::equal(alone.scales.begin(), alone.scales.end(), all.scales.begin() + e * 4)) << "expert " << e;
  }
  EXPECT_EQ(all.scales[size_t((1 * 2 + 1) * 2 + 1)], std::ldexp(1.0f, 200 - 133));
}

// Realistic scales (spreads well under 15): the FP8 block format holds the
// dequantised weights exactly, the same values mxfp4_to_bf16 gives.
TEST(Mxfp4ToFp8BlockCpu, RealisticWeightsAreExactAndAgreeWithBf16) {
  Rng rng(test_seed());
  const int64_t E = 2, N = 200, K = 384;
  Mxfp4Data d = random_mxfp4(rng, E, N, K);
  Fp8Run f(d, E, N, K);
  Bf16Run h(d, E, N, K);
  ASSERT_TRUE(f.status.ok() && h.status.ok());
  for (int64_t r = 0; r < E * N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const double want = dequant(d, K, r, k);
      ASSERT_EQ(f.value(N, K, r, k), want) << r << ", " << k;
      ASSERT_EQ(double(bf16_to_float(h.out[size_t(r * K + k)])), want) << r << ", " << k;
    }
}

// Deep rows (15..22 binades under their block's top): the inexact elements
// are found, and each is within 2^(e_max - 16); the rest stay exact.
TEST(Mxfp4ToFp8BlockCpu, DeepRowsAreFoundAndBounded) {
  Rng rng(test_seed());
  const int64_t N = 256, K = 256;
  Mxfp4Options o;
  o.deep_row_every = 9;
  Mxfp4Data d = random_mxfp4(rng, 1, N, K, o);
  Fp8Run f(d, 1, N, K);
  ASSERT_TRUE(f.status.ok());
  int64_t inexact = 0, deep_elements = 0;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float block_scale = f.scales[size_t((r / 128) * 2 + k / 128)];
      const int e_max = std::ilogb(block_scale) + 6;
      const int e = int(d.scales[size_t(r * (K / 32) + k / 32)]) - 127;
      const double want = dequant(d, K, r, k), got = f.value(N, K, r, k);
      if (e_max - e <= 14) {
        ASSERT_EQ(got, want) << r << ", " << k;
        continue;
      }
      ++deep_elements;
      if (got != want) ++inexact;
      ASSERT_LE(std::fabs(got - want), std::ldexp(1.0, e_max - 16)) << r << ", " << k;
    }
  EXPECT_GT(deep_elements, 0);
  EXPECT_GT(inexact, deep_elements / 4);  // a quarter of the codes round at spread 15, more further down
}

// A NaN scale: its 32 elements are the NaN byte 0x7f and it stays out of the
// block's maximum; a block with no finite scale gets scale 1.
TEST(Mxfp4ToFp8BlockCpu, NaNScalesGiveNaNElementsAndStayOutOfTheMax) {
  Rng rng(test_seed());
  Mxfp4Data d = random_mxfp4(rng, 1, 2, 256);
  for (int g = 0; g < 8; ++g) d.scales[size_t(g)] = 100;
  for (int g = 0; g < 8; ++g) d.scales[size_t(8 + g)] = 100;
  d.scales[2] = 255;                                     // row 0, column block 0: one NaN sub-block
  for (int g = 4; g < 8; ++g) d.scales[size_t(g)] = 255;  // column block 1: NaN on row 0 ...
  for (int g = 12; g < 16; ++g) d.scales[size_t(g)] = 255;  // ... and row 1: no finite scale
  Fp8Run f(d, 1, 2, 256);
  ASSERT_TRUE(f.status.ok());
  EXPECT_EQ(f.scales[0], std::ldexp(1.0f, 100 - 133));
  EXPECT_EQ(f.scales[1], 1.0f);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t k = 0; k < 256; ++k) {
      const bool nan = d.scales[size_t(r * 8 + k / 32)] == 255;
      if (nan) EXPECT_EQ(f.q[size_t(r * 256 + k)], 0x7f) << r << ", " << k;
      else EXPECT_EQ(f.value(2, 256, r, k), dequant(d, 256, r, k)) << r << ", " << k;
    }
}

// The extreme scale bytes: 0 (2^-127) gives the block scale 2^-133, an fp32
// subnormal, and 254 gives 2^121; both exact.
TEST(Mxfp4ToFp8BlockCpu, ExtremeScalesStayExact) {
  for (int s : {0, 1, 254}) {
    Mxfp4Data d;
    for (int g = 0; g < 4; ++g) {
      const std::vector<uint8_t> row = every_code_in_both_nibbles();
      d.w.insert(d.w.end(), row.begin(), row.end());
      d.scales.push_back(uint8_t(s));
    }
    Fp8Run f(d, 1, 1, 128);
    ASSERT_TRUE(f.status.ok());
    EXPECT_EQ(f.scales[0], std::ldexp(1.0f, s - 133)) << "s " << s;
    EXPECT_GT(f.scales[0], 0.0f);
    for (int64_t k = 0; k < 128; ++k) EXPECT_EQ(f.value(1, 128, 0, k), dequant(d, 128, 0, k)) << "s " << s;
  }
}

TEST(Mxfp4Cpu, ZeroBatchOrRowsNeedNoPointers) {
  Mxfp4ToFp8BlockArgs f;
  f.cols = 128;
  f.rows = 5;
  f.batch = 0;
  EXPECT_TRUE(mxfp4_to_fp8_block_cpu(f).ok());
  f.batch = 2;
  f.rows = 0;
  EXPECT_TRUE(mxfp4_to_fp8_block_cpu(f).ok());
  Mxfp4ToBf16Args b;
  b.cols = 32;
  b.rows = 0;
  EXPECT_TRUE(mxfp4_to_bf16_cpu(b).ok());
}

// ---------------------------------------------------------------------------
// Bad input (spec §13.5)
// ---------------------------------------------------------------------------

namespace {

struct ValidBuffers {
  alignas(16) uint8_t w[2 * 256 / 2 + 32];
  alignas(16) uint8_t s[2 * 256 / 32 + 16];
  alignas(16) uint8_t q[2 * 256 + 32];
  alignas(16) float qs[4];
  alignas(16) uint16_t out[2 * 256 + 16];
};

template <typename Args, typename Mutate>
void expect_rejected(Args a, Status (*validate)(const Args&), Status (*cpu)(const Args&), const char* arg,
                     Mutate mutate) {
  mutate(a);
  const Status v = validate(a), c = cpu(a);
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument) << arg;
  EXPECT_NE(v.message().find(std::string(": ") + arg + ": "), std::string::npos) << v.message();
  EXPECT_EQ(c.message(), v.message());
}

}  // namespace

TEST(Mxfp4CpuErrors, Fp8BlockNamesTheArgument) {
  ValidBuffers buf;
  Mxfp4ToFp8BlockArgs a;
  a.w = buf.w;
  a.w_scales = buf.s;
  a.q = buf.q;
  a.q_scales = buf.qs;
  a.rows = 2;
  a.cols = 256;
  ASSERT_TRUE(validate_mxfp4_to_fp8_block(a).ok());
  using A = Mxfp4ToFp8BlockArgs;
  auto* v = &validate_mxfp4_to_fp8_block;
  auto* c = &mxfp4_to_fp8_block_cpu;
  expect_rejected(a, v, c, "cols", [](A& x) { x.cols = 96; });   // a multiple of 32, not of 128
  expect_rejected(a, v, c, "cols", [](A& x) { x.cols = 200; });  // not even a multiple of 32
  expect_rejected(a, v, c, "cols", [](A& x) { x.cols = 0; });
  expect_rejected(a, v, c, "rows", [](A& x) { x.rows = -1; });
  expect_rejected(a, v, c, "batch", [](A& x) { x.batch = -2; });
  expect_rejected(a, v, c, "rows", [](A& x) { x.batch = 1 << 20; x.rows = 1 << 12; });
  expect_rejected(a, v, c, "w", [](A& x) { x.w = nullptr; });
  expect_rejected(a, v, c, "w_scales", [](A& x) { x.w_scales = nullptr; });
  expect_rejected(a, v, c, "q", [](A& x) { x.q = nullptr; });
  expect_rejected(a, v, c, "q_scales", [](A& x) { x.q_scales = nullptr; });
  expect_rejected(a, v, c, "w", [](A& x) { x.w = static_cast<const uint8_t*>(x.w) + 8; });
  expect_rejected(a, v, c, "q", [](A& x) { x.q = static_cast<uint8_t*>(x.q) + 4; });
  expect_rejected(a, v, c, "q_scales", [](A& x) { x.q_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(x.q_scales) + 2); });
  expect_rejected(a, v, c, "q", [](A& x) { x.q = const_cast<void*>(x.w); });
  expect_rejected(a, v, c, "q_scales", [](A& x) { x.q_scales = reinterpret_cast<float*>(static_cast<uint8_t*>(x.q) + 64); });
  expect_rejected(a, v, c, "block", [](A& x) { x.block = Fp8Block(2); });
}

TEST(Mxfp4CpuErrors, Bf16NamesTheArgument) {
  ValidBuffers buf;
  Mxfp4ToBf16Args a;
  a.w = buf.w;
  a.w_scales = buf.s;
  a.out = buf.out;
  a.rows = 2;
  a.cols = 256;
  ASSERT_TRUE(validate_mxfp4_to_bf16(a).ok());
  a.cols = 96;  // any multiple of 32 is fine here
  ASSERT_TRUE(validate_mxfp4_to_bf16(a).ok());
  using A = Mxfp4ToBf16Args;
  auto* v = &validate_mxfp4_to_bf16;
  auto* c = &mxfp4_to_bf16_cpu;
  expect_rejected(a, v, c, "cols", [](A& x) { x.cols = 48; });
  expect_rejected(a, v, c, "cols", [](A& x) { x.cols = -32; });
  expect_rejected(a, v, c, "w", [](A& x) { x.w = nullptr; });
  expect_rejected(a, v, c, "out", [](A& x) { x.out = nullptr; });
  expect_rejected(a, v, c, "out", [](A& x) { x.out = static_cast<uint16_t*>(x.out) + 1; });
  expect_rejected(a, v, c, "out", [](A& x) { x.out = const_cast<void*>(x.w_scales); });
}

// ---------------------------------------------------------------------------
// stack_deepseek_v4_experts (spec §13.6)
// ---------------------------------------------------------------------------

namespace {

// A synthetic V4 checkpoint: per expert w1 / w3 [I, H/2] + [I, H/32], w2
// [H, I/2] + [H, I/32], random bytes.
struct V4Checkpoint {
  struct Expert {
    std::vector<uint8_t> w1, s1, w3, s3, w2, s2;
  };
  int64_t H, I;
  std::vector<Expert> experts;
  std::vector<DeepSeekV4ExpertMxfp4> views;
  V4Checkpoint(Rng& rng, int E, int64_t hidden, int64_t inter) : H(hidden), I(inter), experts(size_t(E)) {
    auto fill = [&](std::vector<uint8_t>& v, int64_t n) {
      v.resize(size_t(n));
      for (uint8_t& b : v) b = uint8_t(rng.integer(0, 255));
    };
    for (Expert& x : experts) {
      fill(x.w1, I * H / 2), fill(x.s1, I * H / 32), fill(x.w3, I * H / 2), fill(x.s3, I * H / 32);
      fill(x.w2, H * I / 2), fill(x.s2, H * I / 32);
      views.push_back({x.w1.data(), x.s1.data(), x.w3.data(), x.s3.data(), x.w2.data(), x.s2.data()});
    }
  }
};

}  // namespace

TEST(StackDeepSeekV4Experts, GateUpAndInterleavedPutEveryRowInPlace) {
  Rng rng(test_seed());
  const int E = 3;
  const int64_t H = 64, I = 96;
  V4Checkpoint ck(rng, E, H, I);
  for (Fc1WeightLayout layout : {Fc1WeightLayout::kGateUp, Fc1WeightLayout::kInterleaved}) {
    std::vector<uint8_t> w1(size_t(E * 2 * I * H / 2), kPoison), s1(size_t(E * 2 * I * H / 32), kPoison);
    std::vector<uint8_t> w2(size_t(E * H * I / 2), kPoison), s2(size_t(E * H * I / 32), kPoison);
    StackDeepSeekV4ExpertsArgs a;
    a.experts = ck.views.data();
    a.num_experts = E;
    a.hidden = H;
    a.inter = I;
    a.layout = layout;
    a.w1 = w1.data();
    a.w1_scales = s1.data();
    a.w2 = w2.data();
    a.w2_scales = s2.data();
    const Status st = stack_deepseek_v4_experts(a);
    ASSERT_TRUE(st.ok()) << st.message();
    for (int e = 0; e < E; ++e) {
      const V4Checkpoint::Expert& x = ck.experts[size_t(e)];
      for (int64_t i = 0; i < I; ++i) {
        const int64_t gate = layout == Fc1WeightLayout::kGateUp ? i : 2 * i;
        const int64_t up = layout == Fc1WeightLayout::kGateUp ? I + i : 2 * i + 1;
        const int64_t base = int64_t(e) * 2 * I;
        EXPECT_TRUE(std::equal(x.w1.begin() + i * H / 2, x.w1.begin() + (i + 1) * H / 2,
                               w1.begin() + (base + gate) * H / 2)) << "gate row " << i;
        EXPECT_TRUE(std::equal(x.w3.begin() + i * H / 2, x.w3.begin() + (i + 1) * H / 2,
                               w1.begin() + (base + up) * H / 2)) << "up row " << i;
        EXPECT_TRUE(std::equal(x.s1.begin() + i * H / 32, x.s1.begin() + (i + 1) * H / 32,
                               s1.begin() + (base + gate) * H / 32)) << "gate scales " << i;
        EXPECT_TRUE(std::equal(x.s3.begin() + i * H / 32, x.s3.begin() + (i + 1) * H / 32,
                               s1.begin() + (base + up) * H / 32)) << "up scales " << i;
      }
      EXPECT_TRUE(std::equal(x.w2.begin(), x.w2.end(), w2.begin() + e * H * I / 2)) << "w2 of expert " << e;
      EXPECT_TRUE(std::equal(x.s2.begin(), x.s2.end(), s2.begin() + e * H * I / 32)) << "w2 scales of " << e;
    }
  }
}

// The stacked W1 of one expert, converted, is gate then up: row i of the
// bf16 dequantisation is w1's row i, row I + i is w3's row i.
TEST(StackDeepSeekV4Experts, StackedWeightsDequantiseToTheExpertsRows) {
  Rng rng(test_seed());
  const int64_t H = 128, I = 64;
  V4Checkpoint ck(rng, 1, H, I);
  for (auto* s : {&ck.experts[0].s1, &ck.experts[0].s3, &ck.experts[0].s2})
    for (uint8_t& b : *s) b = uint8_t(rng.integer(110, 130));  // finite scales
  std::vector<uint8_t> w1(size_t(2 * I * H / 2)), s1(size_t(2 * I * H / 32)), w2(size_t(H * I / 2)),
      s2(size_t(H * I / 32));
  StackDeepSeekV4ExpertsArgs a;
  a.experts = ck.views.data();
  a.num_experts = 1;
  a.hidden = H;
  a.inter = I;
  a.w1 = w1.data();
  a.w1_scales = s1.data();
  a.w2 = w2.data();
  a.w2_scales = s2.data();
  ASSERT_TRUE(stack_deepseek_v4_experts(a).ok());
  Mxfp4Data stacked{w1, s1}, gate{ck.experts[0].w1, ck.experts[0].s1}, up{ck.experts[0].w3, ck.experts[0].s3};
  Bf16Run all(stacked, 1, 2 * I, H);
  ASSERT_TRUE(all.status.ok());
  for (int64_t i = 0; i < I; ++i)
    for (int64_t k = 0; k < H; ++k) {
      EXPECT_EQ(double(bf16_to_float(all.out[size_t(i * H + k)])), dequant(gate, H, i, k));
      EXPECT_EQ(double(bf16_to_float(all.out[size_t((I + i) * H + k)])), dequant(up, H, i, k));
    }
}

TEST(StackDeepSeekV4Experts, BadInputNamesTheArgument) {
  Rng rng(test_seed());
  V4Checkpoint ck(rng, 2, 64, 32);
  std::vector<uint8_t> out(4096);
  StackDeepSeekV4ExpertsArgs a;
  a.experts = ck.views.data();
  a.num_experts = 2;
  a.hidden = 64;
  a.inter = 32;
  a.w1 = a.w1_scales = a.w2 = a.w2_scales = out.data();
  struct Bad {
    const char* argument;
    void (*mutate)(StackDeepSeekV4ExpertsArgs&);
  };
  static std::vector<DeepSeekV4ExpertMxfp4> broken;
  broken = ck.views;
  broken[1].w3_scale = nullptr;
  const Bad bad[] = {
      {"num_experts", [](StackDeepSeekV4ExpertsArgs& x) { x.num_experts = 0; }},
      {"hidden", [](StackDeepSeekV4ExpertsArgs& x) { x.hidden = 48; }},
      {"inter", [](StackDeepSeekV4ExpertsArgs& x) { x.inter = 0; }},
      {"layout", [](StackDeepSeekV4ExpertsArgs& x) { x.layout = Fc1WeightLayout(7); }},
      {"experts", [](StackDeepSeekV4ExpertsArgs& x) { x.experts = nullptr; }},
      {"experts[1].w3_scale", [](StackDeepSeekV4ExpertsArgs& x) { x.experts = broken.data(); }},
      {"w2_scales", [](StackDeepSeekV4ExpertsArgs& x) { x.w2_scales = nullptr; }},
  };
  for (const Bad& b : bad) {
    StackDeepSeekV4ExpertsArgs x = a;
    b.mutate(x);
    const Status st = stack_deepseek_v4_experts(x);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_NE(st.message().find(std::string(": ") + b.argument + ": "), std::string::npos) << st.message();
  }
}

// ---------------------------------------------------------------------------
// The CPU twin of the GPU end-to-end test (test_mxfp4_gpu.cu,
// Fp8LayerOnConvertedWeightsAgainstBf16Layer): MXFP4 experts converted
// both ways by the references, then moe_forward_cpu with FP8 blocks against
// moe_forward_cpu in bf16. The weights are the same values; what differs is
// the FP8 layer's quantisation of X and of FC1's rows (spec §10.4): about 4%
// relative, held to 2^-3.
// ---------------------------------------------------------------------------

TEST(Mxfp4Cpu, Fp8LayerOnConvertedWeightsAgainstBf16Layer) {
  Rng rng(test_seed() ^ 0x4f4ull);
  const int64_t T = 16, H = 256, I = 128;
  const int k = 6, E = 16, start = 4, local = 8;
  const Mxfp4Data w1 = random_mxfp4(rng, local, 2 * I, H), w2 = random_mxfp4(rng, local, H, I);
  Fp8Run f1(w1, local, 2 * I, H), f2(w2, local, H, I);
  Bf16Run h1(w1, local, 2 * I, H), h2(w2, local, H, I);
  ASSERT_TRUE(f1.status.ok() && f2.status.ok() && h1.status.ok() && h2.status.ok());
  HostTensor X(DType::kBFloat16, T * H);
  X.fill_random(rng);
  const Routing r = random_routing(rng, T, k, E, start, local);
  std::vector<float> weights(size_t(T * k));
  for (float& v : weights) v = rng.uniform(0.1f, 1.0f);
  std::vector<uint16_t> out8(size_t(T * H), 0xffff), out16(size_t(T * H), 0xffff);

  MoeForwardArgs a;
  a.num_tokens = T;
  a.hidden = H;
  a.inter = I;
  a.k = k;
  a.num_experts = E;
  a.start_expert_id = start;
  a.num_experts_per_node = local;
  a.X = X.data();
  a.token_selected_experts = r.experts.data();
  a.token_final_scales = weights.data();
  a.activation = MoeActivation::kSwiGLUClamped;
  a.fc2_mode = Fc2Mode::kDeterministic;
  MoeForwardArgs a8 = a, a16 = a;
  a8.fp8 = MoeFp8Scaling::kBlock;
  a8.W1 = f1.q.data();
  a8.w1_scales = f1.scales.data();
  a8.W2 = f2.q.data();
  a8.w2_scales = f2.scales.data();
  a8.out = out8.data();
  a16.W1 = h1.out.data();
  a16.W2 = h2.out.data();
  a16.out = out16.data();
  Status st = moe_forward_cpu(a8);
  ASSERT_TRUE(st.ok()) << st.message();
  st = moe_forward_cpu(a16);
  ASSERT_TRUE(st.ok()) << st.message();
  double num = 0, den = 0;
  for (size_t i = 0; i < out8.size(); ++i) {
    const double x8 = bf16_to_float(out8[i]), x16 = bf16_to_float(out16[i]);
    ASSERT_FALSE(std::isnan(x8) || std::isnan(x16)) << i;
    num += (x8 - x16) * (x8 - x16);
    den += x16 * x16;
  }
  ASSERT_GT(den, 0.0);
  const double rel = std::sqrt(num / den);
  std::printf("[ mxfp4    ] CPU: FP8 layer on mxfp4_to_fp8_block weights vs bf16 layer on mxfp4_to_bf16 weights: "
              "rel. Frobenius error %.4f\n", rel);
  EXPECT_LE(rel, std::ldexp(1.0, -3));
  EXPECT_GT(rel, 0.0);  // the FP8 layer really quantised X and FC1's rows
}

// ---------------------------------------------------------------------------
// 1 x 128 groups (spec §13.3, `block`): one row's four sub-blocks share a scale
// ---------------------------------------------------------------------------

// Each row's scale is 2^(its own e_max - 6), stored [rows, K / 128]: rows far
// below the others, which 128 x 128 blocks round, stay exact.
TEST(Mxfp4ToFp8BlockCpu, RowGroupsTakeEachRowsOwnMax) {
  Rng rng(test_seed());
  const int64_t E = 2, N = 130, K = 256;
  Mxfp4Options o;
  o.deep_row_every = 4;  // rows 15..22 binades under the others
  const Mxfp4Data d = random_mxfp4(rng, E, N, K, o);
  Fp8Run tiles(d, E, N, K);
  ASSERT_TRUE(tiles.status.ok());
  std::vector<uint8_t> q(size_t(E * N * K), kPoison);
  std::vector<float> scales(size_t(E * N * (K / 128)), -1.0f);
  Mxfp4ToFp8BlockArgs a;
  a.w = d.w.data();
  a.w_scales = d.scales.data();
  a.q = q.data();
  a.q_scales = scales.data();
  a.batch = E;
  a.rows = N;
  a.cols = K;
  a.block = Fp8Block::k1x128;
  ASSERT_TRUE(mxfp4_to_fp8_block_cpu(a).ok());
  int64_t inexact_in_tiles = 0;
  for (int64_t r = 0; r < E * N; ++r)
    for (int64_t cb = 0; cb < K / 128; ++cb) {
      int top = 0;
      for (int64_t g = cb * 4; g < cb * 4 + 4; ++g) top = std::max(top, int(d.scales[size_t(r * (K / 32) + g)]));
      const float s = scales[size_t(r * (K / 128) + cb)];
      EXPECT_EQ(s, std::ldexp(1.0f, top - 133)) << "row " << r << " block " << cb;
      for (int64_t k = cb * 128; k < cb * 128 + 128; ++k) {
        const double want = dequant(d, K, r, k);
        EXPECT_EQ(double(e4m3_to_float(q[size_t(r * K + k)])) * s, want) << r << ", " << k;  // row spread <= 2: exact
        if (tiles.value(N, K, r, k) != want) ++inexact_in_tiles;
      }
    }
  EXPECT_GT(inexact_in_tiles, 0);  // the same weights in 128 x 128 tiles do lose the deep rows' small codes
}

// Within a row the spread rule is §13.2's: sub-blocks 0, 14, 15 and 20
// binades under the row's top.
TEST(Mxfp4ToFp8BlockCpu, RowGroupsFollowTheSpreadRuleWithinARow) {
  Mxfp4Data d;
  for (int g = 0; g < 4; ++g) {
    const std::vector<uint8_t> row = every_code_in_both_nibbles();
    d.w.insert(d.w.end(), row.begin(), row.end());
  }
  d.scales = {150, 136, 135, 130};
  std::vector<uint8_t> q(128);
  float s = 0;
  Mxfp4ToFp8BlockArgs a;
  a.w = d.w.data();
  a.w_scales = d.scales.data();
  a.q = q.data();
  a.q_scales = &s;
  a.rows = 1;
  a.cols = 128;
  a.block = Fp8Block::k1x128;
  ASSERT_TRUE(mxfp4_to_fp8_block_cpu(a).ok());
  EXPECT_EQ(s, std::ldexp(1.0f, 150 - 133));
  const double at15[8] = {0, 0, 1, 2, 2, 3, 4, 6};  // §13.2's row for spread 15, by code & 7
  for (int64_t k = 0; k < 128; ++k) {
    const int mag = int((k % 32) / 2) & 7;
    const double got = double(e4m3_to_float(q[size_t(k)])) * s, want = dequant(d, 128, 0, k);
    if (k < 64) EXPECT_EQ(got, want) << k;  // spreads 0 and 14: exact
    else if (k < 96) EXPECT_EQ(std::fabs(got), at15[mag] * std::ldexp(1.0, 135 - 127)) << k;
    else EXPECT_EQ(got, 0.0) << k;  // spread 20: everything flushes (sign kept)
  }
}
