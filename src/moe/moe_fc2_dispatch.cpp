// Which GEMM kernel moe_fc2_finalize runs (moe_fc2_dispatch.h): the table of
// candidates with their conditions, and the automatic rule, stated once.
#include "moe/moe_fc2_dispatch.h"

#include <algorithm>

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
// It takes bf16 A and W2 only: FP8 runs on kRows.
const char* cutlass_unavailable(const Fc2FinalizeArgs& a) {
  if (!sm90_fc2_built_with_cutlass())
    return "built without CUTLASS (set FLASHMIX_CUTLASS_DIR or run scripts/setup_cutlass.sh)";
  if (a.fp8 != MoeFp8Scaling::kNone) return "the CUTLASS kernels take bf16 A and W2 only (FP8 runs on rows)";
  if (a.weights != MoeWeightFormat::kDense) return "the CUTLASS kernels take dense bf16 W2 only (MXFP4 runs on rows)";
  return nullptr;
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

// The automatic rule, measured with flashmix-bench, the kernels pinned
// against each other in the same process (docs/fc2_grouped_gemm.md):
//  - atomic, deterministic, unfused: kRows, faster or even on every bench
//    shape (no MMA on padding rows: CUTLASS's tiles have a fixed row count).
//    H200, 2026-11-23/24: unfused DeepSeek EP 454 vs 482 us; deterministic
//    Qwen3-MoE 363-368 vs 434-451, Mixtral 1510 vs 1596-1608; atomic Mixtral
//    -9 %, Qwen3-MoE -13 %.
//  - atomic_fp32 (twice the reduction bytes of atomic in the epilogue): by
//    the rows per local expert, bounded on the host by T*k / E_local.
//    H100, 2026-11-25, two rounds (rows / CUTLASS pingpong / cooperative):
//    DeepSeek EP (256 a expert) 612 / 588-594 / 625-642 us, Qwen3-MoE (256)
//    449-451 / 412 / 430-432, Mixtral (1024) 1527-1534 / 1733-1794 /
//    1678-1720, decode (T = 16, 4) 318 / 343 / 349-350. So CUTLASS pingpong
//    (whose epilogue overlaps the other warpgroup's mainloop) between
//    kFc2Fp32CutlassMinRows and kFc2Fp32CutlassMaxRows rows a expert, kRows
//    outside (long experts: no padded tiles; decode: one short wave).
//  - without CUTLASS in the build: kRows for every mode.
//  - FP8 (fp8 != kNone) or MXFP4 W2: kRows for every mode (CUTLASS's kernels are bf16).
constexpr int64_t kFc2Fp32CutlassMinRows = 16, kFc2Fp32CutlassMaxRows = 1024;

Status choose_fc2_gemm_kernel(const Fc2FinalizeArgs& a, Fc2GemmChoice* choice) {
  const Fc2GemmKernel pinned = a.tuning.gemm_kernel;
  if (pinned != Fc2GemmKernel::kAuto) {
    const char* why_not = fc2_gemm_kernel_unavailable(pinned, a);
    FM_REQUIRE_SUPPORTED(why_not == nullptr, kOp, "tuning.gemm_kernel", to_string(pinned), " cannot run: ", why_not);
    *choice = {pinned, "pinned by tuning.gemm_kernel"};
    return Status::Ok();
  }
  // The preferred kernel first, then the fallback, each with its reason.
  const int64_t rows_per_expert = a.num_tokens * a.k / std::max(1, a.num_experts_per_node);
  const bool fp32_on_cutlass = rows_per_expert > kFc2Fp32CutlassMinRows && rows_per_expert < kFc2Fp32CutlassMaxRows;
  Fc2GemmChoice order[2];
  int n = 0;
  if (a.weights != MoeWeightFormat::kDense) {
    order[n++] = {Fc2GemmKernel::kRows, "auto: MXFP4 W2: rows (the CUTLASS kernels take dense bf16 only)"};
  } else if (a.fp8 != MoeFp8Scaling::kNone) {
    order[n++] = {Fc2GemmKernel::kRows, "auto: FP8 A and W2: rows (the CUTLASS kernels take bf16 only)"};
  } else if (a.mode == Fc2Mode::kAtomicFp32 && fp32_on_cutlass) {
    order[n++] = {Fc2GemmKernel::kCutlassPingpong,
                  "auto: atomic_fp32, 16 < T*k/E_local < 1024: CUTLASS pingpong 64x256 measured fastest"};
    order[n++] = {Fc2GemmKernel::kRows, "auto: atomic_fp32 on rows: built without CUTLASS"};
  } else if (a.mode == Fc2Mode::kAtomicFp32) {
    order[n++] = {Fc2GemmKernel::kRows, "auto: atomic_fp32, T*k/E_local <= 16 or >= 1024: rows measured fastest"};
    order[n++] = {Fc2GemmKernel::kCutlassPingpong, "auto: rows cannot take the shape: CUTLASS"};
  } else {
    order[n++] = {Fc2GemmKernel::kRows, "auto: atomic, deterministic, unfused: rows measured faster or even"};
    order[n++] = {Fc2GemmKernel::kCutlassPingpong, "auto: rows cannot take the shape: CUTLASS"};
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
