// The CPU reference of moe_fc2_finalize (spec §3) on hand-computed cases, and
// the shared validation (spec §5): each rule broken names its argument.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "moe/moe_fc2_dispatch.h"
#include "moe/moe_fc2_internal.h"

using namespace flashmix;

namespace {

uint16_t bf(float x) { return host::float_to_bf16(x); }
float fl(uint16_t x) { return host::bf16_to_float(x); }

// T = 2 tokens, k = 2, E_local = 2 experts, H = 8, I = 8, small integers so
// every value is exact in bf16.
struct Tiny {
  std::vector<uint16_t> A, W2, bias, out;
  std::vector<int64_t> offsets{0, 2, 3};  // expert 0: rows 0, 1; expert 1: row 2
  // Slots (j*T + t): token 0 -> (j=0: e0, j=1: e1), token 1 -> (j=0: e0, j=1: not local)
  std::vector<int32_t> p2u{0, 1, 2};      // rows: e0 <- slots 0 (t0 j0), 1 (t1 j0); e1 <- slot 2 (t0 j1)
  std::vector<float> scales{0.5f, 2.0f, 1.0f, 4.0f};  // [t][j]
  Fc2FinalizeArgs args;
  Tiny() : A(3 * 8), W2(2 * 8 * 8), bias(2 * 8), out(2 * 8, 0xffff) {
    for (int p = 0; p < 3; ++p)
      for (int i = 0; i < 8; ++i) A[p * 8 + i] = bf(float(p + 1));  // row p is all (p+1)
    for (int e = 0; e < 2; ++e)
      for (int n = 0; n < 8; ++n) {
        for (int i = 0; i < 8; ++i) W2[(e * 8 + n) * 8 + i] = bf(i == n ? float(e + 1) : 0.0f);
        bias[e * 8 + n] = bf(float(10 * (e + 1)));
      }
    args.A = A.data();
    args.W2 = W2.data();
    args.expert_first_token_offset = offsets.data();
    args.permuted_row_to_unpermuted_row = p2u.data();
    args.scales = scales.data();
    args.bias = bias.data();
    args.num_tokens = 2;
    args.k = 2;
    args.hidden = 8;
    args.inter = 8;
    args.num_experts_per_node = 2;
    args.out = out.data();
  }
};

}  // namespace

TEST(MoeFc2Cpu, WeightedSumOfExpertRowsPlusBias) {
  Tiny c;
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  // A[p] @ W2[e]^T = (p+1)*(e+1) in every column.
  // token 0: 0.5*(1*1 + 10) + 2.0*(3*2 + 20) = 5.5 + 52 = 57.5
  // token 1: 1.0*(2*1 + 10) = 12
  for (int n = 0; n < 8; ++n) {
    EXPECT_EQ(fl(c.out[n]), 57.5f) << n;
    EXPECT_EQ(fl(c.out[8 + n]), 12.0f) << n;
  }
}

TEST(MoeFc2Cpu, BiasIgnoredUnlessApplied) {
  Tiny c;
  c.args.apply_bias = false;
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  for (int n = 0; n < 8; ++n) {
    EXPECT_EQ(fl(c.out[n]), 0.5f * 1 + 2.0f * 6) << n;
    EXPECT_EQ(fl(c.out[8 + n]), 2.0f) << n;
  }
}

TEST(MoeFc2Cpu, NoScalesMeansWeightOne) {
  Tiny c;
  c.args.scales = nullptr;
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  EXPECT_EQ(fl(c.out[0]), 11.0f + 26.0f);
  EXPECT_EQ(fl(c.out[8]), 12.0f);
}

TEST(MoeFc2Cpu, TokenWithoutLocalSlotGetsZero) {
  Tiny c;
  c.offsets = {0, 1, 1};  // only row 0 (token 0, j = 0) is local
  c.args.expert_first_token_offset = c.offsets.data();
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  EXPECT_EQ(fl(c.out[0]), 5.5f);
  EXPECT_EQ(fl(c.out[8]), 0.0f);
}

TEST(MoeFc2Cpu, AtomicIntoCallerZeroedOutAddsToIt) {
  Tiny c;
  for (auto& v : c.out) v = bf(1.0f);
  c.args.mode = Fc2Mode::kAtomic;
  c.args.out_already_zeroed = true;
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  EXPECT_EQ(fl(c.out[0]), 58.5f);
}

