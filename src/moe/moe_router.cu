// The MoE router on the GPU (SPEC §8): logits [T, E] -> the k chosen experts
// of each token (token_selected_experts) and their weights (token_final_scales).
//
// Layout. A token is handled by a team of G lanes (G in {1, 8, 16, 32}), lane
// r of the team holding the V consecutive experts [r*V, r*V + V) in
// registers; a block of 128 threads handles 128 / G tokens. The exact layouts
// (E = G*V: 8, 64, 128, 256, 384, 512) load each lane's chunk with 16-byte
// (or 8-byte) vectors; any other E (or a logits pointer not aligned for
// them) runs the general layout: G = 32, V = ceil(E / 32), element loads.
// G = 1 (E = 8) is its own kernel, moe_router_thread_kernel: the steps below
// in one thread with compile-time indices.
//
// Per token:
//   1. the logits are read once (NaN -> -inf, +inf -> FLT_MAX), the scores
//      s and selection values v = s + b computed in fp32 where they are needed
//      (a bias, or groups); every expert gets a 32-bit key whose unsigned order
//      is the order of its selection value (the logit itself without a bias:
//      the scorings are increasing, and the logits never tie by rounding);
//   2. groups: each group's top-2 sum (registers and shuffles when a group is
//      whole lanes, else through shared memory), its rank among the groups,
//      and the keys outside the topk_group best groups set to 0 ("absent");
//   3. selection, ties to the lowest id, either
//      - rounds: k times a team-wide arg-max (max of the lanes' local maxima,
//        the lowest lane holding it by ballot, which is the lowest id since a
//        lane holds consecutive ids; the winner drops it and rescans), or
//      - candidates (G = 32): every key >= a threshold t0 is a candidate;
//        any t0 with k to 32 keys at or above it keeps the k largest (the
//        kept groups' smallest second value where groups allow, else a lower
//        bound of the k-th largest lane maximum). The candidates go to shared
//        memory and each one's rank is counted in one pass. More than 32
//        (heavy ties) fall back to the rounds. Both give the same ids in the
//        same order;
//   4. weights from the chosen experts' logits (re-read, from L1), summed over
//      the team in a fixed order, scaled, stored.
//
// Hash selection (SPEC §8.7, DeepSeek-V4's first layers) takes the experts
// from a table row per token id instead: its own small kernel below.
//
// Roofline: T*E*element bytes of logits read once, 8*k*T bytes written
// (DeepSeek-V3 T = 8192, E = 256, bf16: 4 MiB read, 0.5 MiB written); a few
// hundred instructions per token on top, which the memory time hides only in
// part (docs/moe_router.md).
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/check.h"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "flashmix/moe.h"
#include "moe/moe_router_internal.h"

