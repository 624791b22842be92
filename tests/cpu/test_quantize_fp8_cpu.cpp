// quantize_fp8: the host e4m3 / ue8m0 helpers (src/common/host_fp8.h)
// against hand-worked values and a brute-force rounding, the CPU reference
// on blocks worked out by hand (spec §11.3, §12), and every rule of the
// shared validation (spec §12.4). The GPU tests check the kernels against
// this reference bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fp8_testing.h"
#include "common/host_fp8.h"
#include "flashmix/fp8.h"

using namespace flashmix;
using namespace flashmix::testing;
using flashmix::host::bf16_to_float;
using flashmix::host::e4m3_to_float;
using flashmix::host::float_to_bf16;
using flashmix::host::float_to_e4m3;
using flashmix::host::ue8m0_byte_at_least;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

}  // namespace

// ---------------------------------------------------------------------------
// host e4m3 / ue8m0 (spec §11.1, §11.2)
// ---------------------------------------------------------------------------

TEST(HostFp8, E4m3DecodesTheFormat) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x39), 1.125f);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_EQ(e4m3_to_float(0x77), 240.0f);  // exp 14, mant 7: 1.875 * 128
}

TEST(HostFp8, E4m3EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(b))), b) << "byte " << b;
}

TEST(HostFp8, E4m3SaturatesAt448) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(463.9f), 0x7e);  // nearest is 448 anyway
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // the tie with 480 (which would be NaN) saturates
  EXPECT_EQ(float_to_e4m3(500.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(kInf), 0x7e);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3(-449.0f), 0xfe);
}

TEST(HostFp8, E4m3TiesGoToTheEvenMantissa) {
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);   // between 1 (0x38) and 1.125 (0x39): down to even
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);   // between 1.125 (0x39) and 1.25 (0x3a): up to even
  EXPECT_EQ(float_to_e4m3(-1.1875f), 0xba);
  EXPECT_EQ(float_to_e4m3(1.0625001f), 0x39);  // just above the tie: up
  EXPECT_EQ(float_to_e4m3(1.9375f), 0x40);   // between 1.875 and 2: up to 2 (carries into the exponent)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);      // between 0 and 2^-9: down to 0
  EXPECT_EQ(float_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);  // between 2^-9 and 2^-8: up to even
  EXPECT_EQ(float_to_e4m3(15 * std::ldexp(1.0f, -10)), 0x08); // between 7 * 2^-9 and 2^-6: up to the smallest normal
  EXPECT_EQ(float_to_e4m3(-std::ldexp(1.0f, -11)), 0x80);     // rounds to zero, keeps the sign
  EXPECT_EQ(float_to_e4m3(240.0f + 8.0f), 0x78);  // between 240 and 256: up to even (256, 0x78)
}

TEST(HostFp8, E4m3NaNStaysNaN) {
  EXPECT_EQ(float_to_e4m3(kNaN), 0x7f);
  EXPECT_EQ(float_to_e4m3(-kNaN), 0xff);
}

// Every midpoint between neighbours, its float neighbours and a spread of
// random floats: the encoder against a brute-force nearest search.
TEST(HostFp8, E4m3MatchesBruteForceRounding) {
  std::vector<float> values;
  for (int b = 0; b < 0x7e; ++b) {
    const float mid = 0.5f * (e4m3_to_float(uint8_t(b)) + e4m3_to_float(uint8_t(b + 1)));  // exact in fp32
    values.push_back(mid);
    values.push_back(std::nextafter(mid, 0.0f));
    values.push_back(std::nextafter(mid, kInf));
  }
  Rng rng(test_seed());
  for (int i = 0; i < 20000; ++i) values.push_back(std::ldexp(rng.uniform(0.5f, 1.0f), int(rng.integer(-30, 12))));
  for (int i = 0; i < 2000; ++i) values.push_back(std::ldexp(rng.uniform(0.5f, 1.0f), int(rng.integer(-149, -120))));
  for (float v : values)
    for (float s : {v, -v}) EXPECT_EQ(float_to_e4m3(s), brute_force_e4m3(s)) << "value " << s;
}

