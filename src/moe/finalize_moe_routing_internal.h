// Internal pieces of finalize_moe_routing shared by its validation, its GPU
// launcher and its CPU reference.
#pragma once

#include <cstdint>

#include "flashmix/moe.h"

namespace flashmix {

constexpr int kMaxFinalizeK = 16;
constexpr int kMaxFinalizeThreads = 256;    // the persistent warps' blocks
constexpr int kMaxTokenBlockThreads = 512;  // token blocks (tuning.schedule 2)
constexpr int kMinFinalizeBlocksPerSm = 3;  // 256 x 3 threads: at most 85 registers each

// Strides with the "0 means dense" defaults applied.
struct ResolvedFinalizeStrides {
  int64_t rows, bias, shared, out;
};
ResolvedFinalizeStrides resolve_finalize_strides(const FinalizeMoeRoutingArgs& a);

}  // namespace flashmix
