// Internal to moe_forward (spec §10): where its intermediates lie in the
// workspace (byte offsets), so tests can read them back and check each stage.
#pragma once

#include <cstddef>

#include "flashmix/moe.h"

namespace flashmix {

struct MoeForwardLayout {
  size_t ids = 0, scales = 0, offsets = 0, p2u = 0, u2p = 0, maps_ws = 0, fc1_out = 0, fc2_ws = 0, x_perm = 0;
  // fp8 only: X (or its permuted copy) in e4m3 [T or k*T capacity, H] and its
  // fp32 scales [rows, H / 128]; FC1's output in e4m3 [k*T capacity, I] and
  // its fp32 scales [k*T capacity, I / 128] (first P rows written).
  size_t x_q = 0, x_scales = 0, act_q = 0, act_scales = 0;
  size_t maps_ws_bytes = 0, fc2_ws_bytes = 0, total = 0;
};

// The workspace layout moe_forward uses for these (valid) args.
MoeForwardLayout moe_forward_layout(const MoeForwardArgs& args);

}  // namespace flashmix
