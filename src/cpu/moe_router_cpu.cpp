// CPU reference of the MoE router (SPEC §8), written from the spec: every
// score, selection value, group score and weight in double, rounded once to
// fp32 at the store. Shares no code with the kernels.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "common/host_dtype.h"
#include "flashmix/moe.h"

namespace flashmix {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// SPEC §8.2: NaN is read as -inf, +inf as the largest finite float.
double read_logit(const void* logits, DType t, int64_t i) {
  const double x = host::load_as_double(logits, t, i);
  if (std::isnan(x)) return -kInf;
  if (x == kInf) return double(FLT_MAX);
  return x;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|).
double softplus(double x) {
  if (x == -kInf) return 0.0;
  return std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x)));
}

// Softmax of `x` over the indices in `idx` (all -inf: all 0).
std::vector<double> softmax(const std::vector<double>& x, const std::vector<int>& idx) {
  double m = -kInf;
  for (int e : idx) m = std::max(m, x[size_t(e)]);
  std::vector<double> p(x.size(), 0.0);
  if (m == -kInf) return p;
  double z = 0.0;
  for (int e : idx) z += std::exp(x[size_t(e)] - m);
  for (int e : idx) p[size_t(e)] = std::exp(x[size_t(e)] - m) / z;
  return p;
}

// SPEC §8.7: token t's experts from its row of the hash table; `l` its
// logits (§8.2), `s` their scores (§8.1). A slot whose token id or table
// entry is out of range is id -1, weight 0.
void hash_token(const MoeRouterArgs& a, int64_t t, const std::vector<double>& l, const std::vector<double>& s) {
  const int k = a.k, E = a.num_experts;
  const int64_t id = a.token_ids_int64 ? static_cast<const int64_t*>(a.token_ids)[t]
                                       : int64_t(static_cast<const int32_t*>(a.token_ids)[t]);
  std::vector<int> e(size_t(k), -1), valid;
  for (int j = 0; j < k; ++j) {
    if (id < 0 || id >= a.vocab_size) break;
    const int32_t x = a.hash_table[id * k + j];
    if (x >= 0 && x < E) {
      e[size_t(j)] = x;
      valid.push_back(x);
    }
  }
  // The weights of §8.1 over the valid slots. The renormalised softmax is the
  // softmax of the chosen logits (equal in exact arithmetic; the row's
  // softmax could underflow for all of them when the row's largest logit is
  // not chosen).
  const bool relative = a.scoring == MoeRouterScoring::kSoftmaxAfterTopk ||
                        (a.scoring == MoeRouterScoring::kSoftmax && a.renormalize);
  std::vector<double> p;
  if (relative) p = softmax(l, valid);  // a repeated expert counts twice in the sum, as the gather does
  std::vector<double> w(size_t(k), 0.0);
  double sum = 0.0;
  for (int j = 0; j < k; ++j) {
    if (e[size_t(j)] < 0) continue;
    w[size_t(j)] = relative ? p[size_t(e[size_t(j)])] : s[size_t(e[size_t(j)])];
    sum += w[size_t(j)];
  }
  if (a.renormalize && !relative)
    for (int j = 0; j < k; ++j) w[size_t(j)] = sum > 0.0 ? w[size_t(j)] / sum : 0.0;
  for (int j = 0; j < k; ++j) {
    a.token_selected_experts[t * k + j] = e[size_t(j)];
    a.token_final_scales[t * k + j] = float(w[size_t(j)] * double(a.routed_scaling_factor));
  }
}

}  // namespace

