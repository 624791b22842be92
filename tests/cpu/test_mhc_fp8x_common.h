// Test data for the FP8 residual stream (spec §4.9), CPU and GPU tests: an
// FP8 X made from a Problem's bf16 X by quantize_fp8_cpu (X seen as [B, n*C]
// with 1 x 128 blocks is exactly the stream's layout), its element values,
// and the tolerance of X_next against exact arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/host_fp8.h"
#include "cpu/test_mhc_common.h"
#include "flashmix/fp8.h"
#include "flashmix/mhc.h"

namespace flashmix::mhc_test {

// An FP8 residual stream on the host: codes [B, n*C], scales [B, n, C/128]
// as bytes (float or uint8 by `format`).
struct Fp8X {
  ScaleFormat format = ScaleFormat::kFloat32;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  int64_t scale_bytes() const { return format == ScaleFormat::kUE8M0 ? 1 : 4; }

  // The value of element e (flat index into [B, n*C]): fp32(e4m3(code) * scale).
  float value(int64_t e) const {
    const float q = host::e4m3_to_float(codes[size_t(e)]);
    return q * scale(e / 128);
  }
  float scale(int64_t k) const {
    if (format == ScaleFormat::kUE8M0) return host::ue8m0_to_float(scales[size_t(k)]);
    float s;
    std::memcpy(&s, scales.data() + k * 4, 4);
    return s;
  }
};

// Poisoned output buffers of the FP8 X_next.
inline Fp8X poisoned_fp8x(const MhcShape& s, ScaleFormat f, uint8_t poison = 0xa5) {
  Fp8X o;
  o.format = f;
  o.codes.assign(size_t(s.batch * s.n * s.hidden), poison);
  o.scales.assign(size_t(mhc_x_scale_count(s) * o.scale_bytes()), poison);
  return o;
}

// quantize_fp8_cpu of the bf16 X of `p` viewed as [B, n*C] with 1 x 128 blocks.
inline Fp8X quantize_x(const Problem& p, ScaleFormat f) {
  Fp8X o = poisoned_fp8x({p.B, p.n, p.C}, f);
  if (p.B == 0) return o;
  QuantizeFp8Args q;
  q.x = p.x.data(); q.q = o.codes.data(); q.scales = o.scales.data();
  q.rows = p.B; q.cols = p.K(); q.scale_format = f;
  EXPECT_TRUE(quantize_fp8_cpu(q).ok());
  return o;
}

// mhc_post args on the FP8 stream with host pointers.
inline MhcPostArgs fp8_post_args(const Problem& p, const Fp8X& x, Fp8X& out,
                                 MhcResLayout layout = MhcResLayout::kDeepSeek) {
  MhcPostArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = x.codes.data(); a.x_scales = x.scales.data();
  a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
  a.x_next = out.codes.data(); a.x_next_scales = out.scales.data();
  a.res_layout = layout;
  a.residual = MhcResidual::kFp8E4m3;
  a.x_scale_format = x.format;
  return a;
}

// X_next (dequantised) against the exact sum of the dequantised inputs
// (spec §4.9): |q s - ref| <= 2^-4 |ref| + 2^-10 s + 2^-20 sum|terms| (half an
// e4m3 step, the subnormal step 2^-9 s, the fp32 chain's n + 1 roundings).
// Returns the number of elements out of tolerance (the first few reported).
inline int64_t count_fp8x_far_from_exact(const Problem& p, const Fp8X& x, const Fp8X& got, MhcResLayout layout) {
  const int n = p.n;
  const int64_t C = p.C;
  const bool tr = layout == MhcResLayout::kDeepSeek;
  int64_t bad = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        const double pf = double(p.h_post[b * n + i]) * f32(p.f_out[b * C + c]);
        double ref = pf, terms = std::fabs(pf);
        for (int j = 0; j < n; ++j) {
          const double r = tr ? p.h_res[b * n * n + j * n + i] : p.h_res[b * n * n + i * n + j];
          const double t = r * double(x.value((b * n + j) * C + c));
          ref += t;
          terms += std::fabs(t);
        }
        const int64_t e = (b * n + i) * C + c;
        const double s = got.scale(e / 128), v = got.value(e);
        if (!(std::fabs(v - ref) <= std::ldexp(std::fabs(ref), -4) + std::ldexp(s, -10) + std::ldexp(terms, -20))) {
          if (bad++ < 10)
            ADD_FAILURE() << "X_next[" << b << "," << i << "," << c << "] = " << v << " (code "
                          << int(got.codes[size_t(e)]) << ", scale " << s << "), exact " << ref;
        }
      }
  return bad;
}

}  // namespace flashmix::mhc_test
