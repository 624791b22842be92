// The workspace of the split projection (mhc_split.cu) for small batches:
// shared by the host size query/validation and the kernel's launcher, so the
// two agree byte for byte. Plain C++ (no CUDA).
//
//   [0, 256)           the grid barrier's two words (arrivals, generation), zero when idle
//   pre  [G][B][n+1]   each CTA's partial sums of the pre coefficients and the sum of squares
//   rest [B][G][N-n]   each CTA's partial sums of the other coefficients (token-major: a
//                      token's owner reads one contiguous block)
// Both arrays start 16-byte aligned and are rounded up to whole 16-byte words,
// so they can be copied in 16-byte pieces.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmix::mhc_detail {

constexpr int kSplitMaxCtas = 256;  // the workspace is sized for this many CTAs
constexpr size_t kSplitHeaderBytes = 256;

inline int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

struct SplitWorkspaceLayout {
  int64_t pre_floats = 0;   // per array, rounded up to 4
  int64_t rest_floats = 0;  // per token, rounded up to 4
  size_t pre_offset = 0, rest_offset = 0, bytes = 0;
};

// ctas: the CTAs of the launch (<= kSplitMaxCtas); num_coef: N (n for mhc_head).
inline SplitWorkspaceLayout split_workspace_layout(int64_t ctas, int64_t batch, int n, int num_coef) {
  SplitWorkspaceLayout l;
  l.pre_floats = round_up4(ctas * batch * (n + 1));
  l.rest_floats = round_up4(ctas * (num_coef - n));
  l.pre_offset = kSplitHeaderBytes;
  l.rest_offset = l.pre_offset + size_t(l.pre_floats) * 4;
  l.bytes = l.rest_offset + size_t(batch * l.rest_floats) * 4;
  return l;
}

}  // namespace flashmix::mhc_detail
