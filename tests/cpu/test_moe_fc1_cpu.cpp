// The CPU reference of moe_fc1 (spec §9) on hand-computed cases, and the
// shared validation (spec §9.6): each rule broken names its argument.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "flashmix/moe.h"
#include "moe/moe_fc1_internal.h"
#include "moe/sm90_fc1_gemm.h"

using namespace flashmix;

namespace {

uint16_t bf(float x) { return host::float_to_bf16(x); }
float fl(uint16_t x) { return host::bf16_to_float(x); }

constexpr uint16_t kPoison = 0xffff;  // a NaN no store writes by accident
const float kNaN = std::nanf("");

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// An FC1 call with its logical weights (gate and up rows of each expert kept
// apart) and bias; args() packs W1 and the bias in the chosen layout and
// re-poisons `out`. Every value set is exact in bf16.
struct Fc1Case {
  int64_t T;
  int k, E;
  int64_t H = 8, I = 8;
  int64_t x_stride;  // as stored; args() passes `stride_arg`
  int64_t stride_arg = 0;
  int64_t x_rows;
  std::vector<float> x;           // [x_rows, x_stride], padding included
  std::vector<float> gate, up;    // [E, I, H]
  std::vector<float> bgate, bup;  // [E, I]
  bool use_bias = false;
  std::vector<int64_t> offsets;   // [E + 1]
  std::vector<int32_t> p2u;       // [P]
  MoeFc1Args base;                // activation, limit, alpha, layout, x_permuted
  std::vector<uint16_t> X, W1, bias, out;

  Fc1Case(int64_t T_, int k_, int E_, int64_t x_rows_ = -1, int64_t x_stride_ = 8)
      : T(T_), k(k_), E(E_), x_stride(x_stride_), x_rows(x_rows_ < 0 ? T_ : x_rows_),
        x(size_t(x_rows * x_stride), 0.f), gate(size_t(E * I * H), 0.f), up(size_t(E * I * H), 0.f),
        bgate(size_t(E * I), 0.f), bup(size_t(E * I), 0.f) {
    if (x_stride != H) stride_arg = x_stride;
  }
  float& xv(int64_t row, int64_t h) { return x[size_t(row * x_stride + h)]; }
  float& g(int e, int64_t i, int64_t h) { return gate[size_t((e * I + i) * H + h)]; }
  float& u(int e, int64_t i, int64_t h) { return up[size_t((e * I + i) * H + h)]; }

  MoeFc1Args args() {
    const bool il = base.layout == Fc1WeightLayout::kInterleaved;
    X.resize(x.size());
    for (size_t n = 0; n < x.size(); ++n) X[n] = bf(x[n]);
    W1.assign(size_t(E * 2 * I * H), 0);
    bias.assign(size_t(E * 2 * I), 0);
    for (int e = 0; e < E; ++e)
      for (int64_t i = 0; i < I; ++i) {
        const int64_t gi = il ? 2 * i : i, ui = il ? 2 * i + 1 : I + i;
        for (int64_t h = 0; h < H; ++h) {
          W1[size_t((e * 2 * I + gi) * H + h)] = bf(g(e, i, h));
          W1[size_t((e * 2 * I + ui) * H + h)] = bf(u(e, i, h));
        }
        bias[size_t(e * 2 * I + gi)] = bf(bgate[size_t(e * I + i)]);
        bias[size_t(e * 2 * I + ui)] = bf(bup[size_t(e * I + i)]);
      }
    out.assign(size_t(k * T * I), kPoison);
    MoeFc1Args a = base;
    a.X = X.data();
    a.x_stride = stride_arg;
    a.W1 = W1.data();
    a.bias = use_bias ? bias.data() : nullptr;
    a.expert_first_token_offset = offsets.data();
    a.permuted_row_to_unpermuted_row = p2u.data();
    a.num_tokens = T;
    a.k = k;
    a.hidden = H;
    a.inter = I;
    a.num_experts_per_node = E;
    a.out = out.data();
    return a;
  }
  double o(int64_t p, int64_t i) const { return fl(out[size_t(p * I + i)]); }
  bool untouched(int64_t p) const {
    for (int64_t i = 0; i < I; ++i)
      if (out[size_t(p * I + i)] != kPoison) return false;
    return true;
  }
};

// |got - want| within the bf16 rounding of want (half an ulp, 2^-9 relative;
// 2^-8 leaves room for the float step). NaN must stay NaN.
void expect_bf16(double got, double want, const std::string& where) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << where << ": got " << got << ", want NaN";
    return;
  }
  EXPECT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8)) << where << ": got " << got << ", want " << want;
}

// T = 3 tokens, k = 2, E_local = 2, H = I = 8:
//   X[t, h] = t + h/2; gate row i of expert e = unit vector h = i, so
//   g = X[t, i] = t + i/2; up row i of expert e = (e+1) everywhere, so
//   u = (e+1) * Σ_h X[t, h] = (e+1) * (8t + 14).
// Slots j*T + t. Expert 0 rows 0..2 <- slots 0 (t0), 4 (t1, j1), 2 (t2);
// expert 1 rows 3, 4 <- slots 3 (t0, j1), 1 (t1). P = 5 of 6 rows.
Fc1Case gather_case() {
  Fc1Case c(3, 2, 2);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < 8; ++h) c.xv(t, h) = float(t) + 0.5f * float(h);
  for (int e = 0; e < 2; ++e)
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t h = 0; h < 8; ++h) {
        c.g(e, i, h) = h == i ? 1.f : 0.f;
        c.u(e, i, h) = float(e + 1);
      }
  c.offsets = {0, 3, 5};
  c.p2u = {0, 4, 2, 3, 1};
  return c;
}

