// Internal to the FC1 op (spec §9): the validation both backends and the
// launcher share.
#pragma once

#include "flashmix/moe.h"

namespace flashmix {

// validate_moe_fc1 with check_buffers = false checks the sizes and the
// parameters only, not the buffers (presence, alignment, overlap).
Status validate_fc1(const MoeFc1Args& a, bool check_buffers);

}  // namespace flashmix