namespace flashmix {
namespace {

constexpr const char* kOp = "moe_router";
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxK = detail::kRouterMaxK;
constexpr unsigned kFull = 0xffffffffu;
// Per warp: 32 candidates and a scratch word per lane (8 bytes each), and k
// slot ids (4 bytes).
constexpr int kCandidateBytes = 64 * 8 + kMaxK * 4;

struct Params {
  const void* logits;
  const float* bias;  // null: no bias
  int32_t* ids;
  float* weights;
  int64_t T;
  int E;
  int k;
  int V;            // experts per lane (the general layout's ceil(E / 32); the template V otherwise)
  int n_group;
  int topk_group;
  int group_size;   // E / n_group
  int group_lanes;  // > 0: a group is this many whole lanes (registers); 0: through shared memory
  int group_lanes_log2;
  bool t0_from_groups;  // the candidates' threshold guessed from the kept groups (keys are selection values)
  int warp_smem;    // dynamic shared memory bytes per warp
  int candidate_bytes;  // of which the candidate path's (first)
  float scale;
  bool grouped;     // topk_group < n_group
  bool renormalize;
  bool bias_vec;    // bias 16-byte aligned (vector loads)
  bool candidates;  // the candidate path (G = 32)
};

// A team of G lanes (G >= 8, aligned to G within the warp) working on one
// token. All 32 lanes of a warp call every function (idle teams run along).
template <int G>
struct Team {
  int r;     // lane within the team
  int base;  // warp lane of the team's lane 0
  __device__ Team() {
    const int lane = int(threadIdx.x & 31);
    r = lane & (G - 1);
    base = lane - r;
  }
  __device__ uint32_t max(uint32_t x) const {
    if constexpr (G == 32) {
      return __reduce_max_sync(kFull, x);
    } else {
#pragma unroll
      for (int o = G / 2; o > 0; o >>= 1) x = ::max(x, __shfl_xor_sync(kFull, x, o));
      return x;
    }
  }
  __device__ float fmax(float x) const {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
    return x;
  }
  // Sum in a fixed butterfly order: the same bits on every run.
  __device__ float sum(float x) const {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
    return x;
  }
  // The lowest team lane where p holds (0 if none).
  __device__ int first(bool p) const {
    unsigned b = __ballot_sync(kFull, p);
    if constexpr (G < 32) b = (b >> base) & ((1u << G) - 1u);
    return b ? __ffs(int(b)) - 1 : 0;
  }
  template <typename X>
  __device__ X from(X x, int src) const {
    return __shfl_sync(kFull, x, src, G);
  }
};

// Unsigned order = float order (-0 and +0 must already be one value).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return b ^ (uint32_t(int32_t(b) >> 31) | 0x80000000u);
}

// SPEC §8.2: NaN -> -inf, +inf -> FLT_MAX, -0 -> +0.
__device__ __forceinline__ float sanitize(float x) { return fminf(fmaxf(x, -INFINITY), FLT_MAX) + 0.0f; }

template <MoeRouterScoring S>
__device__ __forceinline__ float score_of(float l) {
  if constexpr (S == MoeRouterScoring::kSigmoid) {
    // e^-l as __expf computes it, with results below 2^-126 flushed to 0
    // (1 + e is 1 either way): the same bits in 2 instructions instead of 5.
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(l * -1.44269504088896341f));
    return __fdividef(1.0f, 1.0f + e);  // l = -inf: 1 / inf = 0
  } else if constexpr (S == MoeRouterScoring::kSqrtSoftplus) {
    // softplus(l) = max(l, 0) + log1p(u), u = e^-|l| in [0, 1], with
    // log1p(u) = 2 atanh(z), z = u / (2 + u) in [0, 1/3], by its series to
    // z^11 (the rest is below 1.5e-7 relative): ~15 instructions against
    // ~40 for expf + log1pf + sqrtf, about 1e-6 relative (the exp's
    // approximation at |l| ~ 10), small e^l kept to full relative precision.
    // Past l ~ 17 the log1p term is below an ulp of l (PyTorch's softplus
    // returns l itself above 20: the same float). l = -inf: u = 0, score 0.
    float u;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(u) : "f"(fabsf(l) * -1.44269504088896341f));
    const float z = __fdividef(u, 2.0f + u), z2 = z * z;
    float p = fmaf(z2, 1.0f / 11, 1.0f / 9);
    p = fmaf(z2, p, 1.0f / 7);
    p = fmaf(z2, p, 1.0f / 5);
    p = fmaf(z2, p, 1.0f / 3);
    p = fmaf(z2, p, 1.0f);
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(2.0f * z, p, fmaxf(l, 0.0f))));
    return r;
  } else {
    return l;
  }
}

// An expert's selection value (what the groups are ranked by): its score
// plus the bias where a bias or groups need the score (m, inv_z: the row's
// softmax max and 1 / sum), the logit itself otherwise.
template <MoeRouterScoring S>
__device__ __forceinline__ float selection_value(float l, float b, bool need_scores, float m, float inv_z) {
  float v = l;
  if (need_scores) {
    float s;
    if constexpr (S == MoeRouterScoring::kSoftmax) s = m != -INFINITY ? __expf(l - m) * inv_z : 0.0f;
    else s = score_of<S>(l);
    v = s + b;
  }
  return v;
}

// One lane's V consecutive logits with the widest vectors V elements allow.
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* p, float (&x)[V]) {
  constexpr int kBytes = V * int(sizeof(T));
  constexpr int kW = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4 : 2;
  using W = typename dev::detail::Word<kW>::type;
  W w[kBytes / kW];
#pragma unroll
  for (int n = 0; n < kBytes / kW; ++n) w[n] = __ldg(reinterpret_cast<const W*>(p) + n);
  T t[V];
  memcpy(t, w, kBytes);
#pragma unroll
  for (int i = 0; i < V; ++i) x[i] = dev::to_float(t[i]);
}

// Blocks an SM must hold: full occupancy (16 blocks of 128 threads, 32
// registers) for the layouts of 8 experts a lane, where ptxas fits them
// without spills; sqrt-softplus needs a few more registers (12 blocks, 40
// registers).
constexpr int router_min_blocks(int G, int V, MoeRouterScoring S) {
  return G >= 8 && V <= 8 ? (S == MoeRouterScoring::kSqrtSoftplus ? 12 : 16) : 1;
}

