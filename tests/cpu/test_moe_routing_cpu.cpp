// build_moe_routing_maps: the CPU reference on hand-worked cases (spec §1),
// and every spec §5 rule of the shared validation (the GPU tests check that
// the same rules leave device outputs untouched).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "common/fp8_testing.h"
#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

// Host buffers sized for the worst case (P = k*T) and poisoned.
struct Maps {
  std::vector<int64_t> offsets;
  std::vector<int32_t> p2u, u2p;
  MoeRoutingArgs args;
  Maps(const std::vector<int32_t>& experts, int64_t T, int k, int start, int local)
      : offsets(size_t(local) + 1, -7), p2u(size_t(T * k), -7), u2p(size_t(T * k), -7) {
    args.token_selected_experts = experts.data();
    args.num_tokens = T;
    args.k = k;
    args.start_expert_id = start;
    args.num_experts_per_node = local;
    args.expert_first_token_offset = offsets.data();
    args.permuted_row_to_unpermuted_row = p2u.data();
    args.unpermuted_row_to_permuted_row = u2p.data();
  }
};

// T = 3, k = 2, experts 0..3, local 1..2 (start 1, E_local 2).
//   token 0: {1, 3}   token 1: {2, 1}   token 2: {0, 2}
// Slots s = j*T + t: s0=(t0,j0)=1  s1=(t1,j0)=2  s2=(t2,j0)=0  s3=(t0,j1)=3  s4=(t1,j1)=1  s5=(t2,j1)=2
// Local expert 0 (global 1): s0, s4.  Local expert 1 (global 2): s1, s5.
const std::vector<int32_t> kSmallExperts = {1, 3, 2, 1, 0, 2};

std::string message_of(const MoeRoutingArgs& a) { return build_moe_routing_maps_cpu(a).message(); }

}  // namespace

TEST(MoeRoutingCpu, OffsetsArePrefixSumsOfLocalRowsPerExpert) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
  EXPECT_EQ(m.offsets, (std::vector<int64_t>{0, 2, 4}));
}

TEST(MoeRoutingCpu, RowsOfAnExpertAreOrderedBySlotIndex) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
  // P = 4; the rest of the buffer is untouched.
  EXPECT_EQ(m.p2u, (std::vector<int32_t>{0, 4, 1, 5, -7, -7}));
}

TEST(MoeRoutingCpu, UnpermutedMapIsInverseAndMinusOneForNonLocal) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
  EXPECT_EQ(m.u2p, (std::vector<int32_t>{0, 2, -1, -1, 1, 3}));
}

TEST(MoeRoutingCpu, MatchesTheIndependentBuilderOnRandomRoutings) {
  Rng rng(test_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t T = rng.integer(1, 300);
    const int k = int(rng.integer(1, 16));
    const int total = int(rng.integer(1, 64));
    const int local = int(rng.integer(1, total));
    const int start = int(rng.integer(0, total - local));
    Routing r = random_routing(rng, T, k, total, start, local);
    Maps m(r.experts, T, k, start, local);
    ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
    EXPECT_EQ(m.offsets, r.offsets);
    EXPECT_EQ(m.u2p, r.u2p);
    EXPECT_TRUE(std::equal(r.p2u.begin(), r.p2u.end(), m.p2u.begin()));
  }
}

TEST(MoeRoutingCpu, ExpertIdsOutsideTheModelAreNotLocal) {
  // Ids are trusted device data: negative or huge ids simply are not local.
  std::vector<int32_t> experts = {-5, 1, INT32_MAX, INT32_MIN};
  Maps m(experts, 2, 2, 0, 2);
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
  EXPECT_EQ(m.offsets, (std::vector<int64_t>{0, 0, 1}));
  // s = j*T + t: expert 1 is (t0, j1) -> s = 2.
  EXPECT_EQ(m.u2p, (std::vector<int32_t>{-1, -1, 0, -1}));
}

TEST(MoeRoutingCpu, ExpansionCopiesEachTokensRowToItsPermutedRows) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  const int64_t H = 3, in_stride = 5, out_stride = 4;
  std::vector<uint16_t> input(3 * in_stride), out(6 * out_stride, 0xdead);
  for (size_t i = 0; i < input.size(); ++i) input[i] = uint16_t(100 + i);
  m.args.input = input.data();
  m.args.permuted_input = out.data();
  m.args.input_dtype = DType::kBFloat16;
  m.args.hidden = H;
  m.args.input_stride = in_stride;
  m.args.permuted_input_stride = out_stride;
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok());
  const int tokens_of_rows[4] = {0, 1, 1, 2};  // p2u = {0, 4, 1, 5}: t = s % 3
  for (int p = 0; p < 4; ++p)
    for (int h = 0; h < H; ++h) EXPECT_EQ(out[p * out_stride + h], input[tokens_of_rows[p] * in_stride + h]);
  // Padding columns and rows past P are untouched.
  for (int p = 0; p < 4; ++p) EXPECT_EQ(out[p * out_stride + 3], 0xdead);
  for (int i = 4 * out_stride; i < 6 * out_stride; ++i) EXPECT_EQ(out[i], 0xdead);
}

