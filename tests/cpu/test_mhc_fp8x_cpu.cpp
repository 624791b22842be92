// CPU tests of the ops on the FP8 residual stream (spec §4.9: mhc_post,
// mhc_expand, mhc_pre, mhc_head, mhc_post_pre) and of their argument checks
// (spec §5.4). These run on any machine.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include <gtest/gtest.h>

#include "cpu/test_mhc_fp8x_common.h"

namespace flashmix {
namespace {

using namespace mhc_test;

constexpr ScaleFormat kFormats[] = {ScaleFormat::kFloat32, ScaleFormat::kUE8M0};
constexpr MhcResLayout kLayouts[] = {MhcResLayout::kDeepSeek, MhcResLayout::kRowMix};

std::string fmt_name(ScaleFormat f) { return to_string(f); }

// Every stream of every token of `out` ([B, n, C]) holds quantize_fp8_cpu's
// codes and scales of row b of `f` ([B, C] bf16, 1 x 128 blocks).
void expect_every_stream_is_quantize_fp8_of(const Fp8X& out, const std::vector<uint16_t>& f, int64_t B, int n,
                                            int64_t C) {
  Fp8X ref = poisoned_fp8x({B, 1, C}, out.format);
  QuantizeFp8Args q;
  q.x = f.data(); q.q = ref.codes.data(); q.scales = ref.scales.data();
  q.rows = B; q.cols = C; q.scale_format = out.format;
  ASSERT_TRUE(quantize_fp8_cpu(q).ok());
  const int64_t blocks = C / 128, sb = out.scale_bytes();
  for (int64_t b = 0; b < B; ++b)
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(0, std::memcmp(out.codes.data() + (b * n + i) * C, ref.codes.data() + b * C, size_t(C)))
          << "token " << b << " stream " << i;
      ASSERT_EQ(0, std::memcmp(out.scales.data() + (b * n + i) * blocks * sb, ref.scales.data() + b * blocks * sb,
                               size_t(blocks * sb)))
          << "token " << b << " stream " << i;
    }
}

// With X = 0 and H_post = 1 every stream of X_next is F_out exactly (fp32:
// 1 * f, then fma(R, 0, f) = f), so X_next is quantize_fp8 of F_out (bf16,
// 1 x 128) in every stream, byte for byte: the fp32 block rule of §4.9 is
// quantize_fp8's on values that are bf16.
TEST(MhcFp8xCpu, ZeroXAndUnitPostGiveQuantizeFp8OfFout) {
  for (int n : {1, 3, 8})
    for (ScaleFormat f : kFormats)
      for (MhcResLayout l : kLayouts) {
        Problem p = make_problem(3, n, 384, seed_for("fp8x_zero_x") + n);
        SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
        for (auto& v : p.h_post) v = 1.0f;
        Fp8X x = quantize_x(p, f);
        std::fill(x.codes.begin(), x.codes.end(), uint8_t(0));
        Fp8X out = poisoned_fp8x({p.B, n, p.C}, f);
        Status s = mhc_post_cpu(fp8_post_args(p, x, out, l));
        ASSERT_TRUE(s.ok()) << s.message();
        expect_every_stream_is_quantize_fp8_of(out, p.f_out, p.B, n, p.C);
      }
}

// One block by hand (spec §4.9): the fp32 chain in its order, amax, the
// scale, every code; and the whole output within the e4m3 tolerance of the
// exact sum, with each block's largest code at +-448 (kFloat32) or in
// [224, 448] (kUE8M0).
TEST(MhcFp8xCpu, MatchesTheFp32ChainAndExactArithmetic) {
  for (int n : {1, 2, 4, 6, 8})
    for (ScaleFormat f : kFormats)
      for (MhcResLayout l : kLayouts) {
        Problem p = make_problem(3, n, 256, seed_for("fp8x_by_hand") + n);
        SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
        const Fp8X x = quantize_x(p, f);
        Fp8X out = poisoned_fp8x({p.B, n, p.C}, f);
        ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, out, l)).ok());
        // Token 2, stream n - 1, channels [128, 256).
        const int64_t b = 2, C = p.C;
        const int i = n - 1;
        const bool tr = l == MhcResLayout::kDeepSeek;
        float v[128], amax = 0;
        for (int k = 0; k < 128; ++k) {
          const int64_t c = 128 + k;
          float acc = p.h_post[b * n + i] * f32(p.f_out[b * C + c]);
          for (int j = 0; j < n; ++j)
            acc = std::fma(tr ? p.h_res[b * n * n + j * n + i] : p.h_res[b * n * n + i * n + j],
                           x.value((b * n + j) * C + c), acc);
          v[k] = acc;
          amax = std::max(amax, std::fabs(acc));
        }
        const int64_t blk = (b * n + i) * (C / 128) + 1;
        float s = amax / 448.0f;
        if (f == ScaleFormat::kUE8M0) {
          const uint8_t e = host::ue8m0_byte_at_least(s);
          EXPECT_EQ(out.scales[size_t(blk)], e);
          s = host::ue8m0_to_float(e);
        } else {
          EXPECT_EQ(out.scale(blk), s);
        }
        for (int k = 0; k < 128; ++k)
          ASSERT_EQ(out.codes[size_t(blk * 128 + k)], host::float_to_e4m3(v[k] / s)) << "channel " << 128 + k;
        EXPECT_EQ(count_fp8x_far_from_exact(p, x, out, l), 0);
        for (int64_t k = 0; k < mhc_x_scale_count({p.B, n, C}); ++k) {
          float big = 0;
          for (int e = 0; e < 128; ++e) big = std::max(big, std::fabs(host::e4m3_to_float(out.codes[size_t(k * 128 + e)])));
          if (f == ScaleFormat::kFloat32) ASSERT_EQ(big, 448.0f) << "block " << k;
          else ASSERT_TRUE(big >= 224.0f && big <= 448.0f) << "block " << k << ": " << big;
        }
      }
}

