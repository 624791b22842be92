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

#include "flashmix/mhc.h"

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

// The workspace of the streamed projection (sm90_mhc_stream.cu) for larger
// batches (B > kMhcSplitMaxBatch, n = 4, C a multiple of 64): one CTA per
// 64-column slice (G = C / 64), X in chunks of kStreamChunk tokens.
//
//   [0, 256)                 the exit counter (zero when idle)
//   released [chunks] u32    per chunk: owners done with the chunk's records
//   hpre  [B][4]             H_pre of every token, encoded (never 0 once written)
//   part  [kStreamSlots][kStreamChunk][G][kStreamRecord]  each CTA's partial sums (a
//         ring), encoded: [pre 0-3][sum of squares, 3 unused][coefficients 4..23]
// A written word is never 0 (see sm90_mhc_stream.cu), so readers poll the data
// itself; owners zero the records they read, the last CTA to leave zeroes
// hpre and the counters: every launch leaves the workspace as it found it.
constexpr int kStreamChunk = 64;   // tokens per chunk
constexpr int kStreamSlots = 10;   // chunks whose records may be in flight
constexpr int kStreamRecord = 28;  // floats per (token, CTA) record (n = 4: 24 coefficients + the sum of squares)
constexpr int kStreamMaxCtas = 256;

// The shapes the streamed projection takes (with a workspace; it also
// needs C / 64 CTAs resident at once, checked at launch).
inline bool stream_takes_shape(int64_t batch, int n, int64_t hidden) {
  return n == 4 && batch > kMhcSplitMaxBatch && hidden % 64 == 0 && hidden / 64 <= kStreamMaxCtas;
}

struct StreamWorkspaceLayout {
  int64_t chunks = 0;
  size_t released_offset = 0, hpre_offset = 0, part_offset = 0, bytes = 0;
};

inline StreamWorkspaceLayout stream_workspace_layout(int64_t ctas, int64_t batch) {
  StreamWorkspaceLayout l;
  l.chunks = (batch + kStreamChunk - 1) / kStreamChunk;
  l.released_offset = kSplitHeaderBytes;
  l.hpre_offset = l.released_offset + size_t(round_up4(l.chunks)) * 4;
  l.part_offset = l.hpre_offset + size_t(batch) * 4 * 4;
  l.bytes = l.part_offset + size_t(kStreamSlots) * kStreamChunk * size_t(ctas) * kStreamRecord * 4;
  return l;
}

}  // namespace flashmix::mhc_detail
