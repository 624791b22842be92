// quantize_fp8 on the GPU against the CPU reference, bit for bit: every
// byte of the e4m3 output buffer (row and matrix padding included, which
// must keep its poison) and of the scales, on fresh random inputs with
// outlier channels, for both block shapes and both scale formats; odd row
// counts, partial 128-row blocks, batches of matrices, strides and pointers
// off the 16-byte grid (the narrower access paths), special values, zero
// work, CUDA graphs, PDL, and bad input (nothing written).
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/fp8_testing.h"
#include "common/gpu_testing.h"
#include "common/test_data.h"
#include "flashmix/fp8.h"
#include "fp8/quantize_fp8_device.cuh"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr uint8_t kPoison = 0xa5;
constexpr size_t kSlack = 64;  // poisoned bytes after each output, checked too

struct Case {
  int64_t batch = 1, rows = 33, cols = 512;
  int64_t x_pad = 0, q_pad = 0;              // extra elements per row
  int64_t x_batch_pad = 0, q_batch_pad = 0;  // extra elements per matrix (batch > 1)
  int64_t x_lead = 0, q_lead = 0, s_lead = 0;  // elements before the first (pointers off the 16-byte grid)
  Fp8Block block = Fp8Block::k1x128;
  ScaleFormat format = ScaleFormat::kFloat32;
  bool specials = false;  // plant NaN, infinite, zero, subnormal and huge-value blocks
  bool enable_pdl = true;
};

std::string describe(const Case& c) {
  return std::string(to_string(c.block)) + " " + to_string(c.format) + " batch=" + std::to_string(c.batch) +
         " rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) + " pads=" +
         std::to_string(c.x_pad) + "/" + std::to_string(c.q_pad) + " leads=" + std::to_string(c.x_lead) + "/" +
         std::to_string(c.q_lead) + "/" + std::to_string(c.s_lead);
}

struct Problem {
  Case c;
  int64_t xs, qs, xbs, qbs;  // strides
  std::vector<uint16_t> x;   // host input, c.x_lead elements first
  std::vector<uint8_t> q_ref, s_ref;  // reference output buffers (poison where nothing is written)
  size_t q_bytes = 0, s_bytes = 0;    // output buffers, lead and slack included
  DeviceBuffer d_x, d_q, d_s;
  QuantizeFp8Args args;  // device pointers

  explicit Problem(const Case& cs, uint64_t salt = 0) : c(cs) {
    Rng rng(test_seed() ^ (salt * 0x9e3779b97f4a7c15ull) ^ uint64_t(c.rows * 131 + c.cols * 7 + c.batch));
    xs = c.cols + c.x_pad;
    qs = c.cols + c.q_pad;
    xbs = c.rows * xs + c.x_batch_pad;
    qbs = c.rows * qs + c.q_batch_pad;
    x = random_fp8_input(rng, c.batch, c.rows, c.cols, xs, xbs, c.x_lead);
    if (c.specials) plant_specials(rng);
    const int64_t br = fp8_block_rows(c.block);
    const int64_t n_scales = c.batch * ((c.rows + br - 1) / br) * (c.cols / 128);
    const int64_t sb = c.format == ScaleFormat::kUE8M0 ? 1 : 4;
    const int64_t q_extent = c.batch * c.rows == 0 ? 0 : (c.batch - 1) * qbs + (c.rows - 1) * qs + c.cols;
    q_bytes = size_t(c.q_lead + q_extent) + kSlack;
    s_bytes = size_t((c.s_lead + n_scales) * sb) + kSlack;

    args.x_stride = xs;
    args.q_stride = qs;
    args.x_batch_stride = xbs;
    args.q_batch_stride = qbs;
    args.batch = c.batch;
    args.rows = c.rows;
    args.cols = c.cols;
    args.block = c.block;
    args.scale_format = c.format;
    args.enable_pdl = c.enable_pdl;

    q_ref.assign(q_bytes, kPoison);
    s_ref.assign(s_bytes, kPoison);
    QuantizeFp8Args h = args;
    h.x = x.data() + c.x_lead;
    h.q = q_ref.data() + c.q_lead;
    h.scales = s_ref.data() + c.s_lead * sb;
    const Status st = quantize_fp8_cpu(h);
    EXPECT_TRUE(st.ok()) << st.message();

    d_x = DeviceBuffer(x);  // ends where the last row ends: memcheck sees any read past it
    d_q = DeviceBuffer(q_bytes);
    d_s = DeviceBuffer(s_bytes);
    args.x = d_x.as<uint16_t>() + c.x_lead;
    args.q = d_q.as<uint8_t>() + c.q_lead;
    args.scales = d_s.as<uint8_t>() + c.s_lead * sb;
    reset_outputs();
  }

