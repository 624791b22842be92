// moe_fc2_finalize on the GPU (sm_90a) against the CPU reference (spec §3):
// every output element, random routings including unbalanced ones, each mode.
//
// Tolerances (ref in double, rounded once; |.|max = largest |ref| of the case).
// Both sides round to bf16, so a value near a rounding boundary may land one
// unit in the last place apart (2^-7 |ref|), plus what each mode adds:
//   deterministic, atomic_fp32: fp32 sums rounded once:
//       |gpu - ref| <= 2^-7 |ref| + 2^-10 |.|max
//   unfused: rows rounded to bf16 before the sum:
//       |gpu - ref| <= 2^-7 |ref| + 2^-8 |.|max
//   atomic (bf16): each of the k adds rounds a partial sum to bf16:
//       |gpu - ref| <= 2^-7 |ref| + k 2^-8 |.|max
// FP8 (spec §3.5): the reference takes the dequantised e4m3 values in
// double; the GPU's FP8 MMA keeps fewer bits than fp32 inside each K block
// of 128 (all of K with per-tensor scales) before the fp32 promotion, which
// adds 2^-8 |.|max (as FC1, spec §9.7) to the mode's own term above. A and W2
// come from random floats with outlier channels (every 61st channel 100 x
// larger), a zero block and a block of one huge value, quantised as spec
// §11.3 says.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/mxfp4_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "moe/moe_fc2_dispatch.h"
#include "moe/moe_fc2_internal.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

// A build without CUTLASS runs every mode on our own kernel; the tests that
// pin a CUTLASS kernel skip it there (and PinnedCutlassKernelWithoutCutlass
// checks that pinning it is refused).
#define SKIP_WITHOUT_HOPPER() SKIP_WITHOUT_HOPPER_FOR("moe_fc2_finalize")

// Whether this build has `kernel` (the CUTLASS ones need CUTLASS's headers);
// says so on stdout when it does not.
bool have_kernel(Fc2GemmKernel kernel) {
  const bool cutlass = kernel == Fc2GemmKernel::kCutlassCooperative || kernel == Fc2GemmKernel::kCutlassPingpong;
  if (cutlass && !sm90_fc2_built_with_cutlass()) {
    std::printf("  (%s not built: skipped)\n", to_string(kernel));
    return false;
  }
  return true;
}

struct Case {
  int64_t T = 64;
  int k = 4;
  int64_t H = 264;  // not a multiple of the 256-column tile
  int64_t I = 200;  // not a multiple of the 64-deep K tile
  int total = 16, start = 0, local = 16;
  int64_t out_pad = 0;
  bool scales = true, bias = true, apply_bias = true;
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
  // MXFP4 W2 (spec §13.7): W4A8 with fp8 = kBlock, W4A16 with kNone.
  bool mx = false;
  Mxfp4Options mxo;
  // kSmallSecond: every slot on the first local expert but slot 0 of the
  // first 40 tokens, which go to the second (k = 1: one expert a token).
  enum Routing { kRandom, kFirstHalfOnly, kAllToOne, kSmallSecond } routing = kRandom;
};

struct Problem {
  Case c;
  Routing routing;
  HostTensor A, W2, bias, ref;
  std::vector<float> scales;
  std::vector<uint8_t> aq, wq;  // FP8: the e4m3 codes of A ([k*T capacity, I]) and W2
  std::vector<float> as, w2s;   // FP8: their scales
  Mxfp4Data mxw;                // MXFP4: W2 packed [E, H, I / 2] and its scales
  DeviceBuffer dA, dW2, dbias, dscales, dp2u, doff, dout, dws, das, dw2s;
  Fc2FinalizeArgs args;
  double max_ref = 0;

  int64_t out_stride() const { return c.H + c.out_pad; }

