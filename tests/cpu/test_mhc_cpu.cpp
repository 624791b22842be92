// CPU tests of the mHC reference backend and of the host-side validation
// (spec §4, §5). These run on any machine.
#include <algorithm>
#include <cstring>

#include <gtest/gtest.h>

#include "cpu/test_mhc_common.h"
#include "flashmix/fp8.h"
#include "flashmix/mhc.h"

namespace flashmix {
namespace {

using namespace mhc_test;

struct PreOut {
  std::vector<uint16_t> f_pre;
  std::vector<float> h_post, h_res;
};

PreOut run_pre_cpu(const Problem& p, const MhcParams& params, DType phi_dtype = DType::kFloat32) {
  PreOut o;
  o.f_pre.assign(size_t(p.B * p.C), 0xffff);
  o.h_post.assign(size_t(p.B * p.n), NAN);
  o.h_res.assign(size_t(p.B * p.n * p.n), NAN);
  MhcPreArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = p.x.data();
  a.phi = phi_dtype == DType::kFloat32 ? static_cast<const void*>(p.phi_f32.data()) : p.phi_bf16.data();
  a.phi_dtype = phi_dtype;
  a.alpha = p.alpha.data();
  a.bias = p.bias.data();
  a.f_pre = o.f_pre.data();
  a.h_post = o.h_post.data();
  a.h_res = o.h_res.data();
  a.params = params;
  Status s = mhc_pre_cpu(a);
  EXPECT_TRUE(s.ok()) << s.message();
  return o;
}

// The seed's setting (all eps 0): H_res equals exp then 20 x (row, column)
// normalisation written independently; rows and columns sum to 1.
TEST(MhcCpu, SeedSettingSinkhornMatchesSeedAlgorithm) {
  for (int n : {1, 2, 4, 6, 8}) {
    Problem p = make_problem(3, n, 64, seed_for("seed_sinkhorn") + n);
    MhcProjectArgs pa;
    pa.shape = {p.B, n, p.C};
    pa.x = p.x.data(); pa.phi = p.phi_f32.data(); pa.alpha = p.alpha.data(); pa.bias = p.bias.data();
    std::vector<float> h(size_t(p.B * p.N())), r(p.B);
    pa.h = h.data(); pa.r = r.data(); pa.eps_norm = 0;
    ASSERT_TRUE(mhc_project_cpu(pa).ok());
    PreOut o = run_pre_cpu(p, MhcParams::seed());
    for (int64_t b = 0; b < p.B; ++b) {
      std::vector<double> logits(n * n);
      for (int e = 0; e < n * n; ++e) logits[e] = h[b * p.N() + 2 * n + e];
      std::vector<double> ref = seed_sinkhorn(logits.data(), n, 20);
      for (int e = 0; e < n * n; ++e) EXPECT_NEAR(o.h_res[b * n * n + e], ref[e], 1e-6) << "n=" << n;
      for (int i = 0; i < n; ++i) {
        double rs = 0, cs = 0;
        for (int j = 0; j < n; ++j) rs += o.h_res[b * n * n + i * n + j], cs += o.h_res[b * n * n + j * n + i];
        EXPECT_NEAR(cs, 1.0, 1e-6);
        EXPECT_NEAR(rs, 1.0, 0.1);  // converges only approximately in 20 rounds
      }
      for (int i = 0; i < n; ++i) {
        EXPECT_GT(o.h_post[b * n + i], 0.f);
        EXPECT_LT(o.h_post[b * n + i], 2.f);
      }
    }
  }
}

// h matches spec §4 written out for one token.
TEST(MhcCpu, ProjectMatchesFormula) {
  Problem p = make_problem(2, 2, 16, seed_for("project_formula"));
  MhcProjectArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = p.x.data(); a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
  std::vector<float> h(size_t(p.B * p.N())), r(p.B);
  a.h = h.data(); a.r = r.data(); a.eps_norm = 1e-3f;
  ASSERT_TRUE(mhc_project_cpu(a).ok());
  for (int64_t b = 0; b < p.B; ++b) {
    double ss = 0;
    for (int64_t k = 0; k < p.K(); ++k) ss += double(f32(p.x[b * p.K() + k])) * f32(p.x[b * p.K() + k]);
    const double rr = std::sqrt(ss / double(p.K()) + 1e-3);
    EXPECT_NEAR(r[b], rr, 1e-6 * rr);
    for (int m = 0; m < p.N(); ++m) {
      double dot = 0;
      for (int64_t k = 0; k < p.K(); ++k) dot += double(f32(p.x[b * p.K() + k])) * p.phi_f32[m * p.K() + k];
      const int ai = m < p.n ? 0 : m < 2 * p.n ? 1 : 2;
      EXPECT_NEAR(h[b * p.N() + m], p.alpha[ai] * dot / rr + p.bias[m], 1e-5);
    }
  }
}

// mhc_pre equals its three stages run one after the other.
TEST(MhcCpu, PreEqualsItsStages) {
  for (int n : {1, 4, 6}) {
    Problem p = make_problem(5, n, 40, seed_for("pre_stages") + n);
    MhcParams params;
    PreOut o = run_pre_cpu(p, params);
    std::vector<float> h(size_t(p.B * p.N())), r(p.B), pre(p.B * n), post(p.B * n), res(p.B * n * n);
    MhcProjectArgs pa;
    pa.shape = {p.B, n, p.C};
    pa.x = p.x.data(); pa.phi = p.phi_f32.data(); pa.alpha = p.alpha.data(); pa.bias = p.bias.data();
    pa.h = h.data(); pa.r = r.data(); pa.eps_norm = params.eps_norm;
    ASSERT_TRUE(mhc_project_cpu(pa).ok());
    MhcActivateArgs aa;
    aa.shape = {p.B, n, p.C};
    aa.h = h.data(); aa.h_pre = pre.data(); aa.h_post = post.data(); aa.h_res = res.data(); aa.params = params;
    ASSERT_TRUE(mhc_activate_cpu(aa).ok());
    std::vector<uint16_t> f(size_t(p.B * p.C));
    MhcPreMixArgs ma;
    ma.shape = {p.B, n, p.C};
    ma.x = p.x.data(); ma.h_pre = pre.data(); ma.f_pre = f.data();
    ASSERT_TRUE(mhc_pre_mix_cpu(ma).ok());
    for (size_t i = 0; i < post.size(); ++i) EXPECT_NEAR(post[i], o.h_post[i], 1e-5);
    for (size_t i = 0; i < res.size(); ++i) EXPECT_NEAR(res[i], o.h_res[i], 1e-5);
    for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f32(f[i]), f32(o.f_pre[i]), 0.02 * (1 + std::fabs(f32(o.f_pre[i]))));
    for (int64_t b = 0; b < p.B; ++b)
      for (int i = 0; i < n; ++i) {
        EXPECT_GT(pre[b * n + i], 0.f);
        EXPECT_LT(pre[b * n + i], 1.f + 2e-6f);
      }
  }
}

// deepseek layout == row_mix with H_res transposed.
TEST(MhcCpu, PostLayoutsAreTransposesOfEachOther) {
  const int n = 4;
  Problem p = make_problem(3, n, 24, seed_for("post_layouts"));
  std::vector<float> res_t(p.h_res.size());
  for (int64_t b = 0; b < p.B; ++b)
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) res_t[b * 16 + i * 4 + j] = p.h_res[b * 16 + j * 4 + i];
  std::vector<uint16_t> o1(p.x.size()), o2(p.x.size());
  MhcPostArgs a;
  a.shape = {p.B, n, p.C};
  a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
  a.x_next = o1.data(); a.res_layout = MhcResLayout::kDeepSeek;
  ASSERT_TRUE(mhc_post_cpu(a).ok());
  a.h_res = res_t.data(); a.x_next = o2.data(); a.res_layout = MhcResLayout::kRowMix;
  ASSERT_TRUE(mhc_post_cpu(a).ok());
  EXPECT_EQ(o1, o2);
  // One element by hand: X_next[0, 1, 5] = sum_j H_res[j, 1] X[0, j, 5] + H_post[0, 1] F_out[0, 5].
  double acc = double(p.h_post[1]) * f32(p.f_out[5]);
  for (int j = 0; j < n; ++j) acc += double(p.h_res[j * 4 + 1]) * f32(p.x[j * p.C + 5]);
  EXPECT_EQ(o1[1 * p.C + 5], bf16(float(acc)));
}