  // Special blocks in the first matrix (1 x 128 blocks of row r, or the
  // rows of a 128-row block that row r starts): a NaN, an infinity, all
  // zeros, bf16 subnormals only, one huge value among small ones.
  void plant_specials(Rng& rng) {
    if (c.rows == 0 || c.batch == 0) return;
    auto at = [&](int64_t r, int64_t col) -> uint16_t& { return x[size_t(c.x_lead + r * xs + col)]; };
    const int64_t blocks = c.cols / 128;
    int kind = 0;
    for (int64_t r = 0; r < c.rows; r += (c.block == Fp8Block::k128x128 ? 128 : 1))
      for (int64_t b = 0; b < blocks; ++b, ++kind) {
        const int64_t col0 = b * 128, r_end = std::min(c.rows, r + fp8_block_rows(c.block));
        switch (kind % 7) {
          case 0: at(r, col0 + rng.integer(0, 127)) = host::float_to_bf16(std::nanf("")); break;
          case 1: at(r_end - 1, col0 + rng.integer(0, 127)) = (kind & 8) ? 0xff80 : 0x7f80; break;  // -inf / +inf
          case 2:
            for (int64_t rr = r; rr < r_end; ++rr)
              for (int64_t k = 0; k < 128; ++k) at(rr, col0 + k) = (k & 1) ? 0x8000 : 0x0000;  // +-0
            break;
          case 3:
            for (int64_t rr = r; rr < r_end; ++rr)
              for (int64_t k = 0; k < 128; ++k) at(rr, col0 + k) = uint16_t(rng.integer(0, 0x7f) | ((k & 1) ? 0x8000 : 0));
            break;
          case 4: at(r, col0 + rng.integer(0, 127)) = host::float_to_bf16(-3.0e38f); break;
          default: break;  // ordinary random blocks
        }
      }
  }

  void reset_outputs() {
    std::vector<uint8_t> pq(q_bytes, kPoison), ps(s_bytes, kPoison);
    d_q.upload(pq.data(), pq.size());
    d_s.upload(ps.data(), ps.size());
  }

  // Every byte of both output buffers against the reference's.
  void expect_matches() const {
    const std::vector<uint8_t> q = d_q.to_host<uint8_t>(), s = d_s.to_host<uint8_t>();
    int64_t bad = 0;
    for (size_t i = 0; i < q_bytes; ++i)
      if (q[i] != q_ref[i] && ++bad <= 5)
        ADD_FAILURE() << "q byte " << i << " (element offset " << int64_t(i) - c.q_lead << "): gpu 0x" << std::hex
                      << int(q[i]) << " ref 0x" << int(q_ref[i]) << std::dec;
    EXPECT_EQ(bad, 0) << "q bytes differ from the reference";
    bad = 0;
    for (size_t i = 0; i < s_bytes; ++i)
      if (s[i] != s_ref[i] && ++bad <= 5)
        ADD_FAILURE() << "scale byte " << i << ": gpu 0x" << std::hex << int(s[i]) << " ref 0x" << int(s_ref[i])
                      << std::dec;
    EXPECT_EQ(bad, 0) << "scale bytes differ from the reference";
  }

  void run(cudaStream_t stream = nullptr) {
    reset_outputs();
    const Status st = quantize_fp8(args, stream);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
};

void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Problem p(c);
  p.run();
  p.expect_matches();
}