// One token, one expert: X = e_0, so column i computes act(g_i, u_i) with
// gate row i = g_i e_0 and up row i = u_i e_0.
Fc1Case pairs_case(const float (&gs)[8], const float (&us)[8]) {
  Fc1Case c(1, 1, 1);
  c.xv(0, 0) = 1.f;
  for (int64_t i = 0; i < 8; ++i) {
    c.g(0, i, 0) = gs[i];
    c.u(0, i, 0) = us[i];
  }
  c.offsets = {0, 1};
  c.p2u = {0};
  return c;
}

// The activation tests' pairs: some inside every limit, some past the
// default limits on each side (g > L, u < -L, u > L), a zero and a boundary.
const float kG[8] = {2.f, 20.f, 2.f, 2.f, -20.f, 0.f, 7.f, -3.f};
const float kU[8] = {3.f, 3.f, -20.f, 20.f, 20.f, 5.f, -1.f, 6.5f};

void expect_pairs(const Fc1Case& c, const double (&want)[8], const char* what) {
  for (int i = 0; i < 8; ++i) expect_bf16(c.o(0, i), want[i], std::string(what) + " column " + std::to_string(i));
}

}  // namespace

TEST(MoeFc1Cpu, RowsGatherTheirTokenAndExpert) {
  Fc1Case c = gather_case();
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const int64_t token[5] = {0, 1, 2, 0, 1};
  const int expert[5] = {0, 0, 0, 1, 1};
  for (int64_t p = 0; p < 5; ++p)
    for (int64_t i = 0; i < 8; ++i) {
      const double t = double(token[p]);
      const double want = silu(t + 0.5 * double(i)) * double(expert[p] + 1) * (8.0 * t + 14.0);
      expect_bf16(c.o(p, i), want, "row " + std::to_string(p) + " column " + std::to_string(i));
    }
  EXPECT_TRUE(c.untouched(5));  // rows >= P keep the poison
}

// gpt-oss's layout and DeepSeek's: the same logical weights and bias give
// the same bits, and the value the math asks for.
TEST(MoeFc1Cpu, BothLayoutsGiveTheSameResult) {
  Fc1Case c = gather_case();
  for (int e = 0; e < 2; ++e)
    for (int64_t i = 0; i < 8; ++i) {
      for (int64_t h = 0; h < 8; ++h) {
        c.g(e, i, h) = 0.5f * float((e * 7 + i * 3 + h) % 5 - 2);
        c.u(e, i, h) = 0.25f * float((e * 5 + i + 2 * h) % 7 - 3);
      }
      c.bgate[size_t(e * 8 + i)] = 0.5f * float(i % 3) - 0.5f;
      c.bup[size_t(e * 8 + i)] = float(e) - 0.25f * float(i);
    }
  c.use_bias = true;
  for (MoeActivation act : {MoeActivation::kSwiGLU, MoeActivation::kSwiGLUOai, MoeActivation::kSwiGLUClamped}) {
    c.base.activation = act;
    c.base.layout = Fc1WeightLayout::kGateUp;
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    const std::vector<uint16_t> gate_up = c.out;
    c.base.layout = Fc1WeightLayout::kInterleaved;
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    EXPECT_EQ(c.out, gate_up) << to_string(act);
    // One element by hand: row 0 = token 0, expert 0, column 1:
    // X[0] = (0, .5, 1, ..., 3.5); gate row 1 = .5*((3 + h) % 5 - 2) = (.5, 1, -1, -.5, 0, .5, 1, -1),
    // g = 0 + .5 - 1 - .75 + 0 + 1.25 + 3 - 3.5 = -.5, + bias .5*(1 % 3) - .5 = 0;
    // up row 1 = .25*((1 + 2h) % 7 - 3) = (-.5, 0, .5, -.75, -.25, .25, .75, -.5),
    // u = 0 + 0 + .5 - 1.125 - .5 + .625 + 2.25 - 1.75 = 0, + bias 0 - .25.
    const double g = -0.5, u = -0.25;
    const double want = act == MoeActivation::kSwiGLUOai ? g * sigmoid(1.702 * g) * (u + 1.0) : silu(g) * u;
    expect_bf16(c.o(0, 1), want, to_string(act));
    EXPECT_TRUE(c.untouched(5));
  }
}

TEST(MoeFc1Cpu, SwiGLUHasNoClampAndIgnoresLimitAndAlpha) {
  Fc1Case c = pairs_case(kG, kU);
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const double want[8] = {silu(2) * 3,   silu(20) * 3, silu(2) * -20, silu(2) * 20,
                          silu(-20) * 20, 0.0,         silu(7) * -1,  silu(-3) * 6.5};
  expect_pairs(c, want, "swiglu");
  const std::vector<uint16_t> plain = c.out;
  c.base.limit = 1.f;
  c.base.alpha = 3.f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  EXPECT_EQ(c.out, plain);
}

// gpt-oss: g' = min(g, 7), u' = clamp(u, -7, 7), g' sigmoid(1.702 g') (u' + 1).
TEST(MoeFc1Cpu, SwiGLUOaiDefaultsAndClamps) {
  Fc1Case c = pairs_case(kG, kU);
  c.base.activation = MoeActivation::kSwiGLUOai;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const double a = 1.702;
  const double want[8] = {2 * sigmoid(a * 2) * 4,         // inside
                          7 * sigmoid(a * 7) * 4,         // g = 20 clamped to 7
                          2 * sigmoid(a * 2) * (-7 + 1),  // u = -20 clamped to -7
                          2 * sigmoid(a * 2) * (7 + 1),   // u = 20 clamped to 7
                          -20 * sigmoid(a * -20) * 8,     // g has no lower clamp
                          0.0,
                          0.0,                            // u' + 1 = 0
                          -3 * sigmoid(a * -3) * 7.5};
  expect_pairs(c, want, "swiglu_oai");
  EXPECT_EQ(c.o(0, 5), 0.0);
  EXPECT_EQ(c.o(0, 6), 0.0);
  // The defaults given explicitly change nothing.
  const std::vector<uint16_t> defaults = c.out;
  c.base.limit = 7.f;
  c.base.alpha = 1.702f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  EXPECT_EQ(c.out, defaults);
}

