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
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/mxfp4_testing.h"
#include "common/scoped_env.h"
#include "common/test_data.h"
#include "flashmix/fp8.h"
#include "flashmix/moe.h"
#include "moe/moe_forward_internal.h"

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
  bool hash = false;  // the router selects by token id (spec §8.7): V4's sqrt-softplus, a table of 50 rows
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
  std::vector<int32_t> table;  // hash: [50, k], some entries outside [0, E) and some token ids outside [0, 50)
  std::vector<int64_t> tok;
  DeviceBuffer dX, dlogits, dW1, db1, dW2, db2, dshared, dids, dscales, dout, dws, dtable, dtok;
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
    if (c.hash) {
      constexpr int64_t kVocab = 50;
      table.resize(size_t(kVocab * c.k));
      for (auto& e : table) e = int32_t(rng.integer(-1, c.E));  // -1 and E: absent slots
      tok.resize(size_t(c.T));
      for (auto& t : tok) t = rng.integer(-1, kVocab);  // -1 and kVocab: tokens with no expert
      args.router.scoring = MoeRouterScoring::kSqrtSoftplus;
      args.router.routed_scaling_factor = 1.5f;
      args.router.vocab_size = kVocab;
      args.router.token_ids_int64 = true;
      dtable = DeviceBuffer(table);
      dtok = DeviceBuffer(std::max<size_t>(8, tok.size() * 8));
      if (!tok.empty()) dtok.upload(tok.data(), tok.size() * 8);
    }
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
    if (c.hash) {
      args.router.hash_table = host ? table.data() : dtable.as<int32_t>();
      args.router.token_ids = host ? static_cast<const void*>(tok.data()) : dtok.get();
    }
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