TEST(MoeFc2Cpu, ZeroTokensIsValid) {
  Tiny c;
  c.args.num_tokens = 0;
  c.args.A = nullptr;
  EXPECT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
}

namespace {
// A bad size makes the workspace size query answer 0; a bad buffer (null,
// misaligned) does not concern it: it reads sizes only.
void expect_invalid(const Fc2FinalizeArgs& a, const std::string& arg) {
  Status st = validate_moe_fc2_finalize(a);
  EXPECT_FALSE(st.ok()) << arg;
  EXPECT_NE(st.message().find("moe_fc2_finalize: " + arg + ":"), std::string::npos) << st.message();
  const bool buffer = arg == "A" || arg == "W2" || arg == "out" || arg == "bias" || arg == "scales" ||
                      arg == "expert_first_token_offset" || arg == "permuted_row_to_unpermuted_row" ||
                      arg == "a_scales" || arg == "w2_scales";
  if (buffer)
    EXPECT_GT(moe_fc2_finalize_workspace_size(a), 0u) << arg;
  else
    EXPECT_EQ(moe_fc2_finalize_workspace_size(a), 0u) << arg;
  EXPECT_FALSE(moe_fc2_finalize_cpu(a).ok());
}
}  // namespace

TEST(MoeFc2Validation, NullDataPointersAreRejected) {
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.A = nullptr;
  expect_invalid(a, "A");
  a = c.args;
  a.W2 = nullptr;
  expect_invalid(a, "W2");
  a = c.args;
  a.expert_first_token_offset = nullptr;
  expect_invalid(a, "expert_first_token_offset");
  a = c.args;
  a.permuted_row_to_unpermuted_row = nullptr;
  expect_invalid(a, "permuted_row_to_unpermuted_row");
  a = c.args;
  a.out = nullptr;
  expect_invalid(a, "out");
}

TEST(MoeFc2Validation, SizesOutOfRangeAreRejected) {
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.num_tokens = -1;
  expect_invalid(a, "num_tokens");
  a = c.args;
  a.k = 0;
  expect_invalid(a, "k");
  a = c.args;
  a.k = 17;
  expect_invalid(a, "k");
  a = c.args;
  a.hidden = 12;
  expect_invalid(a, "hidden");
  a = c.args;
  a.inter = 0;
  expect_invalid(a, "inter");
  a = c.args;
  a.num_experts_per_node = 0;
  expect_invalid(a, "num_experts_per_node");
  a = c.args;
  a.num_tokens = int64_t(1) << 29;
  a.k = 8;
  expect_invalid(a, "num_tokens");
}

TEST(MoeFc2Validation, StridesAndAlignment) {
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.out_stride = 4;
  expect_invalid(a, "out_stride");
  a = c.args;
  a.out_stride = 9;
  expect_invalid(a, "out_stride");
  a = c.args;
  a.A = reinterpret_cast<const char*>(c.A.data()) + 2;
  expect_invalid(a, "A");
  a = c.args;
  a.out = reinterpret_cast<char*>(c.out.data()) + 2;
  expect_invalid(a, "out");
  a = c.args;
  a.expert_first_token_offset = reinterpret_cast<const int64_t*>(
      reinterpret_cast<const char*>(c.args.expert_first_token_offset) + 4);
  expect_invalid(a, "expert_first_token_offset");
  a = c.args;
  a.permuted_row_to_unpermuted_row = reinterpret_cast<const int32_t*>(
      reinterpret_cast<const char*>(c.args.permuted_row_to_unpermuted_row) + 2);
  expect_invalid(a, "permuted_row_to_unpermuted_row");
  ASSERT_NE(c.args.scales, nullptr);
  a = c.args;
  a.scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c.args.scales) + 1);
  expect_invalid(a, "scales");
}

// The buffers overlap but the sizes are valid: the calls fail naming `out`;
// the workspace size query looks at sizes only and still answers.
TEST(MoeFc2Validation, OutOverlappingAnInputIsRejected) {
  Tiny c;
  const size_t ws = moe_fc2_finalize_workspace_size(c.args);
  for (const void* input : {c.args.A, c.args.W2}) {
    Fc2FinalizeArgs a = c.args;
    a.out = const_cast<void*>(input);
    Status st = validate_moe_fc2_finalize(a);
    EXPECT_NE(st.message().find("moe_fc2_finalize: out: must not overlap "), std::string::npos) << st.message();
    EXPECT_FALSE(moe_fc2_finalize_cpu(a).ok());
    EXPECT_EQ(moe_fc2_finalize_workspace_size(a), ws);
  }
}

