// FC1's gated activations on the fp32 sums (spec §9.3), shared by the FC1
// kernels: act(g, u) before the one rounding. The clamps keep NaN
// (comparisons with NaN are false).
#pragma once

#include "flashmix/moe_fc1.h"

namespace flashmix {

//
// The quotient is __fdividef's (x times the approximate reciprocal, ~2 ulp)
// rather than the IEEE division's (an instruction sequence with a slow-path
// branch an element, in epilogues that run while the tensor pipe idles:
// 3-12 % of the prefill FC1 times, docs/moe_fc1.md); the result is rounded
// to bf16 (8 bits) anyway. Where the denominator 1 + exp(-z) passes 2^126
// (z = g, or alpha g for kSwiGLUOai: z below about -87.3) the quotient is 0
// instead of g / (1 + exp(-z)), at most |g| 2^-126 (about 2^-119.5 at
// z = g = -87.3; larger for kSwiGLUOai when alpha < 1), then times u: 0 times
// an infinite u gives NaN there where the division gave an infinity. NaN in
// g or u still gives NaN, and -inf / inf is NaN either way.
__device__ __forceinline__ float fc1_activate(int act, float limit, float alpha, float g, float u) {
  if (act == int(MoeActivation::kSwiGLU)) return __fdividef(g, 1.f + __expf(-g)) * u;
  const float L = limit;
  g = g > L ? L : g;
  u = u > L ? L : (u < -L ? -L : u);
  if (act == int(MoeActivation::kSwiGLUOai)) return __fdividef(g, 1.f + __expf(-alpha * g)) * (u + 1.f);
  return __fdividef(g, 1.f + __expf(-g)) * u;  // kSwiGLUClamped
}

}  // namespace flashmix