TEST(MoeFc1Cpu, SwiGLUOaiLimitAndAlphaOverrides) {
  Fc1Case c = pairs_case(kG, kU);
  c.base.activation = MoeActivation::kSwiGLUOai;
  c.base.limit = 3.f;
  c.base.alpha = 1.f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const double want[8] = {2 * sigmoid(2) * (3 + 1),   3 * sigmoid(3) * (3 + 1),    2 * sigmoid(2) * (-3 + 1),
                          2 * sigmoid(2) * (3 + 1),   -20 * sigmoid(-20) * (3 + 1), 0.0,
                          3 * sigmoid(3) * (-1 + 1), -3 * sigmoid(-3) * (3 + 1)};
  expect_pairs(c, want, "swiglu_oai limit 3 alpha 1");
  // Only alpha changed: the default limit 7.
  c.base.limit = 0.f;
  c.base.alpha = 2.f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  expect_bf16(c.o(0, 0), 2 * sigmoid(2 * 2) * 4, "alpha 2 column 0");
  expect_bf16(c.o(0, 1), 7 * sigmoid(2 * 7) * 4, "alpha 2 column 1");
}

// DeepSeek-V4: silu(min(g, 10)) * clamp(u, -10, 10).
TEST(MoeFc1Cpu, SwiGLUClampedDefaultsAndClamps) {
  const float gs[8] = {2.f, 20.f, 2.f, 2.f, -20.f, 0.f, 10.f, -3.f};
  const float us[8] = {3.f, 3.f, -20.f, 20.f, 20.f, 5.f, -10.f, 6.5f};
  Fc1Case c = pairs_case(gs, us);
  c.base.activation = MoeActivation::kSwiGLUClamped;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const double want[8] = {silu(2) * 3,    silu(10) * 3,  // g = 20 clamped to 10
                          silu(2) * -10,                 // u = -20 clamped
                          silu(2) * 10,                  // u = 20 clamped
                          silu(-20) * 10,                // no lower clamp on g
                          0.0,           silu(10) * -10,  // at the limit: unchanged
                          silu(-3) * 6.5};
  expect_pairs(c, want, "swiglu_clamped");
  // The default given explicitly changes nothing; alpha is not used.
  const std::vector<uint16_t> defaults = c.out;
  c.base.limit = 10.f;
  c.base.alpha = 5.f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  EXPECT_EQ(c.out, defaults);
}

TEST(MoeFc1Cpu, SwiGLUClampedLimitOverride) {
  Fc1Case c = pairs_case(kG, kU);
  c.base.activation = MoeActivation::kSwiGLUClamped;
  c.base.limit = 2.5f;
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  const double want[8] = {silu(2) * 2.5,   silu(2.5) * 2.5, silu(2) * -2.5,    silu(2) * 2.5,
                          silu(-20) * 2.5, 0.0,             silu(2.5) * -1.0, silu(-3) * 2.5};
  expect_pairs(c, want, "swiglu_clamped limit 2.5");
}

// A NaN g or u gives NaN for every activation, also where a clamp would fire
// on the other operand.
TEST(MoeFc1Cpu, ClampsKeepNaN) {
  const float gs[8] = {kNaN, 2.f, kNaN, 20.f, kNaN, -20.f, 2.f, 1.f};
  const float us[8] = {3.f, kNaN, -20.f, kNaN, kNaN, kNaN, 3.f, -1.f};
  for (MoeActivation act : {MoeActivation::kSwiGLU, MoeActivation::kSwiGLUOai, MoeActivation::kSwiGLUClamped}) {
    Fc1Case c = pairs_case(gs, us);
    c.base.activation = act;
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    for (int i = 0; i < 6; ++i) EXPECT_TRUE(std::isnan(c.o(0, i))) << to_string(act) << " column " << i;
    EXPECT_FALSE(std::isnan(c.o(0, 6))) << to_string(act);
    EXPECT_FALSE(std::isnan(c.o(0, 7))) << to_string(act);
  }
}

// The bias is added to g and u before the activation, in W1's row order.
TEST(MoeFc1Cpu, BiasFollowsW1RowOrder) {
  const float gs[8] = {1.f, 2.f, -1.f, 0.f, 3.f, 0.5f, -2.f, 1.f};
  const float us[8] = {1.f, -1.f, 2.f, 0.5f, 0.f, 1.f, 1.f, -3.f};
  for (Fc1WeightLayout layout : {Fc1WeightLayout::kGateUp, Fc1WeightLayout::kInterleaved}) {
    Fc1Case c = pairs_case(gs, us);
    c.base.layout = layout;
    c.use_bias = true;
    for (int64_t i = 0; i < 8; ++i) {
      c.bgate[size_t(i)] = 0.5f * float(i);    // 0, .5, ..., 3.5
      c.bup[size_t(i)] = 2.f - float(i % 4);   // 2, 1, 0, -1, ...
    }
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    for (int i = 0; i < 8; ++i) {
      const double g = gs[i] + 0.5 * i, u = us[i] + 2.0 - (i % 4);
      expect_bf16(c.o(0, i), silu(g) * u, std::string(to_string(layout)) + " column " + std::to_string(i));
    }
    // Without the bias pointer nothing is added.
    c.use_bias = false;
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    expect_bf16(c.o(0, 1), silu(2) * -1, std::string(to_string(layout)) + " no bias");
  }
}