template <typename T, int G, int V, bool kExact, MoeRouterScoring S>
__global__ void __launch_bounds__(kThreads, router_min_blocks(G, V, S)) moe_router_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr float kNegInf = -INFINITY;
  static_assert(G >= 8, "G = 1 is moe_router_thread_kernel");
  constexpr int kSlots = (kMaxK + G - 1) / G;  // output slots per lane: j = s*G + r
  constexpr bool kSoftmax = S == MoeRouterScoring::kSoftmax;
  const Team<G> team;
  const int lane = int(threadIdx.x & 31);
  const int64_t t = int64_t(blockIdx.x) * (kThreads / G) + int64_t(threadIdx.x / G);
  // A warp-per-token warp past T leaves below, so there every lane is active
  // (known at compile time: the exact layouts then have every expert present).
  const bool active = G == 32 || t < p.T;
  const int Vs = kExact ? V : p.V;  // ids r*Vs .. r*Vs + Vs - 1 live in lane r
  unsigned char* warp_smem = smem + size_t(threadIdx.x >> 5) * size_t(p.warp_smem);

  // The logits may come from the kernel before us on the stream.
  dev::grid_dependency_wait();
  if (!__any_sync(kFull, t < p.T)) return;  // a warp with no token (teams of an active warp run along)

  const T* row = static_cast<const T*>(p.logits) + (active ? t : 0) * p.E;
  float l[V];
  bool present[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    present[i] = active && (kExact || (i < Vs && team.r * Vs + i < p.E));
    l[i] = kNegInf;
  }
  if (active) {
    if constexpr (kExact) {
      load_chunk<T, V>(row + team.r * V, l);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (present[i]) l[i] = dev::to_float(__ldg(row + team.r * Vs + i));
    }
  }
  dev::allow_dependents_launch();
#pragma unroll
  for (int i = 0; i < V; ++i) l[i] = present[i] ? sanitize(l[i]) : kNegInf;

  const bool has_bias = p.bias != nullptr;
  const bool need_scores = has_bias || p.grouped;
  // Softmax over the row, where the weights or the selection values need it.
  float m = kNegInf, inv_z = 0.0f;
  if (kSoftmax && (need_scores || !p.renormalize)) {
#pragma unroll
    for (int i = 0; i < V; ++i) m = fmaxf(m, l[i]);
    m = team.fmax(m);
    float z = 0.0f;
    if (m != kNegInf) {
#pragma unroll
      for (int i = 0; i < V; ++i) z += __expf(l[i] - m);  // absent: exp(-inf) = 0
    }
    z = team.sum(z);
    inv_z = m != kNegInf ? 1.0f / z : 0.0f;  // z >= 1 (the largest term is 1)
  }

  // Keys (0 = absent) and the selection values the groups are ranked by.
  uint32_t key[V];
  float gv[V];
  float b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) b[i] = 0.0f;
  if (has_bias && active) {
    if (kExact && p.bias_vec && V % 4 == 0) {
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p.bias + team.r * V) + q);
        b[4 * q] = f.x;
        b[4 * q + 1] = f.y;
        b[4 * q + 2] = f.z;
        b[4 * q + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (present[i]) b[i] = __ldg(p.bias + team.r * Vs + i);
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float v = selection_value<S>(l[i], b[i], need_scores, m, inv_z);
    gv[i] = v;
    key[i] = present[i] ? order_key(has_bias ? v : l[i]) : 0u;
  }

  // Group-limited selection: keep the keys of the topk_group best groups.
  uint32_t group_t0 = ~0u;  // see below; ~0: none
  if (p.grouped) {
    if (kExact && p.group_lanes > 0) {
      // A group is L whole lanes: top-2 in registers, then across its lanes.
      const int L = p.group_lanes;
      float t1 = kNegInf, t2 = kNegInf;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float hi = fmaxf(t1, gv[i]);
        t2 = fmaxf(t2, fminf(t1, gv[i]));
        t1 = hi;
      }
      for (int o = 1; o < L; o <<= 1) {
        const float o1 = __shfl_xor_sync(kFull, t1, o), o2 = __shfl_xor_sync(kFull, t2, o);
        const float hi = fmaxf(t1, o1);
        t2 = fmaxf(fminf(t1, o1), fmaxf(t2, o2));
        t1 = hi;
      }
      // The group's rank: lane j of group g compares g's score with those
      // of the groups h = j, j + L, ... (ties: the lower group first), and the
      // L lanes of the group sum their counts.
      const float gs = p.group_size >= 2 ? t1 + t2 : t1;
      const int g = team.r >> p.group_lanes_log2, j = team.r & (L - 1);
      int rank = 0;
      for (int h0 = 0; h0 < p.n_group; h0 += L) {  // the same trips on every lane (the shuffles)
        const int h = h0 + j;
        const float o = team.from(gs, (h < p.n_group ? h : g) << p.group_lanes_log2);
        rank += h < p.n_group && ((o > gs) || (o == gs && h < g));
      }
      for (int o = 1; o < L; o <<= 1) rank += __shfl_xor_sync(kFull, rank, o);
      const bool kept = rank < p.topk_group;
      // A guess of the selection's threshold (below): the kept groups' top
      // two are 2 * topk_group distinct experts, so with k <= 2 * topk_group
      // the k-th largest key is at least the smallest kept second value.
      if (kept) group_t0 = order_key(t2 + 0.0f);
      if (!kept) {
#pragma unroll
        for (int i = 0; i < V; ++i) key[i] = 0u;
      }
    } else {
      // Any group size: the values through shared memory.
      float* tv = reinterpret_cast<float*>(warp_smem + p.candidate_bytes) + (lane / G) * (G * V);
      float* tg = tv + 32 * V;
      if (active) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (present[i]) tv[team.r * Vs + i] = gv[i];
      }
      __syncwarp();
      if (active) {
        for (int g = team.r; g < p.n_group; g += G) {
          float t1 = kNegInf, t2 = kNegInf;
          for (int e = g * p.group_size; e < (g + 1) * p.group_size; ++e) {
            const float x = tv[e];
            const float hi = fmaxf(t1, x);
            t2 = fmaxf(t2, fminf(t1, x));
            t1 = hi;
          }
          tg[g] = p.group_size >= 2 ? t1 + t2 : t1;
        }
      }
      __syncwarp();
      int* keep = reinterpret_cast<int*>(tv);  // tv is no longer read
      if (active) {
        for (int g = team.r; g < p.n_group; g += G) {
          const float gs = tg[g];
          int rank = 0;
          for (int h = 0; h < p.n_group; ++h) rank += (tg[h] > gs) || (tg[h] == gs && h < g);
          keep[g] = rank < p.topk_group;
        }
      }
      __syncwarp();
      if (active) {
        const int e0 = team.r * Vs;
        int g = e0 / p.group_size, off = e0 - g * p.group_size;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (present[i] && !keep[g]) key[i] = 0u;
          if (++off == p.group_size) {
            off = 0;
            ++g;
          }
        }
      }
    }
  }

  // Selection: slot j (j-th largest key, ties by lowest id) in lane j % G, entry j / G.
  int slot[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) slot[s] = 0;
  bool done = false;
  if constexpr (G == 32) {
    if (p.candidates) {
      // The candidates: the keys >= a threshold t0. Any t0 with at least k
      // keys at or above it keeps the k largest; at most 32 fit the ranking.
      int c = 0, incl = 0, C = 0;
      auto count_from = [&](uint32_t t0) {
        c = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) c += key[i] >= t0;
        incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(kFull, incl, o);
          if (lane >= o) incl += y;
        }
        C = __shfl_sync(kFull, incl, 31);
      };
      uint32_t t0 = 0;
      if (p.t0_from_groups) {  // the kept groups' guess (above), when it holds
        t0 = ::max(__reduce_min_sync(kFull, group_t0), 1u);
        count_from(t0);
      }
      if (!p.t0_from_groups || C < p.k || C > 32) {
        // A lower bound of the k-th largest key from the lane maxima lm. Each
        // lane's lm with its low 5 bits replaced by 31 - lane is unique, so
        // k - 1 rounds of a warp max each remove exactly one lane, and the
        // k-th largest of these values M has at least k lanes with
        // lm >= (M & ~31): that is t0 (at least 1, so that absent keys, 0,
        // never count; fewer than k lanes holding keys give t0 = 1, every key).
        uint32_t lm = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) lm = ::max(lm, key[i]);
        uint32_t mc = (lm & ~31u) | uint32_t(31 - lane);