  Problem(const Case& cs, Fc2Mode mode, uint64_t salt = 0) : c(cs) {
    Rng rng(test_seed() ^ (salt * 0x9e3779b97f4a7c15ull));
    if (c.routing == Case::kRandom) {
      routing = random_routing(rng, c.T, c.k, c.total, c.start, c.local);
    } else {
      std::vector<int32_t> ex(size_t(c.T * c.k));
      for (int64_t t = 0; t < c.T; ++t)
        for (int j = 0; j < c.k; ++j) {
          if (c.routing == Case::kAllToOne)  // slot 0 of every token on expert 3; the rest elsewhere
            ex[t * c.k + j] = j == 0 ? c.start + 3 : c.start + 4 + j;
          else if (c.routing == Case::kSmallSecond)
            ex[t * c.k + j] = c.start + (t < 40 && j == 0 ? 1 : 0);
          else  // only the first half of the local experts get rows
            ex[t * c.k + j] = c.start + int((t * c.k + j) % std::max(1, c.local / 2));
        }
      routing = build_routing(c.T, c.k, c.start, c.local, std::move(ex));
    }
    const int64_t cap = std::max<int64_t>(1, c.T * c.k);
    A = HostTensor(DType::kBFloat16, cap * c.I);
    A.fill_random(rng);
    W2 = HostTensor(DType::kBFloat16, int64_t(c.local) * c.H * c.I);
    W2.fill_random(rng, -0.1f, 0.1f);
    bias = HostTensor(DType::kBFloat16, int64_t(c.local) * c.H);
    bias.fill_random(rng);
    scales.resize(size_t(std::max<int64_t>(1, c.T * c.k)));
    for (auto& s : scales) s = rng.uniform(0.0f, 1.0f);
    ref = HostTensor(DType::kBFloat16, std::max<int64_t>(1, c.T) * out_stride());
    ref.poison();
    const bool fp8 = c.fp8 != MoeFp8Scaling::kNone;
    if (fp8) {
      const bool blk = c.fp8 == MoeFp8Scaling::kBlock;
      std::vector<float> a = random_with_outliers(rng, cap, c.I, 1.f, true);
      if (c.I >= 256)  // a zero block (scale 1, codes 0) in every 7th row
        for (int64_t r = 3; r < cap; r += 7) std::fill(a.begin() + r * c.I + 128, a.begin() + r * c.I + 256, 0.f);
      quantize_e4m3(a, cap, c.I, blk ? 1 : 0, aq, as);
    }
    if (c.mx) {
      mxw = random_mxfp4(rng, c.local, c.H, c.I, c.mxo);
    } else if (fp8) {
      const bool blk = c.fp8 == MoeFp8Scaling::kBlock;
      // W2 one expert at a time (blocks of 128 x 128 never cross experts);
      // expert 0's first element 1000 x its neighbours: a block of one huge value.
      const int64_t per = c.H * c.I;
      std::vector<float> w = random_with_outliers(rng, int64_t(c.local) * c.H, c.I, 0.1f, true);
      w[0] = 100.f;
      for (int e = 0; e < c.local; ++e) {
        std::vector<float> we(w.begin() + e * per, w.begin() + (e + 1) * per);
        std::vector<uint8_t> qe;
        std::vector<float> se;
        quantize_e4m3(we, c.H, c.I, blk ? 128 : 0, qe, se);
        wq.insert(wq.end(), qe.begin(), qe.end());
        w2s.insert(w2s.end(), se.begin(), se.end());
      }
    }

    args.A = fp8 ? static_cast<const void*>(aq.data()) : A.data();
    args.W2 = c.mx ? static_cast<const void*>(mxw.w.data()) : fp8 ? static_cast<const void*>(wq.data()) : W2.data();
    args.fp8 = c.fp8;
    args.a_scales = fp8 ? as.data() : nullptr;
    args.w2_scales = fp8 && !c.mx ? w2s.data() : nullptr;
    args.weights = c.mx ? MoeWeightFormat::kMxfp4 : MoeWeightFormat::kDense;
    args.w2_mx_scales = c.mx ? mxw.scales.data() : nullptr;
    args.expert_first_token_offset = routing.offsets.data();
    args.permuted_row_to_unpermuted_row = routing.p2u.data();
    args.scales = c.scales ? scales.data() : nullptr;
    args.bias = c.bias ? bias.data() : nullptr;
    args.apply_bias = c.apply_bias;
    args.num_tokens = c.T;
    args.k = c.k;
    args.hidden = c.H;
    args.inter = c.I;
    args.num_experts_per_node = c.local;
    args.out = ref.data();
    args.out_stride = out_stride();
    args.mode = mode;
    // FLASHMIX_TEST_FC2_KERNEL=name runs every test of this file on that GEMM
    // kernel (to_string names: rows, cutlass_cooperative, cutlass_pingpong;
    // scripts/gpu_round.sh runs this file once more on rows, with all modes);
    // name,r also pins the CUTLASS tile order r.
    if (const char* env = std::getenv("FLASHMIX_TEST_FC2_KERNEL")) {
      const char* comma = std::strchr(env, ',');
      if (!parse_fc2_gemm_kernel(env, comma ? size_t(comma - env) : std::strlen(env), &args.tuning.gemm_kernel))
        ADD_FAILURE() << "FLASHMIX_TEST_FC2_KERNEL=" << env << ": not a kernel name";
      if (comma) args.tuning.raster = std::atoi(comma + 1);
      // FP8 runs on rows only (a pinned CUTLASS kernel is refused: Fp8BadInput...).
      if ((fp8 || c.mx) && args.tuning.gemm_kernel != Fc2GemmKernel::kAuto)
        args.tuning.gemm_kernel = Fc2GemmKernel::kRows;
    }
    Status st = moe_fc2_finalize_cpu(args);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t n = 0; n < c.H; ++n) max_ref = std::max(max_ref, std::fabs(ref.get(t * out_stride() + n)));

