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
// FP8 (spec §9.7): the reference takes the dequantised e4m3 values in
// double; the GPU's FP8 MMA keeps fewer bits than fp32 inside each K block
// of 128 (all of K with per-tensor scales) before the fp32 promotion:
//   |gpu - ref| <= 2^-7 |ref| + 2^-8 |.|max
// X and W1 come from random floats with outlier channels (every 61st channel
// 100 x larger; not in the clamped-activation case, whose outputs hide the
// pre-activation size the error follows), quantised as spec §11.3 says.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/mxfp4_testing.h"
#include "common/scoped_env.h"
#include "common/test_data.h"
#include "flashmix/fp8.h"
#include "flashmix/moe.h"
#include "flashmix/mxfp4.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

#define SKIP_WITHOUT_HOPPER() SKIP_WITHOUT_HOPPER_FOR("moe_fc1")

// Pins the block-scaled FP8 tile (FLASHMIX_FC1_WIDE, read on every call):
// wide (256 W1 rows a stage) or narrow, whatever the rows an expert.
struct ScopedFc1Wide {
  explicit ScopedFc1Wide(bool wide) : env("FLASHMIX_FC1_WIDE", wide ? "1" : "0") {}
  const ScopedEnv env;
};

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
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
  bool outliers = true;  // FP8: every 61st channel of X and W1 100 x larger
  // MXFP4 W1 (spec §13.7): W4A8 with fp8 = kBlock, W4A16 with kNone.
  bool mx = false;
  Mxfp4Options mxo;
  enum Routing { kRandom, kFirstHalfOnly, kAllToOne } routing = kRandom;
};

struct Problem {
  Case c;
  Routing routing;
  HostTensor X, W1, bias, ref;
  std::vector<uint8_t> xq, wq;  // FP8: the e4m3 codes of X ([X rows, x_stride]) and W1
  std::vector<float> xs, ws;    // FP8: their scales
  Mxfp4Data mxw;                // MXFP4: W1 packed [E, 2I, H / 2] and its scales
  DeviceBuffer dX, dW1, dbias, dp2u, doff, dout, dxs, dws;
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
    const bool fp8 = c.fp8 != MoeFp8Scaling::kNone;
    if (fp8) {
      const int64_t blk = c.fp8 == MoeFp8Scaling::kBlock ? 1 : 0;
      // X: rows of x_stride codes (the padding quantised too, never read).
      quantize_e4m3(random_with_outliers(rng, x_rows, x_stride(), 1.f, c.outliers), x_rows, x_stride(), blk, xq, xs);
      if (blk && c.x_pad) {  // scales [rows, H / 128]: drop the padding's block columns
        const int64_t kbs = c.H / 128, all = x_stride() / 128;
        std::vector<float> dense(size_t(x_rows * kbs));
        for (int64_t r = 0; r < x_rows; ++r)
          for (int64_t b = 0; b < kbs; ++b) dense[r * kbs + b] = xs[r * all + b];
        xs = dense;
      }
    }
    if (c.mx) {
      mxw = random_mxfp4(rng, c.local, 2 * c.I, c.H, c.mxo);
    } else if (fp8) {
      const int64_t blk = c.fp8 == MoeFp8Scaling::kBlock ? 1 : 0;
      // W1: one expert at a time (blocks of 128 x 128 never cross experts).
      const int64_t per = 2 * c.I * c.H;
      const std::vector<float> w = random_with_outliers(rng, int64_t(c.local) * 2 * c.I, c.H, c.w_scale, c.outliers);
      for (int e = 0; e < c.local; ++e) {
        std::vector<float> we(w.begin() + e * per, w.begin() + (e + 1) * per);
        std::vector<uint8_t> qe;
        std::vector<float> se;
        quantize_e4m3(we, 2 * c.I, c.H, blk ? 128 : 0, qe, se);
        wq.insert(wq.end(), qe.begin(), qe.end());
        ws.insert(ws.end(), se.begin(), se.end());
      }
    }

    args.X = fp8 ? static_cast<const void*>(xq.data()) : X.data();
    args.x_stride = c.x_pad ? x_stride() : 0;
    args.x_permuted = c.x_permuted;
    args.W1 = c.mx ? static_cast<const void*>(mxw.w.data()) : fp8 ? static_cast<const void*>(wq.data()) : W1.data();
    args.fp8 = c.fp8;
    args.x_scales = fp8 ? xs.data() : nullptr;
    args.w1_scales = fp8 && !c.mx ? ws.data() : nullptr;
    args.weights = c.mx ? MoeWeightFormat::kMxfp4 : MoeWeightFormat::kDense;
    args.w1_mx_scales = c.mx ? mxw.scales.data() : nullptr;
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