#pragma unroll 4
        for (int j = 1; j < p.k; ++j) {
          const uint32_t M = __reduce_max_sync(kFull, mc);
          if (mc == M) mc = 0u;
        }
        t0 = ::max(__reduce_max_sync(kFull, mc) & ~31u, 1u);
        count_from(t0);
      }
      if (C <= 32) {
        // (key, ~id) as one 64-bit word: its order is the selection order.
        // Entries [0, C) the candidates, [C, 32) zeros (below every
        // candidate), [32, 64) each lane's scratch word, where a key that is
        // not a candidate is written (stores without branches).
        uint64_t* cand = reinterpret_cast<uint64_t*>(warp_smem);
        int* slots = reinterpret_cast<int*>(warp_smem + 64 * 8);
        int pos = incl - c;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const bool take = key[i] >= t0;
          cand[take ? pos : 32 + lane] = (uint64_t(key[i]) << 32) | uint64_t(~uint32_t(lane * Vs + i));
          pos += take;
        }
        if (lane >= C) cand[lane] = 0ull;
        __syncwarp();
        const uint64_t me = lane < C ? cand[lane] : 0ull;
        int rank = 0;
        for (int q = 0; q < C; q += 4) {  // entries up to C rounded up to 4: zeros past C
          const ulonglong2 a = *reinterpret_cast<const ulonglong2*>(cand + q);
          const ulonglong2 b = *reinterpret_cast<const ulonglong2*>(cand + q + 2);
          rank += int(a.x > me) + int(a.y > me) + int(b.x > me) + int(b.y > me);
        }
        if (lane < C && rank < p.k) slots[rank] = int(~uint32_t(me));
        __syncwarp();
        slot[0] = lane < p.k ? slots[lane] : 0;
        done = true;
      }
    }
  }
  if (!done) {
    // k rounds of a team-wide arg-max over the lanes' local maxima.
    uint32_t lm = 0u;
    int li = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (key[i] > lm) {
        lm = key[i];
        li = i;
      }
    }
    for (int j = 0; j < p.k; ++j) {
      const uint32_t M = team.max(lm);
      const int w = team.first(lm == M);  // lowest lane = lowest id among equal maxima
      const int id = w * Vs + team.from(li, w);
      if ((j & (G - 1)) == team.r) {
        const int s = j / G;
#pragma unroll
        for (int q = 0; q < kSlots; ++q)
          if (q == s) slot[q] = id;
      }
      if (team.r == w) {
        uint32_t nm = 0u;
        int ni = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const uint32_t x = i == li ? 0u : key[i];
          key[i] = x;
          if (x > nm) {
            nm = x;
            ni = i;
          }
        }
        lm = nm;
        li = ni;
      }
    }
  }

  // Weights, from the chosen experts' logits (read again: in L1 by now; the
  // relative softmaxes read them twice rather than hold kSlots more registers).
  auto has = [&](int s) { return active && s * G + team.r < p.k; };
  auto chosen_logit = [&](int s) { return has(s) ? sanitize(dev::to_float(__ldg(row + slot[s]))) : kNegInf; };
  float base[kSlots];
  if constexpr (S == MoeRouterScoring::kSigmoid || S == MoeRouterScoring::kSqrtSoftplus) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) base[s] = has(s) ? score_of<S>(chosen_logit(s)) : 0.0f;
  } else {
    if (kSoftmax && !p.renormalize) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s)
        base[s] = has(s) && m != kNegInf ? __expf(chosen_logit(s) - m) * inv_z : 0.0f;
    } else {
      // Softmax over the chosen (renormalised softmax, or softmax after top-k):
      // relative to the largest chosen logit.
      float mr = kNegInf;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) mr = fmaxf(mr, chosen_logit(s));
      mr = team.fmax(mr);
