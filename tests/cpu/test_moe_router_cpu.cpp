// moe_router: the CPU reference on hand-worked cases (SPEC §8), properties
// on random inputs, and every SPEC §8.6 rule of the shared validation (the
// GPU tests hold the kernels to this reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/router_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kPoisonId = -7;
constexpr float kPoisonW = -7.0f;

struct Router {
  std::vector<float> logits;  // fp32 [T, E]
  std::vector<float> bias;    // [E] or empty
  std::vector<int32_t> ids;
  std::vector<float> w;
  MoeRouterArgs args;

  Router(std::vector<float> l, int64_t T, int E, int k, MoeRouterScoring s, bool renormalize = false)
      : logits(std::move(l)), ids(size_t(T * k), kPoisonId), w(size_t(T * k), kPoisonW) {
    args.logits = logits.data();
    args.logits_dtype = DType::kFloat32;
    args.num_tokens = T;
    args.num_experts = E;
    args.k = k;
    args.scoring = s;
    args.renormalize = renormalize;
    args.token_selected_experts = ids.data();
    args.token_final_scales = w.data();
  }
  Router& with_bias(std::vector<float> b) {
    bias = std::move(b);
    args.correction_bias = bias.data();
    return *this;
  }
  Router& with_groups(int n_group, int topk_group) {
    args.n_group = n_group;
    args.topk_group = topk_group;
    return *this;
  }
  Router& with_scale(float s) {
    args.routed_scaling_factor = s;
    return *this;
  }
  Status run() { return moe_router_cpu(args); }
};

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// One rejected argument: `mutate` breaks a valid `a` (whose outputs are `ids`
// and `w`, 13 poisoned slots each); the call must fail naming `expect` and
// write nothing.
struct RejectCase {
  const char* name;
  void (*mutate)(MoeRouterArgs&);
  const char* expect;
};

void expect_rejected(const RejectCase& c, MoeRouterArgs a, const std::vector<int32_t>& ids,
                     const std::vector<float>& w) {
  ASSERT_TRUE(validate_moe_router(a).ok()) << c.name;
  c.mutate(a);
  const Status st = moe_router_cpu(a);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
  EXPECT_NE(st.message().find(std::string("moe_router: ") + c.expect), std::string::npos)
      << c.name << ": got \"" << st.message() << "\"";
  EXPECT_EQ(ids, std::vector<int32_t>(13, kPoisonId)) << c.name;
  EXPECT_EQ(w, std::vector<float>(13, kPoisonW)) << c.name;
}

}  // namespace

TEST(MoeRouterCpu, SoftmaxTopKWithoutRenormalizeGivesTheProbabilities) {
  Router r({1, 3, 2, 0}, 1, 4, 2, MoeRouterScoring::kSoftmax);
  ASSERT_TRUE(r.run().ok());
  const double z = std::exp(0.0) + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(r.w[0], float(std::exp(3.0) / z));
  EXPECT_FLOAT_EQ(r.w[1], float(std::exp(2.0) / z));
}

TEST(MoeRouterCpu, SoftmaxRenormalizedWeightsSumToTheScale) {
  Router r({1, 3, 2, 0}, 1, 4, 2, MoeRouterScoring::kSoftmax, true);
  r.with_scale(2.5f);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  const double a = std::exp(3.0), b = std::exp(2.0);
  EXPECT_FLOAT_EQ(r.w[0], float(2.5 * a / (a + b)));
  EXPECT_FLOAT_EQ(r.w[1], float(2.5 * b / (a + b)));
}

TEST(MoeRouterCpu, TiesBreakByLowestIdAndTheOutputIsSortedByValue) {
  for (int k = 1; k <= 5; ++k) {
    Router r({1, 2, 2, 2, 0}, 1, 5, k, MoeRouterScoring::kSoftmax);
    ASSERT_TRUE(r.run().ok());
    const std::vector<int32_t> want = {1, 2, 3, 0, 4};
    EXPECT_EQ(r.ids, std::vector<int32_t>(want.begin(), want.begin() + k)) << "k=" << k;
    if (k >= 3) EXPECT_EQ(r.w[0], r.w[2]);
  }
  // With a bias the ties are on s + b: expert 3 (0.5 + 0.25) ties expert 1
  // (sigmoid(0) + 0.25) exactly, expert 0 is ahead.
  Router r({3, 0, -5, 0}, 1, 4, 3, MoeRouterScoring::kSigmoid);
  r.with_bias({0, 0.25f, 0, 0.25f});
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 3}));
}

TEST(MoeRouterCpu, SigmoidBiasSelectsButTheWeightsAreTheUnbiasedScores) {
  // v = s + b: s(2) = .881, s(1) = .731, s(0) + 1 = 1.5, s(-1) = .269.
  Router r({2, 1, 0, -1}, 1, 4, 2, MoeRouterScoring::kSigmoid, true);
  r.with_bias({0, 0, 1, 0}).with_scale(2.5f);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  const double s2 = sigmoid(0), s0 = sigmoid(2);
  EXPECT_FLOAT_EQ(r.w[0], float(2.5 * s2 / (s2 + s0)));
  EXPECT_FLOAT_EQ(r.w[1], float(2.5 * s0 / (s2 + s0)));
  // Without renormalising: the scores times the scale.
  Router u({2, 1, 0, -1}, 1, 4, 2, MoeRouterScoring::kSigmoid, false);
  u.with_bias({0, 0, 1, 0}).with_scale(2.5f);
  ASSERT_TRUE(u.run().ok());
  EXPECT_FLOAT_EQ(u.w[0], float(2.5 * s2));
  EXPECT_FLOAT_EQ(u.w[1], float(2.5 * s0));
}

