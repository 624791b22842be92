// finalize_moe_routing: the CPU reference on hand-worked cases, and every
// spec §5 rule of the shared validation (the GPU tests check the same rules
// leave device outputs untouched).
#include <cmath>
#include <gtest/gtest.h>

#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

// Two tokens, k = 2, H = 3, experts 0..3 with 0..1 local.
struct SmallCase {
  Routing routing = build_routing(2, 2, 0, 2, {0, 2, 1, 0});
  std::vector<float> rows;    // [P=3, H=3] float
  std::vector<float> scales = {0.25f, 0.75f, 0.5f, 2.0f};
  std::vector<float> bias = {1, 2, 3, 10, 20, 30};  // [2, 3]
  std::vector<float> out = std::vector<float>(6, -99.0f);
  FinalizeMoeRoutingArgs args;
  SmallCase() {
    rows.resize(9);
    for (int i = 0; i < 9; ++i) rows[i] = float(i + 1);
    args.expanded_permuted_rows = rows.data();
    args.rows_dtype = DType::kFloat32;
    args.num_rows = routing.P();
    args.unpermuted_row_to_permuted_row = routing.u2p.data();
    args.token_selected_experts = routing.experts.data();
    args.scales = scales.data();
    args.out = out.data();
    args.out_dtype = DType::kFloat32;
    args.num_tokens = 2;
    args.hidden = 3;
    args.k = 2;
    args.start_expert_id = 0;
    args.num_experts_per_node = 2;
  }
  // The permuted row of slot (t, j).
  const float* row(int t, int j) const { return rows.data() + routing.u2p[j * 2 + t] * 3; }
};

}  // namespace

TEST(FinalizeCpu, WeightsAndSumsLocalSlots) {
  SmallCase c;
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  // Token 0: slot 0 (expert 0, w .25) local, slot 1 (expert 2) not.
  // Token 1: slot 0 (expert 1, w .5) and slot 1 (expert 0, w 2).
  for (int h = 0; h < 3; ++h) {
    EXPECT_FLOAT_EQ(c.out[h], 0.25f * c.row(0, 0)[h]);
    EXPECT_FLOAT_EQ(c.out[3 + h], 0.5f * c.row(1, 0)[h] + 2.0f * c.row(1, 1)[h]);
  }
}

TEST(FinalizeCpu, BiasIsAddedBeforeScaling) {
  SmallCase c;
  c.args.bias = c.bias.data();
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  for (int h = 0; h < 3; ++h) {
    EXPECT_FLOAT_EQ(c.out[h], 0.25f * (c.row(0, 0)[h] + c.bias[h]));
    EXPECT_FLOAT_EQ(c.out[3 + h], 0.5f * (c.row(1, 0)[h] + c.bias[3 + h]) + 2.0f * (c.row(1, 1)[h] + c.bias[h]));
  }
}

TEST(FinalizeCpu, NoScaleWeighsEverySlotOne) {
  SmallCase c;
  c.args.scales = nullptr;
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  for (int h = 0; h < 3; ++h) EXPECT_FLOAT_EQ(c.out[3 + h], c.row(1, 0)[h] + c.row(1, 1)[h]);
}

TEST(FinalizeCpu, SharedOutputIsAddedOnceUnweighted) {
  SmallCase c;
  std::vector<float> shared = {100, 200, 300, 400, 500, 600};
  c.args.shared_output = shared.data();
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  for (int h = 0; h < 3; ++h) EXPECT_FLOAT_EQ(c.out[h], 0.25f * c.row(0, 0)[h] + shared[h]);
}

TEST(FinalizeCpu, FillingZeroesTokensWithoutLocalSlots) {
  SmallCase c;
  c.args.start_expert_id = 2;  // now only expert 2 (token 0, slot 1) is local
  c.args.num_experts_per_node = 1;
  Routing r = build_routing(2, 2, 2, 1, c.routing.experts);
  c.args.unpermuted_row_to_permuted_row = r.u2p.data();
  c.args.num_rows = r.P();
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  for (int h = 0; h < 3; ++h) EXPECT_EQ(c.out[3 + h], 0.0f);
}

TEST(FinalizeCpu, NoFillingLeavesTokensWithoutLocalSlotsUntouched) {
  SmallCase c;
  Routing r = build_routing(2, 2, 2, 1, c.routing.experts);
  c.args.start_expert_id = 2;
  c.args.num_experts_per_node = 1;
  c.args.unpermuted_row_to_permuted_row = r.u2p.data();
  c.args.permuted_row_to_unpermuted_row = r.p2u.data();
  c.args.expert_first_token_offset = r.offsets.data();
  c.args.num_rows = r.P();
  c.args.fill = false;
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  for (int h = 0; h < 3; ++h) {
    EXPECT_FLOAT_EQ(c.out[h], 0.75f * c.rows[r.u2p[2] * 3 + h]);
    EXPECT_EQ(c.out[3 + h], -99.0f);
  }
}