// The FP8 expansion (spec §1.4): each permuted row holds its token's row in
// e4m3 with one fp32 scale per 128 columns (amax / 448), checked against an
// exhaustive-search e4m3 rounding of x / s; padding and rows past P untouched.
TEST(MoeRoutingCpu, Fp8ExpansionQuantisesEachTokensRowIntoItsPermutedRows) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  const int64_t H = 256, in_stride = 264, out_stride = 272;
  Rng rng(test_seed());
  std::vector<uint16_t> input(size_t(3 * in_stride));
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < H; ++h)
      input[size_t(t * in_stride + h)] = host::float_to_bf16(rng.uniform(-3.f, 3.f) * (h == 77 ? 100.f : 1.f));
  for (int64_t h = 128; h < 256; ++h) input[size_t(2 * in_stride + h)] = 0;  // token 2's second block: zeros
  std::vector<uint8_t> out(size_t(6 * out_stride), 0xA5);
  std::vector<float> scales(6 * 2, -1.f);
  m.args.input = input.data();
  m.args.permuted_input = out.data();
  m.args.permuted_input_scales = scales.data();
  m.args.hidden = H;
  m.args.input_stride = in_stride;
  m.args.permuted_input_stride = out_stride;
  ASSERT_TRUE(build_moe_routing_maps_cpu(m.args).ok()) << message_of(m.args);
  const int tokens_of_rows[4] = {0, 1, 1, 2};  // p2u = {0, 4, 1, 5}: t = s % 3
  for (int p = 0; p < 4; ++p)
    for (int b = 0; b < 2; ++b) {
      const int64_t t = tokens_of_rows[p];
      float amax = 0.f;
      for (int64_t h = 128 * b; h < 128 * b + 128; ++h)
        amax = std::max(amax, std::fabs(host::bf16_to_float(input[size_t(t * in_stride + h)])));
      const float sc = amax == 0.f ? 1.f : amax / 448.f;
      EXPECT_EQ(scales[size_t(p * 2 + b)], sc) << "row " << p << " block " << b;
      for (int64_t h = 128 * b; h < 128 * b + 128; ++h)
        EXPECT_EQ(out[size_t(p * out_stride + h)],
                  brute_force_e4m3(host::bf16_to_float(input[size_t(t * in_stride + h)]) / sc))
            << "row " << p << " column " << h;
    }
  for (int p = 0; p < 4; ++p)
    for (int64_t h = H; h < out_stride; ++h) EXPECT_EQ(out[size_t(p * out_stride + h)], 0xA5);
  for (int64_t i = 4 * out_stride; i < 6 * out_stride; ++i) EXPECT_EQ(out[size_t(i)], 0xA5);
  for (int i = 8; i < 12; ++i) EXPECT_EQ(scales[size_t(i)], -1.f);
}

TEST(MoeRoutingCpuValidation, Fp8ExpansionRulesNameTheArgument) {
  struct Case {
    const char* name;
    void (*mutate)(MoeRoutingArgs&);
    const char* expect;
  };
  const Case cases[] = {
      {"not bf16", [](MoeRoutingArgs& a) { a.input_dtype = DType::kFloat16; }, "input_dtype: must be kBFloat16"},
      {"hidden not a multiple of 128", [](MoeRoutingArgs& a) { a.hidden = 200; a.input_stride = a.permuted_input_stride = 256; },
       "hidden: must be a multiple of 128"},
      {"input stride", [](MoeRoutingArgs& a) { a.input_stride = 130; }, "input_stride: must be a multiple of 8"},
      {"output stride", [](MoeRoutingArgs& a) { a.permuted_input_stride = 132; },
       "permuted_input_stride: must be a multiple of 8"},
      {"misaligned input", [](MoeRoutingArgs& a) { a.input = static_cast<const char*>(a.input) + 8; },
       "input: must be 16-byte aligned"},
      {"misaligned output", [](MoeRoutingArgs& a) { a.permuted_input = static_cast<char*>(a.permuted_input) + 4; },
       "permuted_input: must be 8-byte aligned"},
      {"misaligned scales",
       [](MoeRoutingArgs& a) { a.permuted_input_scales = static_cast<char*>(a.permuted_input_scales) + 2; },
       "permuted_input_scales: must be 4-byte aligned"},
      {"bad scale format", [](MoeRoutingArgs& a) { a.permuted_scale_format = static_cast<ScaleFormat>(5); },
       "permuted_scale_format: is not a valid ScaleFormat"},
      {"scales without the expansion", [](MoeRoutingArgs& a) { a.input = nullptr; a.permuted_input = nullptr; },
       "permuted_input_scales: needs input and permuted_input"},
      {"scales over the rows", [](MoeRoutingArgs& a) { a.permuted_input_scales = a.permuted_input; },
       "must not overlap"},
  };
  for (const Case& c : cases) {
    Maps m(kSmallExperts, 3, 2, 1, 2);
    alignas(16) static uint16_t input[3 * 264];
    alignas(16) static uint8_t out[6 * 272];
    alignas(16) static float scales[6 * 2];
    std::fill(std::begin(out), std::end(out), uint8_t(0xA5));
    m.args.input = input;
    m.args.permuted_input = out;
    m.args.permuted_input_scales = scales;
    m.args.hidden = 128;
    c.mutate(m.args);
    const Status st = build_moe_routing_maps_cpu(m.args);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << c.name << ": got \"" << st.message() << "\"";
    EXPECT_EQ(m.offsets, std::vector<int64_t>(3, -7)) << c.name;
    EXPECT_EQ(out[0], 0xA5) << c.name;
  }
}

