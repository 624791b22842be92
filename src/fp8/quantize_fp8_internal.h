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

// quantize_fp8 of the first min(*device_rows, rows) rows only, the count read
// on the device (after the kernel ahead on the stream, PDL-safe): for buffers
// whose live row count only the device knows (moe_forward's FP8 mode: the
// first P of k*T capacity rows, P = expert_first_token_offset[E_local]).
// Rows past the count are neither read nor written, nor are their scales.
// 1 x 128 blocks and batch == 1 only (kInvalidArgument otherwise). Same
// validation as quantize_fp8 for the full `rows`.
Status quantize_fp8_device_rows(const QuantizeFp8Args& args, const int64_t* device_rows, cudaStream_t stream);

// Bytes of one scale.
inline int64_t scale_bytes(ScaleFormat f) { return f == ScaleFormat::kUE8M0 ? 1 : 4; }

}  // namespace flashmix