#pragma unroll
      for (int s = 0; s < kSlots; ++s)
        base[s] = has(s) && mr != kNegInf ? __expf(chosen_logit(s) - mr) : 0.0f;
    }
  }
  float f = p.scale;
  if (S == MoeRouterScoring::kSoftmaxAfterTopk || p.renormalize) {
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) sum += base[s];
    sum = team.sum(sum);
    f = sum > 0.0f ? p.scale / sum : 0.0f;
  }
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (has(s)) {
      const int64_t o = t * p.k + s * G + team.r;
      p.ids[o] = slot[s];
      p.weights[o] = base[s] * f;
    }
  }
}

// Groups for the thread-a-token kernel: GS experts a group (8 / n_group),
// each group's top-2 sum, its rank (ties: the lower group first), the keys
// of the groups outside the topk_group best set to 0. The same sums and
// comparisons as the team kernel's shared-memory path.
template <int GS>
__device__ __forceinline__ void keep_groups_in_thread(const float (&gv)[8], uint32_t (&key)[8], int topk_group) {
  constexpr int NG = 8 / GS;
  float score[NG];
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    float t1 = -INFINITY, t2 = -INFINITY;
#pragma unroll
    for (int e = g * GS; e < (g + 1) * GS; ++e) {
      const float hi = fmaxf(t1, gv[e]);
      t2 = fmaxf(t2, fminf(t1, gv[e]));
      t1 = hi;
    }
    score[g] = GS >= 2 ? t1 + t2 : t1;
  }
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    int rank = 0;
#pragma unroll
    for (int h = 0; h < NG; ++h) rank += (score[h] > score[g]) || (score[h] == score[g] && h < g);
    if (rank >= topk_group) {
#pragma unroll
      for (int e = g * GS; e < (g + 1) * GS; ++e) key[e] = 0u;
    }
  }
}

// E = 8, a thread a token (the (1, 8) layout): the team kernel's steps with
// every index known at compile time. The k rounds take the arg-max of the
// eight keys by a three-level tree (the higher index only when strictly
// larger: ties to the lowest id) and carry the chosen logit along, so the
// weights need no second read of the row. Same arithmetic, in the same
// order, as the team kernel's (1, 8) form had (ncu, H200, Mixtral T = 8192,
// k = 2: ~1,050 instructions a token there, 78 registers).
template <typename T, MoeRouterScoring S>
__global__ void __launch_bounds__(kThreads) moe_router_thread_kernel(const Params p) {
  constexpr int V = 8;
  constexpr float kNegInf = -INFINITY;
  constexpr bool kSoftmax = S == MoeRouterScoring::kSoftmax;
  const int64_t t = int64_t(blockIdx.x) * kThreads + int64_t(threadIdx.x);

  dev::grid_dependency_wait();  // the logits may come from the kernel before us on the stream
  if (t >= p.T) return;
  float l[V];
  load_chunk<T, V>(static_cast<const T*>(p.logits) + t * V, l);
  float b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) b[i] = 0.0f;
  const bool has_bias = p.bias != nullptr;
  if (has_bias) {
    if (p.bias_vec) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(p.bias)),
                   hi = __ldg(reinterpret_cast<const float4*>(p.bias) + 1);
      b[0] = lo.x, b[1] = lo.y, b[2] = lo.z, b[3] = lo.w, b[4] = hi.x, b[5] = hi.y, b[6] = hi.z, b[7] = hi.w;
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) b[i] = __ldg(p.bias + i);
    }
  }
  dev::allow_dependents_launch();