// deepseek with H_res == row_mix with H_res transposed, byte for byte.
TEST(MhcFp8xCpu, LayoutsAreTransposesOfEachOther) {
  const int n = 4;
  Problem p = make_problem(3, n, 256, seed_for("fp8x_layouts"));
  const Fp8X x = quantize_x(p, ScaleFormat::kFloat32);
  Fp8X o1 = poisoned_fp8x({p.B, n, p.C}, x.format), o2 = o1;
  ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, o1, MhcResLayout::kDeepSeek)).ok());
  Problem t = p;
  for (int64_t b = 0; b < p.B; ++b)
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) t.h_res[b * 16 + i * 4 + j] = p.h_res[b * 16 + j * 4 + i];
  ASSERT_TRUE(mhc_post_cpu(fp8_post_args(t, x, o2, MhcResLayout::kRowMix)).ok());
  EXPECT_EQ(o1.codes, o2.codes);
  EXPECT_EQ(o1.scales, o2.scales);
}

// NaN and infinity (spec §4.9, §12.1): a NaN code in X makes that channel
// NaN in every stream, so each stream's block holding it gets the NaN scale
// and all codes 0x7f; an infinite F_out element (H_post > 0) makes its
// channel +inf: kFloat32 scale +inf, that code 0x7f, the rest +-0; kUE8M0
// scale 2^127 (byte 254), that code 448 (0x7e). Other blocks are untouched
// by either.
TEST(MhcFp8xCpu, NanAndInfinityFollowQuantizeFp8) {
  const int n = 3;
  for (ScaleFormat f : kFormats) {
    Problem p = make_problem(2, n, 384, seed_for("fp8x_special"));
    SCOPED_TRACE("seed " + std::to_string(p.seed) + " " + fmt_name(f));
    Fp8X x = quantize_x(p, f);
    Fp8X clean = poisoned_fp8x({p.B, n, p.C}, f);
    ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, clean)).ok());
    const int64_t C = p.C, blocks = C / 128;
    x.codes[size_t((0 * n + 1) * C + 130)] = 0xff;  // token 0, stream 1, channel 130 (block 1): NaN
    p.f_out[size_t(1 * C + 300)] = 0x7f80;           // token 1, channel 300 (block 2): +inf
    Fp8X out = poisoned_fp8x({p.B, n, p.C}, f);
    ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, out)).ok());
    for (int64_t b = 0; b < p.B; ++b)
      for (int i = 0; i < n; ++i)
        for (int64_t k = 0; k < blocks; ++k) {
          const int64_t blk = (b * n + i) * blocks + k;
          const uint8_t* q = out.codes.data() + blk * 128;
          if (b == 0 && k == 1) {  // NaN block
            EXPECT_TRUE(std::isnan(out.scale(blk)));
            if (f == ScaleFormat::kFloat32) {
              uint32_t bits;
              std::memcpy(&bits, out.scales.data() + blk * 4, 4);
              EXPECT_EQ(bits, 0x7fc00000u);
            }
            for (int e = 0; e < 128; ++e) ASSERT_EQ(q[e], 0x7f);
          } else if (b == 1 && k == 2) {  // +inf at channel 300 = 256 + 44
            if (f == ScaleFormat::kFloat32) {
              EXPECT_EQ(out.scale(blk), std::numeric_limits<float>::infinity());
              for (int e = 0; e < 128; ++e) ASSERT_EQ(q[e] & 0x7f, e == 44 ? 0x7f : 0x00) << e;
            } else {
              EXPECT_EQ(out.scales[size_t(blk)], 254);
              EXPECT_EQ(q[44], 0x7e);
            }
          } else {
            ASSERT_EQ(0, std::memcmp(q, clean.codes.data() + blk * 128, 128)) << "block " << blk;
            ASSERT_EQ(0, std::memcmp(out.scales.data() + blk * x.scale_bytes(), clean.scales.data() + blk * x.scale_bytes(),
                                     size_t(x.scale_bytes())));
          }
        }
  }
}

