// flashmix-bench cases for moe_fc2_finalize (spec §3): the FC2 grouped GEMM
// with the finalize, per mode, against a dense cuBLAS bf16 GEMM of equal
// FLOPs (2 * P * H * I, P = local rows) timed in the same run, and the fused
// modes against the unfused baseline. The routing maps are built beforehand
// (not timed). Fraction = dense time / our time (1.0 = as fast as dense).
// Verification: a sample of tokens and every 4th column against a double
// reference computed here from the same inputs (the full CPU reference would
// take minutes for these shapes); the check string says so. Each record
// names the GEMM kernel that ran (gemm_kernel) and why (gemm_kernel_why);
// --fc2-gemm-kernel pins kernels against each other in the same process
// (records case/mode@kernel), e.g. atomic_fp32 on rows vs CUTLASS:
//   flashmix-bench --filter atomic_fp32 --fc2-gemm-kernel auto,rows,cutlass_pingpong,cutlass_cooperative
// FP8 (op moe_fc2_fp8, spec §3.5): e4m3 A and W2 with block scales (1 x 128,
// 128 x 128), atomic and deterministic, against a dense cuBLASLt FP8 GEMM of
// equal FLOPs (per-tensor scales, fast accumulation: ceiling gemm_fp8) timed
// in the same run; deterministic also against its own atomic (ratio_to_atomic).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "bench_common.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "moe/moe_fc2_dispatch.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix::bench {
namespace {

using flashmix::testing::Rng;
using flashmix::testing::Routing;
using flashmix::testing::fc2_mode_name;

struct Fc2Case {
  std::string name;
  int64_t T;
  int k;
  int total, local;
  int64_t H, I;
  bool decode = false;
  double max_ratio_atomic = 0, max_ratio_det = 0;  // the issue's bounds (0: report only)
  bool balanced = false;  // diagnostic: slot (t, j) -> expert (t*k + j) mod local (equal rows per expert)
};

struct Fc2BenchTuning {
  Fc2Tuning tuning;
  bool all_modes;  // else atomic and unfused only (the sweep's extra tunings)
};

// The record name's suffix: none for the automatic choice, else @kernel (and
// the CUTLASS tile order and swizzle when set).
std::string fc2_suffix(const Fc2Tuning& t) {
  const bool cutlass =
      t.gemm_kernel == Fc2GemmKernel::kCutlassCooperative || t.gemm_kernel == Fc2GemmKernel::kCutlassPingpong;
  std::string s = t.gemm_kernel == Fc2GemmKernel::kAuto ? "" : std::string("@") + to_string(t.gemm_kernel);
  if ((cutlass || t.gemm_kernel == Fc2GemmKernel::kAuto) && (t.raster != 0 || t.swizzle != 0))
    s += (s.empty() ? "@auto" : "") + std::string(t.raster == 2 ? "_rn" : "_rm") + "_sw" + std::to_string(t.swizzle);
  return s;
}

// --fc2-gemm-kernel's list; exits on a name that is no kernel.
std::vector<Fc2GemmKernel> fc2_kernels_of(const Context& ctx) {
  std::vector<Fc2GemmKernel> out;
  const std::string& list = ctx.fc2_gemm_kernels;
  for (size_t b = 0; b <= list.size();) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    Fc2GemmKernel k;
    if (!flashmix::testing::parse_fc2_gemm_kernel(list.c_str() + b, e - b, &k)) {
      std::fprintf(stderr, "flashmix-bench: --fc2-gemm-kernel %s: \"%s\" is none of auto, rows, "
                   "cutlass_cooperative, cutlass_pingpong\n", list.c_str(), list.substr(b, e - b).c_str());
      std::exit(2);
    }
    out.push_back(k);
    b = e + 1;
  }
  return out;
}

