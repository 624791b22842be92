// moe_forward's host side (spec §10): the layer's own rules name their
// argument, a stage's error names the stage, the workspace grows by the
// permuted copy exactly when it is used, and T = 0 is valid.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/fp8.h"
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

// Hash selection (spec §8.7) rides in the router's arguments: valid with
// router_logits, an error with the caller's ids, its buffers checked against
// the layer's outputs, its own rules named as the router's.
TEST(MoeForwardCpu, HashSelectionIsTheRouters) {
  Layer l;
  std::vector<int32_t> table(10 * Layer::k, 1);
  std::vector<int64_t> tok(Layer::T, 3);
  MoeForwardArgs a = l.a;
  a.router.hash_table = table.data();
  a.router.vocab_size = 10;
  a.router.token_ids = tok.data();
  a.router.token_ids_int64 = true;
  EXPECT_TRUE(validate_moe_forward(a).ok()) << validate_moe_forward(a).message();
  MoeForwardArgs b = a;
  b.router_logits = nullptr;
  b.token_selected_experts = l.ids.data();
  expect_names(validate_moe_forward(b), "moe_forward: router.hash_table: selects in the router");
  b = a;
  b.out = reinterpret_cast<uint16_t*>(table.data());  // out over the table
  expect_names(validate_moe_forward(b), "moe_forward: out: must not overlap router.hash_table");
  b = a;
  b.router.vocab_size = 0;
  expect_names(moe_forward_cpu(b), "moe_forward: moe_router: vocab_size:");
  // The layer on the CPU routes by the table: every token to expert 1 (the
  // ids are the table's), with weight routed_scaling_factor (renormalised).
  std::vector<int32_t> kept(Layer::T * Layer::k, -5);
  std::vector<float> kept_w(Layer::T * Layer::k, -5.0f);
  a.selected_experts_out = kept.data();
  a.final_scales_out = kept_w.data();
  a.router.scoring = MoeRouterScoring::kSqrtSoftplus;
  a.router.renormalize = true;
  ASSERT_TRUE(moe_forward_cpu(a).ok()) << moe_forward_cpu(a).message();
  EXPECT_EQ(kept, std::vector<int32_t>(Layer::T * Layer::k, 1));
  EXPECT_EQ(kept_w, std::vector<float>(Layer::T * Layer::k, 0.5f));
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


// spec §10.3's kAuto rule, sizes only: the copy once experts average 64 rows,
// except for bf16 weights with I <= 1024.
TEST(MoeForwardCpu, AutoFc1InputRule) {
  MoeForwardArgs a;
  a.num_tokens = 4096;
  a.k = 8;
  a.num_experts = 128;
  a.num_experts_per_node = 128;
  a.hidden = 2048;
  a.inter = 768;
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kGather);  // Qwen3-MoE: I = 768
  a.inter = 1032;
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kPermutedCopy);
  a.inter = 768;
  a.fp8 = MoeFp8Scaling::kBlock;
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kPermutedCopy);
  a.fp8 = MoeFp8Scaling::kNone;
  a.weights = MoeWeightFormat::kMxfp4;
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kPermutedCopy);
  a.weights = MoeWeightFormat::kDense;
  a.inter = 2048;
  a.num_tokens = 1023;  // T*k < 64 * E: the gather whatever I
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kGather);
  a.num_tokens = 1024;
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kPermutedCopy);
  a.fc1_input = MoeFc1Input::kGather;  // pinned
  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kGather);
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

// --- FP8 weights (spec §10.4) ------------------------------------------------

