// Which GEMM kernel moe_fc2_finalize runs (moe_fc2_dispatch.h): the table of
// candidates with their conditions, and the automatic rule, stated once.
#include "moe/moe_fc2_dispatch.h"

#include "common/check.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix {

const char* to_string(Fc2GemmKernel kernel) {
  switch (kernel) {
    case Fc2GemmKernel::kAuto: return "auto";
    case Fc2GemmKernel::kRows: return "rows";
    case Fc2GemmKernel::kCutlassCooperative: return "cutlass_cooperative";
    case Fc2GemmKernel::kCutlassPingpong: return "cutlass_pingpong";
  }
  return "unknown";
}

namespace {

constexpr const char* kOp = "moe_fc2_finalize";

// Our own kernel (sm90_fc2_rows_gemm.cu): its shared-memory tables hold at
// most kFc2RowsMaxExperts experts, and TMA takes the permuted rows' indices
// as int32 coordinates. (Both hold for every shape validate_fc2 accepts
// today; they are stated here so that widening the op's limits cannot
// silently send a shape to it that it cannot take.)
static_assert(kFc2RowsMaxExperts == 1024, "the message below names the limit");
const char* rows_unavailable(const Fc2FinalizeArgs& a) {
  if (a.num_experts_per_node > kFc2RowsMaxExperts) return "more local experts than its tables hold (1024)";
  if (a.num_tokens * a.k >= (int64_t(1) << 31)) return "T * k must be below 2^31 (TMA row coordinates)";
  return nullptr;
}

// CUTLASS's ptr-array grouped GEMM (sm90_fc2_grouped_gemm.cu): any valid
// shape, when the library was built with the CUTLASS headers.
const char* cutlass_unavailable(const Fc2FinalizeArgs&) {
  return sm90_fc2_built_with_cutlass()
             ? nullptr
             : "built without CUTLASS (set FLASHMIX_CUTLASS_DIR or run scripts/setup_cutlass.sh)";
}

struct Candidate {
  Fc2GemmKernel kernel;
  const char* (*unavailable)(const Fc2FinalizeArgs&);  // nullptr result: it can run these args
};

constexpr Candidate kCandidates[] = {
    {Fc2GemmKernel::kRows, rows_unavailable},
    {Fc2GemmKernel::kCutlassCooperative, cutlass_unavailable},
    {Fc2GemmKernel::kCutlassPingpong, cutlass_unavailable},
};

}  // namespace

const char* fc2_gemm_kernel_unavailable(Fc2GemmKernel kernel, const Fc2FinalizeArgs& a) {
  for (const Candidate& c : kCandidates)
    if (c.kernel == kernel) return c.unavailable(a);
  return "not a kernel (kAuto or an unknown value)";
}

// The automatic rule. Measured on an H200 with flashmix-bench, the kernels
// pinned against each other in the same process (docs/fc2_grouped_gemm.md,
// 2026-11-23/24):
//  - atomic, deterministic, unfused: kRows, faster or even on every bench
//    shape (no MMA on padding rows: CUTLASS's tiles have a fixed row count).
//    unfused DeepSeek EP 454 vs 482 us; deterministic DeepSeek EP 563-574 vs
//    561-570, Qwen3-MoE 363-368 vs 434-451, Mixtral 1510 vs 1596-1608;
//    atomic Mixtral -9 %, Qwen3-MoE -13 %, decode -2 %.
//  - atomic_fp32: CUTLASS, where DeepSeek EP ran 500-519 us vs 525-551 on
//    kRows (measured before kRows' 272-row tiles and batched epilogue;
//    `flashmix-bench --fc2-gemm-kernel` re-measures it): the pingpong
//    64x256, whose epilogue (twice the reduction bytes of atomic) overlaps
//    the other warpgroup's mainloop, except with a short K (I < 1024:
//    Qwen3-MoE's I = 768), where the cooperative 128x256 was faster.
//  - without CUTLASS in the build: kRows for every mode.
Status choose_fc2_gemm_kernel(const Fc2FinalizeArgs& a, Fc2GemmChoice* choice) {
  const Fc2GemmKernel pinned = a.tuning.gemm_kernel;
  if (pinned != Fc2GemmKernel::kAuto) {
    const char* why_not = fc2_gemm_kernel_unavailable(pinned, a);
    FM_REQUIRE_SUPPORTED(why_not == nullptr, kOp, "tuning.gemm_kernel", to_string(pinned), " cannot run: ", why_not);
    *choice = {pinned, "pinned by tuning.gemm_kernel"};
    return Status::Ok();
  }
  // The preferred kernel first, then the fallback, each with its reason.
  const bool short_k = a.inter < 1024;
  const Fc2GemmChoice cutlass =
      short_k ? Fc2GemmChoice{Fc2GemmKernel::kCutlassCooperative,
                              "auto: atomic_fp32, I < 1024: CUTLASS cooperative 128x256 measured fastest"}
              : Fc2GemmChoice{Fc2GemmKernel::kCutlassPingpong,
                              "auto: atomic_fp32: CUTLASS pingpong 64x256 measured faster than rows (DeepSeek EP)"};
  Fc2GemmChoice order[2];
  int n = 0;
  if (a.mode == Fc2Mode::kAtomicFp32) {
    order[n++] = cutlass;
    order[n++] = {Fc2GemmKernel::kRows, "auto: atomic_fp32 on rows: built without CUTLASS"};
  } else {
    order[n++] = {Fc2GemmKernel::kRows, "auto: atomic, deterministic, unfused: rows measured faster or even"};
    order[n++] = {cutlass.kernel, "auto: rows cannot take the shape: CUTLASS"};
  }
  for (int i = 0; i < n; ++i)
    if (fc2_gemm_kernel_unavailable(order[i].kernel, a) == nullptr) {
      *choice = order[i];
      return Status::Ok();
    }
  return Status(StatusCode::kNotSupported,
                detail::concat(kOp, ": tuning.gemm_kernel: no kernel can run this shape in this build (rows: ",
                               fc2_gemm_kernel_unavailable(Fc2GemmKernel::kRows, a), ")"));
}

}  // namespace flashmix
