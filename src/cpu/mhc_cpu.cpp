// CPU reference backend for the mHC ops, written from spec §4 alone: every
// sum in double, each output rounded once at its store. It shares no code
// with the kernels (host bf16 conversion comes from common/host_dtype.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "common/host_dtype.h"
#include "common/host_fp8.h"
#include "flashmix/fp8.h"
#include "flashmix/mhc.h"
#include "mhc/mhc_boundary_args.h"

namespace flashmix {

namespace {

double bf16_at(const void* p, int64_t i) { return host::bf16_to_float(static_cast<const uint16_t*>(p)[i]); }
void store_bf16(void* p, int64_t i, double v) { static_cast<uint16_t*>(p)[i] = host::float_to_bf16(float(v)); }

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

float fp8x_value(const void* codes, const void* scales, bool ue8m0, int64_t e);

// The residual stream X as the pre reads it (spec §4.9): bf16, or e4m3 codes
// with their scales, each element's value fp32(e4m3(code) * scale).
struct XView {
  const void* x = nullptr;
  const void* scales = nullptr;  // null: bf16
  bool ue8m0 = false;
  double at(int64_t e) const { return scales == nullptr ? bf16_at(x, e) : double(fp8x_value(x, scales, ue8m0, e)); }
};

template <typename Args>
XView x_view(const Args& a) {
  if (a.residual == MhcResidual::kBf16) return {a.x, nullptr, false};
  return {a.x, a.x_scales, a.x_scale_format == ScaleFormat::kUE8M0};
}

// Projection with r for one token: h[m] = alpha_of(m) * (X[b] . phi[m]) / r + bias[m].
// `alpha_of` maps m to alpha index; returns r.
template <typename AlphaOf>
double project_row(const XView& x, const void* phi, DType phi_dtype, const float* alpha, const float* bias,
                   int64_t b, int64_t k_len, int num_coef, double eps_norm, AlphaOf alpha_of, double* h) {
  const int64_t row = b * k_len;
  double sumsq = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    const double v = x.at(row + k);
    sumsq += v * v;
  }
  const double r = std::sqrt(sumsq / double(k_len) + eps_norm);
  for (int m = 0; m < num_coef; ++m) {
    double acc = 0;
    for (int64_t k = 0; k < k_len; ++k)
      acc += x.at(row + k) * host::load_as_double(phi, phi_dtype, int64_t(m) * k_len + k);
    h[m] = double(alpha[alpha_of(m)]) * acc / r + double(bias[m]);
  }
  return r;
}

// spec §4 activations for one token; h has N entries.
void activate_row(const double* h, int n, const MhcParams& p, double* pre, double* post, double* res) {
  for (int i = 0; i < n; ++i) pre[i] = sigmoid(h[i]) + p.eps_pre;
  for (int i = 0; i < n; ++i) post[i] = double(p.post_mult) * sigmoid(h[n + i]);
  const double eps = p.eps_sinkhorn;
  std::vector<double> m(size_t(n) * n);
  for (int i = 0; i < n; ++i) {  // softmax over each row, + eps
    const double* row = h + 2 * n + i * n;
    double mx = row[0];
    for (int j = 1; j < n; ++j) mx = std::max(mx, row[j]);
    double s = 0;
    for (int j = 0; j < n; ++j) s += std::exp(row[j] - mx);
    for (int j = 0; j < n; ++j) m[i * n + j] = std::exp(row[j] - mx) / s + eps;
  }
  auto col_norm = [&] {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int i = 0; i < n; ++i) s += m[i * n + j];
      for (int i = 0; i < n; ++i) m[i * n + j] /= (s + eps);
    }
  };
  auto row_norm = [&] {
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < n; ++j) s += m[i * n + j];
      for (int j = 0; j < n; ++j) m[i * n + j] /= (s + eps);
    }
  };
  col_norm();
  for (int it = 1; it < p.sinkhorn_iters; ++it) {
    row_norm();
    col_norm();
  }
  for (int e = 0; e < n * n; ++e) res[e] = m[e];
}

