// Host-side validation of mxfp4_to_fp8_block and mxfp4_to_bf16 (spec §13.5),
// shared by the GPU and CPU backends. Never reads device memory.
#include "common/check.h"
#include "flashmix/mxfp4.h"
#include "mxfp4/mxfp4_internal.h"

namespace flashmix {

namespace {

constexpr int64_t kMaxElems = int64_t(1) << 60;

// The rules both conversions share: sizes, then (with work) the input
// pointers. `col_multiple` is 128 (FP8 blocks) or 32 (bf16).
Status validate_sizes(const char* op, int64_t batch, int64_t rows, int64_t cols, int64_t col_multiple) {
  using detail::kInt32Max;
  FM_REQUIRE(batch >= 0, op, "batch", "must be >= 0 (got ", batch, ")");
  FM_REQUIRE(rows >= 0, op, "rows", "must be >= 0 (got ", rows, ")");
  FM_REQUIRE(cols >= col_multiple && cols % col_multiple == 0, op, "cols", "must be a positive multiple of ",
             col_multiple, " (got ", cols, ")");
  FM_REQUIRE(cols <= kInt32Max, op, "cols", "must fit in 32 bits (got ", cols, ")");
  FM_REQUIRE(rows <= kInt32Max && (batch == 0 || rows <= kInt32Max / batch), op, "rows",
             "batch * rows must fit in int32 (batch ", batch, ", rows ", rows, ")");
  FM_REQUIRE(batch * rows == 0 || cols <= kMaxElems / (batch * rows), op, "rows",
             "batch * rows * cols must be below 2^60 (batch ", batch, ", rows ", rows, ", cols ", cols, ")");
  return Status::Ok();
}

Status validate_inputs(const char* op, const void* w, const void* w_scales) {
  FM_REQUIRE(w != nullptr, op, "w", "is null");
  FM_REQUIRE(w_scales != nullptr, op, "w_scales", "is null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(w) % 16 == 0, op, "w", "must be 16-byte aligned");
  return Status::Ok();
}

}  // namespace

Status validate_mxfp4_to_fp8_block(const Mxfp4ToFp8BlockArgs& a) {
  constexpr const char* kOp = "mxfp4_to_fp8_block";
  FM_RETURN_IF_ERROR(validate_sizes(kOp, a.batch, a.rows, a.cols, kMxfp4Fp8BlockDim));
  FM_REQUIRE(a.block == Fp8Block::k128x128 || a.block == Fp8Block::k1x128, kOp, "block", "unknown Fp8Block value ",
             int(a.block));
  const int64_t block_rows = fp8_block_rows(a.block);
  const int64_t row_blocks = (a.rows + block_rows - 1) / block_rows;
  const int64_t col_blocks = a.cols / kMxfp4Fp8BlockDim;
  FM_REQUIRE(a.batch * row_blocks == 0 || col_blocks <= detail::kInt32Max / (a.batch * row_blocks), kOp, "rows",
             "the 128 x 128 blocks (batch * ceil(rows / 128) * cols / 128) must fit in int32 (batch ", a.batch,
             ", rows ", a.rows, ", cols ", a.cols, ")");
  if (a.batch == 0 || a.rows == 0) return Status::Ok();  // valid: nothing to read or write

  FM_RETURN_IF_ERROR(validate_inputs(kOp, a.w, a.w_scales));
  FM_REQUIRE(a.q != nullptr, kOp, "q", "is null");
  FM_REQUIRE(a.q_scales != nullptr, kOp, "q_scales", "is null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.q) % 16 == 0, kOp, "q", "must be 16-byte aligned");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.q_scales) % 4 == 0, kOp, "q_scales", "must be 4-byte aligned");
  const int64_t elems = a.batch * a.rows * a.cols;
  const detail::Range outs[] = {{"q", a.q, elems}, {"q_scales", a.q_scales, a.batch * row_blocks * col_blocks * 4}};
  const detail::Range ins[] = {{"w", a.w, elems / 2}, {"w_scales", a.w_scales, elems / kMxfp4GroupCols}};
  return detail::check_no_overlap(kOp, outs, ins);
}

Status validate_mxfp4_to_bf16(const Mxfp4ToBf16Args& a) {
  constexpr const char* kOp = "mxfp4_to_bf16";
  FM_RETURN_IF_ERROR(validate_sizes(kOp, a.batch, a.rows, a.cols, kMxfp4GroupCols));
  if (a.batch == 0 || a.rows == 0) return Status::Ok();

  FM_RETURN_IF_ERROR(validate_inputs(kOp, a.w, a.w_scales));
  FM_REQUIRE(a.out != nullptr, kOp, "out", "is null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.out) % 16 == 0, kOp, "out", "must be 16-byte aligned");
  const int64_t elems = a.batch * a.rows * a.cols;
  const detail::Range outs[] = {{"out", a.out, elems * 2}};
  const detail::Range ins[] = {{"w", a.w, elems / 2}, {"w_scales", a.w_scales, elems / kMxfp4GroupCols}};
  return detail::check_no_overlap(kOp, outs, ins);
}

}  // namespace flashmix