Status moe_router_cpu(const MoeRouterArgs& a) {
  Status st = validate_moe_router(a);
  if (!st.ok()) return st;

  const int E = a.num_experts, k = a.k;
  const bool has_bias = a.correction_bias != nullptr;
  const bool after_topk = a.scoring == MoeRouterScoring::kSoftmaxAfterTopk;
  const bool grouped = a.topk_group < a.n_group;
  const int group_size = E / a.n_group;
  std::vector<int> all(static_cast<size_t>(E));
  std::iota(all.begin(), all.end(), 0);

  std::vector<double> l(static_cast<size_t>(E)), s(static_cast<size_t>(E)), v(static_cast<size_t>(E)), key(static_cast<size_t>(E));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    for (int e = 0; e < E; ++e) l[size_t(e)] = read_logit(a.logits, a.logits_dtype, t * E + e);

    // Scores.
    switch (a.scoring) {
      case MoeRouterScoring::kSoftmax: s = softmax(l, all); break;
      case MoeRouterScoring::kSigmoid:
        for (int e = 0; e < E; ++e) s[size_t(e)] = sigmoid(l[size_t(e)]);
        break;
      case MoeRouterScoring::kSqrtSoftplus:
        for (int e = 0; e < E; ++e) s[size_t(e)] = std::sqrt(softplus(l[size_t(e)]));
        break;
      case MoeRouterScoring::kSoftmaxAfterTopk: s = l; break;
    }
    // Selection values; without a bias the logits order the experts (the
    // scorings are strictly increasing, so that is the order of v, with no
    // ties from rounding).
    for (int e = 0; e < E; ++e) {
      const double b = has_bias ? double(a.correction_bias[e]) : 0.0;
      v[size_t(e)] = s[size_t(e)] + b;
      key[size_t(e)] = has_bias ? v[size_t(e)] : l[size_t(e)];
    }
    auto before = [&](int x, int y) {  // x goes before y: larger key, then lower id
      return key[size_t(x)] > key[size_t(y)] || (key[size_t(x)] == key[size_t(y)] && x < y);
    };

    if (a.hash_table != nullptr) {
      hash_token(a, t, l, s);
      continue;
    }

    // Candidates: the experts of the best topk_group groups (or all).
    std::vector<int> cand;
    if (grouped) {
      std::vector<double> gs(size_t(a.n_group));
      for (int g = 0; g < a.n_group; ++g) {
        std::vector<double> in(v.begin() + int64_t(g) * group_size, v.begin() + int64_t(g + 1) * group_size);
        std::sort(in.begin(), in.end(), std::greater<double>());
        gs[size_t(g)] = group_size >= 2 ? in[0] + in[1] : in[0];
      }
      std::vector<int> groups(size_t(a.n_group));
      std::iota(groups.begin(), groups.end(), 0);
      std::stable_sort(groups.begin(), groups.end(),
                       [&](int x, int y) { return gs[size_t(x)] > gs[size_t(y)]; });
      groups.resize(size_t(a.topk_group));
      std::sort(groups.begin(), groups.end());
      for (int g : groups)
        for (int e = g * group_size; e < (g + 1) * group_size; ++e) cand.push_back(e);
    } else {
      cand = all;
    }
    std::stable_sort(cand.begin(), cand.end(), before);
    cand.resize(size_t(k));

    // Weights.
    std::vector<double> w(static_cast<size_t>(k));
    if (after_topk) {
      std::vector<int> chosen(cand.begin(), cand.end());
      const std::vector<double> p = softmax(l, chosen);
      for (int j = 0; j < k; ++j) w[size_t(j)] = p[size_t(cand[size_t(j)])];
    } else {
      for (int j = 0; j < k; ++j) w[size_t(j)] = s[size_t(cand[size_t(j)])];
      if (a.renormalize) {
        double sum = 0.0;
        for (int j = 0; j < k; ++j) sum += w[size_t(j)];
        for (int j = 0; j < k; ++j) w[size_t(j)] = sum > 0.0 ? w[size_t(j)] / sum : 0.0;
      }
    }
    for (int j = 0; j < k; ++j) {
      a.token_selected_experts[t * k + j] = int32_t(cand[size_t(j)]);
      a.token_final_scales[t * k + j] = float(w[size_t(j)] * double(a.routed_scaling_factor));
    }
  }
  return Status::Ok();
}

}  // namespace flashmix
