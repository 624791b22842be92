// MXFP4 test data shared by the CPU and GPU tests (spec §13): random packed
// e2m1 bytes with ue8m0 scales shaped like a checkpoint's (a per-row level
// plus a small per-sub-block wobble), with optional rows far below their
// block's top (spreads past e4m3's exact range) and NaN scales.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/scoped_env.h"
#include "common/test_data.h"

namespace flashmix::testing {

// The MXFP4 GEMMs' kernel for the scope: the TMA + wgmma one, or decode by
// FLASHMIX_MX_DECODE (sm90_mx_decode.h), whose W4A8 runs on wgmma unless
// FLASHMIX_MX_DECODE_WG=0 pins the mma.sync kernel (W4A16 always runs there).
// The library reads both at each call. Restores the automatic choice after.
enum class MxKernel { kTma, kDecode, kDecodeMmaSync };
inline constexpr MxKernel kMxKernels[] = {MxKernel::kTma, MxKernel::kDecode, MxKernel::kDecodeMmaSync};
struct ScopedMxKernel {
  explicit ScopedMxKernel(MxKernel k)
      : decode("FLASHMIX_MX_DECODE", k == MxKernel::kTma ? "0" : "1"),
        wg("FLASHMIX_MX_DECODE_WG", k == MxKernel::kDecodeMmaSync ? "0" : "1") {}
  const ScopedEnv decode, wg;
};
inline const char* mx_kernel_name(MxKernel k) {
  return k == MxKernel::kTma ? "TMA kernel" : k == MxKernel::kDecode ? "decode kernel" : "decode kernel (mma.sync)";
}

struct Mxfp4Data {
  std::vector<uint8_t> w;       // packed [batch, rows, cols / 2]
  std::vector<uint8_t> scales;  // ue8m0 [batch, rows, cols / 32]
};

struct Mxfp4Options {
  int base = 120;          // scale byte around which the rows sit (2^-7)
  int row_wobble = 3;      // each row's level: base + [-row_wobble, row_wobble]
  int group_wobble = 2;    // each sub-block: its row's level - [0, group_wobble]
  int deep_row_every = 0;  // > 0: every such row sits 15..22 binades lower (inexact spreads)
  int nan_every = 0;       // > 0: about one sub-block in this many has the NaN scale 255
};

inline Mxfp4Data random_mxfp4(Rng& rng, int64_t batch, int64_t rows, int64_t cols, const Mxfp4Options& o = {}) {
  Mxfp4Data d;
  d.w.resize(size_t(batch * rows * cols / 2));
  d.scales.resize(size_t(batch * rows * cols / 32));
  for (uint8_t& b : d.w) b = uint8_t(rng.integer(0, 255));
  for (int64_t r = 0; r < batch * rows; ++r) {
    int level = o.base + int(rng.integer(-o.row_wobble, o.row_wobble));
    if (o.deep_row_every > 0 && r % o.deep_row_every == o.deep_row_every - 1) level -= int(rng.integer(15, 22));
    for (int64_t g = 0; g < cols / 32; ++g) {
      int s = std::clamp(level - int(rng.integer(0, o.group_wobble)), 0, 254);
      if (o.nan_every > 0 && rng.integer(0, o.nan_every - 1) == 0) s = 255;
      d.scales[size_t(r * (cols / 32) + g)] = uint8_t(s);
    }
  }
  return d;
}

}  // namespace flashmix::testing