TEST(HostFp8, Ue8m0IsTheNextPowerOfTwoClamped) {
  EXPECT_EQ(ue8m0_byte_at_least(1.0f), 127);
  EXPECT_EQ(ue8m0_byte_at_least(1.0000001f), 128);
  EXPECT_EQ(ue8m0_byte_at_least(1.5f), 128);
  EXPECT_EQ(ue8m0_byte_at_least(2.0f), 128);
  EXPECT_EQ(ue8m0_byte_at_least(0.75f), 127);
  EXPECT_EQ(ue8m0_byte_at_least(0.5f), 126);
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.0f, -126)), 1);
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.0f, -127)), 0);           // subnormal power of two
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.5f, -127)), 1);           // subnormal: up to 2^-126
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.0f, -140)), 0);           // clamped at 2^-127
  EXPECT_EQ(ue8m0_byte_at_least(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(ue8m0_byte_at_least(std::ldexp(1.5f, 127)), 254);          // clamped at 2^127
  EXPECT_EQ(ue8m0_byte_at_least(kInf), 254);
  EXPECT_EQ(host::ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(host::ue8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(host::ue8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(host::ue8m0_to_float(255)));
}

// ---------------------------------------------------------------------------
// quantize_fp8_cpu (spec §11.3, §12)
// ---------------------------------------------------------------------------

namespace {

// One quantize_fp8_cpu call on host buffers: x dense [batch, rows, cols]
// (given as floats, stored as bf16), q and scales poisoned first.
struct Quant {
  std::vector<uint16_t> x;
  std::vector<uint8_t> q;
  std::vector<uint8_t> scales;  // raw bytes of the scale tensor
  QuantizeFp8Args args;

  Quant(int64_t batch, int64_t rows, int64_t cols, Fp8Block block, ScaleFormat format) {
    x.assign(size_t(batch * rows * cols), float_to_bf16(0.0f));
    args.batch = batch;
    args.rows = rows;
    args.cols = cols;
    args.block = block;
    args.scale_format = format;
  }
  void set(int64_t i, float v) { x[size_t(i)] = float_to_bf16(v); }
  Status run() {
    const int64_t br = fp8_block_rows(args.block);
    const int64_t n_scales = args.batch * ((args.rows + br - 1) / br) * (args.cols / 128);
    q.assign(x.size(), 0xa5);
    scales.assign(size_t(n_scales) * (args.scale_format == ScaleFormat::kUE8M0 ? 1 : 4), 0xa5);
    args.x = x.data();
    args.q = q.data();
    args.scales = scales.data();
    return quantize_fp8_cpu(args);
  }
  float scale_f32(int64_t i) const {
    float s;
    std::memcpy(&s, scales.data() + 4 * i, 4);
    return s;
  }
};

}  // namespace

// amax 896 gives s = 2 exactly: every q is x / 2 rounded, worked by hand.
TEST(QuantizeFp8Cpu, OneBlockByHand) {
  Quant t(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kFloat32);
  t.set(0, 896.0f);
  t.set(1, -1.0f);
  t.set(2, 3.0f);
  t.set(3, 2.125f);  // / 2 = 1.0625: the tie between 1 and 1.125 goes to 1
  t.set(4, 2.375f);  // / 2 = 1.1875: the tie between 1.125 and 1.25 goes to 1.25
  t.set(5, -896.0f);
  ASSERT_TRUE(t.run().ok());
  EXPECT_EQ(t.scale_f32(0), 2.0f);
  EXPECT_EQ(t.q[0], 0x7e);
  EXPECT_EQ(t.q[1], 0xb0);  // -0.5
  EXPECT_EQ(t.q[2], 0x3c);  // 1.5
  EXPECT_EQ(t.q[3], 0x38);
  EXPECT_EQ(t.q[4], 0x3a);
  EXPECT_EQ(t.q[5], 0xfe);
  for (int c = 6; c < 128; ++c) EXPECT_EQ(t.q[c], 0x00) << c;
}

// kFloat32: the block's largest element maps to +-448 exactly (s = amax / 448
// rounded, then saturation); every element within half an e4m3 step.
TEST(QuantizeFp8Cpu, Float32ScaleMapsTheLargestElementTo448) {
  Rng rng(test_seed());
  const int64_t rows = 37, cols = 512;
  Quant t(1, rows, cols, Fp8Block::k1x128, ScaleFormat::kFloat32);
  t.x = random_fp8_input(rng, 1, rows, cols, cols, rows * cols);
  ASSERT_TRUE(t.run().ok());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t cb = 0; cb < cols / 128; ++cb) {
      const float s = t.scale_f32(r * (cols / 128) + cb);
      float amax = 0;
      int64_t at = 0;
      for (int64_t c = cb * 128; c < cb * 128 + 128; ++c)
        if (std::fabs(bf16_to_float(t.x[r * cols + c])) > amax) {
          amax = std::fabs(bf16_to_float(t.x[r * cols + c]));
          at = r * cols + c;
        }
      if (amax == 0) {
        EXPECT_EQ(s, 1.0f);
        continue;
      }
      EXPECT_EQ(s, amax / 448.0f);
      EXPECT_EQ(t.q[at] & 0x7f, 0x7e) << "row " << r << " block " << cb;
      for (int64_t c = cb * 128; c < cb * 128 + 128; ++c) {
        const float x = bf16_to_float(t.x[r * cols + c]), d = e4m3_to_float(t.q[r * cols + c]) * s;
        // Half a step of e4m3 (3 mantissa bits: 2^-4 relative), or of its
        // subnormals (2^-10 * s), plus the fp32 roundings of s and x / s.
        EXPECT_LE(std::fabs(d - x), std::fabs(x) * (0.0625f + 1e-6f) + std::ldexp(s, -10)) << "x " << x;
      }
    }
}

TEST(QuantizeFp8Cpu, ZeroBlockHasScaleOne) {
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    Quant t(1, 2, 256, Fp8Block::k1x128, f);
    t.set(1, -0.0f);
    t.set(200, 5.0f);  // the row's second block is not zero
    ASSERT_TRUE(t.run().ok());
    if (f == ScaleFormat::kFloat32) EXPECT_EQ(t.scale_f32(0), 1.0f);
    else EXPECT_EQ(t.scales[0], 127);
    EXPECT_EQ(t.q[0], 0x00);
    EXPECT_EQ(t.q[1], 0x80);  // -0 keeps its sign
    for (int c = 256; c < 512; ++c) EXPECT_EQ(t.q[c], 0x00);  // row 1: all zero
    if (f == ScaleFormat::kFloat32) EXPECT_EQ(t.scale_f32(2), 1.0f);
    else EXPECT_EQ(t.scales[2], 127);
  }
}

// kUE8M0: s is the smallest power of two >= amax / 448.
TEST(QuantizeFp8Cpu, Ue8m0RoundsTheExponentUp) {
  struct Want {
    float amax;
    int byte;
  };
  const Want cases[] = {{448.0f, 127}, {450.0f, 128}, {224.0f, 126}, {300.0f, 127}, {1.0f, 127 - 8},
                        {0.875f, 127 - 9}, {std::ldexp(1.0f, 100), 127 + 92}, {std::ldexp(1.0f, -130), 0}};
  for (const Want& w : cases) {
    Quant t(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kUE8M0);
    t.set(7, -w.amax);
    t.set(8, w.amax / 4);
    ASSERT_TRUE(t.run().ok());
    EXPECT_EQ(t.scales[0], w.byte) << "amax " << w.amax;
    const float s = host::ue8m0_to_float(t.scales[0]);
    EXPECT_EQ(t.q[7], float_to_e4m3(-w.amax / s)) << "amax " << w.amax;
    EXPECT_EQ(t.q[8], float_to_e4m3(w.amax / 4 / s));
    // The largest element lands in [224, 448] (before rounding, in (224, 448])
    // unless the exponent was clamped.
    if (w.byte > 0) EXPECT_GE(std::fabs(e4m3_to_float(t.q[7])), 224.0f) << "amax " << w.amax;
  }
  // 450 / 2 = 225 rounds to 224 (spacing 16 in [128, 256)).
  Quant t(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kUE8M0);
  t.set(0, 450.0f);
  ASSERT_TRUE(t.run().ok());
  EXPECT_EQ(e4m3_to_float(t.q[0]), 224.0f);
}

TEST(QuantizeFp8Cpu, NaNMakesTheBlockScaleNaNAndLeavesOtherBlocks) {
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0})
    for (Fp8Block blk : {Fp8Block::k1x128, Fp8Block::k128x128}) {
      Quant t(1, 3, 256, blk, f);
      for (int64_t i = 0; i < 3 * 256; ++i) t.set(i, float(i % 7) - 3.0f);
      t.set(256 + 5, kNaN);  // row 1, first column block
      ASSERT_TRUE(t.run().ok());
      const int64_t nan_block = blk == Fp8Block::k1x128 ? 2 : 0;  // row 1 block 0, or the tile [0:3, 0:128]
      if (f == ScaleFormat::kFloat32) {
        EXPECT_EQ(bits_of(t.scale_f32(nan_block)), 0x7fc00000u);
        EXPECT_EQ(t.scale_f32(nan_block + 1), 3.0f / 448.0f);
      } else {
        EXPECT_EQ(t.scales[nan_block], 255);
        EXPECT_EQ(t.scales[nan_block + 1], ue8m0_byte_at_least(3.0f / 448.0f));
      }
      for (int64_t r = 0; r < 3; ++r)
        for (int64_t c = 0; c < 256; ++c) {
          const bool in_nan_block = c < 128 && (blk == Fp8Block::k128x128 || r == 1);
          if (in_nan_block) EXPECT_EQ(t.q[r * 256 + c], 0x7f);
          else EXPECT_FALSE(std::isnan(e4m3_to_float(t.q[r * 256 + c])));
        }
    }
}