// mhc_head is mhc_pre's F_pre with the pre rows of phi and bias.
TEST(MhcCpu, HeadEqualsPreMixOfPre) {
  const int n = 4;
  Problem p = make_problem(4, n, 32, seed_for("head"));
  PreOut o = run_pre_cpu(p, MhcParams());
  std::vector<uint16_t> out(size_t(p.B * p.C));
  MhcHeadArgs a;
  a.shape = {p.B, n, p.C};
  a.x = p.x.data(); a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
  a.out = out.data();
  ASSERT_TRUE(mhc_head_cpu(a).ok());
  EXPECT_EQ(out, o.f_pre);
}

// The boundary op is, by definition, mhc_post then mhc_pre on the stored
// (bf16) X_next: the CPU references agree bitwise, every n, both layouts.
TEST(MhcCpu, PostPreEqualsPostThenPre) {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    for (MhcResLayout layout : {MhcResLayout::kDeepSeek, MhcResLayout::kRowMix}) {
      Problem p = make_problem(3, n, 24, seed_for("post_pre") + n);
      std::vector<uint16_t> xn_ref(p.x.size(), 0x7fc1);
      MhcPostArgs pa;
      pa.shape = {p.B, n, p.C};
      pa.x = p.x.data(); pa.f_out = p.f_out.data(); pa.h_post = p.h_post.data(); pa.h_res = p.h_res.data();
      pa.x_next = xn_ref.data(); pa.res_layout = layout;
      ASSERT_TRUE(mhc_post_cpu(pa).ok());
      Problem q = p;
      q.x = xn_ref;
      MhcParams params;
      params.sinkhorn_iters = 7;
      PreOut ref = run_pre_cpu(q, params);

      std::vector<uint16_t> xn(p.x.size(), 0x7fc1), f(size_t(p.B * p.C), 0x7fc1);
      std::vector<float> hp(size_t(p.B * n), NAN), hr(size_t(p.B * n * n), NAN);
      MhcPostPreArgs a;
      a.shape = {p.B, n, p.C};
      a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
      a.res_layout = layout;
      a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
      a.x_next = xn.data(); a.f_pre = f.data(); a.h_post_next = hp.data(); a.h_res_next = hr.data();
      a.params = params;
      Status s = mhc_post_pre_cpu(a);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(xn, xn_ref) << "n " << n;
      EXPECT_EQ(f, ref.f_pre) << "n " << n;
      EXPECT_EQ(0, std::memcmp(hp.data(), ref.h_post.data(), hp.size() * 4)) << "n " << n;
      EXPECT_EQ(0, std::memcmp(hr.data(), ref.h_res.data(), hr.size() * 4)) << "n " << n;
    }
  }
}

// The last boundary is, by definition, mhc_post then mhc_head on the stored
// (bf16) X_next: bitwise, every n, both layouts, X_next kept or not (the
// head's output must not depend on whether X_next is stored).
TEST(MhcCpu, PostHeadEqualsPostThenHead) {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    for (MhcResLayout layout : {MhcResLayout::kDeepSeek, MhcResLayout::kRowMix}) {
      Problem p = make_problem(3, n, 24, seed_for("post_head") + n);
      std::vector<uint16_t> xn_ref(p.x.size(), 0x7fc1), out_ref(size_t(p.B * p.C), 0x7fc1);
      MhcPostArgs pa;
      pa.shape = {p.B, n, p.C};
      pa.x = p.x.data(); pa.f_out = p.f_out.data(); pa.h_post = p.h_post.data(); pa.h_res = p.h_res.data();
      pa.x_next = xn_ref.data(); pa.res_layout = layout;
      ASSERT_TRUE(mhc_post_cpu(pa).ok());
      MhcHeadArgs ha;
      ha.shape = pa.shape;
      ha.x = xn_ref.data(); ha.phi = p.phi_bf16.data(); ha.phi_dtype = DType::kBFloat16;
      ha.alpha = p.alpha.data(); ha.bias = p.bias.data(); ha.out = out_ref.data();
      ha.eps_norm = 1e-5f; ha.eps_pre = 0.01f;
      ASSERT_TRUE(mhc_head_cpu(ha).ok());
      for (bool keep : {true, false}) {
        std::vector<uint16_t> xn(p.x.size(), 0x7fc1), out(size_t(p.B * p.C), 0x7fc1);
        MhcPostHeadArgs a;
        a.shape = pa.shape;
        a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
        a.res_layout = layout;
        a.phi = p.phi_bf16.data(); a.phi_dtype = DType::kBFloat16; a.alpha = p.alpha.data(); a.bias = p.bias.data();
        a.out = out.data(); a.x_next = keep ? xn.data() : nullptr;
        a.eps_norm = 1e-5f; a.eps_pre = 0.01f;
        Status s = mhc_post_head_cpu(a);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(out, out_ref) << "n " << n << " keep " << keep;
        if (keep) EXPECT_EQ(xn, xn_ref) << "n " << n;
        else for (auto v : xn) ASSERT_EQ(v, 0x7fc1);
      }
    }
  }
}

