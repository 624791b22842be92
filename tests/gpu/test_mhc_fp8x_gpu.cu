// GPU tests of the ops on the FP8 residual stream (spec §4.9). mhc_post and
// mhc_expand: the X_next
// codes and scales bitwise equal to mhc_post_cpu's, every byte, for fresh
// random inputs, poisoned outputs (and the bytes past the scales untouched),
// direct launches and CUDA-graph replays, n = 1..8, both layouts, both scale
// formats, odd B and B = 0, 128-channel rows where only half a warp works;
// NaN / inf / vanishing blocks; bad arguments launch nothing. mhc_pre and
// mhc_head: every element against mhc_pre_cpu / mhc_head_cpu on the same
// codes and scales (cluster tiles and the portable kernel, F_pre's
// epilogue). mhc_post_pre: bitwise mhc_post then mhc_pre on the GPU. Without
// a GPU every test is skipped.
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


// ---------------------------------------------------------------------------
// mhc_pre, mhc_head and mhc_post_pre on the FP8 stream (spec §4.9).

struct PreFp8xCase {
  int n;
  int64_t C, B;
  ScaleFormat format;
  DType phi_dtype;
  MhcPreKernel kernel;  // kAuto (resident for n = 4, C = 1024 k up to 7168; else the cluster tiles), or pinned
  bool epilogue;        // F_pre's norm (bf16 weight) and FP8 copy (mhc_pre, mhc_post_pre)
};

std::string pre_fp8x_case_name(const ::testing::TestParamInfo<PreFp8xCase>& info) {
  const PreFp8xCase& c = info.param;
  return "n" + std::to_string(c.n) + "_C" + std::to_string(c.C) + "_B" + std::to_string(c.B) +
         (c.format == ScaleFormat::kUE8M0 ? "_ue8m0" : "_f32") + (c.phi_dtype == DType::kFloat32 ? "_phif32" : "_phibf16") +
         (c.kernel == MhcPreKernel::kPortable ? "_portable" : "") +
         (c.kernel == MhcPreKernel::kClusterTile ? "_clustertiles" : "") + (c.epilogue ? "_epilogue" : "");
}

// The host side of one pre on the FP8 stream: the reference's outputs.
struct PreOut {
  std::vector<uint16_t> f;
  std::vector<float> post, res;
  std::vector<uint8_t> q, qs;
};

// F_pre against the reference (spec §0.11 and §4.8): plain, 2^-7 |ref| +
// 2e-4 S + 1e-6 with S = sum_i |X_i| (the dequantised values); with the
// norm, 2^-5 |ref| + 2e-4 S |w| / rms + 1e-6 (rms of the reference's plain
// F_pre). The coefficients within 2e-4. Returns the failures.
int64_t count_pre_far(const Problem& p, const Fp8X& x, const PreOut& got, const PreOut& ref, const PreOut* plain,
                      const std::vector<uint16_t>& w, double norm_eps, bool head) {
  const int n = p.n;
  const int64_t C = p.C;
  int64_t bad = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    double rms = 0;
    if (plain) {
      for (int64_t c = 0; c < C; ++c) rms += std::pow(f32(plain->f[size_t(b * C + c)]), 2);
      rms = std::sqrt(rms / double(C) + norm_eps);
    }
    for (int64_t c = 0; c < C; ++c) {
      double S = 0;
      for (int i = 0; i < n; ++i) S += std::fabs(x.value((b * n + i) * C + c));
      const double g = f32(got.f[size_t(b * C + c)]), r = f32(ref.f[size_t(b * C + c)]);
      const double tol = plain ? std::ldexp(std::fabs(r), -5) + 2e-4 * S * std::fabs(f32(w[size_t(c)])) / rms + 1e-6
                               : std::ldexp(std::fabs(r), -7) + 2e-4 * S + 1e-6;
      if (!(std::fabs(g - r) <= tol) && bad++ < 10)
        ADD_FAILURE() << "F_pre[" << b << "," << c << "] = " << g << ", reference " << r;
    }
    if (head) continue;
    for (int i = 0; i < n; ++i)
      if (!(std::fabs(got.post[size_t(b * n + i)] - ref.post[size_t(b * n + i)]) <= kCoefAbsTol) && bad++ < 10)
        ADD_FAILURE() << "H_post[" << b << "," << i << "] = " << got.post[size_t(b * n + i)] << ", reference "
                      << ref.post[size_t(b * n + i)];
    for (int e = 0; e < n * n; ++e)
      if (!(std::fabs(got.res[size_t(b * n * n + e)] - ref.res[size_t(b * n * n + e)]) <= kCoefAbsTol) && bad++ < 10)
        ADD_FAILURE() << "H_res[" << b << "," << e << "] = " << got.res[size_t(b * n * n + e)] << ", reference "
                      << ref.res[size_t(b * n * n + e)];
  }
  return bad;
}