TEST(MoeRouterCpu, SoftmaxWithABiasSelectsOnProbabilityPlusBias) {
  // p = softmax({2, 0, 1}) = {.665, .090, .245}; + b {0, .6, 0} = {.665, .690, .245}.
  Router r({2, 0, 1}, 1, 3, 2, MoeRouterScoring::kSoftmax);
  r.with_bias({0, 0.6f, 0});
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  const double z = std::exp(2.0) + 1.0 + std::exp(1.0);
  EXPECT_FLOAT_EQ(r.w[0], float(1.0 / z));
  EXPECT_FLOAT_EQ(r.w[1], float(std::exp(2.0) / z));
}

TEST(MoeRouterCpu, GroupsAreRankedByTheSumOfTheirTwoBestValues) {
  // 4 groups of 2. Group 0 has the single best expert but a weak second;
  // groups 1 and 2 have two good ones each. topk_group 2 keeps groups 2 and 1.
  //            g0         g1        g2        g3
  Router r({4.0f, -4.0f, 1.0f, 1.2f, 1.5f, 1.4f, 0.0f, 0.0f}, 1, 8, 2, MoeRouterScoring::kSigmoid, true);
  r.with_groups(4, 2);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5}));
  // All groups kept (topk_group = n_group): plain top-k.
  Router all(r.logits, 1, 8, 2, MoeRouterScoring::kSigmoid, true);
  all.with_groups(4, 4);
  ASSERT_TRUE(all.run().ok());
  EXPECT_EQ(all.ids, (std::vector<int32_t>{0, 4}));
  // k spans the kept groups: the 3 best of groups 1 and 2.
  Router three(r.logits, 1, 8, 3, MoeRouterScoring::kSigmoid, true);
  three.with_groups(4, 2);
  ASSERT_TRUE(three.run().ok());
  EXPECT_EQ(three.ids, (std::vector<int32_t>{4, 5, 3}));
}

TEST(MoeRouterCpu, GroupScoresUseTheBiasedValues) {
  // Logits equal; the bias lifts group 1 (experts 2, 3) above group 0.
  Router r({0, 0, 0, 0}, 1, 4, 1, MoeRouterScoring::kSigmoid);
  r.with_bias({0.3f, 0, 0.2f, 0.2f}).with_groups(2, 1);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2}));  // group 1 (0.7 + 0.7) beats group 0 (0.8 + 0.5)
}

TEST(MoeRouterCpu, TiedGroupsKeepTheLowestGroupIds) {
  Router r({1, 2, 2, 1, 1, 2, 0, 0}, 1, 8, 2, MoeRouterScoring::kSigmoid);
  r.with_groups(4, 2);
  ASSERT_TRUE(r.run().ok());
  // Groups 0, 1, 2 tie; groups 0 and 1 are kept: experts 1 and 2 (logit 2).
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
}

TEST(MoeRouterCpu, GroupsOfOneExpertScoreThatExpert) {
  Router r({0.5f, 3, 1, 2}, 1, 4, 2, MoeRouterScoring::kSigmoid);
  r.with_groups(4, 2);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
}

TEST(MoeRouterCpu, KEqualToEChoosesEveryExpertInOrder) {
  Router r({0.1f, -2, 5, 0.1f, 3}, 1, 5, 5, MoeRouterScoring::kSigmoid, true);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 4, 0, 3, 1}));
  EXPECT_NEAR(std::accumulate(r.w.begin(), r.w.end(), 0.0), 1.0, 1e-6);
}

TEST(MoeRouterCpu, MinusInfinityLogitsComeLastWithWeightZero) {
  Router r({-kInf, 0, -kInf, 1}, 1, 4, 3, MoeRouterScoring::kSoftmax);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1, 0}));
  const double z = 1.0 + std::exp(1.0);
  EXPECT_FLOAT_EQ(r.w[0], float(std::exp(1.0) / z));
  EXPECT_FLOAT_EQ(r.w[1], float(1.0 / z));
  EXPECT_EQ(r.w[2], 0.0f);
}

TEST(MoeRouterCpu, AllMinusInfinityChoosesTheLowestIdsWithWeightZero) {
  for (MoeRouterScoring s : {MoeRouterScoring::kSoftmax, MoeRouterScoring::kSigmoid, MoeRouterScoring::kSqrtSoftplus,
                             MoeRouterScoring::kSoftmaxAfterTopk})
    for (bool renormalize : {false, true}) {
      Router r(std::vector<float>(6, -kInf), 1, 6, 3, s, renormalize);
      r.with_scale(2.0f);
      ASSERT_TRUE(r.run().ok());
      EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2})) << to_string(s);
      EXPECT_EQ(r.w, std::vector<float>(3, 0.0f)) << to_string(s) << " renormalize " << renormalize;
    }
}