// One element of the boundary by hand: X_next from the post formula, F_pre
// from H_pre computed here (projection, r, sigmoid) on the rounded X_next.
TEST(MhcCpu, PostPreOneTokenByHand) {
  const int n = 2;
  Problem p = make_problem(1, n, 8, seed_for("post_pre_hand"));
  const int64_t C = p.C, K = p.K();
  std::vector<uint16_t> xn(p.x.size()), f(static_cast<size_t>(C));
  std::vector<float> hp(n), hr(n * n);
  MhcPostPreArgs a;
  a.shape = {1, n, C};
  a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
  a.res_layout = MhcResLayout::kRowMix;
  a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
  a.x_next = xn.data(); a.f_pre = f.data(); a.h_post_next = hp.data(); a.h_res_next = hr.data();
  ASSERT_TRUE(mhc_post_pre_cpu(a).ok());
  std::vector<double> x1(static_cast<size_t>(K));
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) {
      double acc = double(p.h_post[i]) * f32(p.f_out[c]);
      for (int j = 0; j < n; ++j) acc += double(p.h_res[i * n + j]) * f32(p.x[j * C + c]);
      ASSERT_EQ(xn[i * C + c], bf16(float(acc)));
      x1[i * C + c] = f32(bf16(float(acc)));
    }
  double ss = 0;
  for (double v : x1) ss += v * v;
  const double r = std::sqrt(ss / double(K) + 1e-6);
  double pre[2];
  for (int i = 0; i < n; ++i) {
    double dot = 0;
    for (int64_t k = 0; k < K; ++k) dot += x1[k] * double(p.phi_f32[i * K + k]);
    pre[i] = 1.0 / (1.0 + std::exp(-(double(p.alpha[0]) * dot / r + double(p.bias[i])))) + 1e-6;
  }
  for (int64_t c = 0; c < C; ++c) EXPECT_EQ(f[c], bf16(float(pre[0] * x1[c] + pre[1] * x1[C + c])));
}

// ---------------------------------------------------------------------------
// F_pre's epilogue (spec §4.8): the input RMSNorm and the FP8 copy.

// The buffers of one mhc_post_pre call, poisoned.
struct PostPreBufs {
  std::vector<uint16_t> xn, f;
  std::vector<float> hp, hr;
  std::vector<uint8_t> q, scales;
  PostPreBufs(const Problem& p)
      : xn(p.x.size(), 0x7fc1), f(size_t(p.B * p.C), 0x7fc1), hp(size_t(p.B * p.n), NAN),
        hr(size_t(p.B * p.n * p.n), NAN), q(size_t(p.B * p.C), 0xa5), scales(size_t(p.B * (p.C / 128) * 4), 0xa5) {}
};

MhcPostPreArgs post_pre_args(const Problem& p, PostPreBufs& o, MhcResLayout layout = MhcResLayout::kDeepSeek) {
  MhcPostPreArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
  a.res_layout = layout;
  a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
  a.x_next = o.xn.data(); a.f_pre = o.f.data(); a.h_post_next = o.hp.data(); a.h_res_next = o.hr.data();
  a.params.sinkhorn_iters = 9;
  return a;
}

// A norm weight of C values around 1 (some negative), as bf16 bits and as
// fp32 holding the same values or its own finer ones.
struct NormWeight {
  std::vector<uint16_t> bf;
  std::vector<float> f32v;
  NormWeight(int64_t C, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-0.5f, 1.5f);
    for (int64_t c = 0; c < C; ++c) {
      float w = u(rng);
      if (std::fabs(w) < 1e-2f) w = 0.25f;
      bf.push_back(bf16(w));
      f32v.push_back(w);
    }
  }
};

// The norm by its formula, from the plain call's bf16 F_pre: the same
// x_next, H_post, H_res (bitwise), and f_pre = bf16(v / sqrt(mean v^2 + eps) * w)
// computed here in double; every n, both layouts, both weight dtypes.
TEST(MhcCpu, PostPreNormIsRmsNormOfTheStoredFpre) {
  for (int n : {1, 3, 4, 8}) {
    for (MhcResLayout layout : {MhcResLayout::kDeepSeek, MhcResLayout::kRowMix}) {
      for (DType wd : {DType::kBFloat16, DType::kFloat32}) {
        Problem p = make_problem(3, n, 40, seed_for("post_pre_norm") + n);
        SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n));
        NormWeight w(p.C, p.seed + 1);
        PostPreBufs plain(p), normed(p);
        MhcPostPreArgs a = post_pre_args(p, plain, layout);
        ASSERT_TRUE(mhc_post_pre_cpu(a).ok());
        MhcPostPreArgs b = post_pre_args(p, normed, layout);
        b.norm_weight = wd == DType::kFloat32 ? static_cast<const void*>(w.f32v.data()) : w.bf.data();
        b.norm_weight_dtype = wd;
        b.norm_eps = 1e-5f;
        Status s = mhc_post_pre_cpu(b);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(normed.xn, plain.xn);
        EXPECT_EQ(0, std::memcmp(normed.hp.data(), plain.hp.data(), plain.hp.size() * 4));
        EXPECT_EQ(0, std::memcmp(normed.hr.data(), plain.hr.data(), plain.hr.size() * 4));
        for (int64_t t = 0; t < p.B; ++t) {
          double ss = 0;
          for (int64_t c = 0; c < p.C; ++c) ss += double(f32(plain.f[t * p.C + c])) * f32(plain.f[t * p.C + c]);
          const double inv = 1.0 / std::sqrt(ss / double(p.C) + double(1e-5f));
          for (int64_t c = 0; c < p.C; ++c) {
            const double wc = wd == DType::kFloat32 ? double(w.f32v[c]) : double(f32(w.bf[c]));
            ASSERT_EQ(normed.f[t * p.C + c], bf16(float(double(f32(plain.f[t * p.C + c])) * inv * wc)))
                << "token " << t << " column " << c;
          }
        }
      }
    }
  }
}