    dX = fp8 ? DeviceBuffer(xq) : DeviceBuffer(X.bytes);
    dW1 = c.mx ? DeviceBuffer(mxw.w) : fp8 ? DeviceBuffer(wq) : DeviceBuffer(W1.bytes);
    if (fp8) {
      dxs = DeviceBuffer(xs);
      args.x_scales = dxs.as<float>();
    }
    if (c.mx) {
      dws = DeviceBuffer(mxw.scales);
      args.w1_mx_scales = dws.get();
    } else if (fp8) {
      dws = DeviceBuffer(ws);
      args.w1_scales = dws.as<float>();
    }
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
    const double rtol = std::ldexp(1.0, -7);
    const double atol = std::ldexp(1.0, c.fp8 != MoeFp8Scaling::kNone ? -8 : -10) * max_ref;
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
          ADD_FAILURE() << to_string(c.act) << "/" << to_string(c.layout) << "/" << to_string(c.fp8) << " p=" << p << " i=" << i
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

// Wide tiles' routings: half the experts empty and the rest large; a
// middle rank of 6 with ~50 rows an expert (T k >= 256 E_local, so the FP8
// rule takes wide tiles, and warpgroup 1 idles on most chunks); one token.
void check_skewed_routings(MoeFp8Scaling fp8) {
  Case c;
  c.fp8 = fp8;
  c.T = 600;
  c.k = 4;
  c.total = c.local = 8;
  c.routing = Case::kFirstHalfOnly;  // experts 0-3 take 600 rows each, 4-7 none
  c.H = 256;
  check_case(c);
  c.routing = Case::kRandom;
  c.total = 48;
  c.start = 16;
  c.local = 8;
  check_case(c);
  c.T = 1;
  c.total = c.local = 8;
  c.start = 0;
  check_case(c);
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

// A permuted X (TMA boxes of 64 and 16 rows) over slice counts of 1, 3, 4
// and 6 (I not a multiple of 64), in 128-row tiles (~112 rows an expert) and
// 256-row tiles (experts past 128 rows on average), and an EP range.
TEST(MoeFc1Gpu, PermutedInputSlicesAndTileSizes) {
  SKIP_WITHOUT_HOPPER();
  for (int64_t I : {8, 136, 200, 328}) {
    SCOPED_TRACE("I = " + std::to_string(I));
    Case c;
    c.x_permuted = true;
    c.I = I;
    c.T = 300;
    c.k = 3;
    c.total = c.local = 8;
    check_case(c);
    c.T = 700;  // ~260 rows an expert: 256-row tiles (one up to 256 rows, or two chunks of ~136)
    check_case(c);
  }
  Case c;
  c.x_permuted = true;
  c.total = 48;
  c.start = 16;
  c.local = 16;
  c.I = 72;
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

namespace {

// The weight formats the repeat and graph tests run: bf16, and MXFP4 W1
// (W4A8 and W4A16, spec §13.7; K a multiple of 128).
std::vector<Case> weight_format_cases(int64_t T) {
  std::vector<Case> cases(3);
  for (Case& c : cases) c.T = T;
  cases[1].mx = cases[2].mx = true;
  cases[1].fp8 = MoeFp8Scaling::kBlock;
  cases[1].H = cases[2].H = 256;
  return cases;
}
const char* weight_format_name(const Case& c) {
  return !c.mx ? "bf16" : c.fp8 == MoeFp8Scaling::kBlock ? "mxfp4 w4a8" : "mxfp4 w4a16";
}

}  // namespace

TEST(MoeFc1Gpu, RepeatedRunsAreBitwiseIdentical) {
  SKIP_WITHOUT_HOPPER();
  for (const Case& c : weight_format_cases(300)) {
    SCOPED_TRACE(weight_format_name(c));
    Problem p(c);
    ASSERT_TRUE(p.run().ok());
    const HostTensor first = p.result();
    p.poison_out();
    ASSERT_TRUE(p.run().ok());
    const HostTensor second = p.result();
    EXPECT_EQ(first.bytes, second.bytes);
    p.check(second);
  }
}

// Each replay is checked, and is bitwise the direct run's result.
TEST(MoeFc1Gpu, GraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  for (const Case& c : weight_format_cases(128)) {
    SCOPED_TRACE(weight_format_name(c));
    Problem p(c);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ASSERT_TRUE(p.run(s).ok());  // attributes set outside the capture
    CUDA_OK(cudaStreamSynchronize(s));
    const HostTensor direct = p.result();
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
      const HostTensor got = p.result();
      p.check(got);
      EXPECT_EQ(got.bytes, direct.bytes);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// FP8 (spec §9.7): block and per-tensor scales, both layouts, gathered and
// permuted X, bias, a K of three scale blocks, 2I = 400 rows (the last W1
// row block partial; with gate_up, up rows start mid-block).
TEST(MoeFc1Gpu, Fp8EveryScalingLayoutAndInput) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kTensor})
    for (Fc1WeightLayout l : kLayouts)
      for (bool permuted : {false, true}) {
        SCOPED_TRACE(std::string(to_string(f)) + "/" + to_string(l) + (permuted ? "/permuted" : "/gather"));
        Case c;
        c.fp8 = f;
        c.H = 384;
        c.layout = l;
        c.x_permuted = permuted;
        c.bias = !permuted;
        check_case(c);
      }
}

TEST(MoeFc1Gpu, Fp8ActivationsStridesAndOddShapes) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kTensor}) {
    SCOPED_TRACE(to_string(f));
    Case c;
    c.fp8 = f;
    c.H = 256;
    c.act = MoeActivation::kSwiGLUOai;
    // No outliers here: the clamps cut g and u to a few units while the FP8
    // MMA's error follows the products' size (hundreds with outliers), which
    // the tolerance (relative to the outputs) does not see.
    c.outliers = false;
    c.w_scale = 0.5f;  // |g|, |u| up to ~10: the clamps fire
    c.x_pad = 128;     // x_stride = H + 128
    check_case(c);
    c = Case{};
    c.fp8 = f;
    c.H = 128;
    c.T = 1;  // one token, every expert of 8
    c.k = 8;
    c.total = c.local = 8;
    c.I = 64;
    check_case(c);
    // 700 rows an expert: chunks of 128 rows; T k > 512 E: the 256-row ring
    // for kTensor; block scales through both the narrow and the wide tiles.
    for (bool wide : {false, true}) {
      if (wide && f != MoeFp8Scaling::kBlock) continue;
      const ScopedFc1Wide pin(wide);
      SCOPED_TRACE(wide ? "wide tiles" : "narrow tiles");
      c = Case{};
      c.fp8 = f;
      c.H = 512;
      c.T = 700;
      c.k = 2;
      c.total = c.local = 2;
      check_case(c);
    }
    c = Case{};
    c.fp8 = f;
    c.H = 256;
    c.total = 48;  // an expert-parallel rank with empty experts
    c.start = 16;
    c.local = 16;
    c.routing = Case::kFirstHalfOnly;
    check_case(c);
  }
}