    dA = fp8 ? DeviceBuffer(aq) : DeviceBuffer(A.bytes);
    dW2 = c.mx ? DeviceBuffer(mxw.w) : fp8 ? DeviceBuffer(wq) : DeviceBuffer(W2.bytes);
    if (fp8) {
      das = DeviceBuffer(as);
      args.a_scales = das.as<float>();
    }
    if (c.mx) {
      dw2s = DeviceBuffer(mxw.scales);
      args.w2_mx_scales = dw2s.get();
    } else if (fp8) {
      dw2s = DeviceBuffer(w2s);
      args.w2_scales = dw2s.as<float>();
    }
    dbias = DeviceBuffer(bias.bytes);
    dscales = DeviceBuffer(scales);
    dp2u = DeviceBuffer(std::max<size_t>(4, size_t(routing.T * routing.k) * 4));  // capacity k*T
    if (!routing.p2u.empty()) dp2u.upload(routing.p2u.data(), routing.p2u.size() * 4);
    doff = DeviceBuffer(routing.offsets);
    dout = DeviceBuffer(ref.bytes.size());
    poison_out();
    args.A = dA.get();
    args.W2 = dW2.get();
    args.expert_first_token_offset = doff.as<int64_t>();
    args.permuted_row_to_unpermuted_row = dp2u.as<int32_t>();
    args.scales = c.scales ? dscales.as<float>() : nullptr;
    args.bias = c.bias ? dbias.get() : nullptr;
    args.out = dout.get();
    const size_t ws = moe_fc2_finalize_workspace_size(args);
    dws = DeviceBuffer(std::max<size_t>(ws, 256));
  }

  void poison_out() {
    HostTensor p(DType::kBFloat16, int64_t(ref.bytes.size() / 2));
    p.poison();
    dout.upload(p.data(), p.bytes.size());
  }

  Status run(cudaStream_t s = nullptr) { return moe_fc2_finalize(args, dws.get(), dws.bytes(), s); }

  HostTensor result() const {
    HostTensor h(DType::kBFloat16, int64_t(ref.bytes.size() / 2));
    dout.download(h.data(), h.bytes.size());
    return h;
  }

  // A rejected call wrote nothing: out is still the NaN poison.
  void expect_out_untouched() const {
    const HostTensor got = result();
    for (int64_t i = 0; i < got.count(); ++i)
      if (!std::isnan(got.get(i))) {
        ADD_FAILURE() << "out written at " << i;
        break;
      }
  }

  // Sum of |gpu - ref| over the output; expects every element within tolerance
  // and the padding columns untouched (still NaN).
  double check(Fc2Mode mode, const HostTensor& got) const {
    const double rtol = std::ldexp(1.0, -7);
    double atol = std::ldexp(1.0, -10) * max_ref;
    if (mode == Fc2Mode::kUnfused) atol = std::ldexp(1.0, -8) * max_ref;
    if (mode == Fc2Mode::kAtomic) atol = c.k * std::ldexp(1.0, -8) * max_ref;
    if (c.fp8 != MoeFp8Scaling::kNone) atol += std::ldexp(1.0, -8) * max_ref;  // the FP8 MMA
    double sum_err = 0;
    int bad = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t n = 0; n < out_stride(); ++n) {
        const double g = got.get(t * out_stride() + n), r = ref.get(t * out_stride() + n);
        if (n >= c.H) {
          if (!std::isnan(g) && bad++ < 5) ADD_FAILURE() << "padding written at t=" << t << " n=" << n;
          continue;
        }
        const double err = std::fabs(g - r);
        sum_err += err;
        if (!(err <= rtol * std::fabs(r) + atol) && bad++ < 5)
          ADD_FAILURE() << fc2_mode_name(mode) << "/" << to_string(c.fp8) << " t=" << t << " n=" << n
                        << " gpu=" << g << " ref=" << r
                        << " tol=" << rtol * std::fabs(r) + atol;
      }
    }
    return sum_err;
  }
};

const Fc2Mode kModes[] = {Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic, Fc2Mode::kUnfused};

// Every mode of c against the reference; a kernel other than kAuto pins it.
void check_all_modes(const Case& c, Fc2GemmKernel kernel = Fc2GemmKernel::kAuto) {
  for (Fc2Mode m : kModes) {
    SCOPED_TRACE(fc2_mode_name(m));
    Problem p(c, m);
    if (kernel != Fc2GemmKernel::kAuto) p.args.tuning.gemm_kernel = kernel;
    Status st = p.run();
    ASSERT_TRUE(st.ok()) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    p.check(m, p.result());
  }
}

}  // namespace

TEST(MoeFc2Gpu, MatchesReferenceRandomRouting) {
  SKIP_WITHOUT_HOPPER();
  check_all_modes(Case{});
}

TEST(MoeFc2Gpu, MatchesReferenceManyRowsPerExpertAndStridedOut) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 700;  // ~175 rows per expert: two M tiles, a partial one
  c.k = 2;
  c.total = 8;
  c.local = 8;
  c.H = 512;
  c.I = 256;
  c.out_pad = 8;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, OutStrideNotAMultipleOf8UsesNarrowAccesses) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.out_pad = 2;  // rows of out are 4-byte but not 16-byte aligned
  check_all_modes(c);
}

TEST(MoeFc2Gpu, EveryGemmKernelMatches) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 300;
  c.k = 4;
  for (Fc2GemmKernel kernel : kFc2GemmKernels) {
    if (!have_kernel(kernel)) continue;
    const bool pingpong = kernel == Fc2GemmKernel::kCutlassPingpong;
    for (Fc2Mode m : kModes) {
      SCOPED_TRACE(std::string(fc2_mode_name(m)) + " on " + to_string(kernel));
      Problem p(c, m);
      p.args.tuning.gemm_kernel = kernel;
      p.args.tuning.raster = pingpong ? 2 : 1;  // both CUTLASS tile orders (rows ignores it)
      p.args.tuning.swizzle = pingpong ? 4 : 0;
      Status st = p.run();
      ASSERT_TRUE(st.ok()) << st.message();
      CUDA_OK(cudaDeviceSynchronize());
      p.check(m, p.result());
    }
  }
}