// DeepSeek-V4's hash layers: the router takes each token's experts from
// the table row of its token id, on one rank and on an expert-parallel range.
TEST(MoeForwardGpu, HashRouterThenLayer) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kDeterministic}) {
    SCOPED_TRACE(fc2_mode_name(m));
    Case c;
    c.hash = true;
    c.mode = m;
    check_case(c);
    c.start = 4;
    c.local = 8;
    c.fill = m == Fc2Mode::kAtomic;
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

// k*T past the maps' one-block path: their count kernel zeroes `out` for
// FC2's atomic adds (with the router in front, before its dependency wait)
// and pulls X into L2 where FC1 gathers it (detail::RoutingSideWork). Every
// element of a poisoned `out`, twice in a row (the second call must zero it
// again), with and without the router, gathered and from the copy, on an EP
// rank (tokens without a local expert get 0), and without PDL.
TEST(MoeForwardGpu, MultiBlockMapsZeroOutForTheAtomicAdds) {
  SKIP_WITHOUT_HOPPER();
  for (bool router : {true, false})
    for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy})
      for (bool ep : {false, true})
        for (bool pdl : {true, false}) {
          if (!pdl && (ep || in != MoeFc1Input::kGather)) continue;
          SCOPED_TRACE(std::string(router ? "router " : "given ids ") +
                       (in == MoeFc1Input::kGather ? "gather" : "permuted copy") + (ep ? " EP rank" : "") +
                       (pdl ? "" : " no PDL"));
          Case c;
          c.T = 701;  // k*T = 2804 slots: the multi-block maps
          c.router = router;
          c.input = in;
          if (ep) {
            c.E = 48;
            c.start = 32;
          }
          Layer l(c);
          l.args.enable_pdl = pdl;
          for (int rep = 0; rep < 2; ++rep) {
            l.poison_out();
            Status st = l.run();
            ASSERT_TRUE(st.ok()) << st.message();
            CUDA_OK(cudaDeviceSynchronize());
            l.check();
          }
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

// ---------------------------------------------------------------------------
// FP8 weights (spec §10.4): W1 and W2 random bf16 quantised 128 x 128 with
// fp32 scales (spec §11.3, quantize_fp8_cpu); X bf16. Each stage is checked
// on what the GPU handed it (read back from the workspace, layout in
// moe_forward_internal.h), against the CPU references in double:
//  (a) X's e4m3 codes and scales (token order, or the permuted copy's first
//      P rows) bitwise equal to quantize_fp8_cpu;
//  (b) FC1's bf16 rows [0, P) vs moe_fc1_cpu on (a): FC1's FP8 tolerance
//      2^-7 |ref| + 2^-8 |.|max (spec §9.7);
//  (c) FC1's rows in e4m3 and their scales bitwise equal to quantize_fp8_cpu
//      of the GPU's own bf16 rows (b), first P rows;
//  (d) out vs moe_fc2_finalize_cpu on (c): FC2's FP8 tolerance, the mode's
//      term plus 2^-8 |.|max (spec §3.5).
// Then (e) end to end vs moe_forward_cpu, the CPU chain alone. The bf16 rows
// (b) may differ from the CPU chain's by one unit (fp32 vs double sums);
// quantising, such a unit moves a code by one e4m3 step (up to 2^-3 of the
// element) about once in 2^5, and that step reaches every column of the
// token's output through W2. Those steps are rare but not small, so (e)
// takes 2^-7 |ref| + (k + 2) 2^-8 |.|max + 2^-5 |.|max per element (room for
// a few such steps in one output; the tight checks are (a)-(d)). Since the
// steps are rare, the Frobenius norm of the error is also bounded by that of
// the single-GEMM tolerance, 2^-7 |ref| + (k + 2) 2^-8 |.|max element by
// element (as if every element used all of it; H100: 0.02-0.05 of it).
// ---------------------------------------------------------------------------
namespace {

struct Fp8Case {
  int64_t T = 200;
  int k = 4;
  int E = 16, start = 0, local = 16;
  int64_t H = 256, I = 256;
  bool router = true;
  bool shared = false;
  bool fill = true;
  Fc2Mode mode = Fc2Mode::kAtomic;
  MoeFc1Input input = MoeFc1Input::kAuto;
  bool mx = false;  // MXFP4 W1 and W2 (W4A8, spec §13.7) instead of FP8 block weights
};

std::string fp8_case_name(const Fp8Case& c) {
  return "T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " E=" + std::to_string(c.E) + " [" +
         std::to_string(c.start) + ", +" + std::to_string(c.local) + ") " + fc2_mode_name(c.mode) + " " +
         to_string(c.input) + (c.fill ? " fill" : " no fill") + (c.shared ? " shared" : "") + (c.mx ? " mxfp4" : "");
}

// Random bf16 weights [E, rows, cols] quantised 128 x 128 (fp32 scales) on the host.
void quantised_weights(Rng& rng, int64_t E, int64_t rows, int64_t cols, std::vector<uint8_t>& q,
                       std::vector<float>& s) {
  HostTensor w(DType::kBFloat16, E * rows * cols);
  w.fill_random(rng, -0.15f, 0.15f);
  q.assign(size_t(E * rows * cols), 0);
  s.assign(size_t(E * ((rows + 127) / 128) * (cols / 128)), 0.f);
  QuantizeFp8Args qa;
  qa.x = w.data();
  qa.q = q.data();
  qa.scales = s.data();
  qa.batch = E;
  qa.rows = rows;
  qa.cols = cols;
  qa.block = Fp8Block::k128x128;
  const Status st = quantize_fp8_cpu(qa);
  EXPECT_TRUE(st.ok()) << st.message();
}

// The bf16 weights the FP8 ones stand for: bf16(e4m3 value * its block's scale).
HostTensor dequantised(const std::vector<uint8_t>& q, const std::vector<float>& s, int64_t E, int64_t rows,
                       int64_t cols) {
  HostTensor w(DType::kBFloat16, E * rows * cols);
  const int64_t rb = (rows + 127) / 128, cb = cols / 128;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = (e * rows + r) * cols + c;
        w.set(i, double(host::e4m3_to_float(q[size_t(i)])) * s[size_t((e * rb + r / 128) * cb + c / 128)]);
      }
  return w;
}

bool within(double g, double r, double rtol, double atol) {
  return std::isnan(r) ? std::isnan(g) : std::fabs(g - r) <= rtol * std::fabs(r) + atol;
}

struct Fp8Layer {
  Fp8Case c;
  HostTensor X, logits, b1, b2, shared, ref;
  std::vector<uint8_t> W1q, W2q;
  std::vector<float> W1s, W2s, scales;
  Mxfp4Data mx1, mx2;  // mx: W1 and W2 packed with their ue8m0 scales
  std::vector<int32_t> ids;
  DeviceBuffer dX, dlogits, dW1, dW1s, dW2, dW2s, db1, db2, dshared, dids, dscales, dout, dws;
  MoeForwardArgs args;
  double max_ref = 0;

  explicit Fp8Layer(const Fp8Case& cs) : c(cs) {
    Rng rng(test_seed() ^ 0xf8f8ull);
    X = HostTensor(DType::kBFloat16, c.T * c.H);
    X.fill_random(rng);
    logits = HostTensor(DType::kBFloat16, c.T * c.E);
    std::vector<int> grid(size_t(c.E));
    for (int64_t t = 0; t < c.T; ++t) {  // distinct values on a 1/16 grid: no ties, exact in bf16
      for (int e = 0; e < c.E; ++e) grid[size_t(e)] = e - c.E / 2;
      std::shuffle(grid.begin(), grid.end(), rng.gen());
      for (int e = 0; e < c.E; ++e) logits.set(t * c.E + e, grid[size_t(e)] / 16.0);
    }
    if (c.mx) {
      Mxfp4Options o;
      o.base = 123;  // |W| up to 6 / 16
      mx1 = random_mxfp4(rng, c.local, 2 * c.I, c.H, o);
      mx2 = random_mxfp4(rng, c.local, c.H, c.I, o);
    } else {
      quantised_weights(rng, c.local, 2 * c.I, c.H, W1q, W1s);
      quantised_weights(rng, c.local, c.H, c.I, W2q, W2s);
    }
    b1 = HostTensor(DType::kBFloat16, int64_t(c.local) * 2 * c.I);
    b1.fill_random(rng, -0.2f, 0.2f);
    b2 = HostTensor(DType::kBFloat16, int64_t(c.local) * c.H);
    b2.fill_random(rng, -0.2f, 0.2f);
    shared = HostTensor(DType::kBFloat16, c.T * c.H);
    shared.fill_random(rng);
    const Routing r = random_routing(rng, c.T, c.k, c.E, c.start, c.local);
    ids = r.experts;
    scales.resize(size_t(c.T * c.k));
    for (auto& v : scales) v = rng.uniform(0.1f, 1.0f);
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
    args.fc1_input = c.input;
    args.fc2_mode = c.mode;
    args.fill = c.fill;
    args.fp8 = MoeFp8Scaling::kBlock;
    set_pointers(true);
    const Status st = moe_forward_cpu(args);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t i = 0; i < ref.count(); ++i)
      if (!std::isnan(ref.get(i))) max_ref = std::max(max_ref, std::fabs(ref.get(i)));

    dX = DeviceBuffer(X.bytes);
    dlogits = DeviceBuffer(logits.bytes);
    dW1 = c.mx ? DeviceBuffer(mx1.w) : DeviceBuffer(W1q);
    dW1s = c.mx ? DeviceBuffer(mx1.scales) : DeviceBuffer(W1s);
    dW2 = c.mx ? DeviceBuffer(mx2.w) : DeviceBuffer(W2q);
    dW2s = c.mx ? DeviceBuffer(mx2.scales) : DeviceBuffer(W2s);
    db1 = DeviceBuffer(b1.bytes);
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
    // Poisoned workspace: a stage that reads a row or scale nobody wrote sees NaN.
    std::vector<uint8_t> poison(dws.bytes(), 0xff);
    dws.upload(poison.data(), poison.size());
  }

  void set_pointers(bool host) {
    auto pick = [&](HostTensor& h, DeviceBuffer& d) -> void* { return host ? h.data() : d.get(); };
    args.X = pick(X, dX);
    args.router_logits = c.router ? pick(logits, dlogits) : nullptr;
    args.token_selected_experts = c.router ? nullptr : host ? ids.data() : dids.as<int32_t>();
    args.token_final_scales = c.router ? nullptr : host ? scales.data() : dscales.as<float>();
    if (c.mx) {
      args.weights = MoeWeightFormat::kMxfp4;
      args.W1 = host ? static_cast<const void*>(mx1.w.data()) : dW1.get();
      args.w1_mx_scales = host ? static_cast<const void*>(mx1.scales.data()) : dW1s.get();
      args.W2 = host ? static_cast<const void*>(mx2.w.data()) : dW2.get();
      args.w2_mx_scales = host ? static_cast<const void*>(mx2.scales.data()) : dW2s.get();
    } else {
      args.W1 = host ? static_cast<const void*>(W1q.data()) : dW1.get();
      args.w1_scales = host ? W1s.data() : dW1s.as<float>();
      args.W2 = host ? static_cast<const void*>(W2q.data()) : dW2.get();
      args.w2_scales = host ? W2s.data() : dW2s.as<float>();
    }
    args.b1 = pick(b1, db1);
    args.b2 = pick(b2, db2);
    args.shared_output = c.shared ? pick(shared, dshared) : nullptr;
    args.out = host ? ref.data() : dout.get();
  }

  void poison_out() {
    HostTensor p(DType::kBFloat16, ref.count());
    p.poison();
    dout.upload(p.data(), p.bytes.size());
  }

  Status run(cudaStream_t s = nullptr) { return moe_forward(args, dws.get(), dws.bytes(), s); }

  HostTensor result() const {
    HostTensor got(DType::kBFloat16, ref.count());
    dout.download(got.data(), got.bytes.size());
    return got;
  }

  // (e): end to end vs the CPU chain.
  void check_end_to_end() const {
    const HostTensor got = result();
    const double rtol = std::ldexp(1.0, -7), atol = ((c.k + 2) * std::ldexp(1.0, -8) + std::ldexp(1.0, -5)) * max_ref;
    const double tight = (c.k + 2) * std::ldexp(1.0, -8) * max_ref;
    int bad = 0;
    int64_t beyond_tight = 0;
    double num = 0, den = 0, tol2 = 0;
    for (int64_t i = 0; i < c.T * c.H; ++i) {
      const double g = got.get(i), r = ref.get(i);
      if (!within(g, r, rtol, atol) && bad++ < 5)
        ADD_FAILURE() << fp8_case_name(c) << " t=" << i / c.H << " n=" << i % c.H << " gpu=" << g << " ref=" << r;
      if (std::isnan(r)) continue;
      beyond_tight += !within(g, r, rtol, tight);
      num += (g - r) * (g - r);
      den += r * r;
      tol2 += (rtol * std::fabs(r) + tight) * (rtol * std::fabs(r) + tight);
    }
    const double rel = den > 0 ? std::sqrt(num / den) : 0;
    EXPECT_LE(std::sqrt(num), std::sqrt(tol2)) << fp8_case_name(c) << ": the error's Frobenius norm";
    std::printf("[ fp8 e2e  ] %s: rel. Frobenius error vs moe_forward_cpu %.3g (%.2f of the tolerance's), %lld "
                "of %lld elements past the single-GEMM tolerance\n",
                fp8_case_name(c).c_str(), rel, tol2 > 0 ? std::sqrt(num / tol2) : 0.0, (long long)beyond_tight,
                (long long)(c.T * c.H));
  }

  // (a)-(d): each stage on what the GPU handed it.
  void check_stages() const {
    const MoeForwardLayout l = moe_forward_layout(args);
    std::vector<uint8_t> ws(l.total);
    dws.download(ws.data(), ws.size());
    auto at = [&](size_t off) { return ws.data() + off; };
    const int64_t slots = c.T * c.k, kbH = c.H / 128, kbI = c.I / 128;
    std::vector<int64_t> offsets(size_t(c.local + 1));
    std::memcpy(offsets.data(), at(l.offsets), offsets.size() * 8);
    const int64_t P = offsets.back();
    ASSERT_GE(P, 0);
    ASSERT_LE(P, slots);
    std::vector<int32_t> p2u(static_cast<size_t>(slots));
    std::memcpy(p2u.data(), at(l.p2u), size_t(P) * 4);
    const bool copy = moe_forward_fc1_input(args) == MoeFc1Input::kPermutedCopy;

    // (a) X's codes and scales.
    const int64_t x_rows = copy ? P : c.T;
    HostTensor xin(DType::kBFloat16, std::max<int64_t>(1, x_rows) * c.H);
    for (int64_t r = 0; r < x_rows; ++r) {
      const int64_t t = copy ? p2u[size_t(r)] % c.T : r;
      std::memcpy(static_cast<uint8_t*>(xin.data()) + r * c.H * 2, static_cast<const uint8_t*>(X.data()) + t * c.H * 2,
                  size_t(c.H) * 2);
    }
    std::vector<uint8_t> xq(size_t(std::max<int64_t>(1, x_rows) * c.H));
    std::vector<float> xs(size_t(std::max<int64_t>(1, x_rows) * kbH));
    QuantizeFp8Args qa;
    qa.x = xin.data();
    qa.q = xq.data();
    qa.scales = xs.data();
    qa.rows = x_rows;
    qa.cols = c.H;
    ASSERT_TRUE(quantize_fp8_cpu(qa).ok());
    EXPECT_EQ(std::memcmp(xq.data(), at(l.x_q), size_t(x_rows * c.H)), 0) << fp8_case_name(c) << ": X's e4m3 codes";
    EXPECT_EQ(std::memcmp(xs.data(), at(l.x_scales), size_t(x_rows * kbH) * 4), 0) << fp8_case_name(c)
                                                                                   << ": X's scales";

    // (b) FC1 on the GPU's e4m3 X.
    HostTensor act_ref(DType::kBFloat16, std::max<int64_t>(1, slots) * c.I);
    act_ref.poison();
    MoeFc1Args f1;
    f1.X = at(l.x_q);
    f1.x_permuted = copy;
    f1.W1 = c.mx ? static_cast<const void*>(mx1.w.data()) : W1q.data();
    f1.bias = b1.data();
    f1.fp8 = MoeFp8Scaling::kBlock;
    f1.x_scales = reinterpret_cast<const float*>(at(l.x_scales));
    f1.w1_scales = c.mx ? nullptr : W1s.data();
    f1.weights = args.weights;
    f1.w1_mx_scales = c.mx ? mx1.scales.data() : nullptr;
    f1.expert_first_token_offset = offsets.data();
    f1.permuted_row_to_unpermuted_row = p2u.data();
    f1.num_tokens = c.T;
    f1.k = c.k;
    f1.hidden = c.H;
    f1.inter = c.I;
    f1.num_experts_per_node = c.local;
    f1.out = act_ref.data();
    Status st = moe_fc1_cpu(f1);
    ASSERT_TRUE(st.ok()) << st.message();
    HostTensor act(DType::kBFloat16, std::max<int64_t>(1, slots) * c.I);
    std::memcpy(act.data(), at(l.fc1_out), size_t(slots * c.I) * 2);
    double max_act = 0;
    for (int64_t i = 0; i < P * c.I; ++i) max_act = std::max(max_act, std::fabs(act_ref.get(i)));
    int bad = 0;
    for (int64_t i = 0; i < P * c.I; ++i)
      if (!within(act.get(i), act_ref.get(i), std::ldexp(1.0, -7), std::ldexp(1.0, -8) * max_act) && bad++ < 5)
        ADD_FAILURE() << fp8_case_name(c) << ": FC1 p=" << i / c.I << " i=" << i % c.I << " gpu=" << act.get(i)
                      << " ref=" << act_ref.get(i);

    // (c) FC1's rows in e4m3.
    std::vector<uint8_t> aq(size_t(std::max<int64_t>(1, P) * c.I));
    std::vector<float> as(size_t(std::max<int64_t>(1, P) * kbI));
    qa = QuantizeFp8Args{};
    qa.x = act.data();
    qa.q = aq.data();
    qa.scales = as.data();
    qa.rows = P;
    qa.cols = c.I;
    ASSERT_TRUE(quantize_fp8_cpu(qa).ok());
    EXPECT_EQ(std::memcmp(aq.data(), at(l.act_q), size_t(P * c.I)), 0) << fp8_case_name(c) << ": FC1 rows' codes";
    EXPECT_EQ(std::memcmp(as.data(), at(l.act_scales), size_t(P * kbI) * 4), 0) << fp8_case_name(c)
                                                                               << ": FC1 rows' scales";

    // (d) FC2 + finalize on the GPU's e4m3 rows.
    std::vector<float> w(scales);
    if (c.router) {
      w.assign(size_t(slots), 0.f);
      std::memcpy(w.data(), at(l.scales), size_t(slots) * 4);
    }
    HostTensor out_ref(DType::kBFloat16, ref.count());
    out_ref.poison();
    Fc2FinalizeArgs f2;
    f2.A = at(l.act_q);
    f2.W2 = c.mx ? static_cast<const void*>(mx2.w.data()) : W2q.data();
    f2.fp8 = MoeFp8Scaling::kBlock;
    f2.a_scales = reinterpret_cast<const float*>(at(l.act_scales));
    f2.w2_scales = c.mx ? nullptr : W2s.data();
    f2.weights = args.weights;
    f2.w2_mx_scales = c.mx ? mx2.scales.data() : nullptr;
    f2.expert_first_token_offset = offsets.data();
    f2.permuted_row_to_unpermuted_row = p2u.data();
    f2.scales = w.data();
    f2.bias = b2.data();
    f2.num_tokens = c.T;
    f2.k = c.k;
    f2.hidden = c.H;
    f2.inter = c.I;
    f2.num_experts_per_node = c.local;
    f2.out = out_ref.data();
    f2.mode = c.mode;
    f2.shared_output = c.shared ? shared.data() : nullptr;
    f2.fill = c.fill;
    st = moe_fc2_finalize_cpu(f2);
    ASSERT_TRUE(st.ok()) << st.message();
    double max_out = 0;
    for (int64_t i = 0; i < out_ref.count(); ++i)
      if (!std::isnan(out_ref.get(i))) max_out = std::max(max_out, std::fabs(out_ref.get(i)));
    double atol = std::ldexp(1.0, -10);
    if (c.mode == Fc2Mode::kUnfused) atol = std::ldexp(1.0, -8);
    if (c.mode == Fc2Mode::kAtomic) atol = c.k * std::ldexp(1.0, -8);
    atol = (atol + std::ldexp(1.0, -8)) * max_out;  // + the FP8 MMA
    const HostTensor got = result();
    bad = 0;
    for (int64_t i = 0; i < c.T * c.H; ++i)
      if (!within(got.get(i), out_ref.get(i), std::ldexp(1.0, -7), atol) && bad++ < 5)
        ADD_FAILURE() << fp8_case_name(c) << ": FC2 t=" << i / c.H << " n=" << i % c.H << " gpu=" << got.get(i)
                      << " ref=" << out_ref.get(i);
  }
};

void check_fp8_case(const Fp8Case& c) {
  SCOPED_TRACE(fp8_case_name(c));
  Fp8Layer l(c);
  const Status st = l.run();
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  l.check_stages();
  l.check_end_to_end();
}

}  // namespace