// The FP8 copy is quantize_fp8 (1 x 128) of the bf16 f_pre, bit for bit:
// with and without the norm, both scale formats, with f_pre written too or
// null (the FP8 copy only); the bf16 f_pre is the same as without FP8.
TEST(MhcCpu, PostPreFp8IsQuantizeFp8OfTheBf16Output) {
  for (int n : {1, 4, 6}) {
    for (bool norm : {false, true}) {
      for (ScaleFormat sf : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
        Problem p = make_problem(3, n, 384, seed_for("post_pre_fp8") + n);
        SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + (norm ? " norm" : ""));
        NormWeight w(p.C, p.seed + 2);
        PostPreBufs bf(p), both(p), only(p);
        MhcPostPreArgs a = post_pre_args(p, bf);
        if (norm) a.norm_weight = w.bf.data();
        ASSERT_TRUE(mhc_post_pre_cpu(a).ok());
        QuantizeFp8Args qa;
        std::vector<uint8_t> q_ref(size_t(p.B * p.C)), s_ref(size_t(p.B * (p.C / 128) * 4));
        qa.x = bf.f.data(); qa.q = q_ref.data(); qa.scales = s_ref.data();
        qa.rows = p.B; qa.cols = p.C; qa.scale_format = sf;
        ASSERT_TRUE(quantize_fp8_cpu(qa).ok());
        const size_t sbytes = size_t(p.B * (p.C / 128)) * (sf == ScaleFormat::kUE8M0 ? 1 : 4);
        for (PostPreBufs* o : {&both, &only}) {
          MhcPostPreArgs b = post_pre_args(p, *o);
          if (norm) b.norm_weight = w.bf.data();
          b.f_pre_fp8 = o->q.data(); b.f_pre_scales = o->scales.data(); b.f_pre_scale_format = sf;
          if (o == &only) b.f_pre = nullptr;
          Status s = mhc_post_pre_cpu(b);
          ASSERT_TRUE(s.ok()) << s.message();
          EXPECT_EQ(o->q, q_ref);
          EXPECT_EQ(0, std::memcmp(o->scales.data(), s_ref.data(), sbytes));
          for (size_t i = sbytes; i < o->scales.size(); ++i) ASSERT_EQ(o->scales[i], 0xa5) << "past the scales";
          EXPECT_EQ(o->xn, bf.xn);
          if (o == &both) EXPECT_EQ(o->f, bf.f);
          else for (auto v : o->f) ASSERT_EQ(v, 0x7fc1) << "f_pre is null: nothing written there";
        }
      }
    }
  }
}

// mhc_pre's epilogue is the same: mhc_pre on the X_next that mhc_post_pre
// stored, with the same norm and FP8 copy, gives the same bytes.
TEST(MhcCpu, PreEpilogueEqualsPostPreEpilogue) {
  const int n = 4;
  Problem p = make_problem(2, n, 256, seed_for("pre_epilogue"));
  NormWeight w(p.C, p.seed + 3);
  PostPreBufs o(p);
  MhcPostPreArgs a = post_pre_args(p, o);
  a.norm_weight = w.f32v.data(); a.norm_weight_dtype = DType::kFloat32; a.norm_eps = 1e-6f;
  a.f_pre_fp8 = o.q.data(); a.f_pre_scales = o.scales.data(); a.f_pre_scale_format = ScaleFormat::kUE8M0;
  ASSERT_TRUE(mhc_post_pre_cpu(a).ok());
  std::vector<uint16_t> f(o.f.size(), 0x7fc1);
  std::vector<float> hp(o.hp.size()), hr(o.hr.size());
  std::vector<uint8_t> q(o.q.size(), 0xa5), sc(o.scales.size(), 0xa5);
  MhcPreArgs b;
  b.shape = a.shape;
  b.x = o.xn.data(); b.phi = a.phi; b.alpha = a.alpha; b.bias = a.bias; b.params = a.params;
  b.f_pre = f.data(); b.h_post = hp.data(); b.h_res = hr.data();
  b.norm_weight = a.norm_weight; b.norm_weight_dtype = a.norm_weight_dtype; b.norm_eps = a.norm_eps;
  b.f_pre_fp8 = q.data(); b.f_pre_scales = sc.data(); b.f_pre_scale_format = a.f_pre_scale_format;
  Status s = mhc_pre_cpu(b);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(f, o.f);
  EXPECT_EQ(q, o.q);
  EXPECT_EQ(sc, o.scales);
}

TEST(MhcCpu, ExpandCopiesEachToken) {
  const int n = 3;
  Problem p = make_problem(2, n, 16, seed_for("expand"));
  std::vector<uint16_t> x(size_t(p.B * p.K()));
  MhcExpandArgs a;
  a.shape = {p.B, n, p.C};
  a.embedding = p.f_out.data(); a.x = x.data();
  ASSERT_TRUE(mhc_expand_cpu(a).ok());
  for (int64_t b = 0; b < p.B; ++b)
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < p.C; ++c) EXPECT_EQ(x[(b * n + i) * p.C + c], p.f_out[b * p.C + c]);
}

// ---- spec §5: bad input names the argument and writes nothing ----

struct PreFixture {
  Problem p = make_problem(2, 4, 64, seed_for("validation"));
  std::vector<uint16_t> f_pre = std::vector<uint16_t>(size_t(2 * 64), 0x7fc1);
  std::vector<float> h_post = std::vector<float>(8, 1234.f), h_res = std::vector<float>(32, 1234.f);
  MhcPreArgs args() {
    MhcPreArgs a;
    a.shape = {p.B, p.n, p.C};
    a.x = p.x.data(); a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
    a.f_pre = f_pre.data(); a.h_post = h_post.data(); a.h_res = h_res.data();
    return a;
  }
  void expect_untouched() {
    for (auto v : f_pre) ASSERT_EQ(v, 0x7fc1);
    for (auto v : h_post) ASSERT_EQ(v, 1234.f);
    for (auto v : h_res) ASSERT_EQ(v, 1234.f);
  }
};

void expect_error(const Status& s, StatusCode code, const std::string& arg) {
  EXPECT_EQ(s.code(), code) << s.message();
  EXPECT_NE(s.message().find(": " + arg + ": "), std::string::npos) << s.message();
}

TEST(MhcValidation, NullPointersAreRejected) {
  const char* names[] = {"x", "phi", "alpha", "bias", "f_pre", "h_post", "h_res"};
  for (int which = 0; which < 7; ++which) {
    PreFixture f;
    MhcPreArgs a = f.args();
    switch (which) {
      case 0: a.x = nullptr; break;
      case 1: a.phi = nullptr; break;
      case 2: a.alpha = nullptr; break;
      case 3: a.bias = nullptr; break;
      case 4: a.f_pre = nullptr; break;
      case 5: a.h_post = nullptr; break;
      default: a.h_res = nullptr; break;
    }
    expect_error(validate_mhc_pre(a), StatusCode::kInvalidArgument, names[which]);
    expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, names[which]);
    f.expect_untouched();
  }
}

TEST(MhcValidation, NegativeBatchIsRejected) {
  PreFixture f;
  MhcPreArgs a = f.args();
  a.shape.batch = -1;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "batch");
  f.expect_untouched();
}