// What the automatic choice runs, and that a kernel this build lacks is
// refused when pinned, naming tuning.gemm_kernel, with nothing written.
TEST(MoeFc2Gpu, AutomaticChoiceAndPinnedKernelWithoutCutlass) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  for (Fc2Mode m : kModes) {
    Problem p(c, m);
    Fc2GemmChoice choice;
    ASSERT_TRUE(choose_fc2_gemm_kernel(p.args, &choice).ok());
    std::printf("  %s: %s (%s)\n", fc2_mode_name(m), to_string(choice.kernel), choice.why);
  }
  if (sm90_fc2_built_with_cutlass()) return;
  for (Fc2GemmKernel kernel : {Fc2GemmKernel::kCutlassCooperative, Fc2GemmKernel::kCutlassPingpong}) {
    SCOPED_TRACE(to_string(kernel));
    Problem p(c, Fc2Mode::kAtomic);
    p.args.tuning.gemm_kernel = kernel;
    const Status st = p.run();
    EXPECT_EQ(st.code(), StatusCode::kNotSupported) << st.message();
    EXPECT_NE(st.message().find("tuning.gemm_kernel"), std::string::npos) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    p.expect_out_untouched();
  }
}

// Our kernel (kRows) orders the experts by tile size in a counting
// sort over blocks of 32 experts: many experts (up to the op's 1,024), most
// of them empty or with a few rows.
TEST(MoeFc2Gpu, RowsKernelManyExperts) {
  SKIP_WITHOUT_HOPPER();
  for (int experts : {40, 1024}) {
    Case c;
    c.T = 700;
    c.k = 8;
    c.total = c.local = experts;
    SCOPED_TRACE("experts " + std::to_string(experts));
    check_all_modes(c, Fc2GemmKernel::kRows);
  }
}

// Our kernel (kRows) takes an expert of up to 272 rows (256 with more than 256
// experts) as one tile, cuts a larger one into equal chunks of at most 256,
// and sizes each tile's wgmma N to its chunk: experts of 600, 257 and 1 rows
// and the sizes around the limits below.
TEST(MoeFc2Gpu, RowsKernelChunksLargeExperts) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 600;
  c.k = 2;
  c.routing = Case::kAllToOne;  // expert 3: a row of every token (600 rows: 3 chunks of 200)
  Case d;
  d.T = 257;
  d.k = 1;
  d.total = 1;
  d.local = 1;  // one expert of 257 rows: one tile of N = 272 (two wgmmas a k16 step)
  Case e;
  e.T = 1;
  e.k = 1;
  // One expert of 264 and 272 rows: one N = 272 tile; of 273, 300, 320 and 641
  // rows: 2, 2, 2 and 3 chunks (N = 144, 160, 160, 224).
  std::vector<Case> cases{c, d, e};
  for (int64_t rows : {264, 272, 273, 300, 320, 641}) {
    Case f = d;
    f.T = rows;
    cases.push_back(f);
  }
  // More experts than the 272-row tiles' tables hold: the kernel with tiles of
  // at most 256 rows, where 257 rows are two chunks (N = 144).
  Case g = d;
  g.total = g.local = 300;
  g.routing = Case::kAllToOne;
  cases.push_back(g);
  // A 272-row tile with a single, partial k-block (I = 40) and H below one
  // 128-column slice.
  Case h = d;
  h.T = 260;
  h.I = 40;
  h.H = 104;
  cases.push_back(h);
  for (const Case& cs : cases) {
    SCOPED_TRACE("T=" + std::to_string(cs.T));
    check_all_modes(cs, Fc2GemmKernel::kRows);
  }
}

TEST(MoeFc2Gpu, ExpertParallelRankTokensWithoutLocalSlotsGetZero) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 96;
  c.k = 2;
  c.total = 64;
  c.start = 16;
  c.local = 8;  // most tokens have no local slot
  check_all_modes(c);
}

TEST(MoeFc2Gpu, EmptyExperts) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.routing = Case::kFirstHalfOnly;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, OneExpertHasARowOfEveryToken) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 300;
  c.k = 3;
  c.routing = Case::kAllToOne;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, KEqualsOneStoresPlainly) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.k = 1;
  c.total = 8;
  c.start = 2;
  c.local = 4;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, SingleToken) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 1;
  c.k = 8;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 0;
  for (Fc2Mode m : kModes) {
    Problem p(c, m);
    Status st = p.run();
    EXPECT_TRUE(st.ok()) << st.message();
  }
  CUDA_OK(cudaDeviceSynchronize());
}

TEST(MoeFc2Gpu, NoScalesAndBiasOnlyWhenApplied) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.scales = false;
  c.apply_bias = false;  // the bias pointer is given but must be ignored
  check_all_modes(c);
}

TEST(MoeFc2Gpu, DeterministicIsBitwiseReproducible) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 512;
  c.k = 8;
  c.total = 32;
  c.local = 32;
  Problem p(c, Fc2Mode::kDeterministic);
  ASSERT_TRUE(p.run().ok());
  CUDA_OK(cudaDeviceSynchronize());
  const HostTensor first = p.result();
  p.check(Fc2Mode::kDeterministic, first);
  for (int rep = 0; rep < 3; ++rep) {
    p.poison_out();
    ASSERT_TRUE(p.run().ok());
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(p.result().bytes == first.bytes) << "run " << rep + 1 << " differs";
  }
}

