// moe_forward on the GPU (sm_90a) against moe_forward_cpu (spec §10): the
// whole layer on random inputs, with the router or with given ids and
// weights, every FC2 mode, an expert-parallel range, fill and no fill, a
// shared output, both W1 layouts, graph capture.
//
// Tolerance (ref: the stages' CPU references chained, each in double and
// rounded once; |.|max = largest |ref|): the FC1 rows are rounded to bf16 on
// both sides and may differ by one unit (2^-8 relative), which FC2 carries
// into every output; plus the FC2 mode's own error (bf16 adds: k units):
//   |gpu - ref| <= 2^-7 |ref| + (k + 2) 2^-8 |.|max
// The router's logits sit on a grid of 1/16 (exact in bf16, no near-ties),
// so both sides choose the same experts.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

#define SKIP_WITHOUT_HOPPER() SKIP_WITHOUT_HOPPER_FOR("moe_forward")

struct Case {
  int64_t T = 96;
  int k = 4;
  int E = 16, start = 0, local = 16;
  int64_t H = 136, I = 72;
  bool router = true;
  bool shared = false;
  bool fill = true;
  bool biases = true;
  Fc2Mode mode = Fc2Mode::kAtomic;
  Fc1WeightLayout layout = Fc1WeightLayout::kGateUp;
  MoeFc1Input input = MoeFc1Input::kAuto;
};

struct Layer {
  Case c;
  HostTensor X, logits, W1, b1, W2, b2, shared, ref;
  std::vector<int32_t> ids;
  std::vector<float> scales;
  DeviceBuffer dX, dlogits, dW1, db1, dW2, db2, dshared, dids, dscales, dout, dws;
  MoeForwardArgs args;
  double max_ref = 0;

  explicit Layer(const Case& cs) : c(cs) {
    Rng rng(test_seed() ^ 0xf0ba11ull);
    X = HostTensor(DType::kBFloat16, c.T * c.H);
    X.fill_random(rng);
    logits = HostTensor(DType::kBFloat16, c.T * c.E);
    std::vector<int> grid(size_t(c.E));
    for (int64_t t = 0; t < c.T; ++t) {  // distinct values on a 1/16 grid: no ties, exact in bf16
      for (int e = 0; e < c.E; ++e) grid[size_t(e)] = e - c.E / 2;
      std::shuffle(grid.begin(), grid.end(), rng.gen());
      for (int e = 0; e < c.E; ++e) logits.set(t * c.E + e, grid[size_t(e)] / 16.0);
    }
    W1 = HostTensor(DType::kBFloat16, int64_t(c.local) * 2 * c.I * c.H);
    W1.fill_random(rng, -0.15f, 0.15f);
    b1 = HostTensor(DType::kBFloat16, int64_t(c.local) * 2 * c.I);
    b1.fill_random(rng, -0.2f, 0.2f);
    W2 = HostTensor(DType::kBFloat16, int64_t(c.local) * c.H * c.I);
    W2.fill_random(rng, -0.15f, 0.15f);
    b2 = HostTensor(DType::kBFloat16, int64_t(c.local) * c.H);
    b2.fill_random(rng, -0.2f, 0.2f);
    shared = HostTensor(DType::kBFloat16, c.T * c.H);
    shared.fill_random(rng);
    const Routing r = random_routing(rng, c.T, c.k, c.E, c.start, c.local);
    ids = r.experts;
    scales.resize(size_t(c.T * c.k));
    for (auto& s : scales) s = rng.uniform(0.1f, 1.0f);
    ref = HostTensor(DType::kBFloat16, std::max<int64_t>(1, c.T) * c.H);
    ref.poison();

    args.num_tokens = c.T;
    args.hidden = c.H;
    args.inter = c.I;
    args.k = c.k;
    args.num_experts = c.E;
    args.start_expert_id = c.start;
    args.num_experts_per_node = c.local;
    args.router.scoring = MoeRouterScoring::kSoftmax;
    args.router.renormalize = true;
    args.router.logits_dtype = DType::kBFloat16;
    args.w1_layout = c.layout;
    args.fc1_input = c.input;
    args.fc2_mode = c.mode;
    args.fill = c.fill;
    set_pointers(true);
    Status st = moe_forward_cpu(args);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t i = 0; i < ref.count(); ++i)
      if (!std::isnan(ref.get(i))) max_ref = std::max(max_ref, std::fabs(ref.get(i)));