constexpr Fp8Block kBlocks[] = {Fp8Block::k1x128, Fp8Block::k128x128};
constexpr ScaleFormat kFormats[] = {ScaleFormat::kFloat32, ScaleFormat::kUE8M0};

}  // namespace

TEST(QuantizeFp8Gpu, MatchesTheReferenceBitwise) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (ScaleFormat f : kFormats)
      for (int64_t rows : {1, 7, 128, 129, 300})
        for (int64_t cols : {128, 640}) {
          Case c;
          c.block = blk;
          c.format = f;
          c.rows = rows;
          c.cols = cols;
          check_case(c);
        }
}

TEST(QuantizeFp8Gpu, ActivationSizedRows) {
  SKIP_WITHOUT_GPU();
  for (ScaleFormat f : kFormats) {
    Case c;
    c.rows = 1001;
    c.cols = 7168;
    c.format = f;
    check_case(c);
  }
}

// [E, N, K] weights with N not a multiple of 128: the last row block of each
// expert is partial and blocks never cross experts.
TEST(QuantizeFp8Gpu, BatchedWeightsWithAPartialLastRowBlock) {
  SKIP_WITHOUT_GPU();
  for (ScaleFormat f : kFormats)
    for (int64_t N : {300, 128, 77}) {
      Case c;
      c.block = Fp8Block::k128x128;
      c.format = f;
      c.batch = 5;
      c.rows = N;
      c.cols = 1024;
      check_case(c);
    }
  Case c;  // a batch of activations too
  c.batch = 3;
  c.rows = 45;
  c.cols = 384;
  check_case(c);
}

// Row and matrix strides, and pointers a few elements past a 16-byte
// boundary: each access width (8, 4, 2, 1 elements) on both kernels, the
// padding left as it was.
TEST(QuantizeFp8Gpu, StridesAndPointersOffThe16ByteGrid) {
  SKIP_WITHOUT_GPU();
  struct Layout {
    int64_t x_pad, q_pad, x_batch_pad, q_batch_pad, x_lead, q_lead, s_lead;
  };
  const Layout layouts[] = {
      {8, 16, 0, 0, 0, 0, 0},   // padded rows, 16-byte grid kept
      {24, 8, 40, 3, 0, 0, 1},  // an odd q matrix stride: 1-element accesses
      {4, 4, 0, 0, 4, 4, 0},    // 4-element accesses
      {2, 6, 0, 0, 2, 2, 3},    // 2-element accesses
      {1, 3, 5, 7, 1, 1, 1},    // 1-element accesses (odd strides and pointers)
      {0, 0, 0, 0, 0, 1, 0},    // only q off the grid
      {0, 0, 0, 0, 1, 0, 0},    // only x off the grid
  };
  for (Fp8Block blk : kBlocks)
    for (ScaleFormat f : kFormats)
      for (const Layout& l : layouts) {
        Case c;
        c.block = blk;
        c.format = f;
        c.batch = 2;
        c.rows = 131;
        c.cols = 256;
        c.x_pad = l.x_pad;
        c.q_pad = l.q_pad;
        c.x_batch_pad = l.x_batch_pad;
        c.q_batch_pad = l.q_batch_pad;
        c.x_lead = l.x_lead;
        c.q_lead = l.q_lead;
        c.s_lead = l.s_lead;
        check_case(c);
      }
}

// NaN blocks (scale NaN, every element 0x7f), infinities, zero blocks
// (scale 1), bf16 subnormals (fp32-subnormal scales, no flushing), huge values.
TEST(QuantizeFp8Gpu, SpecialValuesMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (ScaleFormat f : kFormats) {
      Case c;
      c.block = blk;
      c.format = f;
      c.rows = blk == Fp8Block::k128x128 ? 1000 : 40;
      c.cols = 896;
      c.specials = true;
      check_case(c);
    }
}

TEST(QuantizeFp8Gpu, ZeroRowsOrBatchLaunchNothing) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (int64_t batch : {0, 1, 3}) {
      Case c;
      c.block = blk;
      c.batch = batch;
      c.rows = batch == 1 ? 0 : 5;
      if (batch == 3) c.rows = 0;
      Problem p(c);
      p.run();
      p.expect_matches();  // the reference wrote nothing: all poison
      QuantizeFp8Args a = p.args;
      a.x = nullptr;  // no work: pointers are not needed
      a.q = nullptr;
      a.scales = nullptr;
      EXPECT_TRUE(quantize_fp8(a, nullptr).ok());
    }
  CUDA_OK(cudaDeviceSynchronize());
}

