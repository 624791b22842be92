// moe_fc1 on the GPU (sm_90a) against the CPU reference (spec §9): every
// output element of every local row, rows past P untouched, random routings
// including skewed ones (empty experts, one expert with a row of every
// token), EP ranges, both W1 layouts, every activation (with the clamps
// firing), bias, a strided or permuted X, graph capture, bad input.
//
// Tolerance (ref in double, rounded once; |.|max = largest |ref| of the case):
// the GPU sums the exact bf16 products in fp32 and evaluates the activation
// in fp32 (__expf), then rounds once to bf16, so a value near a rounding
// boundary may land one unit in the last place apart:
//   |gpu - ref| <= 2^-7 |ref| + 2^-10 |.|max
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

#define SKIP_WITHOUT_HOPPER() SKIP_WITHOUT_HOPPER_FOR("moe_fc1")

struct Case {
  int64_t T = 64;
  int k = 4;
  int64_t H = 264;  // not a multiple of the 64-deep K tile
  int64_t I = 200;  // not a multiple of the 64-column output tile
  int total = 16, start = 0, local = 16;
  int64_t x_pad = 0;  // x_stride = H + x_pad
  bool x_permuted = false;
  bool bias = true;
  Fc1WeightLayout layout = Fc1WeightLayout::kGateUp;
  MoeActivation act = MoeActivation::kSwiGLU;
  float limit = 0.f, alpha = 0.f;
  float w_scale = 0.1f;  // W1 uniform in [-w_scale, w_scale]
  enum Routing { kRandom, kFirstHalfOnly, kAllToOne } routing = kRandom;
};

struct Problem {
  Case c;
  Routing routing;
  HostTensor X, W1, bias, ref;
  DeviceBuffer dX, dW1, dbias, dp2u, doff, dout;
  MoeFc1Args args;
  double max_ref = 0;

  int64_t cap() const { return std::max<int64_t>(1, c.T * c.k); }
  int64_t x_stride() const { return c.H + c.x_pad; }

  explicit Problem(const Case& cs, uint64_t salt = 0) : c(cs) {
    Rng rng(test_seed() ^ (salt * 0x9e3779b97f4a7c15ull));
    if (c.routing == Case::kRandom) {
      routing = random_routing(rng, c.T, c.k, c.total, c.start, c.local);
    } else {
      std::vector<int32_t> ex(size_t(c.T * c.k));
      for (int64_t t = 0; t < c.T; ++t)
        for (int j = 0; j < c.k; ++j) {
          if (c.routing == Case::kAllToOne)
            ex[t * c.k + j] = j == 0 ? c.start + 3 : c.start + 4 + j;
          else
            ex[t * c.k + j] = c.start + int((t * c.k + j) % std::max(1, c.local / 2));
        }
      routing = build_routing(c.T, c.k, c.start, c.local, std::move(ex));
    }
    const int64_t x_rows = c.x_permuted ? cap() : std::max<int64_t>(1, c.T);
    X = HostTensor(DType::kBFloat16, x_rows * x_stride());
    X.fill_random(rng);
    W1 = HostTensor(DType::kBFloat16, int64_t(c.local) * 2 * c.I * c.H);
    W1.fill_random(rng, -c.w_scale, c.w_scale);
    bias = HostTensor(DType::kBFloat16, int64_t(c.local) * 2 * c.I);
    bias.fill_random(rng, -0.5f, 0.5f);
    ref = HostTensor(DType::kBFloat16, cap() * c.I);
    ref.poison();

    args.X = X.data();
    args.x_stride = c.x_pad ? x_stride() : 0;
    args.x_permuted = c.x_permuted;
    args.W1 = W1.data();
    args.layout = c.layout;
    args.bias = c.bias ? bias.data() : nullptr;
    args.expert_first_token_offset = routing.offsets.data();
    args.permuted_row_to_unpermuted_row = routing.p2u.data();
    args.num_tokens = c.T;
    args.k = c.k;
    args.hidden = c.H;
    args.inter = c.I;
    args.num_experts_per_node = c.local;
    args.activation = c.act;
    args.limit = c.limit;
    args.alpha = c.alpha;
    args.out = ref.data();
    Status st = moe_fc1_cpu(args);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t i = 0; i < routing.P() * c.I; ++i) max_ref = std::max(max_ref, std::fabs(ref.get(i)));