// x_permuted: row p reads X[p] of the caller's permuted copy, not X[t].
TEST(MoeFc1Cpu, XPermutedReadsRowP) {
  // T = 2, k = 2, one expert; rows 0..2 <- slots 3 (t1), 0 (t0), 1 (t1); P = 3 of 4.
  // gate row i = e_0 (g = X[row, 0]), up row i = (i+1) e_1 (u = (i+1) X[row, 1]).
  for (bool permuted : {false, true}) {
    Fc1Case c(2, 2, 1, permuted ? 4 : 2);
    for (int64_t r = 0; r < c.x_rows; ++r) {
      c.xv(r, 0) = permuted ? -0.5f * float(r + 1) : float(r + 1);
      c.xv(r, 1) = permuted ? float(r + 2) : 0.5f;
    }
    for (int64_t i = 0; i < 8; ++i) {
      c.g(0, i, 0) = 1.f;
      c.u(0, i, 1) = float(i + 1);
    }
    c.offsets = {0, 3};
    c.p2u = {3, 0, 1};
    c.base.x_permuted = permuted;
    ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
    const int64_t token[3] = {1, 0, 1};
    for (int64_t p = 0; p < 3; ++p) {
      const int64_t r = permuted ? p : token[p];
      for (int64_t i = 0; i < 8; ++i) {
        const double want = permuted ? silu(-0.5 * double(r + 1)) * double(i + 1) * double(r + 2)
                                     : silu(double(r + 1)) * double(i + 1) * 0.5;
        expect_bf16(c.o(p, i), want, std::string(permuted ? "permuted" : "gathered") + " row " + std::to_string(p));
      }
    }
    EXPECT_TRUE(c.untouched(3));
  }
}

// x_stride > hidden: the padding (NaN here) is never read.
TEST(MoeFc1Cpu, XStrideSkipsThePadding) {
  Fc1Case c(3, 2, 2, -1, 24);
  Fc1Case ref = gather_case();
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < 24; ++h) c.xv(t, h) = h < 8 ? ref.xv(t, h) : kNaN;
  c.gate = ref.gate;
  c.up = ref.up;
  c.offsets = ref.offsets;
  c.p2u = ref.p2u;
  ASSERT_TRUE(moe_fc1_cpu(ref.args()).ok());
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  EXPECT_EQ(c.out, ref.out);
}

// Expert parallelism: a local expert may get no rows; the next expert's rows
// still use that expert's weights.
TEST(MoeFc1Cpu, EmptyLocalExpert) {
  Fc1Case c(2, 2, 3);
  for (int64_t t = 0; t < 2; ++t) c.xv(t, 0) = float(t + 1);
  for (int e = 0; e < 3; ++e)
    for (int64_t i = 0; i < 8; ++i) {
      c.g(e, i, 0) = float(e + 1);
      c.u(e, i, 0) = 1.f;
    }
  c.offsets = {0, 2, 2, 3};  // expert 1 empty; P = 3 of 4
  c.p2u = {0, 1, 3};         // e0 <- t0, t1; e2 <- slot 3 (t1, j1)
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  for (int64_t i = 0; i < 8; ++i) {
    expect_bf16(c.o(0, i), silu(1) * 1, "row 0");
    expect_bf16(c.o(1, i), silu(2) * 2, "row 1");
    expect_bf16(c.o(2, i), silu(6) * 2, "row 2");  // expert 2: g = 3 * 2
  }
  EXPECT_TRUE(c.untouched(3));
  // No local row at all: nothing written.
  c.offsets = {0, 0, 0, 0};
  ASSERT_TRUE(moe_fc1_cpu(c.args()).ok());
  for (int64_t p = 0; p < 4; ++p) EXPECT_TRUE(c.untouched(p)) << p;
}

TEST(MoeFc1Cpu, ZeroTokensIsValid) {
  MoeFc1Args a;
  a.num_tokens = 0;
  a.k = 2;
  a.hidden = 8;
  a.inter = 8;
  a.num_experts_per_node = 4;
  EXPECT_TRUE(validate_moe_fc1(a).ok());
  EXPECT_TRUE(moe_fc1_cpu(a).ok());
  // The size rules still apply at T = 0.
  a.hidden = 12;
  EXPECT_FALSE(moe_fc1_cpu(a).ok());
}

TEST(MoeFc1Names, ToString) {
  EXPECT_STREQ(to_string(MoeActivation::kSwiGLU), "swiglu");
  EXPECT_STREQ(to_string(MoeActivation::kSwiGLUOai), "swiglu_oai");
  EXPECT_STREQ(to_string(MoeActivation::kSwiGLUClamped), "swiglu_clamped");
  EXPECT_STREQ(to_string(static_cast<MoeActivation>(3)), "unknown");
  EXPECT_STREQ(to_string(Fc1WeightLayout::kGateUp), "gate_up");
  EXPECT_STREQ(to_string(Fc1WeightLayout::kInterleaved), "interleaved");
  EXPECT_STREQ(to_string(static_cast<Fc1WeightLayout>(2)), "unknown");
}

namespace {
// A size or parameter rule fails in the sizes-only mode too; a buffer rule
// (presence, alignment, overlap) only when the buffers are checked.
enum class Rule { kSize, kBuffer };
void expect_invalid(const MoeFc1Args& a, const std::string& arg, Rule rule) {
  Status st = validate_moe_fc1(a);
  EXPECT_FALSE(st.ok()) << arg;
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << arg;
  EXPECT_NE(st.message().find("moe_fc1: " + arg + ":"), std::string::npos) << st.message();
  EXPECT_EQ(validate_fc1(a, false).ok(), rule == Rule::kBuffer) << arg;
  EXPECT_FALSE(moe_fc1_cpu(a).ok()) << arg;
}
}  // namespace