// The FP8 residual stream (spec §4.9). Element e of X (flat index into
// [B, n*C], C % 128 == 0): fp32(e4m3(code) * scale), its block's scale at
// e / 128 of [B, n, C/128] (the flat index of (b, i, c / 128)).
float fp8x_value(const void* codes, const void* scales, bool ue8m0, int64_t e) {
  const float q = host::e4m3_to_float(static_cast<const uint8_t*>(codes)[e]);
  const int64_t k = e / 128;
  const float s = ue8m0 ? host::ue8m0_to_float(static_cast<const uint8_t*>(scales)[k])
                        : static_cast<const float*>(scales)[k];
  return q * s;  // one fp32 rounding (ue8m0 scales: exact, or +-inf past the fp32 range)
}

// quantize_fp8's 1 x 128 rule (spec §12.1) on 128 fp32 values (spec §4.9:
// the values of X_next before any bf16 rounding), scale index `si`; one
// addition for fp32 inputs: fp32(amax / 448) == 0 counts as amax == 0.
void quantize_block_f32(const float* v, bool ue8m0, uint8_t* q, void* scales, int64_t si) {
  float amax = 0.0f;
  bool nan = false;
  for (int k = 0; k < 128; ++k) {
    nan = nan || std::isnan(v[k]);
    amax = std::max(amax, std::fabs(v[k]));
  }
  if (nan) {
    if (ue8m0) static_cast<uint8_t*>(scales)[si] = 255;
    else static_cast<float*>(scales)[si] = std::numeric_limits<float>::quiet_NaN();
    for (int k = 0; k < 128; ++k) q[k] = 0x7f;
    return;
  }
  const float r = amax / host::kE4m3Max;  // fp32 division
  float s;
  if (ue8m0) {
    const uint8_t e = r == 0.0f ? uint8_t(127) : host::ue8m0_byte_at_least(r);
    static_cast<uint8_t*>(scales)[si] = e;
    s = host::ue8m0_to_float(e);
  } else {
    s = r == 0.0f ? 1.0f : r;
    static_cast<float*>(scales)[si] = s;
  }
  for (int k = 0; k < 128; ++k) {
    const float t = v[k] / s;  // a NaN quotient (inf / inf) is the NaN byte without a sign
    q[k] = std::isnan(t) ? uint8_t(0x7f) : host::float_to_e4m3(t);
  }
}

// mhc_post on the FP8 residual stream (spec §4.9): X_next in fp32 in the
// spec's fixed order (not §0.9's double sums), each (token, stream,
// 128-channel) block quantised from those fp32 values.
void mhc_post_fp8_cpu(const MhcPostArgs& a) {
  const int n = a.shape.n;
  const int64_t C = a.shape.hidden;
  const bool transpose = a.res_layout == MhcResLayout::kDeepSeek;
  const bool ue8m0 = a.x_scale_format == ScaleFormat::kUE8M0;
  std::vector<float> v(static_cast<size_t>(C));
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    const float* hres = a.h_res + b * n * n;
    for (int i = 0; i < n; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        float acc = a.h_post[b * n + i] * host::bf16_to_float(static_cast<const uint16_t*>(a.f_out)[b * C + c]);
        for (int j = 0; j < n; ++j) {
          const float rij = transpose ? hres[j * n + i] : hres[i * n + j];
          acc = std::fma(rij, fp8x_value(a.x, a.x_scales, ue8m0, (b * n + j) * C + c), acc);
        }
        v[size_t(c)] = acc;
      }
      const int64_t row = b * n + i;
      for (int64_t k = 0; k < C / 128; ++k)
        quantize_block_f32(v.data() + k * 128, ue8m0, static_cast<uint8_t*>(a.x_next) + row * C + k * 128,
                           a.x_next_scales, row * (C / 128) + k);
    }
  }
}