// An infinite element: kFloat32 s = inf, so finite elements give +-0 and the
// infinite ones inf / inf = NaN (the byte 0x7f); kUE8M0 clamps s at 2^127
// and the infinite element saturates.
TEST(QuantizeFp8Cpu, InfinityFollowsTheFormulas) {
  Quant f(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kFloat32);
  f.set(0, -kInf);
  f.set(1, 2.0f);
  f.set(2, -2.0f);
  ASSERT_TRUE(f.run().ok());
  EXPECT_EQ(f.scale_f32(0), kInf);
  EXPECT_EQ(f.q[0], 0x7f);
  EXPECT_EQ(f.q[1], 0x00);
  EXPECT_EQ(f.q[2], 0x80);
  Quant u(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kUE8M0);
  u.set(0, -kInf);
  u.set(1, std::ldexp(1.0f, 127));
  ASSERT_TRUE(u.run().ok());
  EXPECT_EQ(u.scales[0], 254);
  EXPECT_EQ(u.q[0], 0xfe);
  EXPECT_EQ(u.q[1], 0x38);  // 2^127 / 2^127 = 1
}

// Subnormal bf16 inputs: s = amax / 448 is an fp32 subnormal, still exact
// IEEE arithmetic (no flush to zero).
TEST(QuantizeFp8Cpu, SubnormalInputsAreNotFlushed) {
  Quant t(1, 1, 128, Fp8Block::k1x128, ScaleFormat::kFloat32);
  const float tiny = bf16_to_float(0x0003);  // 3 * 2^-133
  t.set(0, tiny);
  t.set(1, -tiny / 3);
  ASSERT_TRUE(t.run().ok());
  EXPECT_EQ(t.scale_f32(0), tiny / 448.0f);
  EXPECT_GT(t.scale_f32(0), 0.0f);
  EXPECT_EQ(t.q[0], float_to_e4m3(tiny / (tiny / 448.0f)));
  EXPECT_EQ(t.q[1], float_to_e4m3(-(tiny / 3) / (tiny / 448.0f)));
  EXPECT_EQ(e4m3_to_float(t.q[0]), 448.0f);
}

