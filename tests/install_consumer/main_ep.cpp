// flashmix::flashmix_ep from an installed package: the header, the library
// and NCCL link, and a size query answers without a GPU or a communicator.
#include <cstdio>

#include "flashmix/ep.h"

int main() {
  flashmix::EpShape s;
  s.world = 2;
  s.hidden = 64;
  s.k = 2;
  s.num_experts = 8;
  s.max_tokens_per_rank = 16;
  const size_t bytes = flashmix::ep_workspace_size(s);
  s.num_experts = 7;  // not a multiple of the world: no workspace
  const size_t bad = flashmix::ep_workspace_size(s);
  std::printf("ep_workspace_size: %zu (bad shape: %zu)\n", bytes, bad);
  return bytes > 0 && bad == 0 ? 0 : 1;
}