int alpha_index(int m, int n) { return m < n ? 0 : (m < 2 * n ? 1 : 2); }

// F_pre's epilogue for token b (spec §4.8), from the row v of F_pre values
// already rounded to bf16 (as they would be stored): the optional RMSNorm
// (double sums, one rounding to bf16), the bf16 row into f_pre (when given),
// and its FP8 copy by quantize_fp8_cpu (1 x 128 blocks, the definition).
template <typename Args>
Status f_pre_epilogue_row(const Args& a, int64_t b, std::vector<uint16_t>& v) {
  const int64_t C = a.shape.hidden;
  if (a.norm_weight != nullptr) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double f = host::bf16_to_float(v[c]);
      ss += f * f;
    }
    const double inv = 1.0 / std::sqrt(ss / double(C) + double(a.norm_eps));
    for (int64_t c = 0; c < C; ++c)
      v[c] = host::float_to_bf16(
          float(double(host::bf16_to_float(v[c])) * inv * host::load_as_double(a.norm_weight, a.norm_weight_dtype, c)));
  }
  if (a.f_pre != nullptr)
    for (int64_t c = 0; c < C; ++c) static_cast<uint16_t*>(a.f_pre)[b * C + c] = v[c];
  if (a.f_pre_fp8 != nullptr) {
    QuantizeFp8Args q;
    q.x = v.data();
    q.q = static_cast<uint8_t*>(a.f_pre_fp8) + b * C;
    q.scales = static_cast<uint8_t*>(a.f_pre_scales) +
               b * (C / 128) * (a.f_pre_scale_format == ScaleFormat::kUE8M0 ? 1 : 4);
    q.rows = 1;
    q.cols = C;
    q.block = Fp8Block::k1x128;
    q.scale_format = a.f_pre_scale_format;
    FM_RETURN_IF_ERROR(quantize_fp8_cpu(q));
  }
  return Status::Ok();
}

}  // namespace

Status mhc_project_cpu(const MhcProjectArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_project(a));
  const int n = a.shape.n, num_coef = mhc_num_coefficients(n);
  const int64_t k_len = n * a.shape.hidden;
  std::vector<double> h(num_coef);
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    const double r = project_row(XView{a.x}, a.phi, a.phi_dtype, a.alpha, a.bias, b, k_len, num_coef, a.eps_norm,
                                 [n](int m) { return alpha_index(m, n); }, h.data());
    for (int m = 0; m < num_coef; ++m) a.h[b * num_coef + m] = float(h[m]);
    a.r[b] = float(r);
  }
  return Status::Ok();
}

Status mhc_activate_cpu(const MhcActivateArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_activate(a));
  const int n = a.shape.n, num_coef = mhc_num_coefficients(n);
  std::vector<double> h(num_coef), pre(n), post(n), res(n * n);
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    for (int m = 0; m < num_coef; ++m) h[m] = a.h[b * num_coef + m];
    activate_row(h.data(), n, a.params, pre.data(), post.data(), res.data());
    for (int i = 0; i < n; ++i) a.h_pre[b * n + i] = float(pre[i]);
    for (int i = 0; i < n; ++i) a.h_post[b * n + i] = float(post[i]);
    for (int e = 0; e < n * n; ++e) a.h_res[b * n * n + e] = float(res[e]);
  }
  return Status::Ok();
}

Status mhc_pre_mix_cpu(const MhcPreMixArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_pre_mix(a));
  const int n = a.shape.n;
  const int64_t C = a.shape.hidden;
  for (int64_t b = 0; b < a.shape.batch; ++b)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += double(a.h_pre[b * n + i]) * bf16_at(a.x, (b * n + i) * C + c);
      store_bf16(a.f_pre, b * C + c, acc);
    }
  return Status::Ok();
}