// Block scales with experts averaging 256 rows or more (T k >= 256 E_local):
// the wide tiles (256 W1 rows a stage, two slices through one partial; spec
// §9.7). Both layouts, gathered and permuted X, I = 200 (the last tile's
// second slice partly past I), 136 (wholly past I: its scale rows clamped,
// its W1 rows zeros) and 256, an expert-parallel rank with empty experts,
// and experts of under 64 rows (the second consumer warpgroup idle).
TEST(MoeFc1Gpu, Fp8BlockWideTiles) {
  SKIP_WITHOUT_HOPPER();
  const ScopedFc1Wide pin(true);  // as the rule picks here, pinned against a stray FLASHMIX_FC1_WIDE=0
  for (Fc1WeightLayout l : kLayouts)
    for (bool permuted : {false, true})
      for (int64_t I : {200, 136, 256}) {
        SCOPED_TRACE(std::string(to_string(l)) + (permuted ? "/permuted" : "/gather") + " I=" + std::to_string(I));
        Case c;
        c.fp8 = MoeFp8Scaling::kBlock;
        c.T = 600;
        c.k = 4;
        c.total = c.local = 8;  // 300 rows an expert on average: chunks of ~100 rows (t.n 112)
        c.H = 384;
        c.I = I;
        c.layout = l;
        c.x_permuted = permuted;
        c.bias = I != 256;
        check_case(c);
      }
  check_skewed_routings(MoeFp8Scaling::kBlock);
}