TEST(MoeFc1Validation, TheValidCaseIsValid) {
  Fc1Case c = gather_case();
  c.use_bias = true;
  MoeFc1Args a = c.args();
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  EXPECT_TRUE(validate_fc1(a, false).ok());
}

TEST(MoeFc1Validation, NumTokens) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.num_tokens = -1;
  expect_invalid(a, "num_tokens", Rule::kSize);
  a = c.args();
  a.num_tokens = int64_t(1) << 28;
  a.k = 8;  // k*T = 2^31: overflows int32
  expect_invalid(a, "num_tokens", Rule::kSize);
}

TEST(MoeFc1Validation, K) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.k = 0;
  expect_invalid(a, "k", Rule::kSize);
  a.k = 17;
  expect_invalid(a, "k", Rule::kSize);
}

TEST(MoeFc1Validation, Hidden) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  for (int64_t h : {int64_t(0), int64_t(-8), int64_t(12), int64_t(1) << 32}) {
    a.hidden = h;
    a.x_stride = 0;
    expect_invalid(a, "hidden", Rule::kSize);
  }
}

TEST(MoeFc1Validation, Inter) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  for (int64_t i : {int64_t(0), int64_t(-8), int64_t(4), int64_t(1) << 32}) {
    a.inter = i;
    expect_invalid(a, "inter", Rule::kSize);
  }
}

TEST(MoeFc1Validation, NumExpertsPerNode) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.num_experts_per_node = 0;
  expect_invalid(a, "num_experts_per_node", Rule::kSize);
  a.num_experts_per_node = 1025;
  expect_invalid(a, "num_experts_per_node", Rule::kSize);
}

TEST(MoeFc1Validation, ActivationAndLayoutValues) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.activation = static_cast<MoeActivation>(3);
  expect_invalid(a, "activation", Rule::kSize);
  a = c.args();
  a.activation = static_cast<MoeActivation>(-1);
  expect_invalid(a, "activation", Rule::kSize);
  a = c.args();
  a.layout = static_cast<Fc1WeightLayout>(2);
  expect_invalid(a, "layout", Rule::kSize);
}

// Checked for every activation, also kSwiGLU, which does not use them.
TEST(MoeFc1Validation, LimitAndAlpha) {
  Fc1Case c = gather_case();
  for (MoeActivation act : {MoeActivation::kSwiGLU, MoeActivation::kSwiGLUOai, MoeActivation::kSwiGLUClamped}) {
    for (float bad : {-1.f, kNaN, INFINITY, -INFINITY}) {
      MoeFc1Args a = c.args();
      a.activation = act;
      a.limit = bad;
      expect_invalid(a, "limit", Rule::kSize);
      a = c.args();
      a.activation = act;
      a.alpha = bad;
      expect_invalid(a, "alpha", Rule::kSize);
    }
  }
}

TEST(MoeFc1Validation, XStride) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.x_stride = -8;
  expect_invalid(a, "x_stride", Rule::kSize);
  a.x_stride = 4;  // < hidden
  expect_invalid(a, "x_stride", Rule::kSize);
  a.x_stride = 12;  // not a multiple of 8
  expect_invalid(a, "x_stride", Rule::kSize);
  a.x_stride = int64_t(1) << 60;  // rows * x_stride overflows
  expect_invalid(a, "x_stride", Rule::kSize);
}

TEST(MoeFc1Validation, ExtentsThatOverflow) {
  MoeFc1Args a;
  a.num_tokens = 1;
  a.k = 1;
  // E_local * 2I * H = 2^10 * 2^31 * 2^30 (2^71).
  a.num_experts_per_node = 1024;
  a.inter = int64_t(1) << 30;
  a.hidden = int64_t(1) << 30;
  expect_invalid(a, "W1", Rule::kSize);
  // k*T * I = 2^30 * (2^31 - 8).
  a.num_tokens = int64_t(1) << 27;
  a.k = 8;
  a.num_experts_per_node = 1;
  a.inter = (int64_t(1) << 31) - 8;
  a.hidden = 8;
  expect_invalid(a, "out", Rule::kSize);
}

TEST(MoeFc1Validation, NullBuffersAreRejected) {
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.X = nullptr;
  expect_invalid(a, "X", Rule::kBuffer);
  a = c.args();
  a.W1 = nullptr;
  expect_invalid(a, "W1", Rule::kBuffer);
  a = c.args();
  a.expert_first_token_offset = nullptr;
  expect_invalid(a, "expert_first_token_offset", Rule::kBuffer);
  a = c.args();
  a.permuted_row_to_unpermuted_row = nullptr;
  expect_invalid(a, "permuted_row_to_unpermuted_row", Rule::kBuffer);
  a = c.args();
  a.out = nullptr;
  expect_invalid(a, "out", Rule::kBuffer);
  // The bias is optional.
  a = c.args();
  a.bias = nullptr;
  EXPECT_TRUE(validate_moe_fc1(a).ok());
}