TEST(FinalizeCpu, ZeroTokensIsValidWithNullPointers) {
  FinalizeMoeRoutingArgs a;
  a.num_tokens = 0;
  a.hidden = 7;
  a.k = 3;
  a.num_experts_per_node = 4;
  EXPECT_TRUE(finalize_moe_routing_cpu(a).ok());
}

TEST(FinalizeCpu, Bf16OutputIsRoundedOnce) {
  SmallCase c;
  HostTensor out(DType::kBFloat16, 6);
  c.args.out = out.data();
  c.args.out_dtype = DType::kBFloat16;
  ASSERT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  const double want = 0.5 * c.row(1, 0)[0] + 2.0 * c.row(1, 1)[0];
  EXPECT_EQ(out.get(3), double(host::bf16_to_float(host::float_to_bf16(float(want)))));
}

// --- spec §5: each rule, an error that names the argument.

namespace {
void expect_error(const FinalizeMoeRoutingArgs& a, const char* argument) {
  Status s = finalize_moe_routing_cpu(a);
  EXPECT_FALSE(s.ok()) << "expected an error naming " << argument;
  EXPECT_NE(s.message().find(argument), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("finalize_moe_routing"), std::string::npos) << s.message();
}
}  // namespace

TEST(FinalizeCpuErrors, NullPointersAreRejected) {
  { SmallCase c; c.args.expanded_permuted_rows = nullptr; expect_error(c.args, "expanded_permuted_rows"); }
  { SmallCase c; c.args.unpermuted_row_to_permuted_row = nullptr; expect_error(c.args, "unpermuted_row_to_permuted_row"); }
  { SmallCase c; c.args.token_selected_experts = nullptr; expect_error(c.args, "token_selected_experts"); }
  { SmallCase c; c.args.out = nullptr; expect_error(c.args, "out"); }
  { SmallCase c; c.args.fill = false; expect_error(c.args, "permuted_row_to_unpermuted_row"); }
  {
    SmallCase c;
    c.args.fill = false;
    c.args.permuted_row_to_unpermuted_row = c.routing.p2u.data();
    expect_error(c.args, "expert_first_token_offset");
  }
}

TEST(FinalizeCpuErrors, NegativeOrZeroSizesAreRejected) {
  { SmallCase c; c.args.num_tokens = -1; expect_error(c.args, "num_tokens"); }
  { SmallCase c; c.args.hidden = 0; expect_error(c.args, "hidden"); }
  { SmallCase c; c.args.num_rows = -3; expect_error(c.args, "num_rows"); }
  { SmallCase c; c.args.num_experts_per_node = 0; expect_error(c.args, "num_experts_per_node"); }
  { SmallCase c; c.args.start_expert_id = -1; expect_error(c.args, "start_expert_id"); }
  { SmallCase c; c.args.rows_stride = -8; expect_error(c.args, "rows_stride"); }
}

TEST(FinalizeCpuErrors, KOutOfRangeIsRejected) {
  { SmallCase c; c.args.k = 0; expect_error(c.args, "k"); }
  { SmallCase c; c.args.k = 17; expect_error(c.args, "k"); }
}

TEST(FinalizeCpuErrors, SizesThatOverflow32BitIndexingAreRejected) {
  { SmallCase c; c.args.num_tokens = int64_t(1) << 29; c.args.k = 8; expect_error(c.args, "num_tokens"); }
  { SmallCase c; c.args.num_rows = int64_t(1) << 32; expect_error(c.args, "num_rows"); }
  { SmallCase c; c.args.hidden = int64_t(1) << 33; c.args.rows_stride = c.args.hidden; c.args.out_stride = c.args.hidden;
    expect_error(c.args, "hidden"); }
  { SmallCase c; c.args.start_expert_id = 0x7fffffff; expect_error(c.args, "num_experts_per_node"); }
}

TEST(FinalizeCpuErrors, StridesSmallerThanARowAreRejected) {
  { SmallCase c; c.args.rows_stride = 2; expect_error(c.args, "rows_stride"); }
  { SmallCase c; c.args.out_stride = 2; expect_error(c.args, "out_stride"); }
  { SmallCase c; c.args.bias = c.bias.data(); c.args.bias_stride = 1; expect_error(c.args, "bias_stride"); }
  {
    SmallCase c;
    std::vector<float> shared(6);
    c.args.shared_output = shared.data();
    c.args.shared_stride = 2;
    expect_error(c.args, "shared_stride");
  }
}