TEST(MhcValidation, OverflowingSizesAreRejected) {
  PreFixture f;
  MhcPreArgs a = f.args();
  a.shape.batch = int64_t(1) << 28;  // B * n * C > 2^31
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "batch");
  a = f.args();
  a.shape.hidden = int64_t(1) << 30;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "hidden");
  f.expect_untouched();
}

TEST(MhcValidation, StreamsOutOfRangeAreRejected) {
  for (int n : {0, -1, 9}) {
    PreFixture f;
    MhcPreArgs a = f.args();
    a.shape.n = n;
    expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "n");
    f.expect_untouched();
  }
}

TEST(MhcValidation, HiddenNotMultipleOf8IsRejected) {
  for (int64_t c : {0, -8, 12, 63}) {
    PreFixture f;
    MhcPreArgs a = f.args();
    a.shape.hidden = c;
    expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "hidden");
    f.expect_untouched();
  }
}

TEST(MhcValidation, MisalignedPointersAreRejected) {
  PreFixture f;
  MhcPreArgs a = f.args();
  a.x = reinterpret_cast<const char*>(a.x) + 2;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "x");
  a = f.args();
  a.f_pre = reinterpret_cast<char*>(a.f_pre) + 8;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "f_pre");
  a = f.args();
  a.phi = reinterpret_cast<const char*>(a.phi) + 4;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "phi");
  f.expect_untouched();
}

// Outputs that share bytes with an input or with each other are rejected,
// with the two arguments named; a partial overlap as much as an exact alias.
TEST(MhcValidation, OverlappingOutputsAreRejected) {
  PreFixture f;
  std::vector<uint16_t> big(f.p.x.size() + 64, 0x7fc1);  // a writable copy of x with room after it
  std::copy(f.p.x.begin(), f.p.x.end(), big.begin());
  MhcPreArgs a = f.args();
  a.x = big.data();
  a.f_pre = big.data() + 8;  // inside x, 16-byte aligned
  Status st = mhc_pre_cpu(a);
  expect_error(st, StatusCode::kInvalidArgument, "f_pre");
  EXPECT_NE(st.message().find("must not overlap x"), std::string::npos) << st.message();
  a = f.args();
  std::vector<float> post_res(64, 1234.f);  // h_post, and h_res starting at its second token
  a.h_post = post_res.data();
  a.h_res = post_res.data() + 4;
  st = mhc_pre_cpu(a);
  expect_error(st, StatusCode::kInvalidArgument, "h_res");
  EXPECT_NE(st.message().find("must not overlap h_post"), std::string::npos) << st.message();
  for (float v : post_res) ASSERT_EQ(v, 1234.f);
  a = f.args();
  a.h_post = const_cast<float*>(a.bias);  // bias has N >= 2n floats: h_post's range lies inside it
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "h_post");
  f.expect_untouched();
  for (size_t i = 0; i < f.p.x.size(); ++i) ASSERT_EQ(big[i], f.p.x[i]);

  Problem p = make_problem(2, 2, 16, seed_for("post_overlap"));
  std::vector<uint16_t> buf(p.x.size() * 2 + 8, 0x7fc1);
  std::copy(p.x.begin(), p.x.end(), buf.begin());
  const std::vector<uint16_t> before = buf;
  MhcPostArgs q;
  q.shape = {p.B, p.n, p.C};
  q.x = buf.data(); q.f_out = p.f_out.data(); q.h_post = p.h_post.data(); q.h_res = p.h_res.data();
  q.x_next = buf.data() + p.x.size() - 8;  // its first vector is x's last
  st = mhc_post_cpu(q);
  expect_error(st, StatusCode::kInvalidArgument, "x_next");
  EXPECT_NE(st.message().find("must not overlap x"), std::string::npos) << st.message();
  q.x_next = buf.data() + p.x.size();  // right after x: fine
  EXPECT_TRUE(mhc_post_cpu(q).ok());
  EXPECT_TRUE(std::equal(before.begin(), before.begin() + p.x.size(), buf.begin())) << "x was written";
}

// The stage ops, mhc_head and mhc_expand check their outputs the same way.
TEST(MhcValidation, StageOutputsThatOverlapAnInputAreRejected) {
  const int n = 4;
  Problem p = make_problem(3, n, 32, seed_for("stage_overlap"));
  std::vector<float> h(size_t(p.B * p.N()), 7.f), r(size_t(p.B), 7.f), pre(size_t(p.B * n), 7.f),
      post(size_t(p.B * n), 7.f), res(size_t(p.B * n * n), 7.f);
  const std::vector<float> h0 = h;
  MhcProjectArgs pa;
  pa.shape = {p.B, n, p.C};
  pa.x = p.x.data(); pa.phi = p.phi_f32.data(); pa.alpha = p.alpha.data(); pa.bias = p.bias.data();
  pa.h = h.data(); pa.r = h.data() + 4;  // r inside h
  Status st = mhc_project_cpu(pa);
  expect_error(st, StatusCode::kInvalidArgument, "r");
  EXPECT_NE(st.message().find("must not overlap h"), std::string::npos) << st.message();
  EXPECT_EQ(h, h0) << "h was written";
  pa.r = r.data();
  ASSERT_TRUE(mhc_project_cpu(pa).ok());

  MhcActivateArgs aa;
  aa.shape = {p.B, n, p.C};
  aa.h = h.data(); aa.h_pre = h.data(); aa.h_post = post.data(); aa.h_res = res.data();  // h_pre aliases h
  expect_error(mhc_activate_cpu(aa), StatusCode::kInvalidArgument, "h_pre");
  aa.h_pre = pre.data();
  ASSERT_TRUE(mhc_activate_cpu(aa).ok());

  std::vector<uint16_t> f(size_t(p.B * p.C), 0x7fc1);
  MhcPreMixArgs ma;
  ma.shape = {p.B, n, p.C};
  ma.x = p.x.data(); ma.h_pre = pre.data();
  ma.f_pre = const_cast<uint16_t*>(p.x.data()) + 8;  // inside x
  expect_error(mhc_pre_mix_cpu(ma), StatusCode::kInvalidArgument, "f_pre");

  MhcHeadArgs ha;
  ha.shape = {p.B, n, p.C};
  ha.x = p.x.data(); ha.phi = p.phi_f32.data(); ha.alpha = p.alpha.data(); ha.bias = p.bias.data();
  ha.out = const_cast<uint16_t*>(p.x.data());  // aliases x
  expect_error(mhc_head_cpu(ha), StatusCode::kInvalidArgument, "out");

  std::vector<uint16_t> xs(size_t(p.B * p.K()) + 16, 0x7fc1);
  MhcExpandArgs ea;
  ea.shape = {p.B, n, p.C};
  ea.embedding = xs.data() + 8;  // inside x
  ea.x = xs.data();
  expect_error(mhc_expand_cpu(ea), StatusCode::kInvalidArgument, "x");
  for (auto v : xs) ASSERT_EQ(v, 0x7fc1);
  for (auto v : f) ASSERT_EQ(v, 0x7fc1);
}