// fp32(amax / 448) == 0 (amax below about 2^-141, reachable only from fp32
// values): the block counts as amax == 0, scale 1 (byte 127), codes +-0.
TEST(MhcFp8xCpu, VanishingBlockGetsScaleOne) {
  const int n = 1;
  for (ScaleFormat f : kFormats) {
    Problem p = make_problem(1, n, 128, seed_for("fp8x_tiny"));
    p.h_post[0] = 0.0f;
    p.h_res[0] = 1.0f;
    Fp8X x = poisoned_fp8x({1, n, 128}, f);
    std::fill(x.codes.begin(), x.codes.end(), uint8_t(0x08));  // 2^-6
    if (f == ScaleFormat::kFloat32) {
      const float s = std::ldexp(1.0f, -140);  // values 2^-146
      std::memcpy(x.scales.data(), &s, 4);
    } else {
      x.scales[0] = 0;  // 2^-127: values 2^-133, amax / 448 still a subnormal
    }
    Fp8X out = poisoned_fp8x({1, n, 128}, f);
    ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, out)).ok());
    if (f == ScaleFormat::kFloat32) {
      EXPECT_EQ(out.scale(0), 1.0f);
      for (int e = 0; e < 128; ++e) ASSERT_EQ(out.codes[size_t(e)] & 0x7f, 0) << e;
    } else {
      EXPECT_EQ(out.scales[0], 0);  // 2^-127, clamped; 2^-133 / 2^-127 = 2^-6 = code 0x08
      for (int e = 0; e < 128; ++e) ASSERT_EQ(out.codes[size_t(e)], 0x08) << e;
    }
  }
}