TEST(MoeRouterCpu, NaNLogitsAreReadAsMinusInfinity) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Router r({nan, 1, nan, 0}, 1, 4, 3, MoeRouterScoring::kSoftmax, true);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 0}));
  EXPECT_EQ(r.w[2], 0.0f);
  EXPECT_FLOAT_EQ(r.w[0] + r.w[1], 1.0f);
  // Sigmoid: a NaN logit is a score of 0 (sigmoid(-inf)), which a bias can still lift.
  Router s({nan, -1, 0}, 1, 3, 2, MoeRouterScoring::kSigmoid);
  s.with_bias({2, 0, 0});
  ASSERT_TRUE(s.run().ok());
  EXPECT_EQ(s.ids, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(s.w[0], 0.0f);
  EXPECT_FLOAT_EQ(s.w[1], 0.5f);
}

TEST(MoeRouterCpu, PlusInfinityIsReadAsTheLargestFloat) {
  Router r({0, kInf, 1}, 1, 3, 2, MoeRouterScoring::kSoftmax);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.w[0], 1.0f);
  EXPECT_EQ(r.w[1], 0.0f);
  Router q({kInf, 1, kInf}, 1, 3, 2, MoeRouterScoring::kSoftmaxAfterTopk);
  ASSERT_TRUE(q.run().ok());
  EXPECT_EQ(q.ids, (std::vector<int32_t>{0, 2}));  // a tie at FLT_MAX
  EXPECT_EQ(q.w, (std::vector<float>{0.5f, 0.5f}));
}

TEST(MoeRouterCpu, SqrtSoftplusScores) {
  Router r({0, 1, -1, 30}, 1, 4, 3, MoeRouterScoring::kSqrtSoftplus);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1, 0}));
  EXPECT_FLOAT_EQ(r.w[0], float(std::sqrt(30.0 + std::log1p(std::exp(-30.0)))));
  EXPECT_FLOAT_EQ(r.w[1], float(std::sqrt(std::log1p(std::exp(1.0)))));
  EXPECT_FLOAT_EQ(r.w[2], float(std::sqrt(std::log(2.0))));
  // DeepSeek-V4 style: bias for the choice, renormalised, scaled.
  Router v({0, 1, -1, 30}, 1, 4, 2, MoeRouterScoring::kSqrtSoftplus, true);
  v.with_bias({0, 0, 10, 0}).with_scale(1.5f);
  ASSERT_TRUE(v.run().ok());
  EXPECT_EQ(v.ids, (std::vector<int32_t>{2, 3}));
  const double a = std::sqrt(std::log1p(std::exp(-1.0))), b = std::sqrt(30.0 + std::log1p(std::exp(-30.0)));
  EXPECT_FLOAT_EQ(v.w[0], float(1.5 * a / (a + b)));
  EXPECT_FLOAT_EQ(v.w[1], float(1.5 * b / (a + b)));
}

TEST(MoeRouterCpu, SoftmaxAfterTopkIsASoftmaxOverTheChosenLogits) {
  Router r({1, 3, 2, 0}, 1, 4, 2, MoeRouterScoring::kSoftmaxAfterTopk);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  const double a = std::exp(3.0), b = std::exp(2.0);
  EXPECT_FLOAT_EQ(r.w[0], float(a / (a + b)));
  EXPECT_FLOAT_EQ(r.w[1], float(b / (a + b)));
  // renormalize changes nothing; a bias changes the choice, not the softmax.
  Router q({1, 3, 2, 0}, 1, 4, 2, MoeRouterScoring::kSoftmaxAfterTopk, true);
  q.with_bias({0, 0, 0, 4});
  ASSERT_TRUE(q.run().ok());
  EXPECT_EQ(q.ids, (std::vector<int32_t>{3, 1}));
  EXPECT_FLOAT_EQ(q.w[0], float(1.0 / (1.0 + std::exp(3.0))));
  EXPECT_FLOAT_EQ(q.w[1], float(std::exp(3.0) / (1.0 + std::exp(3.0))));
}

TEST(MoeRouterCpu, WithoutABiasTheLogitsOrderSaturatedScores) {
  // sigmoid(40) and sigmoid(45) are both 1 in double; the logits still order them.
  Router r({40, 45, 38}, 1, 3, 2, MoeRouterScoring::kSigmoid);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  // -0 and +0 are one value: a tie, lowest id first.
  Router z({-0.0f, 0.0f, -1}, 1, 3, 1, MoeRouterScoring::kSoftmax);
  ASSERT_TRUE(z.run().ok());
  EXPECT_EQ(z.ids, (std::vector<int32_t>{0}));
  Router z2({0.0f, -0.0f, -1}, 1, 3, 1, MoeRouterScoring::kSoftmax);
  ASSERT_TRUE(z2.run().ok());
  EXPECT_EQ(z2.ids, (std::vector<int32_t>{0}));
}

TEST(MoeRouterCpu, Bf16LogitsAreReadExactly) {
  HostTensor l(DType::kBFloat16, 8);
  const float v[8] = {1, 3, 2, 0, 0.5f, -1, 3.5f, 2};
  for (int i = 0; i < 8; ++i) l.set(i, v[i]);
  std::vector<int32_t> ids(6, kPoisonId);
  std::vector<float> w(6, kPoisonW);
  MoeRouterArgs a;
  a.logits = l.data();
  a.logits_dtype = DType::kBFloat16;
  a.num_tokens = 2;
  a.num_experts = 4;
  a.k = 3;
  a.scoring = MoeRouterScoring::kSoftmaxAfterTopk;
  a.token_selected_experts = ids.data();
  a.token_final_scales = w.data();
  ASSERT_TRUE(moe_router_cpu(a).ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 0, 2, 3, 0}));
  const double e = std::exp(1.0), e2 = std::exp(2.0);
  EXPECT_FLOAT_EQ(w[0], float(e2 / (e2 + e + 1)));
  EXPECT_FLOAT_EQ(w[3], float(std::exp(3.0) / (std::exp(3.0) + std::exp(1.5) + 1)));
}

