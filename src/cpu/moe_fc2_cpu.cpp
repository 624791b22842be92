// CPU reference for moe_fc2_finalize, written from spec §3 alone:
//   out[t, :] = sum over local slots (t, j): w[t, j] * (A[p] @ W2[e]^T + bias[e])
// accumulated in double and rounded once to bf16. FP8 (§3.5): A and W2 are
// e4m3 codes; each element is dequantised (its e4m3 value times its scale,
// §11; host_fp8.h's decoder, shared with no kernel) and the dot product of
// the dequantised values is taken in double. MXFP4 weights (§13.7): each W2
// element is the value the W4A8 / W4A16 GEMM multiplies (host_mxfp4.h).
#include <vector>

#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "common/host_mxfp4.h"
#include "flashmix/moe.h"

namespace flashmix {

Status moe_fc2_finalize_cpu(const Fc2FinalizeArgs& a) {
  Status st = validate_moe_fc2_finalize(a);
  if (!st.ok()) return st;
  const int64_t T = a.num_tokens, H = a.hidden, I = a.inter, k = a.k, E = a.num_experts_per_node;
  if (T == 0) return Status::Ok();
  const int64_t out_stride = a.out_stride ? a.out_stride : H;
  const bool fp8 = a.fp8 != MoeFp8Scaling::kNone, block = a.fp8 == MoeFp8Scaling::kBlock;
  const int64_t kbs = I / 128, h_blocks = (H + 127) / 128;
  // Element i of A's row p, and of W2[e]'s row n, dequantised.
  auto a_at = [&](int64_t p, int64_t i) -> double {
    if (!fp8) return host::bf16_to_float(static_cast<const uint16_t*>(a.A)[p * I + i]);  // exact
    const double q = host::e4m3_to_float(static_cast<const uint8_t*>(a.A)[p * I + i]);
    return q * double(block ? a.a_scales[p * kbs + i / 128] : a.a_scales[0]);
  };
  const bool mx = a.weights == MoeWeightFormat::kMxfp4;
  auto w_at = [&](int64_t e, int64_t n, int64_t i) -> double {
    const int64_t at = (e * H + n) * I + i;
    if (mx) {  // spec §13.7: W4A8's folded value, or W4A16's bf16 of the dequantised one
      const uint8_t* packed = static_cast<const uint8_t*>(a.W2) + (e * H + n) * (I / 2);
      const uint8_t* sc = static_cast<const uint8_t*>(a.w2_mx_scales) + (e * H + n) * (I / 32);
      return fp8 ? host::mxfp4_w4a8_value(packed, sc, i) : host::mxfp4_w4a16_value(packed, sc, i);
    }
    if (!fp8) return host::bf16_to_float(static_cast<const uint16_t*>(a.W2)[at]);
    const double q = host::e4m3_to_float(static_cast<const uint8_t*>(a.W2)[at]);
    return q * double(block ? a.w2_scales[(e * h_blocks + n / 128) * kbs + i / 128] : a.w2_scales[e]);
  };
  const auto* bias = (a.bias && a.apply_bias) ? static_cast<const uint16_t*>(a.bias) : nullptr;
  auto* out = static_cast<uint16_t*>(a.out);
  std::vector<double> acc(static_cast<size_t>(T * H), 0.0);
  std::vector<double> arow(static_cast<size_t>(I)), wmat;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t p0 = a.expert_first_token_offset[e], p1 = a.expert_first_token_offset[e + 1];
    if (p1 > p0) {  // W2[e] dequantised once per expert
      wmat.resize(static_cast<size_t>(H * I));
      for (int64_t n = 0; n < H; ++n)
        for (int64_t i = 0; i < I; ++i) wmat[n * I + i] = w_at(e, n, i);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = a.permuted_row_to_unpermuted_row[p];
      const int64_t t = s % T, j = s / T;
      const double w = a.scales ? double(a.scales[t * k + j]) : 1.0;
      for (int64_t i = 0; i < I; ++i) arow[i] = a_at(p, i);
      for (int64_t n = 0; n < H; ++n) {
        const double* wrow = wmat.data() + n * I;
        double dot = 0.0;
        for (int64_t i = 0; i < I; ++i) dot += arow[i] * wrow[i];
        if (bias) dot += host::bf16_to_float(bias[e * H + n]);
        acc[t * H + n] += w * dot;
      }
    }
  }
  const bool add_to_out = a.mode == Fc2Mode::kAtomic && a.out_already_zeroed;
  const auto* shared = static_cast<const uint16_t*>(a.shared_output);
  const int64_t shared_stride = a.shared_stride ? a.shared_stride : H;
  std::vector<char> local(static_cast<size_t>(T), 0);  // tokens with a local row
  for (int64_t p = 0; p < a.expert_first_token_offset[E]; ++p) local[a.permuted_row_to_unpermuted_row[p] % T] = 1;
  for (int64_t t = 0; t < T; ++t) {
    if (!a.fill && !local[t]) continue;  // no-fill: left untouched
    for (int64_t n = 0; n < H; ++n) {
      double v = acc[t * H + n];
      if (add_to_out) v += host::bf16_to_float(out[t * out_stride + n]);
      if (shared) v += host::bf16_to_float(shared[t * shared_stride + n]);
      out[t * out_stride + n] = host::float_to_bf16(float(v));
    }
  }
  return Status::Ok();
}

}  // namespace flashmix
