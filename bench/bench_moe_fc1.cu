// flashmix-bench cases for moe_fc1 (spec §9): the FC1 grouped GEMM with the
// gather and SwiGLU fused, against a dense cuBLAS bf16 GEMM of equal FLOPs
// (2 * P * 2I * H, P = local rows) timed in the same run. Routing maps are
// built beforehand (not timed). fraction = dense time / our time;
// ratio_to_dense its inverse (the issue's bounds: target_ratio). A second
// record per case, .../prepermuted, reads a permuted copy of X instead of
// gathering (the copy not timed): what the fused gather costs.
// Verification: a sample of rows and every 4th column against a double
// reference computed here from the same inputs.
// FP8 (op moe_fc1_fp8, spec §9.7): e4m3 X and W1 with block scales (1 x 128,
// 128 x 128), against a dense cuBLASLt FP8 GEMM of equal FLOPs (per-tensor
// scales, fast accumulation: ceiling gemm_fp8) timed in the same run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "bench_common.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

namespace flashmix::bench {
namespace {

using flashmix::testing::Rng;
using flashmix::testing::Routing;

struct Fc1Case {
  std::string name;
  int64_t T;
  int k;
  int total, local;
  int64_t H, I;
  bool decode = false;
  double max_ratio = 0;  // the issue's bound (0: report only)
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
};

// xp[p] = x[p2u[p] % T] for rows of `row` elements of type Elem.
template <class Elem>
__global__ void permute_rows(const Elem* x, const int32_t* p2u, int64_t P, int T, int64_t row, Elem* xp) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < P * row;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / row, c = i % row;
    xp[i] = x[int64_t(p2u[p] % T) * row + c];
  }
}

