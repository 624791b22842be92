// MoE routing maps: the launch plan, shared by the GPU launcher, the
// workspace-size query and the validation (so all three agree on the path).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmix/moe.h"

namespace flashmix::detail {

// One block ranks kRoutingThreads slots per step; a block keeps at most
// kRoutingMaxItems steps' expert ids in registers (a segment).
constexpr int kRoutingThreads = 512;
constexpr int kRoutingMaxItems = 16;
constexpr int64_t kRoutingMaxSegmentSlots = int64_t(kRoutingThreads) * kRoutingMaxItems;  // 8192
// One block costs about 1.3 us per 512-slot step, the three-launch path about
// 7 us in all for up to ~64K slots (H200, graph replays): they cross near 2048.
constexpr int kRoutingDefaultSingleBlockSlots = 2048;
constexpr int kRoutingMaxExperts = 1024;
// Segments are sized so that about this many blocks cover the slots (one wave on H100/H200).
constexpr int64_t kRoutingTargetSegments = 128;

// The multi path's scatter blocks scan the counts themselves (no scan
// launch) while the counts are at most this many: each block then reads them
// all (64 KB at most, in 16-byte loads of one expert's segments). H100: maps
// of k*T = 8192 slots 8.4-8.8 -> 5.0-5.8 us, EP rank (32 experts) at 65536
// slots 9.3 -> 7.8 us; 128 segments x 256 experts (32K counts) 13.5-14.0 ->
// 14.5-14.9 us: those keep the scan kernel.
constexpr int64_t kRoutingMaxScatterScanCounts = 16384;

struct MoeRoutingPlan {
  int64_t slots = 0;         // k*T
  bool single_block = true;  // one launch does count + scan + scatter
  int items = 1;             // steps of kRoutingThreads slots per segment
  int64_t num_segments = 0;  // blocks of the count and scatter kernels (multi path)
  // Multi path: the counts [E][segments_pad] (segments_pad = num_segments
  // rounded up to 4), scanned by each scatter block (two launches); else
  // [segments][E], scanned in place by the one-block scan kernel (three).
  bool scatter_scans = false;
  int64_t segments_pad = 0;
  size_t workspace_bytes = 0;
};

inline MoeRoutingPlan plan_moe_routing(const MoeRoutingArgs& a) {
  MoeRoutingPlan p;
  p.slots = a.num_tokens * int64_t(a.k);
  int64_t threshold = a.tuning.single_block_max_slots == 0 ? kRoutingDefaultSingleBlockSlots
                                                           : int64_t(a.tuning.single_block_max_slots);
  if (threshold > kRoutingMaxSegmentSlots) threshold = kRoutingMaxSegmentSlots;
  p.single_block = p.slots <= threshold;  // threshold -1: never
  if (p.single_block) {
    p.items = int((p.slots + kRoutingThreads - 1) / kRoutingThreads);
    if (p.items < 1) p.items = 1;
    p.num_segments = 1;
    return p;
  }
  const int64_t step = kRoutingThreads;
  int64_t items = (p.slots + step * kRoutingTargetSegments - 1) / (step * kRoutingTargetSegments);
  p.items = int(items < 1 ? 1 : items > kRoutingMaxItems ? kRoutingMaxItems : items);
  const int64_t seg = step * p.items;
  p.num_segments = (p.slots + seg - 1) / seg;
  p.segments_pad = (p.num_segments + 3) & ~int64_t(3);
  p.scatter_scans = p.segments_pad * a.num_experts_per_node <= kRoutingMaxScatterScanCounts;
  // Per-segment per-expert counts (room for either layout); 256 bytes of
  // slack to align the caller's pointer.
  p.workspace_bytes = size_t(p.segments_pad) * size_t(a.num_experts_per_node) * sizeof(int32_t) + 256;
  return p;
}

// moe_forward's glue, done by the maps' kernels on the way: zero the
// layer's output rows for FC2's atomic adds, so no memset runs between FC1
// and FC2, and pull the input rows FC1 gathers into L2 (they are read there
// from DRAM otherwise: the layer's X is whatever the caller last wrote);
// on the single-block path (decode) also quantise X for the FP8 layers, so
// no quantize_fp8 launch runs before FC1. Memory traffic that the count
// kernel, bound by its latency, has room for (multi-block path: its blocks
// past the segments and the count blocks; single-block path: blocks of their
// own beside the one that builds the maps, min_blocks - 1 of them).
// before_wait: done ahead of the count kernel's dependency wait, i.e. while
// the previous kernel finishes. Only where that kernel is the layer's own
// router, which lets no dependent start before it exits (so every earlier
// kernel on the stream is done, and nothing still reads `zero` or writes
// `prefetch`); otherwise after the wait.
struct RoutingSideWork {
  void* zero = nullptr;  // rows of zero_row_bytes (a multiple of 16), 16-byte aligned, zero_stride_bytes apart
  int64_t zero_rows = 0, zero_row_bytes = 0, zero_stride_bytes = 0;
  // With zero_ids ([zero_rows, zero_k] expert ids): only the rows of tokens
  // with an id in [zero_lo, zero_lo + zero_n), a warp a row, a lane an id
  // (zero_k <= 32; the layer's k <= 16) (FC2's kAtomic without fill). The
  // ids may come from the kernel ahead: not with before_wait.
  const int32_t* zero_ids = nullptr;
  int zero_k = 0, zero_lo = 0, zero_n = 0;
  const void* prefetch = nullptr;  // rows of prefetch_row_bytes, prefetch_stride_bytes apart
  int64_t prefetch_rows = 0, prefetch_row_bytes = 0, prefetch_stride_bytes = 0;
  // Single-block path only: bf16 rows [quant_rows, quant_cols] (quant_x_stride
  // elements apart, 16-byte aligned) into e4m3 (quant_q_stride bytes apart)
  // with 1 x 128 fp32 scales [quant_rows, quant_cols / 128]: quantize_fp8's
  // result bit for bit (the same team-of-four-lanes code).
  const void* quant_x = nullptr;
  int64_t quant_x_stride = 0, quant_rows = 0, quant_cols = 0, quant_q_stride = 0;
  void* quant_q = nullptr;
  float* quant_scales = nullptr;
  bool before_wait = false;
  // The count kernel's grid is at least this many blocks (those past its
  // segments do the side work alone): the segments are few on small
  // batches (16 at k*T = 8192), too few to move the bytes at speed.
  int min_blocks = 0;
};

// build_moe_routing_maps (validated by the caller) with the side work.
Status build_moe_routing_maps_with(const MoeRoutingArgs& args, const RoutingSideWork& side, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace flashmix::detail

namespace flashmix {
// validate_moe_routing_maps with check_buffers = false checks the sizes only
// (the workspace size query, and moe_forward before its workspace exists).
Status validate_routing(const MoeRoutingArgs& a, bool check_buffers);
}  // namespace flashmix