TEST(MoeRouterCpu, SeveralTokensAreIndependent) {
  Router r({1, 3, 2, 0, /**/ 0, 0, 5, 1, /**/ -1, -2, -3, -4}, 3, 4, 2, MoeRouterScoring::kSoftmax, true);
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 2, 3, 0, 1}));
}

TEST(MoeRouterCpu, ZeroTokensIsValidAndWritesNothing) {
  Router r({}, 0, 4, 2, MoeRouterScoring::kSoftmax);
  std::vector<int32_t> ids(4, kPoisonId);
  r.args.logits = nullptr;
  r.args.token_selected_experts = nullptr;
  r.args.token_final_scales = nullptr;
  EXPECT_TRUE(r.run().ok());
  r.args.token_selected_experts = ids.data();
  EXPECT_TRUE(r.run().ok());
  EXPECT_EQ(ids, std::vector<int32_t>(4, kPoisonId));
}

// Properties of the reference on random inputs, checked from the definition
// with a brute force per token: the chosen are the best candidates of the
// best groups, in order, and renormalised weights sum to the scale.
TEST(MoeRouterCpu, RandomInputsSatisfyTheDefinition) {
  Rng rng(test_seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int n_group = int(rng.integer(1, 6));
    const int S = int(rng.integer(1, 6));
    const int E = n_group * S;
    const int topk_group = int(rng.integer(1, n_group));
    const int k = int(rng.integer(1, std::min(16, topk_group * S)));
    const MoeRouterScoring sc = MoeRouterScoring(rng.integer(0, 3));
    const bool bias = rng.integer(0, 1), renorm = rng.integer(0, 1);
    const int64_t T = rng.integer(1, 5);
    std::vector<float> logits(size_t(T * E));
    // Values on a coarse grid: exact ties are common. The offset keeps x and
    // -x off the grid together (sigmoid(x) + sigmoid(-x) = 1 would tie group
    // scores in exact arithmetic but not in rounded double).
    for (auto& x : logits) x = float(rng.integer(-6, 6)) * 0.5f + 0.1f;
    Router r(logits, T, E, k, sc, renorm);
    r.with_groups(n_group, topk_group).with_scale(1.75f);
    std::vector<float> b(static_cast<size_t>(E));
    for (auto& x : b) x = float(rng.integer(-2, 2)) * 0.25f;
    if (bias) r.with_bias(b);
    ASSERT_TRUE(r.run().ok());
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + to_string(sc) + " E=" + std::to_string(E) +
                 " k=" + std::to_string(k));
    for (int64_t t = 0; t < T; ++t) {
      // Selection values, from the definition.
      std::vector<double> l(logits.begin() + t * E, logits.begin() + (t + 1) * E), s(static_cast<size_t>(E)), v(static_cast<size_t>(E));
      double m = *std::max_element(l.begin(), l.end()), z = 0;
      for (double x : l) z += std::exp(x - m);
      for (int e = 0; e < E; ++e) {
        const double x = l[size_t(e)];
        s[size_t(e)] = sc == MoeRouterScoring::kSoftmax        ? std::exp(x - m) / z
                       : sc == MoeRouterScoring::kSigmoid      ? sigmoid(x)
                       : sc == MoeRouterScoring::kSqrtSoftplus ? std::sqrt(std::log1p(std::exp(x)))
                                                               : x;
        v[size_t(e)] = s[size_t(e)] + (bias ? b[size_t(e)] : 0.0);
      }
      auto key = [&](int e) { return bias ? v[size_t(e)] : l[size_t(e)]; };
      // Group scores and the kept groups.
      std::vector<double> gs(static_cast<size_t>(n_group));
      for (int g = 0; g < n_group; ++g) {
        std::vector<double> in(v.begin() + g * S, v.begin() + (g + 1) * S);
        std::sort(in.rbegin(), in.rend());
        gs[size_t(g)] = S >= 2 ? in[0] + in[1] : in[0];
      }
      auto kept = [&](int g) {
        if (topk_group == n_group) return true;
        int rank = 0;
        for (int h = 0; h < n_group; ++h) rank += gs[size_t(h)] > gs[size_t(g)] || (gs[size_t(h)] == gs[size_t(g)] && h < g);
        return rank < topk_group;
      };
      const int32_t* ids = r.ids.data() + t * k;
      std::vector<bool> chosen(size_t(E), false);
      for (int j = 0; j < k; ++j) {
        const int e = ids[j];
        ASSERT_TRUE(e >= 0 && e < E);
        ASSERT_FALSE(chosen[size_t(e)]) << "expert " << e << " chosen twice";
        chosen[size_t(e)] = true;
        EXPECT_TRUE(kept(e / S)) << "expert " << e << " is outside the kept groups";
        if (j > 0) {
          const int p = ids[j - 1];
          EXPECT_TRUE(key(p) > key(e) || (key(p) == key(e) && p < e)) << "order at slot " << j;
        }
      }
      // No candidate left out beats the last chosen.
      const int last = ids[k - 1];
      for (int e = 0; e < E; ++e)
        if (!chosen[size_t(e)] && kept(e / S))
          EXPECT_TRUE(key(e) < key(last) || (key(e) == key(last) && e > last)) << "expert " << e << " left out";
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += r.w[size_t(t * k + j)];
      if (sc == MoeRouterScoring::kSoftmaxAfterTopk || renorm) EXPECT_NEAR(sum, 1.75, 1e-5);
    }
  }
}