// The rules of spec §5.4 for the FP8 stream, each named; nothing written.
TEST(MhcFp8xValidation, NamesItsArguments) {
  Problem p = make_problem(2, 4, 256, seed_for("fp8x_validation"));
  const Fp8X x = quantize_x(p, ScaleFormat::kFloat32);
  Fp8X out = poisoned_fp8x({p.B, 4, p.C}, ScaleFormat::kFloat32);
  auto base = [&] { return fp8_post_args(p, x, out); };
  EXPECT_TRUE(validate_mhc_post(base()).ok());
  struct Bad {
    const char* arg;
    std::function<void(MhcPostArgs&)> edit;
  };
  const Bad bad[] = {
      {"residual", [](MhcPostArgs& a) { a.residual = static_cast<MhcResidual>(7); }},
      {"x_scale_format", [](MhcPostArgs& a) { a.x_scale_format = static_cast<ScaleFormat>(3); }},
      {"hidden", [](MhcPostArgs& a) { a.shape.hidden = 200; }},
      {"x_scales", [](MhcPostArgs& a) { a.residual = MhcResidual::kBf16; a.x_next_scales = nullptr; }},
      {"x_next_scales", [](MhcPostArgs& a) { a.residual = MhcResidual::kBf16; a.x_scales = nullptr; }},
      {"x_scales", [](MhcPostArgs& a) { a.x_scales = nullptr; }},
      {"x_next_scales", [](MhcPostArgs& a) { a.x_next_scales = nullptr; }},
      {"x", [](MhcPostArgs& a) { a.x = static_cast<const uint8_t*>(a.x) + 8; }},
      {"x_next", [](MhcPostArgs& a) { a.x_next = static_cast<uint8_t*>(a.x_next) + 8; }},
      {"x_scales", [](MhcPostArgs& a) { a.x_scales = static_cast<const uint8_t*>(a.x_scales) + 2; }},
      {"x_next_scales", [](MhcPostArgs& a) { a.x_next_scales = static_cast<uint8_t*>(a.x_next_scales) + 1; }},
      // Overlaps, on the FP8 extents (codes: one byte per element).
      {"x_next", [](MhcPostArgs& a) { a.x_next = const_cast<void*>(a.x); }},
      {"x_next_scales", [](MhcPostArgs& a) { a.x_next_scales = const_cast<void*>(a.x_scales); }},
      {"x_next_scales", [](MhcPostArgs& a) { a.x_next_scales = a.x_next; }},
      {"x_next", [](MhcPostArgs& a) {
         a.x_next = const_cast<uint8_t*>(static_cast<const uint8_t*>(a.x_scales)) - 2 * 4 * 256 + 16;
       }},
  };
  for (const Bad& b : bad) {
    MhcPostArgs a = base();
    b.edit(a);
    SCOPED_TRACE(b.arg);
    Status s = mhc_post_cpu(a);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(": " + std::string(b.arg) + ": "), std::string::npos) << s.message();
  }
  for (auto v : out.codes) ASSERT_EQ(v, 0xa5);
  for (auto v : out.scales) ASSERT_EQ(v, 0xa5);
  // ue8m0 scales need 1-byte alignment only; codes end exactly where the
  // bf16 extent would still overlap (one byte per element, not two).
  MhcPostArgs a = base();
  a.x_scale_format = ScaleFormat::kUE8M0;
  a.x_scales = x.scales.data() + 1;
  a.x_next_scales = out.scales.data() + 3;
  EXPECT_TRUE(validate_mhc_post(a).ok());
  std::vector<uint8_t> two(size_t(2 * p.B * 4 * p.C));
  a = base();
  a.x = two.data();
  a.x_next = two.data() + p.B * 4 * p.C;
  EXPECT_TRUE(validate_mhc_post(a).ok());
  // B = 0: the value rules still hold, no buffers needed.
  MhcPostArgs z;
  z.shape = {0, 4, 200};
  z.residual = MhcResidual::kFp8E4m3;
  Status s = validate_mhc_post(z);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(": hidden: "), std::string::npos) << s.message();
  z.shape.hidden = 256;
  EXPECT_TRUE(mhc_post_cpu(z).ok());
  EXPECT_STREQ(to_string(MhcResidual::kBf16), "bf16");
  EXPECT_STREQ(to_string(MhcResidual::kFp8E4m3), "fp8_e4m3");
  EXPECT_EQ(mhc_x_scale_count({8192, 4, 7168}), 8192 * 4 * 56);
}

// An FP8 X whose scales are powers of two (ue8m0, or the same values as
// floats), so every element's value is a bf16 number, and that bf16 X.
struct ExactFp8X {
  Fp8X fp8;
  std::vector<uint16_t> bf16;
};
ExactFp8X exact_fp8x(const Problem& p, ScaleFormat f) {
  ExactFp8X o;
  o.fp8 = quantize_x(p, ScaleFormat::kUE8M0);
  if (f == ScaleFormat::kFloat32) {
    std::vector<uint8_t> fs(o.fp8.scales.size() * 4);
    for (size_t k = 0; k < o.fp8.scales.size(); ++k) {
      const float v = host::ue8m0_to_float(o.fp8.scales[k]);
      std::memcpy(fs.data() + 4 * k, &v, 4);
    }
    o.fp8.scales = fs;
    o.fp8.format = f;
  }
  o.bf16.resize(o.fp8.codes.size());
  for (size_t e = 0; e < o.bf16.size(); ++e) {
    const float v = o.fp8.value(int64_t(e));
    o.bf16[e] = bf16(v);
    EXPECT_EQ(f32(o.bf16[e]), v) << "element " << e << " is not a bf16 number";
  }
  return o;
}

