// flashmix-bench cases for the MXFP4 conversions (spec §13): one rank's
// worth (EP 8) of DeepSeek-V4-Flash's and V4-Pro's expert weights through
// mxfp4_to_fp8_block (op "mxfp4_to_fp8_block") and, for V4-Flash's W1,
// through mxfp4_to_bf16 (op "mxfp4_to_bf16").
//
// Bytes counted (the minimum any implementation moves): the packed e2m1
// bytes and the ue8m0 scales read once, the output (e4m3 + fp32 block
// scales, or bf16) written once. Fraction = (bytes / time) / the
// device-to-device copy bandwidth measured in the same run. Every input is
// larger than L2. Verification: the CPU reference on the first and last 256
// rows of the first and last expert, bit for bit.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.h"
#include "flashmix/mxfp4.h"

namespace flashmix::bench {
namespace {

struct Mxfp4Case {
  std::string name;
  int64_t batch, rows, cols;  // experts, N, K
  bool bf16;                  // mxfp4_to_bf16 instead of mxfp4_to_fp8_block
};

// The conversion to FP8 blocks: W1 and W2 of V4-Flash (H 4096, I 2048, 256
// experts: 32 a rank) and W1 of V4-Pro (H 7168, I 3072, 384 experts: 48 a rank).
std::vector<Mxfp4Case> fp8_block_cases() {
  return {
      {"v4flash_ep8_w1_E32_N4096_K4096", 32, 4096, 4096, false},
      {"v4flash_ep8_w2_E32_N4096_K2048", 32, 4096, 2048, false},
      {"v4pro_ep8_w1_E48_N6144_K7168", 48, 6144, 7168, false},
  };
}

// The dequantisation to bf16 (W4A16 references): V4-Flash's W1.
std::vector<Mxfp4Case> bf16_cases() { return {{"v4flash_ep8_w1_E32_N4096_K4096", 32, 4096, 4096, true}}; }

int64_t row_blocks(const Mxfp4Case& c) { return (c.rows + 127) / 128; }
int64_t fp8_scale_count(const Mxfp4Case& c) { return c.batch * row_blocks(c) * (c.cols / 128); }

double counted_bytes(const Mxfp4Case& c) {
  const double n = double(c.batch) * c.rows * c.cols;
  const double in = n / 2 + n / 32;
  return c.bf16 ? in + 2 * n : in + n + 4.0 * fp8_scale_count(c);
}

// Random packed bytes; scale bytes 116..123 (2^-11 .. 2^-4, a checkpoint's range).
__global__ void fill_mxfp4(uint8_t* w, int64_t w_bytes, uint8_t* s, int64_t s_bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < w_bytes; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = (uint64_t(i) + seed) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    w[i] = uint8_t(h);
    if (i < s_bytes) s[i] = uint8_t(116 + ((h >> 8) & 7));
  }
}

// The reference on rows [r0, r0 + n) of matrix b against the GPU's bytes:
// "" when equal, else what differs. r0 and n are multiples of 128 (whole blocks)
// unless the rows end first.
std::string verify_rows(const Mxfp4Case& c, const uint8_t* d_w, const uint8_t* d_s, const void* d_out,
                        const float* d_qs, int64_t b, int64_t r0, int64_t n) {
  const int64_t first = b * c.rows + r0, elems = n * c.cols;
  std::vector<uint8_t> w(size_t(elems / 2)), s(size_t(elems / 32));
  BENCH_CUDA(cudaMemcpy(w.data(), d_w + first * c.cols / 2, w.size(), cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(s.data(), d_s + first * c.cols / 32, s.size(), cudaMemcpyDeviceToHost));
  const int64_t out_bytes = c.bf16 ? 2 : 1;
  std::vector<uint8_t> got(size_t(elems * out_bytes)), want(got.size());
  BENCH_CUDA(cudaMemcpy(got.data(), static_cast<const uint8_t*>(d_out) + first * c.cols * out_bytes, got.size(),
                        cudaMemcpyDeviceToHost));
  int64_t bad = 0, bad_scales = 0;
  if (c.bf16) {
    Mxfp4ToBf16Args h;
    h.w = w.data(), h.w_scales = s.data(), h.out = want.data(), h.rows = n, h.cols = c.cols;
    const Status st = mxfp4_to_bf16_cpu(h);
    if (!st.ok()) return "reference: " + st.message();
  } else {
    const int64_t nb = ((n + 127) / 128) * (c.cols / 128);
    std::vector<float> qs(static_cast<size_t>(nb)), qs_want(qs.size());
    BENCH_CUDA(cudaMemcpy(qs.data(), d_qs + (b * row_blocks(c) + r0 / 128) * (c.cols / 128), qs.size() * 4,
                          cudaMemcpyDeviceToHost));
    Mxfp4ToFp8BlockArgs h;
    h.w = w.data(), h.w_scales = s.data(), h.q = want.data(), h.q_scales = qs_want.data(), h.rows = n, h.cols = c.cols;
    const Status st = mxfp4_to_fp8_block_cpu(h);
    if (!st.ok()) return "reference: " + st.message();
    for (size_t i = 0; i < qs.size(); ++i) bad_scales += qs[i] != qs_want[i];
  }
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
  if (bad || bad_scales)
    return std::to_string(bad) + " output bytes and " + std::to_string(bad_scales) + " block scales differ (matrix " +
           std::to_string(b) + ", rows " + std::to_string(r0) + "+" + std::to_string(n) + ")";
  return "";
}

void run_gpu_case(Context& ctx, const Mxfp4Case& c, cudaStream_t stream) {
  const int64_t n = c.batch * c.rows * c.cols;
  uint8_t *d_w = nullptr, *d_s = nullptr;
  void* d_out = nullptr;
  float* d_qs = nullptr;
  BENCH_CUDA(cudaMalloc(&d_w, size_t(n / 2)));
  BENCH_CUDA(cudaMalloc(&d_s, size_t(n / 32)));
  BENCH_CUDA(cudaMalloc(&d_out, size_t(c.bf16 ? 2 * n : n)));
  if (!c.bf16) BENCH_CUDA(cudaMalloc(&d_qs, size_t(fp8_scale_count(c) * 4)));
  fill_mxfp4<<<4096, 256, 0, stream>>>(d_w, n / 2, d_s, n / 32, 0x5eedull + std::hash<std::string>()(c.name));
  BENCH_CUDA(cudaGetLastError());

  Mxfp4ToFp8BlockArgs f;
  f.w = d_w, f.w_scales = d_s, f.q = d_out, f.q_scales = d_qs, f.batch = c.batch, f.rows = c.rows, f.cols = c.cols;
  Mxfp4ToBf16Args h;
  h.w = d_w, h.w_scales = d_s, h.out = d_out, h.batch = c.batch, h.rows = c.rows, h.cols = c.cols;
  auto launch = [&] {
    const Status st = c.bf16 ? mxfp4_to_bf16(h, stream) : mxfp4_to_fp8_block(f, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s: %s\n", c.name.c_str(), st.message().c_str());
      std::exit(2);
    }
  };

  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    launch();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const int64_t span = std::min<int64_t>(256, c.rows);
    std::string why;
    for (int64_t b : {int64_t(0), c.batch - 1})
      for (int64_t r0 : {int64_t(0), (c.rows - span) / 128 * 128})
        if (why.empty()) why = verify_rows(c, d_w, d_s, d_out, d_qs, b, r0, std::min(span, c.rows - r0));
    check = why.empty() ? "passed (bitwise; first and last " + std::to_string(span) +
                              " rows of the first and last expert)"
                        : "FAILED: " + why;
  }

  const double us = median_us(launch, stream, 5, ctx.quick ? 10 : 50);
  const double bytes = counted_bytes(c);
  Record r = copy_record(ctx, c.bf16 ? "mxfp4_to_bf16" : "mxfp4_to_fp8_block", c.name, us, bytes, check);
  r.extra["bound_us"] = copy_bound_us(ctx, bytes);
  add_record(ctx, r);
  cudaFree(d_w);
  cudaFree(d_s);
  cudaFree(d_out);
  if (d_qs) cudaFree(d_qs);
}

void run_cpu_case(Context& ctx, const Mxfp4Case& c) {
  const int64_t n = c.batch * c.rows * c.cols;
  std::vector<uint8_t> w(size_t(n / 2)), s(size_t(n / 32)), out(size_t(c.bf16 ? 2 * n : n));
  std::vector<float> qs(size_t(fp8_scale_count(c)));
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& v : w) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    v = uint8_t(x >> 56);
  }
  for (size_t i = 0; i < s.size(); ++i) s[i] = uint8_t(116 + (i * 5) % 8);
  Mxfp4ToFp8BlockArgs f;
  f.w = w.data(), f.w_scales = s.data(), f.q = out.data(), f.q_scales = qs.data();
  f.batch = c.batch, f.rows = c.rows, f.cols = c.cols;
  Mxfp4ToBf16Args h;
  h.w = w.data(), h.w_scales = s.data(), h.out = out.data(), h.batch = c.batch, h.rows = c.rows, h.cols = c.cols;
  record_cpu_run(ctx, c.bf16 ? "mxfp4_to_bf16" : "mxfp4_to_fp8_block", c.name, counted_bytes(c),
                 [&] { return c.bf16 ? mxfp4_to_bf16_cpu(h) : mxfp4_to_fp8_block_cpu(f); });
}

}  // namespace

void run_mxfp4_cases(Context& ctx) {
  auto shrink = [](Mxfp4Case c) {
    c.batch = std::min<int64_t>(c.batch, 2);
    c.rows = std::min<int64_t>(c.rows, 130);
    c.cols = 512;
    return c;
  };
  for_each_case(ctx, "mxfp4_to_fp8_block", fp8_block_cases(), run_gpu_case, run_cpu_case, shrink);
  for_each_case(ctx, "mxfp4_to_bf16", bf16_cases(), run_gpu_case, run_cpu_case, shrink);
}

}  // namespace flashmix::bench
