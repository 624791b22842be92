// flashmix-bench: every op, its ceilings measured in the same run, a check
// against the CPU reference per case, and an optional JSON record.
//
//   flashmix-bench [--json FILE] [--filter TEXT] [--quick] [--no-verify] [--sweep]
//                  [--fc2-gemm-kernel NAME[,NAME...]]
//
// --fc2-gemm-kernel: time each moe_fc2 case on these GEMM kernels (auto,
// rows, cutlass_cooperative, cutlass_pingpong; default auto); a pinned one's
// records are named case/mode@NAME.
//
// Without a GPU it runs the CPU reference backend on small shapes and says so.
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

#include "bench_common.h"
#include "flashmix_git_commit.h"  // generated at build time (cmake/git_commit.cmake)

using namespace flashmix::bench;

int main(int argc, char** argv) {
  Context ctx;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) ctx.filter = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) ctx.quick = true;
    else if (!std::strcmp(argv[i], "--no-verify")) ctx.verify = false;
    else if (!std::strcmp(argv[i], "--sweep")) ctx.sweep = true;
    else if (!std::strcmp(argv[i], "--fc2-gemm-kernel") && i + 1 < argc) ctx.fc2_gemm_kernels = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: %s [--json FILE] [--filter TEXT] [--quick] [--no-verify] [--sweep] "
                   "[--fc2-gemm-kernel NAME[,NAME...]]\n",
                   argv[0]);
      return 2;
    }
  }
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  ctx.date = date;
  ctx.commit = FLASHMIX_GIT_COMMIT;

  int devices = 0;
  ctx.gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();
  cudaStream_t stream = nullptr;
  if (ctx.gpu) {
    cudaDeviceProp prop;
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    ctx.gpu_name = prop.name;
    ctx.num_sms = prop.multiProcessorCount;
    ctx.l2_bytes = prop.l2CacheSize;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ctx.copy_gbps = measure_copy_gbps(stream, ctx.quick ? 10 : 30);
    double gemm_us = cublas_gemm_us(8192, 8192, 8192, stream, ctx.quick ? 10 : 30);
    ctx.gemm_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / (gemm_us * 1e-6) / 1e12;
    double fp8_us = cublaslt_fp8_gemm_us(8192, 8192, 8192, stream, ctx.quick ? 10 : 30);
    ctx.gemm_fp8_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / (fp8_us * 1e-6) / 1e12;
    std::printf("flashmix-bench on %s (%d SMs, L2 %zu MiB), commit %s, %s\n", prop.name, ctx.num_sms,
                ctx.l2_bytes >> 20, ctx.commit.c_str(), ctx.date.c_str());
    std::printf("ceilings: device-to-device copy %.1f GB/s (read + write); cuBLAS bf16 GEMM 8192^3 %.1f TFLOP/s; "
                "cuBLASLt FP8 GEMM 8192^3 (e4m3, per-tensor scales, fast accumulation) %.1f TFLOP/s\n",
                ctx.copy_gbps, ctx.gemm_tflops, ctx.gemm_fp8_tflops);
  } else {
    std::printf("flashmix-bench: no GPU found: running the CPU reference backend on small shapes "
                "(CPU timings; no ceilings, nothing to check against)\n");
  }
  print_header();
  run_moe_finalize_cases(ctx);
  run_mhc_cases(ctx);
  run_moe_routing_cases(ctx);
  run_moe_router_cases(ctx);
  run_moe_fc1_cases(ctx);
  run_moe_fc2_cases(ctx);
  run_moe_forward_cases(ctx);
  run_quantize_fp8_cases(ctx);
  run_mxfp4_cases(ctx);

  int failed = 0;
  for (const auto& r : ctx.records) failed += r.check.rfind("FAILED", 0) == 0;
  if (!json_path.empty()) {
    if (!write_json(ctx, json_path)) {
      std::fprintf(stderr, "flashmix-bench: cannot write %s\n", json_path.c_str());
      return 2;
    }
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (stream) cudaStreamDestroy(stream);
  std::printf("%zu cases, %d failed checks\n", ctx.records.size(), failed);
  return failed ? 1 : 0;
}
