// Internal to the FC2 op: which GEMM kernel runs under the finalize epilogue.
// One table of candidates with the conditions each needs, and the automatic
// rule, in moe_fc2_dispatch.cpp; moe_fc2_finalize launches what it returns.
#pragma once

#include "flashmix/moe.h"

namespace flashmix {

struct Fc2GemmChoice {
  Fc2GemmKernel kernel = Fc2GemmKernel::kAuto;  // never kAuto once chosen
  const char* why = "";  // a short static sentence: the rule that picked it, or "pinned ..."
};

// nullptr when `kernel` (not kAuto) is built in and can take these args, else
// why not (a static sentence). Sizes only; the args should be valid.
const char* fc2_gemm_kernel_unavailable(Fc2GemmKernel kernel, const Fc2FinalizeArgs& a);

// The kernel moe_fc2_finalize runs for these (valid) args: a.tuning.gemm_kernel
// when pinned, else the automatic rule. kNotSupported, naming
// tuning.gemm_kernel, when the pinned kernel is not built or cannot take the
// shape. Host only, no device access.
Status choose_fc2_gemm_kernel(const Fc2FinalizeArgs& a, Fc2GemmChoice* choice);

}  // namespace flashmix