TEST(MoeFc1Validation, Alignment) {
  Fc1Case c = gather_case();
  c.use_bias = true;
  auto shift = [](const void* p, int bytes) { return static_cast<const char*>(p) + bytes; };
  MoeFc1Args a = c.args();
  ASSERT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();  // the vectors are 16-byte aligned
  a.X = shift(c.X.data(), 8);  // 8-byte aligned is not enough
  expect_invalid(a, "X", Rule::kBuffer);
  a = c.args();
  a.W1 = shift(c.W1.data(), 8);
  expect_invalid(a, "W1", Rule::kBuffer);
  a = c.args();
  a.out = const_cast<char*>(shift(c.out.data(), 8));
  expect_invalid(a, "out", Rule::kBuffer);
  a = c.args();
  a.bias = shift(c.bias.data(), 8);
  expect_invalid(a, "bias", Rule::kBuffer);
  a = c.args();
  a.expert_first_token_offset = reinterpret_cast<const int64_t*>(shift(c.offsets.data(), 4));
  expect_invalid(a, "expert_first_token_offset", Rule::kBuffer);
  a = c.args();
  a.permuted_row_to_unpermuted_row = reinterpret_cast<const int32_t*>(shift(c.p2u.data(), 2));
  expect_invalid(a, "permuted_row_to_unpermuted_row", Rule::kBuffer);
}

// Each input in its own 4 KiB of one arena, so `out` (96 bytes) placed on
// one input can only overlap that one.
TEST(MoeFc1Validation, OutOverlappingAnInputIsRejected) {
  Fc1Case c = gather_case();
  c.use_bias = true;
  MoeFc1Args valid = c.args();
  std::vector<uint64_t> arena(5 * 512, 0);
  auto slot = [&](int n) { return reinterpret_cast<char*>(arena.data()) + n * 4096; };
  valid.X = slot(0);
  valid.W1 = slot(1);
  valid.bias = slot(2);
  valid.expert_first_token_offset = reinterpret_cast<const int64_t*>(slot(3));
  valid.permuted_row_to_unpermuted_row = reinterpret_cast<const int32_t*>(slot(4));
  ASSERT_TRUE(validate_moe_fc1(valid).ok()) << validate_moe_fc1(valid).message();
  const char* names[] = {"X", "W1", "bias", "expert_first_token_offset", "permuted_row_to_unpermuted_row"};
  for (int n = 0; n < 5; ++n) {
    MoeFc1Args a = valid;
    a.out = slot(n) + (n == 1 ? 256 : 0);  // inside W1, not only at its start
    Status st = validate_moe_fc1(a);
    EXPECT_NE(st.message().find(std::string("moe_fc1: out: must not overlap ") + names[n]), std::string::npos)
        << st.message();
    EXPECT_TRUE(validate_fc1(a, false).ok()) << names[n];
    EXPECT_FALSE(moe_fc1_cpu(a).ok()) << names[n];
  }
  // Just past the bias (E_local * 2I * 2 = 64 bytes): no overlap.
  MoeFc1Args a = valid;
  a.out = slot(2) + 64;
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
}

// X's extent: T rows (gathered) or k*T rows (x_permuted), x_stride apart, the
// last one `hidden` long. `out` may start right after it.
TEST(MoeFc1Validation, XExtentDependsOnXPermuted) {
  // T = 2, k = 2, H = 8, x_stride = 16: T rows span (16 + 8) * 2 = 48 bytes,
  // k*T rows (3*16 + 8) * 2 = 112.
  std::vector<uint16_t> buffer(256, 0);
  Fc1Case c(2, 2, 1, 4, 16);
  c.offsets = {0, 0};
  c.p2u = {0, 1, 2, 3};
  MoeFc1Args a = c.args();
  a.X = buffer.data();
  a.out = buffer.data() + 24;  // 48 bytes in: 16-byte aligned
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  a.x_permuted = true;
  Status st = validate_moe_fc1(a);
  EXPECT_NE(st.message().find("moe_fc1: out: must not overlap X"), std::string::npos) << st.message();
  a.out = buffer.data() + 56;  // 112 bytes in
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
}

// validate_fc1(a, false) reads sizes only: no buffer needed.
TEST(MoeFc1Validation, SizesOnlyModeNeedsNoBuffers) {
  MoeFc1Args a;
  a.num_tokens = 5;
  a.k = 2;
  a.hidden = 64;
  a.inter = 32;
  a.num_experts_per_node = 8;
  EXPECT_TRUE(validate_fc1(a, false).ok());
  Status st = validate_moe_fc1(a);
  EXPECT_NE(st.message().find("moe_fc1: X:"), std::string::npos) << st.message();
}

TEST(MoeFc1Validation, GpuEntryPointReportsInsteadOfAborting) {
  // Validation runs before any device query: an error, not a crash, with or without a GPU.
  Fc1Case c = gather_case();
  MoeFc1Args a = c.args();
  a.X = nullptr;
  Status st = moe_fc1(a, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("moe_fc1: X:"), std::string::npos) << st.message();
}

// FP8 (spec §9.7, §11): e4m3 codes times their scales. Codes used: 0x38 = 1,
// 0x40 = 2, 0x3c = 1.5, 0x7e = 448 (the largest), 0x01 = 2^-9 (the smallest
// subnormal), 0x80 = -0.
namespace {
struct Fp8Case {
  static constexpr int64_t H = 256;  // two K blocks
  const int64_t I;                    // 8 by default: 2I = 16 rows, one W1 row block
  std::vector<uint8_t> X = std::vector<uint8_t>(2 * H, 0), W1 = std::vector<uint8_t>(2 * I * H, 0);
  std::vector<float> xs, ws;
  std::vector<int64_t> offsets{0, 2};
  std::vector<int32_t> p2u{0, 1};
  std::vector<uint16_t> out = std::vector<uint16_t>(2 * I, kPoison);
  MoeFc1Args a;
  explicit Fp8Case(MoeFp8Scaling f, int64_t inter = 8) : I(inter) {
    X[0] = 0x38;            // token 0: 1 at h = 0 (block 0) ...
    X[130] = 0x40;          // ... 2 at h = 130 (block 1)
    X[H + 0] = 0x38;        // token 1: the same codes
    X[H + 130] = 0x40;
    X[H + 7] = 0x01;        // and 2^-9 at h = 7, against a zero weight
    for (int64_t i = 0; i < I; ++i) {
      W1[i * H + 0] = 0x38;    // gate rows: 1 at h = 0, 1.5 at h = 130
      W1[i * H + 130] = 0x3c;
      W1[i * H + 9] = 0x80;    // -0
      W1[(I + i) * H + 0] = 0x7e;  // up rows: 448 at h = 0
    }
    if (f == MoeFp8Scaling::kBlock) {
      xs = {0.5f, 3.f, 2.f, 0.25f};  // [2 tokens, 2 blocks]
      for (int64_t rb = 0; rb < (2 * I + 127) / 128; ++rb) ws.insert(ws.end(), {0.125f, 2.f});  // [row blocks, 2]
    } else {
      xs = {0.5f};
      ws = {2.f};
    }
    a.X = X.data();
    a.W1 = W1.data();
    a.fp8 = f;
    a.x_scales = xs.data();
    a.w1_scales = ws.data();
    a.expert_first_token_offset = offsets.data();
    a.permuted_row_to_unpermuted_row = p2u.data();
    a.num_tokens = 2;
    a.k = 1;
    a.hidden = H;
    a.inter = I;
    a.num_experts_per_node = 1;
    a.out = out.data();
  }
};
}  // namespace