TEST(MoeRoutingCpu, ZeroTokensZeroesTheOffsets) {
  std::vector<int64_t> offsets(5, -7);
  MoeRoutingArgs a;
  a.num_tokens = 0;
  a.k = 4;
  a.num_experts_per_node = 4;
  a.expert_first_token_offset = offsets.data();
  ASSERT_TRUE(build_moe_routing_maps_cpu(a).ok());
  EXPECT_EQ(offsets, (std::vector<int64_t>(5, 0)));
}

// ---- spec §5: every rule names its argument; nothing is written ------------

TEST(MoeRoutingCpuValidation, RejectsBadSizesNamingTheArgument) {
  struct Case {
    const char* name;
    void (*mutate)(MoeRoutingArgs&);
    const char* expect;
  };
  const Case cases[] = {
      {"negative T", [](MoeRoutingArgs& a) { a.num_tokens = -1; }, "num_tokens: must be >= 0"},
      {"k = 0", [](MoeRoutingArgs& a) { a.k = 0; }, "k: must be in 1..16"},
      {"k = 17", [](MoeRoutingArgs& a) { a.k = 17; }, "k: must be in 1..16"},
      {"k*T overflows int32", [](MoeRoutingArgs& a) { a.num_tokens = int64_t(1) << 28; a.k = 8; },
       "num_tokens: k*T must fit int32"},
      {"E_local = 0", [](MoeRoutingArgs& a) { a.num_experts_per_node = 0; }, "num_experts_per_node: must be >= 1"},
      {"negative start", [](MoeRoutingArgs& a) { a.start_expert_id = -1; }, "start_expert_id: must be >= 0"},
      {"start + E overflows", [](MoeRoutingArgs& a) { a.start_expert_id = INT32_MAX; },
       "start_expert_id: start_expert_id + num_experts_per_node must fit int32"},
      {"null offsets", [](MoeRoutingArgs& a) { a.expert_first_token_offset = nullptr; },
       "expert_first_token_offset: must not be null"},
      {"null experts", [](MoeRoutingArgs& a) { a.token_selected_experts = nullptr; },
       "token_selected_experts: must not be null"},
      {"null p2u", [](MoeRoutingArgs& a) { a.permuted_row_to_unpermuted_row = nullptr; },
       "permuted_row_to_unpermuted_row: must not be null"},
      {"null u2p", [](MoeRoutingArgs& a) { a.unpermuted_row_to_permuted_row = nullptr; },
       "unpermuted_row_to_permuted_row: must not be null"},
      {"misaligned u2p",
       [](MoeRoutingArgs& a) {
         a.unpermuted_row_to_permuted_row =
             reinterpret_cast<int32_t*>(reinterpret_cast<char*>(a.unpermuted_row_to_permuted_row) + 2);
       },
       "unpermuted_row_to_permuted_row: must be 4-byte aligned"},
      {"misaligned offsets",
       [](MoeRoutingArgs& a) {
         a.expert_first_token_offset =
             reinterpret_cast<int64_t*>(reinterpret_cast<char*>(a.expert_first_token_offset) + 4);
       },
       "expert_first_token_offset: must be 8-byte aligned"},
      {"misaligned input",
       [](MoeRoutingArgs& a) { a.input = static_cast<const char*>(a.input) + 1; },
       "input: must be aligned to its element (2 bytes)"},
      {"misaligned expanded rows",
       [](MoeRoutingArgs& a) { a.permuted_input = static_cast<char*>(a.permuted_input) + 1; },
       "permuted_input: must be aligned to its element (2 bytes)"},
      {"input without output", [](MoeRoutingArgs& a) { a.permuted_input = nullptr; },
       "permuted_input: must not be null when input is given"},
      {"output without input", [](MoeRoutingArgs& a) { a.input = nullptr; },
       "input: must not be null when permuted_input is given"},
      {"hidden = 0", [](MoeRoutingArgs& a) { a.hidden = 0; }, "hidden: must be >= 1 when expanding"},
      {"bad dtype", [](MoeRoutingArgs& a) { a.input_dtype = static_cast<DType>(9); }, "input_dtype: is not a valid DType"},
      {"input stride < hidden", [](MoeRoutingArgs& a) { a.input_stride = 3; }, "input_stride: must be 0 or >= hidden"},
      {"output stride < hidden", [](MoeRoutingArgs& a) { a.permuted_input_stride = 2; },
       "permuted_input_stride: must be 0 or >= hidden"},
      {"bad tuning", [](MoeRoutingArgs& a) { a.tuning.single_block_max_slots = 9000; },
       "tuning.single_block_max_slots"},
      {"u2p aliases p2u", [](MoeRoutingArgs& a) { a.unpermuted_row_to_permuted_row = a.permuted_row_to_unpermuted_row; },
       "unpermuted_row_to_permuted_row: must not overlap permuted_row_to_unpermuted_row"},
      {"input inside the expanded rows", [](MoeRoutingArgs& a) { a.input = a.permuted_input; },
       "permuted_input: must not overlap input"},
      {"offsets over the experts",
       [](MoeRoutingArgs& a) {
         a.expert_first_token_offset = reinterpret_cast<int64_t*>(const_cast<int32_t*>(a.token_selected_experts));
       },
       "expert_first_token_offset: must not overlap token_selected_experts"},
  };
  for (const Case& c : cases) {
    Maps m(kSmallExperts, 3, 2, 1, 2);
    std::vector<uint16_t> input(3 * 4, 1), out(6 * 4, 0xdead);
    m.args.input = input.data();
    m.args.permuted_input = out.data();
    m.args.hidden = 4;
    c.mutate(m.args);
    const Status st = build_moe_routing_maps_cpu(m.args);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(std::string("build_moe_routing_maps: ") + c.expect), std::string::npos)
        << c.name << ": got \"" << st.message() << "\"";
    // Nothing written.
    EXPECT_EQ(m.offsets, std::vector<int64_t>(3, -7)) << c.name;
    EXPECT_EQ(m.u2p, std::vector<int32_t>(6, -7)) << c.name;
    EXPECT_EQ(out, std::vector<uint16_t>(24, 0xdead)) << c.name;
  }
}