    dX = DeviceBuffer(X.bytes);
    dW1 = DeviceBuffer(W1.bytes);
    dbias = DeviceBuffer(bias.bytes);
    dp2u = DeviceBuffer(std::max<size_t>(4, size_t(routing.T * routing.k) * 4));  // capacity k*T
    if (!routing.p2u.empty()) dp2u.upload(routing.p2u.data(), routing.p2u.size() * 4);
    doff = DeviceBuffer(routing.offsets);
    dout = DeviceBuffer(ref.bytes.size());
    poison_out();
    args.X = dX.get();
    args.W1 = dW1.get();
    args.bias = c.bias ? dbias.get() : nullptr;
    args.expert_first_token_offset = doff.as<int64_t>();
    args.permuted_row_to_unpermuted_row = dp2u.as<int32_t>();
    args.out = dout.get();
  }

  void poison_out() {
    HostTensor p(DType::kBFloat16, int64_t(ref.bytes.size() / 2));
    p.poison();
    dout.upload(p.data(), p.bytes.size());
  }

  Status run(cudaStream_t s = nullptr) { return moe_fc1(args, s); }

  HostTensor result() const {
    HostTensor h(DType::kBFloat16, int64_t(ref.bytes.size() / 2));
    dout.download(h.data(), h.bytes.size());
    return h;
  }

  void expect_out_untouched() const {
    const HostTensor got = result();
    for (int64_t i = 0; i < got.count(); ++i)
      if (!std::isnan(got.get(i))) {
        ADD_FAILURE() << "out written at " << i;
        break;
      }
  }

  // Every element of rows [0, P) within tolerance (NaN only where the
  // reference is NaN), rows [P, k*T) still the poison.
  void check(const HostTensor& got) const {
    const double rtol = std::ldexp(1.0, -7), atol = std::ldexp(1.0, -10) * max_ref;
    const int64_t P = routing.P();
    int bad = 0;
    for (int64_t p = 0; p < cap(); ++p)
      for (int64_t i = 0; i < c.I; ++i) {
        const double g = got.get(p * c.I + i), r = ref.get(p * c.I + i);
        if (p >= P) {
          if (!std::isnan(g) && bad++ < 5) ADD_FAILURE() << "row past P written: p=" << p << " i=" << i;
          continue;
        }
        const bool ok = std::isnan(r) ? std::isnan(g) : std::fabs(g - r) <= rtol * std::fabs(r) + atol;
        if (!ok && bad++ < 5)
          ADD_FAILURE() << to_string(c.act) << "/" << to_string(c.layout) << " p=" << p << " i=" << i
                        << " gpu=" << g << " ref=" << r << " tol=" << rtol * std::fabs(r) + atol;
      }
  }
};

void check_case(const Case& c, uint64_t salt = 0) {
  Problem p(c, salt);
  Status st = p.run();
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  p.check(p.result());
}

const MoeActivation kActs[] = {MoeActivation::kSwiGLU, MoeActivation::kSwiGLUOai, MoeActivation::kSwiGLUClamped};
const Fc1WeightLayout kLayouts[] = {Fc1WeightLayout::kGateUp, Fc1WeightLayout::kInterleaved};

}  // namespace

TEST(MoeFc1Gpu, EveryActivationAndLayoutMatchesReference) {
  SKIP_WITHOUT_HOPPER();
  for (MoeActivation a : kActs)
    for (Fc1WeightLayout l : kLayouts)
      for (bool bias : {true, false}) {
        SCOPED_TRACE(std::string(to_string(a)) + "/" + to_string(l) + (bias ? "/bias" : "/no bias"));
        Case c;
        c.act = a;
        c.layout = l;
        c.bias = bias;
        check_case(c);
      }
}

TEST(MoeFc1Gpu, ClampsFireAtDefaultAndChosenLimits) {
  SKIP_WITHOUT_HOPPER();
  for (MoeActivation a : {MoeActivation::kSwiGLUOai, MoeActivation::kSwiGLUClamped})
    for (Fc1WeightLayout l : kLayouts) {
      SCOPED_TRACE(std::string(to_string(a)) + "/" + to_string(l));
      Case c;
      c.act = a;
      c.layout = l;
      c.w_scale = 1.5f;  // |g|, |u| up to ~25: past the default limits 7 / 10
      check_case(c);
      c.w_scale = 0.1f;
      c.limit = 0.25f;  // past a small chosen limit
      c.alpha = 1.25f;
      check_case(c, 1);
    }
}