namespace {

// A small valid FP8 layer: H and I multiples of 128, e4m3 weights, fp32 block scales.
struct Fp8Layer {
  static constexpr int64_t T = 4, H = 256, I = 128;
  static constexpr int k = 2, E = 4;
  std::vector<uint16_t> x = std::vector<uint16_t>(T * H), out = std::vector<uint16_t>(T * H);
  std::vector<uint8_t> w1 = std::vector<uint8_t>(E * 2 * I * H), w2 = std::vector<uint8_t>(E * H * I);
  std::vector<float> w1s = std::vector<float>(E * (2 * I / 128) * (H / 128), 1.f),
                     w2s = std::vector<float>(E * (H / 128) * (I / 128), 1.f);
  std::vector<float> logits = std::vector<float>(T * E);
  MoeForwardArgs a;
  Fp8Layer() {
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
    a.fp8 = MoeFp8Scaling::kBlock;
    a.w1_scales = w1s.data();
    a.w2_scales = w2s.data();
    a.out = out.data();
  }
};

}  // namespace

TEST(MoeForwardCpu, Fp8ValidArgsAreValid) {
  Fp8Layer l;
  EXPECT_TRUE(validate_moe_forward(l.a).ok()) << validate_moe_forward(l.a).message();
}

// The workspace grows by exactly the FP8 buffers: X's e4m3 rows and scales
// (T rows gathered, k*T with the permuted copy) and FC1's output's e4m3 rows
// and scales (k*T), each region 256-byte aligned.
TEST(MoeForwardCpu, Fp8WorkspaceHoldsTheQuantisedBuffers) {
  auto up = [](size_t b) { return (b + 255) & ~size_t(255); };
  constexpr int64_t T = Fp8Layer::T, k = Fp8Layer::k, H = Fp8Layer::H, I = Fp8Layer::I;
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy}) {
    Fp8Layer l;
    MoeForwardArgs a = l.a;
    a.fc1_input = in;
    const size_t fp8 = moe_forward_workspace_size(a);
    a.fp8 = MoeFp8Scaling::kNone;
    const size_t bf16 = moe_forward_workspace_size(a);
    const size_t x_rows = in == MoeFc1Input::kGather ? T : T * k;
    const size_t extra = up(x_rows * H) + up(x_rows * (H / 128) * 4) + up(T * k * I) + up(T * k * (I / 128) * 4);
    // With the permuted copy the maps write X's e4m3 rows directly (spec
    // §1.4): the bf16 layer's bf16 copy [k*T, H] is not in the FP8 workspace.
    const size_t bf16_copy = in == MoeFc1Input::kPermutedCopy ? up(T * k * H * 2) : 0;
    EXPECT_EQ(fp8, bf16 + extra - bf16_copy) << to_string(in);
  }
}

TEST(MoeForwardCpu, Fp8RulesNameTheirArgument) {
  Fp8Layer l;
  MoeForwardArgs a = l.a;
  a.fp8 = static_cast<MoeFp8Scaling>(9);
  expect_names(validate_moe_forward(a), "moe_forward: fp8: unknown");
  EXPECT_EQ(moe_forward_workspace_size(a), 0u);
  a = l.a;
  a.fp8 = MoeFp8Scaling::kTensor;
  Status st = validate_moe_forward(a);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported);
  expect_names(st, "moe_forward: fp8: tensor scaling is not supported");
  a = l.a;
  a.inter = 136;  // a multiple of 8 but not of 128
  expect_names(validate_moe_forward(a), "moe_forward: inter: must be a multiple of 128");
  a = l.a;
  a.hidden = 264;
  expect_names(validate_moe_forward(a), "moe_forward: hidden: must be a multiple of 128");
  a = l.a;
  a.w1_scales = nullptr;
  expect_names(validate_moe_forward(a), "moe_forward: moe_fc1: w1_scales:");
  a = l.a;
  a.w2_scales = nullptr;
  expect_names(validate_moe_forward(a), "moe_forward: moe_fc2_finalize: w2_scales:");
  a = l.a;
  a.w2_scales = reinterpret_cast<const float*>(l.out.data());  // w2_scales inside out
  expect_names(validate_moe_forward(a), "w2_scales");
  // Nothing launched on bad input, even without a GPU: the host checks come first.
  a = l.a;
  a.w1_scales = nullptr;
  const size_t bytes = moe_forward_workspace_size(l.a);
  std::vector<uint64_t> ws(bytes / 8 + 64);  // never touched: validation reads no memory
  void* base = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) & ~uintptr_t(255));
  expect_names(moe_forward(a, base, bytes, nullptr), "moe_forward: moe_fc1: w1_scales:");
  expect_names(moe_forward_cpu(a), "w1_scales");
}