TEST(MhcValidation, UnsupportedPhiDtypeIsRejected) {
  PreFixture f;
  MhcPreArgs a = f.args();
  a.phi_dtype = DType::kFloat16;
  expect_error(mhc_pre_cpu(a), StatusCode::kNotSupported, "phi_dtype");
  a.phi_dtype = static_cast<DType>(77);
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "phi_dtype");
  f.expect_untouched();
}

TEST(MhcValidation, BadParametersAreRejected) {
  PreFixture f;
  MhcPreArgs a = f.args();
  a.params.sinkhorn_iters = 0;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "params.sinkhorn_iters");
  a = f.args();
  a.params.eps_norm = -1e-6f;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "params.eps_norm");
  a = f.args();
  a.params.eps_sinkhorn = NAN;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "params.eps_sinkhorn");
  a = f.args();
  a.params.post_mult = INFINITY;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "params.post_mult");
  a = f.args();
  a.params.res_layout = static_cast<MhcResLayout>(5);
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "params.res_layout");
  f.expect_untouched();
}

TEST(MhcValidation, PostRejectsAliasingAndNulls) {
  Problem p = make_problem(2, 2, 16, seed_for("post_validation"));
  std::vector<uint16_t> out(p.x.size(), 0x7fc1);
  MhcPostArgs a;
  a.shape = {p.B, p.n, p.C};
  a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
  a.x_next = const_cast<uint16_t*>(p.x.data());
  expect_error(mhc_post_cpu(a), StatusCode::kInvalidArgument, "x_next");
  a.x_next = out.data();
  a.f_out = nullptr;
  expect_error(mhc_post_cpu(a), StatusCode::kInvalidArgument, "f_out");
  a.f_out = p.f_out.data();
  a.h_res = nullptr;
  expect_error(mhc_post_cpu(a), StatusCode::kInvalidArgument, "h_res");
  a.h_res = p.h_res.data();
  a.res_layout = static_cast<MhcResLayout>(9);
  expect_error(mhc_post_cpu(a), StatusCode::kInvalidArgument, "res_layout");
  for (auto v : out) ASSERT_EQ(v, 0x7fc1);
}

TEST(MhcValidation, OtherOpsNameTheirArguments) {
  MhcActivateArgs act;
  act.shape = {4, 4, 0};
  expect_error(validate_mhc_activate(act), StatusCode::kInvalidArgument, "h");
  MhcPreMixArgs mix;
  mix.shape = {4, 4, 64};
  expect_error(validate_mhc_pre_mix(mix), StatusCode::kInvalidArgument, "x");
  MhcHeadArgs head;
  head.shape = {4, 4, 64};
  expect_error(validate_mhc_head(head), StatusCode::kInvalidArgument, "x");
  MhcExpandArgs ex;
  ex.shape = {4, 4, 60};
  expect_error(validate_mhc_expand(ex), StatusCode::kInvalidArgument, "hidden");
  MhcProjectArgs pr;
  pr.shape = {4, 4, 64};
  pr.eps_norm = -1;
  expect_error(validate_mhc_project(pr), StatusCode::kInvalidArgument, "eps_norm");
}

// The small-batch workspace: its size covers the split kernel's CTAs for
// 1 <= B <= kMhcSplitMaxBatch and is 0 elsewhere; a bad workspace is named.
TEST(MhcValidation, WorkspaceSizeAndRules) {
  EXPECT_EQ(mhc_workspace_bytes({0, 4, 7168}), 0u);
  EXPECT_EQ(mhc_workspace_bytes({kMhcSplitMaxBatch + 1, 4, 7168}), 0u);
  EXPECT_EQ(mhc_workspace_bytes({4, 4, 60}), 0u);  // invalid hidden
  const size_t b16 = mhc_workspace_bytes({16, 4, 7168});
  // 256 header bytes + [256 records][16 tokens x (N + 1) = 400] 8-byte tagged words.
  EXPECT_EQ(b16, 256u + 8u * 256 * 400);
  EXPECT_LT(mhc_workspace_bytes({1, 4, 7168}), b16);
  EXPECT_LT(mhc_workspace_bytes({16, 4, 64}), b16);  // 8 CTAs at most for 8 column groups
  EXPECT_GT(mhc_workspace_bytes({kMhcSplitMaxBatch, 8, 7168}), b16);

  PreFixture f;
  const size_t need = mhc_workspace_bytes({f.p.B, f.p.n, f.p.C});
  ASSERT_GT(need, 0u);
  std::vector<float> ws(need / 4 + 8, 0.f);
  MhcPreArgs a = f.args();
  a.workspace = ws.data();
  a.workspace_bytes = need;
  EXPECT_TRUE(validate_mhc_pre(a).ok());
  a.workspace_bytes = need - 4;
  expect_error(validate_mhc_pre(a), StatusCode::kInvalidArgument, "workspace_bytes");
  a.workspace = ws.data() + 1;  // 4-byte aligned only
  a.workspace_bytes = need;
  expect_error(validate_mhc_pre(a), StatusCode::kInvalidArgument, "workspace");
  a.workspace = nullptr;
  expect_error(validate_mhc_pre(a), StatusCode::kInvalidArgument, "workspace");
  a = f.args();
  a.workspace = f.h_res.data();  // overlaps an output
  a.workspace_bytes = need;
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "workspace");
  a = f.args();
  a.workspace = ws.data();
  a.workspace_bytes = need;
  a.workspace = const_cast<float*>(f.p.alpha.data());  // overlaps an input
  expect_error(mhc_pre_cpu(a), StatusCode::kInvalidArgument, "workspace");
  f.expect_untouched();
}

