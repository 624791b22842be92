// moe_forward's host side (spec §10): the layer's own rules name their
// argument, a stage's error names the stage, the workspace grows by the
// permuted copy exactly when it is used, and T = 0 is valid.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flashmix/moe.h"

using namespace flashmix;

namespace {

// A small valid layer on host buffers (the values do not matter here).
struct Layer {
  static constexpr int64_t T = 4, H = 16, I = 8;
  static constexpr int k = 2, E = 4;
  std::vector<uint16_t> x = std::vector<uint16_t>(T * H), w1 = std::vector<uint16_t>(E * 2 * I * H),
                        w2 = std::vector<uint16_t>(E * H * I), out = std::vector<uint16_t>(T * H);
  std::vector<float> logits = std::vector<float>(T * E);
  std::vector<int32_t> ids = std::vector<int32_t>(T * k);
  MoeForwardArgs a;
  Layer() {
    a.num_tokens = T;
    a.hidden = H;
    a.inter = I;
    a.k = k;
    a.num_experts = E;
    a.num_experts_per_node = E;
    a.X = x.data();
    a.router_logits = logits.data();
    a.router.logits_dtype = DType::kFloat32;
    a.W1 = w1.data();
    a.W2 = w2.data();
    a.out = out.data();
  }
};

void expect_names(const Status& st, const std::string& what) {
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
}

}  // namespace

TEST(MoeForwardCpu, ValidArgsAreValid) {
  Layer l;
  EXPECT_TRUE(validate_moe_forward(l.a).ok()) << validate_moe_forward(l.a).message();
  EXPECT_GT(moe_forward_workspace_size(l.a), 0u);
}

TEST(MoeForwardCpu, ExactlyOneRoutingSource) {
  Layer l;
  MoeForwardArgs a = l.a;
  a.router_logits = nullptr;  // neither
  expect_names(validate_moe_forward(a), "moe_forward: router_logits: give exactly one");
  a = l.a;
  a.token_selected_experts = l.ids.data();  // both
  expect_names(validate_moe_forward(a), "moe_forward: router_logits: give exactly one");
  a = l.a;
  a.router_logits = nullptr;
  a.token_selected_experts = l.ids.data();  // the caller's ids: valid
  EXPECT_TRUE(validate_moe_forward(a).ok()) << validate_moe_forward(a).message();
}

TEST(MoeForwardCpu, LayerRulesNameTheirArgument) {
  Layer l;
  MoeForwardArgs a = l.a;
  a.k = 5;  // > E
  expect_names(validate_moe_forward(a), "moe_forward: k:");
  a = l.a;
  a.start_expert_id = 1;  // [1, 5) past E = 4
  expect_names(validate_moe_forward(a), "moe_forward: num_experts_per_node:");
  a = l.a;
  a.fc1_input = static_cast<MoeFc1Input>(7);
  expect_names(validate_moe_forward(a), "moe_forward: fc1_input:");
  a = l.a;
  a.out = l.x.data();  // overlaps X
  expect_names(validate_moe_forward(a), "out");
}

TEST(MoeForwardCpu, StageErrorsNameTheStage) {
  Layer l;
  MoeForwardArgs a = l.a;
  a.inter = 12;  // not a multiple of 8
  expect_names(validate_moe_forward(a), "moe_forward: moe_fc1: inter:");
  a = l.a;
  a.W2 = nullptr;
  expect_names(validate_moe_forward(a), "moe_forward: moe_fc2_finalize: W2:");
  a = l.a;
  a.router.n_group = 3;  // does not divide E
  expect_names(moe_forward_cpu(a), "moe_forward: moe_router: n_group:");
}

TEST(MoeForwardCpu, WorkspaceHoldsThePermutedCopyOnlyWhenUsed) {
  Layer l;
  MoeForwardArgs a = l.a;
  a.fc1_input = MoeFc1Input::kGather;
  const size_t gather = moe_forward_workspace_size(a);
  a.fc1_input = MoeFc1Input::kPermutedCopy;
  const size_t copy = moe_forward_workspace_size(a);
  EXPECT_GE(copy, gather + size_t(Layer::T * Layer::k * Layer::H * 2));
  a.fc1_input = MoeFc1Input::kAuto;  // T*k = 8 < 64 * E_local: the gather
  EXPECT_EQ(moe_forward_workspace_size(a), gather);
  EXPECT_STREQ(to_string(MoeFc1Input::kPermutedCopy), "permuted_copy");
}

TEST(MoeForwardCpu, ZeroTokensIsValidAndWritesNothing) {
  Layer l;
  MoeForwardArgs a = l.a;
  a.num_tokens = 0;
  a.X = nullptr;
  a.router_logits = nullptr;
  a.W1 = a.W2 = nullptr;
  a.out = nullptr;
  EXPECT_TRUE(moe_forward_cpu(a).ok());
  EXPECT_TRUE(moe_forward(a, nullptr, 0, nullptr).ok());
}
