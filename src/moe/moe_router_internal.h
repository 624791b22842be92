// moe_router: limits shared by the validation and the launcher, and the launch shape the bench asks for.
#pragma once

#include "flashmix/moe_router.h"

namespace flashmix::detail {

constexpr int kRouterMaxExperts = 512;  // E: 32 lanes x 16 values
constexpr int kRouterMaxK = 16;

// Tokens a block of the router's kernel takes with these arguments (its grid
// is ceil(T / this) blocks of 128 threads): for the bench's launch bound.
int router_tokens_per_block(const MoeRouterArgs& a);

}  // namespace flashmix::detail
