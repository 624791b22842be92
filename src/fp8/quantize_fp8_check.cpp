// Host-side validation of quantize_fp8 (spec §12.4), shared by the GPU and
// CPU backends, and the names of the FP8 enums. Never reads device memory.
#include <cstring>

#include "common/check.h"
#include "flashmix/fp8.h"
#include "fp8/quantize_fp8_internal.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "quantize_fp8";
constexpr int64_t kMaxElems = int64_t(1) << 60;

bool known(ScaleFormat f) { return f == ScaleFormat::kFloat32 || f == ScaleFormat::kUE8M0; }
bool known(Fp8Block b) { return b == Fp8Block::k1x128 || b == Fp8Block::k128x128; }

// Elements spanned by `batch` matrices of `rows` x `cols`: from the first
// element to the last matrix's last row's end (0 when empty).
int64_t extent_elems(int64_t batch, int64_t batch_stride, int64_t rows, int64_t stride, int64_t cols) {
  if (batch == 0 || rows == 0) return 0;
  return (batch - 1) * batch_stride + (rows - 1) * stride + cols;
}
}  // namespace

const char* to_string(ScaleFormat format) {
  switch (format) {
    case ScaleFormat::kFloat32: return "float32";
    case ScaleFormat::kUE8M0: return "ue8m0";
  }
  return "unknown";
}

const char* to_string(Fp8Block block) {
  switch (block) {
    case Fp8Block::k1x128: return "1x128";
    case Fp8Block::k128x128: return "128x128";
  }
  return "unknown";
}

bool parse_scale_format(const char* name, ScaleFormat* out) {
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0})
    if (name && std::strcmp(name, to_string(f)) == 0) {
      *out = f;
      return true;
    }
  return false;
}

bool parse_fp8_block(const char* name, Fp8Block* out) {
  for (Fp8Block b : {Fp8Block::k1x128, Fp8Block::k128x128})
    if (name && std::strcmp(name, to_string(b)) == 0) {
      *out = b;
      return true;
    }
  return false;
}

QuantizeFp8Layout quantize_fp8_layout(const QuantizeFp8Args& a) {
  QuantizeFp8Layout l;
  l.x_stride = a.x_stride ? a.x_stride : a.cols;
  l.q_stride = a.q_stride ? a.q_stride : a.cols;
  l.x_batch_stride = a.x_batch_stride ? a.x_batch_stride : a.rows * l.x_stride;
  l.q_batch_stride = a.q_batch_stride ? a.q_batch_stride : a.rows * l.q_stride;
  l.block_rows = fp8_block_rows(a.block);
  l.row_blocks = (a.rows + l.block_rows - 1) / l.block_rows;
  l.col_blocks = a.cols / kFp8BlockCols;
  return l;
}