// The CPU reference runs the FP8 chain end to end on host buffers (all-zero
// weights: every output is exactly 0, written over a poisoned out).
TEST(MoeForwardCpu, Fp8CpuReferenceRuns) {
  Fp8Layer l;
  for (auto& v : l.x) v = 0x3f80;  // 1.0
  for (auto& v : l.out) v = 0x7fc0;  // NaN
  ASSERT_TRUE(moe_forward_cpu(l.a).ok()) << moe_forward_cpu(l.a).message();
  for (uint16_t v : l.out) ASSERT_EQ(v, 0);
}

// X already quantised (MoeForwardArgs::x_scales, what the EP FP8 dispatch
// hands over): the same layer as the bf16 X it came from, bit for bit, since
// the layer quantises X 1 x 128 the same way (quantize_fp8); no X buffers in
// the workspace; FC1 gathers (auto resolves to gather, permuted copy is not
// supported); x_scales only with fp8 = block.
TEST(MoeForwardCpu, Fp8PrequantisedXEqualsTheLayerOnBf16X) {
  Fp8Layer l;
  constexpr int64_t T = Fp8Layer::T, H = Fp8Layer::H, k = Fp8Layer::k;
  flashmix::testing::Rng rng(flashmix::testing::test_seed() ^ 0x9e11ull);
  for (auto& v : l.x) v = host::float_to_bf16(rng.uniform(-2.f, 2.f));
  for (auto& v : l.logits) v = rng.uniform(-1.f, 1.f);
  for (auto& v : l.w1) v = uint8_t(rng.integer(0, 255)) & 0xf7;  // no NaN codes (0x7f / 0xff)
  for (auto& v : l.w2) v = uint8_t(rng.integer(0, 255)) & 0xf7;
  for (auto& v : l.w1s) v = rng.uniform(0.001f, 0.01f);
  for (auto& v : l.w2s) v = rng.uniform(0.001f, 0.01f);
  ASSERT_TRUE(moe_forward_cpu(l.a).ok()) << moe_forward_cpu(l.a).message();
  const std::vector<uint16_t> want = l.out;

  std::vector<uint8_t> xq(size_t(T * H));
  std::vector<float> xs(size_t(T * (H / 128)));
  QuantizeFp8Args q;
  q.x = l.x.data();
  q.q = xq.data();
  q.scales = xs.data();
  q.rows = T;
  q.cols = H;
  q.block = Fp8Block::k1x128;
  ASSERT_TRUE(quantize_fp8_cpu(q).ok());
  MoeForwardArgs a = l.a;
  a.X = xq.data();
  a.x_scales = xs.data();
  for (auto& v : l.out) v = 0x7fc0;
  ASSERT_TRUE(moe_forward_cpu(a).ok()) << moe_forward_cpu(a).message();
  EXPECT_EQ(l.out, want);

  EXPECT_EQ(moe_forward_fc1_input(a), MoeFc1Input::kGather);
  MoeForwardArgs b = l.a;
  b.fc1_input = MoeFc1Input::kGather;
  const size_t x_bufs = ((T * H + 255) & ~size_t(255)) + ((T * (H / 128) * 4 + 255) & ~size_t(255));
  EXPECT_EQ(moe_forward_workspace_size(a) + x_bufs, moe_forward_workspace_size(b));
  a.fc1_input = MoeFc1Input::kPermutedCopy;
  EXPECT_EQ(validate_moe_forward(a).code(), StatusCode::kNotSupported);
  expect_names(validate_moe_forward(a), "moe_forward: fc1_input:");
  a = l.a;
  a.x_scales = xs.data();
  a.fp8 = MoeFp8Scaling::kNone;
  expect_names(validate_moe_forward(a), "moe_forward: x_scales:");
  (void)k;
}
