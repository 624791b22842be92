// flashmix: the MoE router (SPEC §8): router logits [T, E] -> the k chosen
// experts of each token and their weights, in TensorRT-LLM's layout
// (token_selected_experts int32 [T, k], token_final_scales fp32 [T, k]).
// Included from flashmix/moe.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/dtype.h"
#include "flashmix/status.h"

namespace flashmix {

// How an expert's score s is computed from its logit l, and what its weight is.
enum class MoeRouterScoring : int {
  kSoftmax = 0,           // s = softmax over the E logits (Mixtral, Qwen3-MoE)
  kSigmoid = 1,           // s = 1 / (1 + exp(-l))  (DeepSeek-V3 noaux_tc)
  kSqrtSoftplus = 2,      // s = sqrt(log(1 + exp(l)))  (DeepSeek-V4)
  kSoftmaxAfterTopk = 3,  // top-k on the logits, then softmax over the k chosen (gpt-oss)
};

// Which selection algorithm runs (results are identical); 0 = automatic.
struct MoeRouterTuning {
  // 0 automatic; 1 k rounds of a team-wide arg-max; 2 a candidate prefilter
  // then one ranking pass (one-warp-per-token layouts, E >= 256 or an E off
  // the exact layouts; elsewhere it runs the rounds).
  int path = 0;
  // true: the general layout (scalar loads, any E) even where an exact one exists.
  bool generic_layout = false;
};

// SPEC §8.1. Per token t, with l the logits (NaN read as -inf, +inf as the
// largest float), s the scores, b the bias (0 when null):
//   selection value v = s + b  (kSoftmaxAfterTopk: v = l + b); without a bias
//     the order of v is the order of the logits, and the logits are compared.
//   groups (when topk_group < n_group): the E experts in n_group groups of
//     E / n_group consecutive ids; a group's score is the sum of its two largest
//     v; the topk_group best groups (ties: lowest group id) hold the candidates.
//   the k candidates with the largest v (ties: lowest id), in that order.
//   weight w_j = s of the j-th chosen expert (kSoftmaxAfterTopk: softmax over
//     the chosen logits); renormalize: w_j /= sum of the k (0 if that sum is 0);
//     then w_j *= routed_scaling_factor.
// Hash selection (SPEC §8.7; DeepSeek-V4's first layers): with hash_table set,
// token t's experts are row token_ids[t] of the table, in its order, instead
// of the top-k (no bias, no groups); the weights are as above. A token id
// outside [0, vocab_size), or an entry outside [0, E), gives that slot id -1
// ("not local" downstream) and weight 0.
struct MoeRouterArgs {
  const void* logits = nullptr;             // [T, E] of logits_dtype, dense rows
  DType logits_dtype = DType::kBFloat16;    // fp32 or bf16
  int64_t num_tokens = 0;                   // T (0 is valid: nothing is launched); k*T <= INT32_MAX
  int num_experts = 0;                      // E, 1..512
  int k = 0;                                // 1..16, <= E
  MoeRouterScoring scoring = MoeRouterScoring::kSoftmax;
  bool renormalize = false;                 // ignored by kSoftmaxAfterTopk (its weights sum to 1)
  const float* correction_bias = nullptr;   // [E] (e_score_correction_bias) or null: selection only
  int n_group = 1;                          // divides E
  int topk_group = 1;                       // 1..n_group; topk_group * (E / n_group) >= k
  float routed_scaling_factor = 1.0f;       // finite
  // Hash selection (SPEC §8.7): null = the top-k above.
  const int32_t* hash_table = nullptr;      // [vocab_size, k] expert ids (V4's tid2eid), dense rows
  int64_t vocab_size = 0;                   // rows of hash_table (>= 1 with one)
  const void* token_ids = nullptr;          // [T] token ids, int32 (or int64: token_ids_int64); with hash_table only
  bool token_ids_int64 = false;
  int32_t* token_selected_experts = nullptr;  // out [T, k]
  float* token_final_scales = nullptr;        // out [T, k]
  bool enable_pdl = true;
  MoeRouterTuning tuning;
};

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, safe to capture in a CUDA graph. Device pointers.
Status moe_router(const MoeRouterArgs& args, cudaStream_t stream);

// CPU reference (double arithmetic, one rounding at the store). Host pointers.
Status moe_router_cpu(const MoeRouterArgs& args);

// Host-side validation shared by both backends (no device access).
Status validate_moe_router(const MoeRouterArgs& args);

const char* to_string(MoeRouterScoring scoring);

}  // namespace flashmix