// ---- SPEC §8.6: every rule names its argument; nothing is written ----------

TEST(MoeRouterCpuValidation, RejectsBadInputNamingTheArgument) {
  const RejectCase cases[] = {
      {"negative T", [](MoeRouterArgs& a) { a.num_tokens = -1; }, "num_tokens: must be >= 0"},
      {"E = 0", [](MoeRouterArgs& a) { a.num_experts = 0; }, "num_experts: must be >= 1"},
      {"k = 0", [](MoeRouterArgs& a) { a.k = 0; }, "k: must be in 1..16"},
      {"k = 17", [](MoeRouterArgs& a) { a.k = 17; }, "k: must be in 1..16"},
      {"k > E", [](MoeRouterArgs& a) { a.k = 9; }, "k: must be <= num_experts"},
      {"k*T overflows int32", [](MoeRouterArgs& a) { a.num_tokens = int64_t(1) << 29; },
       "num_tokens: k*T must fit int32"},
      {"bad dtype", [](MoeRouterArgs& a) { a.logits_dtype = static_cast<DType>(7); },
       "logits_dtype: is not a valid DType"},
      {"bad scoring", [](MoeRouterArgs& a) { a.scoring = static_cast<MoeRouterScoring>(4); },
       "scoring: is not a known MoeRouterScoring"},
      {"n_group = 0", [](MoeRouterArgs& a) { a.n_group = 0; }, "n_group: must be >= 1"},
      {"n_group does not divide E", [](MoeRouterArgs& a) { a.n_group = 3; }, "n_group: must divide num_experts"},
      {"topk_group = 0", [](MoeRouterArgs& a) { a.n_group = 4; a.topk_group = 0; }, "topk_group: must be in 1..n_group"},
      {"topk_group > n_group", [](MoeRouterArgs& a) { a.n_group = 4; a.topk_group = 5; },
       "topk_group: must be in 1..n_group"},
      {"kept groups hold fewer than k",
       [](MoeRouterArgs& a) {
         a.n_group = 4;
         a.topk_group = 1;
       },
       "topk_group: topk_group * (num_experts / n_group) must be >= k"},
      {"scale NaN", [](MoeRouterArgs& a) { a.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN(); },
       "routed_scaling_factor: must be finite"},
      {"scale inf", [](MoeRouterArgs& a) { a.routed_scaling_factor = INFINITY; }, "routed_scaling_factor: must be finite"},
      {"bad tuning", [](MoeRouterArgs& a) { a.tuning.path = 3; }, "tuning.path: must be 0, 1 or 2"},
      {"null logits", [](MoeRouterArgs& a) { a.logits = nullptr; }, "logits: must not be null"},
      {"null ids", [](MoeRouterArgs& a) { a.token_selected_experts = nullptr; },
       "token_selected_experts: must not be null"},
      {"null weights", [](MoeRouterArgs& a) { a.token_final_scales = nullptr; }, "token_final_scales: must not be null"},
      {"misaligned logits", [](MoeRouterArgs& a) { a.logits = static_cast<const char*>(a.logits) + 2; },
       "logits: must be aligned to its element (4 bytes)"},
      {"misaligned bias",
       [](MoeRouterArgs& a) {
         a.correction_bias = reinterpret_cast<const float*>(reinterpret_cast<const char*>(a.correction_bias) + 1);
       },
       "correction_bias: must be 4-byte aligned"},
      {"misaligned ids",
       [](MoeRouterArgs& a) {
         a.token_selected_experts = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(a.token_selected_experts) + 2);
       },
       "token_selected_experts: must be 4-byte aligned"},
      {"misaligned weights",
       [](MoeRouterArgs& a) {
         a.token_final_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(a.token_final_scales) + 2);
       },
       "token_final_scales: must be 4-byte aligned"},
      {"ids over the logits",
       [](MoeRouterArgs& a) { a.token_selected_experts = reinterpret_cast<int32_t*>(const_cast<void*>(a.logits)); },
       "token_selected_experts: must not overlap logits"},
      {"weights over the bias",
       [](MoeRouterArgs& a) { a.token_final_scales = const_cast<float*>(a.correction_bias); },
       "token_final_scales: must not overlap correction_bias"},
      {"weights over the ids",
       [](MoeRouterArgs& a) { a.token_final_scales = reinterpret_cast<float*>(a.token_selected_experts) + 1; },
       "token_final_scales: must not overlap token_selected_experts"},
  };
  for (const RejectCase& c : cases) {
    // 3 tokens, 8 experts, k = 4; buffers with room for the mutations.
    std::vector<float> logits(3 * 8 + 1, 0.5f), bias(9, 0.0f);
    std::vector<int32_t> ids(3 * 4 + 1, kPoisonId);
    std::vector<float> w(3 * 4 + 1, kPoisonW);
    MoeRouterArgs a;
    a.logits = logits.data();
    a.logits_dtype = DType::kFloat32;
    a.num_tokens = 3;
    a.num_experts = 8;
    a.k = 4;
    a.scoring = MoeRouterScoring::kSigmoid;
    a.correction_bias = bias.data();
    a.token_selected_experts = ids.data();
    a.token_final_scales = w.data();
    expect_rejected(c, a, ids, w);
  }
}

