// GPU tests of mhc_post on the FP8 residual stream (spec §4.9): the X_next
// codes and scales bitwise equal to mhc_post_cpu's, every byte, for fresh
// random inputs, poisoned outputs (and the bytes past the scales untouched),
// direct launches and CUDA-graph replays, n = 1..8, both layouts, both scale
// formats, odd B and B = 0, 128-channel rows where only half a warp works;
// NaN / inf / vanishing blocks; bad arguments launch nothing. Without a GPU
// every test is skipped.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/gpu_testing.h"
#include "cpu/test_mhc_fp8x_common.h"

namespace flashmix {
namespace {

using namespace mhc_test;
using testing::DeviceBuffer;
using testing::run_direct_or_graph;

constexpr uint8_t kPoison = 0xa5;
constexpr size_t kTail = 64;  // poisoned bytes past each output, checked untouched

struct Fp8xCase {
  int n;
  int64_t C, B;
  MhcResLayout layout;
  ScaleFormat format;
};

std::string fp8x_case_name(const ::testing::TestParamInfo<Fp8xCase>& info) {
  const Fp8xCase& c = info.param;
  return "n" + std::to_string(c.n) + "_C" + std::to_string(c.C) + "_B" + std::to_string(c.B) +
         (c.layout == MhcResLayout::kDeepSeek ? "_deepseek" : "_rowmix") +
         (c.format == ScaleFormat::kUE8M0 ? "_ue8m0" : "_f32");
}

// The device side of one FP8 post: inputs uploaded, outputs poisoned (with a tail).
struct DeviceFp8Post {
  DeviceBuffer x, xs, f_out, h_post, h_res, out, out_s;
  size_t code_bytes, scale_bytes;
  DeviceFp8Post(const Problem& p, const Fp8X& xin)
      : x(xin.codes), xs(xin.scales), f_out(p.f_out), h_post(p.h_post), h_res(p.h_res),
        code_bytes(xin.codes.size()), scale_bytes(xin.scales.size()) {
    out = testing::poisoned_buffer(code_bytes + kTail, kPoison);
    out_s = testing::poisoned_buffer(scale_bytes + kTail, kPoison);
  }
  MhcPostArgs args(const Problem& p, MhcResLayout layout, ScaleFormat f) const {
    MhcPostArgs a;
    a.shape = {p.B, p.n, p.C};
    a.x = x.get(); a.x_scales = xs.get(); a.f_out = f_out.get();
    a.h_post = h_post.as<float>(); a.h_res = h_res.as<float>();
    a.x_next = out.get(); a.x_next_scales = out_s.get();
    a.res_layout = layout;
    a.residual = MhcResidual::kFp8E4m3;
    a.x_scale_format = f;
    return a;
  }
  void poison(cudaStream_t s) {
    EXPECT_EQ(cudaMemsetAsync(out.get(), kPoison, code_bytes + kTail, s), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(out_s.get(), kPoison, scale_bytes + kTail, s), cudaSuccess);
  }
};

// Every code and scale byte equal to the reference's, and the tails untouched.
void expect_bitwise(const DeviceBuffer& out, const DeviceBuffer& out_s, const Fp8X& ref, const char* what) {
  SCOPED_TRACE(what);
  const auto codes = out.to_host<uint8_t>();
  const auto scales = out_s.to_host<uint8_t>();
  int64_t bad = 0;
  for (size_t e = 0; e < ref.codes.size(); ++e)
    if (codes[e] != ref.codes[e] && bad++ < 10)
      ADD_FAILURE() << "code " << e << ": " << int(codes[e]) << ", reference " << int(ref.codes[e]);
  for (size_t e = 0; e < ref.scales.size(); ++e)
    if (scales[e] != ref.scales[e] && bad++ < 20)
      ADD_FAILURE() << "scale byte " << e << ": " << int(scales[e]) << ", reference " << int(ref.scales[e]);
  for (size_t e = ref.codes.size(); e < codes.size(); ++e)
    if (codes[e] != kPoison && bad++ < 30) ADD_FAILURE() << "byte " << e << " past the codes written";
  for (size_t e = ref.scales.size(); e < scales.size(); ++e)
    if (scales[e] != kPoison && bad++ < 30) ADD_FAILURE() << "byte " << e << " past the scales written";
  EXPECT_EQ(bad, 0);
}
void expect_bitwise(const DeviceFp8Post& d, const Fp8X& ref, const char* what) {
  expect_bitwise(d.out, d.out_s, ref, what);
}

class MhcPostFp8xGpu : public ::testing::TestWithParam<Fp8xCase> {};

TEST_P(MhcPostFp8xGpu, BitwiseEqualsReferenceDirectAndInGraphs) {
  SKIP_WITHOUT_GPU();
  const Fp8xCase c = GetParam();
  Problem p = make_problem(c.B, c.n, c.C, seed_for(fp8x_case_name({c, 0})));
  SCOPED_TRACE("seed " + std::to_string(p.seed));
  const Fp8X x = quantize_x(p, c.format);
  DeviceFp8Post d(p, x);
  const MhcPostArgs a = d.args(p, c.layout, c.format);
  Fp8X ref = poisoned_fp8x({p.B, p.n, p.C}, c.format, kPoison);
  if (c.B > 0) ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, ref, c.layout)).ok());
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (bool graph : {false, true}) {
    d.poison(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    run_direct_or_graph(
        stream, graph,
        [&] {
          Status s = mhc_post(a, stream);
          EXPECT_TRUE(s.ok()) << s.message();
        },
        [&] { d.poison(stream); });
    expect_bitwise(d, ref, graph ? "graph replays" : "direct launch");  // B = 0: all poison
  }
  // PDL off: the same bytes.
  MhcPostArgs np = a;
  np.enable_pdl = false;
  d.poison(stream);
  Status s = mhc_post(np, stream);
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  expect_bitwise(d, ref, "enable_pdl = false");
  cudaStreamDestroy(stream);
  if (c.B > 0) {
    Fp8X got = ref;
    got.codes = d.out.to_host<uint8_t>();
    got.codes.resize(ref.codes.size());
    got.scales = d.out_s.to_host<uint8_t>();
    got.scales.resize(ref.scales.size());
    EXPECT_EQ(count_fp8x_far_from_exact(p, x, got, c.layout), 0);
  }
}

