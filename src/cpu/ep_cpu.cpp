// CPU reference of the all-to-all way's plan (spec §14.3), written from the
// spec: token t goes to rank d when one of its k ids lies in d's expert range
// [d * E/W, (d + 1) * E/W); its row in d's slab is the number of earlier
// tokens that go to d; rows at or past the capacity C are cut.
#include <cstdint>
#include <vector>

#include "flashmix/ep.h"

namespace flashmix {

EpPlanCpu ep_plan_cpu(const EpShape& shape, int64_t num_tokens, const int32_t* topk_ids) {
  EpPlanCpu plan;
  const int W = shape.world;
  const int64_t T = num_tokens;
  const int64_t e_local = shape.num_experts / W;
  const int64_t C = ep_recv_capacity(shape);
  plan.row.assign(size_t(W) * size_t(T), -1);
  plan.counts.assign(size_t(W), 0);
  for (int d = 0; d < W; ++d) {
    for (int64_t t = 0; t < T; ++t) {
      bool goes = false;
      for (int j = 0; j < shape.k; ++j) {
        const int64_t e = topk_ids[t * shape.k + j];
        goes = goes || (e >= d * e_local && e < (d + 1) * e_local);
      }
      if (!goes) continue;
      const int64_t row = plan.counts[size_t(d)]++;
      plan.row[size_t(d) * size_t(T) + size_t(t)] = int32_t(row);
      if (row >= C) ++plan.dropped;
    }
  }
  return plan;
}

}  // namespace flashmix
