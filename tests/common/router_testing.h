// moe_router test data and the comparison the GPU tests and flashmix-bench
// hold the kernels to (SPEC §8.5): the chosen ids exactly, wherever the
// reference's choice is decided by more than the GPU's fp32 rounding, and the
// weights within 2^-14 |ref| + 2^-20 |routed_scaling_factor|.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/test_data.h"
#include "flashmix/moe.h"

namespace flashmix::testing {

struct RouterCase {
  MoeRouterScoring scoring = MoeRouterScoring::kSoftmax;
  DType dtype = DType::kBFloat16;
  int64_t T = 0;
  int E = 0, k = 0;
  bool renormalize = false;
  bool bias = false;
  int n_group = 1, topk_group = 1;
  float scale = 1.0f;

  bool grouped() const { return topk_group < n_group; }
  std::string describe() const {
    return std::string(to_string(scoring)) + " " + to_string(dtype) + " T=" + std::to_string(T) +
           " E=" + std::to_string(E) + " k=" + std::to_string(k) + (renormalize ? " renormalize" : "") +
           (bias ? " bias" : "") +
           (n_group > 1 ? " groups " + std::to_string(topk_group) + "/" + std::to_string(n_group) : "") +
           " scale " + std::to_string(scale);
  }
};

struct RouterHostData {
  HostTensor logits;        // [T, E]
  std::vector<float> bias;  // [E]; empty: none
};

// Logits uniform in [lo, hi] (rounded to the dtype), bias in +-bias_range.
inline RouterHostData random_router_data(Rng& rng, const RouterCase& c, float lo = -6.0f, float hi = 6.0f,
                                         float bias_range = 0.5f) {
  RouterHostData d;
  d.logits = HostTensor(c.dtype, c.T * c.E);
  d.logits.fill_random(rng, lo, hi);
  if (c.bias) {
    d.bias.resize(static_cast<size_t>(c.E));
    for (auto& b : d.bias) b = rng.uniform(-bias_range, bias_range);
  }
  return d;
}

// Host pointers for the inputs; the outputs are left to the caller.
inline MoeRouterArgs router_args(const RouterCase& c, const RouterHostData& d) {
  MoeRouterArgs a;
  a.logits = d.logits.data();
  a.logits_dtype = c.dtype;
  a.num_tokens = c.T;
  a.num_experts = c.E;
  a.k = c.k;
  a.scoring = c.scoring;
  a.renormalize = c.renormalize;
  a.correction_bias = d.bias.empty() ? nullptr : d.bias.data();
  a.n_group = c.n_group;
  a.topk_group = c.topk_group;
  a.routed_scaling_factor = c.scale;
  return a;
}

inline double router_weight_tolerance(double ref, float scale) {
  return std::ldexp(std::fabs(ref), -14) + std::ldexp(std::fabs(double(scale)), -20);
}

// Per token: true when the reference's choice does not hinge on two values
// that lie within the GPU's fp32 error of each other without being equal:
// a group score among the topk_group best against one outside them and, with
// a bias, the selection value of each of the k chosen against every value
// after it (a later chosen one: the order of the ids; an unchosen one: the
// set). Every such pair counts, not only the two neighbours at the boundary:
// an exact tie there (decided by the lowest id on both backends) can hide a
// third value made of other terms within rounding of it, which the GPU may
// round above the tie (seen on an H100: sqrt-softplus, bias {0, 0.25},
// groups 2 of 4, the group scores s(a) + 0.25 + s(b) of two groups with
// equal terms tied, and a third group's s(a) + (s(b) + 0.25) a rounding
// below them in double but above them in fp32). Without a bias the keys are
// the logits, exact in both. Exact ties (equal inputs) are decided: both
// backends break them by the lowest id. Equal in double but made of other
// terms (group scores of other pairs, s + b of other s) is not a tie in
// fp32, so undecided. Written from the spec, in double.
//
// The GPU's error of a selection value v = s + b: the fast exp's relative
// error (about 1e-6 for logits up to ~10) times the part of s it reaches
// (se: p for the softmax, s·(1 - s) for the sigmoid, s for the sqrt-softplus,
// nothing for a logit), plus a few fp32 roundings of s and v. Two values
// count as close when they differ by at most eps·(se_a + se_b) +
// 2^-21·(|s_a| + |s_b| + |v_a| + |v_b|); group scores: the same over their
// four terms, plus 2^-21 of their own magnitudes.
inline std::vector<char> decided_tokens(const RouterCase& c, const RouterHostData& d, double eps = 1e-5) {
  const double inf = std::numeric_limits<double>::infinity();
  const double ulp = std::ldexp(1.0, -21);
  const int E = c.E, S = E / c.n_group;
  std::vector<char> decided(size_t(c.T), 1);
  // Per expert: the selection value and the magnitude of its error-prone part.
  struct Value {
    double v, se, s;
  };
  std::vector<double> l(static_cast<size_t>(E));
  std::vector<Value> val(static_cast<size_t>(E));
  auto close = [](double a, double b, double tol) {
    if (a == b || std::isinf(a) || std::isinf(b)) return false;
    return std::fabs(a - b) <= tol;
  };
  auto by_value = [](const Value& a, const Value& b) { return a.v > b.v; };
  for (int64_t t = 0; t < c.T; ++t) {
    double m = -inf;
    for (int e = 0; e < E; ++e) {
      double x = d.logits.get(t * E + e);
      if (std::isnan(x)) x = -inf;
      if (x == inf) x = FLT_MAX;
      l[size_t(e)] = x;
      m = std::max(m, x);
    }
    double z = 0;
    if (m != -inf)
      for (int e = 0; e < E; ++e) z += std::exp(l[size_t(e)] - m);
    for (int e = 0; e < E; ++e) {
      const double x = l[size_t(e)];
      double s = x, se = 0.0;
      switch (c.scoring) {
        case MoeRouterScoring::kSoftmax: s = m == -inf ? 0.0 : std::exp(x - m) / z; se = s; break;
        case MoeRouterScoring::kSigmoid: s = 1.0 / (1.0 + std::exp(-x)); se = s * (1.0 - s); break;
        case MoeRouterScoring::kSqrtSoftplus:
          s = x == -inf ? 0.0 : std::sqrt(std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
          se = s;
          break;
        case MoeRouterScoring::kSoftmaxAfterTopk: break;
      }
      val[size_t(e)] = {s + (c.bias ? double(d.bias[size_t(e)]) : 0.0), se, std::fabs(s)};
    }
    std::vector<Value> cand;
    if (c.grouped()) {
      struct Group {
        double gs, tol_part;  // score; eps·Σse + ulp·Σ|v| of its terms
        double t0, t1;        // its terms, largest first (a tie of scores made of other terms is no tie in fp32)
      };
      std::vector<Group> gs(size_t(c.n_group));
      for (int g = 0; g < c.n_group; ++g) {
        std::vector<Value> in(val.begin() + int64_t(g) * S, val.begin() + int64_t(g + 1) * S);
        std::stable_sort(in.begin(), in.end(), by_value);
        const int n = S >= 2 ? 2 : 1;
        double score = 0, part = 0;
        for (int q = 0; q < n; ++q) {
          score += in[size_t(q)].v;
          part += eps * in[size_t(q)].se + ulp * (in[size_t(q)].s + std::fabs(in[size_t(q)].v));
        }
        gs[size_t(g)] = {score, part, in[0].v, n == 2 ? in[1].v : 0.0};
      }
      std::vector<int> order(size_t(c.n_group));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gs[size_t(a)].gs > gs[size_t(b)].gs; });
      // Every kept group against every dropped one.
      for (int p = 0; p < c.topk_group && decided[size_t(t)]; ++p)
        for (int q = c.topk_group; q < c.n_group; ++q) {
          const Group& in = gs[size_t(order[size_t(p)])];
          const Group& out = gs[size_t(order[size_t(q)])];
          const bool same_terms = in.t0 == out.t0 && in.t1 == out.t1;
          if ((in.gs == out.gs && !same_terms) ||
              close(in.gs, out.gs, in.tol_part + out.tol_part + ulp * (std::fabs(in.gs) + std::fabs(out.gs)))) {
            decided[size_t(t)] = 0;
            break;
          }
        }
      for (int q = 0; q < c.topk_group; ++q)
        for (int e = order[size_t(q)] * S; e < (order[size_t(q)] + 1) * S; ++e) cand.push_back(val[size_t(e)]);
    } else {
      cand = val;
    }
    if (c.bias && decided[size_t(t)]) {
      std::stable_sort(cand.begin(), cand.end(), by_value);
      // Bounds of the other value's part of the tolerance, to stop each scan
      // once the values are further apart than any tolerance.
      double max_se = 0, max_mag = 0;
      for (const Value& x : cand) {
        max_se = std::max(max_se, x.se);
        max_mag = std::max(max_mag, x.s + std::fabs(x.v));
      }
      const int n = int(cand.size());
      for (int p = 0; p < c.k && p + 1 < n && decided[size_t(t)]; ++p) {
        const Value& a = cand[size_t(p)];
        const double reach = eps * (a.se + max_se) + ulp * (a.s + std::fabs(a.v) + max_mag);
        for (int q = p + 1; q < n; ++q) {
          const Value& b = cand[size_t(q)];
          if (a.v - b.v > reach) break;  // sorted: every later value is further away
          if ((a.v == b.v && a.s != b.s) ||  // equal sums of other terms: equal in double, not in fp32
              close(a.v, b.v, eps * (a.se + b.se) + ulp * (a.s + b.s + std::fabs(a.v) + std::fabs(b.v)))) {
            decided[size_t(t)] = 0;
            break;
          }
        }
      }
    }
  }
  return decided;
}