// A 128 x 128 tile's scale is the largest of its rows' 1 x 128 scales
// (s = amax / 448 is monotone), for a full and a partial row block.
TEST(QuantizeFp8Cpu, TileScaleIsTheLargestRowScale) {
  Rng rng(test_seed());
  const int64_t rows = 200, cols = 384;
  std::vector<uint16_t> x = random_fp8_input(rng, 1, rows, cols, cols, rows * cols);
  Quant rowwise(1, rows, cols, Fp8Block::k1x128, ScaleFormat::kFloat32), tiled(1, rows, cols, Fp8Block::k128x128,
                                                                             ScaleFormat::kFloat32);
  rowwise.x = tiled.x = x;
  ASSERT_TRUE(rowwise.run().ok());
  ASSERT_TRUE(tiled.run().ok());
  for (int64_t rb = 0; rb < 2; ++rb)
    for (int64_t cb = 0; cb < 3; ++cb) {
      float m = 0;  // the largest scale of a row block that is not all zero (those have s = 1)
      for (int64_t r = rb * 128; r < std::min<int64_t>(rows, rb * 128 + 128); ++r) {
        bool zero = true;
        for (int64_t c = cb * 128; c < cb * 128 + 128; ++c) zero = zero && bf16_to_float(x[r * cols + c]) == 0.0f;
        if (!zero) m = std::max(m, rowwise.scale_f32(r * 3 + cb));
      }
      EXPECT_EQ(tiled.scale_f32(rb * 3 + cb), m == 0 ? 1.0f : m) << "tile " << rb << ", " << cb;
    }
}