// The FP8 copy is bitwise quantize_fp8 (1 x 128, f32 scales) of the f_pre the same call wrote.
void expect_fp8_copy_of(const PreOut& got, int64_t B, int64_t C) {
  if (B == 0) return;
  std::vector<uint8_t> q(size_t(B * C)), qs(size_t(B * C / 128 * 4));
  QuantizeFp8Args a;
  a.x = got.f.data(); a.q = q.data(); a.scales = qs.data(); a.rows = B; a.cols = C;
  ASSERT_TRUE(quantize_fp8_cpu(a).ok());
  EXPECT_EQ(got.q, q) << "f_pre_fp8 is not quantize_fp8 of f_pre";
  EXPECT_EQ(got.qs, qs) << "f_pre_scales are not quantize_fp8's of f_pre";
}

// The device buffers of a pre (or the pre half of a boundary): poisoned outputs.
struct DevicePreOut {
  DeviceBuffer f, post, res, q, qs;
  int64_t B, C;
  int n;
  DevicePreOut(int64_t B_, int n_, int64_t C_) : B(B_), C(C_), n(n_) {
    f = testing::poisoned_buffer(size_t(B * C) * 2, 0x7f);
    post = testing::poisoned_buffer(size_t(B * n) * 4, 0x7f);
    res = testing::poisoned_buffer(size_t(B * n * n) * 4, 0x7f);
    q = testing::poisoned_buffer(size_t(B * C), 0x7f);
    qs = testing::poisoned_buffer(size_t(B * C / 128) * 4, 0x7f);
  }
  PreOut host() const {
    return {f.to_host<uint16_t>(), post.to_host<float>(), res.to_host<float>(), q.to_host<uint8_t>(),
            qs.to_host<uint8_t>()};
  }
};

std::vector<uint16_t> norm_weight_for(int64_t C) {
  std::vector<uint16_t> w(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) w[size_t(c)] = bf16(0.25f + float((c * 37) % 64) / 32.0f);
  return w;
}

class MhcPreFp8xGpu : public ::testing::TestWithParam<PreFp8xCase> {};