// Results do not depend on PDL; a rerun gives the same bytes.
TEST(QuantizeFp8Gpu, PdlOffGivesTheSameBytes) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks) {
    Case c;
    c.block = blk;
    c.rows = 257;
    c.enable_pdl = false;
    check_case(c);
  }
}

TEST(QuantizeFp8Gpu, CapturableInACudaGraph) {
  SKIP_WITHOUT_GPU();
  for (Fp8Block blk : kBlocks)
    for (ScaleFormat f : kFormats) {
      Case c;
      c.block = blk;
      c.format = f;
      c.batch = 2;
      c.rows = 190;
      c.cols = 384;
      SCOPED_TRACE(describe(c));
      Problem p(c);
      cudaStream_t stream;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      p.reset_outputs();
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < 2; ++i) {
        const Status st = quantize_fp8(p.args, stream);
        EXPECT_TRUE(st.ok()) << st.message();
      }
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      // Nothing ran during the capture: the outputs still hold their poison.
      CUDA_OK(cudaStreamSynchronize(stream));
      {
        const std::vector<uint8_t> q = p.d_q.to_host<uint8_t>();
        EXPECT_EQ(q, std::vector<uint8_t>(p.q_bytes, kPoison)) << "written during capture";
      }
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      p.expect_matches();
      CUDA_OK(cudaGraphExecDestroy(exec));
      CUDA_OK(cudaGraphDestroy(graph));
      CUDA_OK(cudaStreamDestroy(stream));
    }
}