#pragma unroll
  for (int i = 0; i < V; ++i) l[i] = sanitize(l[i]);

  const bool need_scores = has_bias || p.grouped;
  float m = kNegInf, inv_z = 0.0f;
  if (kSoftmax && (need_scores || !p.renormalize)) {
#pragma unroll
    for (int i = 0; i < V; ++i) m = fmaxf(m, l[i]);
    float z = 0.0f;
    if (m != kNegInf) {
#pragma unroll
      for (int i = 0; i < V; ++i) z += __expf(l[i] - m);
    }
    inv_z = m != kNegInf ? 1.0f / z : 0.0f;
  }
  uint32_t key[V];
  float gv[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    gv[i] = selection_value<S>(l[i], b[i], need_scores, m, inv_z);
    key[i] = order_key(has_bias ? gv[i] : l[i]);
  }
  if (p.grouped) {  // n_group in {2, 4, 8} (it divides 8, and topk_group < n_group)
    if (p.group_size == 4) keep_groups_in_thread<4>(gv, key, p.topk_group);
    else if (p.group_size == 2) keep_groups_in_thread<2>(gv, key, p.topk_group);
    else keep_groups_in_thread<1>(gv, key, p.topk_group);
  }

  // Selection: slot j the j-th largest key (every chosen key is nonzero: the
  // kept groups hold at least k experts), its logit carried along.
  int id[V];
  float lc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    id[j] = 0;
    lc[j] = kNegInf;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (j >= p.k) break;
    uint32_t k1[4], k2[2];
    int i1[4], i2[2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const bool hi = key[2 * q + 1] > key[2 * q];
      k1[q] = hi ? key[2 * q + 1] : key[2 * q];
      i1[q] = hi ? 2 * q + 1 : 2 * q;
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const bool hi = k1[2 * q + 1] > k1[2 * q];
      k2[q] = hi ? k1[2 * q + 1] : k1[2 * q];
      i2[q] = hi ? i1[2 * q + 1] : i1[2 * q];
    }
    const int w = k2[1] > k2[0] ? i2[1] : i2[0];
    float lw = kNegInf;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (i == w) {
        lw = l[i];
        key[i] = 0u;
      }
    }
    id[j] = w;
    lc[j] = lw;
  }

  // Weights (as the team kernel computes them, summed in slot order).
  float base[V];
  if constexpr (S == MoeRouterScoring::kSigmoid || S == MoeRouterScoring::kSqrtSoftplus) {
#pragma unroll
    for (int j = 0; j < V; ++j) base[j] = j < p.k ? score_of<S>(lc[j]) : 0.0f;
  } else if (kSoftmax && !p.renormalize) {
#pragma unroll
    for (int j = 0; j < V; ++j) base[j] = j < p.k && m != kNegInf ? __expf(lc[j] - m) * inv_z : 0.0f;
  } else {
    float mr = kNegInf;
#pragma unroll
    for (int j = 0; j < V; ++j) mr = fmaxf(mr, lc[j]);  // lc = -inf past k
#pragma unroll
    for (int j = 0; j < V; ++j) base[j] = j < p.k && mr != kNegInf ? __expf(lc[j] - mr) : 0.0f;
  }
  float f = p.scale;
  if (S == MoeRouterScoring::kSoftmaxAfterTopk || p.renormalize) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) sum += base[j];
    f = sum > 0.0f ? p.scale / sum : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (j < p.k) {
      p.ids[t * p.k + j] = id[j];
      p.weights[t * p.k + j] = base[j] * f;
    }
  }
}

// Calls f with the scoring as a compile-time constant
// (std::integral_constant<MoeRouterScoring, S>): the one switch both
// launchers take their kernel instantiation from.
template <class F>
cudaError_t with_scoring(MoeRouterScoring s, F&& f) {
  using S = MoeRouterScoring;
  switch (s) {
    case S::kSoftmax: return f(std::integral_constant<S, S::kSoftmax>{});
    case S::kSigmoid: return f(std::integral_constant<S, S::kSigmoid>{});
    case S::kSqrtSoftplus: return f(std::integral_constant<S, S::kSqrtSoftplus>{});
    default: return f(std::integral_constant<S, S::kSoftmaxAfterTopk>{});
  }
}

// ---- hash selection (SPEC §8.7) ---------------------------------------------
//
// No choice to make: token t's experts are row token_ids[t] of the table. A
// team of 16 lanes takes a token (k <= 16), lane j its slot j: the slot's
// expert, its logit and score, and the team's sums for the weights (the same
// fixed butterfly as above). Softmax without renormalising needs the whole
// row's maximum and sum: the team reads the row once for each (the second
// read from L1).
constexpr int kHashG = 16;