// mhc_pre and mhc_head on the FP8 stream against mhc_pre_cpu / mhc_head_cpu
// on the same codes and scales, every element; direct launches and graph
// replays give the same bytes; the kernel that ran is the one asked for.
TEST_P(MhcPreFp8xGpu, PreAndHeadMatchTheReference) {
  SKIP_WITHOUT_GPU();
  const PreFp8xCase c = GetParam();
  const int n = c.n;
  Problem p = make_problem(c.B, n, c.C, seed_for("pre_" + pre_fp8x_case_name({c, 0})));
  SCOPED_TRACE("seed " + std::to_string(p.seed));
  const Fp8X x = quantize_x(p, c.format);
  const std::vector<uint16_t> w = norm_weight_for(c.C);
  DeviceBuffer dx(x.codes), dxs(x.scales), dphi(p.phi_f32), dphib(p.phi_bf16), dal(p.alpha), dbi(p.bias), dw(w);
  DevicePreOut d(c.B, n, c.C);
  MhcPreArgs a;
  a.shape = {c.B, n, c.C};
  a.x = dx.get();
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scales = dxs.get();
  a.x_scale_format = c.format;
  a.phi_dtype = c.phi_dtype;
  a.phi = c.phi_dtype == DType::kFloat32 ? dphi.get() : dphib.get();
  a.alpha = dal.as<float>();
  a.bias = dbi.as<float>();
  a.f_pre = d.f.get();
  a.h_post = d.post.as<float>();
  a.h_res = d.res.as<float>();
  a.kernel = c.kernel;
  if (c.epilogue) {
    a.norm_weight = dw.get();
    a.f_pre_fp8 = d.q.get();
    a.f_pre_scales = d.qs.get();
  }
  MhcPreKernel chosen;
  std::string why;
  ASSERT_TRUE(mhc_pre_kernel_choice(a, &chosen, &why).ok());
  // The resident kernel's shapes run there, F_pre's epilogue too (as a pass after it: f_pre is given).
  const bool resident = c.n == 4 && c.C % 1024 == 0 && c.C <= 7168;
  EXPECT_EQ(chosen, c.kernel != MhcPreKernel::kAuto ? c.kernel
                    : resident                      ? MhcPreKernel::kResident
                                                    : MhcPreKernel::kClusterTile)
      << why;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<PreOut> runs;
  for (bool graph : {false, true}) {
    run_direct_or_graph(
        stream, graph,
        [&] {
          Status s = mhc_pre(a, stream);
          EXPECT_TRUE(s.ok()) << s.message();
        },
        [&] { EXPECT_EQ(cudaMemsetAsync(d.f.get(), 0x7f, d.f.bytes(), stream), cudaSuccess); });
    runs.push_back(d.host());
  }
  EXPECT_EQ(runs[0].f, runs[1].f);
  EXPECT_EQ(runs[0].post, runs[1].post);
  EXPECT_EQ(runs[0].res, runs[1].res);
  if (c.B == 0) {
    for (auto v : runs[0].f) ASSERT_EQ(v, 0x7f7f);
    cudaStreamDestroy(stream);
    return;
  }
  // The reference, on the host copies.
  PreOut ref{std::vector<uint16_t>(size_t(c.B * c.C)), std::vector<float>(size_t(c.B * n)),
             std::vector<float>(size_t(c.B * n * n)), std::vector<uint8_t>(size_t(c.B * c.C)),
             std::vector<uint8_t>(size_t(c.B * c.C / 128 * 4))};
  MhcPreArgs r = a;
  r.x = x.codes.data();
  r.x_scales = x.scales.data();
  r.phi = c.phi_dtype == DType::kFloat32 ? static_cast<const void*>(p.phi_f32.data()) : p.phi_bf16.data();
  r.alpha = p.alpha.data();
  r.bias = p.bias.data();
  r.f_pre = ref.f.data();
  r.h_post = ref.post.data();
  r.h_res = ref.res.data();
  r.norm_weight = nullptr;
  r.f_pre_fp8 = nullptr;
  r.f_pre_scales = nullptr;
  ASSERT_TRUE(mhc_pre_cpu(r).ok());
  if (c.epilogue) {
    PreOut normed = ref;
    r.f_pre = normed.f.data();
    r.norm_weight = w.data();
    ASSERT_TRUE(mhc_pre_cpu(r).ok());
    EXPECT_EQ(count_pre_far(p, x, runs[0], normed, &ref, w, a.norm_eps, false), 0);
    expect_fp8_copy_of(runs[0], c.B, c.C);
  } else {
    EXPECT_EQ(count_pre_far(p, x, runs[0], ref, nullptr, w, 0, false), 0);
  }
  // mhc_head on the same stream (phi's first n rows, alpha_pre, bias's first n).
  MhcHeadArgs h;
  h.shape = a.shape;
  h.x = a.x;
  h.residual = MhcResidual::kFp8E4m3;
  h.x_scales = a.x_scales;
  h.x_scale_format = c.format;
  h.phi = a.phi;
  h.phi_dtype = c.phi_dtype;
  h.alpha = a.alpha;
  h.bias = a.bias;
  h.out = d.f.get();
  h.kernel = c.kernel;
  Status s = mhc_head(h, stream);
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  PreOut got_head = d.host();
  PreOut ref_head = ref;
  h.x = x.codes.data();
  h.x_scales = x.scales.data();
  h.phi = r.phi;
  h.alpha = p.alpha.data();
  h.bias = p.bias.data();
  h.out = ref_head.f.data();
  ASSERT_TRUE(mhc_head_cpu(h).ok());
  EXPECT_EQ(count_pre_far(p, x, got_head, ref_head, nullptr, w, 0, true), 0);
  cudaStreamDestroy(stream);
}

