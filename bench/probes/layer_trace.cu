// Probe: the GPU timeline of moe_forward — every kernel, memset and memcpy
// of one layer call with its start, its duration and the idle gap before it
// (CUPTI activity records, GPU timestamps) — to see where the layer's time
// outside FC1 and FC2 goes. flashmix-bench's moe_forward records give the
// layer against FC1 + FC2 alone; ncu gives each kernel's duration but
// serialises them and skips memsets, so neither shows the gaps.
//
// The layer runs `reps` times back to back on one stream after a warm-up
// (as flashmix-bench times it: no sync between calls); the records of the
// middle call are printed, and the median over calls of the span, the
// kernels' sum and the gaps' sum.
//
// A stand-alone probe (not built by CMake), against the built library:
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude \
//     -o layer_trace bench/probes/layer_trace.cu build/libflashmix.a -lcupti -lcuda
//   ./layer_trace CASE [auto|gather|copy] [bf16|fp8|fp8full]
// CASE: qwen3 (T4096 k8 E128 I768 H2048), deepseek_ep (T1024 k8 E32 I2048
// H7168), mixtral (T4096 k2 E8 I14336 H4096): flashmix-bench's moe_forward
// cases, bf16 router logits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashmix/moe.h"
#include "probe_check.h"

#define CUPTI_CK(x)                                              \
  do {                                                           \
    CUptiResult r = (x);                                         \
    if (r != CUPTI_SUCCESS) {                                    \
      const char* s = nullptr;                                   \
      cuptiGetResultString(r, &s);                               \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, s ? s : "?"); \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

namespace {

struct Activity {
  uint64_t start, end;
  std::string name;
};
std::vector<Activity> g_acts;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max_records = 0;
}

std::string short_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  // "void flashmix::(anonymous namespace)::kernel<...>(args)" -> "kernel<...>", cut.
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  for (const char* drop : {"flashmix::", "(anonymous namespace)::", "detail::", "moe::"}) {
    for (size_t p; (p = s.find(drop)) != std::string::npos;) s.erase(p, std::strlen(drop));
  }
  size_t depth = 0, cut = s.size();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>' && depth) --depth;
    if (s[i] == '(' && depth == 0) {
      cut = i;
      break;
    }
  }
  s = s.substr(0, cut);
  return s.size() > 90 ? s.substr(0, 90) + "..." : s;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
      g_acts.push_back({k->start, k->end, short_name(k->name)});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
      g_acts.push_back({m->start, m->end, "[memset " + std::to_string(m->bytes >> 10) + " KiB]"});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
      g_acts.push_back({m->start, m->end, "[memcpy " + std::to_string(m->bytes >> 10) + " KiB]"});
    }
  }
  std::free(buffer);
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed * 97531u ^ uint32_t(i >> 32);
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(scale * (float(x & 0xffffff) / float(0x800000) - 1.0f));
  }
}

// e4m3 codes without NaN (0x7f / 0xff): below +-8 (exponent field < 11;
// scales 1/64), or with `full` every finite magnitude up to 448 (scales
// 1/4096), as quantize_fp8 of uniform weights gives: the same layer on
// other bits, to see whether the data moves the FP8 GEMMs' clocks.
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint32_t seed, bool full) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed * 97531u;
    x ^= x >> 15;
    x *= 2246822519u;
    p[i] = uint8_t((x & 0x80) | ((x >> 8) % (full ? 127 : 88)));
  }
}