struct RouterComparison {
  int64_t undecided = 0;          // tokens not compared (decided_tokens)
  int64_t id_mismatches = 0;      // compared tokens whose ids differ
  int64_t weight_mismatches = 0;  // compared weights off by more than the tolerance
  double worst = 0;               // largest weight error over its tolerance
  std::string first_failure;
  bool ok() const { return id_mismatches == 0 && weight_mismatches == 0; }
};

inline RouterComparison compare_router(const RouterCase& c, const std::vector<char>& decided, const int32_t* ids,
                                       const float* w, const int32_t* ref_ids, const float* ref_w) {
  RouterComparison r;
  for (int64_t t = 0; t < c.T; ++t) {
    if (!decided[size_t(t)]) {
      ++r.undecided;
      continue;
    }
    bool ids_ok = true;
    for (int j = 0; j < c.k; ++j) ids_ok &= ids[t * c.k + j] == ref_ids[t * c.k + j];
    if (!ids_ok) {
      if (r.first_failure.empty()) {
        r.first_failure = "token " + std::to_string(t) + ": ids";
        for (int j = 0; j < c.k; ++j) r.first_failure += " " + std::to_string(ids[t * c.k + j]);
        r.first_failure += ", reference";
        for (int j = 0; j < c.k; ++j) r.first_failure += " " + std::to_string(ref_ids[t * c.k + j]);
      }
      ++r.id_mismatches;
      continue;
    }
    for (int j = 0; j < c.k; ++j) {
      const double got = w[t * c.k + j], want = ref_w[t * c.k + j];
      const double err = std::fabs(got - want) / router_weight_tolerance(want, c.scale);
      r.worst = std::max(r.worst, std::isnan(err) ? INFINITY : err);
      if (!(err <= 1.0)) {
        if (r.first_failure.empty())
          r.first_failure = "token " + std::to_string(t) + " slot " + std::to_string(j) + ": weight " +
                            std::to_string(got) + ", reference " + std::to_string(want);
        ++r.weight_mismatches;
      }
    }
  }
  return r;
}

}  // namespace flashmix::testing