std::vector<PreFp8xCase> pre_fp8x_cases() {
  std::vector<PreFp8xCase> v;
  constexpr auto kF = ScaleFormat::kFloat32, kE = ScaleFormat::kUE8M0;
  constexpr auto kAuto = MhcPreKernel::kAuto, kPortable = MhcPreKernel::kPortable;
  // C = 128 / 384 / 2560: CTAs of the cluster with no block or fewer blocks than the others.
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (int64_t C : {128, 384, 2560, 7168})
      for (int64_t B : {0, 1, 7, 33})
        v.push_back({n, C, B, (n + B) % 2 ? kF : kE, (C == 384 && n % 2) ? DType::kBFloat16 : DType::kFloat32, kAuto,
                     (n + C / 128 + B) % 3 == 0});
  v.push_back({4, 7168, 1001, kF, DType::kFloat32, kAuto, false});   // many tiles
  v.push_back({4, 7168, 300, kE, DType::kFloat32, kAuto, true});
  v.push_back({8, 4096, 100, kE, DType::kBFloat16, kAuto, false});
  // The resident kernel (kAuto, n = 4): every C it takes (1 to 7 boxes a
  // CTA, a CTA's slice starting mid-block when C / 16 is not a multiple of
  // 128), partial last tiles, many tiles per cluster, phi bf16; the cluster
  // tiles pinned on the same shapes.
  constexpr auto kTiles = MhcPreKernel::kClusterTile;
  for (int64_t C : {1024, 2048, 3072, 5120, 7168})
    for (int64_t B : {1, 17, 300}) v.push_back({4, C, B, (C / 1024 + B) % 2 ? kF : kE, DType::kFloat32, kAuto, false});
  v.push_back({4, 7168, 2053, kE, DType::kFloat32, kAuto, false});
  v.push_back({4, 4096, 5000, kF, DType::kBFloat16, kAuto, false});
  v.push_back({4, 6144, 77, kF, DType::kBFloat16, kAuto, false});
  v.push_back({4, 7168, 33, kF, DType::kFloat32, kTiles, false});
  v.push_back({4, 1024, 300, kE, DType::kBFloat16, kTiles, false});
  for (int n : {1, 4, 8})
    for (int64_t B : {1, 7}) v.push_back({n, 1280, B, B == 1 ? kF : kE, DType::kFloat32, kPortable, false});
  v.push_back({4, 7168, 16, kF, DType::kBFloat16, kPortable, false});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcPreFp8xGpu, ::testing::ValuesIn(pre_fp8x_cases()), pre_fp8x_case_name);

class MhcPostPreFp8xGpu : public ::testing::TestWithParam<PreFp8xCase> {};

