// The MXFP4 expert GEMMs' CPU references (spec §13.7) against the dense
// references on the converted weights, and the MXFP4 rules of the shared
// validation. With a row's (and a 128 x 128 block's) scales spread narrowly,
// mxfp4_to_fp8_block is exact and so is mxfp4_to_bf16 (§13.2, §13.4): W4A8's
// reference must then equal the FP8 block reference on the converted weights
// and W4A16's the bf16 reference on the dequantised ones, element for element
// (the same products summed in the same order in double).
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/mxfp4_testing.h"
#include "flashmix/moe.h"
#include "flashmix/mxfp4.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

struct Shapes {
  int64_t T = 5;
  int k = 2, E = 3;
  int64_t H = 256, I = 128;
};

// X: e4m3 codes of random values and a random fp32 scale a row and block
// (W4A8), or random bf16 (W4A16); a fixed routing over the E experts.
struct Inputs {
  std::vector<uint8_t> xq;
  std::vector<float> xs;
  std::vector<uint16_t> xb;
  std::vector<int64_t> offsets;
  std::vector<int32_t> p2u;
  Inputs(Rng& rng, int64_t rows, int64_t cols, const Shapes& s) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = rng.uniform(-2.f, 2.f);
      xq.push_back(host::float_to_e4m3(v));
      xb.push_back(host::float_to_bf16(v));
    }
    for (int64_t i = 0; i < rows * (cols / 128); ++i) xs.push_back(rng.uniform(0.01f, 0.1f));
    // Slot j*T + t to expert (t + j) % E, in expert order.
    offsets.assign(size_t(s.E + 1), 0);
    for (int e = 0; e < s.E; ++e) {
      for (int64_t t = 0; t < s.T; ++t)
        for (int j = 0; j < s.k; ++j)
          if ((t + j) % s.E == e) p2u.push_back(int32_t(j * s.T + t));
      offsets[size_t(e + 1)] = int64_t(p2u.size());
    }
  }
};

// The dense weights MXFP4 converts to exactly here: e4m3 + 128 x 128 fp32 scales, and bf16.
struct Converted {
  std::vector<uint8_t> q;
  std::vector<float> qs;
  std::vector<uint16_t> b;
  Converted(const Mxfp4Data& d, int64_t batch, int64_t rows, int64_t cols) {
    q.resize(size_t(batch * rows * cols));
    qs.resize(size_t(batch * ((rows + 127) / 128) * (cols / 128)));
    b.resize(q.size());
    Mxfp4ToFp8BlockArgs a;
    a.w = d.w.data();
    a.w_scales = d.scales.data();
    a.q = q.data();
    a.q_scales = qs.data();
    a.batch = batch;
    a.rows = rows;
    a.cols = cols;
    EXPECT_TRUE(mxfp4_to_fp8_block_cpu(a).ok());
    Mxfp4ToBf16Args c;
    c.w = d.w.data();
    c.w_scales = d.scales.data();
    c.out = b.data();
    c.batch = batch;
    c.rows = rows;
    c.cols = cols;
    EXPECT_TRUE(mxfp4_to_bf16_cpu(c).ok());
  }
};

Mxfp4Options narrow() {
  Mxfp4Options o;
  o.base = 124;
  o.row_wobble = 2;
  o.group_wobble = 2;  // a 128 x 128 block spreads at most 6 binades: exact conversions
  return o;
}

void expect_equal(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.size() << " outputs differ";
}

}  // namespace