double silu_mul(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

void run_case(Context& ctx, const Fc1Case& c, cudaStream_t stream) {
  const bool fp8 = c.fp8 != MoeFp8Scaling::kNone;
  const char* op = fp8 ? "moe_fc1_fp8" : "moe_fc1";
  if (!ctx.selected(op, c.name)) return;
  Rng rng(0xfc1000ull + std::hash<std::string>()(c.name));
  const Routing r = flashmix::testing::random_routing(rng, c.T, c.k, c.total, 0, c.local);
  const int64_t P = r.P(), cap = std::max<int64_t>(1, c.T * c.k);
  const int64_t es = fp8 ? 1 : 2;  // bytes an element of X and W1
  void *dX, *dXp, *dW1, *dout;
  float *dxs = nullptr, *dxsp = nullptr, *dws = nullptr;
  int32_t* dp2u;
  int64_t* doff;
  const int64_t nX = c.T * c.H, nW = int64_t(c.local) * 2 * c.I * c.H;
  const int64_t kbs = c.H / 128, wrb = (2 * c.I + 127) / 128;  // FP8 block scales: K blocks, W1 row blocks
  BENCH_CUDA(cudaMalloc(&dX, nX * es));
  BENCH_CUDA(cudaMalloc(&dXp, cap * c.H * es));
  BENCH_CUDA(cudaMalloc(&dW1, nW * es));
  BENCH_CUDA(cudaMalloc(&dout, cap * c.I * 2));
  BENCH_CUDA(cudaMalloc(&dp2u, std::max<size_t>(1, size_t(cap)) * 4));
  BENCH_CUDA(cudaMalloc(&doff, r.offsets.size() * 8));
  std::vector<float> hxs, hws;  // FP8 block scales (host copies for the reference)
  if (fp8) {
    fill_e4m3(dX, nX, 11, 448.f, stream);
    fill_e4m3(dW1, nW, 12, 448.f, stream);
    hxs.resize(size_t(c.T * kbs));
    hws.resize(size_t(c.local * wrb * kbs));
    for (auto& v : hxs) v = rng.uniform(0.5f, 1.5f) / 448.f;
    for (auto& v : hws) v = rng.uniform(0.5f, 1.5f) * 0.05f / 448.f;
    if (c.fp8 == MoeFp8Scaling::kTensor) {  // one value each: x_scales[0], w1_scales[e] read the same
      std::fill(hxs.begin(), hxs.end(), hxs[0]);
      std::fill(hws.begin(), hws.end(), hws[0]);
    }
    BENCH_CUDA(cudaMalloc(&dxs, hxs.size() * 4));
    BENCH_CUDA(cudaMalloc(&dxsp, size_t(cap * kbs) * 4));
    BENCH_CUDA(cudaMalloc(&dws, hws.size() * 4));
    BENCH_CUDA(cudaMemcpyAsync(dxs, hxs.data(), hxs.size() * 4, cudaMemcpyHostToDevice, stream));
    BENCH_CUDA(cudaMemcpyAsync(dws, hws.data(), hws.size() * 4, cudaMemcpyHostToDevice, stream));
  } else {
    fill_bf16(static_cast<__nv_bfloat16*>(dX), nX, 11, 1.0f, stream);
    fill_bf16(static_cast<__nv_bfloat16*>(dW1), nW, 12, 0.05f, stream);
  }
  if (!r.p2u.empty())
    BENCH_CUDA(cudaMemcpyAsync(dp2u, r.p2u.data(), r.p2u.size() * 4, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(doff, r.offsets.data(), r.offsets.size() * 8, cudaMemcpyHostToDevice, stream));
  if (P > 0 && fp8) {
    permute_rows<<<1024, 256, 0, stream>>>(static_cast<const uint8_t*>(dX), dp2u, P, int(c.T), c.H,
                                           static_cast<uint8_t*>(dXp));
    permute_rows<<<1024, 256, 0, stream>>>(dxs, dp2u, P, int(c.T), kbs, dxsp);
  } else if (P > 0) {
    permute_rows<<<1024, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(dX), dp2u, P, int(c.T), c.H,
                                           static_cast<__nv_bfloat16*>(dXp));
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaStreamSynchronize(stream));

  MoeFc1Args a;
  a.X = dX;
  a.W1 = dW1;
  a.fp8 = c.fp8;
  a.w1_scales = dws;
  a.expert_first_token_offset = doff;
  a.permuted_row_to_unpermuted_row = dp2u;
  a.num_tokens = c.T;
  a.k = c.k;
  a.hidden = c.H;
  a.inter = c.I;
  a.num_experts_per_node = c.local;
  a.out = dout;

  // A sample of rows (every 4th column) in double.
  std::vector<int64_t> rows;
  for (int64_t p = 0; p < P && rows.size() < 6; p += std::max<int64_t>(1, P / 6)) rows.push_back(p);
  std::vector<std::vector<double>> ref;
  double max_ref = 0;
  if (ctx.verify && P > 0) {
    std::vector<uint8_t> hX(static_cast<size_t>(nX * es)), hW(static_cast<size_t>(nW * es));
    BENCH_CUDA(cudaMemcpy(hX.data(), dX, hX.size(), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hW.data(), dW1, hW.size(), cudaMemcpyDeviceToHost));
    auto x_at = [&](int64_t t, int64_t h) {
      if (!fp8) return double(host::bf16_to_float(reinterpret_cast<const uint16_t*>(hX.data())[t * c.H + h]));
      return double(host::e4m3_to_float(hX[size_t(t * c.H + h)])) * hxs[size_t(t * kbs + h / 128)];
    };
    auto w_at = [&](int e, int64_t row, int64_t h) {
      const int64_t at = (e * 2 * c.I + row) * c.H + h;
      if (!fp8) return double(host::bf16_to_float(reinterpret_cast<const uint16_t*>(hW.data())[at]));
      return double(host::e4m3_to_float(hW[size_t(at)])) * hws[size_t((e * wrb + row / 128) * kbs + h / 128)];
    };
    for (int64_t p : rows) {
      int e = 0;
      while (r.offsets[e + 1] <= p) ++e;
      const int64_t t = r.p2u[size_t(p)] % c.T;
      std::vector<double> row(size_t(c.I), 0.0);
      for (int64_t i = 0; i < c.I; i += 4) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < c.H; ++h) {
          const double x = x_at(t, h);
          g += x * w_at(e, i, h);
          u += x * w_at(e, c.I + i, h);
        }
        row[size_t(i)] = silu_mul(g, u);
        max_ref = std::max(max_ref, std::fabs(row[size_t(i)]));
      }
      ref.push_back(std::move(row));
    }
  }

  const double flops = 2.0 * double(P) * 2.0 * double(c.I) * double(c.H);
  const int iters = ctx.quick ? 10 : 30;
  std::unique_ptr<DenseGemm> dense;
  if (!fp8) dense = std::make_unique<DenseGemm>(std::max<int64_t>(P, 1), 2 * c.I, c.H, stream);
  auto dense_time = [&] {
    if (fp8) return cublaslt_fp8_gemm_us((std::max<int64_t>(P, 1) + 15) / 16 * 16, 2 * c.I, c.H, stream, iters);
    return median_us([&] { dense->run(); }, stream, 5, iters);
  };
  const double dense_first_us = dense_time();
  int touched = 0;
  for (int e = 0; e < c.local; ++e) touched += r.offsets[e + 1] > r.offsets[e];
  const double wbytes = double(touched) * 2.0 * c.I * c.H * es;
  // Variants: X gathered, X permuted (.../prepermuted), and with block scales
  // X permuted and FC1's FP8 output (.../prepermuted_fp8out, spec §9.8: e4m3
  // rows + 1 x 128 scales into dout, scales at dout + cap * I; what
  // moe_forward runs).
  const bool q_variant = c.fp8 == MoeFp8Scaling::kBlock && c.I % 128 == 0;
  for (int variant = 0; variant < (q_variant ? 3 : 2); ++variant) {
    const bool pre = variant >= 1, q_out = variant == 2;
    a.X = pre ? dXp : dX;
    a.x_scales = pre ? dxsp : dxs;
    a.x_permuted = pre;
    a.out_scales = q_out ? static_cast<char*>(dout) + cap * c.I : nullptr;
    BENCH_CUDA(cudaMemsetAsync(dout, 0xff, cap * c.I * 2, stream));
    Status st = moe_fc1(a, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s %s: %s\n", op, c.name.c_str(), st.message().c_str());
      break;
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::string check = "not checked (--no-verify)";
    if (ctx.verify) {
      std::vector<uint16_t> got(size_t(cap * c.I));
      BENCH_CUDA(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
      const uint8_t* q = reinterpret_cast<const uint8_t*>(got.data());
      const float* qs = reinterpret_cast<const float*>(q + cap * c.I);  // q_out: the scales after the codes
      // The tests' tolerance; the FP8 output adds one e4m3 rounding (2^-4 |x| + 2^-10 s).
      double rtol = std::ldexp(1.0, -7), atol = std::ldexp(1.0, fp8 ? -8 : -10) * max_ref;
      if (q_out) rtol += std::ldexp(1.0, -4);
      int64_t bad = 0;
      double worst = 0;
      for (size_t ri = 0; ri < rows.size(); ++ri)
        for (int64_t i = 0; i < c.I; i += 4) {
          const int64_t at = rows[ri] * c.I + i;
          double g = 0, extra = 0;
          if (q_out) {
            const double sc = qs[rows[ri] * (c.I / 128) + i / 128];
            g = host::e4m3_to_float(q[at]) * sc;
            extra = std::ldexp(sc, -10);
          } else {
            g = host::bf16_to_float(got[size_t(at)]);
          }
          const double rv = ref[ri][size_t(i)];
          const double err = std::fabs(g - rv);
          worst = std::max(worst, err);
          bad += !(err <= rtol * std::fabs(rv) + atol + extra);
        }
      check = bad ? "FAILED: " + std::to_string(bad) + " sampled elements (max abs err " + std::to_string(worst) + ")"
                  : "passed (" + std::to_string(rows.size()) + " sampled rows, every 4th column)";
    }
    const double dense_us = std::min(dense_first_us, dense_time());
    const double us = c.decode ? graph_us_per_launch([&](int) { (void)moe_fc1(a, stream); }, 20, stream,
                                                     ctx.quick ? 5 : 20)
                               : median_us([&] { (void)moe_fc1(a, stream); }, stream, 3, iters);
    Record rec;
    rec.op = op;
    rec.case_name = c.name + (q_out ? "/prepermuted_fp8out" : pre ? "/prepermuted" : "");
    rec.median_us = us;
    rec.flops = flops;
    rec.check = check;
    rec.extra["rows"] = double(P);
    rec.extra["dense_us"] = dense_us;
    rec.extra["ratio_to_dense"] = us / dense_us;
    rec.extra["tflops"] = flops / (us * 1e-6) / 1e12;
    rec.extra["weight_bytes_fraction_of_copy"] = wbytes / (us * 1e-6) / (ctx.copy_gbps * 1e9);
    if (c.decode) {  // bound by reading the used experts' W1
      set_copy_ceiling(ctx, rec, wbytes);
    } else {
      rec.ceiling = fp8 ? "gemm_fp8" : "gemm";
      rec.fraction = dense_us / us;
    }
    if (c.max_ratio > 0 && !pre) rec.extra["target_ratio"] = c.max_ratio;
    add_record(ctx, rec);
  }
  cudaFree(dX);
  cudaFree(dXp);
  cudaFree(dW1);
  cudaFree(dout);
  cudaFree(dp2u);
  cudaFree(doff);
  cudaFree(dxs);
  cudaFree(dxsp);
  cudaFree(dws);
}

}  // namespace