// mhc_pre and mhc_head on the FP8 stream read each element as
// fp32(code * scale) and do the rest as on the bf16 stream (spec §4.9): with
// values that are bf16 numbers, bitwise the bf16 op's results on them, for
// both scale formats, n = 1..8, with and without F_pre's epilogue.
TEST(MhcPreFp8xCpu, PreAndHeadReadTheDequantisedX) {
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (ScaleFormat f : kFormats) {
      Problem p = make_problem(3, n, 256, seed_for("fp8x_pre") + n);
      SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
      const ExactFp8X x = exact_fp8x(p, f);
      const int64_t B = p.B, C = p.C;
      std::vector<float> nw(static_cast<size_t>(C));
      for (int64_t c = 0; c < C; ++c) nw[size_t(c)] = 0.5f + float(c % 7) / 8.0f;
      for (bool epi : {false, true}) {
        std::vector<uint16_t> f_bf(size_t(B * C), 1), f_fp(size_t(B * C), 2);
        std::vector<float> post_bf(size_t(B * n), 3), post_fp(size_t(B * n), 4), res_bf(size_t(B * n * n), 5),
            res_fp(size_t(B * n * n), 6);
        std::vector<uint8_t> q_bf(size_t(B * C), 7), q_fp(q_bf), s_bf(size_t(B * C / 128 * 4), 9), s_fp(s_bf);
        MhcPreArgs a;
        a.shape = {B, n, C};
        a.x = x.bf16.data();
        a.phi = p.phi_f32.data();
        a.alpha = p.alpha.data();
        a.bias = p.bias.data();
        a.f_pre = f_bf.data();
        a.h_post = post_bf.data();
        a.h_res = res_bf.data();
        if (epi) {
          a.norm_weight = nw.data();
          a.norm_weight_dtype = DType::kFloat32;
          a.f_pre_fp8 = q_bf.data();
          a.f_pre_scales = s_bf.data();
        }
        ASSERT_TRUE(mhc_pre_cpu(a).ok());
        a.x = x.fp8.codes.data();
        a.residual = MhcResidual::kFp8E4m3;
        a.x_scales = x.fp8.scales.data();
        a.x_scale_format = f;
        a.f_pre = f_fp.data();
        a.h_post = post_fp.data();
        a.h_res = res_fp.data();
        if (epi) {
          a.f_pre_fp8 = q_fp.data();
          a.f_pre_scales = s_fp.data();
        }
        Status s = mhc_pre_cpu(a);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(f_bf, f_fp);
        EXPECT_EQ(post_bf, post_fp);
        EXPECT_EQ(res_bf, res_fp);
        EXPECT_EQ(q_bf, q_fp);
        EXPECT_EQ(s_bf, s_fp);
      }
      std::vector<uint16_t> o_bf(size_t(B * C), 1), o_fp(size_t(B * C), 2);
      MhcHeadArgs h;
      h.shape = {B, n, C};
      h.x = x.bf16.data();
      h.phi = p.phi_f32.data();
      h.alpha = p.alpha.data();
      h.bias = p.bias.data();
      h.out = o_bf.data();
      ASSERT_TRUE(mhc_head_cpu(h).ok());
      h.x = x.fp8.codes.data();
      h.residual = MhcResidual::kFp8E4m3;
      h.x_scales = x.fp8.scales.data();
      h.x_scale_format = f;
      h.out = o_fp.data();
      Status s = mhc_head_cpu(h);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(o_bf, o_fp);
    }
}

