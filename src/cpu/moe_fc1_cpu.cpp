// CPU reference for moe_fc1, written from spec §9 (and moe_fc1.h) alone:
// for each local expert e and permuted row p of e, with t = p2u[p] mod T,
//   g = X[row] . W1[e, gate row i] (+ bias), u = X[row] . W1[e, up row i] (+ bias)
//   out[p, i] = bf16(act(g, u))
// row = p with x_permuted, else t. Dot products and the activation in
// double, rounded once at the store. FP8 (§9.7): X and W1 are e4m3 codes;
// each element is dequantised (its e4m3 value times its scale, §11) and the
// dot product of the dequantised values is taken in double (e4m3 decoded by
// host_fp8.h, which shares no code with the kernels). MXFP4 weights (§13.7):
// each W1 element is the value the W4A8 / W4A16 GEMM multiplies
// (host_mxfp4.h), X as its own dtype says. The FP8 output (§9.8): those bf16
// rows through quantize_fp8_cpu.
#include <cmath>
#include <vector>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "flashmix/moe.h"

namespace flashmix {

namespace {

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// min(x, L), keeping NaN (a comparison with NaN is false).
double clamp_max(double x, double L) { return x > L ? L : x; }
// clamp(x, -L, L), keeping NaN.
double clamp_both(double x, double L) { return x < -L ? -L : (x > L ? L : x); }

// act(g, u) in double, the defaults resolved here from the Args' fields
// (spec §9.3). alpha's default is the float 1.702f, so that passing it
// explicitly gives the same result as leaving it 0.
double activate(const MoeFc1Args& a, double g, double u) {
  switch (a.activation) {
    case MoeActivation::kSwiGLU:
      return silu(g) * u;
    case MoeActivation::kSwiGLUOai: {
      const double L = a.limit > 0.f ? double(a.limit) : 7.0;
      const double alpha = a.alpha > 0.f ? double(a.alpha) : double(1.702f);
      const double gc = clamp_max(g, L), uc = clamp_both(u, L);
      return gc / (1.0 + std::exp(-alpha * gc)) * (uc + 1.0);
    }
    case MoeActivation::kSwiGLUClamped: {
      const double L = a.limit > 0.f ? double(a.limit) : 10.0;
      return silu(clamp_max(g, L)) * clamp_both(u, L);
    }
  }
  return std::nan("");  // unreachable: validated
}

}  // namespace

Status moe_fc1_cpu(const MoeFc1Args& a) {
  Status st = validate_moe_fc1(a);
  if (!st.ok()) return st;
  const int64_t T = a.num_tokens, H = a.hidden, I = a.inter, E = a.num_experts_per_node;
  if (T == 0) return Status::Ok();
  const int64_t x_stride = a.x_stride ? a.x_stride : H;
  const auto* bias = static_cast<const uint16_t*>(a.bias);
  // FP8 output (spec §9.8): the bf16 rows in a scratch buffer, then
  // quantize_fp8_cpu of the first P rows into out / out_scales.
  const bool q_out = a.out_scales != nullptr;
  std::vector<uint16_t> bf16_rows(q_out ? size_t(T * a.k * I) : 0);
  auto* out = q_out ? bf16_rows.data() : static_cast<uint16_t*>(a.out);
  const bool interleaved = a.layout == Fc1WeightLayout::kInterleaved;
  const bool fp8 = a.fp8 != MoeFp8Scaling::kNone, block = a.fp8 == MoeFp8Scaling::kBlock;
  const int64_t kbs = H / 128, w_row_blocks = (2 * I + 127) / 128;
  // Element h of X's row `row`, and of W1[e]'s row r, dequantised.
  auto x_at = [&](int64_t row, int64_t h) -> double {
    if (!fp8) return host::bf16_to_float(static_cast<const uint16_t*>(a.X)[row * x_stride + h]);  // exact
    const double q = host::e4m3_to_float(static_cast<const uint8_t*>(a.X)[row * x_stride + h]);
    return q * double(block ? a.x_scales[row * kbs + h / 128] : a.x_scales[0]);
  };
  const bool mx = a.weights == MoeWeightFormat::kMxfp4;
  auto w_at = [&](int64_t e, int64_t r, int64_t h) -> double {
    const int64_t at = (e * 2 * I + r) * H + h;
    if (mx) {  // spec §13.7: W4A8's folded value, or W4A16's bf16 of the dequantised one
      const uint8_t* packed = static_cast<const uint8_t*>(a.W1) + (e * 2 * I + r) * (H / 2);
      const uint8_t* sc = static_cast<const uint8_t*>(a.w1_mx_scales) + (e * 2 * I + r) * (H / 32);
      return fp8 ? host::mxfp4_w4a8_value(packed, sc, h) : host::mxfp4_w4a16_value(packed, sc, h);
    }
    if (!fp8) return host::bf16_to_float(static_cast<const uint16_t*>(a.W1)[at]);
    const double q = host::e4m3_to_float(static_cast<const uint8_t*>(a.W1)[at]);
    return q * double(block ? a.w1_scales[(e * w_row_blocks + r / 128) * kbs + h / 128] : a.w1_scales[e]);
  };
  std::vector<double> xrow(static_cast<size_t>(H)), wg(static_cast<size_t>(H)), wu(static_cast<size_t>(H));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I; ++i) {
      const int64_t gi = interleaved ? 2 * i : i, ui = interleaved ? 2 * i + 1 : I + i;
      for (int64_t h = 0; h < H; ++h) {
        wg[h] = w_at(e, gi, h);
        wu[h] = w_at(e, ui, h);
      }
      for (int64_t p = a.expert_first_token_offset[e]; p < a.expert_first_token_offset[e + 1]; ++p) {
        const int64_t s = a.permuted_row_to_unpermuted_row[p];
        const int64_t t = s % T;
        const int64_t row = a.x_permuted ? p : t;
        double g = 0.0, u = 0.0;
        for (int64_t h = 0; h < H; ++h) {
          const double x = x_at(row, h);
          g += x * wg[h];
          u += x * wu[h];
        }
        if (bias) {
          g += host::bf16_to_float(bias[e * 2 * I + gi]);
          u += host::bf16_to_float(bias[e * 2 * I + ui]);
        }
        // double -> float -> bf16: two roundings where the spec says one; they
        // differ only when the double lies within float precision of a bf16
        // rounding boundary (spec §7, as in the FC2 reference).
        out[p * I + i] = host::float_to_bf16(float(activate(a, g, u)));
      }
    }
  }
  if (q_out) {
    QuantizeFp8Args q;
    q.x = bf16_rows.data();
    q.q = a.out;
    q.scales = a.out_scales;
    q.rows = a.expert_first_token_offset[E];
    q.cols = I;
    q.block = Fp8Block::k1x128;
    q.scale_format = a.out_scale_format;
    return quantize_fp8_cpu(q);
  }
  return Status::Ok();
}

}  // namespace flashmix
