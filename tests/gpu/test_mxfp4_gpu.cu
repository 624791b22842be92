// mxfp4_to_fp8_block and mxfp4_to_bf16 on the GPU against their CPU
// references (spec §13), byte for byte: every byte of the output buffers,
// with poisoned slack after each that must stay poisoned, on fresh random
// weights (rows far below their block's top, NaN scales), both scale groups
// (128 x 128 and 1 x 128), odd batches and row counts, partial row blocks,
// every scale byte and code, zero work, PDL off, CUDA graphs, and bad input
// (named, nothing written). End to end:
// MXFP4 expert weights -> mxfp4_to_fp8_block -> the FP8 moe_forward (kBlock)
// against the bf16 moe_forward on mxfp4_to_bf16 of the same weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/mxfp4_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "flashmix/mxfp4.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr uint8_t kPoison = 0xa5;
constexpr size_t kSlack = 64;  // poisoned bytes after each output, checked too

struct Case {
  int64_t batch = 1, rows = 33, cols = 256;
  Mxfp4Options data;
  Fp8Block block = Fp8Block::k128x128;
  bool enable_pdl = true;
};

std::string describe(const Case& c) {
  return std::string(to_string(c.block)) + " batch=" + std::to_string(c.batch) + " rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) +
         " deep_row_every=" + std::to_string(c.data.deep_row_every) + " nan_every=" + std::to_string(c.data.nan_every);
}

// Every byte of `got` against `want`; the first few differences reported.
void expect_bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && ++bad <= 5)
      ADD_FAILURE() << what << " byte " << i << ": gpu 0x" << std::hex << int(got[i]) << " ref 0x" << int(want[i])
                    << std::dec;
  EXPECT_EQ(bad, 0) << what << " bytes differ from the reference";
}

// Both conversions of one random MXFP4 tensor, on the GPU and the CPU.
struct Problem {
  Case c;
  Mxfp4Data data;
  size_t q_bytes, qs_bytes, out_bytes;  // output buffers, slack included
  std::vector<uint8_t> q_ref, qs_ref, out_ref;
  DeviceBuffer d_w, d_ws, d_q, d_qs, d_out;
  Mxfp4ToFp8BlockArgs fp8;  // device pointers
  Mxfp4ToBf16Args bf16;

  explicit Problem(const Case& cs, Mxfp4Data given = {}) : c(cs) {
    Rng rng(test_seed() ^ uint64_t(c.batch * 7919 + c.rows * 131 + c.cols));
    data = given.w.empty() ? random_mxfp4(rng, c.batch, c.rows, c.cols, c.data) : std::move(given);
    const int64_t elems = c.batch * c.rows * c.cols;
    const int64_t br = fp8_block_rows(c.block);
    const int64_t blocks = c.cols % 128 == 0 ? c.batch * ((c.rows + br - 1) / br) * (c.cols / 128) : 0;
    q_bytes = size_t(elems) + kSlack;
    qs_bytes = size_t(blocks * 4) + kSlack;
    out_bytes = size_t(elems * 2) + kSlack;
    q_ref.assign(q_bytes, kPoison);
    qs_ref.assign(qs_bytes, kPoison);
    out_ref.assign(out_bytes, kPoison);

    fp8.batch = c.batch, fp8.rows = c.rows, fp8.cols = c.cols, fp8.enable_pdl = c.enable_pdl, fp8.block = c.block;
    bf16.batch = c.batch, bf16.rows = c.rows, bf16.cols = c.cols, bf16.enable_pdl = c.enable_pdl;
    if (blocks > 0) {
      Mxfp4ToFp8BlockArgs h = fp8;
      h.w = data.w.data(), h.w_scales = data.scales.data(), h.q = q_ref.data();
      h.q_scales = reinterpret_cast<float*>(qs_ref.data());
      const Status st = mxfp4_to_fp8_block_cpu(h);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    Mxfp4ToBf16Args hb = bf16;
    hb.w = data.w.data(), hb.w_scales = data.scales.data(), hb.out = out_ref.data();
    const Status st = mxfp4_to_bf16_cpu(hb);
    EXPECT_TRUE(st.ok()) << st.message();

    d_w = DeviceBuffer(data.w);  // ends where the last row ends: memcheck sees any read past it
    d_ws = DeviceBuffer(data.scales);
    d_q = DeviceBuffer(q_bytes);
    d_qs = DeviceBuffer(qs_bytes);
    d_out = DeviceBuffer(out_bytes);
    fp8.w = bf16.w = d_w.get();
    fp8.w_scales = bf16.w_scales = d_ws.get();
    fp8.q = d_q.get();
    fp8.q_scales = d_qs.as<float>();
    bf16.out = d_out.get();
    reset_outputs();
  }

  void reset_outputs() {
    CUDA_OK(cudaMemset(d_q.get(), kPoison, q_bytes));
    CUDA_OK(cudaMemset(d_qs.get(), kPoison, qs_bytes));
    CUDA_OK(cudaMemset(d_out.get(), kPoison, out_bytes));
    CUDA_OK(cudaDeviceSynchronize());
  }

  void run(cudaStream_t stream = nullptr) {
    reset_outputs();
    if (c.cols % 128 == 0) {
      const Status st = mxfp4_to_fp8_block(fp8, stream);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    const Status st = mxfp4_to_bf16(bf16, stream);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }

  void expect_matches() const {
    expect_bytes_equal(d_q.to_host<uint8_t>(), q_ref, "q");
    expect_bytes_equal(d_qs.to_host<uint8_t>(), qs_ref, "q_scales");
    expect_bytes_equal(d_out.to_host<uint8_t>(), out_ref, "bf16 out");
  }
};

void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Problem p(c);
  p.run();
  p.expect_matches();
}

}  // namespace