// Wide bf16 tiles (token rows as M, 256 W1 rows a stage; the rule takes
// them when gathering): both layouts, gathered and permuted X, every
// activation, I with the last tile's second slice partly or wholly past I,
// H off the 64-deep stage, strided X, chunks under 64 rows (warpgroup 1
// idles), empty experts, an EP rank and one token; each against the CPU
// reference.
TEST(MoeFc1Gpu, Bf16WideTiles) {
  SKIP_WITHOUT_HOPPER();
  const ScopedFc1Wide pin(true);
  for (Fc1WeightLayout l : kLayouts)
    for (bool permuted : {false, true})
      for (int64_t I : {200, 136, 256}) {
        SCOPED_TRACE(std::string(to_string(l)) + (permuted ? "/permuted" : "/gather") + " I=" + std::to_string(I));
        Case c;
        c.T = 600;
        c.k = 4;
        c.total = c.local = 8;  // 300 rows an expert on average: chunks of ~100 rows (t.n 112)
        c.H = 328;              // five 64-deep stages and a partial one
        c.I = I;
        c.layout = l;
        c.x_permuted = permuted;
        c.x_pad = permuted ? 0 : 24;
        c.bias = I != 256;
        c.act = I == 200 ? MoeActivation::kSwiGLU : I == 136 ? MoeActivation::kSwiGLUOai : MoeActivation::kSwiGLUClamped;
        check_case(c);
      }
  check_skewed_routings(MoeFp8Scaling::kNone);
}

// The layer's two FC1 inputs give the same bits (spec §10.3): the gather
// takes wide tiles (token rows as M) and a permuted X the transposed tile,
// so the two orientations must agree bit for bit. Same inputs, both tiles
// pinned in turn, every output element compared (each also against the CPU
// reference).
TEST(MoeFc1Gpu, Bf16WideAndTransposedTilesAreBitwiseEqual) {
  SKIP_WITHOUT_HOPPER();
  for (Fc1WeightLayout l : kLayouts)
    for (MoeActivation a : kActs) {
      SCOPED_TRACE(std::string(to_string(l)) + "/" + to_string(a));
      Case c;
      c.T = 300;
      c.k = 4;
      c.total = c.local = 8;
      c.H = 328;
      c.I = 200;
      c.layout = l;
      c.act = a;
      Problem p(c);
      HostTensor got[2];
      for (int wide = 0; wide < 2; ++wide) {
        const ScopedFc1Wide pin(wide == 1);
        p.poison_out();
        const Status st = p.run();
        ASSERT_TRUE(st.ok()) << st.message();
        CUDA_OK(cudaDeviceSynchronize());
        got[wide] = p.result();
        p.check(got[wide]);
      }
      const size_t n = size_t(p.routing.P() * c.I) * 2;  // the live rows' bytes
      EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), n), 0);
    }
}

// Block scales at the largest hidden size (kFc1BlockMaxHidden = 54528: the
// tile's W1 scales fill 10,224 of the 10,240 bytes of staging), narrow and
// wide tiles, gathered and permuted X.
TEST(MoeFc1Gpu, Fp8BlockLargestHidden) {
  SKIP_WITHOUT_HOPPER();
  for (bool wide : {false, true})
    for (bool permuted : {false, true}) {
      const ScopedFc1Wide pin(wide);
      SCOPED_TRACE(std::string(wide ? "wide" : "narrow") + (permuted ? "/permuted" : "/gather"));
      Case c;
      c.fp8 = MoeFp8Scaling::kBlock;
      c.T = 3;
      c.k = 1;
      c.total = c.local = 1;
      c.H = 54528;
      c.I = 136;  // the last slice's up rows in two scale blocks
      c.x_permuted = permuted;
      check_case(c);
    }
}