std::vector<Fp8xCase> fp8x_cases() {
  std::vector<Fp8xCase> v;
  const MhcResLayout layouts[] = {MhcResLayout::kDeepSeek, MhcResLayout::kRowMix};
  const ScaleFormat formats[] = {ScaleFormat::kFloat32, ScaleFormat::kUE8M0};
  // C = 128, 384: rows whose last warp has only one half-warp at work.
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (int64_t C : {128, 384, 1280, 7168})
      for (int64_t B : {0, 1, 7, 33})
        v.push_back({n, C, B, layouts[(n + B) % 2], formats[(n + C / 128 + B) % 2]});
  // Many waves of the grid (the fp64 reference of B = 8192 takes a minute a case).
  v.push_back({4, 7168, 2053, MhcResLayout::kDeepSeek, ScaleFormat::kFloat32});
  v.push_back({4, 7168, 2053, MhcResLayout::kRowMix, ScaleFormat::kUE8M0});
  v.push_back({8, 7168, 1001, MhcResLayout::kDeepSeek, ScaleFormat::kUE8M0});
  v.push_back({6, 1280, 3001, MhcResLayout::kRowMix, ScaleFormat::kFloat32});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcPostFp8xGpu, ::testing::ValuesIn(fp8x_cases()), fp8x_case_name);

// mhc_expand onto the FP8 stream (spec §4.9): every code and scale byte of
// every stream equal to mhc_expand_cpu's (whose values
// tests/cpu/test_mhc_fp8x_cpu.cpp checks against quantize_fp8_cpu), direct
// and in graph replays; B = 0 writes nothing.
class MhcExpandFp8xGpu : public ::testing::TestWithParam<Fp8xCase> {};

TEST_P(MhcExpandFp8xGpu, BitwiseEqualsReferenceDirectAndInGraphs) {
  SKIP_WITHOUT_GPU();
  const Fp8xCase c = GetParam();
  Problem p = make_problem(c.B, c.n, c.C, seed_for("expand_" + fp8x_case_name({c, 0})));
  SCOPED_TRACE("seed " + std::to_string(p.seed));
  if (c.B > 1) p.f_out[size_t(p.C + 5)] = 0x7fc0;  // token 1, block 0: NaN
  Fp8X ref = poisoned_fp8x({p.B, p.n, p.C}, c.format, kPoison);
  MhcExpandArgs a;
  a.shape = {p.B, p.n, p.C};
  a.embedding = p.f_out.data();
  a.x = ref.codes.data();
  a.x_scales = ref.scales.data();
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scale_format = c.format;
  if (c.B > 0) ASSERT_TRUE(mhc_expand_cpu(a).ok());
  DeviceBuffer emb(p.f_out);
  DeviceBuffer out = testing::poisoned_buffer(ref.codes.size() + kTail, kPoison);
  DeviceBuffer out_s = testing::poisoned_buffer(ref.scales.size() + kTail, kPoison);
  a.embedding = emb.get();
  a.x = out.get();
  a.x_scales = out_s.get();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto poison = [&] {
    EXPECT_EQ(cudaMemsetAsync(out.get(), kPoison, ref.codes.size() + kTail, stream), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(out_s.get(), kPoison, ref.scales.size() + kTail, stream), cudaSuccess);
  };
  for (bool graph : {false, true}) {
    poison();
    CUDA_OK(cudaStreamSynchronize(stream));
    run_direct_or_graph(
        stream, graph,
        [&] {
          Status s = mhc_expand(a, stream);
          EXPECT_TRUE(s.ok()) << s.message();
        },
        poison);
    expect_bitwise(out, out_s, ref, graph ? "graph replays" : "direct launch");
  }
  cudaStreamDestroy(stream);
}