constexpr Fp8Block kBlocks[] = {Fp8Block::k128x128, Fp8Block::k1x128};

TEST(Mxfp4Gpu, MatchesTheReferenceBitwise) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (int64_t batch : {1, 3})
      for (int64_t rows : {1, 7, 128, 129, 300})
        for (int64_t cols : {128, 640}) {
          Case c;
          c.block = blk;
          c.batch = batch;
          c.rows = rows;
          c.cols = cols;
          check_case(c);
        }
}

// Rows 15..22 binades under their block's top (the inexact spreads of spec
// §13.2 with 128 x 128 groups), sub-blocks up to 8 binades under their row's
// top, and NaN scales: the rounding and the NaN bytes match the reference.
TEST(Mxfp4Gpu, DeepRowsAndNaNScalesMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (int64_t rows : {5, 257}) {
      Case c;
      c.block = blk;
      c.batch = 2;
      c.rows = rows;
      c.cols = 512;
      c.data.deep_row_every = 3;
      c.data.nan_every = 17;
      c.data.group_wobble = 8;
      check_case(c);
    }
}

// bf16 takes any multiple of 32 along K (the fp8 path is skipped where K % 128 != 0).
TEST(Mxfp4Gpu, Bf16TakesAnyMultipleOf32) {
  SKIP_WITHOUT_GPU();
  for (int64_t cols : {32, 96, 160}) {
    Case c;
    c.batch = 3;
    c.rows = 5;
    c.cols = cols;
    check_case(c);
  }
}

// Every scale byte 0..254 (and 255) with every code in both nibbles, 2
// blocks of rows: the extremes (bf16 overflow to inf, fp32-subnormal block
// scales) and the largest spreads.
TEST(Mxfp4Gpu, EveryScaleByteAndCode) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks) {
    Case c;
    c.block = blk;
    c.rows = 256;
    c.cols = 128;
    Mxfp4Data d;
    for (int64_t r = 0; r < c.rows; ++r)
      for (int g = 0; g < 4; ++g) {
        for (int j = 0; j < 16; ++j) d.w.push_back(uint8_t(((j + r) & 15) | (((j + g) & 15) << 4)));
        d.scales.push_back(uint8_t((r * 4 + g * 61) % 256));  // 255 (NaN) included; rows spread up to 183
      }
    SCOPED_TRACE(describe(c));
    Problem p(c, d);
    p.run();
    p.expect_matches();
  }
}