// Blocks never cross matrices: a batch [E, N, K] with N % 128 != 0 gives
// each expert exactly what quantising it alone gives.
TEST(QuantizeFp8Cpu, BatchedWeightsEqualEachExpertAlone) {
  Rng rng(test_seed());
  const int64_t E = 3, N = 130, K = 256;
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    Quant all(E, N, K, Fp8Block::k128x128, f);
    all.x = random_fp8_input(rng, E, N, K, K, N * K);
    ASSERT_TRUE(all.run().ok());
    const size_t sb = f == ScaleFormat::kUE8M0 ? 1 : 4, per_expert_scales = 2 * 2 * sb;
    ASSERT_EQ(all.scales.size(), E * per_expert_scales);
    for (int64_t e = 0; e < E; ++e) {
      Quant one(1, N, K, Fp8Block::k128x128, f);
      one.x.assign(all.x.begin() + e * N * K, all.x.begin() + (e + 1) * N * K);
      ASSERT_TRUE(one.run().ok());
      EXPECT_TRUE(std::equal(one.q.begin(), one.q.end(), all.q.begin() + e * N * K)) << "expert " << e;
      EXPECT_TRUE(std::equal(one.scales.begin(), one.scales.end(), all.scales.begin() + e * per_expert_scales))
          << "expert " << e;
    }
  }
}

// Strided rows and matrices: only the [rows, cols] elements are read
// (padding holds NaN) or written (padding keeps its poison).
TEST(QuantizeFp8Cpu, StridesLeavePaddingUntouched) {
  Rng rng(test_seed());
  const int64_t E = 2, N = 5, K = 128, xs = 136, xbs = 6 * 136, qs = 140, qbs = 5 * 140 + 3;
  std::vector<uint16_t> x = random_fp8_input(rng, E, N, K, xs, xbs);
  std::vector<uint8_t> q(size_t((E - 1) * qbs + (N - 1) * qs + K + 9), 0xa5), scales(E * N * 4, 0xa5);
  QuantizeFp8Args a;
  a.x = x.data();
  a.x_stride = xs;
  a.x_batch_stride = xbs;
  a.q = q.data();
  a.q_stride = qs;
  a.q_batch_stride = qbs;
  a.scales = scales.data();
  a.batch = E;
  a.rows = N;
  a.cols = K;
  ASSERT_TRUE(quantize_fp8_cpu(a).ok());
  for (int64_t i = 0; i < int64_t(q.size()); ++i) {
    const int64_t e = i / qbs, r = (i % qbs) / qs, c = (i % qbs) % qs;
    const bool inside = e < E && r < N && c < K;
    if (!inside) {
      EXPECT_EQ(q[i], 0xa5) << "padding byte " << i << " written";
    } else {
      const float s = [&] { float f; std::memcpy(&f, scales.data() + 4 * (e * N + r), 4); return f; }();
      EXPECT_EQ(q[i], float_to_e4m3(bf16_to_float(x[e * xbs + r * xs + c]) / s)) << "element " << i;
      EXPECT_FALSE(std::isnan(s));
    }
  }
}

TEST(QuantizeFp8Cpu, ZeroRowsOrBatchWriteNothing) {
  for (int64_t batch : {0, 2})
    for (int64_t rows : {0, 3}) {
      if (batch && rows) continue;
      QuantizeFp8Args a;
      a.batch = batch;
      a.rows = rows;
      a.cols = 256;
      EXPECT_TRUE(quantize_fp8_cpu(a).ok()) << "null pointers are fine without work";
    }
}

TEST(QuantizeFp8Cpu, EnumNamesRoundTrip) {
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    ScaleFormat g = ScaleFormat(9);
    EXPECT_TRUE(parse_scale_format(to_string(f), &g));
    EXPECT_EQ(g, f);
  }
  for (Fp8Block b : {Fp8Block::k1x128, Fp8Block::k128x128}) {
    Fp8Block g = Fp8Block(9);
    EXPECT_TRUE(parse_fp8_block(to_string(b), &g));
    EXPECT_EQ(g, b);
  }
  ScaleFormat f = ScaleFormat::kUE8M0;
  EXPECT_FALSE(parse_scale_format("fp32", &f));
  EXPECT_FALSE(parse_scale_format(nullptr, &f));
  EXPECT_EQ(f, ScaleFormat::kUE8M0);
  Fp8Block b = Fp8Block::k128x128;
  EXPECT_FALSE(parse_fp8_block("128", &b));
  EXPECT_EQ(b, Fp8Block::k128x128);
  EXPECT_STREQ(to_string(ScaleFormat::kUE8M0), "ue8m0");
  EXPECT_STREQ(to_string(Fp8Block::k128x128), "128x128");
  EXPECT_EQ(fp8_block_rows(Fp8Block::k1x128), 1);
  EXPECT_EQ(fp8_block_rows(Fp8Block::k128x128), 128);
}