// The size query reads sizes only: asked before any buffer exists, it gives
// the same answer as with the buffers, and it does not depend on the device.
TEST(MoeFc2Validation, WorkspaceSizeNeedsNoBuffers) {
  Tiny c;
  for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic, Fc2Mode::kUnfused}) {
    Fc2FinalizeArgs a = c.args;
    a.mode = m;
    const size_t with_buffers = moe_fc2_finalize_workspace_size(a);
    a.A = a.W2 = nullptr;
    a.expert_first_token_offset = nullptr;
    a.permuted_row_to_unpermuted_row = nullptr;
    a.scales = nullptr;
    a.out = nullptr;
    EXPECT_GT(with_buffers, 0u) << int(m);  // at least the per-expert GEMM arrays
    EXPECT_EQ(moe_fc2_finalize_workspace_size(a), with_buffers) << int(m);
  }
}

TEST(MoeFc2Validation, UnknownModeIsRejected) {
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.mode = static_cast<Fc2Mode>(7);
  expect_invalid(a, "mode");
}

TEST(MoeFc2Validation, UnknownTuningIsRejected) {
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.tuning.gemm_kernel = static_cast<Fc2GemmKernel>(4);
  expect_invalid(a, "tuning.gemm_kernel");
  a = c.args;
  a.tuning.raster = 3;
  expect_invalid(a, "tuning.raster");
  a = c.args;
  a.tuning.swizzle = 3;
  expect_invalid(a, "tuning.swizzle");
}

TEST(MoeFc2Validation, GpuEntryPointReportsInsteadOfAborting) {
  // Without a GPU (or a Hopper one, or CUTLASS) it must return an error, not crash.
  Tiny c;
  Fc2FinalizeArgs a = c.args;
  a.A = nullptr;
  Status st = moe_fc2_finalize(a, nullptr, 0, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("A:"), std::string::npos) << st.message();
}

// The GEMM kernel choice (moe_fc2_dispatch.cpp): names, the automatic rule,
// and a pinned kernel this build lacks.
TEST(MoeFc2GemmKernel, NamesRoundTrip) {
  EXPECT_STREQ(to_string(Fc2GemmKernel::kAuto), "auto");
  EXPECT_STREQ(to_string(Fc2GemmKernel::kRows), "rows");
  EXPECT_STREQ(to_string(Fc2GemmKernel::kCutlassCooperative), "cutlass_cooperative");
  EXPECT_STREQ(to_string(Fc2GemmKernel::kCutlassPingpong), "cutlass_pingpong");
  EXPECT_STREQ(to_string(static_cast<Fc2GemmKernel>(9)), "unknown");
  for (Fc2GemmKernel k : {Fc2GemmKernel::kAuto, Fc2GemmKernel::kRows, Fc2GemmKernel::kCutlassCooperative,
                          Fc2GemmKernel::kCutlassPingpong}) {
    Fc2GemmKernel parsed = Fc2GemmKernel::kAuto;
    EXPECT_TRUE(flashmix::testing::parse_fc2_gemm_kernel(to_string(k), &parsed)) << to_string(k);
    EXPECT_EQ(parsed, k);
  }
  Fc2GemmKernel parsed;
  EXPECT_FALSE(flashmix::testing::parse_fc2_gemm_kernel("cutlass", &parsed));
}

TEST(MoeFc2GemmKernel, AutomaticChoice) {
  const bool cutlass = sm90_fc2_built_with_cutlass();
  Tiny c;
  // (T, k, E_local): rows a local expert at most T*k/E_local = 2 (decode-like), 256 (DeepSeek EP, Qwen3-MoE),
  // 1024 (Mixtral).
  struct Shape { int64_t T; int k, E; Fc2GemmKernel fp32; };
  const Shape shapes[] = {{2, 2, 2, Fc2GemmKernel::kRows},
                          {1024, 8, 32, Fc2GemmKernel::kCutlassPingpong},
                          {4096, 2, 8, Fc2GemmKernel::kRows}};
  for (const Shape& sh : shapes) {
    for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic, Fc2Mode::kUnfused}) {
      Fc2FinalizeArgs a = c.args;
      a.num_tokens = sh.T;
      a.k = sh.k;
      a.num_experts_per_node = sh.E;
      a.mode = m;
      Fc2GemmChoice choice;
      ASSERT_TRUE(choose_fc2_gemm_kernel(a, &choice).ok());
      const Fc2GemmKernel want = m == Fc2Mode::kAtomicFp32 && cutlass ? sh.fp32 : Fc2GemmKernel::kRows;
      EXPECT_EQ(choice.kernel, want) << int(m) << " T*k/E=" << sh.T * sh.k / sh.E << ": " << to_string(choice.kernel)
                                     << " (" << choice.why << ")";
      EXPECT_NE(std::string(choice.why), "");
    }
  }
}