TEST(MoeForwardGpu, Fp8StagesAndEndToEndBothInputs) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy})
    for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kDeterministic}) {
      Fp8Case c;
      c.input = in;
      c.mode = m;
      check_fp8_case(c);
      c.E = 48;  // an expert-parallel rank: P well below k*T
      c.start = 16;
      check_fp8_case(c);
    }
}

// Where FC1 takes wide tiles (pinned here: FLASHMIX_FC1_WIDE=1; the rule
// takes them once T k >= 256 E_local) the layer lets FC1 write the e4m3
// rows and scales itself instead of bf16 rows and a quantize_fp8 pass: the
// same bytes. Each case runs both ways on one poisoned workspace
// (FLASHMIX_LAYER_FC1_FP8_OUT=0 first, every stage checked), then fused:
// FC1's codes and scales of the first P rows and the layer's output
// (deterministic FC2) bitwise equal, and end to end against the reference.
TEST(MoeForwardGpu, Fp8Fc1WritesE4m3ItselfOnWideTiles) {
  SKIP_WITHOUT_HOPPER();
  const ScopedEnv wide("FLASHMIX_FC1_WIDE", "1");
  for (bool mx : {false, true})  // MXFP4 W1: the wide W4A8 tiles (a permuted X) write it too
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy})
    for (int ep = 0; ep < 2; ++ep) {
      Fp8Case c;
      c.mx = mx;
      c.input = in;
      c.mode = Fc2Mode::kDeterministic;
      c.I = 384;  // three 128-column scale blocks
      if (ep) {
        c.E = 48;  // an expert-parallel rank: P well below k*T
        c.start = 16;
      }
      SCOPED_TRACE(fp8_case_name(c));
      Fp8Layer l(c);
      const MoeForwardLayout lay = moe_forward_layout(l.args);
      std::vector<uint8_t> ws[2];
      HostTensor out[2];
      for (int fused = 0; fused < 2; ++fused) {
        const ScopedEnv fc1_out("FLASHMIX_LAYER_FC1_FP8_OUT", fused ? "1" : "0");
        std::vector<uint8_t> poison(l.dws.bytes(), 0xff);
        l.dws.upload(poison.data(), poison.size());
        l.poison_out();
        const Status st = l.run();
        ASSERT_TRUE(st.ok()) << st.message();
        CUDA_OK(cudaDeviceSynchronize());
        if (!fused) l.check_stages();
        l.check_end_to_end();
        ws[fused].resize(lay.total);
        l.dws.download(ws[fused].data(), lay.total);
        out[fused] = l.result();
      }
      int64_t P = 0;
      std::memcpy(&P, ws[0].data() + lay.offsets + size_t(c.local) * 8, 8);
      EXPECT_EQ(std::memcmp(ws[0].data() + lay.act_q, ws[1].data() + lay.act_q, size_t(P * c.I)), 0)
          << "FC1's e4m3 rows";
      EXPECT_EQ(std::memcmp(ws[0].data() + lay.act_scales, ws[1].data() + lay.act_scales, size_t(P * c.I / 128) * 4),
                0)
          << "FC1's scales";
      EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].bytes.size()), 0) << "the layer's output";
    }
}