struct HashParams {
  const void* logits;
  const int32_t* table;
  const void* token_ids;
  int64_t vocab;
  int32_t* ids;
  float* weights;
  int64_t T;
  int E;
  int k;
  float scale;
  bool renormalize;
};

template <typename T, typename Id, MoeRouterScoring S>
__global__ void __launch_bounds__(kThreads) moe_router_hash_kernel(const HashParams p) {
  constexpr float kNegInf = -INFINITY;
  // The row's softmax, or (renormalised softmax, softmax after top-k) the
  // chosen logits' own: the same weights in exact arithmetic.
  const bool row_softmax = S == MoeRouterScoring::kSoftmax && !p.renormalize;
  const bool relative = S == MoeRouterScoring::kSoftmaxAfterTopk ||
                        (S == MoeRouterScoring::kSoftmax && p.renormalize);
  const Team<kHashG> team;
  const int64_t t = int64_t(blockIdx.x) * (kThreads / kHashG) + int64_t(threadIdx.x / kHashG);
  const bool active = t < p.T;
  const bool mine = active && team.r < p.k;

  // The ids, the table and the logits may come from the kernels before us.
  dev::grid_dependency_wait();
  if (!__any_sync(kFull, active)) return;
  const T* row = static_cast<const T*>(p.logits) + (active ? t : 0) * p.E;
  int e = -1;
  float l = kNegInf;
  if (mine) {
    const int64_t id = int64_t(__ldg(static_cast<const Id*>(p.token_ids) + t));
    if (id >= 0 && id < p.vocab) {
      const int32_t x = __ldg(p.table + id * p.k + team.r);
      if (x >= 0 && x < p.E) {
        e = x;
        l = sanitize(dev::to_float(__ldg(row + x)));
      }
    }
  }
  float m = kNegInf, inv_z = 0.0f;
  if (row_softmax) {
    if (active)
      for (int i = team.r; i < p.E; i += kHashG) m = fmaxf(m, sanitize(dev::to_float(__ldg(row + i))));
    m = team.fmax(m);
    float z = 0.0f;
    if (active && m != kNegInf)
      for (int i = team.r; i < p.E; i += kHashG) z += __expf(sanitize(dev::to_float(__ldg(row + i))) - m);
    z = team.sum(z);
    inv_z = m != kNegInf ? 1.0f / z : 0.0f;  // z >= 1 (the largest term is 1)
  }
  dev::allow_dependents_launch();

  float w;
  if (S == MoeRouterScoring::kSigmoid || S == MoeRouterScoring::kSqrtSoftplus) {
    w = e >= 0 ? score_of<S>(l) : 0.0f;
  } else if (relative) {
    const float mr = team.fmax(l);  // absent slots hold -inf
    w = e >= 0 && mr != kNegInf ? __expf(l - mr) : 0.0f;
  } else {
    w = e >= 0 && m != kNegInf ? __expf(l - m) * inv_z : 0.0f;
  }
  float f = p.scale;
  if (relative || p.renormalize) {
    const float sum = team.sum(w);
    f = sum > 0.0f ? p.scale / sum : 0.0f;
  }
  if (mine) {
    const int64_t o = t * p.k + team.r;
    p.ids[o] = e;
    p.weights[o] = w * f;
  }
}

template <typename T, typename Id>
cudaError_t launch_hash(const MoeRouterArgs& a, const HashParams& p, cudaStream_t stream) {
  const unsigned blocks = unsigned((p.T + kThreads / kHashG - 1) / (kThreads / kHashG));
  return with_scoring(a.scoring, [&](auto s) {
    return dev::launch(moe_router_hash_kernel<T, Id, decltype(s)::value>, dim3(blocks), dim3(kThreads), 0, stream,
                       a.enable_pdl, p);
  });
}

Status run_hash_router(const MoeRouterArgs& a, cudaStream_t stream) {
  HashParams p{};
  p.logits = a.logits;
  p.table = a.hash_table;
  p.token_ids = a.token_ids;
  p.vocab = a.vocab_size;
  p.ids = a.token_selected_experts;
  p.weights = a.token_final_scales;
  p.T = a.num_tokens;
  p.E = a.num_experts;
  p.k = a.k;
  p.scale = a.routed_scaling_factor;
  p.renormalize = a.renormalize;
  cudaError_t err;
  if (a.logits_dtype == DType::kFloat32)
    err = a.token_ids_int64 ? launch_hash<float, int64_t>(a, p, stream) : launch_hash<float, int32_t>(a, p, stream);
  else
    err = a.token_ids_int64 ? launch_hash<__nv_bfloat16, int64_t>(a, p, stream)
                            : launch_hash<__nv_bfloat16, int32_t>(a, p, stream);
  FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "kernel launch"));
  return detail::check_launch(kOp);
}

// ---- host side -------------------------------------------------------------

struct Layout {
  int G = 32, V = 16;
  bool exact = false;
};

