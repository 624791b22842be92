// moe_router: limits shared by the validation and the launcher.
#pragma once

namespace flashmix::detail {

constexpr int kRouterMaxExperts = 512;  // E: 32 lanes x 16 values
constexpr int kRouterMaxK = 16;

}  // namespace flashmix::detail