TEST(MoeMxfp4Cpu, Fc1ReferenceEqualsTheDenseReferenceOnConvertedWeights) {
  const Shapes s;
  Rng rng(test_seed());
  const Inputs in(rng, s.T, s.H, s);
  const Mxfp4Data w = random_mxfp4(rng, s.E, 2 * s.I, s.H, narrow());
  const Converted cv(w, s.E, 2 * s.I, s.H);
  for (bool a8 : {true, false})
    for (Fc1WeightLayout l : {Fc1WeightLayout::kGateUp, Fc1WeightLayout::kInterleaved}) {
      SCOPED_TRACE(std::string(a8 ? "w4a8/" : "w4a16/") + to_string(l));
      MoeFc1Args a;
      a.X = a8 ? static_cast<const void*>(in.xq.data()) : in.xb.data();
      a.fp8 = a8 ? MoeFp8Scaling::kBlock : MoeFp8Scaling::kNone;
      a.x_scales = a8 ? in.xs.data() : nullptr;
      a.layout = l;
      a.expert_first_token_offset = in.offsets.data();
      a.permuted_row_to_unpermuted_row = in.p2u.data();
      a.num_tokens = s.T;
      a.k = s.k;
      a.hidden = s.H;
      a.inter = s.I;
      a.num_experts_per_node = s.E;
      a.activation = MoeActivation::kSwiGLUClamped;
      std::vector<uint16_t> mx_out(size_t(s.T * s.k * s.I), 0xffff), dense_out(mx_out);
      MoeFc1Args m = a;
      m.weights = MoeWeightFormat::kMxfp4;
      m.W1 = w.w.data();
      m.w1_mx_scales = w.scales.data();
      m.out = mx_out.data();
      ASSERT_TRUE(moe_fc1_cpu(m).ok());
      MoeFc1Args d = a;
      d.W1 = a8 ? static_cast<const void*>(cv.q.data()) : cv.b.data();
      d.w1_scales = a8 ? cv.qs.data() : nullptr;
      d.out = dense_out.data();
      ASSERT_TRUE(moe_fc1_cpu(d).ok());
      expect_equal(mx_out, dense_out, "FC1");
    }
}

TEST(MoeMxfp4Cpu, Fc2ReferenceEqualsTheDenseReferenceOnConvertedWeights) {
  const Shapes s;
  Rng rng(test_seed() ^ 2);
  const Inputs in(rng, s.T * s.k, s.I, s);
  const Mxfp4Data w = random_mxfp4(rng, s.E, s.H, s.I, narrow());
  const Converted cv(w, s.E, s.H, s.I);
  std::vector<float> weights(size_t(s.T * s.k));
  for (float& x : weights) x = rng.uniform(0.1f, 1.f);
  for (bool a8 : {true, false}) {
    SCOPED_TRACE(a8 ? "w4a8" : "w4a16");
    Fc2FinalizeArgs a;
    a.A = a8 ? static_cast<const void*>(in.xq.data()) : in.xb.data();
    a.fp8 = a8 ? MoeFp8Scaling::kBlock : MoeFp8Scaling::kNone;
    a.a_scales = a8 ? in.xs.data() : nullptr;
    a.expert_first_token_offset = in.offsets.data();
    a.permuted_row_to_unpermuted_row = in.p2u.data();
    a.scales = weights.data();
    a.num_tokens = s.T;
    a.k = s.k;
    a.hidden = s.H;
    a.inter = s.I;
    a.num_experts_per_node = s.E;
    std::vector<uint16_t> mx_out(size_t(s.T * s.H), 0xffff), dense_out(mx_out);
    Fc2FinalizeArgs m = a;
    m.weights = MoeWeightFormat::kMxfp4;
    m.W2 = w.w.data();
    m.w2_mx_scales = w.scales.data();
    m.out = mx_out.data();
    ASSERT_TRUE(moe_fc2_finalize_cpu(m).ok());
    Fc2FinalizeArgs d = a;
    d.W2 = a8 ? static_cast<const void*>(cv.q.data()) : cv.b.data();
    d.w2_scales = a8 ? cv.qs.data() : nullptr;
    d.out = dense_out.data();
    ASSERT_TRUE(moe_fc2_finalize_cpu(d).ok());
    expect_equal(mx_out, dense_out, "FC2");
  }
}

