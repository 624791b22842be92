// GPU tests of mhc_post_head (spec §4.10): the last layer's post fused in
// front of the head, on the bf16 and the FP8 residual streams, with X_next
// kept or left on chip. Without a GPU every test is skipped.
//
// What is compared, every element:
//   - out (and X_next, its scales, where kept) bitwise against mhc_post then
//     mhc_head pinned to the kernel the fused op ran, same inputs;
//   - that X_next against the CPU post (bf16: 2^-7 |ref| + 1e-5 S, S the sum
//     of |terms|; FP8: count_fp8x_far_from_exact's bound against exact
//     arithmetic) and out against the CPU head of that X_next
//     (2^-7 |ref| + 2e-4 S + 1e-6, S = sum_i |X_next[i]|: the coefficients
//     come from the tensor-core projection);
//   - the poison gone from every output element, and untouched past each
//     output's end.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/gpu_testing.h"
#include "cpu/test_mhc_fp8x_common.h"
#include "flashmix/mhc.h"

namespace flashmix {
namespace {

using namespace mhc_test;
using testing::DeviceBuffer;
using testing::run_direct_or_graph;

constexpr uint8_t kPoison = 0x7f;  // bf16 0x7f7f, e4m3 NaN, fp32 ~3.4e38
constexpr size_t kTail = 64;       // poisoned bytes past each output, checked untouched

struct PostHeadCase {
  int n;
  int64_t C, B;
  MhcResLayout layout;
  DType phi_dtype = DType::kFloat32;
  MhcPreKernel kernel = MhcPreKernel::kAuto;
  bool workspace = false;      // a zeroed workspace (the split kernel for small B)
  bool keep_x_next = true;     // x_next given (else X_next stays on chip)
  bool graph = false;
  bool fp8 = false;            // the FP8 residual stream
  ScaleFormat format = ScaleFormat::kFloat32;
};

std::string case_name(const ::testing::TestParamInfo<PostHeadCase>& info) {
  const PostHeadCase& c = info.param;
  return "n" + std::to_string(c.n) + "_C" + std::to_string(c.C) + "_B" + std::to_string(c.B) +
         (c.layout == MhcResLayout::kDeepSeek ? "_deepseek" : "_rowmix") +
         (c.phi_dtype == DType::kFloat32 ? "_phif32" : "_phibf16") +
         (c.kernel == MhcPreKernel::kClusterTile ? "_clustertiles" : "") +
         (c.kernel == MhcPreKernel::kSplit ? "_splitpinned" : "") + (c.workspace ? "_workspace" : "") +
         (c.keep_x_next ? "_keepx" : "_nox") + (c.graph ? "_graph" : "") +
         (c.fp8 ? (c.format == ScaleFormat::kUE8M0 ? "_fp8x_ue8m0" : "_fp8x_f32") : "");
}

int64_t scale_size(ScaleFormat f) { return f == ScaleFormat::kUE8M0 ? 1 : 4; }

// An output buffer of `bytes` poisoned, with kTail poisoned bytes after it.
DeviceBuffer poisoned(size_t bytes) { return testing::poisoned_buffer(bytes + kTail, kPoison); }

void expect_tail_untouched(const DeviceBuffer& b, const char* what) {
  if (b.get() == nullptr) return;
  const auto h = b.to_host<uint8_t>();
  for (size_t i = h.size() - kTail; i < h.size(); ++i)
    ASSERT_EQ(h[i], kPoison) << what << ": written past its end at byte " << i;
}

std::vector<uint8_t> bytes_of(const DeviceBuffer& b, size_t n) {
  auto h = b.to_host<uint8_t>();
  h.resize(n);
  return h;
}

int64_t first_diff(const std::vector<uint8_t>& u, const std::vector<uint8_t>& v) {
  for (size_t i = 0; i < std::min(u.size(), v.size()); ++i)
    if (u[i] != v[i]) return int64_t(i);
  return u.size() == v.size() ? -1 : int64_t(std::min(u.size(), v.size()));
}

// The inputs of one problem on the device: X (bf16, or FP8 codes + scales
// made by quantize_fp8 of the problem's X) and the post's and head's inputs.
struct DeviceInputs {
  Fp8X fx;
  DeviceBuffer x, xs, f_out, h_post, h_res, phi, alpha, bias;
  DeviceInputs(const Problem& p, const PostHeadCase& c)
      : fx(c.fp8 ? quantize_x(p, c.format) : Fp8X()),
        x(c.fp8 ? DeviceBuffer(fx.codes) : DeviceBuffer(p.x)),
        xs(c.fp8 ? DeviceBuffer(fx.scales) : DeviceBuffer()),
        f_out(p.f_out), h_post(p.h_post), h_res(p.h_res),
        phi(c.phi_dtype == DType::kFloat32 ? DeviceBuffer(p.phi_f32) : DeviceBuffer(p.phi_bf16)),
        alpha(p.alpha), bias(p.bias) {}
};

DeviceBuffer zeroed_workspace(const MhcShape& shape) {
  return flashmix::testing::zeroed_buffer(std::max<size_t>(mhc_workspace_bytes(shape), 256));
}

// mhc_post_head's arguments on `d` (phi's first n rows are the head's phi,
// bias's first n its bias, alpha[0] its alpha).
MhcPostHeadArgs post_head_args(const Problem& p, const PostHeadCase& c, const DeviceInputs& d) {
  MhcPostHeadArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = d.x.get(); a.f_out = d.f_out.get(); a.h_post = d.h_post.as<float>(); a.h_res = d.h_res.as<float>();
  a.res_layout = c.layout;
  a.phi = d.phi.get(); a.phi_dtype = c.phi_dtype; a.alpha = d.alpha.as<float>(); a.bias = d.bias.as<float>();
  a.eps_norm = 1e-6f;
  a.eps_pre = 1e-3f;
  a.kernel = c.kernel;
  if (c.fp8) {
    a.residual = MhcResidual::kFp8E4m3;
    a.x_scales = d.xs.get();
    a.x_scale_format = c.format;
  }
  return a;
}

class MhcPostHeadGpu : public ::testing::TestWithParam<PostHeadCase> {};

TEST_P(MhcPostHeadGpu, BitwiseEqualsPostThenHeadAndMatchesReference) {
  SKIP_WITHOUT_GPU();
  const PostHeadCase c = GetParam();
  const int n = c.n;
  Problem p = make_problem(c.B, n, c.C, seed_for(case_name({c, 0})));
  SCOPED_TRACE("seed " + std::to_string(p.seed));
  DeviceInputs d(p, c);
  const MhcShape shape{c.B, n, c.C};
  const size_t xb = size_t(c.B * p.K() * (c.fp8 ? 1 : 2)), ob = size_t(c.B * c.C * 2);
  const size_t sb = c.fp8 ? size_t(mhc_x_scale_count(shape) * scale_size(c.format)) : 0;
  DeviceBuffer out = poisoned(ob);
  DeviceBuffer x_next = c.keep_x_next ? poisoned(xb) : DeviceBuffer();
  DeviceBuffer x_next_s = c.keep_x_next && c.fp8 ? poisoned(sb) : DeviceBuffer();
  MhcPostHeadArgs a = post_head_args(p, c, d);
  a.out = out.get();
  a.x_next = x_next.get();
  a.x_next_scales = x_next_s.get();
  DeviceBuffer ws = c.workspace ? zeroed_workspace(shape) : DeviceBuffer();
  a.workspace = ws.get();
  a.workspace_bytes = ws.bytes();
  MhcPreKernel ran = MhcPreKernel::kAuto;
  {  // the same answer at B = 0 (no buffers) as with tokens
    std::string why;
    Status s = mhc_post_head_kernel_choice(a, &ran, &why);
    ASSERT_TRUE(s.ok()) << s.message();
    if (c.kernel != MhcPreKernel::kAuto) EXPECT_EQ(ran, c.kernel);
    if (c.kernel == MhcPreKernel::kAuto && c.workspace && c.B >= 1 && c.B <= 16 && !c.fp8)
      EXPECT_EQ(ran, MhcPreKernel::kSplit) << why;
    // Without a workspace: fused on the cluster tiles, or with x_next given
    // and the head on the resident kernel (n = 4, C a multiple of 1024, bf16
    // stream) post then head.
    const bool resident_head = a.x_next != nullptr && !c.fp8 && n == 4 && c.C % 1024 == 0 && c.C <= 7168;
    if (c.kernel == MhcPreKernel::kAuto && !c.workspace)
      EXPECT_EQ(ran, resident_head ? MhcPreKernel::kResident : MhcPreKernel::kClusterTile) << why;
    if (c.kernel == MhcPreKernel::kAuto && c.B > 0)
      EXPECT_EQ(why.rfind("post then head", 0) == 0, ran == MhcPreKernel::kResident) << why;
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  run_direct_or_graph(
      stream, c.graph,
      [&] {
        Status s = mhc_post_head(a, stream);
        EXPECT_TRUE(s.ok()) << s.message();
      },
      [&] {
        EXPECT_EQ(cudaMemsetAsync(out.get(), kPoison, ob, stream), cudaSuccess);
        if (x_next.get()) EXPECT_EQ(cudaMemsetAsync(x_next.get(), kPoison, xb, stream), cudaSuccess);
        if (x_next_s.get()) EXPECT_EQ(cudaMemsetAsync(x_next_s.get(), kPoison, sb, stream), cudaSuccess);
      });
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaGetLastError());
  expect_tail_untouched(out, "out");
  expect_tail_untouched(x_next, "x_next");
  expect_tail_untouched(x_next_s, "x_next_scales");
  if (c.B == 0) return;

  // The same boundary as two ops: mhc_post, then mhc_head pinned to `ran`
  // (the same workspace: the epoch word only counts launches).
  DeviceBuffer x2 = poisoned(xb), s2 = poisoned(sb), o2 = poisoned(ob);
  MhcPostArgs post;
  post.shape = shape;
  post.x = a.x; post.f_out = a.f_out; post.h_post = a.h_post; post.h_res = a.h_res; post.res_layout = c.layout;
  post.x_next = x2.get();
  if (c.fp8) {
    post.residual = MhcResidual::kFp8E4m3;
    post.x_scales = a.x_scales; post.x_next_scales = s2.get(); post.x_scale_format = c.format;
  }
  {
    Status s = mhc_post(post, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  MhcHeadArgs head;
  head.shape = shape;
  head.x = x2.get(); head.phi = a.phi; head.phi_dtype = a.phi_dtype; head.alpha = a.alpha; head.bias = a.bias;
  head.out = o2.get(); head.eps_norm = a.eps_norm; head.eps_pre = a.eps_pre;
  head.kernel = ran; head.workspace = a.workspace; head.workspace_bytes = a.workspace_bytes;
  if (c.fp8) {
    head.residual = MhcResidual::kFp8E4m3;
    head.x_scales = s2.get(); head.x_scale_format = c.format;
  }
  {
    Status s = mhc_head(head, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  CUDA_OK(cudaDeviceSynchronize());
  const auto got_o = bytes_of(out, ob), two_o = bytes_of(o2, ob);
  const auto two_x = bytes_of(x2, xb), two_s = bytes_of(s2, sb);
  EXPECT_EQ(first_diff(got_o, two_o), -1) << "out differs from mhc_post + mhc_head";
  if (c.keep_x_next) {
    EXPECT_EQ(first_diff(bytes_of(x_next, xb), two_x), -1) << "X_next differs from mhc_post's";
    if (c.fp8) EXPECT_EQ(first_diff(bytes_of(x_next_s, sb), two_s), -1) << "X_next's scales differ from mhc_post's";
  }

  // Against the reference. X_next (the two-op X_next, bitwise the fused one
  // where kept) against the CPU post; out against the CPU head of it.
  int64_t bad = 0;
  std::vector<float> xv(size_t(c.B * p.K()));  // X_next's values
  Fp8X got_fx;
  if (c.fp8) {
    got_fx.format = c.format;
    got_fx.codes = two_x;
    got_fx.scales = two_s;
    bad += count_fp8x_far_from_exact(p, d.fx, got_fx, c.layout);
    for (size_t e = 0; e < xv.size(); ++e) xv[e] = got_fx.value(int64_t(e));
  } else {
    std::vector<uint16_t> ref_x(xv.size());
    MhcPostArgs rp = post;
    rp.x = p.x.data(); rp.f_out = p.f_out.data(); rp.h_post = p.h_post.data(); rp.h_res = p.h_res.data();
    rp.x_next = ref_x.data();
    ASSERT_TRUE(mhc_post_cpu(rp).ok());
    const bool tr = c.layout == MhcResLayout::kDeepSeek;
    for (int64_t b = 0; b < c.B; ++b)
      for (int i = 0; i < n; ++i)
        for (int64_t col = 0; col < c.C; ++col) {
          double scale = std::fabs(p.h_post[b * n + i] * f32(p.f_out[b * c.C + col]));
          for (int j = 0; j < n; ++j)
            scale += std::fabs((tr ? p.h_res[b * n * n + j * n + i] : p.h_res[b * n * n + i * n + j]) *
                               f32(p.x[(b * n + j) * c.C + col]));
          const int64_t e = (b * n + i) * c.C + col;
          uint16_t g;
          std::memcpy(&g, &two_x[size_t(e) * 2], 2);
          xv[size_t(e)] = f32(g);
          const double r = f32(ref_x[size_t(e)]);
          if (!(std::fabs(double(xv[size_t(e)]) - r) <= std::ldexp(std::fabs(r), -7) + 1e-5 * scale + 1e-6) &&
              bad++ < 10)
            ADD_FAILURE() << "X_next[" << b << "," << i << "," << col << "] = " << xv[size_t(e)] << ", reference " << r;
        }
  }
  std::vector<uint16_t> ref_o(size_t(c.B * c.C));
  MhcHeadArgs rh = head;
  rh.x = c.fp8 ? static_cast<const void*>(got_fx.codes.data()) : static_cast<const void*>(two_x.data());
  rh.x_scales = c.fp8 ? got_fx.scales.data() : nullptr;
  rh.phi = c.phi_dtype == DType::kFloat32 ? static_cast<const void*>(p.phi_f32.data()) : p.phi_bf16.data();
  rh.alpha = p.alpha.data(); rh.bias = p.bias.data(); rh.out = ref_o.data();
  rh.workspace = nullptr; rh.workspace_bytes = 0;
  ASSERT_TRUE(mhc_head_cpu(rh).ok());
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t col = 0; col < c.C; ++col) {
      double S = 0;
      for (int i = 0; i < n; ++i) S += std::fabs(double(xv[size_t((b * n + i) * c.C + col)]));
      uint16_t g16;
      std::memcpy(&g16, &got_o[size_t(b * c.C + col) * 2], 2);
      const double g = f32(g16), r = f32(ref_o[size_t(b * c.C + col)]);
      if (!(std::isfinite(g) && std::fabs(g - r) <= std::ldexp(std::fabs(r), -7) + 2e-4 * S + 1e-6) && bad++ < 10)
        ADD_FAILURE() << "out[" << b << "," << col << "] = " << g << ", reference " << r;
    }
  EXPECT_EQ(bad, 0);
}

std::vector<PostHeadCase> cases() {
  using L = MhcResLayout;
  constexpr auto kAuto = MhcPreKernel::kAuto, kTiles = MhcPreKernel::kClusterTile, kSplit = MhcPreKernel::kSplit;
  constexpr auto F32 = DType::kFloat32, BF16 = DType::kBFloat16;
  std::vector<PostHeadCase> v;
  // The cluster tiles (no workspace): every n, odd C and B, both layouts,
  // X_next kept and not.
  for (int n = 1; n <= 8; ++n)
    for (int64_t C : {1000, 7168})
      for (int64_t B : {0, 1, 7, 45})
        v.push_back({n, C, B, (n + B) % 2 ? L::kRowMix : L::kDeepSeek, n % 3 ? F32 : BF16, kAuto, false, B != 7});
  v.push_back({4, 7168, 1000, L::kDeepSeek, F32, kAuto, false, false});
  v.push_back({4, 4096, 333, L::kRowMix, BF16, kTiles, false, true, true});
  v.push_back({3, 8, 5, L::kDeepSeek});  // smallest C: most CTAs of a cluster hold nothing
  // The split kernel (a workspace, B <= 32): pinned, and kAuto's pick at B <= 16.
  for (int n : {1, 2, 4, 6, 8})
    for (int64_t B : {1, 7, 16, 32})
      v.push_back({n, n == 8 && B == 32 ? 1000 : 7168, B, B == 7 ? L::kRowMix : L::kDeepSeek, F32, kSplit, true,
                   B != 16});
  v.push_back({4, 7168, 16, L::kDeepSeek, F32, kAuto, true, false, true});
  v.push_back({4, 2560, 9, L::kRowMix, BF16, kAuto, true, true, true});
  v.push_back({3, 8, 5, L::kDeepSeek, F32, kSplit, true, true});
  v.push_back({4, 7168, 64, L::kDeepSeek, F32, kAuto, true, false});  // past the split kernel's batch: the cluster tiles
  // The FP8 residual stream (the cluster tiles), both scale formats.
  for (int n : {1, 4, 8})
    for (int64_t B : {0, 1, 33})
      for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0})
        v.push_back({n, n == 8 ? 1024 : 7168, B, B == 1 ? L::kRowMix : L::kDeepSeek, F32, kAuto, false,
                     f == ScaleFormat::kFloat32, false, true, f});
  v.push_back({4, 7168, 16, L::kDeepSeek, BF16, kAuto, true, false, true, true, ScaleFormat::kUE8M0});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcPostHeadGpu, ::testing::ValuesIn(cases()), case_name);

// X_next in the workspace's scratch (mhc_post_head_workspace_bytes): with
// x_next null kAuto runs post then the head on the resident kernel where the
// fused op's own choice is not the split kernel (B > 32 here; B = 16: the
// fused split kernel); out bitwise mhc_post then mhc_head pinned to the kernel
// reported. kPostThenPre pinned without x_next or that workspace:
// kInvalidArgument naming x_next, nothing written.
TEST(MhcPostHeadPathGpu, XNextScratchInTheWorkspace) {
  SKIP_WITHOUT_GPU();
  for (int64_t B : {16, 100, 333}) {
    SCOPED_TRACE("B=" + std::to_string(B));
    const PostHeadCase c{4, 2048, B, B == 100 ? MhcResLayout::kRowMix : MhcResLayout::kDeepSeek};
    Problem p = make_problem(c.B, c.n, c.C, seed_for("post_head_scratch") + B);
    DeviceInputs d(p, c);
    const size_t xb = size_t(c.B * p.K() * 2), ob = size_t(c.B * c.C * 2);
    const size_t wb = mhc_post_head_workspace_bytes({c.B, c.n, c.C});
    ASSERT_GE(wb, xb);
    DeviceBuffer out = poisoned(ob), ws = flashmix::testing::zeroed_buffer(wb);
    MhcPostHeadArgs a = post_head_args(p, c, d);
    a.out = out.get();
    MhcPostHeadArgs bad = a;
    bad.path = MhcBoundaryPath::kPostThenPre;
    Status s = mhc_post_head(bad, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(": x_next: "), std::string::npos) << s.message();
    a.workspace = ws.get();
    a.workspace_bytes = wb;
    MhcPreKernel ran = MhcPreKernel::kAuto;
    std::string why;
    s = mhc_post_head_kernel_choice(a, &ran, &why);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(ran, B <= 16 ? MhcPreKernel::kSplit : MhcPreKernel::kResident) << why;
    if (B > 16) EXPECT_EQ(why.rfind("post then head: X_next in the workspace's scratch", 0), 0u) << why;
    s = mhc_post_head(a, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
    // The two ops: mhc_post into a buffer, mhc_head pinned to `ran`.
    DeviceBuffer x2 = poisoned(xb), o2 = poisoned(ob), ws2 = zeroed_workspace({c.B, c.n, c.C});
    MhcPostArgs post;
    post.shape = a.shape;
    post.x = a.x; post.f_out = a.f_out; post.h_post = a.h_post; post.h_res = a.h_res; post.res_layout = c.layout;
    post.x_next = x2.get();
    ASSERT_TRUE(mhc_post(post, nullptr).ok());
    MhcHeadArgs head;
    head.shape = a.shape;
    head.x = x2.get(); head.phi = a.phi; head.phi_dtype = a.phi_dtype; head.alpha = a.alpha; head.bias = a.bias;
    head.out = o2.get(); head.eps_norm = a.eps_norm; head.eps_pre = a.eps_pre; head.kernel = ran;
    if (ran == MhcPreKernel::kSplit) {
      head.workspace = ws2.get();
      head.workspace_bytes = ws2.bytes();
    }
    s = mhc_head(head, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(first_diff(bytes_of(out, ob), bytes_of(o2, ob)), -1) << "out differs from mhc_post + mhc_head";
  }
}

// The kernels without a fused post before the head (the resident and the
// portable kernel), and the split kernel without a workspace or on the FP8
// stream: kNotSupported naming the kernel, nothing written, no CUDA error left.
TEST(MhcPostHeadPathGpu, NotSupportedLaunchesNothing) {
  SKIP_WITHOUT_GPU();
  const PostHeadCase c{4, 7168, 3, MhcResLayout::kDeepSeek};
  Problem p = make_problem(c.B, c.n, c.C, seed_for("post_head_not_supported"));
  DeviceInputs d(p, c);
  const size_t xb = size_t(c.B * p.K() * 2), ob = size_t(c.B * c.C * 2);
  DeviceBuffer out = poisoned(ob), x_next = poisoned(xb);
  MhcPostHeadArgs a = post_head_args(p, c, d);
  a.out = out.get();
  a.x_next = x_next.get();
  // (kResident: without x_next or a workspace, so with no place for X_next
  // for its two launches; with x_next it takes them: below.)
  for (MhcPreKernel k : {MhcPreKernel::kResident, MhcPreKernel::kPortable, MhcPreKernel::kSplit}) {
    MhcPostHeadArgs r = a;
    r.kernel = k;
    if (k == MhcPreKernel::kResident) r.x_next = nullptr;
    Status s = mhc_post_head(r, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
    EXPECT_NE(s.message().find(to_string(k)), std::string::npos) << s.message();
    MhcPreKernel chosen;
    EXPECT_EQ(mhc_post_head_kernel_choice(r, &chosen, nullptr).code(), StatusCode::kNotSupported);
  }
  {
    MhcPostHeadArgs r = a;
    r.kernel = MhcPreKernel::kResident;
    MhcPreKernel chosen = MhcPreKernel::kAuto;
    std::string why;
    ASSERT_TRUE(mhc_post_head_kernel_choice(r, &chosen, &why).ok());
    EXPECT_EQ(chosen, MhcPreKernel::kResident) << why;
    EXPECT_EQ(why.rfind("post then head: args.kernel pins the resident kernel", 0), 0u) << why;
  }
  // The FP8 stream with a workspace, split pinned.
  const PostHeadCase f{4, 1024, 3, MhcResLayout::kDeepSeek, DType::kFloat32, MhcPreKernel::kSplit, true, true,
                       false, true};
  Problem pf = make_problem(f.B, f.n, f.C, seed_for("post_head_not_supported_fp8"));
  DeviceInputs df(pf, f);
  DeviceBuffer outf = poisoned(size_t(f.B * f.C * 2));
  DeviceBuffer ws = zeroed_workspace({f.B, f.n, f.C});
  MhcPostHeadArgs b = post_head_args(pf, f, df);
  b.out = outf.get();
  b.workspace = ws.get();
  b.workspace_bytes = ws.bytes();
  Status s = mhc_post_head(b, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (auto v : out.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  for (auto v : x_next.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  for (auto v : outf.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
}

// B = 0: kOk with no buffers, nothing launched; a bad argument is named and
// nothing is written.
TEST(MhcPostHeadPathGpu, ZeroTokensAndBadArguments) {
  SKIP_WITHOUT_GPU();
  MhcPostHeadArgs z;
  z.shape = {0, 4, 7168};
  EXPECT_TRUE(mhc_post_head(z, nullptr).ok());
  const PostHeadCase c{4, 256, 2, MhcResLayout::kDeepSeek, DType::kFloat32, MhcPreKernel::kAuto, false, true,
                       false, true};
  Problem p = make_problem(c.B, c.n, c.C, seed_for("post_head_bad"));
  DeviceInputs d(p, c);
  const size_t xb = size_t(c.B * p.K()), ob = size_t(c.B * c.C * 2), sb = size_t(c.B * c.n * (c.C / 128) * 4);
  DeviceBuffer out = poisoned(ob), x_next = poisoned(xb), x_next_s = poisoned(sb);
  MhcPostHeadArgs a = post_head_args(p, c, d);
  a.out = out.get();
  a.x_next = x_next.get();
  a.x_next_scales = x_next_s.get();
  auto expect_named = [&](const MhcPostHeadArgs& b, const char* name) {
    Status s = mhc_post_head(b, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(std::string(": ") + name + ": "), std::string::npos) << s.message();
  };
  MhcPostHeadArgs b = a;
  b.x_next = const_cast<void*>(a.x);
  expect_named(b, "x_next");
  b = a;
  b.x_next_scales = nullptr;  // X_next's codes without its scales
  expect_named(b, "x_next_scales");
  b = a;
  b.out = nullptr;
  expect_named(b, "out");
  b = a;
  b.out = x_next.get();
  expect_named(b, "x_next");  // out and x_next overlap
  b = a;
  b.h_res = nullptr;
  expect_named(b, "h_res");
  b = a;
  b.residual = MhcResidual::kBf16;  // scales on the bf16 stream
  expect_named(b, "x_scales");
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (auto v : out.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  for (auto v : x_next.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
  for (auto v : x_next_s.to_host<uint8_t>()) ASSERT_EQ(v, kPoison);
}

}  // namespace
}  // namespace flashmix