TEST(MoeRouterCpuValidation, Fp16LogitsAndMoreThan512ExpertsAreNotSupported) {
  std::vector<float> logits(1024, 0.0f);
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  MoeRouterArgs a;
  a.logits = logits.data();
  a.logits_dtype = DType::kFloat16;
  a.num_tokens = 1;
  a.num_experts = 8;
  a.k = 2;
  a.token_selected_experts = ids.data();
  a.token_final_scales = w.data();
  Status st = validate_moe_router(a);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported);
  EXPECT_NE(st.message().find("moe_router: logits_dtype"), std::string::npos) << st.message();
  a.logits_dtype = DType::kFloat32;
  a.num_experts = 513;
  st = validate_moe_router(a);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported);
  EXPECT_NE(st.message().find("moe_router: num_experts"), std::string::npos) << st.message();
  a.num_experts = 512;
  EXPECT_TRUE(validate_moe_router(a).ok());
}

TEST(MoeRouterCpuValidation, ZeroTokensNeedsNoPointersButValidSizes) {
  MoeRouterArgs a;
  a.num_experts = 8;
  a.k = 2;
  EXPECT_TRUE(validate_moe_router(a).ok());
  a.k = 9;
  EXPECT_EQ(validate_moe_router(a).code(), StatusCode::kInvalidArgument);
}

// ---- hash selection (SPEC §8.7) ---------------------------------------------

namespace {
// A router with DeepSeek-V4's hash selection: T tokens, E experts, k slots,
// the table [V, k] and the token ids given.
struct HashRouter : Router {
  std::vector<int32_t> table;
  std::vector<int64_t> ids64;
  std::vector<int32_t> ids32;
  HashRouter(std::vector<float> l, int64_t T, int E, int k, MoeRouterScoring s, bool renormalize,
             std::vector<int32_t> tab, std::vector<int64_t> tok, bool int64_ids = true)
      : Router(std::move(l), T, E, k, s, renormalize), table(std::move(tab)), ids64(std::move(tok)) {
    args.hash_table = table.data();
    args.vocab_size = int64_t(table.size()) / k;
    if (int64_ids) {
      args.token_ids = ids64.data();
      args.token_ids_int64 = true;
    } else {
      for (int64_t x : ids64) ids32.push_back(int32_t(x));
      args.token_ids = ids32.data();
    }
  }
};
double sqrt_softplus(double x) { return std::sqrt(std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x)))); }
}  // namespace

TEST(MoeRouterCpu, HashSelectionTakesTheTableRowOfTheTokenIdInItsOrder) {
  // DeepSeek-V4's hash layer: sqrt-softplus scores of the row's experts,
  // renormalised, scaled; the logits' order plays no part.
  const std::vector<float> l = {0.5f, -1.0f, 2.0f, 0.0f, 3.0f, -2.0f};  // 2 tokens, E = 3
  const std::vector<int32_t> table = {0, 1, 2, 0, 1, 2, 2, 1};          // V = 4, k = 2
  for (bool int64_ids : {true, false}) {
    HashRouter r(l, 2, 3, 2, MoeRouterScoring::kSqrtSoftplus, true, table, {3, 1}, int64_ids);
    r.with_scale(1.5f);
    ASSERT_TRUE(r.run().ok());
    EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1, 2, 0}));
    const double a = sqrt_softplus(2.0), b = sqrt_softplus(-1.0);  // token 0: experts 2, 1
    EXPECT_FLOAT_EQ(r.w[0], float(1.5 * a / (a + b)));
    EXPECT_FLOAT_EQ(r.w[1], float(1.5 * b / (a + b)));
    const double c = sqrt_softplus(-2.0), d = sqrt_softplus(0.0);  // token 1: experts 2, 0
    EXPECT_FLOAT_EQ(r.w[2], float(1.5 * c / (c + d)));
    EXPECT_FLOAT_EQ(r.w[3], float(1.5 * d / (c + d)));
  }
}

TEST(MoeRouterCpu, HashSelectionWeightsFollowEachScoring) {
  const std::vector<float> l = {1.0f, 3.0f, 2.0f, 0.0f};  // 1 token, E = 4; the row's largest (3) not chosen
  const std::vector<int32_t> table = {3, 2};              // V = 1, k = 2
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  {  // softmax over the row, not renormalised: the row's probabilities
    HashRouter r(l, 1, 4, 2, MoeRouterScoring::kSoftmax, false, table, {0});
    ASSERT_TRUE(r.run().ok());
    EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 2}));
    EXPECT_FLOAT_EQ(r.w[0], float(1.0 / z));
    EXPECT_FLOAT_EQ(r.w[1], float(std::exp(2.0) / z));
  }
  for (auto s : {MoeRouterScoring::kSoftmax, MoeRouterScoring::kSoftmaxAfterTopk}) {
    // renormalised softmax and softmax after the choice: a softmax over the two
    HashRouter r(l, 1, 4, 2, s, true, table, {0});
    ASSERT_TRUE(r.run().ok());
    EXPECT_FLOAT_EQ(r.w[0], float(1.0 / (1.0 + std::exp(2.0)))) << to_string(s);
    EXPECT_FLOAT_EQ(r.w[1], float(std::exp(2.0) / (1.0 + std::exp(2.0)))) << to_string(s);
  }
  {  // sigmoid, not renormalised: the scores themselves
    HashRouter r(l, 1, 4, 2, MoeRouterScoring::kSigmoid, false, table, {0});
    r.with_scale(2.0f);
    ASSERT_TRUE(r.run().ok());
    EXPECT_FLOAT_EQ(r.w[0], float(2.0 * sigmoid(0.0)));
    EXPECT_FLOAT_EQ(r.w[1], float(2.0 * sigmoid(2.0)));
  }
}