std::vector<Fp8xCase> expand_cases() {
  std::vector<Fp8xCase> v;
  const ScaleFormat formats[] = {ScaleFormat::kFloat32, ScaleFormat::kUE8M0};
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (int64_t C : {128, 384, 7168})
      for (int64_t B : {0, 1, 7, 33}) v.push_back({n, C, B, MhcResLayout::kDeepSeek, formats[(n + B) % 2]});
  v.push_back({4, 7168, 2053, MhcResLayout::kDeepSeek, ScaleFormat::kUE8M0});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcExpandFp8xGpu, ::testing::ValuesIn(expand_cases()), fp8x_case_name);

// NaN and infinity in the inputs and a vanishing block (spec §4.9): the same
// bytes as the reference, whose values tests/cpu/test_mhc_fp8x_cpu.cpp checks.
TEST(MhcPostFp8xSpecialsGpu, NanInfAndVanishingBlocksMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    const int n = 3;
    Problem p = make_problem(5, n, 384, seed_for("fp8x_specials_gpu"));
    SCOPED_TRACE("seed " + std::to_string(p.seed) + (f == ScaleFormat::kUE8M0 ? " ue8m0" : " f32"));
    Fp8X x = quantize_x(p, f);
    const int64_t C = p.C;
    x.codes[size_t((0 * n + 1) * C + 130)] = 0xff;  // NaN code: token 0, block 1 of every stream
    p.f_out[size_t(1 * C + 300)] = 0x7f80;           // +inf: token 1, block 2
    p.f_out[size_t(1 * C + 10)] = 0xff80;            // -inf: token 1, block 0
    // Token 2, stream 0, block 2: NaN scale. Token 3: subnormal scales
    // (2^-140 or 2^-127) with H_post = 0 and an identity H_res, and in
    // stream 0 codes of +-2^-6 only: values 2^-146 (fp32 scales), where
    // fp32(amax / 448) == 0 (the block counts as amax == 0).
    if (f == ScaleFormat::kUE8M0) x.scales[size_t((2 * n + 0) * 3 + 2)] = 255;
    else { const float nan = NAN; std::memcpy(x.scales.data() + ((2 * n + 0) * 3 + 2) * 4, &nan, 4); }
    for (int i = 0; i < n; ++i) {
      p.h_post[3 * n + i] = 0.0f;
      for (int j = 0; j < n; ++j) p.h_res[3 * n * n + i * n + j] = i == j ? 1.0f : 0.0f;
      for (int64_t k = 0; k < 3; ++k) {
        const int64_t blk = (3 * n + i) * 3 + k;
        if (f == ScaleFormat::kUE8M0) x.scales[size_t(blk)] = 0;
        else { const float s = std::ldexp(1.0f, -140); std::memcpy(x.scales.data() + blk * 4, &s, 4); }
      }
    }
    for (int64_t c = 0; c < C; ++c) x.codes[size_t(3 * n * C + c)] = (c & 1) ? 0x88 : 0x08;
    Fp8X ref = poisoned_fp8x({p.B, n, C}, f, kPoison);
    ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, ref)).ok());
    DeviceFp8Post d(p, x);
    Status s = mhc_post(d.args(p, MhcResLayout::kDeepSeek, f), nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
    CUDA_OK(cudaDeviceSynchronize());
    expect_bitwise(d, ref, "specials");
  }
}

// Bad arguments (spec §5.4, §4.9): the named error, nothing launched or written.
TEST(MhcPostFp8xSpecialsGpu, BadArgumentsLaunchNothing) {
  SKIP_WITHOUT_GPU();
  Problem p = make_problem(2, 4, 256, seed_for("fp8x_bad_gpu"));
  const Fp8X x = quantize_x(p, ScaleFormat::kFloat32);
  DeviceFp8Post d(p, x);
  const MhcPostArgs good = d.args(p, MhcResLayout::kDeepSeek, ScaleFormat::kFloat32);
  struct Bad {
    const char* arg;
    MhcPostArgs a;
  };
  std::vector<Bad> bad;
  MhcPostArgs a = good;
  a.shape.hidden = 200;
  bad.push_back({"hidden", a});
  a = good;
  a.x_next_scales = nullptr;
  bad.push_back({"x_next_scales", a});
  a = good;
  a.residual = MhcResidual::kBf16;
  bad.push_back({"x_scales", a});
  a = good;
  a.x_next_scales = const_cast<void*>(a.x_scales);
  bad.push_back({"x_next_scales", a});
  for (const Bad& b : bad) {
    Status s = mhc_post(b.a, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(": " + std::string(b.arg) + ": "), std::string::npos) << s.message();
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (auto v : d.out.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  for (auto v : d.out_s.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  // B = 0 with null buffers: ok, nothing launched.
  MhcPostArgs z;
  z.shape = {0, 4, 256};
  z.residual = MhcResidual::kFp8E4m3;
  EXPECT_TRUE(mhc_post(z, nullptr).ok());
}

}  // namespace
}  // namespace flashmix