    dX = DeviceBuffer(X.bytes);
    dlogits = DeviceBuffer(logits.bytes);
    dW1 = DeviceBuffer(W1.bytes);
    db1 = DeviceBuffer(b1.bytes);
    dW2 = DeviceBuffer(W2.bytes);
    db2 = DeviceBuffer(b2.bytes);
    dshared = DeviceBuffer(shared.bytes);
    dids = DeviceBuffer(std::max<size_t>(4, ids.size() * 4));
    if (!ids.empty()) dids.upload(ids.data(), ids.size() * 4);
    dscales = DeviceBuffer(std::max<size_t>(4, scales.size() * 4));
    if (!scales.empty()) dscales.upload(scales.data(), scales.size() * 4);
    dout = DeviceBuffer(ref.bytes.size());
    poison_out();
    set_pointers(false);
    dws = DeviceBuffer(std::max<size_t>(256, moe_forward_workspace_size(args)));
  }

  void set_pointers(bool host) {
    auto pick = [&](HostTensor& h, DeviceBuffer& d) -> void* { return host ? h.data() : d.get(); };
    args.X = pick(X, dX);
    args.router_logits = c.router ? pick(logits, dlogits) : nullptr;
    args.token_selected_experts = c.router ? nullptr : host ? ids.data() : dids.as<int32_t>();
    args.token_final_scales = c.router ? nullptr : host ? scales.data() : dscales.as<float>();
    args.W1 = pick(W1, dW1);
    args.b1 = c.biases ? pick(b1, db1) : nullptr;
    args.W2 = pick(W2, dW2);
    args.b2 = c.biases ? pick(b2, db2) : nullptr;
    args.shared_output = c.shared ? pick(shared, dshared) : nullptr;
    args.out = host ? ref.data() : dout.get();
  }

  void poison_out() {
    HostTensor p(DType::kBFloat16, ref.count());
    p.poison();
    dout.upload(p.data(), p.bytes.size());
  }

  Status run(cudaStream_t s = nullptr) { return moe_forward(args, dws.get(), dws.bytes(), s); }

  void check() const {
    HostTensor got(DType::kBFloat16, ref.count());
    dout.download(got.data(), got.bytes.size());
    const double rtol = std::ldexp(1.0, -7), atol = (c.k + 2) * std::ldexp(1.0, -8) * max_ref;
    int bad = 0;
    for (int64_t i = 0; i < c.T * c.H; ++i) {
      const double g = got.get(i), r = ref.get(i);
      const bool ok = std::isnan(r) ? std::isnan(g) : std::fabs(g - r) <= rtol * std::fabs(r) + atol;
      if (!ok && bad++ < 5)
        ADD_FAILURE() << fc2_mode_name(c.mode) << " t=" << i / c.H << " n=" << i % c.H << " gpu=" << g
                      << " ref=" << r;
    }
  }
};

void check_case(const Case& c) {
  Layer l(c);
  Status st = l.run();
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  l.check();
}

const Fc2Mode kModes[] = {Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic, Fc2Mode::kUnfused};

}  // namespace

TEST(MoeForwardGpu, RouterThenLayerEveryMode) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : kModes) {
    SCOPED_TRACE(fc2_mode_name(m));
    Case c;
    c.mode = m;
    check_case(c);
  }
}

TEST(MoeForwardGpu, Fc1GathersOrReadsAPermutedCopy) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy})
    for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kDeterministic}) {
      SCOPED_TRACE(std::string(in == MoeFc1Input::kGather ? "gather " : "permuted copy ") + fc2_mode_name(m));
      Case c;
      c.T = 200;
      c.input = in;
      c.mode = m;
      check_case(c);
      c.E = 48;  // an expert-parallel rank
      c.start = 32;
      check_case(c);
    }
}

TEST(MoeForwardGpu, GivenIdsAndWeightsInterleavedW1) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.router = false;
  c.layout = Fc1WeightLayout::kInterleaved;
  check_case(c);
}

TEST(MoeForwardGpu, ExpertParallelRangeFillNoFillShared) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : kModes)
    for (bool fill : {true, false})
      for (bool shared : {false, true}) {
        SCOPED_TRACE(std::string(fc2_mode_name(m)) + (fill ? " fill" : " no fill") + (shared ? " shared" : ""));
        Case c;
        c.E = 64;
        c.start = 16;
        c.local = 16;
        c.k = 2;  // many tokens with no local expert
        c.mode = m;
        c.fill = fill;
        c.shared = shared;
        check_case(c);
      }
}

TEST(MoeForwardGpu, OneTokenAndNoBiases) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 1;
  c.biases = false;
  check_case(c);
}

TEST(MoeForwardGpu, ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 0;
  Layer l(c);
  EXPECT_TRUE(l.run().ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(MoeForwardGpu, DecodeGraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 8;
  c.k = 8;
  c.E = 32;
  c.local = 32;
  c.shared = true;
  Layer l(c);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ASSERT_TRUE(l.run(s).ok());  // attributes set outside the capture
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  Status st = l.run(s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  ASSERT_TRUE(st.ok()) << st.message();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    l.poison_out();
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    l.check();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(MoeForwardGpu, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  Layer l(c);
  auto expect_error = [&](const MoeForwardArgs& a, const char* what) {
    Status st = moe_forward(a, l.dws.get(), l.dws.bytes(), nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  MoeForwardArgs a = l.args;
  a.W1 = nullptr;
  expect_error(a, "W1");
  a = l.args;
  a.inter = 70;
  expect_error(a, "inter");
  a = l.args;
  a.k = 17;
  expect_error(a, "k:");
  a = l.args;
  a.token_selected_experts = l.dids.as<int32_t>();  // both routing sources
  expect_error(a, "router_logits");
  a = l.args;
  a.router.n_group = 3;  // does not divide E
  expect_error(a, "n_group");
  a = l.args;
  a.num_experts_per_node = 17;  // past the router's E
  expect_error(a, "num_experts_per_node");
  Status st = moe_forward(l.args, l.dws.get(), 16, nullptr);
  EXPECT_NE(st.message().find("workspace_bytes"), std::string::npos) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  HostTensor got(DType::kBFloat16, l.ref.count());
  l.dout.download(got.data(), got.bytes.size());
  for (int64_t i = 0; i < got.count(); ++i)
    if (!std::isnan(got.get(i))) {
      ADD_FAILURE() << "out written at " << i;
      break;
    }
}
