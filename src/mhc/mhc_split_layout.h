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

// The workspace's second part, a scratch after the split kernel's part
// (mhc_workspace_bytes, 0 past kMhcSplitMaxBatch), 256-byte aligned: the
// plain F_pre for F_pre's epilogue pass (2 B C bytes,
// mhc_epilogue_workspace_bytes) or X_next for mhc_post_head's two launches
// (2 B n C bytes, mhc_post_head_workspace_bytes).
inline size_t align_scratch(size_t bytes) { return (bytes + 255) / 256 * 256; }
inline size_t workspace_scratch_offset(const MhcShape& s) { return align_scratch(mhc_workspace_bytes(s)); }

// A workspace size with a scratch of `scratch` bytes (0 for an invalid
// shape or B == 0, as mhc_workspace_bytes).
inline size_t workspace_bytes_with_scratch(const MhcShape& s, size_t scratch) {
  if (s.batch < 1 || s.n < 1 || s.n > kMhcMaxStreams || s.hidden < 8 || s.hidden % 8 != 0) return 0;
  return workspace_scratch_offset(s) + align_scratch(scratch);
}

// The scratch in the caller's workspace when it holds at least `need` bytes
// (a workspace_bytes_with_scratch size; 0: none), else null.
inline void* workspace_scratch(void* workspace, size_t bytes, size_t need, const MhcShape& s) {
  if (workspace == nullptr || need == 0 || bytes < need) return nullptr;
  return static_cast<char*>(workspace) + workspace_scratch_offset(s);
}

}  // namespace flashmix::mhc_detail