Status mhc_pre_cpu(const MhcPreArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_pre(a));
  const int n = a.shape.n, num_coef = mhc_num_coefficients(n);
  const int64_t C = a.shape.hidden, k_len = n * C;
  std::vector<double> h(num_coef), pre(n), post(n), res(n * n);
  std::vector<uint16_t> f(static_cast<size_t>(C));
  const XView x = x_view(a);
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    project_row(x, a.phi, a.phi_dtype, a.alpha, a.bias, b, k_len, num_coef, a.params.eps_norm,
                [n](int m) { return alpha_index(m, n); }, h.data());
    activate_row(h.data(), n, a.params, pre.data(), post.data(), res.data());
    for (int64_t c = 0; c < C; ++c) {  // H_pre stays in double: one rounding, at the store
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += pre[i] * x.at(b * k_len + i * C + c);
      store_bf16(f.data(), c, acc);
    }
    FM_RETURN_IF_ERROR(f_pre_epilogue_row(a, b, f));
    for (int i = 0; i < n; ++i) a.h_post[b * n + i] = float(post[i]);
    for (int e = 0; e < n * n; ++e) a.h_res[b * n * n + e] = float(res[e]);
  }
  return Status::Ok();
}

Status mhc_post_cpu(const MhcPostArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_post(a));
  if (a.residual == MhcResidual::kFp8E4m3) {
    mhc_post_fp8_cpu(a);
    return Status::Ok();
  }
  const int n = a.shape.n;
  const int64_t C = a.shape.hidden;
  const bool transpose = a.res_layout == MhcResLayout::kDeepSeek;
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    const float* hres = a.h_res + b * n * n;
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        double acc = double(a.h_post[b * n + i]) * bf16_at(a.f_out, b * C + c);
        for (int j = 0; j < n; ++j) {
          const double rij = transpose ? hres[j * n + i] : hres[i * n + j];
          acc += rij * bf16_at(a.x, (b * n + j) * C + c);
        }
        store_bf16(a.x_next, (b * n + i) * C + c, acc);
      }
  }
  return Status::Ok();
}

Status mhc_head_cpu(const MhcHeadArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_head(a));
  const int n = a.shape.n;
  const int64_t C = a.shape.hidden, k_len = n * C;
  std::vector<double> h(n);
  const XView x = x_view(a);
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    project_row(x, a.phi, a.phi_dtype, a.alpha, a.bias, b, k_len, n, a.eps_norm, [](int) { return 0; }, h.data());
    for (int i = 0; i < n; ++i) h[i] = sigmoid(h[i]) + a.eps_pre;
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += h[i] * x.at(b * k_len + i * C + c);
      store_bf16(a.out, b * C + c, acc);
    }
  }
  return Status::Ok();
}

Status mhc_expand_cpu(const MhcExpandArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_expand(a));
  const int n = a.shape.n;
  const int64_t C = a.shape.hidden;
  if (a.residual == MhcResidual::kFp8E4m3) {  // spec §4.9: each block quantised once, written to every stream
    const bool ue8m0 = a.x_scale_format == ScaleFormat::kUE8M0;
    const int64_t blocks = C / 128;
    std::vector<float> v(static_cast<size_t>(C));
    for (int64_t b = 0; b < a.shape.batch; ++b) {
      for (int64_t c = 0; c < C; ++c)
        v[size_t(c)] = host::bf16_to_float(static_cast<const uint16_t*>(a.embedding)[b * C + c]);
      for (int i = 0; i < n; ++i)
        for (int64_t k = 0; k < blocks; ++k)
          quantize_block_f32(v.data() + k * 128, ue8m0, static_cast<uint8_t*>(a.x) + (b * n + i) * C + k * 128,
                             a.x_scales, (b * n + i) * blocks + k);
    }
    return Status::Ok();
  }
  for (int64_t b = 0; b < a.shape.batch; ++b)
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c)
        static_cast<uint16_t*>(a.x)[(b * n + i) * C + c] = static_cast<const uint16_t*>(a.embedding)[b * C + c];
  return Status::Ok();
}

