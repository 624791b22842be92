// flashmix: FP8 (e4m3) quantisation (docs/spec.md §11 the formats, §12 the op).
//
// quantize_fp8: bf16 [batch x rows x cols] -> e4m3 of the same shape plus one
// scale per block, block 1 x 128 (activations: per row per 128 channels) or
// 128 x 128 (weights [E, N, K]: per 128 x 128 tile of each expert; N need
// not be a multiple of 128, blocks never cross experts). For each block:
//   amax = max |x|;  s = amax / 448 (kFloat32) or the next power of two >= it (kUE8M0);
//   s = 1 if amax == 0;  q = e4m3_satfinite(x / s)   (fp32 division, round to nearest even)
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/status.h"

namespace flashmix {

// How a block scale is stored (spec §11.2).
enum class ScaleFormat : int {
  kFloat32 = 0,  // float: s itself
  kUE8M0 = 1,    // uint8 b (torch.float8_e8m0fnu): s = 2^(b - 127); 255 is NaN
};

// The block a scale covers (spec §11.2).
enum class Fp8Block : int {
  k1x128 = 0,    // one row x 128 columns: activations (a token's scales are contiguous)
  k128x128 = 1,  // 128 rows x 128 columns: weights (the last row block of each matrix may be partial)
};

const char* to_string(ScaleFormat format);  // "float32", "ue8m0"
const char* to_string(Fp8Block block);      // "1x128", "128x128"
// The value whose to_string is `name`; false (and *out untouched) for any other text.
bool parse_scale_format(const char* name, ScaleFormat* out);
bool parse_fp8_block(const char* name, Fp8Block* out);

// Rows of one block (1 or 128).
inline constexpr int64_t fp8_block_rows(Fp8Block block) { return block == Fp8Block::k128x128 ? 128 : 1; }

struct QuantizeFp8Args {
  // Input: bf16, `batch` matrices of [rows, cols]; element (b, r, c) at
  // x[b * x_batch_stride + r * x_stride + c].
  const void* x = nullptr;
  int64_t x_stride = 0;        // elements between rows; 0 means cols
  int64_t x_batch_stride = 0;  // elements between matrices; 0 means rows * (resolved) x_stride

  // Output: e4m3 (__nv_fp8_e4m3 / torch.float8_e4m3fn bytes), same shape;
  // element (b, r, c) at q[b * q_batch_stride + r * q_stride + c]. Only those
  // bytes are written (row padding is left untouched).
  void* q = nullptr;
  int64_t q_stride = 0;        // bytes (elements) between rows; 0 means cols
  int64_t q_batch_stride = 0;  // 0 means rows * (resolved) q_stride

  // Scales, dense row-major [batch, ceil(rows / block rows), cols / 128] of
  // float (kFloat32) or uint8 (kUE8M0).
  void* scales = nullptr;

  int64_t batch = 1;  // matrices (experts); 0 is valid (nothing launched)
  int64_t rows = 0;   // per matrix; 0 is valid (nothing launched)
  int64_t cols = 0;   // a positive multiple of 128
  Fp8Block block = Fp8Block::k1x128;
  ScaleFormat scale_format = ScaleFormat::kFloat32;

  bool enable_pdl = true;  // programmatic dependent launch with the neighbours on the stream
};

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, no workspace, safe to capture in a CUDA graph. Device pointers.
// Bitwise equal to quantize_fp8_cpu.
Status quantize_fp8(const QuantizeFp8Args& args, cudaStream_t stream);

// CPU reference (the same fp32 math, written from the spec). Host pointers;
// same validation.
Status quantize_fp8_cpu(const QuantizeFp8Args& args);

// Host-side validation shared by both backends (no device access).
Status validate_quantize_fp8(const QuantizeFp8Args& args);

}  // namespace flashmix