TEST(MoeFc1Cpu, Fp8BlockScalesDequantisePerBlock) {
  Fp8Case c(MoeFp8Scaling::kBlock);
  ASSERT_TRUE(moe_fc1_cpu(c.a).ok());
  // token 0: g = (1 * 0.5)(1 * 0.125) + (2 * 3)(1.5 * 2) = 18.0625, u = (1 * 0.5)(448 * 0.125) = 28
  // token 1: g = (1 * 2)(1 * 0.125) + (2 * 0.25)(1.5 * 2) = 1.75,   u = (1 * 2)(448 * 0.125) = 112
  const double want[2] = {silu(18.0625) * 28.0, silu(1.75) * 112.0};
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < c.I; ++i)
      expect_bf16(fl(c.out[t * c.I + i]), want[t], "token " + std::to_string(t));
}

TEST(MoeFc1Cpu, Fp8TensorScalesApplyOnce) {
  Fp8Case c(MoeFp8Scaling::kTensor);
  ASSERT_TRUE(moe_fc1_cpu(c.a).ok());
  // g = (1 * 1 + 2 * 1.5) * 0.5 * 2 = 4, u = 448 * 0.5 * 2 = 448 (both tokens)
  for (int64_t n = 0; n < 2 * c.I; ++n) expect_bf16(fl(c.out[n]), silu(4.0) * 448.0, "tensor");
}

TEST(MoeFc1Names, Fp8ScalingToString) {
  EXPECT_STREQ(to_string(MoeFp8Scaling::kNone), "none");
  EXPECT_STREQ(to_string(MoeFp8Scaling::kBlock), "block");
  EXPECT_STREQ(to_string(MoeFp8Scaling::kTensor), "tensor");
  EXPECT_STREQ(to_string(static_cast<MoeFp8Scaling>(3)), "unknown");
}

TEST(MoeFc1Validation, Fp8Rules) {
  Fp8Case c(MoeFp8Scaling::kBlock);
  EXPECT_TRUE(validate_moe_fc1(c.a).ok()) << validate_moe_fc1(c.a).message();
  MoeFc1Args a = c.a;
  a.fp8 = static_cast<MoeFp8Scaling>(5);
  expect_invalid(a, "fp8", Rule::kSize);
  a = c.a;
  a.hidden = 192;  // block scales: a multiple of 128
  a.x_stride = 256;
  expect_invalid(a, "hidden", Rule::kSize);
  a.fp8 = MoeFp8Scaling::kTensor;  // per tensor: any multiple of 8
  EXPECT_TRUE(validate_fc1(a, false).ok());
  // Block scales with dense W1: hidden up to 54528 (426 K blocks; the
  // kernel holds a tile's W1 scales in shared memory), kNotSupported above.
  constexpr int64_t kBigH = 54528 + 128;
  std::vector<uint8_t> big_x(2 * kBigH), big_w(2 * c.I * kBigH);
  std::vector<float> big_xs(2 * kBigH / 128), big_ws(kBigH / 128);
  a = c.a;
  a.X = big_x.data();
  a.W1 = big_w.data();
  a.x_scales = big_xs.data();
  a.w1_scales = big_ws.data();
  a.hidden = 54528;
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  a.hidden = kBigH;
  const Status big = validate_moe_fc1(a);
  EXPECT_EQ(big.code(), StatusCode::kNotSupported);
  EXPECT_NE(big.message().find("moe_fc1: hidden:"), std::string::npos) << big.message();
  a.fp8 = MoeFp8Scaling::kTensor;  // per-tensor scales: no such limit
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  a = c.a;
  a.x_stride = 264;  // e4m3 rows: a multiple of 16 elements
  expect_invalid(a, "x_stride", Rule::kSize);
  a = c.a;
  a.x_scales = nullptr;
  expect_invalid(a, "x_scales", Rule::kBuffer);
  a = c.a;
  a.w1_scales = nullptr;
  expect_invalid(a, "w1_scales", Rule::kBuffer);
  a = c.a;
  a.x_scales = c.xs.data() + 0;
  a.out = const_cast<float*>(c.ws.data());  // out overlaps w1_scales
  expect_invalid(a, "out", Rule::kBuffer);
}