TEST(MhcValidation, PostPreNamesItsArguments) {
  Problem p = make_problem(2, 4, 16, seed_for("post_pre_validation"));
  std::vector<uint16_t> xn(p.x.size(), 0x7fc1), f(size_t(p.B * p.C), 0x7fc1);
  std::vector<float> hp(size_t(p.B * 4), 1234.f), hr(size_t(p.B * 16), 1234.f);
  auto base = [&] {
    MhcPostPreArgs a;
    a.shape = {p.B, 4, p.C};
    a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
    a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
    a.x_next = xn.data(); a.f_pre = f.data(); a.h_post_next = hp.data(); a.h_res_next = hr.data();
    return a;
  };
  EXPECT_TRUE(validate_mhc_post_pre(base()).ok());
  const char* nulls[] = {"x", "f_out", "h_post", "h_res", "phi", "alpha", "bias", "x_next", "f_pre", "h_post_next",
                         "h_res_next"};
  for (int which = 0; which < 11; ++which) {
    MhcPostPreArgs a = base();
    switch (which) {
      case 0: a.x = nullptr; break;
      case 1: a.f_out = nullptr; break;
      case 2: a.h_post = nullptr; break;
      case 3: a.h_res = nullptr; break;
      case 4: a.phi = nullptr; break;
      case 5: a.alpha = nullptr; break;
      case 6: a.bias = nullptr; break;
      case 7: a.x_next = nullptr; break;
      case 8: a.f_pre = nullptr; break;
      case 9: a.h_post_next = nullptr; break;
      default: a.h_res_next = nullptr; break;
    }
    expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, nulls[which]);
  }
  MhcPostPreArgs a = base();
  a.x_next = const_cast<uint16_t*>(p.x.data());  // in place is not allowed
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "x_next");
  a = base();
  a.h_res_next = const_cast<float*>(p.h_res.data());  // the coefficients must be double-buffered
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "h_res_next");
  a = base();
  a.f_pre = xn.data() + 8;  // overlaps another output
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "f_pre");
  a = base();
  a.f_out = p.f_out.data() + 1;  // 2-byte aligned only
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "f_out");
  a = base();
  a.res_layout = static_cast<MhcResLayout>(9);
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "res_layout");
  a = base();
  a.params.sinkhorn_iters = 0;
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "params.sinkhorn_iters");
  a = base();
  a.phi_dtype = DType::kFloat16;
  expect_error(mhc_post_pre_cpu(a), StatusCode::kNotSupported, "phi_dtype");
  a = base();
  a.kernel = static_cast<MhcPreKernel>(17);
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "kernel");
  a = base();
  a.path = static_cast<MhcBoundaryPath>(3);
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "path");
  EXPECT_STREQ(to_string(MhcBoundaryPath::kAuto), "auto");
  EXPECT_STREQ(to_string(MhcBoundaryPath::kFused), "fused");
  EXPECT_STREQ(to_string(MhcBoundaryPath::kPostThenPre), "post_then_pre");
  EXPECT_STREQ(to_string(static_cast<MhcBoundaryPath>(3)), "unknown");
  for (MhcBoundaryPath path : {MhcBoundaryPath::kFused, MhcBoundaryPath::kPostThenPre}) {
    a = base();  // the CPU reference has one path: every valid value is accepted
    a.path = path;
    EXPECT_TRUE(validate_mhc_post_pre(a).ok());
  }
  a = base();
  a.shape.hidden = 20;
  expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "hidden");
  {  // the small-batch workspace (spec §4.6): size, alignment, overlap
    const size_t need = mhc_workspace_bytes(base().shape);
    ASSERT_GT(need, 0u);
    std::vector<uint64_t> ws(need / 8 + 2, 0);
    a = base();
    a.workspace = ws.data();
    a.workspace_bytes = need;
    EXPECT_TRUE(validate_mhc_post_pre(a).ok());
    a.workspace_bytes = need - 8;
    expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "workspace_bytes");
    a.workspace = reinterpret_cast<char*>(ws.data()) + 4;  // 4-byte aligned only
    a.workspace_bytes = need;
    expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "workspace");
    a.workspace = xn.data();  // overlaps an output
    expect_error(mhc_post_pre_cpu(a), StatusCode::kInvalidArgument, "workspace");
  }
  for (auto v : xn) ASSERT_EQ(v, 0x7fc1);
  for (auto v : f) ASSERT_EQ(v, 0x7fc1);
  for (auto v : hp) ASSERT_EQ(v, 1234.f);
  for (auto v : hr) ASSERT_EQ(v, 1234.f);
  MhcPostPreArgs z;  // B = 0: valid without buffers
  z.shape = {0, 4, 7168};
  EXPECT_TRUE(mhc_post_pre_cpu(z).ok());
}

TEST(MhcValidation, PostHeadNamesItsArguments) {
  Problem p = make_problem(2, 4, 16, seed_for("post_head_validation"));
  std::vector<uint16_t> xn(p.x.size(), 0x7fc1), out(size_t(p.B * p.C), 0x7fc1);
  auto base = [&] {
    MhcPostHeadArgs a;
    a.shape = {p.B, 4, p.C};
    a.x = p.x.data(); a.f_out = p.f_out.data(); a.h_post = p.h_post.data(); a.h_res = p.h_res.data();
    a.phi = p.phi_f32.data(); a.alpha = p.alpha.data(); a.bias = p.bias.data();
    a.out = out.data(); a.x_next = xn.data();
    return a;
  };
  EXPECT_TRUE(validate_mhc_post_head(base()).ok());
  MhcPostHeadArgs a = base();
  a.x_next = nullptr;  // optional
  EXPECT_TRUE(validate_mhc_post_head(a).ok());
  const char* nulls[] = {"x", "f_out", "h_post", "h_res", "phi", "alpha", "bias", "out"};
  for (int which = 0; which < 8; ++which) {
    a = base();
    switch (which) {
      case 0: a.x = nullptr; break;
      case 1: a.f_out = nullptr; break;
      case 2: a.h_post = nullptr; break;
      case 3: a.h_res = nullptr; break;
      case 4: a.phi = nullptr; break;
      case 5: a.alpha = nullptr; break;
      case 6: a.bias = nullptr; break;
      default: a.out = nullptr; break;
    }
    expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, nulls[which]);
  }
  a = base();
  a.x_next = const_cast<uint16_t*>(p.x.data());  // in place is not allowed
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "x_next");
  a = base();
  a.out = const_cast<uint16_t*>(p.f_out.data());  // over an input
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "out");
  a = base();
  a.out = xn.data() + 8;  // over the other output
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "x_next");
  a = base();
  a.x_next = xn.data() + 1;  // 2-byte aligned only
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "x_next");
  a = base();
  a.res_layout = static_cast<MhcResLayout>(9);
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "res_layout");
  a = base();
  a.eps_pre = -1.f;
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "eps_pre");
  a = base();
  a.eps_norm = NAN;
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "eps_norm");
  a = base();
  a.phi_dtype = DType::kFloat16;
  expect_error(mhc_post_head_cpu(a), StatusCode::kNotSupported, "phi_dtype");
  a = base();
  a.kernel = static_cast<MhcPreKernel>(17);
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "kernel");
  a = base();
  a.x_next_scales = out.data();  // scales on the bf16 stream
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "x_next_scales");
  a = base();
  a.shape.hidden = 20;
  expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "hidden");
  {
    const size_t need = mhc_workspace_bytes(base().shape);
    std::vector<uint64_t> ws(need / 8 + 2, 0);
    a = base();
    a.workspace = ws.data();
    a.workspace_bytes = need;
    EXPECT_TRUE(validate_mhc_post_head(a).ok());
    a.workspace_bytes = need - 8;
    expect_error(mhc_post_head_cpu(a), StatusCode::kInvalidArgument, "workspace_bytes");
  }
  for (auto v : xn) ASSERT_EQ(v, 0x7fc1);
  for (auto v : out) ASSERT_EQ(v, 0x7fc1);
  MhcPostHeadArgs z;  // B = 0: valid without buffers
  z.shape = {0, 4, 7168};
  EXPECT_TRUE(mhc_post_head_cpu(z).ok());
}