void run_moe_fc1_cases(Context& ctx) {
  if (!ctx.gpu) return;  // the CPU reference on these shapes would take minutes
  const std::vector<Fc1Case> cases = {
      {"mixtral_T4096_k2_E8_I14336_H4096", 4096, 2, 8, 8, 4096, 14336, false, 1.10},
      {"deepseek_ep_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 32, 7168, 2048, false, 1.25},
      {"qwen3moe_T4096_k8_E128_I768_H2048", 4096, 8, 128, 128, 2048, 768, false, 1.40},
      {"decode_deepseek_ep_T16_k8_E32_I2048_H7168", 16, 8, 32, 32, 7168, 2048, true, 0},
      {"decode_deepseek_ep_T64_k8_E32_I2048_H7168", 64, 8, 32, 32, 7168, 2048, true, 0},
      // FP8, block scales (issue 25's bounds, against the dense FP8 GEMM).
      {"mixtral_T4096_k2_E8_I14336_H4096", 4096, 2, 8, 8, 4096, 14336, false, 1.05, MoeFp8Scaling::kBlock},
      {"deepseek_ep_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 32, 7168, 2048, false, 1.30, MoeFp8Scaling::kBlock},
      {"qwen3moe_T4096_k8_E128_I768_H2048", 4096, 8, 128, 128, 2048, 768, false, 1.40, MoeFp8Scaling::kBlock},
      {"decode_deepseek_ep_T16_k8_E32_I2048_H7168", 16, 8, 32, 32, 7168, 2048, true, 0, MoeFp8Scaling::kBlock},
      // Per-tensor scales (report only): the same MMAs without the promotion.
      {"mixtral_T4096_k2_E8_I14336_H4096/tensor", 4096, 2, 8, 8, 4096, 14336, false, 0, MoeFp8Scaling::kTensor},
      {"qwen3moe_T4096_k8_E128_I768_H2048/tensor", 4096, 8, 128, 128, 2048, 768, false, 0, MoeFp8Scaling::kTensor},
  };
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const auto& c : cases) run_case(ctx, c, stream);
  BENCH_CUDA(cudaStreamDestroy(stream));
}

}  // namespace flashmix::bench