TEST(MoeFc2Gpu, AtomicFp32IsCloserToReferenceThanBf16Atomic) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.T = 256;
  c.k = 8;
  c.total = 16;
  c.local = 16;
  Problem p(c, Fc2Mode::kAtomic);
  ASSERT_TRUE(p.run().ok());
  CUDA_OK(cudaDeviceSynchronize());
  const double err_bf16 = p.check(Fc2Mode::kAtomic, p.result());
  p.args.mode = Fc2Mode::kAtomicFp32;
  p.dws = DeviceBuffer(moe_fc2_finalize_workspace_size(p.args));
  ASSERT_TRUE(p.run().ok());
  CUDA_OK(cudaDeviceSynchronize());
  const double err_fp32 = p.check(Fc2Mode::kAtomicFp32, p.result());
  EXPECT_LT(err_fp32, err_bf16) << "sum |err|: fp32 " << err_fp32 << ", bf16 " << err_bf16;
}

TEST(MoeFc2Gpu, AtomicAddsToCallerZeroedOut) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  Problem p(c, Fc2Mode::kAtomic);
  CUDA_OK(cudaMemset(p.dout.get(), 0, p.dout.bytes()));
  CUDA_OK(cudaDeviceSynchronize());  // the legacy stream's memset, before any non-blocking stream
  p.args.out_already_zeroed = true;
  ASSERT_TRUE(p.run().ok());
  CUDA_OK(cudaDeviceSynchronize());
  p.check(Fc2Mode::kAtomic, p.result());
}

// With k = 1 the epilogue may store instead of adding, but not when out
// holds the caller's residual.
TEST(MoeFc2Gpu, AtomicWithKEqualsOneAddsToCallerResidual) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.k = 1;
  for (Fc2GemmKernel kernel : kFc2GemmKernels) {
    if (!have_kernel(kernel)) continue;
    SCOPED_TRACE(to_string(kernel));
    Problem p(c, Fc2Mode::kAtomic);
    p.args.tuning.gemm_kernel = kernel;
    HostTensor out(DType::kBFloat16, int64_t(p.ref.bytes.size() / 2));
    Rng rng(test_seed() ^ 0x51);
    out.fill_random(rng);
    for (int64_t i = 0; i < out.count(); ++i)  // expected: residual + the experts' sum
      p.ref.set(i, double(out.get(i)) + p.ref.get(i));
    p.dout.upload(out.data(), out.bytes.size());
    p.args.out_already_zeroed = true;
    ASSERT_TRUE(p.run().ok());
    CUDA_OK(cudaDeviceSynchronize());
    p.check(Fc2Mode::kAtomic, p.result());
  }
}

// shared_output added once, and fill = false (tokens without a local row left
// untouched: still the poison), in every mode, on an expert-parallel rank.
TEST(MoeFc2Gpu, SharedOutputAndNoFill) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : kModes)
    for (bool fill : {true, false})
      for (bool with_shared : {true, false}) {
        if (fill && !with_shared) continue;  // the other tests
        SCOPED_TRACE(std::string(fc2_mode_name(m)) + (fill ? " fill" : " no fill") +
                     (with_shared ? " shared" : ""));
        for (int k : {2, 1}) {  // k = 1: the plain-store path of kAtomic (seeded or with shared_output: adds)
          SCOPED_TRACE("k=" + std::to_string(k));
          Case c;
          c.total = 48;
          c.start = 16;
          c.local = 16;
          c.k = k;  // most tokens have no local slot
          c.out_pad = 8;
          Problem p(c, m);
          Rng rng(test_seed() ^ 0x5eedull);
          HostTensor shared(DType::kBFloat16, c.T * (c.H + 16));
          shared.fill_random(rng);
          DeviceBuffer dshared(shared.bytes);
          // The reference: the host args with shared_output and fill.
          Fc2FinalizeArgs h = p.args;
          h.A = p.A.data();
          h.W2 = p.W2.data();
          h.expert_first_token_offset = p.routing.offsets.data();
          h.permuted_row_to_unpermuted_row = p.routing.p2u.data();
          h.scales = p.scales.data();
          h.bias = p.bias.data();
          h.shared_output = with_shared ? shared.data() : nullptr;
          h.shared_stride = c.H + 16;
          h.fill = fill;
          p.ref.poison();
          h.out = p.ref.data();
          ASSERT_TRUE(moe_fc2_finalize_cpu(h).ok());
          p.max_ref = 0;
          for (int64_t i = 0; i < p.ref.count(); ++i)
            if (!std::isnan(p.ref.get(i))) p.max_ref = std::max(p.max_ref, std::fabs(p.ref.get(i)));
          p.args.shared_output = with_shared ? dshared.get() : nullptr;
          p.args.shared_stride = c.H + 16;
          p.args.fill = fill;
          Status st = p.run();
          ASSERT_TRUE(st.ok()) << st.message();
          CUDA_OK(cudaDeviceSynchronize());
          const HostTensor got = p.result();
          // Untouched tokens: NaN on both sides; the rest within the mode's tolerance.
          int bad = 0;
          for (int64_t t = 0; t < c.T; ++t)
            for (int64_t n = 0; n < c.H; ++n) {
              const double g = got.get(t * p.out_stride() + n), r = p.ref.get(t * p.out_stride() + n);
              if (std::isnan(r) != std::isnan(g)) {
                if (bad++ < 5) ADD_FAILURE() << "t=" << t << " n=" << n << " gpu=" << g << " ref=" << r;
              }
            }
          if (fill) p.check(m, got);
          else {
            const double tol_rel = std::ldexp(1.0, -7), tol_abs = c.k * std::ldexp(1.0, -8) * p.max_ref;
            for (int64_t t = 0; t < c.T; ++t)
              for (int64_t n = 0; n < c.H; ++n) {
                const double g = got.get(t * p.out_stride() + n), r = p.ref.get(t * p.out_stride() + n);
                if (!std::isnan(r) && !(std::fabs(g - r) <= tol_rel * std::fabs(r) + tol_abs) && bad++ < 5)
                  ADD_FAILURE() << "t=" << t << " n=" << n << " gpu=" << g << " ref=" << r;
              }
          }
        }
      }
}