// mhc_post_pre on the FP8 stream (spec §4.7, §4.9): X_next bitwise
// mhc_post's on the stream, and the next pre's outputs bitwise mhc_pre's on
// that stored X_next.
TEST(MhcPreFp8xCpu, PostPreIsPostThenPre) {
  for (int n : {1, 4, 7})
    for (ScaleFormat f : kFormats) {
      Problem p = make_problem(3, n, 384, seed_for("fp8x_post_pre") + n);
      SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
      const Fp8X x = quantize_x(p, f);
      const int64_t B = p.B, C = p.C;
      Fp8X xn1 = poisoned_fp8x({B, n, C}, f), xn2 = poisoned_fp8x({B, n, C}, f);
      ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, xn1, MhcResLayout::kRowMix)).ok());
      std::vector<uint16_t> f1(size_t(B * C), 1), f2(size_t(B * C), 2);
      std::vector<float> po1(size_t(B * n), 3), po2(size_t(B * n), 4), r1(size_t(B * n * n), 5),
          r2(size_t(B * n * n), 6);
      MhcPreArgs pre;
      pre.shape = {B, n, C};
      pre.x = xn1.codes.data();
      pre.residual = MhcResidual::kFp8E4m3;
      pre.x_scales = xn1.scales.data();
      pre.x_scale_format = f;
      pre.phi = p.phi_f32.data();
      pre.alpha = p.alpha.data();
      pre.bias = p.bias.data();
      pre.f_pre = f1.data();
      pre.h_post = po1.data();
      pre.h_res = r1.data();
      ASSERT_TRUE(mhc_pre_cpu(pre).ok());
      MhcPostPreArgs a;
      a.shape = {B, n, C};
      a.x = x.codes.data();
      a.f_out = p.f_out.data();
      a.h_post = p.h_post.data();
      a.h_res = p.h_res.data();
      a.res_layout = MhcResLayout::kRowMix;
      a.phi = p.phi_f32.data();
      a.alpha = p.alpha.data();
      a.bias = p.bias.data();
      a.x_next = xn2.codes.data();
      a.f_pre = f2.data();
      a.h_post_next = po2.data();
      a.h_res_next = r2.data();
      a.residual = MhcResidual::kFp8E4m3;
      a.x_scales = x.scales.data();
      a.x_next_scales = xn2.scales.data();
      a.x_scale_format = f;
      Status s = mhc_post_pre_cpu(a);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(xn1.codes, xn2.codes);
      EXPECT_EQ(xn1.scales, xn2.scales);
      EXPECT_EQ(f1, f2);
      EXPECT_EQ(po1, po2);
      EXPECT_EQ(r1, r2);
    }
}

// mhc_post_head on the FP8 stream is mhc_post then mhc_head on the stored
// codes and scales, X_next kept or not; the scales go with the codes.
TEST(MhcPreFp8xCpu, PostHeadIsPostThenHead) {
  for (int n : {1, 4, 7})
    for (ScaleFormat f : kFormats) {
      Problem p = make_problem(3, n, 384, seed_for("fp8x_post_head") + n);
      SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
      const Fp8X x = quantize_x(p, f);
      const int64_t B = p.B, C = p.C;
      Fp8X xn1 = poisoned_fp8x({B, n, C}, f);
      ASSERT_TRUE(mhc_post_cpu(fp8_post_args(p, x, xn1, MhcResLayout::kDeepSeek)).ok());
      std::vector<uint16_t> o1(size_t(B * C), 1);
      MhcHeadArgs head;
      head.shape = {B, n, C};
      head.x = xn1.codes.data();
      head.residual = MhcResidual::kFp8E4m3;
      head.x_scales = xn1.scales.data();
      head.x_scale_format = f;
      head.phi = p.phi_f32.data();
      head.alpha = p.alpha.data();
      head.bias = p.bias.data();
      head.out = o1.data();
      ASSERT_TRUE(mhc_head_cpu(head).ok());
      for (bool keep : {true, false}) {
        Fp8X xn2 = poisoned_fp8x({B, n, C}, f);
        std::vector<uint16_t> o2(size_t(B * C), 2);
        MhcPostHeadArgs a;
        a.shape = {B, n, C};
        a.x = x.codes.data();
        a.f_out = p.f_out.data();
        a.h_post = p.h_post.data();
        a.h_res = p.h_res.data();
        a.phi = p.phi_f32.data();
        a.alpha = p.alpha.data();
        a.bias = p.bias.data();
        a.out = o2.data();
        a.x_next = keep ? xn2.codes.data() : nullptr;
        a.residual = MhcResidual::kFp8E4m3;
        a.x_scales = x.scales.data();
        a.x_next_scales = keep ? xn2.scales.data() : nullptr;
        a.x_scale_format = f;
        Status s = mhc_post_head_cpu(a);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(o1, o2) << "keep " << keep;
        if (keep) {
          EXPECT_EQ(xn1.codes, xn2.codes);
          EXPECT_EQ(xn1.scales, xn2.scales);
        }
        a.x_next_scales = keep ? nullptr : xn2.scales.data();  // the codes without their scales, or the reverse
        const Status bad = validate_mhc_post_head(a);
        EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.message();
        EXPECT_NE(bad.message().find(": x_next_scales: "), std::string::npos) << bad.message();
      }
    }
}