// The FP8 output (spec §9.8): block scales with dense weights only
// (kNotSupported naming out_scales), I % 128 == 0 (naming inter), a valid
// scale format, float32 scales 4-byte aligned, no overlap with out; and the
// reference's codes and scales are quantize_fp8_cpu of its bf16 rows.
TEST(MoeFc1Validation, Fp8OutputRules) {
  Fp8Case small(MoeFp8Scaling::kBlock);
  std::vector<float> sc8(8, -1.f);
  MoeFc1Args s = small.a;
  s.out_scales = sc8.data();
  expect_invalid(s, "inter", Rule::kSize);  // I = 8
  // I = 128 with buffers to match (2 tokens, H = 256, one expert); the FP8
  // output in its own buffers.
  constexpr int64_t I = 128;
  Fp8Case big(MoeFp8Scaling::kBlock, I);
  alignas(16) static uint8_t out[2 * I];
  alignas(16) static float sc[2 * (I / 128) + 1];
  std::fill(std::begin(out), std::end(out), uint8_t(0xA5));
  MoeFc1Args a = big.a;
  a.out = out;
  a.out_scales = sc;
  EXPECT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  MoeFc1Args b = a;
  b.out_scale_format = static_cast<ScaleFormat>(7);
  expect_invalid(b, "out_scale_format", Rule::kSize);
  b = a;
  b.out_scales = reinterpret_cast<char*>(sc) + 2;
  expect_invalid(b, "out_scales", Rule::kBuffer);
  b.out_scale_format = ScaleFormat::kUE8M0;  // one byte a scale: any address
  EXPECT_TRUE(validate_moe_fc1(b).ok()) << validate_moe_fc1(b).message();
  b = a;
  b.out_scales = out + 64;  // inside out
  const Status ov = validate_moe_fc1(b);
  EXPECT_EQ(ov.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ov.message().find("out_scales"), std::string::npos) << ov.message();
  EXPECT_NE(ov.message().find("must not overlap"), std::string::npos) << ov.message();
  b = a;
  b.fp8 = MoeFp8Scaling::kTensor;
  const Status ns = validate_moe_fc1(b);
  EXPECT_EQ(ns.code(), StatusCode::kNotSupported);
  EXPECT_NE(ns.message().find("moe_fc1: out_scales:"), std::string::npos) << ns.message();
  EXPECT_EQ(out[0], 0xA5);  // nothing written by any of these
  // The reference: every code and scale equal to quantize_fp8_cpu of its bf16 rows.
  ASSERT_TRUE(moe_fc1_cpu(a).ok());
  std::vector<uint16_t> rows(2 * I);
  MoeFc1Args r = a;
  r.out = rows.data();
  r.out_scales = nullptr;
  ASSERT_TRUE(moe_fc1_cpu(r).ok());
  std::vector<uint8_t> q(2 * I);
  std::vector<float> qs(2);
  QuantizeFp8Args qa;
  qa.x = rows.data();
  qa.q = q.data();
  qa.scales = qs.data();
  qa.rows = 2;
  qa.cols = I;
  ASSERT_TRUE(quantize_fp8_cpu(qa).ok());
  EXPECT_EQ(std::vector<uint8_t>(out, out + 2 * I), q);
  EXPECT_EQ(sc[0], qs[0]);
  EXPECT_EQ(sc[1], qs[1]);
}

// The wide-tile rule (sm90_fc1_wide_tiles), which the launcher and
// moe_forward both ask (the layer takes FC1's FP8 output where it holds):
// block FP8 with dense W1 once T k >= 256 E_local, bf16 with dense W1 when
// gathering, never MXFP4 or per-tensor FP8; FLASHMIX_FC1_WIDE pins it for
// the dense formats only.
TEST(MoeFc1Cpu, WideTileRule) {
  unsetenv("FLASHMIX_FC1_WIDE");
  const MoeFp8Scaling kBlock = MoeFp8Scaling::kBlock, kNone = MoeFp8Scaling::kNone;
  const MoeWeightFormat kDense = MoeWeightFormat::kDense, kMx = MoeWeightFormat::kMxfp4;
  EXPECT_TRUE(sm90_fc1_wide_tiles(kBlock, kDense, true, 1024, 8, 32));   // 8192 slots = 256 a local expert
  EXPECT_TRUE(sm90_fc1_wide_tiles(kBlock, kDense, false, 1024, 8, 32));  // gathered or not
  EXPECT_FALSE(sm90_fc1_wide_tiles(kBlock, kDense, true, 1023, 8, 32));
  EXPECT_FALSE(sm90_fc1_wide_tiles(kBlock, kMx, true, 4096, 8, 32));
  EXPECT_FALSE(sm90_fc1_wide_tiles(MoeFp8Scaling::kTensor, kDense, true, 4096, 8, 32));
  EXPECT_TRUE(sm90_fc1_wide_tiles(kNone, kDense, false, 16, 8, 32));  // bf16 gathering: any size
  EXPECT_FALSE(sm90_fc1_wide_tiles(kNone, kDense, true, 4096, 8, 32));
  EXPECT_FALSE(sm90_fc1_wide_tiles(kNone, kMx, false, 4096, 8, 32));
  setenv("FLASHMIX_FC1_WIDE", "1", 1);
  EXPECT_TRUE(sm90_fc1_wide_tiles(kBlock, kDense, true, 16, 8, 32));
  EXPECT_TRUE(sm90_fc1_wide_tiles(kNone, kDense, true, 4096, 8, 32));
  EXPECT_FALSE(sm90_fc1_wide_tiles(kBlock, kMx, true, 4096, 8, 32));
  setenv("FLASHMIX_FC1_WIDE", "0", 1);
  EXPECT_FALSE(sm90_fc1_wide_tiles(kBlock, kDense, true, 4096, 8, 32));
  EXPECT_FALSE(sm90_fc1_wide_tiles(kNone, kDense, false, 4096, 8, 32));
  unsetenv("FLASHMIX_FC1_WIDE");
}