// The FP8 output (spec §9.8): e4m3 codes and 1 x 128 scales bitwise equal to
// the same GPU's bf16 output (checked against the CPU reference first) run
// through quantize_fp8 (first P rows); rows past P and the scales' rows past
// P untouched (poison). Both scale formats, gathered and permuted X, both
// layouts, bias, chunks short of 64 and of 128 rows, three scale blocks of I,
// an EP rank with empty experts, one token; narrow tiles (two slices in
// turn) and wide ones (both in one stage); and the CPU reference's FP8
// output is quantize_fp8_cpu of its bf16 rows.
TEST(MoeFc1Gpu, Fp8OutputIsQuantizeFp8OfTheBf16Rows) {
  SKIP_WITHOUT_HOPPER();
  std::vector<Case> cases;
  {
    Case c;
    c.fp8 = MoeFp8Scaling::kBlock;
    c.H = 256;
    c.I = 384;  // three 128-column scale blocks
    cases.push_back(c);
    c.x_permuted = true;
    c.bias = false;
    c.layout = Fc1WeightLayout::kInterleaved;
    cases.push_back(c);
    Case d;
    d.fp8 = MoeFp8Scaling::kBlock;
    d.H = 128;
    d.I = 128;
    d.T = 700;  // ~350 rows an expert: chunks of 128 and a tail
    d.k = 2;
    d.total = d.local = 2;
    cases.push_back(d);
    Case e;
    e.fp8 = MoeFp8Scaling::kBlock;
    e.H = 256;
    e.I = 256;
    e.total = 48;  // an EP rank with empty experts
    e.start = 16;
    e.local = 16;
    e.routing = Case::kFirstHalfOnly;
    e.act = MoeActivation::kSwiGLUClamped;
    e.outliers = false;  // as Fp8ActivationsStridesAndOddShapes: clamps with outliers outrun the tolerance
    e.w_scale = 0.5f;    // |g|, |u| up to ~10: the clamps fire
    cases.push_back(e);
    Case g;
    g.fp8 = MoeFp8Scaling::kBlock;
    g.H = 128;
    g.I = 256;
    g.T = 1;
    g.k = 8;
    g.total = g.local = 8;
    cases.push_back(g);
  }
  for (bool wide : {false, true})
  for (const Case& c : cases)
    for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
      const ScopedFc1Wide pin(wide);
      SCOPED_TRACE(std::string(wide ? "wide " : "narrow ") + to_string(f) + " I=" + std::to_string(c.I) +
                   " T=" + std::to_string(c.T) + (c.x_permuted ? " permuted" : " gather"));
      Problem p(c);
      ASSERT_TRUE(p.run().ok());
      CUDA_OK(cudaDeviceSynchronize());
      const HostTensor bf16_rows = p.result();
      p.check(bf16_rows);
      const int64_t P = p.routing.P(), cap = p.cap(), blocks = c.I / 128;
      const size_t sb = f == ScaleFormat::kUE8M0 ? 1 : 4;
      // Unfused: quantize_fp8 of the GPU's bf16 rows [0, P).
      DeviceBuffer want_q(size_t(cap * c.I)), want_s(size_t(cap * blocks) * sb);
      std::vector<uint8_t> poison_q(want_q.bytes(), 0xA5), poison_s(want_s.bytes(), 0xA5);
      want_q.upload(poison_q.data(), poison_q.size());
      want_s.upload(poison_s.data(), poison_s.size());
      // quantize_fp8 1 x 128 of the first P bf16 rows at x into q / scales.
      auto rows_q = [&](const void* x, void* q, void* scales) {
        QuantizeFp8Args qa;
        qa.x = x;
        qa.q = q;
        qa.scales = scales;
        qa.rows = P;
        qa.cols = c.I;
        qa.scale_format = f;
        return qa;
      };
      if (P > 0) ASSERT_TRUE(quantize_fp8(rows_q(p.dout.get(), want_q.get(), want_s.get()), nullptr).ok());
      // Fused: the FP8 output.
      DeviceBuffer got_q(want_q.bytes()), got_s(want_s.bytes());
      got_q.upload(poison_q.data(), poison_q.size());
      got_s.upload(poison_s.data(), poison_s.size());
      MoeFc1Args a = p.args;
      a.out = got_q.get();
      a.out_scales = got_s.get();
      a.out_scale_format = f;
      Status st = moe_fc1(a, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> gq = got_q.to_host<uint8_t>(), wq = want_q.to_host<uint8_t>();
      const std::vector<uint8_t> gs = got_s.to_host<uint8_t>(), ws = want_s.to_host<uint8_t>();
      size_t bad_q = 0, bad_s = 0;
      for (size_t i = 0; i < gq.size(); ++i) bad_q += gq[i] != wq[i];
      for (size_t i = 0; i < gs.size(); ++i) bad_s += gs[i] != ws[i];
      EXPECT_EQ(bad_q, 0u) << "e4m3 bytes differ from quantize_fp8 of the bf16 rows (P=" << P << ")";
      EXPECT_EQ(bad_s, 0u) << "scales differ";
      // The CPU reference's FP8 output: quantize_fp8_cpu of its own bf16 rows.
      MoeFc1Args h = p.args;  // host pointers (Problem keeps them for the reference)
      h.X = c.fp8 != MoeFp8Scaling::kNone ? static_cast<const void*>(p.xq.data()) : p.X.data();
      h.W1 = p.wq.data();
      h.x_scales = p.xs.data();
      h.w1_scales = p.ws.data();
      h.bias = c.bias ? p.bias.data() : nullptr;
      h.expert_first_token_offset = p.routing.offsets.data();
      h.permuted_row_to_unpermuted_row = p.routing.p2u.data();
      std::vector<uint8_t> cq(size_t(cap * c.I), 0xA5), cs(size_t(cap * blocks) * sb, 0xA5);
      h.out = cq.data();
      h.out_scales = cs.data();
      h.out_scale_format = f;
      ASSERT_TRUE(moe_fc1_cpu(h).ok());
      std::vector<uint8_t> rq(size_t(cap * c.I), 0xA5), rs(size_t(cap * blocks) * sb, 0xA5);
      if (P > 0) ASSERT_TRUE(quantize_fp8_cpu(rows_q(p.ref.data(), rq.data(), rs.data())).ok());
      EXPECT_TRUE(cq == rq && cs == rs) << "moe_fc1_cpu's FP8 output is not quantize_fp8_cpu of its bf16 rows";
    }
}