// spec §12.4 on the GPU entry point: the error names the argument, nothing
// is launched, the (poisoned) outputs are left exactly as they were.
TEST(QuantizeFp8GpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.batch = 2;
  c.rows = 20;
  c.cols = 256;
  Problem p(c);
  struct Bad {
    const char* argument;
    void (*mutate)(QuantizeFp8Args&);
  };
  const Bad bad[] = {
      {"x", [](QuantizeFp8Args& a) { a.x = nullptr; }},
      {"q", [](QuantizeFp8Args& a) { a.q = nullptr; }},
      {"scales", [](QuantizeFp8Args& a) { a.scales = nullptr; }},
      {"cols", [](QuantizeFp8Args& a) { a.cols = 192; }},
      {"rows", [](QuantizeFp8Args& a) { a.rows = -1; }},
      {"x_stride", [](QuantizeFp8Args& a) { a.x_stride = 100; }},
      {"q_batch_stride", [](QuantizeFp8Args& a) { a.q_batch_stride = 256; }},
      {"block", [](QuantizeFp8Args& a) { a.block = Fp8Block(3); }},
      {"scale_format", [](QuantizeFp8Args& a) { a.scale_format = ScaleFormat(5); }},
      {"x", [](QuantizeFp8Args& a) { a.x = static_cast<const char*>(a.x) + 1; }},
      {"scales", [](QuantizeFp8Args& a) { a.scales = static_cast<char*>(a.scales) + 1; }},
      {"q", [](QuantizeFp8Args& a) { a.q = const_cast<void*>(a.x); }},
  };
  for (const Bad& b : bad) {
    QuantizeFp8Args a = p.args;
    b.mutate(a);
    p.reset_outputs();
    const Status st = quantize_fp8(a, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_NE(st.message().find(std::string(": ") + b.argument + ": "), std::string::npos) << st.message();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error left set (" << b.argument << ")";
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(p.d_q.to_host<uint8_t>(), std::vector<uint8_t>(p.q_bytes, kPoison)) << "q written (" << b.argument << ")";
    EXPECT_EQ(p.d_s.to_host<uint8_t>(), std::vector<uint8_t>(p.s_bytes, kPoison))
        << "scales written (" << b.argument << ")";
  }
}

// A stream whose capture an earlier illegal call invalidated is rejected,
// naming the stream; nothing is written.
TEST(QuantizeFp8GpuErrors, AStreamWithAnInvalidatedCaptureIsRejected) {
  SKIP_WITHOUT_GPU();
  Case c;
  Problem p(c);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_NE(cudaStreamSynchronize(stream), cudaSuccess);  // illegal while capturing: invalidates the capture
  (void)cudaGetLastError();
  const Status st = quantize_fp8(p.args, stream);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("stream"), std::string::npos) << st.message();
  cudaGraph_t graph = nullptr;
  EXPECT_NE(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(p.d_q.to_host<uint8_t>(), std::vector<uint8_t>(p.q_bytes, kPoison));
  CUDA_OK(cudaStreamDestroy(stream));
}

// The block divider of every FP8 quantisation (fp8_dev::ScaleDivisor, an
// rcp once per block and 5 instructions a value) against __fdiv_rn, bit for
// bit, on 2^24 quotients a launch: scales log-uniform over its fast range
// [2^-60, 2^100] and past both ends (there quantize8_f32 divides), powers of two (ue8m0),
// scales with all-ones significands, x anywhere in [-448 s, 448 s] and at e4m3
// rounding midpoints times s.
namespace {

__device__ __forceinline__ uint32_t mix32(uint32_t v) {
  v ^= v >> 16; v *= 0x7feb352du; v ^= v >> 15; v *= 0x846ca68bu; v ^= v >> 16;
  return v;
}

__global__ void scale_divisor_mismatches(uint32_t seed, unsigned long long* bad, float* example) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t h1 = mix32(i ^ seed), h2 = mix32(h1 + 0x9e3779b9u), h3 = mix32(h2 + 0x85ebca6bu);
  // The scale: a random significand and an exponent in [-70, 110].
  float s;
  switch (h1 & 3) {
    case 0: s = ldexpf(1.0f, int(h2 % 181) - 70); break;                               // power of two
    case 1: s = ldexpf(__uint_as_float(0x3fffffffu), int(h2 % 181) - 70); break;       // significand all ones
    default: s = ldexpf(__uint_as_float(0x3f800000u | (h2 >> 9)), int(h2 % 181) - 70); // any
  }
  // x: a random fraction of 448 s, or an e4m3 value / midpoint times s.
  float x;
  if (h3 & 1) {
    x = __fmul_rn(__fmul_rn(float(h3 >> 8) * 0x1p-24f * 448.0f, s), (h3 & 2) ? -1.0f : 1.0f);
  } else {
    const float m = ldexpf(float(8 + ((h3 >> 4) & 15)) * 0.0625f, int((h3 >> 8) % 19) - 10);  // 5-bit significands
    x = __fmul_rn(m, s);
  }
  const flashmix::fp8_dev::ScaleDivisor d = flashmix::fp8_dev::scale_divisor(s);
  const float want = __fdiv_rn(x, s), got = d.fast ? d.fast_div(x) : want;
  if (__float_as_uint(got) != __float_as_uint(want)) {
    if (atomicAdd(bad, 1ull) == 0) {
      example[0] = x;
      example[1] = s;
      example[2] = got;
      example[3] = want;
    }
  }
}

}  // namespace

TEST(QuantizeFp8Gpu, ScaleDivisorIsBitwiseTheIeeeQuotient) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer bad(sizeof(unsigned long long)), example(4 * sizeof(float));
  CUDA_OK(cudaMemset(bad.get(), 0, bad.bytes()));
  for (uint32_t seed : {1u, 0x2545f491u, 0xdeadbeefu, 12345u}) {
    scale_divisor_mismatches<<<1 << 16, 256>>>(seed, bad.as<unsigned long long>(), example.as<float>());
    CUDA_OK(cudaGetLastError());
  }
  CUDA_OK(cudaDeviceSynchronize());
  const auto n = bad.to_host<unsigned long long>()[0];
  const auto e = example.to_host<float>();
  EXPECT_EQ(n, 0ull) << "first: " << e[0] << " / " << e[1] << " = " << e[2] << ", __fdiv_rn " << e[3];
}