// spec §12.4: every rule, by the argument it names; nothing is written.
TEST(QuantizeFp8CpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  std::vector<uint16_t> x(4 * 256 + 8, float_to_bf16(1.0f));
  std::vector<uint8_t> q(4 * 256 + 8, 0xa5), scales(64, 0xa5);
  QuantizeFp8Args good;
  good.x = x.data();
  good.q = q.data();
  good.scales = scales.data();
  good.batch = 2;
  good.rows = 2;
  good.cols = 256;
  ASSERT_TRUE(quantize_fp8_cpu(good).ok());
  std::fill(q.begin(), q.end(), 0xa5);
  std::fill(scales.begin(), scales.end(), 0xa5);
  struct Bad {
    const char* argument;
    void (*mutate)(QuantizeFp8Args&);
  };
  const Bad bad[] = {
      {"batch", [](QuantizeFp8Args& a) { a.batch = -1; }},
      {"rows", [](QuantizeFp8Args& a) { a.rows = -2; }},
      {"cols", [](QuantizeFp8Args& a) { a.cols = 0; }},
      {"cols", [](QuantizeFp8Args& a) { a.cols = 200; }},
      {"cols", [](QuantizeFp8Args& a) { a.cols = int64_t(1) << 32; }},
      {"block", [](QuantizeFp8Args& a) { a.block = Fp8Block(7); }},
      {"scale_format", [](QuantizeFp8Args& a) { a.scale_format = ScaleFormat(-1); }},
      {"x_stride", [](QuantizeFp8Args& a) { a.x_stride = -1; }},
      {"x_stride", [](QuantizeFp8Args& a) { a.x_stride = 255; }},
      {"q_stride", [](QuantizeFp8Args& a) { a.q_stride = 128; }},
      {"x_batch_stride", [](QuantizeFp8Args& a) { a.x_batch_stride = 511; }},
      {"q_batch_stride", [](QuantizeFp8Args& a) { a.q_batch_stride = -4; }},
      {"q_batch_stride", [](QuantizeFp8Args& a) { a.q_batch_stride = 300; }},
      {"rows", [](QuantizeFp8Args& a) { a.rows = int64_t(1) << 31; }},
      {"rows", [](QuantizeFp8Args& a) { a.rows = int64_t(1) << 20; a.cols = int64_t(1) << 20; }},
      {"x_stride", [](QuantizeFp8Args& a) { a.x_stride = int64_t(1) << 60; }},
      {"x", [](QuantizeFp8Args& a) { a.x = nullptr; }},
      {"q", [](QuantizeFp8Args& a) { a.q = nullptr; }},
      {"scales", [](QuantizeFp8Args& a) { a.scales = nullptr; }},
      {"x", [](QuantizeFp8Args& a) { a.x = static_cast<const char*>(a.x) + 1; }},
      {"scales", [](QuantizeFp8Args& a) { a.scales = static_cast<char*>(a.scales) + 2; }},
      {"q", [](QuantizeFp8Args& a) { a.q = const_cast<void*>(a.x); }},
      {"scales", [](QuantizeFp8Args& a) { a.scales = static_cast<char*>(a.q) + 16; }},
  };
  for (const Bad& b : bad) {
    QuantizeFp8Args a = good;
    b.mutate(a);
    const Status st = quantize_fp8_cpu(a);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_EQ(st.message().rfind(std::string("quantize_fp8: ") + b.argument + ": ", 0), 0u) << st.message();
    EXPECT_EQ(validate_quantize_fp8(a).message(), st.message());
  }
  for (uint8_t v : q) EXPECT_EQ(v, 0xa5);
  for (uint8_t v : scales) EXPECT_EQ(v, 0xa5);
  // ue8m0 scales are bytes: any address will do.
  QuantizeFp8Args a = good;
  a.scale_format = ScaleFormat::kUE8M0;
  a.scales = scales.data() + 1;
  EXPECT_TRUE(validate_quantize_fp8(a).ok());
}