// MXFP4 W1 (spec §13.7): W4A8 (e4m3 X, 1 x 128 scales) and W4A16 (bf16 X),
// both layouts, gathered and permuted X, K of three blocks, I = 200 (the
// last slice partial: its rows past I are TMA's zero fill).
TEST(MoeFc1Gpu, Mxfp4EveryPathLayoutAndInput) {
  SKIP_WITHOUT_HOPPER();
  for (MxKernel decode : kMxKernels)
    for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kNone})
      for (Fc1WeightLayout l : kLayouts)
        for (bool permuted : {false, true}) {
          const ScopedMxKernel pin(decode);
          SCOPED_TRACE(std::string(mx_kernel_name(decode)) + (f == MoeFp8Scaling::kBlock ? " w4a8/" : " w4a16/") +
                       to_string(l) + (permuted ? "/permuted" : "/gather"));
          Case c;
          c.mx = true;
          c.fp8 = f;
          c.H = 384;
          c.layout = l;
          c.x_permuted = permuted;
          c.bias = !permuted;
          check_case(c);
        }
}

// Scales that spread within a row's K block: up to 18 binades (the
// conversion's slow path: subnormal e4m3 and, past 14, the rounding of spec
// §13.2, which the reference applies too), rows 15-22 binades below their
// neighbours, NaN scales (their outputs NaN); the activations clamped; one
// token; many rows (256-row W4A16 tiles, chunks); an expert-parallel range.
TEST(MoeFc1Gpu, Mxfp4SpreadsNaNsAndOddShapes) {
  SKIP_WITHOUT_HOPPER();
  for (MxKernel decode : kMxKernels)
    for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kNone}) {
    const ScopedMxKernel pin(decode);
    SCOPED_TRACE(std::string(mx_kernel_name(decode)) + (f == MoeFp8Scaling::kBlock ? " w4a8" : " w4a16"));
    Case c;
    c.mx = true;
    c.fp8 = f;
    c.H = 512;
    c.mxo.group_wobble = 18;
    c.mxo.deep_row_every = 7;
    c.mxo.nan_every = 300;
    c.act = MoeActivation::kSwiGLUClamped;
    check_case(c);
    c = Case{};
    c.mx = true;
    c.fp8 = f;
    c.H = 128;
    c.T = 1;
    c.k = 8;
    c.total = c.local = 8;
    c.I = 64;
    c.act = MoeActivation::kSwiGLUOai;
    check_case(c);
    c = Case{};
    c.mx = true;
    c.fp8 = f;
    c.H = 256;
    c.T = 700;  // ~350 rows an expert
    c.k = 2;
    c.total = c.local = 2;
    check_case(c);
    c = Case{};
    c.mx = true;
    c.fp8 = f;
    c.H = 256;
    c.total = 48;
    c.start = 16;
    c.local = 16;
    c.routing = Case::kFirstHalfOnly;
    check_case(c);
    c = Case{};
    c.mx = true;
    c.fp8 = f;
    c.H = 256;
    c.T = 100;  // one expert of 100 rows while experts average 12.5: 32-row tiles, in chunks
    c.k = 2;
    c.routing = Case::kAllToOne;
    check_case(c);
    c = Case{};
    c.mx = true;
    c.fp8 = f;
    c.H = 9216;  // the W4A8 decode kernel's token stages: two warpgroups a CTA fit, not three
    c.T = 8;
    c.k = 2;
    c.I = 64;
    c.total = c.local = 4;
    check_case(c);
  }
}