// The exact layout for E, if the logits pointer is aligned for its vectors.
Layout choose_layout(const MoeRouterArgs& a) {
  Layout g;  // the general layout
  if (a.tuning.generic_layout) return g;
  static const Layout kExact[] = {{1, 8, true}, {8, 8, true}, {16, 8, true},
                                  {32, 8, true}, {32, 12, true}, {32, 16, true}};
  const int es = int(dtype_size(a.logits_dtype));
  for (const Layout& x : kExact) {
    if (x.G * x.V != a.num_experts) continue;
    const int bytes = x.V * es;
    const int w = bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(a.logits) % uintptr_t(w) == 0) return x;
  }
  return g;
}

template <typename T, int G, int V, bool kExact, MoeRouterScoring S>
cudaError_t launch_kernel(const Params& p, cudaStream_t stream, bool pdl) {
  const int64_t per_block = kThreads / G;
  const unsigned blocks = unsigned((p.T + per_block - 1) / per_block);
  return dev::launch(moe_router_kernel<T, G, V, kExact, S>, dim3(blocks), dim3(kThreads),
                     size_t(kWarps) * size_t(p.warp_smem), stream, pdl, p);
}

template <typename T, MoeRouterScoring S>
cudaError_t launch_layout(const Layout& g, const Params& p, cudaStream_t stream, bool pdl) {
  if (!g.exact) return launch_kernel<T, 32, 16, false, S>(p, stream, pdl);
  switch (g.G * 100 + g.V) {
    case 108: {
      const unsigned blocks = unsigned((p.T + kThreads - 1) / kThreads);
      return dev::launch(moe_router_thread_kernel<T, S>, dim3(blocks), dim3(kThreads), 0, stream, pdl, p);
    }
    case 808: return launch_kernel<T, 8, 8, true, S>(p, stream, pdl);
    case 1608: return launch_kernel<T, 16, 8, true, S>(p, stream, pdl);
    case 3208: return launch_kernel<T, 32, 8, true, S>(p, stream, pdl);
    case 3212: return launch_kernel<T, 32, 12, true, S>(p, stream, pdl);
    default: return launch_kernel<T, 32, 16, true, S>(p, stream, pdl);
  }
}

template <typename T>
cudaError_t launch_scoring(const MoeRouterArgs& a, const Layout& g, const Params& p, cudaStream_t stream) {
  return with_scoring(a.scoring,
                      [&](auto s) { return launch_layout<T, decltype(s)::value>(g, p, stream, a.enable_pdl); });
}

Status run_router(const MoeRouterArgs& a, cudaStream_t stream) {
  const Layout g = choose_layout(a);
  Params p{};
  p.logits = a.logits;
  p.bias = a.correction_bias;
  p.ids = a.token_selected_experts;
  p.weights = a.token_final_scales;
  p.T = a.num_tokens;
  p.E = a.num_experts;
  p.k = a.k;
  p.V = g.exact ? g.V : (a.num_experts + 31) / 32;
  p.n_group = a.n_group;
  p.topk_group = a.topk_group;
  p.group_size = a.num_experts / a.n_group;
  p.grouped = a.topk_group < a.n_group;
  p.group_lanes = 0;
  if (p.grouped && g.exact && p.group_size % g.V == 0) {
    const int L = p.group_size / g.V;
    if ((L & (L - 1)) == 0 && L <= g.G) {
      p.group_lanes = L;
      while ((1 << p.group_lanes_log2) < L) ++p.group_lanes_log2;
    }
  }
  p.scale = a.routed_scaling_factor;
  p.renormalize = a.renormalize;
  p.bias_vec = reinterpret_cast<uintptr_t>(a.correction_bias) % 16 == 0;
  p.candidates = g.G == 32 && a.tuning.path != 1;
  p.t0_from_groups = p.candidates && p.group_lanes > 0 && a.correction_bias != nullptr && p.group_size >= 2 &&
                     2 * int64_t(a.topk_group) >= a.k;
  // Shared memory only where it is used: the candidates' space on their path.
  p.candidate_bytes = p.candidates ? kCandidateBytes : 0;
  p.warp_smem = p.candidate_bytes + (p.grouped && p.group_lanes == 0 ? 2 * 32 * g.V * 4 : 0);

  const cudaError_t err = a.logits_dtype == DType::kFloat32
                              ? launch_scoring<float>(a, g, p, stream)
                              : launch_scoring<__nv_bfloat16>(a, g, p, stream);
  FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "kernel launch"));
  return detail::check_launch(kOp);
}

}  // namespace

int detail::router_tokens_per_block(const MoeRouterArgs& a) {
  return kThreads / (a.hash_table != nullptr ? kHashG : choose_layout(a).G);
}

Status moe_router(const MoeRouterArgs& a, cudaStream_t stream) {
  return detail::gpu_entry(kOp, validate_moe_router(a), stream, a.num_tokens == 0, [&] {
    return a.hash_table != nullptr ? run_hash_router(a, stream) : run_router(a, stream);
  });
}

}  // namespace flashmix
