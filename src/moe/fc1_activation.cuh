// FC1's gated activations on the fp32 sums (spec §9.3), shared by the FC1
// kernels: act(g, u) before the one rounding. The clamps keep NaN
// (comparisons with NaN are false).
#pragma once

#include "flashmix/moe_fc1.h"

namespace flashmix {

__device__ __forceinline__ float fc1_activate(int act, float limit, float alpha, float g, float u) {
  if (act == int(MoeActivation::kSwiGLU)) return g / (1.f + __expf(-g)) * u;
  const float L = limit;
  g = g > L ? L : g;
  u = u > L ? L : (u < -L ? -L : u);
  if (act == int(MoeActivation::kSwiGLUOai)) return g / (1.f + __expf(-alpha * g)) * (u + 1.f);
  return g / (1.f + __expf(-g)) * u;  // kSwiGLUClamped
}

}  // namespace flashmix