void run_case(Context& ctx, const Fc2Case& c, cudaStream_t stream) {
  const Fc2Mode modes[] = {Fc2Mode::kUnfused, Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32, Fc2Mode::kDeterministic};
  bool any = false;
  for (Fc2Mode m : modes) any |= ctx.selected("moe_fc2", c.name + "/" + fc2_mode_name(m));
  if (!any) return;

  Rng rng(0xfc2000ull + std::hash<std::string>()(c.name));
  Routing r;
  if (c.balanced) {
    std::vector<int32_t> experts(size_t(c.T * c.k));
    for (size_t i = 0; i < experts.size(); ++i) experts[i] = int32_t(i % size_t(c.local));
    r = flashmix::testing::build_routing(c.T, c.k, 0, c.local, std::move(experts));
  } else {
    r = flashmix::testing::random_routing(rng, c.T, c.k, c.total, 0, c.local);
  }
  const int64_t P = r.P();
  std::vector<float> scales(size_t(c.T * c.k));
  for (auto& s : scales) s = rng.uniform(0.05f, 1.0f);

  __nv_bfloat16 *dA, *dW2, *dbias, *dout;
  float* dscales;
  int32_t* dp2u;
  int64_t* doff;
  const int64_t nA = std::max<int64_t>(1, P) * c.I, nW = int64_t(c.local) * c.H * c.I;
  BENCH_CUDA(cudaMalloc(&dA, nA * 2));
  BENCH_CUDA(cudaMalloc(&dW2, nW * 2));
  BENCH_CUDA(cudaMalloc(&dbias, int64_t(c.local) * c.H * 2));
  BENCH_CUDA(cudaMalloc(&dout, c.T * c.H * 2));
  BENCH_CUDA(cudaMalloc(&dscales, scales.size() * 4));
  BENCH_CUDA(cudaMalloc(&dp2u, std::max<size_t>(1, r.p2u.size()) * 4));
  BENCH_CUDA(cudaMalloc(&doff, r.offsets.size() * 8));
  fill_bf16(dA, nA, 1, 1.0f, stream);
  fill_bf16(dW2, nW, 2, 0.05f, stream);
  fill_bf16(dbias, int64_t(c.local) * c.H, 3, 1.0f, stream);
  BENCH_CUDA(cudaMemcpyAsync(dscales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice, stream));
  if (!r.p2u.empty())
    BENCH_CUDA(cudaMemcpyAsync(dp2u, r.p2u.data(), r.p2u.size() * 4, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(doff, r.offsets.data(), r.offsets.size() * 8, cudaMemcpyHostToDevice, stream));

  Fc2FinalizeArgs a;
  a.A = dA;
  a.W2 = dW2;
  a.expert_first_token_offset = doff;
  a.permuted_row_to_unpermuted_row = dp2u;
  a.scales = dscales;
  a.bias = dbias;
  a.apply_bias = true;
  a.num_tokens = c.T;
  a.k = c.k;
  a.hidden = c.H;
  a.inter = c.I;
  a.num_experts_per_node = c.local;
  a.out = dout;
  size_t ws_bytes = 0;
  for (Fc2Mode m : modes) {
    a.mode = m;
    ws_bytes = std::max(ws_bytes, moe_fc2_finalize_workspace_size(a));
  }
  void* dws;
  BENCH_CUDA(cudaMalloc(&dws, ws_bytes));
  BENCH_CUDA(cudaStreamSynchronize(stream));

  // Reference for a sample of tokens (every 4th column), in double.
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < c.T && tokens.size() < 6; t += std::max<int64_t>(1, c.T / 6)) tokens.push_back(t);
  std::vector<std::vector<double>> ref;
  double max_ref = 0;
  if (ctx.verify) {
    std::vector<uint16_t> hA(static_cast<size_t>(nA)), hW(static_cast<size_t>(nW)), hb(static_cast<size_t>(c.local * c.H));
    BENCH_CUDA(cudaMemcpy(hA.data(), dA, nA * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hW.data(), dW2, nW * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hb.data(), dbias, hb.size() * 2, cudaMemcpyDeviceToHost));
    for (int64_t t : tokens) {
      std::vector<double> row(static_cast<size_t>(c.H), 0.0);
      for (int j = 0; j < c.k; ++j) {
        const int32_t p = r.u2p[size_t(j * c.T + t)];
        if (p < 0) continue;
        int e = 0;
        while (r.offsets[e + 1] <= p) ++e;
        const double w = scales[size_t(t * c.k + j)];
        for (int64_t n = 0; n < c.H; n += 4) {
          double dot = 0;
          for (int64_t i = 0; i < c.I; ++i)
            dot += double(host::bf16_to_float(hA[size_t(p * c.I + i)])) *
                   double(host::bf16_to_float(hW[size_t((e * c.H + n) * c.I + i)]));
          row[size_t(n)] += w * (dot + host::bf16_to_float(hb[size_t(e * c.H + n)]));
        }
      }
      for (int64_t n = 0; n < c.H; n += 4) max_ref = std::max(max_ref, std::fabs(row[size_t(n)]));
      ref.push_back(std::move(row));
    }
  }

  const double flops = 2.0 * double(P) * double(c.H) * double(c.I);
  const int iters = ctx.quick ? 10 : 30;
  // The dense reference: the faster of its time at the start of the case and
  // its time right before each mode (back-to-back launches, like ours). Under
  // sustained tensor load the H200's clock drops by up to 20 % over a run, and
  // a dense GEMM timed right after our op can come out that much slower; the
  // minimum never flatters our ratio. (Timed alternately with our op, a
  // launch at a time, it was 15-20 % slower too.)
  DenseGemm dense(std::max<int64_t>(P, 1), c.H, c.I, stream);
  const double dense_first_us = median_us([&] { dense.run(); }, stream, 5, iters);
  // Tunings: each kernel of --fc2-gemm-kernel (default: the automatic
  // choice), every mode; then with --sweep (atomic and unfused only) every
  // kernel this build has, the CUTLASS ones in both tile orders x swizzles.
  std::vector<Fc2BenchTuning> tunings;
  // FLASHMIX_BENCH_FC2_TUNING=kernel,raster,swizzle (a kernel name, e.g.
  // rows,0,0 or cutlass_pingpong,2,4) replaces --fc2-gemm-kernel's list (to
  // profile one tuning with scripts/tuning/ncu_cases.sh or fc2_profile_round.sh).
  if (const char* env = std::getenv("FLASHMIX_BENCH_FC2_TUNING")) {
    Fc2Tuning t;
    const char* comma = std::strchr(env, ',');
    if (!comma || !flashmix::testing::parse_fc2_gemm_kernel(env, size_t(comma - env), &t.gemm_kernel) ||
        std::sscanf(comma + 1, "%d,%d", &t.raster, &t.swizzle) != 2) {
      std::fprintf(stderr, "flashmix-bench: FLASHMIX_BENCH_FC2_TUNING=%s: want kernel,raster,swizzle\n", env);
      std::exit(2);
    }
    tunings.push_back({t, true});
  } else {
    for (Fc2GemmKernel k : fc2_kernels_of(ctx)) {
      Fc2Tuning t;
      t.gemm_kernel = k;
      tunings.push_back({t, true});
    }
  }
  if (ctx.sweep) {
    auto add = [&](Fc2GemmKernel k, int raster, int swizzle) {
      Fc2Tuning t;
      t.gemm_kernel = k;
      t.raster = raster;
      t.swizzle = swizzle;
      for (const auto& have : tunings)
        if (fc2_suffix(have.tuning) == fc2_suffix(t)) return;
      tunings.push_back({t, false});
    };
    if (sm90_fc2_built_with_cutlass())
      for (Fc2GemmKernel k : {Fc2GemmKernel::kCutlassCooperative, Fc2GemmKernel::kCutlassPingpong})
        for (int raster = 1; raster <= 2; ++raster)
          for (int swizzle : {1, 4}) add(k, raster, swizzle);
    add(Fc2GemmKernel::kRows, 0, 0);  // its tile order is its own
  }
  for (const Fc2BenchTuning& bt : tunings) {
  const Fc2Tuning& tuning = bt.tuning;
  double unfused_us = 0;
  a.tuning = tuning;
  const std::string suffix = fc2_suffix(tuning);
  for (Fc2Mode m : modes) {
    if (!ctx.selected("moe_fc2", c.name + "/" + fc2_mode_name(m))) continue;
    // The sweep's extra tunings time atomic and unfused only.
    if (!bt.all_modes && m != Fc2Mode::kAtomic && m != Fc2Mode::kUnfused) continue;
    a.mode = m;
    Fc2GemmChoice choice;
    const Status chosen = choose_fc2_gemm_kernel(a, &choice);
    BENCH_CUDA(cudaMemsetAsync(dout, 0xff, c.T * c.H * 2, stream));
    Status st = moe_fc2_finalize(a, dws, ws_bytes, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: moe_fc2 %s/%s%s: %s\n", c.name.c_str(), fc2_mode_name(m),
                   suffix.c_str(), st.message().c_str());
      continue;
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::string check = "not checked (--no-verify)";
    if (ctx.verify) {
      std::vector<uint16_t> got(static_cast<size_t>(c.T * c.H));
      BENCH_CUDA(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
      // The test's tolerances (tests/gpu/test_moe_fc2_gpu.cu): one bf16 ulp plus the mode's own error.
      const double rtol = std::ldexp(1.0, -7);
      double atol = std::ldexp(1.0, -10) * max_ref;
      if (m == Fc2Mode::kUnfused) atol = std::ldexp(1.0, -8) * max_ref;
      if (m == Fc2Mode::kAtomic) atol = c.k * std::ldexp(1.0, -8) * max_ref;
      int64_t bad = 0;
      double worst = 0;
      for (size_t ti = 0; ti < tokens.size(); ++ti)
        for (int64_t n = 0; n < c.H; n += 4) {
          const double g = host::bf16_to_float(got[size_t(tokens[ti] * c.H + n)]), rv = ref[ti][size_t(n)];
          const double err = std::fabs(g - rv);
          worst = std::max(worst, err);
          bad += !(err <= rtol * std::fabs(rv) + atol);
        }
      check = bad ? "FAILED: " + std::to_string(bad) + " sampled elements (max abs err " + std::to_string(worst) + ")"
                  : "passed (" + std::to_string(tokens.size()) + " sampled tokens, every 4th column)";
    }
    const double dense_us = std::min(dense_first_us, median_us([&] { dense.run(); }, stream, 5, iters));
    double us;
    if (c.decode)
      us = graph_us_per_launch([&](int) { (void)moe_fc2_finalize(a, dws, ws_bytes, stream); }, 20, stream,
                               ctx.quick ? 5 : 20);
    else
      us = median_us([&] { (void)moe_fc2_finalize(a, dws, ws_bytes, stream); }, stream, 3, iters);
    if (m == Fc2Mode::kUnfused) unfused_us = us;
    Record rec;
    rec.op = "moe_fc2";
    rec.case_name = c.name + "/" + fc2_mode_name(m) + suffix;
    rec.median_us = us;
    rec.ceiling = "gemm";
    rec.flops = flops;
    rec.fraction = dense_us / us;
    rec.check = check;
    rec.extra["dense_us"] = dense_us;
    rec.extra["ratio_to_dense"] = us / dense_us;
    rec.extra["tflops"] = flops / (us * 1e-6) / 1e12;
    rec.extra["rows"] = double(P);
    if (chosen.ok()) {
      rec.labels["gemm_kernel"] = to_string(choice.kernel);
      rec.labels["gemm_kernel_why"] = choice.why;
    }
    {  // weight bytes of the experts with rows: the floor when rows per expert are few (decode)
      int touched = 0;
      for (int e = 0; e < c.local; ++e) touched += r.offsets[e + 1] > r.offsets[e];
      const double wbytes = double(touched) * c.H * c.I * 2;
      rec.extra["weight_bytes_fraction_of_copy"] = wbytes / (us * 1e-6) / (ctx.copy_gbps * 1e9);
    }
    if (unfused_us > 0 && m != Fc2Mode::kUnfused) rec.extra["speedup_vs_unfused"] = unfused_us / us;
    const double bound = m == Fc2Mode::kAtomic ? c.max_ratio_atomic : m == Fc2Mode::kDeterministic ? c.max_ratio_det : 0;
    if (bound > 0) rec.extra["target_ratio"] = bound;
    add_record(ctx, rec);
  }
  }
  cudaFree(dws);
  cudaFree(dA);
  cudaFree(dW2);
  cudaFree(dbias);
  cudaFree(dout);
  cudaFree(dscales);
  cudaFree(dp2u);
  cudaFree(doff);
}

// FP8 with block scales (issue 25): atomic and deterministic on the rows
// kernel, the dense FP8 GEMM of equal FLOPs as the ceiling.
// scaling kTensor (report only): the same data, x_scales[0] and w2_scales[e]
// read as the per-tensor scales; cases <shape>/tensor/<mode>.
void run_fp8_case(Context& ctx, const Fc2Case& c, double max_ratio_atomic, MoeFp8Scaling scaling,
                  cudaStream_t stream) {
  const Fc2Mode modes[] = {Fc2Mode::kAtomic, Fc2Mode::kDeterministic};
  const bool tensor = scaling == MoeFp8Scaling::kTensor;
  const std::string prefix = c.name + (tensor ? "/tensor/" : "/");
  bool any = false;
  for (Fc2Mode m : modes) any |= ctx.selected("moe_fc2_fp8", prefix + fc2_mode_name(m));
  if (!any) return;
  Rng rng(0xfc2f8ull + std::hash<std::string>()(c.name));
  const Routing r = flashmix::testing::random_routing(rng, c.T, c.k, c.total, 0, c.local);
  const int64_t P = r.P(), cap = std::max<int64_t>(1, c.T * c.k);
  const int64_t kbs = c.I / 128, hb = (c.H + 127) / 128;
  std::vector<float> scales(size_t(c.T * c.k)), has(size_t(cap * kbs)), hws(size_t(c.local * hb * kbs));
  for (auto& s : scales) s = rng.uniform(0.05f, 1.0f);
  for (auto& v : has) v = rng.uniform(0.5f, 1.5f) / 448.f;
  for (auto& v : hws) v = rng.uniform(0.5f, 1.5f) * 0.05f / 448.f;
  if (tensor) {  // one value each: a_scales[0] and w2_scales[e] read the same
    std::fill(has.begin(), has.end(), has[0]);
    std::fill(hws.begin(), hws.end(), hws[0]);
  }
  uint8_t *dA, *dW2;
  __nv_bfloat16 *dbias, *dout;
  float *dscales, *das, *dws2;
  int32_t* dp2u;
  int64_t* doff;
  const int64_t nA = cap * c.I, nW = int64_t(c.local) * c.H * c.I;
  BENCH_CUDA(cudaMalloc(&dA, nA));
  BENCH_CUDA(cudaMalloc(&dW2, nW));
  BENCH_CUDA(cudaMalloc(&dbias, int64_t(c.local) * c.H * 2));
  BENCH_CUDA(cudaMalloc(&dout, c.T * c.H * 2));
  BENCH_CUDA(cudaMalloc(&dscales, scales.size() * 4));
  BENCH_CUDA(cudaMalloc(&das, has.size() * 4));
  BENCH_CUDA(cudaMalloc(&dws2, hws.size() * 4));
  BENCH_CUDA(cudaMalloc(&dp2u, size_t(cap) * 4));
  BENCH_CUDA(cudaMalloc(&doff, r.offsets.size() * 8));
  fill_e4m3(dA, nA, 21, 448.f, stream);
  fill_e4m3(dW2, nW, 22, 448.f, stream);
  BENCH_CUDA(cudaGetLastError());
  fill_bf16(dbias, int64_t(c.local) * c.H, 3, 1.0f, stream);
  BENCH_CUDA(cudaMemcpyAsync(dscales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(das, has.data(), has.size() * 4, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(dws2, hws.data(), hws.size() * 4, cudaMemcpyHostToDevice, stream));
  if (!r.p2u.empty())
    BENCH_CUDA(cudaMemcpyAsync(dp2u, r.p2u.data(), r.p2u.size() * 4, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(doff, r.offsets.data(), r.offsets.size() * 8, cudaMemcpyHostToDevice, stream));

  Fc2FinalizeArgs a;
  a.A = dA;
  a.W2 = dW2;
  a.fp8 = scaling;
  a.a_scales = das;
  a.w2_scales = dws2;
  a.expert_first_token_offset = doff;
  a.permuted_row_to_unpermuted_row = dp2u;
  a.scales = dscales;
  a.bias = dbias;
  a.num_tokens = c.T;
  a.k = c.k;
  a.hidden = c.H;
  a.inter = c.I;
  a.num_experts_per_node = c.local;
  a.out = dout;
  size_t ws_bytes = 0;
  for (Fc2Mode m : modes) {
    a.mode = m;
    ws_bytes = std::max(ws_bytes, moe_fc2_finalize_workspace_size(a));
  }
  void* dws;
  BENCH_CUDA(cudaMalloc(&dws, std::max<size_t>(ws_bytes, 256)));
  BENCH_CUDA(cudaStreamSynchronize(stream));

  // Reference for a sample of tokens (every 4th column), in double from the
  // dequantised values (e4m3 decoded by host_fp8.h).
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < c.T && tokens.size() < 6; t += std::max<int64_t>(1, c.T / 6)) tokens.push_back(t);
  std::vector<std::vector<double>> ref;
  double max_ref = 0;
  if (ctx.verify) {
    std::vector<uint8_t> hA(static_cast<size_t>(nA)), hW(static_cast<size_t>(nW));
    std::vector<uint16_t> hbias(static_cast<size_t>(c.local * c.H));
    BENCH_CUDA(cudaMemcpy(hA.data(), dA, nA, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hW.data(), dW2, nW, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hbias.data(), dbias, hbias.size() * 2, cudaMemcpyDeviceToHost));
    for (int64_t t : tokens) {
      std::vector<double> row(static_cast<size_t>(c.H), 0.0);
      for (int j = 0; j < c.k; ++j) {
        const int32_t p = r.u2p[size_t(j * c.T + t)];
        if (p < 0) continue;
        int e = 0;
        while (r.offsets[e + 1] <= p) ++e;
        const double w = scales[size_t(t * c.k + j)];
        for (int64_t n = 0; n < c.H; n += 4) {
          double dot = 0;
          for (int64_t i = 0; i < c.I; ++i)
            dot += double(host::e4m3_to_float(hA[size_t(p * c.I + i)])) * has[size_t(p * kbs + i / 128)] *
                   double(host::e4m3_to_float(hW[size_t((e * c.H + n) * c.I + i)])) *
                   hws[size_t((e * hb + n / 128) * kbs + i / 128)];
          row[size_t(n)] += w * (dot + host::bf16_to_float(hbias[size_t(e * c.H + n)]));
        }
      }
      for (int64_t n = 0; n < c.H; n += 4) max_ref = std::max(max_ref, std::fabs(row[size_t(n)]));
      ref.push_back(std::move(row));
    }
  }

  const double flops = 2.0 * double(P) * double(c.H) * double(c.I);
  const int iters = ctx.quick ? 10 : 30;
  auto dense_time = [&] {
    return cublaslt_fp8_gemm_us((std::max<int64_t>(P, 1) + 15) / 16 * 16, c.H, c.I, stream, iters);
  };
  const double dense_first_us = dense_time();
  double atomic_us = 0;
  for (Fc2Mode m : modes) {
    if (!ctx.selected("moe_fc2_fp8", prefix + fc2_mode_name(m))) continue;
    a.mode = m;
    Fc2GemmChoice choice;
    const Status chosen = choose_fc2_gemm_kernel(a, &choice);
    BENCH_CUDA(cudaMemsetAsync(dout, 0xff, c.T * c.H * 2, stream));
    Status st = moe_fc2_finalize(a, dws, ws_bytes, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: moe_fc2_fp8 %s/%s: %s\n", c.name.c_str(), fc2_mode_name(m),
                   st.message().c_str());
      continue;
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::string check = "not checked (--no-verify)";
    if (ctx.verify) {
      std::vector<uint16_t> got(static_cast<size_t>(c.T * c.H));
      BENCH_CUDA(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
      // The test's tolerances (tests/gpu/test_moe_fc2_gpu.cu): the mode's, plus 2^-8 |.|max for the FP8 MMA.
      const double rtol = std::ldexp(1.0, -7);
      const double atol = ((m == Fc2Mode::kAtomic ? c.k * std::ldexp(1.0, -8) : std::ldexp(1.0, -10)) +
                           std::ldexp(1.0, -8)) * max_ref;
      int64_t bad = 0;
      double worst = 0;
      for (size_t ti = 0; ti < tokens.size(); ++ti)
        for (int64_t n = 0; n < c.H; n += 4) {
          const double g = host::bf16_to_float(got[size_t(tokens[ti] * c.H + n)]), rv = ref[ti][size_t(n)];
          const double err = std::fabs(g - rv);
          worst = std::max(worst, err);
          bad += !(err <= rtol * std::fabs(rv) + atol);
        }
      check = bad ? "FAILED: " + std::to_string(bad) + " sampled elements (max abs err " + std::to_string(worst) + ")"
                  : "passed (" + std::to_string(tokens.size()) + " sampled tokens, every 4th column)";
    }
    const double dense_us = std::min(dense_first_us, dense_time());
    const double us = median_us([&] { (void)moe_fc2_finalize(a, dws, ws_bytes, stream); }, stream, 3, iters);
    if (m == Fc2Mode::kAtomic) atomic_us = us;
    Record rec;
    rec.op = "moe_fc2_fp8";
    rec.case_name = prefix + fc2_mode_name(m);
    rec.median_us = us;
    rec.ceiling = "gemm_fp8";
    rec.flops = flops;
    rec.fraction = dense_us / us;
    rec.check = check;
    rec.extra["dense_us"] = dense_us;
    rec.extra["ratio_to_dense"] = us / dense_us;
    rec.extra["tflops"] = flops / (us * 1e-6) / 1e12;
    rec.extra["rows"] = double(P);
    if (chosen.ok()) {
      rec.labels["gemm_kernel"] = to_string(choice.kernel);
      rec.labels["gemm_kernel_why"] = choice.why;
    }
    rec.labels["fp8"] = to_string(a.fp8);
    if (m == Fc2Mode::kAtomic && max_ratio_atomic > 0 && !tensor) rec.extra["target_ratio"] = max_ratio_atomic;
    if (m == Fc2Mode::kDeterministic && atomic_us > 0) {
      rec.extra["ratio_to_atomic"] = us / atomic_us;
      if (!tensor) rec.extra["target_ratio_to_atomic"] = 1.10;
    }
    add_record(ctx, rec);
  }
  cudaFree(dws);
  cudaFree(dA);
  cudaFree(dW2);
  cudaFree(dbias);
  cudaFree(dout);
  cudaFree(dscales);
  cudaFree(das);
  cudaFree(dws2);
  cudaFree(dp2u);
  cudaFree(doff);
}

}  // namespace

void run_moe_fc2_cases(Context& ctx) {
  (void)fc2_kernels_of(ctx);  // a bad --fc2-gemm-kernel fails here, GPU or not
  if (!ctx.gpu) return;       // the CPU reference on these shapes would take minutes
  std::vector<Fc2Case> cases = {
      {"deepseek_ep_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 32, 7168, 2048, false, 1.15, 1.30},
      {"mixtral_T4096_k2_E8_I14336_H4096", 4096, 2, 8, 8, 4096, 14336, false, 1.15, 1.30},
      {"qwen3moe_T4096_k8_E128_I768_H2048", 4096, 8, 128, 128, 2048, 768, false, 0, 0},
      {"decode_deepseek_T16_k8_E32_I2048_H7168", 16, 8, 32, 32, 7168, 2048, true, 0, 0},
  };
  // Diagnostics (--sweep): the DeepSeek shape with equal rows per expert (no
  // ragged tiles), and its FLOPs as one expert (the grouped kernel as a dense GEMM).
  if (ctx.sweep) {
    cases.push_back({"diag_deepseek_balanced_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 32, 7168, 2048, false, 0, 0, true});
    // 272 rows per expert: the rows kernel cuts every expert into two chunks (N = 144 tiles).
    cases.push_back({"diag_deepseek_balanced_T1088_k8_E32_I2048_H7168", 1088, 8, 32, 32, 7168, 2048, false, 0, 0, true});
    cases.push_back({"diag_one_expert_T8192_k1_E1_I2048_H7168", 8192, 1, 1, 1, 7168, 2048, false, 0, 0, true});
    cases.push_back({"diag_two_experts_T4096_k2_E2_I2048_H7168", 4096, 2, 2, 2, 7168, 2048, false, 0, 0, true});
  }
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const auto& c : cases) run_case(ctx, c, stream);
  // FP8, block scales (issue 25's bounds against the dense FP8 GEMM; deterministic <= 1.10 x its atomic).
  const std::pair<Fc2Case, double> fp8_cases[] = {
      {{"mixtral_T4096_k2_E8_I14336_H4096", 4096, 2, 8, 8, 4096, 14336}, 1.05},
      {{"deepseek_ep_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 32, 7168, 2048}, 1.30},
      {{"qwen3moe_T4096_k8_E128_I768_H2048", 4096, 8, 128, 128, 2048, 768}, 1.40},
  };
  for (const auto& [c, bound] : fp8_cases) run_fp8_case(ctx, c, bound, MoeFp8Scaling::kBlock, stream);
  // Per-tensor scales, for reference (no bound).
  for (const auto& [c, bound] : fp8_cases) run_fp8_case(ctx, c, 0, MoeFp8Scaling::kTensor, stream);
  BENCH_CUDA(cudaStreamDestroy(stream));
}

}  // namespace flashmix::bench