TEST(MoeRouterCpu, HashSelectionMarksOutOfRangeIdsAndEntriesAbsent) {
  // V = 3, k = 3, E = 4: row 0 holds an entry past E and a negative one, row 1
  // repeats an expert, row 2 is in range.
  const std::vector<int32_t> table = {1, 4, -1, 2, 2, 0, 3, 2, 1};
  const std::vector<float> l(4 * 4, 0.0f);
  HashRouter r(l, 4, 4, 3, MoeRouterScoring::kSigmoid, true, table, {0, 1, 3, -1});
  ASSERT_TRUE(r.run().ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, -1, -1, 2, 2, 0, -1, -1, -1, -1, -1, -1}));
  // Token 0: one valid slot takes the whole (renormalised) weight; token 1:
  // a repeated expert keeps both slots, as the reference's gather does;
  // tokens 2 and 3 (ids 3 and -1, outside [0, 3)): nothing.
  EXPECT_EQ(r.w, (std::vector<float>{1.0f, 0.0f, 0.0f, 1.0f / 3, 1.0f / 3, 1.0f / 3, 0, 0, 0, 0, 0, 0}));
}

TEST(MoeRouterCpuValidation, HashSelectionRulesNameTheArgument) {
  const RejectCase cases[] = {
      {"ids without a table", [](MoeRouterArgs& a) { a.hash_table = nullptr; }, "token_ids: selects through hash_table"},
      {"vocab 0", [](MoeRouterArgs& a) { a.vocab_size = 0; }, "vocab_size: must be >= 1"},
      {"vocab overflows", [](MoeRouterArgs& a) { a.vocab_size = int64_t(1) << 62; }, "vocab_size: vocab_size * k"},
      {"bias", [](MoeRouterArgs& a) { a.correction_bias = static_cast<const float*>(a.logits); },
       "correction_bias: must be null with hash_table"},
      {"groups", [](MoeRouterArgs& a) { a.n_group = 2; }, "topk_group: must equal n_group with hash_table"},
      {"null ids", [](MoeRouterArgs& a) { a.token_ids = nullptr; }, "token_ids: must not be null with hash_table"},
      {"misaligned int64 ids",
       [](MoeRouterArgs& a) { a.token_ids = static_cast<const char*>(a.token_ids) + 4; },
       "token_ids: must be 8-byte aligned (int64)"},
      {"misaligned table",
       [](MoeRouterArgs& a) { a.hash_table = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(a.hash_table) + 2); },
       "hash_table: must be 4-byte aligned"},
      {"weights over the table",
       [](MoeRouterArgs& a) { a.token_final_scales = reinterpret_cast<float*>(const_cast<int32_t*>(a.hash_table)); },
       "token_final_scales: must not overlap hash_table"},
      {"ids over the token ids",
       [](MoeRouterArgs& a) { a.token_selected_experts = static_cast<int32_t*>(const_cast<void*>(a.token_ids)); },
       "token_selected_experts: must not overlap token_ids"},
  };
  for (const RejectCase& c : cases) {
    std::vector<float> logits(3 * 8 + 1, 0.5f);
    std::vector<int32_t> table(5 * 4 + 1, 1), ids(3 * 4 + 1, kPoisonId);
    std::vector<int64_t> tok(3 + 1, 2);
    std::vector<float> w(3 * 4 + 1, kPoisonW);
    MoeRouterArgs a;
    a.logits = logits.data();
    a.logits_dtype = DType::kFloat32;
    a.num_tokens = 3;
    a.num_experts = 8;
    a.k = 4;
    a.scoring = MoeRouterScoring::kSqrtSoftplus;
    a.hash_table = table.data();
    a.vocab_size = 5;
    a.token_ids = tok.data();
    a.token_ids_int64 = true;
    a.token_selected_experts = ids.data();
    a.token_final_scales = w.data();
    expect_rejected(c, a, ids, w);
  }
}

// ---- the comparison the GPU tests use (tests/common/router_testing.h) ------

