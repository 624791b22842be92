// CPU reference for quantize_fp8, written from spec §11.3 / §12 alone. For
// each block (1 x 128, or 128 x 128 within one matrix; the last row block
// of a matrix may be partial):
//   amax = max |x|                 (NaN block: scale NaN, every q the NaN byte 0x7f)
//   s    = amax / 448              (kFloat32; fp32 division)
//        = 2^e, e the exponent of the smallest power of two >= fp32(amax / 448),
//          clamped to [-127, 127]  (kUE8M0; stored as e + 127)
//   s    = 1                       if amax == 0
//   q    = e4m3_satfinite(fp32(x / s)), round to nearest even (a NaN quotient,
//          inf / inf, the byte 0x7f)
// The arithmetic is fp32, as the spec states it, so the kernel can match it
// bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "flashmix/fp8.h"
#include "fp8/quantize_fp8_internal.h"

namespace flashmix {

Status quantize_fp8_cpu(const QuantizeFp8Args& a) {
  Status st = validate_quantize_fp8(a);
  if (!st.ok()) return st;
  if (a.batch == 0 || a.rows == 0) return Status::Ok();
  const QuantizeFp8Layout l = quantize_fp8_layout(a);
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  uint8_t* q = static_cast<uint8_t*>(a.q);
  const bool ue8m0 = a.scale_format == ScaleFormat::kUE8M0;
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t rb = 0; rb < l.row_blocks; ++rb)
      for (int64_t cb = 0; cb < l.col_blocks; ++cb) {
        const int64_t r0 = rb * l.block_rows, r1 = std::min(a.rows, r0 + l.block_rows);
        const int64_t c0 = cb * kFp8BlockCols, c1 = c0 + kFp8BlockCols;
        auto xv = [&](int64_t r, int64_t c) {
          return host::bf16_to_float(x[b * l.x_batch_stride + r * l.x_stride + c]);
        };
        auto qv = [&](int64_t r, int64_t c) -> uint8_t& { return q[b * l.q_batch_stride + r * l.q_stride + c]; };
        float amax = 0.0f;
        bool nan = false;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) {
            const float v = xv(r, c);
            nan = nan || std::isnan(v);
            amax = std::max(amax, std::fabs(v));
          }
        const int64_t si = (b * l.row_blocks + rb) * l.col_blocks + cb;
        if (nan) {
          if (ue8m0) static_cast<uint8_t*>(a.scales)[si] = 255;
          else static_cast<float*>(a.scales)[si] = std::numeric_limits<float>::quiet_NaN();
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c) qv(r, c) = 0x7f;
          continue;
        }
        float s;
        if (ue8m0) {
          const uint8_t e = amax == 0.0f ? uint8_t(127) : host::ue8m0_byte_at_least(amax / host::kE4m3Max);
          static_cast<uint8_t*>(a.scales)[si] = e;
          s = host::ue8m0_to_float(e);
        } else {
          s = amax == 0.0f ? 1.0f : amax / host::kE4m3Max;
          static_cast<float*>(a.scales)[si] = s;
        }
        // A NaN quotient (inf / inf) is the NaN byte without a sign.
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) {
            const float v = xv(r, c) / s;
            qv(r, c) = std::isnan(v) ? uint8_t(0x7f) : host::float_to_e4m3(v);
          }
      }
  return Status::Ok();
}

}  // namespace flashmix