// The epilogue's rules (spec §5.4), on mhc_post_pre and mhc_pre: each one
// named, nothing written.
TEST(MhcValidation, EpilogueNamesItsArguments) {
  Problem p = make_problem(2, 4, 256, seed_for("epilogue_validation"));
  NormWeight w(p.C, 5);
  PostPreBufs o(p);
  auto base = [&] {
    MhcPostPreArgs a = post_pre_args(p, o);
    a.norm_weight = w.bf.data();
    a.f_pre_fp8 = o.q.data(); a.f_pre_scales = o.scales.data();
    return a;
  };
  EXPECT_TRUE(validate_mhc_post_pre(base()).ok());
  struct Bad {
    const char* arg;
    StatusCode code;
    std::function<void(MhcPostPreArgs&)> edit;
  };
  const Bad bad[] = {
      {"norm_weight_dtype", StatusCode::kNotSupported, [](MhcPostPreArgs& a) { a.norm_weight_dtype = DType::kFloat16; }},
      {"norm_weight_dtype", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.norm_weight_dtype = static_cast<DType>(99); }},
      {"norm_eps", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.norm_eps = -1e-6f; }},
      {"norm_eps", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.norm_eps = NAN; }},
      {"f_pre_scale_format", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.f_pre_scale_format = static_cast<ScaleFormat>(5); }},
      {"hidden", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.shape.hidden = 200; }},
      {"f_pre_scales", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.f_pre_scales = nullptr; }},
      {"f_pre_fp8", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.f_pre_fp8 = nullptr; }},
      {"f_pre", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.f_pre = nullptr; a.f_pre_fp8 = nullptr; a.f_pre_scales = nullptr; }},
      {"norm_weight", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.norm_weight = static_cast<const uint16_t*>(a.norm_weight) + 1; }},
      {"f_pre_fp8", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.f_pre_fp8 = static_cast<uint8_t*>(a.f_pre_fp8) + 8; }},
      {"f_pre_scales", StatusCode::kInvalidArgument,
       [](MhcPostPreArgs& a) { a.f_pre_scales = static_cast<uint8_t*>(a.f_pre_scales) + 2; }},
      {"f_pre_fp8", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.f_pre_fp8 = a.x_next; }},
      {"f_pre_scales", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.f_pre_scales = a.f_pre; }},
      {"f_pre_fp8", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.f_pre_fp8 = const_cast<void*>(a.norm_weight); }},
      {"f_pre", StatusCode::kInvalidArgument, [](MhcPostPreArgs& a) { a.norm_weight = a.f_pre; }},
  };
  for (const Bad& b : bad) {
    MhcPostPreArgs a = base();
    b.edit(a);
    SCOPED_TRACE(b.arg);
    expect_error(mhc_post_pre_cpu(a), b.code, b.arg);
  }
  for (auto v : o.xn) ASSERT_EQ(v, 0x7fc1);
  for (auto v : o.f) ASSERT_EQ(v, 0x7fc1);
  for (auto v : o.q) ASSERT_EQ(v, 0xa5);
  for (auto v : o.scales) ASSERT_EQ(v, 0xa5);
  // ue8m0 scales need only 1-byte alignment.
  MhcPostPreArgs a = base();
  a.f_pre_scale_format = ScaleFormat::kUE8M0;
  a.f_pre_scales = o.scales.data() + 1;
  EXPECT_TRUE(validate_mhc_post_pre(a).ok());
  // B = 0: the value rules still hold, no buffers needed.
  MhcPostPreArgs z;
  z.shape = {0, 4, 200};
  z.f_pre_fp8 = o.q.data();
  expect_error(validate_mhc_post_pre(z), StatusCode::kInvalidArgument, "hidden");
  z.shape.hidden = 256;
  z.f_pre_fp8 = nullptr;
  z.norm_eps = 0.0f;
  EXPECT_TRUE(mhc_post_pre_cpu(z).ok());
  // mhc_pre: the same rules, its own names.
  std::vector<float> hp(o.hp.size()), hr(o.hr.size());
  MhcPreArgs q;
  q.shape = {p.B, 4, p.C};
  q.x = p.x.data(); q.phi = p.phi_f32.data(); q.alpha = p.alpha.data(); q.bias = p.bias.data();
  q.f_pre = nullptr; q.h_post = hp.data(); q.h_res = hr.data();
  q.f_pre_fp8 = o.q.data(); q.f_pre_scales = o.scales.data();
  EXPECT_TRUE(validate_mhc_pre(q).ok());
  q.f_pre_scales = nullptr;
  expect_error(mhc_pre_cpu(q), StatusCode::kInvalidArgument, "f_pre_scales");
  q.f_pre_scales = o.scales.data();
  q.norm_weight = w.bf.data();
  q.norm_eps = INFINITY;
  expect_error(mhc_pre_cpu(q), StatusCode::kInvalidArgument, "norm_eps");
  q.norm_eps = 1e-6f;
  q.f_pre_scales = const_cast<uint16_t*>(p.x.data());
  expect_error(mhc_pre_cpu(q), StatusCode::kInvalidArgument, "f_pre_scales");
  for (auto v : o.q) ASSERT_EQ(v, 0xa5);
}

TEST(MhcValidation, ZeroTokensIsValidWithoutBuffers) {
  MhcPreArgs a;
  a.shape = {0, 4, 7168};
  EXPECT_TRUE(mhc_pre_cpu(a).ok());
  MhcPostArgs b;
  b.shape = {0, 4, 7168};
  EXPECT_TRUE(mhc_post_cpu(b).ok());
  MhcHeadArgs h;
  h.shape = {0, 8, 1000};
  EXPECT_TRUE(mhc_head_cpu(h).ok());
}

}  // namespace
}  // namespace flashmix