// The FP8 stream's argument rules on mhc_pre, mhc_head and mhc_post_pre
// (spec §5.4), each named: value rules at any B (an unknown residual or
// format, C % 128, scales given with the bf16 stream), then pointers and
// overlaps on the one-byte code extents.
TEST(MhcFp8xValidation, PrePostPreAndHeadNameTheirArguments) {
  const int64_t B = 2, C = 256;
  const int n = 4;
  std::vector<uint8_t> codes(size_t(B * n * C)), codes2(size_t(B * n * C));
  std::vector<float> scales(size_t(B * n * C / 128)), scales2(scales.size());
  std::vector<float> phi(size_t(24 * n * C)), alpha(3), bias(24), hp(size_t(B * n)), hr(size_t(B * n * n)),
      hp2(hp.size()), hr2(hr.size());
  std::vector<uint16_t> f(size_t(B * C)), fo(size_t(B * C));
  auto expect_bad = [](const Status& s, const char* arg, StatusCode code = StatusCode::kInvalidArgument) {
    EXPECT_EQ(s.code(), code) << s.message();
    EXPECT_NE(s.message().find(std::string(": ") + arg + ": "), std::string::npos) << s.message();
  };
  MhcPreArgs pre;
  pre.shape = {B, n, C};
  pre.x = codes.data();
  pre.residual = MhcResidual::kFp8E4m3;
  pre.x_scales = scales.data();
  pre.phi = phi.data();
  pre.alpha = alpha.data();
  pre.bias = bias.data();
  pre.f_pre = f.data();
  pre.h_post = hp.data();
  pre.h_res = hr.data();
  ASSERT_TRUE(validate_mhc_pre(pre).ok());
  {
    MhcPreArgs a = pre;
    a.shape.hidden = 200;
    expect_bad(validate_mhc_pre(a), "hidden");
    a.shape.batch = 0;
    expect_bad(validate_mhc_pre(a), "hidden");
    a = pre;
    a.x_scales = nullptr;
    expect_bad(validate_mhc_pre(a), "x_scales");
    a = pre;
    a.x_scales = reinterpret_cast<const uint8_t*>(scales.data()) + 2;
    expect_bad(validate_mhc_pre(a), "x_scales");
    a = pre;
    a.residual = MhcResidual::kBf16;
    a.shape.batch = 0;
    expect_bad(validate_mhc_pre(a), "x_scales");
    a = pre;
    a.residual = static_cast<MhcResidual>(5);
    expect_bad(validate_mhc_pre(a), "residual");
    a = pre;
    a.x_scale_format = static_cast<ScaleFormat>(5);
    expect_bad(validate_mhc_pre(a), "x_scale_format");
    a = pre;
    a.h_post = reinterpret_cast<float*>(scales.data());  // an output over the scales
    expect_bad(validate_mhc_pre(a), "h_post");
    a = pre;  // codes take one byte an element: the bf16 extent would overlap, this does not
    a.f_pre = codes.data() + B * n * C / 2;
    expect_bad(validate_mhc_pre(a), "f_pre");
    std::vector<uint8_t> room(size_t(B * n * C + B * C * 2));
    a.x = room.data();
    a.f_pre = room.data() + B * n * C;
    EXPECT_TRUE(validate_mhc_pre(a).ok());
    a.x_scale_format = ScaleFormat::kUE8M0;
    a.x_scales = reinterpret_cast<const uint8_t*>(scales.data()) + 1;  // ue8m0: byte-aligned
    EXPECT_TRUE(validate_mhc_pre(a).ok());
  }
  MhcHeadArgs head;
  head.shape = {B, n, C};
  head.x = codes.data();
  head.residual = MhcResidual::kFp8E4m3;
  head.x_scales = scales.data();
  head.phi = phi.data();
  head.alpha = alpha.data();
  head.bias = bias.data();
  head.out = f.data();
  ASSERT_TRUE(validate_mhc_head(head).ok());
  {
    MhcHeadArgs a = head;
    a.x_scales = nullptr;
    expect_bad(validate_mhc_head(a), "x_scales");
    a = head;
    a.shape.hidden = 384 - 8;
    expect_bad(validate_mhc_head(a), "hidden");
    a = head;
    a.out = reinterpret_cast<uint16_t*>(scales.data());
    expect_bad(validate_mhc_head(a), "out");
    a = head;
    a.residual = MhcResidual::kBf16;
    expect_bad(mhc_head_cpu(a), "x_scales");
  }
  MhcPostPreArgs pp;
  pp.shape = {B, n, C};
  pp.x = codes.data();
  pp.f_out = fo.data();
  pp.h_post = hp.data();
  pp.h_res = hr.data();
  pp.phi = phi.data();
  pp.alpha = alpha.data();
  pp.bias = bias.data();
  pp.x_next = codes2.data();
  pp.f_pre = f.data();
  pp.h_post_next = hp2.data();
  pp.h_res_next = hr2.data();
  pp.residual = MhcResidual::kFp8E4m3;
  pp.x_scales = scales.data();
  pp.x_next_scales = scales2.data();
  ASSERT_TRUE(validate_mhc_post_pre(pp).ok());
  {
    MhcPostPreArgs a = pp;
    a.x_next_scales = nullptr;
    expect_bad(validate_mhc_post_pre(a), "x_next_scales");
    a = pp;
    a.x_scales = nullptr;
    expect_bad(validate_mhc_post_pre(a), "x_scales");
    a = pp;
    a.x_next_scales = scales.data();
    expect_bad(validate_mhc_post_pre(a), "x_next_scales");
    a = pp;
    a.x_next_scales = reinterpret_cast<uint8_t*>(scales2.data()) + 1;
    expect_bad(validate_mhc_post_pre(a), "x_next_scales");
    a = pp;
    a.residual = MhcResidual::kBf16;
    a.x_scales = nullptr;
    a.shape.batch = 0;
    expect_bad(validate_mhc_post_pre(a), "x_next_scales");
    a = pp;
    a.shape.hidden = 200;
    expect_bad(mhc_post_pre_cpu(a), "hidden");
  }
}

