// Internal pieces of quantize_fp8 shared by its validation, its GPU launcher
// and its CPU reference.
#pragma once

#include <cstdint>

#include "flashmix/fp8.h"

namespace flashmix {

constexpr int64_t kFp8BlockCols = 128;  // columns of every block (spec §11.2)

// The strides with the "0 means dense" defaults applied, and the scale
// tensor's shape [batch, row_blocks, col_blocks].
struct QuantizeFp8Layout {
  int64_t x_stride, x_batch_stride, q_stride, q_batch_stride;
  int64_t block_rows;  // 1 or 128
  int64_t row_blocks;  // ceil(rows / block_rows)
  int64_t col_blocks;  // cols / 128
};
QuantizeFp8Layout quantize_fp8_layout(const QuantizeFp8Args& a);

// Bytes of one scale.
inline int64_t scale_bytes(ScaleFormat f) { return f == ScaleFormat::kUE8M0 ? 1 : 4; }

}  // namespace flashmix