TEST(MoeFc2GemmKernel, PinnedKernelIsTakenOrRefused) {
  Tiny c;
  for (Fc2GemmKernel k : flashmix::testing::kFc2GemmKernels) {
    Fc2FinalizeArgs a = c.args;
    a.mode = Fc2Mode::kAtomicFp32;
    a.tuning.gemm_kernel = k;
    Fc2GemmChoice choice;
    const Status st = choose_fc2_gemm_kernel(a, &choice);
    const bool built = k == Fc2GemmKernel::kRows || sm90_fc2_built_with_cutlass();
    if (built) {
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(choice.kernel, k);
    } else {
      EXPECT_EQ(st.code(), StatusCode::kNotSupported);
      EXPECT_NE(st.message().find("tuning.gemm_kernel"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("CUTLASS"), std::string::npos) << st.message();
    }
  }
}

// FP8 (spec §3.5): T = 2 tokens, k = 1, one expert, H = 136 (two W2 row
// blocks, the second partial), I = 256 (two K blocks). Row p of A has
// 1.0 at i = 0 and 2.0 at i = 128 (e4m3 0x38, 0x40), every row of W2 has
// 1.0 at i = 0 and 1.5 at i = 128 (0x38, 0x3c); everything else is 0.
namespace {
struct Fp8Tiny {
  static constexpr int64_t H = 136, I = 256;
  std::vector<uint8_t> A, W2;
  std::vector<float> as, ws, router{1.f, 1.f};
  std::vector<uint16_t> bias, out;
  std::vector<int64_t> offsets{0, 2};
  std::vector<int32_t> p2u{0, 1};  // row p: token p, j = 0
  Fc2FinalizeArgs args;
  explicit Fp8Tiny(MoeFp8Scaling f) : A(2 * I, 0), W2(H * I, 0), bias(H, bf(0.f)), out(2 * H, 0xffff) {
    for (int p = 0; p < 2; ++p) {
      A[p * I + 0] = 0x38;    // 1.0
      A[p * I + 128] = 0x40;  // 2.0
    }
    for (int64_t n = 0; n < H; ++n) {
      W2[n * I + 0] = 0x38;    // 1.0
      W2[n * I + 128] = 0x3c;  // 1.5
    }
    if (f == MoeFp8Scaling::kBlock) {
      as = {0.5f, 3.f, 2.f, 0.25f};  // [row][K block]
      ws = {1.f, 2.f, 4.f, 0.5f};    // [H block][K block]
    } else {
      as = {0.5f};
      ws = {2.f};
    }
    args.A = A.data();
    args.W2 = W2.data();
    args.fp8 = f;
    args.a_scales = as.data();
    args.w2_scales = ws.data();
    args.expert_first_token_offset = offsets.data();
    args.permuted_row_to_unpermuted_row = p2u.data();
    args.scales = router.data();
    args.bias = bias.data();
    args.num_tokens = 2;
    args.k = 1;
    args.hidden = H;
    args.inter = I;
    args.num_experts_per_node = 1;
    args.out = out.data();
  }
};
}  // namespace

TEST(MoeFc2Cpu, Fp8BlockScalesDequantisePerBlock) {
  Fp8Tiny c(MoeFp8Scaling::kBlock);
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  // out[t, n] = (1 * as[t][0]) (1 * ws[n / 128][0]) + (2 * as[t][1]) (1.5 * ws[n / 128][1]):
  //   t0, n < 128: 0.5 * 1 + 6 * 3 = 18.5;     t0, n >= 128: 0.5 * 4 + 6 * 0.75 = 6.5
  //   t1, n < 128: 2 * 1 + 0.5 * 3 = 3.5;      t1, n >= 128: 2 * 4 + 0.5 * 0.75 = 8.375
  for (int64_t n = 0; n < Fp8Tiny::H; ++n) {
    EXPECT_EQ(fl(c.out[n]), n < 128 ? 18.5f : 6.5f) << n;
    EXPECT_EQ(fl(c.out[Fp8Tiny::H + n]), n < 128 ? 3.5f : 8.375f) << n;
  }
}

TEST(MoeFc2Cpu, Fp8TensorScalesApplyOnceBeforeBiasAndWeight) {
  Fp8Tiny c(MoeFp8Scaling::kTensor);
  c.router[1] = 0.5f;  // args.scales points at router
  for (auto& b : c.bias) b = bf(1.f);
  ASSERT_TRUE(moe_fc2_finalize_cpu(c.args).ok());
  // dot = (1 * 1 + 2 * 1.5) * 0.5 * 2 = 4; out = w (dot + bias): t0 5, t1 2.5
  for (int64_t n = 0; n < Fp8Tiny::H; ++n) {
    EXPECT_EQ(fl(c.out[n]), 5.f) << n;
    EXPECT_EQ(fl(c.out[Fp8Tiny::H + n]), 2.5f) << n;
  }
}

TEST(MoeFc2Validation, Fp8Rules) {
  Fp8Tiny c(MoeFp8Scaling::kBlock);
  EXPECT_TRUE(validate_moe_fc2_finalize(c.args).ok()) << validate_moe_fc2_finalize(c.args).message();
  Fc2FinalizeArgs a = c.args;
  a.fp8 = static_cast<MoeFp8Scaling>(5);
  expect_invalid(a, "fp8");
  a = c.args;
  a.inter = 136;  // block scales: a multiple of 128
  expect_invalid(a, "inter");
  a.fp8 = MoeFp8Scaling::kTensor;  // per tensor: a multiple of 16 (16-byte e4m3 rows)
  expect_invalid(a, "inter");
  a.inter = 144;
  EXPECT_TRUE(validate_moe_fc2_finalize(a).ok()) << validate_moe_fc2_finalize(a).message();
  a.inter = 120;
  expect_invalid(a, "inter");
  a = c.args;
  a.a_scales = nullptr;
  expect_invalid(a, "a_scales");
  a = c.args;
  a.w2_scales = nullptr;
  expect_invalid(a, "w2_scales");
  a = c.args;
  a.a_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c.as.data()) + 2);
  expect_invalid(a, "a_scales");
  a = c.args;
  a.w2_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c.ws.data()) + 1);
  expect_invalid(a, "w2_scales");
  // out overlapping a scale tensor (the scales count as inputs).
  for (const float* sc : {c.as.data(), c.ws.data()}) {
    a = c.args;
    a.out = const_cast<float*>(sc);
    Status st = validate_moe_fc2_finalize(a);
    EXPECT_NE(st.message().find("moe_fc2_finalize: out: must not overlap "), std::string::npos) << st.message();
  }
  // kNone ignores the scale pointers (null or not).
  a = c.args;
  a.fp8 = MoeFp8Scaling::kNone;
  a.a_scales = a.w2_scales = nullptr;
  a.inter = 8;
  EXPECT_TRUE(validate_fc2(a, false).ok());
}