namespace {

// The op captured once in a CUDA graph, then replayed twice over poisoned
// outputs, each replay checked against the reference.
void capture_and_replay(const Case& c, Fc2Mode m) {
  Problem p(c, m);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
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
    p.check(m, p.result());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace

TEST(MoeFc2Gpu, GraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  for (Fc2Mode m : kModes) {
    SCOPED_TRACE(fc2_mode_name(m));
    Case c;
    c.T = 128;
    capture_and_replay(c, m);
  }
}

TEST(MoeFc2Gpu, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  Problem p(c, Fc2Mode::kAtomic);
  auto expect_error = [&](Fc2FinalizeArgs a, size_t ws_bytes, const char* arg) {
    Status st = moe_fc2_finalize(a, p.dws.get(), ws_bytes, nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
  };
  Fc2FinalizeArgs a = p.args;
  a.A = nullptr;
  expect_error(a, p.dws.bytes(), "A:");
  a = p.args;
  a.W2 = static_cast<const char*>(p.args.W2) + 2;
  expect_error(a, p.dws.bytes(), "W2:");
  a = p.args;
  a.hidden = 260;
  expect_error(a, p.dws.bytes(), "hidden");
  a = p.args;
  a.k = 17;
  expect_error(a, p.dws.bytes(), "k:");
  a = p.args;
  a.out_stride = 3;
  expect_error(a, p.dws.bytes(), "out_stride");
  a = p.args;
  a.mode = static_cast<Fc2Mode>(9);
  expect_error(a, p.dws.bytes(), "mode");
  expect_error(p.args, 16, "workspace_bytes");
  CUDA_OK(cudaDeviceSynchronize());
  p.expect_out_untouched();
}

// ---------------------------------------------------------------------------
// FP8 A and W2 (spec §3.5): on our kernel (kRows) whatever the mode.

namespace {
const MoeFp8Scaling kFp8Scalings[] = {MoeFp8Scaling::kBlock, MoeFp8Scaling::kTensor};

// The low-precision weights the repeat and graph tests run: FP8 W2 (block,
// per-tensor scales) and MXFP4 W2 (W4A8, W4A16; spec §13.7).
struct LowPrecision {
  MoeFp8Scaling fp8;
  bool mx;
  const char* name;
};
const LowPrecision kLowPrecision[] = {{MoeFp8Scaling::kBlock, false, "fp8 block"},
                                      {MoeFp8Scaling::kTensor, false, "fp8 tensor"},
                                      {MoeFp8Scaling::kBlock, true, "mxfp4 w4a8"},
                                      {MoeFp8Scaling::kNone, true, "mxfp4 w4a16"}};
}  // namespace

// Every mode, both scalings: I = 384 (three K blocks, a zero block in every
// 7th row of A), H = 264 (the last W2 row block of 8 rows), bias, weights.
TEST(MoeFc2Gpu, Fp8EveryScalingAndMode) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFp8Scaling f : kFp8Scalings) {
    SCOPED_TRACE(to_string(f));
    Case c;
    c.fp8 = f;
    c.I = 384;
    check_all_modes(c);
  }
}

// Tile shapes: experts of ~175 rows (block scales: two chunks of at most
// 128 rows; per tensor one tile), an expert with a row of every token (300
// rows: 3 / 2 chunks), one token, k = 1 (plain stores), an expert-parallel rank
// with empty experts, many experts, strided out.
TEST(MoeFc2Gpu, Fp8ShapesAndRoutings) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFp8Scaling f : kFp8Scalings) {
    std::vector<std::pair<std::string, Case>> cases;
    Case c;
    c.fp8 = f;
    c.I = 256;
    Case a = c;
    a.T = 700;
    a.k = 2;
    a.total = a.local = 8;
    a.H = 512;
    a.out_pad = 8;
    cases.push_back({"175 rows an expert", a});
    Case b = c;
    b.T = 300;
    b.k = 3;
    b.routing = Case::kAllToOne;
    cases.push_back({"all to one", b});
    Case d = c;
    d.T = 1;
    d.k = 8;
    cases.push_back({"one token", d});
    Case e = c;
    e.k = 1;
    e.total = 8;
    e.start = 2;
    e.local = 4;
    cases.push_back({"k = 1", e});
    Case g = c;
    g.total = 48;
    g.start = 16;
    g.local = 16;
    g.routing = Case::kFirstHalfOnly;
    cases.push_back({"EP rank, empty experts", g});
    Case h = c;
    h.T = 400;
    h.k = 8;
    h.total = h.local = 300;  // more than 256 experts
    cases.push_back({"300 experts", h});
    // One expert of 256 rows (block scales: two promotion halves of 128) and
    // of 129 (N = 144: halves of 128 and 16).
    for (int64_t rows : {256, 129}) {
      Case one = c;
      one.T = rows;
      one.k = 1;
      one.total = one.local = 1;
      cases.push_back({"one expert of " + std::to_string(rows) + " rows", one});
    }
    // More than 512 slots an expert: block scales take the token rows as
    // wgmma's M (the launcher's rule), here on 2 experts of ~700 rows (chunks
    // short of 128) and on an EP rank of 2 of 4 experts.
    Case big = c;
    big.T = 700;
    big.k = 2;
    big.total = big.local = 2;
    cases.push_back({"700 rows an expert", big});
    Case big_ep = c;
    big_ep.T = 1100;
    big_ep.k = 2;
    big_ep.total = 4;
    big_ep.start = 1;
    big_ep.local = 2;
    cases.push_back({"EP rank, 550 rows an expert", big_ep});
    // Token rows as M with more K blocks than the ring has stages, and not a
    // multiple of them (every tile starts at stage 0: the rest of the last
    // round is skipped), on large experts and beside an expert of 40 rows
    // (one chunk of 48: the second warpgroup only waits and releases).
    Case big6 = big;
    big6.I = 768;
    cases.push_back({"700 rows an expert, 6 K blocks", big6});
    Case skew = c;
    skew.T = 1100;
    skew.k = 1;
    skew.total = skew.local = 2;
    skew.I = 640;
    skew.routing = Case::kSmallSecond;
    cases.push_back({"1060 and 40 rows, 5 K blocks", skew});
    for (const auto& [name, cs] : cases) {
      SCOPED_TRACE(std::string(to_string(f)) + ": " + name);
      check_all_modes(cs);
    }
  }
}