// The boundary (spec §4.7): the post, each X_next element rounded to bf16 at
// its store, then the next pre computed from those stored values, then F_pre's
// epilogue (§4.8) on the bf16 F_pre.
Status mhc_post_pre_cpu(const MhcPostPreArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_post_pre(a));
  if (a.residual == MhcResidual::kFp8E4m3) {  // spec §4.9: mhc_post_cpu, then mhc_pre_cpu on the stored X_next
    FM_RETURN_IF_ERROR(mhc_post_cpu(boundary_post_args(a, a.x_next, a.x_next_scales)));
    return mhc_pre_cpu(boundary_pre_args(a, MhcPreKernel::kAuto));
  }
  const int n = a.shape.n, num_coef = mhc_num_coefficients(n);
  const int64_t C = a.shape.hidden, k_len = n * C;
  const bool transpose = a.res_layout == MhcResLayout::kDeepSeek;
  std::vector<double> h(num_coef), pre(n), post(n), res(n * n);
  std::vector<uint16_t> f(static_cast<size_t>(C));
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    const float* hres = a.h_res + b * n * n;
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        double acc = double(a.h_post[b * n + i]) * bf16_at(a.f_out, b * C + c);
        for (int j = 0; j < n; ++j) {
          const double rij = transpose ? hres[j * n + i] : hres[i * n + j];
          acc += rij * bf16_at(a.x, (b * n + j) * C + c);
        }
        store_bf16(a.x_next, (b * n + i) * C + c, acc);
      }
    project_row(XView{a.x_next}, a.phi, a.phi_dtype, a.alpha, a.bias, b, k_len, num_coef, a.params.eps_norm,
                [n](int m) { return alpha_index(m, n); }, h.data());
    activate_row(h.data(), n, a.params, pre.data(), post.data(), res.data());
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += pre[i] * bf16_at(a.x_next, b * k_len + i * C + c);
      store_bf16(f.data(), c, acc);
    }
    FM_RETURN_IF_ERROR(f_pre_epilogue_row(a, b, f));
    for (int i = 0; i < n; ++i) a.h_post_next[b * n + i] = float(post[i]);
    for (int e = 0; e < n * n; ++e) a.h_res_next[b * n * n + e] = float(res[e]);
  }
  return Status::Ok();
}

// The last boundary (spec §4.10): mhc_post_cpu into x_next (or a host
// buffer when the caller leaves x_next null), then mhc_head_cpu on those
// stored values, bf16 or FP8 stream alike.
Status mhc_post_head_cpu(const MhcPostHeadArgs& a) {
  FM_RETURN_IF_ERROR(validate_mhc_post_head(a));
  if (a.shape.batch == 0) return Status::Ok();
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  const MhcShape& s = a.shape;
  std::vector<uint8_t> codes, scales;  // X_next when the caller does not keep it
  void* x_next = a.x_next;
  void* x_next_scales = a.x_next_scales;
  if (x_next == nullptr) {
    codes.resize(size_t(s.batch * s.n * s.hidden * (fp8 ? 1 : 2)));
    x_next = codes.data();
    if (fp8) {
      scales.resize(size_t(mhc_x_scale_count(s) * (a.x_scale_format == ScaleFormat::kUE8M0 ? 1 : 4)));
      x_next_scales = scales.data();
    }
  }
  FM_RETURN_IF_ERROR(mhc_post_cpu(boundary_post_args(a, x_next, x_next_scales)));
  MhcHeadArgs head = boundary_head_args(a, x_next, x_next_scales, MhcPreKernel::kAuto);
  head.workspace = nullptr;  // (the CPU reference takes none)
  head.workspace_bytes = 0;
  return mhc_head_cpu(head);
}

}  // namespace flashmix