TEST(FinalizeCpuErrors, PointersNotAlignedToTheirElementAreRejected) {
  auto off = [](const void* p, int bytes) { return static_cast<const char*>(p) + bytes; };
  { SmallCase c; c.args.expanded_permuted_rows = off(c.rows.data(), 2); expect_error(c.args, "expanded_permuted_rows"); }
  { SmallCase c; c.args.bias = off(c.bias.data(), 1); expect_error(c.args, "bias"); }
  { SmallCase c; c.args.out = const_cast<char*>(off(c.out.data(), 2)); expect_error(c.args, "out"); }
  { SmallCase c; c.args.shared_output = off(c.out.data(), 2); expect_error(c.args, "shared_output"); }
  { SmallCase c; c.args.scales = reinterpret_cast<const float*>(off(c.scales.data(), 2)); expect_error(c.args, "scales"); }
  {
    SmallCase c;
    c.args.token_selected_experts = reinterpret_cast<const int32_t*>(off(c.routing.experts.data(), 1));
    expect_error(c.args, "token_selected_experts");
  }
  {
    SmallCase c;
    c.args.unpermuted_row_to_permuted_row = reinterpret_cast<const int32_t*>(off(c.routing.u2p.data(), 3));
    expect_error(c.args, "unpermuted_row_to_permuted_row");
  }
  {
    SmallCase c;  // int64 offsets need 8 bytes
    c.args.fill = false;
    c.args.permuted_row_to_unpermuted_row = c.routing.p2u.data();
    c.args.expert_first_token_offset = reinterpret_cast<const int64_t*>(off(c.routing.offsets.data(), 4));
    expect_error(c.args, "expert_first_token_offset");
  }
  {
    SmallCase c;  // bf16 rows need 2 bytes, not 16: an odd element offset is fine
    std::vector<uint16_t> rows16(10, 0x3f80);
    c.args.rows_dtype = DType::kBFloat16;
    c.args.expanded_permuted_rows = rows16.data() + 1;
    EXPECT_TRUE(finalize_moe_routing_cpu(c.args).ok());
  }
}

TEST(FinalizeCpuErrors, OutOverlappingAnInputIsRejected) {
  {
    SmallCase c;
    c.args.out = c.rows.data() + 3;  // out inside the expert rows
    expect_error(c.args, "out");
  }
  {
    SmallCase c;
    c.args.out = c.scales.data();
    expect_error(c.args, "out");
  }
  {
    SmallCase c;
    c.args.bias = c.bias.data();
    c.args.out = c.bias.data() + 2;
    expect_error(c.args, "out");
  }
  {
    SmallCase c;  // shared_output shifted by one element against out
    std::vector<float> buf(7, 0.5f);
    c.args.out = buf.data();
    c.args.shared_output = buf.data() + 1;
    expect_error(c.args, "shared_output");
  }
}

// shared_output == out (same stride): an in-place residual add.
TEST(FinalizeCpu, SharedOutputMayBeOutInPlace) {
  SmallCase a, b;
  std::vector<float> residual = {0.5f, -1.0f, 2.0f, 3.0f, -0.25f, 4.0f};
  a.args.shared_output = residual.data();
  ASSERT_TRUE(finalize_moe_routing_cpu(a.args).ok());
  b.out = residual;
  b.args.out = b.out.data();
  b.args.shared_output = b.out.data();
  ASSERT_TRUE(finalize_moe_routing_cpu(b.args).ok());
  EXPECT_EQ(b.out, a.out);
}

TEST(FinalizeCpuErrors, UnsupportedDtypesAreRejected) {
  { SmallCase c; c.args.rows_dtype = static_cast<DType>(7); expect_error(c.args, "rows_dtype"); }
  { SmallCase c; c.args.out_dtype = static_cast<DType>(-1); expect_error(c.args, "out_dtype"); }
}

TEST(FinalizeCpuErrors, BadTuningIsRejected) {
  { SmallCase c; c.args.tuning.threads_per_block = 100; expect_error(c.args, "tuning.threads_per_block"); }
  { SmallCase c; c.args.tuning.vectors_per_thread = 4; expect_error(c.args, "tuning.vectors_per_thread"); }
  { SmallCase c; c.args.tuning.chunks_per_token = -2; expect_error(c.args, "tuning.chunks_per_token"); }
}

TEST(FinalizeCpuErrors, ARejectedCallWritesNothing) {
  SmallCase c;
  c.args.out_stride = 1;
  EXPECT_FALSE(finalize_moe_routing_cpu(c.args).ok());
  for (float v : c.out) EXPECT_EQ(v, -99.0f);
}