// Per-tensor scales take any I % 16 == 0: I = 144 (a last stage of 16 bytes
// of K), H = 104 (below one 128-column slice).
TEST(MoeFc2Gpu, Fp8TensorPartialKStage) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.fp8 = MoeFp8Scaling::kTensor;
  c.I = 144;
  c.H = 104;
  check_all_modes(c);
}

TEST(MoeFc2Gpu, Fp8ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_HOPPER();
  for (MoeFp8Scaling f : kFp8Scalings) {
    Case c;
    c.fp8 = f;
    c.I = 256;
    c.T = 0;
    for (Fc2Mode m : kModes) {
      Problem p(c, m);
      Status st = p.run();
      EXPECT_TRUE(st.ok()) << st.message();
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
}

TEST(MoeFc2Gpu, Fp8AndMxfp4DeterministicIsBitwiseReproducible) {
  SKIP_WITHOUT_HOPPER();
  for (const LowPrecision& lp : kLowPrecision) {
    SCOPED_TRACE(lp.name);
    Case c;
    c.fp8 = lp.fp8;
    c.mx = lp.mx;
    c.T = 512;
    c.k = 8;
    c.total = c.local = 32;
    c.I = 256;
    Problem p(c, Fc2Mode::kDeterministic);
    ASSERT_TRUE(p.run().ok());
    CUDA_OK(cudaDeviceSynchronize());
    const HostTensor first = p.result();
    p.check(Fc2Mode::kDeterministic, first);
    for (int rep = 0; rep < 3; ++rep) {
      p.poison_out();
      ASSERT_TRUE(p.run().ok());
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(p.result().bytes == first.bytes) << "run " << rep + 1 << " differs";
    }
  }
}

TEST(MoeFc2Gpu, Fp8AndMxfp4GraphCaptureAndReplay) {
  SKIP_WITHOUT_HOPPER();
  for (const LowPrecision& lp : kLowPrecision)
    for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kDeterministic}) {
      SCOPED_TRACE(std::string(lp.name) + "/" + fc2_mode_name(m));
      Case c;
      c.fp8 = lp.fp8;
      c.mx = lp.mx;
      c.I = 256;
      c.T = 128;
      capture_and_replay(c, m);
    }
}

TEST(MoeFc2Gpu, Fp8BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.fp8 = MoeFp8Scaling::kBlock;
  c.I = 256;
  Problem p(c, Fc2Mode::kAtomic);
  auto expect_error = [&](const Fc2FinalizeArgs& a, const char* arg, StatusCode code) {
    Status st = moe_fc2_finalize(a, p.dws.get(), p.dws.bytes(), nullptr);
    EXPECT_EQ(st.code(), code) << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  Fc2FinalizeArgs a = p.args;
  a.a_scales = nullptr;
  expect_error(a, "a_scales", StatusCode::kInvalidArgument);
  a = p.args;
  a.w2_scales = nullptr;
  expect_error(a, "w2_scales", StatusCode::kInvalidArgument);
  a = p.args;
  a.a_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(p.args.a_scales) + 2);
  expect_error(a, "a_scales", StatusCode::kInvalidArgument);
  a = p.args;
  a.inter = 136;  // block scales: a multiple of 128
  expect_error(a, "inter", StatusCode::kInvalidArgument);
  a = p.args;
  a.fp8 = static_cast<MoeFp8Scaling>(9);
  expect_error(a, "fp8", StatusCode::kInvalidArgument);
  a = p.args;
  a.out = const_cast<float*>(p.args.w2_scales);  // overlaps an input
  expect_error(a, "out", StatusCode::kInvalidArgument);
  for (Fc2GemmKernel k : {Fc2GemmKernel::kCutlassCooperative, Fc2GemmKernel::kCutlassPingpong}) {
    a = p.args;
    a.tuning.gemm_kernel = k;  // bf16 only
    expect_error(a, "tuning.gemm_kernel", StatusCode::kNotSupported);
  }
  CUDA_OK(cudaDeviceSynchronize());
  p.expect_out_untouched();
}

