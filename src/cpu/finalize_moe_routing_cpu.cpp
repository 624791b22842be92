// CPU reference for finalize_moe_routing, written from spec §2 alone:
//   out[t, c] = sum over j with e = experts[t, j] local:
//                 w[t, j] * (rows[u2p[j*T + t], c] + bias[e - start, c])   (+ shared_output[t, c])
// accumulated in double and rounded once to the output dtype.
#include <vector>

#include "common/host_dtype.h"
#include "flashmix/moe.h"
#include "moe/finalize_moe_routing_internal.h"

namespace flashmix {

Status finalize_moe_routing_cpu(const FinalizeMoeRoutingArgs& a) {
  Status st = validate_finalize_moe_routing(a);
  if (!st.ok()) return st;
  const ResolvedFinalizeStrides s = resolve_finalize_strides(a);
  const int64_t T = a.num_tokens, H = a.hidden, k = a.k;
  const int64_t lo = a.start_expert_id, hi = lo + a.num_experts_per_node;
  std::vector<double> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    bool any_local = false;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = a.token_selected_experts[t * k + j];
      if (e < lo || e >= hi) continue;  // non-local: never read
      any_local = true;
      const int64_t row = a.unpermuted_row_to_permuted_row[j * T + t];
      const double w = a.scales ? double(a.scales[t * k + j]) : 1.0;
      for (int64_t c = 0; c < H; ++c) {
        double x = host::load_as_double(a.expanded_permuted_rows, a.rows_dtype, row * s.rows + c);
        if (a.bias) x += host::load_as_double(a.bias, a.rows_dtype, (e - lo) * s.bias + c);
        acc[c] += w * x;
      }
    }
    if (!any_local && !a.fill) continue;  // no-filling: left untouched
    for (int64_t c = 0; c < H; ++c) {
      double v = acc[c];
      if (a.shared_output) v += host::load_as_double(a.shared_output, a.out_dtype, t * s.shared + c);
      host::store_from_double(a.out, a.out_dtype, t * s.out + c, v);
    }
  }
  return Status::Ok();
}

}  // namespace flashmix