TEST(MoeRouterCpuComparison, NearTiesAreUndecidedExactTiesAndLogitKeysAreNot) {
  RouterCase c;
  c.scoring = MoeRouterScoring::kSigmoid;
  c.dtype = DType::kFloat32;
  c.T = 4;
  c.E = 4;
  c.k = 1;
  RouterHostData d;
  d.logits = HostTensor(DType::kFloat32, 16);
  const float rows[4][4] = {{1, 1, 0, 0}, {1, 1.000001f, 0, 0}, {1, 1.000001f, 0, 0}, {1, 2, 0, 0}};
  for (int t = 0; t < 4; ++t)
    for (int e = 0; e < 4; ++e) d.logits.set(t * 4 + e, rows[t][e]);
  // Without a bias the keys are the logits: every token decided.
  EXPECT_EQ(decided_tokens(c, d), (std::vector<char>{1, 1, 1, 1}));
  // With a bias, scores 1e-7 apart (token 1 and 2) are within the GPU's error;
  // equal inputs (token 0) and a clear gap (token 3) are decided.
  c.bias = true;
  d.bias = {0, 0, 0, 0};
  EXPECT_EQ(decided_tokens(c, d), (std::vector<char>{1, 0, 0, 1}));
  // Only the boundary matters: with k = 2 both near-equal experts are chosen,
  // but their order still hinges on the gap.
  c.k = 2;
  EXPECT_EQ(decided_tokens(c, d), (std::vector<char>{1, 0, 0, 1}));
  // The comparison skips undecided tokens and counts mismatches elsewhere.
  const std::vector<int32_t> ref = {0, 1, 1, 0, 1, 0, 1, 0}, got = {0, 1, 0, 1, 1, 0, 0, 1};
  const std::vector<float> w(8, 0.5f);
  const RouterComparison r = compare_router(c, decided_tokens(c, d), got.data(), w.data(), ref.data(), w.data());
  EXPECT_EQ(r.undecided, 2);
  EXPECT_EQ(r.id_mismatches, 1);  // token 3
  EXPECT_FALSE(r.ok());
}

// An exact tie at the boundary must not hide a third value within rounding of
// it: every pair across the boundary counts, not only the two neighbours.
TEST(MoeRouterCpuComparison, AnExactTieDoesNotHideANearTieBeyondIt) {
  // Groups: the H100 failure of ExactTiesBreakByTheLowestId (sqrt-softplus,
  // bf16, E = 8, k = 1, groups 2 of 4), rebuilt. With x = -1.9 and y = 0.1 on
  // the bf16 grid, group 0 is {x + 0.25, y}, group 1 the same two values
  // (an exact tie with group 0), group 3 {x, y + 0.25}: the same sum
  // s(x) + s(y) + 0.25, rounded otherwise. In double group 3 lies one ulp
  // above groups 0 and 1, so the reference keeps groups 3 and 0 and picks
  // expert 7 (y + 0.25); an fp32 score a rounding higher (CUDA's expf and
  // log1pf are not correctly rounded) puts group 3 below the tie, and the GPU
  // keeps groups 0 and 1 and picks expert 1.
  RouterCase c;
  c.scoring = MoeRouterScoring::kSqrtSoftplus;
  c.dtype = DType::kBFloat16;
  c.T = 2;
  c.E = 8;
  c.k = 1;
  c.bias = true;
  c.renormalize = true;
  c.n_group = 4;
  c.topk_group = 2;
  RouterHostData d;
  d.logits = HostTensor(c.dtype, 16);
  const double x = -1.9, y = 0.1;
  const double rows[2][8] = {{x, y, x, y, x, x, x, y},   // group 3 ~ groups 0 = 1 (other terms)
                             {x, y, x, y, x, x, y, x}};  // group 3 = groups 0 = 1 (the same terms): exact
  for (int t = 0; t < 2; ++t)
    for (int e = 0; e < 8; ++e) d.logits.set(t * 8 + e, rows[t][e]);
  d.bias = {0.25f, 0, 0.25f, 0, 0, 0, 0, 0.25f};
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  MoeRouterArgs a = router_args(c, d);
  a.token_selected_experts = ids.data();
  a.token_final_scales = w.data();
  ASSERT_TRUE(moe_router_cpu(a).ok());
  EXPECT_EQ(ids[0], 7);  // group 3, one double ulp above the tie, is kept
  EXPECT_EQ(ids[1], 1);  // the exact three-way tie: groups 0 and 1
  EXPECT_EQ(decided_tokens(c, d), (std::vector<char>{0, 1}));

  // Selection (no groups, k = 1): experts 1 and 2 tie exactly at the top and
  // expert 0 lies an fp32 ulp of its logit below them, which the GPU's fast
  // exp may round onto (or above) the tie: then it would pick 0.
  RouterCase s;
  s.scoring = MoeRouterScoring::kSigmoid;
  s.dtype = DType::kFloat32;
  s.T = 2;
  s.E = 4;
  s.k = 1;
  s.bias = true;
  RouterHostData e;
  e.logits = HostTensor(s.dtype, 8);
  const float below = std::nextafter(1.0f, 0.0f);
  const float sel[2][4] = {{below, 1, 1, 0}, {0.5f, 1, 1, 0}};  // near-tie past the exact one; a clear gap
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 4; ++i) e.logits.set(t * 4 + i, sel[t][i]);
  e.bias = {0, 0, 0, 0};
  EXPECT_EQ(decided_tokens(s, e), (std::vector<char>{0, 1}));
  s.k = 2;  // the chosen pair is an exact tie either way; the set hinges on expert 0 vs 2
  EXPECT_EQ(decided_tokens(s, e), (std::vector<char>{0, 1}));
}

TEST(MoeRouterCpuComparison, WeightToleranceIsRelativePlusAScaledFloor) {
  EXPECT_DOUBLE_EQ(router_weight_tolerance(1.0, 1.0f), std::ldexp(1.0, -14) + std::ldexp(1.0, -20));
  EXPECT_DOUBLE_EQ(router_weight_tolerance(0.0, 2.5f), 2.5 * std::ldexp(1.0, -20));
}
