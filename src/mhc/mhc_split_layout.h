// The workspace of the split projection (mhc_split.cu) for small batches:
// shared by the host size query/validation and the kernel's launcher, so the
// two agree byte for byte. Plain C++ (no CUDA).
//
//   [0, 256)                  the epoch word (at 0): the launches so far, mod 2^32
//   records [R][rec_stride]   8-byte words, one record per cluster of CTAs (per CTA
//                             without clusters): the cluster's partial sums, each
//                             word {float value (low half), tag (high half)}
// A record holds first the pre coefficients and the sum of squares of every
// token, [B][n+1] (the part every CTA reads), then the other coefficients,
// [B][N-n] (token b's part read by its owner). rec_stride is rounded up to
// whole 16-byte pairs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmix/mhc.h"

namespace flashmix::mhc_detail {

constexpr int kSplitMaxCtas = 256;     // at most this many CTAs, so records, per launch
constexpr size_t kSplitHeaderBytes = 256;

struct SplitWorkspaceLayout {
  int64_t rec_stride = 0;  // 8-byte words per record
  size_t rec_offset = 0, bytes = 0;
};

// records: the records of the launch (<= kSplitMaxCtas); num_coef: N (n for mhc_head).
inline SplitWorkspaceLayout split_workspace_layout(int64_t records, int64_t batch, int num_coef) {
  SplitWorkspaceLayout l;
  l.rec_stride = (batch * (num_coef + 1) + 1) / 2 * 2;
  l.rec_offset = kSplitHeaderBytes;
  l.bytes = l.rec_offset + size_t(records * l.rec_stride) * 8;
  return l;
}

// The workspace's second part: F_pre's scratch for the epilogue pass (2 B C
// bytes of bf16, mhc_epilogue_workspace_bytes), after the split kernel's
// part (mhc_workspace_bytes, 0 past kMhcSplitMaxBatch), 256-byte aligned.
inline size_t align_scratch(size_t bytes) { return (bytes + 255) / 256 * 256; }
inline size_t epilogue_scratch_offset(const MhcShape& s) { return align_scratch(mhc_workspace_bytes(s)); }

}  // namespace flashmix::mhc_detail