TEST(Mxfp4Gpu, ZeroBatchOrRowsLaunchNothing) {
  SKIP_WITHOUT_GPU();
  for (int64_t batch : {0, 2}) {
    Case c;
    c.batch = batch;
    c.rows = batch == 0 ? 5 : 0;
    Problem p(c);
    p.run();
    p.expect_matches();  // the references wrote nothing: all poison
    Mxfp4ToFp8BlockArgs f = p.fp8;
    f.w = f.w_scales = nullptr;  // no work: pointers are not needed
    f.q = nullptr;
    f.q_scales = nullptr;
    EXPECT_TRUE(mxfp4_to_fp8_block(f, nullptr).ok());
    Mxfp4ToBf16Args b = p.bf16;
    b.w = b.w_scales = b.out = nullptr;
    EXPECT_TRUE(mxfp4_to_bf16(b, nullptr).ok());
  }
  CUDA_OK(cudaDeviceSynchronize());
}

TEST(Mxfp4Gpu, PdlOffGivesTheSameBytes) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 131;
  c.enable_pdl = false;
  check_case(c);
}

TEST(Mxfp4Gpu, CapturableInACudaGraph) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.batch = 2;
  c.rows = 190;
  c.cols = 384;
  SCOPED_TRACE(describe(c));
  Problem p(c);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 2; ++i) {
    Status st = mxfp4_to_fp8_block(p.fp8, stream);
    EXPECT_TRUE(st.ok()) << st.message();
    st = mxfp4_to_bf16(p.bf16, stream);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(p.d_q.to_host<uint8_t>(), std::vector<uint8_t>(p.q_bytes, kPoison)) << "written during capture";
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  p.expect_matches();
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

// spec §13.5 on the GPU entry points: the error names the argument, nothing
// is launched, the poisoned outputs stay as they were, no CUDA error is left.
TEST(Mxfp4GpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.batch = 2;
  c.rows = 20;
  Problem p(c);
  auto expect_untouched = [&](const char* arg) {
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(p.d_q.to_host<uint8_t>(), std::vector<uint8_t>(p.q_bytes, kPoison)) << "q written (" << arg << ")";
    EXPECT_EQ(p.d_qs.to_host<uint8_t>(), std::vector<uint8_t>(p.qs_bytes, kPoison)) << arg;
    EXPECT_EQ(p.d_out.to_host<uint8_t>(), std::vector<uint8_t>(p.out_bytes, kPoison)) << arg;
  };
  struct BadFp8 {
    const char* argument;
    void (*mutate)(Mxfp4ToFp8BlockArgs&);
  };
  const BadFp8 bad_fp8[] = {
      {"cols", [](Mxfp4ToFp8BlockArgs& a) { a.cols = 160; }},  // a multiple of 32, not of 128
      {"rows", [](Mxfp4ToFp8BlockArgs& a) { a.rows = -3; }},
      {"w", [](Mxfp4ToFp8BlockArgs& a) { a.w = nullptr; }},
      {"w_scales", [](Mxfp4ToFp8BlockArgs& a) { a.w_scales = nullptr; }},
      {"q_scales", [](Mxfp4ToFp8BlockArgs& a) { a.q_scales = nullptr; }},
      {"w", [](Mxfp4ToFp8BlockArgs& a) { a.w = static_cast<const char*>(a.w) + 8; }},
      {"q", [](Mxfp4ToFp8BlockArgs& a) { a.q = static_cast<char*>(a.q) + 1; }},
      {"q", [](Mxfp4ToFp8BlockArgs& a) { a.q = const_cast<void*>(a.w); }},
      {"block", [](Mxfp4ToFp8BlockArgs& a) { a.block = Fp8Block(4); }},
  };
  for (const BadFp8& b : bad_fp8) {
    Mxfp4ToFp8BlockArgs a = p.fp8;
    b.mutate(a);
    const Status st = mxfp4_to_fp8_block(a, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_NE(st.message().find(std::string("mxfp4_to_fp8_block: ") + b.argument + ": "), std::string::npos)
        << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error left set (" << b.argument << ")";
    expect_untouched(b.argument);
  }
  struct BadBf16 {
    const char* argument;
    void (*mutate)(Mxfp4ToBf16Args&);
  };
  const BadBf16 bad_bf16[] = {
      {"cols", [](Mxfp4ToBf16Args& a) { a.cols = 48; }},
      {"out", [](Mxfp4ToBf16Args& a) { a.out = nullptr; }},
      {"out", [](Mxfp4ToBf16Args& a) { a.out = static_cast<char*>(a.out) + 2; }},
      {"out", [](Mxfp4ToBf16Args& a) { a.out = const_cast<void*>(a.w); }},
  };
  for (const BadBf16& b : bad_bf16) {
    Mxfp4ToBf16Args a = p.bf16;
    b.mutate(a);
    const Status st = mxfp4_to_bf16(a, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_NE(st.message().find(std::string("mxfp4_to_bf16: ") + b.argument + ": "), std::string::npos)
        << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    expect_untouched(b.argument);
  }
}

// ---------------------------------------------------------------------------
// End to end: MXFP4 experts through the FP8 layer and through the bf16 layer
// ---------------------------------------------------------------------------

namespace {

struct LayerCase {
  int64_t T = 64, H = 512, I = 256;
  int k = 6, E = 16, start = 0, local = 16;
};

// Converted on the GPU: W1, W2 of `local` experts as FP8 blocks and as bf16.
struct ConvertedWeights {
  DeviceBuffer q, qs, bf16;
  Status convert(const Mxfp4Data& d, int64_t E, int64_t rows, int64_t cols) {
    DeviceBuffer w(d.w), s(d.scales);
    q = DeviceBuffer(size_t(E * rows * cols));
    qs = DeviceBuffer(size_t(E * ((rows + 127) / 128) * (cols / 128) * 4));
    bf16 = DeviceBuffer(size_t(E * rows * cols * 2));
    Mxfp4ToFp8BlockArgs f;
    f.w = w.get(), f.w_scales = s.get(), f.q = q.get(), f.q_scales = qs.as<float>();
    f.batch = E, f.rows = rows, f.cols = cols;
    Mxfp4ToBf16Args b;
    b.w = w.get(), b.w_scales = s.get(), b.out = bf16.get();
    b.batch = E, b.rows = rows, b.cols = cols;
    Status st = mxfp4_to_fp8_block(f, nullptr);
    if (st.ok()) st = mxfp4_to_bf16(b, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return st;
  }
};

// Every element of the FP8 blocks, dequantised, equals the bf16 weight
// (spreads stay under 15 in these weights, so the conversion is exact).
void expect_fp8_equals_bf16(const ConvertedWeights& c, int64_t E, int64_t rows, int64_t cols) {
  const std::vector<uint8_t> q = c.q.to_host<uint8_t>();
  const std::vector<float> s = c.qs.to_host<float>();
  const std::vector<uint16_t> h = c.bf16.to_host<uint16_t>();
  const int64_t rb = (rows + 127) / 128, cb = cols / 128;
  int64_t bad = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) {
        const int64_t i = (e * rows + r) * cols + k;
        const float v = host::e4m3_to_float(q[size_t(i)]) * s[size_t((e * rb + r / 128) * cb + k / 128)];
        if (v != host::bf16_to_float(h[size_t(i)]) && ++bad <= 5) ADD_FAILURE() << "element " << i;
      }
  EXPECT_EQ(bad, 0);
}

}  // namespace

// MXFP4 weights -> mxfp4_to_fp8_block -> moe_forward (kBlock), against
// moe_forward (bf16) on mxfp4_to_bf16 of the same weights, with V4's
// clamped SwiGLU and gate/up W1. The weights are the same values in both
// (checked element by element), so the layers differ only by the FP8
// layer's quantisation of X and of FC1's output: the relative Frobenius
// error is printed and held to 2^-3 as the FP8 layer's own test against its
// bf16 twin (test_moe_forward_gpu.cu, Fp8AgainstBf16LayerOnTheSameWeights);
// each e4m3 rounding is about 2.4% rms, a wrong scale, row or nibble gives
// errors of order 1.
TEST(Mxfp4Gpu, Fp8LayerOnConvertedWeightsAgainstBf16Layer) {
  SKIP_WITHOUT_HOPPER_FOR("moe_forward");
  LayerCase cases[2];
  cases[1].T = 3;  // decode-sized, one rank of an expert-parallel split
  cases[1].start = 4;
  cases[1].local = 8;
  for (const LayerCase& c : cases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " start=" + std::to_string(c.start));
    Rng rng(test_seed() ^ 0x4f4ull);
    Mxfp4Options o;  // about 2^-7: FC1's sums of 512 products stay of order 1
    const Mxfp4Data w1 = random_mxfp4(rng, c.local, 2 * c.I, c.H, o);
    const Mxfp4Data w2 = random_mxfp4(rng, c.local, c.H, c.I, o);
    ConvertedWeights c1, c2;
    ASSERT_TRUE(c1.convert(w1, c.local, 2 * c.I, c.H).ok());
    ASSERT_TRUE(c2.convert(w2, c.local, c.H, c.I).ok());
    expect_fp8_equals_bf16(c1, c.local, 2 * c.I, c.H);
    expect_fp8_equals_bf16(c2, c.local, c.H, c.I);

    HostTensor X(DType::kBFloat16, c.T * c.H);
    X.fill_random(rng);
    const Routing r = random_routing(rng, c.T, c.k, c.E, c.start, c.local);
    std::vector<float> weights(size_t(c.T * c.k));
    for (float& v : weights) v = rng.uniform(0.1f, 1.0f);
    DeviceBuffer dX(X.bytes), dids(r.experts), dw(weights), out8(size_t(c.T * c.H * 2)), out16(size_t(c.T * c.H * 2));

    MoeForwardArgs a;
    a.num_tokens = c.T;
    a.hidden = c.H;
    a.inter = c.I;
    a.k = c.k;
    a.num_experts = c.E;
    a.start_expert_id = c.start;
    a.num_experts_per_node = c.local;
    a.X = dX.get();
    a.token_selected_experts = dids.as<int32_t>();
    a.token_final_scales = dw.as<float>();
    a.activation = MoeActivation::kSwiGLUClamped;
    a.fc2_mode = Fc2Mode::kDeterministic;
    MoeForwardArgs f8 = a, f16 = a;
    f8.fp8 = MoeFp8Scaling::kBlock;
    f8.W1 = c1.q.get();
    f8.w1_scales = c1.qs.as<float>();
    f8.W2 = c2.q.get();
    f8.w2_scales = c2.qs.as<float>();
    f8.out = out8.get();
    f16.W1 = c1.bf16.get();
    f16.W2 = c2.bf16.get();
    f16.out = out16.get();
    DeviceBuffer ws8(std::max<size_t>(256, moe_forward_workspace_size(f8)));
    DeviceBuffer ws16(std::max<size_t>(256, moe_forward_workspace_size(f16)));
    Status st = moe_forward(f8, ws8.get(), ws8.bytes(), nullptr);
    ASSERT_TRUE(st.ok()) << st.message();
    st = moe_forward(f16, ws16.get(), ws16.bytes(), nullptr);
    ASSERT_TRUE(st.ok()) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> o8 = out8.to_host<uint16_t>(), o16 = out16.to_host<uint16_t>();
    double num = 0, den = 0;
    for (size_t i = 0; i < o8.size(); ++i) {
      const double x8 = host::bf16_to_float(o8[i]), x16 = host::bf16_to_float(o16[i]);
      ASSERT_FALSE(std::isnan(x8) || std::isnan(x16)) << "i=" << i;
      num += (x8 - x16) * (x8 - x16);
      den += x16 * x16;
    }
    ASSERT_GT(den, 0.0);
    const double rel = std::sqrt(num / den);
    std::printf("[ mxfp4    ] T=%lld E_local=%d: FP8 layer on mxfp4_to_fp8_block weights vs bf16 layer on "
                "mxfp4_to_bf16 weights: rel. Frobenius error %.4f\n",
                (long long)c.T, c.local, rel);
    ::testing::Test::RecordProperty("mxfp4_fp8_vs_bf16_rel_error", std::to_string(rel));
    EXPECT_LE(rel, std::ldexp(1.0, -3));
  }
}