// MXFP4 weights on the FP8 layer's pipeline (W4A8, spec §13.7): each stage
// against its reference on what the GPU handed it, and end to end; both FC1
// inputs, an expert-parallel rank, every mode with and without fill.
TEST(MoeForwardGpu, Mxfp4StagesAndEndToEnd) {
  SKIP_WITHOUT_HOPPER();
  // FC1's bf16 rows and the quantize_fp8 pass, so that every stage can be
  // checked (the wide W4A8 tiles' own FP8 output: Fp8Fc1WritesE4m3ItselfOnWideTiles).
  const ScopedEnv fc1_rows("FLASHMIX_LAYER_FC1_FP8_OUT", "0");
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy})
    for (Fc2Mode m : kModes) {
      Fp8Case c;
      c.mx = true;
      c.input = in;
      c.mode = m;
      check_fp8_case(c);
      c.E = 48;
      c.start = 16;
      c.fill = false;
      c.shared = true;
      check_fp8_case(c);
    }
  Fp8Case one;
  one.mx = true;
  one.T = 1;
  check_fp8_case(one);
}

TEST(MoeForwardGpu, Fp8EveryModeNoFillSharedGivenIds) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : kModes)
    for (bool fill : {true, false}) {
      Fp8Case c;
      c.T = 96;
      c.E = 64;
      c.start = 16;
      c.k = 2;  // many tokens with no local expert
      c.router = false;
      c.shared = true;
      c.fill = fill;
      c.mode = m;
      c.H = 384;
      c.I = 128;
      check_fp8_case(c);
    }
}