// T * k <= 512 * E_local: tiles of up to 128 rows (6-stage ring).
TEST(MoeFc1Gpu, LargeExpertsAreChunked) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 700;  // ~350 rows an expert: three chunks of 128 rows each; I = 200: four output slices
  c.k = 2;
  c.total = c.local = 4;
  check_case(c);
  c.routing = Case::kAllToOne;  // expert 3: a row of every token (six chunks)
  c.total = c.local = 8;
  check_case(c);
}

// T * k > 512 * E_local: the other ring (tiles of up to 256 rows, 4 stages,
// a 4-pass epilogue), gathering and from a permuted X.
TEST(MoeFc1Gpu, LargeExpertsTake256RowTiles) {
  SKIP_WITHOUT_HOPPER();
  for (bool permuted : {false, true}) {
    SCOPED_TRACE(permuted ? "permuted X" : "gather");
    Case c;
    c.T = 2100;  // T * k = 4200 > 512 * 4; ~1050 rows an expert: chunks of up to 256 rows
    c.k = 2;
    c.total = c.local = 4;
    c.x_permuted = permuted;
    c.layout = permuted ? Fc1WeightLayout::kInterleaved : Fc1WeightLayout::kGateUp;
    check_case(c);
  }
}

TEST(MoeFc1Gpu, EmptyExpertsAndExpertParallelRange) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.routing = Case::kFirstHalfOnly;
  check_case(c);
  c = Case{};
  c.total = 48;
  c.start = 16;
  c.local = 16;  // a middle rank: most slots are not local; rows past P stay untouched
  check_case(c);
}

TEST(MoeFc1Gpu, ManyExpertsAndDeepK) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 256;
  c.k = 8;
  c.total = c.local = 1024;  // the most local experts: most have 1-4 rows, many none
  c.H = 1032;
  c.I = 72;
  check_case(c);
}

TEST(MoeFc1Gpu, SmallestShapes) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 1;
  c.k = 1;
  c.total = c.local = 1;
  c.H = 8;
  c.I = 8;
  check_case(c);
  c.T = 1;  // one token, k = 8 of 8 experts
  c.k = 8;
  c.total = c.local = 8;
  c.H = 2048;
  c.I = 64;
  check_case(c);
}

TEST(MoeFc1Gpu, StridedAndPermutedInput) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.x_pad = 24;
  check_case(c);
  c.x_permuted = true;  // the caller's permuted copy: row p reads X[p]
  check_case(c);
  c.x_pad = 0;
  check_case(c);
}

TEST(MoeFc1Gpu, ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_HOPPER();
  MoeFc1Args a;
  a.num_tokens = 0;
  a.k = 4;
  a.hidden = 64;
  a.inter = 64;
  a.num_experts_per_node = 8;
  Status st = moe_fc1(a, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(MoeFc1Gpu, RepeatedRunsAreBitwiseIdentical) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 300;
  Problem p(c);
  ASSERT_TRUE(p.run().ok());
  const HostTensor first = p.result();
  p.poison_out();
  ASSERT_TRUE(p.run().ok());
  const HostTensor second = p.result();
  EXPECT_EQ(first.bytes, second.bytes);
  p.check(second);
}

TEST(MoeFc1Gpu, GraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 128;
  Problem p(c);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ASSERT_TRUE(p.run(s).ok());  // attributes set outside the capture
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  Status st = p.run(s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  ASSERT_TRUE(st.ok()) << st.message();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    p.poison_out();
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    p.check(p.result());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(MoeFc1Gpu, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  Problem p(c);
  auto expect_error = [&](const MoeFc1Args& a, const char* arg) {
    Status st = moe_fc1(a, nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  MoeFc1Args a = p.args;
  a.X = nullptr;
  expect_error(a, "X");
  a = p.args;
  a.W1 = static_cast<const char*>(p.args.W1) + 2;
  expect_error(a, "W1");
  a = p.args;
  a.hidden = 260;
  expect_error(a, "hidden");
  a = p.args;
  a.inter = 201;
  expect_error(a, "inter");
  a = p.args;
  a.k = 17;
  expect_error(a, "k:");
  a = p.args;
  a.activation = static_cast<MoeActivation>(7);
  expect_error(a, "activation");
  a = p.args;
  a.layout = static_cast<Fc1WeightLayout>(5);
  expect_error(a, "layout");
  a = p.args;
  a.x_stride = 100;  // < hidden
  expect_error(a, "x_stride");
  a = p.args;
  a.out = const_cast<void*>(p.args.X);  // overlaps an input
  expect_error(a, "out");
  CUDA_OK(cudaDeviceSynchronize());
  p.expect_out_untouched();
}
