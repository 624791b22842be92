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

struct MoeRoutingPlan {
  int64_t slots = 0;         // k*T
  bool single_block = true;  // one launch does count + scan + scatter
  int items = 1;             // steps of kRoutingThreads slots per segment
  int64_t num_segments = 0;  // blocks of the count and scatter kernels (multi path)
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
  // Per-segment per-expert counts, scanned in place into per-segment bases;
  // 256 bytes of slack to align the caller's pointer.
  p.workspace_bytes = size_t(p.num_segments) * size_t(a.num_experts_per_node) * sizeof(int32_t) + 256;
  return p;
}

}  // namespace flashmix::detail

namespace flashmix {
// validate_moe_routing_maps with check_buffers = false checks the sizes only
// (the workspace size query, and moe_forward before its workspace exists).
Status validate_routing(const MoeRoutingArgs& a, bool check_buffers);
}  // namespace flashmix
