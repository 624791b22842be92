// CPU references for mxfp4_to_fp8_block and mxfp4_to_bf16, written from
// spec §13 alone:
//   W[n, k]  = e2m1(code) * 2^(S - 127)                 (NaN where S = 255)
//   fp8 block (128 x 128, or 1 x 128): e_max = the largest finite scale exponent
//     of the block's rows' sub-blocks; block scale 2^(e_max - 6) (1 if none is finite);
//     q = e4m3(e2m1(code) * 2^(e - e_max + 6)), 0x7f for a NaN sub-block
//   bf16: bf16(W[n, k]) (0x7fc0 for a NaN sub-block)
// Every product is exact in fp32 (or overflows to inf in the bf16 case, or
// lies far below e4m3's range in the fp8 case, where it becomes +-0 either
// way); the one rounding is the conversion to e4m3 / bf16.
#include <algorithm>
#include <cmath>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "flashmix/mxfp4.h"
#include "mxfp4/mxfp4_internal.h"

namespace flashmix {

Status mxfp4_to_fp8_block_cpu(const Mxfp4ToFp8BlockArgs& a) {
  Status st = validate_mxfp4_to_fp8_block(a);
  if (!st.ok()) return st;
  if (a.batch == 0 || a.rows == 0) return Status::Ok();
  const int64_t K = a.cols, block_rows = fp8_block_rows(a.block), col_blocks = K / 128;
  const int64_t row_blocks = (a.rows + block_rows - 1) / block_rows;
  const int64_t groups = K / kMxfp4GroupCols;
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  const uint8_t* ws = static_cast<const uint8_t*>(a.w_scales);
  uint8_t* q = static_cast<uint8_t*>(a.q);
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t rb = 0; rb < row_blocks; ++rb)
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t r0 = rb * block_rows, r1 = std::min(a.rows, r0 + block_rows);
        const int64_t g0 = cb * (128 / kMxfp4GroupCols), g1 = g0 + 128 / kMxfp4GroupCols;
        auto scale_byte = [&](int64_t r, int64_t g) { return ws[(b * a.rows + r) * groups + g]; };
        int e_max = 0;
        bool any_finite = false;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = g0; g < g1; ++g) {
            const uint8_t s = scale_byte(r, g);
            if (s == kUe8m0NaN) continue;
            e_max = any_finite ? std::max(e_max, int(s) - 127) : int(s) - 127;
            any_finite = true;
          }
        const int block_exp = any_finite ? e_max - kMxfp4Fp8TopShift : 0;
        a.q_scales[(b * row_blocks + rb) * col_blocks + cb] = std::ldexp(1.0f, block_exp);
        for (int64_t r = r0; r < r1; ++r) {
          const uint8_t* row = w + (b * a.rows + r) * (K / 2);
          for (int64_t k = cb * 128; k < cb * 128 + 128; ++k) {
            const uint8_t s = scale_byte(r, k / kMxfp4GroupCols);
            uint8_t& out = q[(b * a.rows + r) * K + k];
            if (s == kUe8m0NaN) {
              out = 0x7f;
              continue;
            }
            // d = e - E_block <= 6; far below, every e2m1 value rounds to +-0
            // in e4m3 however small: clamp so 2^d stays a normal float.
            const int d = std::max(int(s) - 127 - block_exp, kMxfp4MinShift);
            out = host::float_to_e4m3(std::ldexp(host::e2m1_to_float(host::e2m1_code_at(row, k)), d));
          }
        }
      }
  return Status::Ok();
}

Status mxfp4_to_bf16_cpu(const Mxfp4ToBf16Args& a) {
  Status st = validate_mxfp4_to_bf16(a);
  if (!st.ok()) return st;
  const int64_t K = a.cols, groups = K / kMxfp4GroupCols;
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  const uint8_t* ws = static_cast<const uint8_t*>(a.w_scales);
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int64_t r = 0; r < a.batch * a.rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t s = ws[r * groups + k / kMxfp4GroupCols];
      if (s == kUe8m0NaN) {
        out[r * K + k] = 0x7fc0;
        continue;
      }
      // |e2m1| * 2^(s - 127): exact in fp32 (a subnormal at the bottom), or
      // +-inf past fp32's range, which bf16 rounds the same way.
      const float v = host::e2m1_to_float(host::e2m1_code_at(w + r * (K / 2), k));
      out[r * K + k] = host::float_to_bf16(v * host::ue8m0_to_float(s));
    }
  return Status::Ok();
}

}  // namespace flashmix