// mhc_post_pre on the FP8 stream, fused (the cluster tiles) and on the path
// kAuto takes (post then pre, or fused with an epilogue off the resident
// kernel's shapes): bitwise mhc_post then mhc_pre pinned to the
// kernel the boundary reports, on the GPU (X_next codes and scales, F_pre
// and its epilogue, H_post, H_res), X_next bitwise mhc_post_cpu's; direct
// and graph replays alike.
TEST_P(MhcPostPreFp8xGpu, BitwiseEqualsPostThenPre) {
  SKIP_WITHOUT_GPU();
  const PreFp8xCase c = GetParam();
  const int n = c.n;
  Problem p = make_problem(c.B, n, c.C, seed_for("postpre_" + pre_fp8x_case_name({c, 0})));
  SCOPED_TRACE("seed " + std::to_string(p.seed));
  const MhcResLayout layout = (n + c.B) % 2 ? MhcResLayout::kDeepSeek : MhcResLayout::kRowMix;
  const Fp8X x = quantize_x(p, c.format);
  const std::vector<uint16_t> w = norm_weight_for(c.C);
  DeviceFp8Post post(p, x);  // X_L, F_out, H_post, H_res; X_next of the separate post
  DeviceBuffer dphi(p.phi_f32), dphib(p.phi_bf16), dal(p.alpha), dbi(p.bias), dw(w);
  DeviceBuffer xn = testing::poisoned_buffer(post.code_bytes + kTail, kPoison);
  DeviceBuffer xns = testing::poisoned_buffer(post.scale_bytes + kTail, kPoison);
  DevicePreOut fused(c.B, n, c.C), sep(c.B, n, c.C);
  MhcPostPreArgs a;
  a.shape = {c.B, n, c.C};
  a.x = post.x.get();
  a.f_out = post.f_out.get();
  a.h_post = post.h_post.as<float>();
  a.h_res = post.h_res.as<float>();
  a.res_layout = layout;
  a.phi_dtype = c.phi_dtype;
  a.phi = c.phi_dtype == DType::kFloat32 ? dphi.get() : dphib.get();
  a.alpha = dal.as<float>();
  a.bias = dbi.as<float>();
  a.x_next = xn.get();
  a.f_pre = fused.f.get();
  a.h_post_next = fused.post.as<float>();
  a.h_res_next = fused.res.as<float>();
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scales = post.xs.get();
  a.x_next_scales = xns.get();
  a.x_scale_format = c.format;
  if (c.epilogue) {
    a.norm_weight = dw.get();
    a.f_pre_fp8 = fused.q.get();
    a.f_pre_scales = fused.qs.get();
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The fused cluster-tile kernel, and the path kAuto takes (post then pre).
  for (MhcBoundaryPath path : {MhcBoundaryPath::kFused, MhcBoundaryPath::kAuto}) {
    SCOPED_TRACE(to_string(path));
    a.path = path;
    MhcPreKernel chosen;
    MhcBoundaryPath ran = MhcBoundaryPath::kAuto;
    std::string why;
    ASSERT_TRUE(mhc_post_pre_path_choice(a, &ran, &chosen, &why).ok());
    if (a.path == MhcBoundaryPath::kFused) EXPECT_EQ(chosen, MhcPreKernel::kClusterTile) << why;
    // kAuto: post then pre; with F_pre's epilogue too where the pre runs on
    // the resident kernel (n = 4, C a multiple of 1024: the epilogue a pass
    // after it), fused on the cluster tiles otherwise (MhcBoundaryPath).
    const bool resident_pre = n == 4 && c.C % 1024 == 0 && c.C <= 7168;
    if (a.path == MhcBoundaryPath::kAuto && c.B > 0)
      EXPECT_EQ(ran, c.epilogue && !resident_pre ? MhcBoundaryPath::kFused : MhcBoundaryPath::kPostThenPre) << why;
    // The separate ops: mhc_post, then mhc_pre on its X_next pinned to the kernel the boundary runs.
    MhcPreArgs pre;
    pre.shape = a.shape;
    pre.x = post.out.get();
    pre.residual = MhcResidual::kFp8E4m3;
    pre.x_scales = post.out_s.get();
    pre.x_scale_format = c.format;
    pre.phi = a.phi;
    pre.phi_dtype = c.phi_dtype;
    pre.alpha = a.alpha;
    pre.bias = a.bias;
    pre.f_pre = sep.f.get();
    pre.h_post = sep.post.as<float>();
    pre.h_res = sep.res.as<float>();
    pre.kernel = chosen;
    if (c.epilogue) {
      pre.norm_weight = dw.get();
      pre.f_pre_fp8 = sep.q.get();
      pre.f_pre_scales = sep.qs.get();
    }
    {
      Status s = mhc_post(post.args(p, layout, c.format), stream);
      ASSERT_TRUE(s.ok()) << s.message();
      s = mhc_pre(pre, stream);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    const PreOut want = sep.host();
    const auto want_codes = post.out.to_host<uint8_t>();
    const auto want_scales = post.out_s.to_host<uint8_t>();
    Fp8X ref = poisoned_fp8x({p.B, p.n, p.C}, c.format, kPoison);
    if (c.B > 0) ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, ref, layout)).ok());
    for (bool graph : {false, true}) {
      SCOPED_TRACE(graph ? "graph replays" : "direct launch");
      run_direct_or_graph(
          stream, graph,
          [&] {
            Status s = mhc_post_pre(a, stream);
            EXPECT_TRUE(s.ok()) << s.message();
          },
          [&] {
            EXPECT_EQ(cudaMemsetAsync(xn.get(), kPoison, post.code_bytes + kTail, stream), cudaSuccess);
            EXPECT_EQ(cudaMemsetAsync(xns.get(), kPoison, post.scale_bytes + kTail, stream), cudaSuccess);
            for (const DeviceBuffer* b : {&fused.f, &fused.post, &fused.res, &fused.q, &fused.qs})
              if (b->bytes()) EXPECT_EQ(cudaMemsetAsync(b->get(), 0x7f, b->bytes(), stream), cudaSuccess);
          });
      expect_bitwise(xn, xns, ref, "X_next against mhc_post_cpu");
      EXPECT_EQ(xn.to_host<uint8_t>(), want_codes);
      EXPECT_EQ(xns.to_host<uint8_t>(), want_scales);
      const PreOut got = fused.host();
      EXPECT_EQ(got.f, want.f);
      EXPECT_EQ(got.post, want.post);
      EXPECT_EQ(got.res, want.res);
      if (c.epilogue) {
        EXPECT_EQ(got.q, want.q);
        EXPECT_EQ(got.qs, want.qs);
      }
    }
  }
  cudaStreamDestroy(stream);
}