// FP8 runs on kRows whatever the mode; a pinned CUTLASS kernel is refused
// naming tuning.gemm_kernel.
TEST(MoeFc2GemmKernel, Fp8RunsOnRowsOnly) {
  for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kTensor}) {
    Fp8Tiny c(f);
    for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic, Fc2Mode::kUnfused}) {
      Fc2FinalizeArgs a = c.args;
      a.num_tokens = 1024;  // 256 rows a expert: atomic_fp32 would take CUTLASS pingpong in bf16
      a.k = 8;
      a.num_experts_per_node = 32;
      a.mode = m;
      Fc2GemmChoice choice;
      ASSERT_TRUE(choose_fc2_gemm_kernel(a, &choice).ok());
      EXPECT_EQ(choice.kernel, Fc2GemmKernel::kRows) << choice.why;
      for (Fc2GemmKernel k : {Fc2GemmKernel::kCutlassCooperative, Fc2GemmKernel::kCutlassPingpong}) {
        a.tuning.gemm_kernel = k;
        const Status st = choose_fc2_gemm_kernel(a, &choice);
        EXPECT_EQ(st.code(), StatusCode::kNotSupported);
        EXPECT_NE(st.message().find("tuning.gemm_kernel"), std::string::npos) << st.message();
      }
      a.tuning.gemm_kernel = Fc2GemmKernel::kRows;
      ASSERT_TRUE(choose_fc2_gemm_kernel(a, &choice).ok());
      EXPECT_EQ(choice.kernel, Fc2GemmKernel::kRows);
    }
  }
}