// W4A8 on wide tiles (spec §13.7, docs/mxfp4.md §4.13: a permuted X, gate
// rows then up rows, I % 128 == 0, experts averaging more than 32 rows).
// They fold the scales per 128 x 128 block of W1, so their weights are
// mxfp4_to_fp8_block's (k128x128) and their result must be the block-FP8
// FC1's on that conversion bit for bit (the same K loop); the CPU
// reference is moe_fc1_cpu on the converted weights. Chunks of 1-64 rows
// (one consumer warpgroup idle) and 65-128, an expert in chunks, an EP
// range, every activation, bias, and scales spread past 14 binades within
// a block (where the 1 x 128 rule of the other kernels would differ).
TEST(MoeFc1Gpu, Mxfp4WideTiles) {
  SKIP_WITHOUT_HOPPER();
  const ScopedFc1Wide wide_fp8(true);
  const ScopedEnv wide_mx("FLASHMIX_FC1_MX_WIDE", "1");
  auto run = [](Case c, const char* what) {
    SCOPED_TRACE(what);
    c.mx = true;
    c.fp8 = MoeFp8Scaling::kBlock;
    c.x_permuted = true;
    Problem p(c);
    const int64_t rows = 2 * c.I, blocks = c.local * (rows / 128) * (c.H / 128);
    std::vector<uint8_t> q(size_t(c.local * rows * c.H));
    std::vector<float> qs(static_cast<size_t>(blocks));
    Mxfp4ToFp8BlockArgs cv;
    cv.w = p.mxw.w.data();
    cv.w_scales = p.mxw.scales.data();
    cv.q = q.data();
    cv.q_scales = qs.data();
    cv.batch = c.local;
    cv.rows = rows;
    cv.cols = c.H;
    ASSERT_TRUE(mxfp4_to_fp8_block_cpu(cv).ok());
    // The reference: the block-FP8 FC1 on the converted weights.
    MoeFc1Args h = p.args;
    h.X = p.xq.data();
    h.x_scales = p.xs.data();
    h.W1 = q.data();
    h.w1_scales = qs.data();
    h.weights = MoeWeightFormat::kDense;
    h.w1_mx_scales = nullptr;
    h.bias = c.bias ? p.bias.data() : nullptr;
    h.expert_first_token_offset = p.routing.offsets.data();
    h.permuted_row_to_unpermuted_row = p.routing.p2u.data();
    p.ref.poison();
    h.out = p.ref.data();
    ASSERT_TRUE(moe_fc1_cpu(h).ok());
    p.max_ref = 0;
    for (int64_t i = 0; i < p.routing.P() * c.I; ++i) p.max_ref = std::max(p.max_ref, std::fabs(p.ref.get(i)));
    ASSERT_TRUE(p.run().ok());
    CUDA_OK(cudaDeviceSynchronize());
    const HostTensor got = p.result();
    p.check(got);
    // The block-FP8 FC1 (wide tiles) on the GPU, same X, the converted W1.
    DeviceBuffer dq(q), dqs(qs), dout(got.bytes.size());
    HostTensor poison(DType::kBFloat16, got.count());
    poison.poison();
    dout.upload(poison.data(), poison.bytes.size());
    MoeFc1Args g = p.args;
    g.W1 = dq.get();
    g.w1_scales = dqs.as<float>();
    g.weights = MoeWeightFormat::kDense;
    g.w1_mx_scales = nullptr;
    g.out = dout.get();
    ASSERT_TRUE(moe_fc1(g, nullptr).ok());
    CUDA_OK(cudaDeviceSynchronize());
    HostTensor fp8(DType::kBFloat16, got.count());
    dout.download(fp8.data(), fp8.bytes.size());
    EXPECT_EQ(0, std::memcmp(fp8.data(), got.data(), got.bytes.size()))
        << "W4A8 wide tiles differ from the block-FP8 FC1 on mxfp4_to_fp8_block's weights";
    // The FP8 output (spec §9.8; written by these tiles only with MXFP4
    // weights): codes and scales, both paths, bitwise.
    const int64_t cap = p.cap(), sblocks = c.I / 128;
    std::vector<uint8_t> codes[2], scl[2];
    for (int mx = 0; mx < 2; ++mx) {
      DeviceBuffer q_out(size_t(cap * c.I)), s_out(size_t(cap * sblocks) * 4);
      std::vector<uint8_t> pq(size_t(cap * c.I), 0xA5), ps(size_t(cap * sblocks) * 4, 0xA5);
      q_out.upload(pq.data(), pq.size());
      s_out.upload(ps.data(), ps.size());
      MoeFc1Args a = mx ? p.args : g;
      a.out = q_out.get();
      a.out_scales = s_out.get();
      const Status st = moe_fc1(a, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      CUDA_OK(cudaDeviceSynchronize());
      codes[mx].resize(pq.size());
      scl[mx].resize(ps.size());
      q_out.download(codes[mx].data(), pq.size());
      s_out.download(scl[mx].data(), ps.size());
    }
    EXPECT_TRUE(codes[0] == codes[1] && scl[0] == scl[1])
        << "W4A8 wide tiles' FP8 output differs from the block-FP8 FC1's on mxfp4_to_fp8_block's weights";
  };
  Case c;
  c.T = 256;  // ~64 rows an expert: chunks both sides of 64
  c.H = 384;
  c.I = 256;
  run(c, "two wide tiles, bias");
  c.bias = false;
  c.act = MoeActivation::kSwiGLUClamped;
  c.I = 128;
  c.mxo.group_wobble = 18;  // spreads past 14 binades within a row and a block
  c.mxo.deep_row_every = 7;
  c.mxo.nan_every = 300;
  run(c, "spreads and NaN scales, clamped");
  c = Case{};
  c.T = 300;
  c.k = 2;
  c.H = 256;
  c.I = 128;
  c.act = MoeActivation::kSwiGLUOai;
  c.routing = Case::kAllToOne;  // one expert of 300 rows (chunks), others ~2
  run(c, "an expert in chunks, oai");
  c = Case{};
  c.T = 512;
  c.H = 256;
  c.I = 128;
  c.total = 48;
  c.start = 16;
  c.local = 16;
  c.routing = Case::kFirstHalfOnly;
  run(c, "EP range, half the experts empty");
}

TEST(MoeFc1Gpu, Mxfp4BadInput) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.mx = true;
  c.fp8 = MoeFp8Scaling::kBlock;
  c.H = 256;
  Problem p(c);
  auto expect_error = [&](MoeFc1Args a, const char* what) {
    const Status st = moe_fc1(a, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  MoeFc1Args a = p.args;
  a.w1_mx_scales = nullptr;
  expect_error(a, "w1_mx_scales");
  a = p.args;
  a.fp8 = MoeFp8Scaling::kTensor;
  expect_error(a, "fp8");
  a = p.args;
  a.hidden = 160;  // a multiple of 32, not of 128
  expect_error(a, "hidden");
  a = p.args;
  a.weights = static_cast<MoeWeightFormat>(7);
  expect_error(a, "weights");
  a = p.args;
  a.w1_mx_scales = static_cast<const uint8_t*>(p.args.w1_mx_scales) + 1;
  expect_error(a, "w1_mx_scales");
  {  // an FP8 output where the wide W4A8 tiles do not apply (a gathered X): kNotSupported, nothing written
    a = p.args;
    a.inter = 128;
    a.out_scales = p.args.out;
    const Status st = moe_fc1(a, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kNotSupported) << st.message();
    EXPECT_NE(st.message().find("out_scales"), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  p.expect_out_untouched();
}

TEST(MoeFc1Gpu, Fp8BadInput) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.fp8 = MoeFp8Scaling::kBlock;
  c.H = 256;
  Problem p(c);
  auto expect_error = [&](const MoeFc1Args& a, const char* arg) {
    Status st = moe_fc1(a, nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  MoeFc1Args a = p.args;
  a.x_scales = nullptr;
  expect_error(a, "x_scales");
  a = p.args;
  a.w1_scales = nullptr;
  expect_error(a, "w1_scales");
  a = p.args;
  a.hidden = 192;  // not a multiple of 128
  a.x_stride = 256;
  expect_error(a, "hidden");
  a = p.args;
  a.x_stride = 264;  // not 16 bytes a multiple of e4m3
  expect_error(a, "x_stride");
  a = p.args;
  a.fp8 = static_cast<MoeFp8Scaling>(9);
  expect_error(a, "fp8");
  a = p.args;
  a.out = const_cast<float*>(p.args.w1_scales);  // overlaps an input
  expect_error(a, "out");
  CUDA_OK(cudaDeviceSynchronize());
  p.expect_out_untouched();
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