std::vector<PreFp8xCase> post_pre_fp8x_cases() {
  std::vector<PreFp8xCase> v;
  constexpr auto kF = ScaleFormat::kFloat32, kE = ScaleFormat::kUE8M0;
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (int64_t C : {128, 2560, 7168})
      for (int64_t B : {0, 1, 33})
        v.push_back({n, C, B, (n + B) % 2 ? kF : kE, (C == 2560 && n % 2) ? DType::kBFloat16 : DType::kFloat32,
                     MhcPreKernel::kAuto, (n + C / 128 + B) % 3 == 1});
  v.push_back({4, 7168, 1001, kF, DType::kFloat32, MhcPreKernel::kAuto, false});
  v.push_back({4, 7168, 300, kE, DType::kFloat32, MhcPreKernel::kAuto, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcPostPreFp8xGpu, ::testing::ValuesIn(post_pre_fp8x_cases()), pre_fp8x_case_name);

// The resident kernel reads ue8m0 scales by aligned 4-byte copies; an array
// that is only byte-aligned takes its other path: the same bytes out.
TEST(MhcPreFp8xPathGpu, ResidentUe8m0ScalesAtAnyAlignment) {
  SKIP_WITHOUT_GPU();
  Problem p = make_problem(40, 4, 3072, seed_for("fp8x_align"));
  const Fp8X x = quantize_x(p, ScaleFormat::kUE8M0);
  std::vector<uint8_t> shifted(x.scales.size() + 4, 0);
  std::copy(x.scales.begin(), x.scales.end(), shifted.begin() + 1);
  DeviceBuffer dx(x.codes), dxs(x.scales), dxs1(shifted), dphi(p.phi_f32), dal(p.alpha), dbi(p.bias);
  DevicePreOut d0(p.B, 4, p.C), d1(p.B, 4, p.C);
  MhcPreArgs a;
  a.shape = {p.B, 4, p.C};
  a.x = dx.get();
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scale_format = ScaleFormat::kUE8M0;
  a.x_scales = dxs.get();
  a.phi = dphi.get();
  a.alpha = dal.as<float>();
  a.bias = dbi.as<float>();
  a.f_pre = d0.f.get();
  a.h_post = d0.post.as<float>();
  a.h_res = d0.res.as<float>();
  a.kernel = MhcPreKernel::kResident;
  Status s = mhc_pre(a, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  a.x_scales = static_cast<const uint8_t*>(dxs1.get()) + 1;
  a.f_pre = d1.f.get();
  a.h_post = d1.post.as<float>();
  a.h_res = d1.res.as<float>();
  s = mhc_pre(a, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  const PreOut o0 = d0.host(), o1 = d1.host();
  EXPECT_EQ(o0.f, o1.f);
  EXPECT_EQ(o0.post, o1.post);
  EXPECT_EQ(o0.res, o1.res);
}

// The kernels that do not take the FP8 stream, pinned: kNotSupported,
// nothing launched (split; resident for the boundary).
TEST(MhcPreFp8xPathGpu, SplitAndResidentBoundarySayNotSupported) {
  SKIP_WITHOUT_GPU();
  Problem p = make_problem(16, 4, 7168, seed_for("fp8x_paths"));
  const Fp8X x = quantize_x(p, ScaleFormat::kFloat32);
  DeviceBuffer dx(x.codes), dxs(x.scales), dphi(p.phi_f32), dal(p.alpha), dbi(p.bias);
  DevicePreOut d(p.B, 4, p.C);
  DeviceBuffer ws = testing::zeroed_buffer(std::max<size_t>(mhc_workspace_bytes({p.B, 4, p.C}), 256));
  MhcPreArgs a;
  a.shape = {p.B, 4, p.C};
  a.x = dx.get();
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scales = dxs.get();
  a.phi = dphi.get();
  a.alpha = dal.as<float>();
  a.bias = dbi.as<float>();
  a.f_pre = d.f.get();
  a.h_post = d.post.as<float>();
  a.h_res = d.res.as<float>();
  a.workspace = ws.get();
  a.workspace_bytes = ws.bytes();
  a.kernel = MhcPreKernel::kSplit;
  Status s = mhc_pre(a, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
  EXPECT_NE(s.message().find("bf16 residual stream only"), std::string::npos) << s.message();
  a.kernel = MhcPreKernel::kAuto;
  MhcPreKernel chosen;
  std::string why;
  ASSERT_TRUE(mhc_pre_kernel_choice(a, &chosen, &why).ok());
  EXPECT_EQ(chosen, MhcPreKernel::kResident) << why;  // the workspace is not used by it
  CUDA_OK(cudaDeviceSynchronize());
  for (auto v : d.f.to_host<uint16_t>()) ASSERT_EQ(v, 0x7f7f);
  // The boundary on the FP8 stream: the cluster tiles only.
  DeviceBuffer fo(p.f_out), hp(p.h_post), hr(p.h_res);
  DeviceBuffer xn(x.codes.size()), xns(x.scales.size());
  DevicePreOut d2(p.B, 4, p.C);
  MhcPostPreArgs pp;
  pp.shape = a.shape;
  pp.x = a.x;
  pp.f_out = fo.get();
  pp.h_post = hp.as<float>();
  pp.h_res = hr.as<float>();
  pp.phi = a.phi;
  pp.alpha = a.alpha;
  pp.bias = a.bias;
  pp.x_next = xn.get();
  pp.f_pre = d2.f.get();
  pp.h_post_next = d2.post.as<float>();
  pp.h_res_next = d2.res.as<float>();
  pp.residual = MhcResidual::kFp8E4m3;
  pp.x_scales = a.x_scales;
  pp.x_next_scales = xns.get();
  pp.kernel = MhcPreKernel::kResident;
  s = mhc_post_pre(pp, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
  EXPECT_NE(s.message().find("boundary runs on the cluster-tile kernel"), std::string::npos) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  for (auto v : d2.f.to_host<uint16_t>()) ASSERT_EQ(v, 0x7f7f);
}

}  // namespace
}  // namespace flashmix