// mhc_expand onto the FP8 stream (spec §4.9): every stream of every token
// holds quantize_fp8_cpu's codes and scales of the embedding row (its 1 x 128
// rule on [B, C]), for n = 1..8, both scale formats.
TEST(MhcExpandFp8xCpu, EveryStreamIsQuantizeFp8OfTheEmbedding) {
  for (int n = 1; n <= kMhcMaxStreams; ++n)
    for (ScaleFormat f : kFormats) {
      Problem p = make_problem(5, n, 384, seed_for("fp8x_expand") + n);
      SCOPED_TRACE("seed " + std::to_string(p.seed) + " n " + std::to_string(n) + " " + fmt_name(f));
      p.f_out[7] = 0x7fc0;  // a NaN block: NaN scale, 0x7f codes
      Fp8X out = poisoned_fp8x({p.B, n, p.C}, f);
      MhcExpandArgs a;
      a.shape = {p.B, n, p.C};
      a.embedding = p.f_out.data();
      a.x = out.codes.data();
      a.x_scales = out.scales.data();
      a.residual = MhcResidual::kFp8E4m3;
      a.x_scale_format = f;
      Status s = mhc_expand_cpu(a);
      ASSERT_TRUE(s.ok()) << s.message();
      expect_every_stream_is_quantize_fp8_of(out, p.f_out, p.B, n, p.C);
    }
}

TEST(MhcExpandFp8xCpu, ValidationNamesItsArguments) {
  std::vector<uint16_t> emb(2 * 256, 0x3f80);
  std::vector<uint8_t> codes(2 * 4 * 256), scales(2 * 4 * 2 * 4);
  MhcExpandArgs good;
  good.shape = {2, 4, 256};
  good.embedding = emb.data();
  good.x = codes.data();
  good.x_scales = scales.data();
  good.residual = MhcResidual::kFp8E4m3;
  ASSERT_TRUE(validate_mhc_expand(good).ok());
  auto expect_bad = [](MhcExpandArgs a, const char* arg) {
    const Status s = validate_mhc_expand(a);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(std::string(": ") + arg + ": "), std::string::npos) << s.message();
  };
  MhcExpandArgs a = good;
  a.shape.hidden = 200;
  expect_bad(a, "hidden");
  a = good;
  a.x_scales = nullptr;
  expect_bad(a, "x_scales");
  a = good;
  a.x_scale_format = static_cast<ScaleFormat>(7);
  expect_bad(a, "x_scale_format");
  a = good;
  a.residual = MhcResidual::kBf16;  // scales given with the bf16 stream
  expect_bad(a, "x_scales");
  a = good;
  a.x_scales = codes.data() + 100;  // inside the codes
  expect_bad(a, "x_scales");
}

}  // namespace
}  // namespace flashmix