// MXFP4 W2 (spec §13.7): W4A8 (e4m3 A, 1 x 128 scales) and W4A16 (bf16 A)
// in every mode, K of three blocks, H = 264 (the last 128-row slice partial).
TEST(MoeFc2Gpu, Mxfp4EveryPathAndMode) {
  SKIP_WITHOUT_HOPPER();
  for (MxKernel decode : kMxKernels)
  for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kNone}) {
    const ScopedMxKernel pin(decode);
    SCOPED_TRACE(std::string(mx_kernel_name(decode)) + (f == MoeFp8Scaling::kBlock ? " w4a8" : " w4a16"));
    Case c;
    c.mx = true;
    c.fp8 = f;
    c.I = 384;
    check_all_modes(c);
  }
}

// Scale spreads up to 18 binades within a row's K block (the slow path and
// spec §13.2's rounding, which the reference applies too) and deep rows;
// one token; many rows (chunks, 256-row W4A16 tiles); an EP range with
// empty experts; more than 256 experts.
TEST(MoeFc2Gpu, Mxfp4SpreadsAndShapes) {
  SKIP_WITHOUT_HOPPER();
  for (MxKernel decode : kMxKernels)
  for (MoeFp8Scaling f : {MoeFp8Scaling::kBlock, MoeFp8Scaling::kNone}) {
    const ScopedMxKernel pin(decode);
    std::vector<std::pair<std::string, Case>> cases;
    Case c;
    c.mx = true;
    c.fp8 = f;
    c.I = 256;
    Case s = c;
    s.mxo.group_wobble = 18;
    s.mxo.deep_row_every = 5;
    cases.push_back({"spreads", s});
    Case a = c;
    a.T = 700;
    a.k = 2;
    a.total = a.local = 4;
    a.H = 512;
    cases.push_back({"350 rows an expert", a});
    Case d = c;
    d.T = 1;
    d.k = 8;
    cases.push_back({"one token", d});
    Case g = c;
    g.total = 48;
    g.start = 16;
    g.local = 16;
    g.routing = Case::kFirstHalfOnly;
    cases.push_back({"EP rank, empty experts", g});
    Case h = c;
    h.T = 400;
    h.k = 8;
    h.total = h.local = 300;
    cases.push_back({"300 experts", h});
    Case o = c;
    o.T = 100;  // one expert of 100 rows while experts average 12.5: 32-row tiles, in chunks
    o.k = 2;
    o.routing = Case::kAllToOne;
    cases.push_back({"all to one", o});
    for (const auto& [name, cs] : cases) {
      SCOPED_TRACE(std::string(mx_kernel_name(decode)) + (f == MoeFp8Scaling::kBlock ? " w4a8: " : " w4a16: ") +
                   name);
      for (Fc2Mode m : {Fc2Mode::kAtomic, Fc2Mode::kDeterministic}) {
        SCOPED_TRACE(fc2_mode_name(m));
        Problem p(cs, m);
        Status st = p.run();
        ASSERT_TRUE(st.ok()) << st.message();
        CUDA_OK(cudaDeviceSynchronize());
        p.check(m, p.result());
      }
    }
  }
}

TEST(MoeFc2Gpu, Mxfp4BadInput) {
  SKIP_WITHOUT_HOPPER();
  Case c;
  c.mx = true;
  c.fp8 = MoeFp8Scaling::kBlock;
  c.I = 256;
  Problem p(c, Fc2Mode::kAtomic);
  auto expect_error = [&](const Fc2FinalizeArgs& a, const char* arg, StatusCode code) {
    const Status st = moe_fc2_finalize(a, p.dws.get(), p.dws.bytes(), nullptr);
    EXPECT_EQ(st.code(), code) << arg << ": " << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  };
  Fc2FinalizeArgs a = p.args;
  a.w2_mx_scales = nullptr;
  expect_error(a, "w2_mx_scales", StatusCode::kInvalidArgument);
  a = p.args;
  a.fp8 = MoeFp8Scaling::kTensor;
  expect_error(a, "fp8", StatusCode::kInvalidArgument);
  a = p.args;
  a.inter = 160;
  expect_error(a, "inter", StatusCode::kInvalidArgument);
  a = p.args;
  a.tuning.gemm_kernel = Fc2GemmKernel::kCutlassPingpong;
  expect_error(a, "gemm_kernel", StatusCode::kNotSupported);
  a = p.args;
  a.out = const_cast<void*>(p.args.w2_mx_scales);  // overlaps an input
  expect_error(a, "w2_mx_scales", StatusCode::kInvalidArgument);
  p.expect_out_untouched();
}