TEST(MoeForwardGpu, Fp8OneTokenAndZeroTokens) {
  SKIP_WITHOUT_HOPPER();
  Fp8Case c;
  c.T = 1;
  check_fp8_case(c);
  c.T = 0;
  Fp8Layer l(c);
  EXPECT_TRUE(l.run().ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(MoeForwardGpu, Fp8DecodeGraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy}) {
    Fp8Case c;
    c.T = 8;
    c.k = 8;
    c.E = 32;
    c.local = 32;
    c.shared = true;
    c.input = in;
    SCOPED_TRACE(fp8_case_name(c));
    Fp8Layer l(c);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ASSERT_TRUE(l.run(s).ok());  // attributes set outside the capture
    CUDA_OK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const Status st = l.run(s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    ASSERT_TRUE(st.ok()) << st.message();
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      l.poison_out();
      CUDA_OK(cudaGraphLaunch(exec, s));
      CUDA_OK(cudaStreamSynchronize(s));
      l.check_stages();
      l.check_end_to_end();
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// The FP8 layer against the bf16 layer on the same weights (the bf16 one
// gets bf16(e4m3 * scale)): what quantising X and FC1's output costs. The
// relative Frobenius error is printed (issue 25 asks for it) and bounded by
// 2^-3: each e4m3 rounding is about 2.4% rms of an element, and X's (through
// both FC1 products and SwiGLU) and the activations' add up to about 4%; a
// wrong scale or row would give errors of order 1.
TEST(MoeForwardGpu, Fp8AgainstBf16LayerOnTheSameWeights) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFc1Input in : {MoeFc1Input::kGather, MoeFc1Input::kPermutedCopy}) {
    Fp8Case c;
    c.T = 256;
    c.k = 8;
    c.E = 32;
    c.local = 32;
    c.H = 512;
    c.I = 256;
    c.input = in;
    SCOPED_TRACE(fp8_case_name(c));
    Fp8Layer l(c);
    ASSERT_TRUE(l.run().ok());
    const HostTensor w1 = dequantised(l.W1q, l.W1s, c.local, 2 * c.I, c.H);
    const HostTensor w2 = dequantised(l.W2q, l.W2s, c.local, c.H, c.I);
    DeviceBuffer dw1(w1.bytes), dw2(w2.bytes), dout16(l.ref.bytes.size());
    MoeForwardArgs a = l.args;
    a.fp8 = MoeFp8Scaling::kNone;
    a.w1_scales = a.w2_scales = nullptr;
    a.W1 = dw1.get();
    a.W2 = dw2.get();
    a.out = dout16.get();
    DeviceBuffer ws16(std::max<size_t>(256, moe_forward_workspace_size(a)));
    const Status st = moe_forward(a, ws16.get(), ws16.bytes(), nullptr);
    ASSERT_TRUE(st.ok()) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    const HostTensor o8 = l.result();
    HostTensor o16(DType::kBFloat16, l.ref.count());
    dout16.download(o16.data(), o16.bytes.size());
    double num = 0, den = 0, max_abs = 0, max16 = 0;
    for (int64_t i = 0; i < c.T * c.H; ++i) {
      const double d = o8.get(i) - o16.get(i);
      ASSERT_FALSE(std::isnan(d)) << "i=" << i;
      num += d * d;
      den += o16.get(i) * o16.get(i);
      max_abs = std::max(max_abs, std::fabs(d));
      max16 = std::max(max16, std::fabs(o16.get(i)));
    }
    const double rel = std::sqrt(num / den);
    std::printf("[ fp8/bf16 ] %s: FP8 layer vs bf16 layer on the same weights: rel. Frobenius error %.4f, "
                "max |diff| / max |bf16| %.4f\n",
                fp8_case_name(c).c_str(), rel, max_abs / max16);
    ::testing::Test::RecordProperty("fp8_vs_bf16_rel_error", std::to_string(rel));
    EXPECT_LE(rel, std::ldexp(1.0, -3));
    EXPECT_GT(rel, 0.0);  // the layers differ: the FP8 one really quantised
  }
}

TEST(MoeForwardGpu, Fp8BadInputNamesTheArgumentAndLaunchesNothing) {
  SKIP_WITHOUT_HOPPER();
  Fp8Case c;
  Fp8Layer l(c);
  auto expect_error = [&](const MoeForwardArgs& a, const char* what) {
    const Status st = moe_forward(a, l.dws.get(), l.dws.bytes(), nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  MoeForwardArgs a = l.args;
  a.w1_scales = nullptr;
  expect_error(a, "w1_scales");
  a = l.args;
  a.w2_scales = nullptr;
  expect_error(a, "w2_scales");
  a = l.args;
  a.fp8 = MoeFp8Scaling::kTensor;
  expect_error(a, "fp8");
  a = l.args;
  a.w1_scales = l.dout.as<float>();  // w1_scales inside out
  expect_error(a, "w1_scales");
  const Status st = moe_forward(l.args, l.dws.get(), moe_forward_workspace_size(l.args) - 256, nullptr);
  EXPECT_NE(st.message().find("workspace_bytes"), std::string::npos) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  const HostTensor got = l.result();
  for (int64_t i = 0; i < got.count(); ++i)
    if (!std::isnan(got.get(i))) {
      ADD_FAILURE() << "out written at " << i;
      break;
    }
}