Status validate_quantize_fp8(const QuantizeFp8Args& a) {
  using detail::kInt32Max;
  FM_REQUIRE(a.batch >= 0, kOp, "batch", "must be >= 0 (got ", a.batch, ")");
  FM_REQUIRE(a.rows >= 0, kOp, "rows", "must be >= 0 (got ", a.rows, ")");
  FM_REQUIRE(a.cols >= kFp8BlockCols && a.cols % kFp8BlockCols == 0, kOp, "cols",
             "must be a positive multiple of 128 (got ", a.cols, ")");
  FM_REQUIRE(a.cols <= kInt32Max, kOp, "cols", "must fit in 32 bits (got ", a.cols, ")");
  FM_REQUIRE(known(a.block), kOp, "block", "unknown Fp8Block value ", int(a.block));
  FM_REQUIRE(known(a.scale_format), kOp, "scale_format", "unknown ScaleFormat value ", int(a.scale_format));
  FM_REQUIRE(a.x_stride >= 0, kOp, "x_stride", "must be >= 0 (0 means cols; got ", a.x_stride, ")");
  FM_REQUIRE(a.q_stride >= 0, kOp, "q_stride", "must be >= 0 (0 means cols; got ", a.q_stride, ")");
  FM_REQUIRE(a.x_batch_stride >= 0, kOp, "x_batch_stride", "must be >= 0 (0 means rows * x_stride; got ",
             a.x_batch_stride, ")");
  FM_REQUIRE(a.q_batch_stride >= 0, kOp, "q_batch_stride", "must be >= 0 (0 means rows * q_stride; got ",
             a.q_batch_stride, ")");
  FM_REQUIRE(a.x_stride == 0 || a.x_stride >= a.cols, kOp, "x_stride", "smaller than a row: ", a.x_stride,
             " < cols ", a.cols);
  FM_REQUIRE(a.q_stride == 0 || a.q_stride >= a.cols, kOp, "q_stride", "smaller than a row: ", a.q_stride,
             " < cols ", a.cols);
  // Block and row indices are 32-bit in the kernels; element offsets 64-bit.
  FM_REQUIRE(a.rows <= kInt32Max && (a.batch == 0 || a.rows <= kInt32Max / a.batch), kOp, "rows",
             "batch * rows must fit in int32 (batch ", a.batch, ", rows ", a.rows, ")");
  FM_REQUIRE(a.batch * a.rows == 0 || a.cols / kFp8BlockCols <= kInt32Max / (a.batch * a.rows), kOp, "rows",
             "batch * rows * cols / 128 (the 1 x 128 blocks) must fit in int32 (batch ", a.batch, ", rows ", a.rows,
             ", cols ", a.cols, ")");
  FM_REQUIRE(a.x_stride <= kMaxElems / (a.rows + 1), kOp, "x_stride", "rows * x_stride overflows");
  FM_REQUIRE(a.q_stride <= kMaxElems / (a.rows + 1), kOp, "q_stride", "rows * q_stride overflows");
  const QuantizeFp8Layout l = quantize_fp8_layout(a);
  if (a.batch > 1) {
    FM_REQUIRE(l.x_batch_stride >= a.rows * l.x_stride, kOp, "x_batch_stride", "smaller than a matrix: ",
               l.x_batch_stride, " < rows * x_stride = ", a.rows * l.x_stride);
    FM_REQUIRE(l.q_batch_stride >= a.rows * l.q_stride, kOp, "q_batch_stride", "smaller than a matrix: ",
               l.q_batch_stride, " < rows * q_stride = ", a.rows * l.q_stride);
    FM_REQUIRE(l.x_batch_stride <= kMaxElems / a.batch, kOp, "x_batch_stride", "batch * x_batch_stride overflows");
    FM_REQUIRE(l.q_batch_stride <= kMaxElems / a.batch, kOp, "q_batch_stride", "batch * q_batch_stride overflows");
  }

  if (a.batch == 0 || a.rows == 0) return Status::Ok();  // valid: nothing to read or write

  FM_REQUIRE(a.x != nullptr, kOp, "x", "is null");
  FM_REQUIRE(a.q != nullptr, kOp, "q", "is null");
  FM_REQUIRE(a.scales != nullptr, kOp, "scales", "is null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.x) % 2 == 0, kOp, "x", "must be aligned to its element (2 bytes)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.scales) % uintptr_t(scale_bytes(a.scale_format)) == 0, kOp, "scales",
             "must be aligned to its element (", scale_bytes(a.scale_format), " bytes)");
  const int64_t x_bytes = 2 * extent_elems(a.batch, l.x_batch_stride, a.rows, l.x_stride, a.cols);
  const int64_t q_bytes = extent_elems(a.batch, l.q_batch_stride, a.rows, l.q_stride, a.cols);
  const int64_t s_bytes = a.batch * l.row_blocks * l.col_blocks * scale_bytes(a.scale_format);
  const detail::Range outs[] = {{"q", a.q, q_bytes}, {"scales", a.scales, s_bytes}};
  const detail::Range ins[] = {{"x", a.x, x_bytes}};
  return detail::check_no_overlap(kOp, outs, ins);
}

}  // namespace flashmix
