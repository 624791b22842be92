// CPU reference for the MoE routing maps (spec §1), written from the spec:
// a stable counting sort of the local slots s = j*T + t by local expert; the
// FP8 expansion through quantize_fp8's reference.
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashmix/fp8.h"
#include "flashmix/moe.h"

namespace flashmix {

Status build_moe_routing_maps_cpu(const MoeRoutingArgs& a) {
  Status st = validate_moe_routing_maps(a);
  if (!st.ok()) return st;

  const int64_t T = a.num_tokens, k = a.k, E = a.num_experts_per_node, start = a.start_expert_id;
  auto local_expert = [&](int64_t s) -> int64_t {  // -1 when not local
    const int64_t j = s / T, t = s % T;
    const int64_t e = int64_t(a.token_selected_experts[t * k + j]) - start;
    return (e >= 0 && e < E) ? e : -1;
  };

  std::vector<int64_t> count(size_t(E) + 1, 0);
  for (int64_t s = 0; s < k * T; ++s) {
    const int64_t e = local_expert(s);
    if (e >= 0) ++count[size_t(e)];
  }
  std::vector<int64_t> next(size_t(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) next[size_t(e) + 1] = next[size_t(e)] + count[size_t(e)];
  for (int64_t e = 0; e <= E; ++e) a.expert_first_token_offset[e] = next[size_t(e)];

  // Visiting s in increasing order makes the order within an expert stable.
  for (int64_t s = 0; s < k * T; ++s) {
    const int64_t e = local_expert(s);
    if (e < 0) {
      a.unpermuted_row_to_permuted_row[s] = -1;
      continue;
    }
    const int64_t p = next[size_t(e)]++;
    a.unpermuted_row_to_permuted_row[s] = int32_t(p);
    a.permuted_row_to_unpermuted_row[p] = int32_t(s);
    if (a.input != nullptr && a.permuted_input_scales != nullptr) {
      // FP8 expansion (spec §1.4): the token's row quantised by quantize_fp8's
      // reference (1 x 128 blocks), written to this permuted row.
      const int64_t in_stride = a.input_stride ? a.input_stride : a.hidden;
      const int64_t out_stride = a.permuted_input_stride ? a.permuted_input_stride : a.hidden;
      const int64_t t = s % T;
      QuantizeFp8Args q;
      q.x = static_cast<const uint16_t*>(a.input) + t * in_stride;
      q.q = static_cast<uint8_t*>(a.permuted_input) + p * out_stride;
      const size_t scale_bytes = a.permuted_scale_format == ScaleFormat::kUE8M0 ? 1 : 4;
      q.scales = static_cast<char*>(a.permuted_input_scales) + size_t(p * (a.hidden / 128)) * scale_bytes;
      q.rows = 1;
      q.cols = a.hidden;
      q.block = Fp8Block::k1x128;
      q.scale_format = a.permuted_scale_format;
      st = quantize_fp8_cpu(q);
      if (!st.ok()) return st;
    } else if (a.input != nullptr) {
      const int64_t es = int64_t(dtype_size(a.input_dtype));
      const int64_t in_stride = a.input_stride ? a.input_stride : a.hidden;
      const int64_t out_stride = a.permuted_input_stride ? a.permuted_input_stride : a.hidden;
      const int64_t t = s % T;
      std::memcpy(static_cast<char*>(a.permuted_input) + p * out_stride * es,
                  static_cast<const char*>(a.input) + t * in_stride * es, size_t(a.hidden * es));
    }
  }
  return Status::Ok();
}

}  // namespace flashmix
