// Probe: where the split projection's time goes at decode (B = 16, n = 4,
// C = 7168, fp32 phi). Builds src/mhc/mhc_split.cu with its phase stamps on
// (FLASHMIX_MHC_SPLIT_TRACE: thread 0 and the owner warp's lane 0 of each
// CTA record %globaltimer at each step) and prints, over isolated launches on
// rotated input sets (cold in L2), the median across launches of each
// step's earliest, median and latest CTA time from the launch's first stamp.
// Also times back-to-back launches (events, no sync between) like the bench.
// A stand-alone probe (not built by CMake), after the library is built:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc \
//     -o mhc_split_trace bench/probes/mhc_split_trace.cu build/libflashmix.a -lcuda
#define FLASHMIX_MHC_SPLIT_TRACE 1
#define mhc_split_project mhc_split_project_traced
#include "../../src/mhc/mhc_split.cu"
#undef mhc_split_project

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "probe_check.h"

using namespace flashmix::mhc_detail;

// Keeps the GPU busy (and its clocks up) for `ns` before each traced launch.
__global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? std::atoi(argv[1]) : 16, n = 4, C = argc > 2 ? std::atoi(argv[2]) : 7168;
  const int K = n * C, N = n * n + 2 * n, sets = 40;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<__nv_bfloat16> hx(size_t(B) * K);
  std::vector<float> hphi(size_t(N) * K), halpha = {0.8f, 0.9f, 1.1f}, hbias(N);
  for (auto& v : hx) v = __float2bfloat16(nd(rng));
  for (auto& v : hphi) v = 0.01f * nd(rng);
  for (auto& v : hbias) v = 0.1f * nd(rng);
  std::vector<ProjectParams> ps(sets);
  const SplitWorkspaceLayout l = split_workspace_layout(kSplitMaxCtas, B, N);
  void* ws;
  CK(cudaMalloc(&ws, l.bytes));
  CK(cudaMemset(ws, 0, l.bytes));
  for (int s = 0; s < sets; ++s) {
    void *x, *phi, *alpha, *bias, *f, *hp, *hr;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMalloc(&phi, hphi.size() * 4));
    CK(cudaMalloc(&alpha, 12));
    CK(cudaMalloc(&bias, N * 4));
    CK(cudaMalloc(&f, size_t(B) * C * 2));
    CK(cudaMalloc(&hp, B * n * 4));
    CK(cudaMalloc(&hr, B * n * n * 4));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(phi, hphi.data(), hphi.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(alpha, halpha.data(), 12, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(bias, hbias.data(), N * 4, cudaMemcpyHostToDevice));
    ProjectParams& p = ps[s];
    p.x = static_cast<const __nv_bfloat16*>(x);
    p.phi = phi;
    p.alpha = static_cast<const float*>(alpha);
    p.bias = static_cast<const float*>(bias);
    p.f_out = static_cast<__nv_bfloat16*>(f);
    p.h_post = static_cast<float*>(hp);
    p.h_res = static_cast<float*>(hr);
    p.batch = B;
    p.hidden = C;
    p.k_len = K;
    p.num_coef = N;
    p.eps_norm = 1e-6f;
    p.mode = ProjectMode::kPre;
    p.workspace = ws;
    p.workspace_bytes = l.bytes;
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const char* why = nullptr;
  for (int i = 0; i < 5; ++i) {
    cudaError_t e = mhc_split_project_traced(ps[i % sets], n, true, st, true, false, &why);
    if (e != cudaSuccess) {
      std::printf("launch: %s (%s)\n", cudaGetErrorString(e), why ? why : "");
      return 1;
    }
  }
  CK(cudaStreamSynchronize(st));
  const int ctas = (C / 8 + (C / 8 + 131) / 132 - 1) / ((C / 8 + 131) / 132);
  std::printf("B=%d n=%d C=%d ctas(est)=%d\n", B, n, C, ctas);
  // Isolated launches: stamps.
  const int reps = 60, steps = 9;
  std::vector<std::vector<double>> lo(2 * steps), med(2 * steps), hi(2 * steps);
  std::vector<double> mhz;
  std::vector<int> grid_seen;
  for (int r = 0; r < reps; ++r) {
    std::vector<unsigned long long> zero(kSplitMaxCtas * 32, 0);
    CK(cudaMemcpyToSymbol(g_split_trace, zero.data(), zero.size() * 8));
    spin<<<132, 32, 0, st>>>(50000);
    CK(cudaGetLastError());
    CK(mhc_split_project_traced(ps[(r + 5) % sets], n, true, st, true, false, &why));
    CK(cudaStreamSynchronize(st));
    std::vector<unsigned long long> t(kSplitMaxCtas * 32);
    CK(cudaMemcpyFromSymbol(t.data(), g_split_trace, t.size() * 8));
    {
      std::vector<double> f;
      for (int c = 0; c < kSplitMaxCtas && t[c * 32] != 0; ++c)
        if (t[c * 32 + 12] > t[c * 32 + 2]) f.push_back(double(t[c * 32 + 26] - t[c * 32 + 21]) / double(t[c * 32 + 12] - t[c * 32 + 2]));
      std::sort(f.begin(), f.end());
      if (!f.empty()) mhz.push_back(f[f.size() / 2] * 1e3);
    }
    unsigned long long t0 = ~0ull;
    int launched = 0;  // CTAs that stamped their entry (the launcher may take fewer than ctas(est))
    while (launched < kSplitMaxCtas && t[launched * 32] != 0) ++launched;
    for (int c = 0; c < launched; ++c) t0 = std::min(t0, t[c * 32]);
    for (int k = 0; k < 2 * steps; ++k) {
      std::vector<double> v;
      for (int c = 0; c < launched; ++c)
        if (t[c * 32 + k] != 0) v.push_back(double(t[c * 32 + k] - t0) * 1e-3);
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      if (k == 0) grid_seen.push_back(launched);
      lo[k].push_back(v.front());
      med[k].push_back(v[v.size() / 2]);
      hi[k].push_back(v.back());
    }
  }
  const char* names[steps] = {"entry",         "loads done",  "partials in smem", "record published", "records gathered",
                              "H_pre",         "mix stored",  "(MMAs done)",         "owner Sinkhorn+stores"};
  auto mid = [](std::vector<double> v) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%-24s %-6s %8s %8s %8s   (us from the first CTA's entry; medians over %d launches)\n", "step", "thread",
              "first", "median", "last", reps);
  for (int k = 0; k < 2 * steps; ++k) {
    if (med[k].empty()) continue;
    std::printf("%-24s %-6s %8.2f %8.2f %8.2f  (%zu)\n", names[k / 2], k % 2 ? "t480" : "t0", mid(lo[k]), mid(med[k]),
                mid(hi[k]), med[k].size());
  }
  if (!grid_seen.empty()) std::printf("CTAs launched: %d\n", grid_seen.back());
  std::printf("SM clock over the steps (clock64 / globaltimer, thread 0): %.0f MHz\n", mid(mhz));
  // Back-to-back: events around 200 launches over rotated sets.
  for (int pdl = 0; pdl < 2; ++pdl) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int rep = 0; rep < 5; ++rep) {
      CK(cudaEventRecord(a, st));
      for (int i = 0; i < 200; ++i) CK(mhc_split_project_traced(ps[i % sets], n, true, st, pdl, false, &why));
      CK(cudaEventRecord(b, st));
      CK(cudaEventSynchronize(b));
      float m;
      CK(cudaEventElapsedTime(&m, a, b));
      ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("back-to-back stream launches, pdl=%d: %.2f us each (median of 5 x 200)\n", pdl, ms[2] * 1e3 / 200);
  }
  return 0;
}
