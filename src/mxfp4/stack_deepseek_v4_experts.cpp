// stack_deepseek_v4_experts (spec §13.6): DeepSeek-V4's per-expert MXFP4
// tensors -> flashmix's stacked expert weights, in host memory. V4 stores
// each expert's gate (w1), up (w3) and down (w2) projections as separate
// [out, in / 2] packed-e2m1 and [out, in / 32] ue8m0 tensors (docs/mxfp4.md);
// FC1 takes gate and up as one [2I, H] matrix per expert in a
// Fc1WeightLayout row order, FC2 the down projection as it is. Rows are
// copied whole: a row's bytes and its scales keep their meaning.
#include <cstring>

#include "common/check.h"
#include "flashmix/mxfp4.h"
#include "mxfp4/mxfp4_internal.h"

namespace flashmix {

namespace {

constexpr const char* kOp = "stack_deepseek_v4_experts";
constexpr int kMaxExperts = 1024;

// Copies `rows` rows of `row_bytes` from src into dst, source row r landing
// on destination row first + r * step.
void copy_rows(uint8_t* dst, const void* src, int64_t rows, int64_t row_bytes, int64_t first, int64_t step) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + (first + r * step) * row_bytes, s + r * row_bytes, size_t(row_bytes));
}

}  // namespace

Status stack_deepseek_v4_experts(const StackDeepSeekV4ExpertsArgs& a) {
  FM_REQUIRE(a.num_experts >= 1 && a.num_experts <= kMaxExperts, kOp, "num_experts", "must be in 1..", kMaxExperts,
             " (got ", a.num_experts, ")");
  FM_REQUIRE(a.hidden >= kMxfp4GroupCols && a.hidden % kMxfp4GroupCols == 0, kOp, "hidden",
             "must be a positive multiple of 32 (got ", a.hidden, ")");
  FM_REQUIRE(a.inter >= kMxfp4GroupCols && a.inter % kMxfp4GroupCols == 0, kOp, "inter",
             "must be a positive multiple of 32 (got ", a.inter, ")");
  FM_REQUIRE(a.hidden <= detail::kInt32Max && a.inter <= detail::kInt32Max &&
                 a.hidden * a.inter <= (int64_t(1) << 50) / a.num_experts,
             kOp, "inter", "E * H * I must be below 2^50 (hidden ", a.hidden, ", inter ", a.inter, ")");
  FM_REQUIRE(a.layout == Fc1WeightLayout::kGateUp || a.layout == Fc1WeightLayout::kInterleaved, kOp, "layout",
             "unknown Fc1WeightLayout value ", int(a.layout));
  FM_REQUIRE(a.experts != nullptr, kOp, "experts", "is null");
  for (int e = 0; e < a.num_experts; ++e) {
    const DeepSeekV4ExpertMxfp4& x = a.experts[e];
    const struct {
      const char* name;
      const void* ptr;
    } inputs[] = {{"w1", x.w1}, {"w1_scale", x.w1_scale}, {"w3", x.w3},
                  {"w3_scale", x.w3_scale}, {"w2", x.w2}, {"w2_scale", x.w2_scale}};
    for (const auto& in : inputs)
      FM_REQUIRE(in.ptr != nullptr, kOp, detail::concat("experts[", e, "].", in.name), "is null");
  }
  FM_REQUIRE(a.w1 != nullptr, kOp, "w1", "is null");
  FM_REQUIRE(a.w1_scales != nullptr, kOp, "w1_scales", "is null");
  FM_REQUIRE(a.w2 != nullptr, kOp, "w2", "is null");
  FM_REQUIRE(a.w2_scales != nullptr, kOp, "w2_scales", "is null");

  const int64_t H = a.hidden, I = a.inter;
  const int64_t w1_row = H / 2, w1_srow = H / kMxfp4GroupCols, w2_row = I / 2, w2_srow = I / kMxfp4GroupCols;
  // Gate row i lands on row gate_first + i * step, up row i on up_first + i * step.
  const bool interleaved = a.layout == Fc1WeightLayout::kInterleaved;
  const int64_t step = interleaved ? 2 : 1, gate_first = 0, up_first = interleaved ? 1 : I;
  for (int e = 0; e < a.num_experts; ++e) {
    const DeepSeekV4ExpertMxfp4& x = a.experts[e];
    uint8_t* w1 = static_cast<uint8_t*>(a.w1) + e * 2 * I * w1_row;
    uint8_t* s1 = static_cast<uint8_t*>(a.w1_scales) + e * 2 * I * w1_srow;
    copy_rows(w1, x.w1, I, w1_row, gate_first, step);
    copy_rows(w1, x.w3, I, w1_row, up_first, step);
    copy_rows(s1, x.w1_scale, I, w1_srow, gate_first, step);
    copy_rows(s1, x.w3_scale, I, w1_srow, up_first, step);
    std::memcpy(static_cast<uint8_t*>(a.w2) + e * H * w2_row, x.w2, size_t(H * w2_row));
    std::memcpy(static_cast<uint8_t*>(a.w2_scales) + e * H * w2_srow, x.w2_scale, size_t(H * w2_srow));
  }
  return Status::Ok();
}

}  // namespace flashmix