TEST(MoeRoutingCpuValidation, TooManyLocalExpertsIsNotSupported) {
  Maps m(kSmallExperts, 3, 2, 0, 2);
  m.args.num_experts_per_node = 1025;
  const Status st = build_moe_routing_maps_cpu(m.args);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported);
  EXPECT_NE(st.message().find("num_experts_per_node"), std::string::npos) << st.message();
}

TEST(MoeRoutingCpuValidation, ZeroTokensNeedsNoMapPointers) {
  std::vector<int64_t> offsets(3, -7);
  MoeRoutingArgs a;
  a.k = 2;
  a.num_experts_per_node = 2;
  a.expert_first_token_offset = offsets.data();
  EXPECT_TRUE(validate_moe_routing_maps(a).ok());
}

TEST(MoeRoutingCpuValidation, WorkspaceSizeIsZeroForTheSingleLaunchPathAndForBadArgs) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  EXPECT_EQ(build_moe_routing_maps_workspace_size(m.args), 0u);
  m.args.tuning.single_block_max_slots = -1;  // force the multi-launch path
  EXPECT_GE(build_moe_routing_maps_workspace_size(m.args), sizeof(int32_t) * 2);
  m.args.k = 0;
  EXPECT_EQ(build_moe_routing_maps_workspace_size(m.args), 0u);
}

// The size query reads sizes only: the same answer before any buffer exists.
TEST(MoeRoutingCpuValidation, WorkspaceSizeNeedsNoBuffers) {
  Maps m(kSmallExperts, 3, 2, 1, 2);
  m.args.tuning.single_block_max_slots = -1;  // the multi-launch path, which has a workspace
  const size_t with_buffers = build_moe_routing_maps_workspace_size(m.args);
  EXPECT_GT(with_buffers, 0u);
  MoeRoutingArgs a = m.args;
  a.token_selected_experts = nullptr;
  a.expert_first_token_offset = nullptr;
  a.permuted_row_to_unpermuted_row = nullptr;
  a.unpermuted_row_to_permuted_row = nullptr;
  EXPECT_EQ(build_moe_routing_maps_workspace_size(a), with_buffers);
  EXPECT_FALSE(validate_moe_routing_maps(a).ok());  // the op itself still needs them
}