// The rules (spec §13.7): named arguments, sizes-only checks included.
TEST(MoeMxfp4Cpu, ValidationNamesTheArgument) {
  const Shapes s;
  Rng rng(test_seed() ^ 3);
  const Inputs in(rng, s.T, s.H, s);
  const Mxfp4Data w = random_mxfp4(rng, s.E, 2 * s.I, s.H);
  std::vector<uint16_t> out(size_t(s.T * s.k * s.I));
  MoeFc1Args a;
  a.X = in.xq.data();
  a.fp8 = MoeFp8Scaling::kBlock;
  a.x_scales = in.xs.data();
  a.weights = MoeWeightFormat::kMxfp4;
  a.W1 = w.w.data();
  a.w1_mx_scales = w.scales.data();
  a.expert_first_token_offset = in.offsets.data();
  a.permuted_row_to_unpermuted_row = in.p2u.data();
  a.num_tokens = s.T;
  a.k = s.k;
  a.hidden = s.H;
  a.inter = s.I;
  a.num_experts_per_node = s.E;
  a.out = out.data();
  ASSERT_TRUE(validate_moe_fc1(a).ok()) << validate_moe_fc1(a).message();
  auto expect_bad = [](const Status& st, const char* arg) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << arg;
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
  };
  MoeFc1Args b = a;
  b.fp8 = MoeFp8Scaling::kTensor;
  expect_bad(validate_moe_fc1(b), "fp8");
  b = a;
  b.hidden = 96;  // a multiple of 32, not of 128
  expect_bad(validate_moe_fc1(b), "hidden");
  b = a;
  b.w1_mx_scales = nullptr;
  expect_bad(validate_moe_fc1(b), "w1_mx_scales");
  b = a;
  b.w1_mx_scales = w.scales.data() + 2;
  expect_bad(validate_moe_fc1(b), "w1_mx_scales");
  b = a;
  b.weights = static_cast<MoeWeightFormat>(5);
  expect_bad(validate_moe_fc1(b), "weights");
  b = a;
  b.w1_scales = nullptr;  // ignored with mxfp4
  EXPECT_TRUE(validate_moe_fc1(b).ok());
  // out over the packed W1's bytes (its extent is E * 2I * H / 2).
  b = a;
  b.out = const_cast<uint8_t*>(w.w.data()) + w.w.size() - 16;
  expect_bad(validate_moe_fc1(b), "W1");
  EXPECT_STREQ(to_string(MoeWeightFormat::kMxfp4), "mxfp4");
  EXPECT_STREQ(to_string(MoeWeightFormat::kDense), "dense");

  Fc2FinalizeArgs f;
  f.A = in.xq.data();
  f.fp8 = MoeFp8Scaling::kBlock;
  f.a_scales = in.xs.data();
  f.weights = MoeWeightFormat::kMxfp4;
  f.W2 = w.w.data();
  f.w2_mx_scales = w.scales.data();
  f.expert_first_token_offset = in.offsets.data();
  f.permuted_row_to_unpermuted_row = in.p2u.data();
  f.num_tokens = s.T;
  f.k = s.k;
  f.hidden = s.H;
  f.inter = 256;
  f.num_experts_per_node = s.E;
  std::vector<uint16_t> out2(size_t(s.T * s.H));
  f.out = out2.data();
  ASSERT_TRUE(validate_moe_fc2_finalize(f).ok()) << validate_moe_fc2_finalize(f).message();
  Fc2FinalizeArgs g = f;
  g.inter = 160;
  expect_bad(validate_moe_fc2_finalize(g), "inter");
  g = f;
  g.w2_mx_scales = nullptr;
  expect_bad(validate_moe_fc2_finalize(g), "w2_mx_scales");
  g = f;
  g.fp8 = MoeFp8Scaling::kTensor;
  expect_bad(validate_moe_fc2_finalize(g), "fp8");
}