__global__ void fill_f32(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

struct Case {
  const char* name;
  int64_t T;
  int k, E;
  int64_t H, I;
  flashmix::MoeRouterScoring scoring;
  float scaling;
  int ep = 1;  // rank 0 of EP `ep`: E / ep local experts, router over all E
};

template <class T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Times fn as flashmix-bench does (back to back on the stream, event pairs,
// median), then traces `reps` more calls and prints the middle one.
template <class Fn>
void trace(const char* label, Fn&& fn, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaStreamSynchronize(stream));
  // Event-timed, as flashmix-bench: back to back, median.
  // LAYER_TRACE_REPS=N times N calls instead (the traced calls stay 9) and
  // prints each call's time in order: drift under sustained load.
  const char* env_reps = std::getenv("LAYER_TRACE_REPS");
  const int timed = env_reps ? std::max(1, std::atoi(env_reps)) : 9;
  std::vector<cudaEvent_t> ev(2 * timed);
  for (auto& evt : ev) CK(cudaEventCreate(&evt));
  for (int i = 0; i < timed; ++i) {
    CK(cudaEventRecord(ev[2 * i], stream));
    fn();
    CK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  CK(cudaStreamSynchronize(stream));
  std::vector<float> ms(timed);
  for (int i = 0; i < timed; ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  if (env_reps) {
    std::printf("\n%s: each of %d calls in order (us):", label, timed);
    for (int i = 0; i < timed; ++i) std::printf("%s%.1f", i % 10 ? " " : "\n  ", ms[i] * 1e3);
    std::printf("\n");
  }
  std::sort(ms.begin(), ms.end());
  const int reps = 9;  // traced calls

  CUPTI_CK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  fn();  // the first call after enabling may carry CUPTI's set-up
  CK(cudaStreamSynchronize(stream));
  CUPTI_CK(cuptiActivityFlushAll(1));
  g_acts.clear();
  for (int i = 0; i < reps; ++i) fn();
  CK(cudaStreamSynchronize(stream));
  CUPTI_CK(cuptiActivityFlushAll(1));
  CUPTI_CK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  CUPTI_CK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET));
  CUPTI_CK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY));

  std::sort(g_acts.begin(), g_acts.end(), [](const Activity& a, const Activity& b) { return a.start < b.start; });
  if (g_acts.size() % reps != 0) {
    std::printf("%s: %zu records for %d calls: not a whole number a call\n", label, g_acts.size(), reps);
    return;
  }
  const size_t per = g_acts.size() / reps;
  std::printf("\n%s: event-timed median %.1f us (min %.1f)\n", label, ms[timed / 2] * 1e3, ms[0] * 1e3);
  std::vector<double> spans, sums, gaps, between;
  for (int r = 0; r < reps; ++r) {
    const Activity* a = &g_acts[r * per];
    if (r) between.push_back((double(a[0].start) - double(a[-1].end)) * 1e-3);
    double sum = 0, gap = 0;
    for (size_t i = 0; i < per; ++i) {
      sum += (a[i].end - a[i].start) * 1e-3;
      if (i) gap += std::max(0.0, (double(a[i].start) - double(a[i - 1].end)) * 1e-3);
    }
    spans.push_back((a[per - 1].end - a[0].start) * 1e-3);
    sums.push_back(sum);
    gaps.push_back(gap);
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "per call: span %.1f us, activities' sum %.1f us, idle gaps' sum %.1f us, between calls %.1f us "
      "(medians of %d calls)\n",
      med(spans), med(sums), med(gaps), med(between), reps);
  const Activity* a = &g_acts[(reps / 2) * per];
  std::printf("call %d of %d:\n%10s %10s %10s  %s\n", reps / 2 + 1, reps, "start_us", "gap_us", "dur_us", "what");
  for (size_t i = 0; i < per; ++i) {
    const double start = (double(a[i].start) - double(a[0].start)) * 1e-3;
    const double gap = i ? (double(a[i].start) - double(a[i - 1].end)) * 1e-3 : 0.0;
    std::printf("%10.2f %10.2f %10.2f  %s\n", start, gap, (a[i].end - a[i].start) * 1e-3, a[i].name.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashmix;
  const Case cases[] = {
      {"qwen3", 4096, 8, 128, 2048, 768, MoeRouterScoring::kSoftmax, 1.f},
      {"deepseek_ep", 1024, 8, 32, 7168, 2048, MoeRouterScoring::kSigmoid, 2.5f},
      {"mixtral", 4096, 2, 8, 4096, 14336, MoeRouterScoring::kSoftmax, 1.f},
      {"deepseek_ep_T16", 16, 8, 32, 7168, 2048, MoeRouterScoring::kSigmoid, 2.5f},
      {"v4flash_ep8_T16", 16, 6, 256, 4096, 2048, MoeRouterScoring::kSigmoid, 1.5f, 8},
      {"v4flash_ep8_T64", 64, 6, 256, 4096, 2048, MoeRouterScoring::kSigmoid, 1.5f, 8},
  };
  const std::string want = argc > 1 ? argv[1] : "qwen3";
  const std::string input = argc > 2 ? argv[2] : "auto";
  const bool fp8_full = argc > 3 && std::string(argv[3]) == "fp8full";
  const bool fp8 = fp8_full || (argc > 3 && std::string(argv[3]) == "fp8");
  const Case* c = nullptr;
  for (const Case& x : cases)
    if (want == x.name) c = &x;
  if (!c) {
    std::printf("usage: layer_trace qwen3|deepseek_ep|mixtral|deepseek_ep_T16|v4flash_ep8_T16|v4flash_ep8_T64 "
                "[auto|gather|copy] [bf16|fp8|fp8full]\n");
    return 2;
  }
  const int64_t T = c->T, H = c->H, I = c->I, E = c->E / c->ep;  // E: the local experts
  const size_t wb = fp8 ? 1 : 2;
  auto* X = dalloc<__nv_bfloat16>(size_t(T * H));
  auto* logits = dalloc<__nv_bfloat16>(size_t(T * c->E));
  auto* W1 = dalloc<uint8_t>(size_t(E * 2 * I * H) * wb);
  auto* W2 = dalloc<uint8_t>(size_t(E * H * I) * wb);
  auto* out = dalloc<__nv_bfloat16>(size_t(T * H));
  float *s1 = nullptr, *s2 = nullptr;
  fill_bf16<<<1024, 256>>>(X, T * H, 21, 1.0f);
  fill_bf16<<<1024, 256>>>(logits, T * c->E, 22, 4.0f);
  if (fp8) {
    fill_e4m3<<<4096, 256>>>(W1, E * 2 * I * H, 23, fp8_full);
    fill_e4m3<<<4096, 256>>>(W2, E * H * I, 24, fp8_full);
    const int64_t n1 = E * (2 * I / 128) * (H / 128), n2 = E * ((H + 127) / 128) * (I / 128);
    s1 = dalloc<float>(size_t(n1));
    s2 = dalloc<float>(size_t(n2));
    fill_f32<<<256, 256>>>(s1, n1, fp8_full ? 1.0f / 4096 : 1.0f / 64);
    fill_f32<<<256, 256>>>(s2, n2, fp8_full ? 1.0f / 4096 : 1.0f / 64);
  } else {
    fill_bf16<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(W1), E * 2 * I * H, 23, 0.05f);
    fill_bf16<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(W2), E * H * I, 24, 0.05f);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  MoeForwardArgs f;
  f.num_tokens = T;
  f.hidden = H;
  f.inter = I;
  f.k = c->k;
  f.num_experts = c->E;
  f.num_experts_per_node = int(E);
  f.X = X;
  f.router_logits = logits;
  f.router.logits_dtype = DType::kBFloat16;
  f.router.scoring = c->scoring;
  f.router.renormalize = true;
  f.router.routed_scaling_factor = c->scaling;
  f.W1 = W1;
  f.W2 = W2;
  f.out = out;
  if (fp8) {
    f.fp8 = MoeFp8Scaling::kBlock;
    f.w1_scales = s1;
    f.w2_scales = s2;
  }
  if (input == "gather") f.fc1_input = MoeFc1Input::kGather;
  if (input == "copy") f.fc1_input = MoeFc1Input::kPermutedCopy;
  const size_t ws_bytes = moe_forward_workspace_size(f);
  void* ws = dalloc<char>(ws_bytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto layer = [&] {
    const Status st = moe_forward(f, ws, ws_bytes, stream);
    if (!st.ok()) {
      std::printf("moe_forward: %s\n", st.message().c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) layer();
  CK(cudaStreamSynchronize(stream));

  std::printf("case %s, fc1_input %s (resolved: %s), %s weights\n", c->name, input.c_str(),
              to_string(moe_forward_fc1_input(f)), fp8 ? "fp8 block" : "bf16");
  trace("moe_forward", layer, stream);
  if (!fp8) {
    // FC1 and FC2 alone on the layer's routing (flashmix-bench's staged
    // ceiling): FC1 on the permuted copy and gathered, FC2 kAtomic.
    auto* ids = dalloc<int32_t>(size_t(T * c->k));
    auto* scales = dalloc<float>(size_t(T * c->k));
    auto* offsets = dalloc<int64_t>(size_t(E + 1));
    auto* p2u = dalloc<int32_t>(size_t(T * c->k));
    auto* u2p = dalloc<int32_t>(size_t(T * c->k));
    auto* xp = dalloc<__nv_bfloat16>(size_t(T * c->k * H));
    auto* act = dalloc<__nv_bfloat16>(size_t(T * c->k * I));
    MoeForwardArgs g = f;
    g.selected_experts_out = ids;
    g.final_scales_out = scales;
    CK(cudaStreamSynchronize(stream));
    if (!moe_forward(g, ws, ws_bytes, stream).ok()) return 1;
    MoeRoutingArgs m;
    m.token_selected_experts = ids;
    m.num_tokens = T;
    m.k = c->k;
    m.num_experts_per_node = int(E);
    m.expert_first_token_offset = offsets;
    m.permuted_row_to_unpermuted_row = p2u;
    m.unpermuted_row_to_permuted_row = u2p;
    m.input = X;
    m.permuted_input = xp;
    m.hidden = H;
    const size_t mws_bytes = build_moe_routing_maps_workspace_size(m);
    void* mws = dalloc<char>(mws_bytes);
    if (!build_moe_routing_maps(m, mws, mws_bytes, stream).ok()) return 1;
    MoeFc1Args a1;
    a1.X = xp;
    a1.x_permuted = true;
    a1.W1 = W1;
    a1.expert_first_token_offset = offsets;
    a1.permuted_row_to_unpermuted_row = p2u;
    a1.num_tokens = T;
    a1.k = c->k;
    a1.hidden = H;
    a1.inter = I;
    a1.num_experts_per_node = int(E);
    a1.out = act;
    MoeFc1Args a1g = a1;
    a1g.X = X;
    a1g.x_permuted = false;
    Fc2FinalizeArgs a2;
    a2.A = act;
    a2.W2 = W2;
    a2.expert_first_token_offset = offsets;
    a2.permuted_row_to_unpermuted_row = p2u;
    a2.scales = scales;
    a2.num_tokens = T;
    a2.k = c->k;
    a2.hidden = H;
    a2.inter = I;
    a2.num_experts_per_node = int(E);
    a2.out = out;
    const size_t ws2_bytes = moe_fc2_finalize_workspace_size(a2);
    void* ws2 = dalloc<char>(ws2_bytes);
    auto ok = [](Status st) {
      if (!st.ok()) {
        std::printf("%s\n", st.message().c_str());
        std::exit(1);
      }
    };
    trace("moe_fc1 (permuted copy)", [&] { ok(moe_fc1(a1, stream)); }, stream);
    trace("moe_fc1 (gathered)", [&] { ok(moe_fc1(a1g, stream)); }, stream);
    trace("moe_fc2_finalize (atomic)", [&] { ok(moe_fc2_finalize(a2, ws2, ws2_bytes, stream)); }, stream);
  }
  return 0;
}
