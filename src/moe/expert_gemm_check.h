// Host-side size rules shared by the grouped expert GEMMs (moe_fc1,
// moe_fc2_finalize): tokens, k, the GEMM's H and I, the local experts.
#pragma once

#include <cstdint>

#include "common/check.h"
#include "flashmix/moe_fc1.h"

namespace flashmix::detail {

inline Status validate_expert_gemm_sizes(const char* op, int64_t num_tokens, int k, int64_t hidden, int64_t inter,
                                         int num_experts_per_node) {
  FM_REQUIRE(num_tokens >= 0, op, "num_tokens", "must be >= 0 (got ", num_tokens, ")");
  FM_REQUIRE(k >= 1 && k <= 16, op, "k", "must be in [1, 16] (got ", k, ")");
  FM_REQUIRE(num_tokens <= kInt32Max / k, op, "num_tokens",
             "num_tokens * k overflows int32: slot indices j*T + t are int32 (T=", num_tokens, ", k=", k, ")");
  FM_REQUIRE(hidden >= 8 && hidden % 8 == 0, op, "hidden",
             "must be a positive multiple of 8 (16-byte rows for TMA; got ", hidden, ")");
  FM_REQUIRE(hidden <= kInt32Max, op, "hidden", "must fit in 32 bits (got ", hidden, ")");
  FM_REQUIRE(inter >= 8 && inter % 8 == 0, op, "inter",
             "must be a positive multiple of 8 (16-byte rows for TMA; got ", inter, ")");
  FM_REQUIRE(inter <= kInt32Max, op, "inter", "must fit in 32 bits (got ", inter, ")");
  FM_REQUIRE(num_experts_per_node >= 1 && num_experts_per_node <= 1024, op, "num_experts_per_node",
             "must be in [1, 1024] (got ", num_experts_per_node, ")");
  return Status::Ok();
}

// The weight format and, for MXFP4 (spec §13.7), its rules on the
// activations and on the GEMM's K (named k_name: "hidden" for FC1, "inter"
// for FC2). `mx` is set to whether the weights are MXFP4.
inline Status validate_expert_weight_format(const char* op, MoeWeightFormat weights, MoeFp8Scaling fp8, int64_t K,
                                            const char* k_name, bool* mx) {
  const int wf = int(weights);
  FM_REQUIRE(wf >= int(MoeWeightFormat::kDense) && wf <= int(MoeWeightFormat::kMxfp4), op, "weights",
             "unknown MoeWeightFormat value ", wf);
  *mx = weights == MoeWeightFormat::kMxfp4;
  if (!*mx) return Status::Ok();
  FM_REQUIRE(fp8 != MoeFp8Scaling::kTensor, op, "fp8",
             "weights = mxfp4 takes fp8 = block (W4A8) or none (W4A16), not tensor");
  FM_REQUIRE(K % 128 == 0, op, k_name,
             "must be a multiple of 128 with weights = mxfp4 (a ue8m0 scale per 32 of K, folded per 128; got ", K,
             ")");
  return Status::Ok();
}

}  // namespace flashmix::detail
