// finalize_moe_routing (spec §2): un-permute the expert outputs, weight them
// by the router, reduce the top-k, add bias and an optional shared output.
//
//   out[t, c] = sum over local slots j (in order j = 0..k-1) of
//                 w[t, j] * (rows[u2p[j*T + t], c] + bias[e - start, c])   (+ shared_output[t, c])
//
// Roofline: memory bound. It must read every local row once (P rows x H) and
// write T x H outputs (tokens with a local slot only, when not filling); the
// index and scale reads are k*T*12 bytes. At T=8192, k=8, H=7168 in bf16 that
// is 0.94 GB read + 0.12 GB written: 249 us at the H200's 4.25 TB/s of copy
// bandwidth; this kernel takes 250-260 us there (docs/moe_finalize.md).
// Everything else (bias rows) stays in L2.
//
// Work decomposition: a work item is (output row, chunk of its columns) and
// belongs to one warp. The warp resolves the item's local slots (expert,
// permuted row, weight: lane j reads slot j) into its own shared-memory
// record, then each lane reduces U 16-byte column vectors over those slots.
// Three ways to keep HBM busy, chosen at the boundary:
//  - 16-byte rows, no bias: the row vectors are staged through a per-warp
//    cp.async ring in shared memory (bytes in flight cost no registers);
//  - bias: register loads, kLoadsInFlight at a time, with an L2 prefetch of
//    the next group;
//  - rows not on the 16-byte grid (odd strides, offset pointers): the
//    register path with 16-byte loads realigned across lanes;
//  - decode-sized work: all of a lane's slot loads at once (one round trip).
// Warps never wait for each other (no block barrier), so one warp's index
// round trip overlaps other warps' row loads. The grid is persistent (at most
// one wave of resident blocks); its warps walk the items:
//  - filling:   items are T x chunks; every token is written.
//  - no-filling: items are (local permuted row p) x chunks, with the local row
//    count read on the device from expert_first_token_offset[E_local]; a
//    token is handled by the item of its first local slot, the others skip.
//    The cost follows the local rows, not T.
// The summation order is the same on every path (vector, narrow, tail) and for
// every tuning, so results are bitwise reproducible and independent of tuning.
#include <algorithm>

#include "common/check.h"
#include "common/launch.cuh"
#include "common/kernel_fit.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "flashmix/moe.h"
#include "moe/finalize_moe_routing_internal.h"

namespace flashmix {
namespace {

constexpr const char* kOp = "finalize_moe_routing";
// Row (and bias) vectors a lane holds in registers before their first use;
// with the L2 prefetch of the next group below, twice that is in flight.
// More would spill at the register cap that keeps 24 warps per SM resident.
constexpr int kLoadsInFlight = 4;
constexpr int kDecodeLoadsInFlight = 8;  // decode: all of k = 8's rows at once
// Bias with 16-byte vectors: 4 rows + their 4 bias vectors per group (up to
// 128 registers, fewer warps, twice the loads in flight per warp).
constexpr int kBiasLoadsInFlight = 8;
// The async path: a ring of kFinalizeStages stages per warp, each holding
// kFinalizeStageVectors 16-byte vectors per lane (8 KB per warp).
constexpr int kFinalizeStages = 4;
constexpr int kFinalizeStageVectors = 4;
constexpr int kFinalizeRingVectors = kFinalizeStages * kFinalizeStageVectors * 32;
// Token blocks (16-byte rows, no bias) once T >= this many tokens per SM;
// below it the persistent warps spread each row over many warps (H100:
// token blocks 0.875 of copy at T = 1024, k = 8, H = 7168, 7.8 tokens per
// SM, against 0.840; at T = 64 6.8 against 5.6 us).
constexpr int kTokenBlocksPerSm = 7;

struct FinalizeParams {
  const void* rows;
  const void* bias;
  const void* shared;
  void* out;
  const int32_t* u2p;
  const int32_t* experts;
  const float* scales;
  const int32_t* p2u;
  const int64_t* expert_offsets;
  int64_t rows_stride, bias_stride, shared_stride, out_stride;
  int64_t num_tokens;
  int64_t items_bound;  // items the grid may have to walk (filling: all of them)
  int hidden;
  int k;
  int start_expert;
  int num_local_experts;
  int vectors;     // full V-element vectors per row; columns [vectors*V, hidden) are the tail
  int chunks;      // chunks per output row
  int chunk_vecs;  // vectors per chunk
  bool fill;
  bool prefetch_indices;  // the index loads of the first items go out before the grid dependency wait
  bool out_vectors;  // out (and shared_output) aligned for V-element vectors; else element stores
  // Realigned path: rows / bias point at the 16-byte boundary at or below
  // the caller's pointer, and these are the caller's pointers' distances from
  // it in elements (folded into every row offset). 0 on the other paths.
  int rows_shift, bias_shift;
};

// The local slots of one work item, in slot order.
struct SlotMeta {
  int64_t row_offset[kMaxFinalizeK];   // element offset of the permuted row
  int64_t bias_offset[kMaxFinalizeK];  // element offset of the expert's bias row
  float weight[kMaxFinalizeK];
  int64_t token;
  int count;  // local slots
};

// Where an item's slots are read from: its token and, when not filling, the
// slot of the permuted row that names the item.
struct ItemKey {
  int64_t token;
  int first_slot;  // -1 when filling
};

__device__ __forceinline__ ItemKey item_key(const FinalizeParams& p, int64_t key, int32_t unpermuted) {
  if (p.fill) return {key, -1};
  // T * k fits in int32 (validated): 32-bit division suffices.
  const int32_t T = int32_t(p.num_tokens);
  return {unpermuted % T, unpermuted / T};
}

// Lane j's view of slot j of an item, loaded two items ahead of its use so the
// index round trip overlaps earlier items' row loads.
struct SlotLoad {
  int expert;
  int32_t row;
  float weight;
};

__device__ __forceinline__ SlotLoad load_slot(const FinalizeParams& p, int64_t t) {
  const int lane = threadIdx.x & 31;
  const bool in_k = lane < p.k;
  // Independent loads, issued together. Reading u2p of a non-local slot is
  // harmless (in bounds, unused).
  SlotLoad s;
  s.expert = in_k ? p.experts[t * p.k + lane] : -1;
  s.row = in_k ? p.u2p[int64_t(lane) * p.num_tokens + t] : 0;
  s.weight = (in_k && p.scales) ? p.scales[t * p.k + lane] : 1.0f;
  return s;
}

// One warp. Compacts the item's local slots into the warp's record m, in slot
// order. Returns false when the item is skipped (no-filling: the token belongs
// to the item of its first local slot). kRealign: the offsets include the
// pointers' distances from their 16-byte boundary (the other paths' code is
// left exactly as it was: the bias path's speed has moved with code changes
// as small as an unused branch).
// kEveryToken: the item is the token itself (a block per token), never skipped.
template <bool kRealign, bool kEveryToken = false>
__device__ __forceinline__ bool resolve_slots(const FinalizeParams& p, const ItemKey& key, const SlotLoad& s,
                                              SlotMeta& m) {
  const int lane = threadIdx.x & 31;
  const bool local = lane < p.k && s.expert >= p.start_expert && s.expert - p.start_expert < p.num_local_experts;
  const unsigned mask = __ballot_sync(dev::kFullMask, local);
  if (!kEveryToken && !p.fill && __ffs(mask) - 1 != key.first_slot) return false;  // uniform across the warp
  if (local) {
    const int slot = __popc(mask & ((1u << lane) - 1u));
    m.row_offset[slot] = (kRealign ? p.rows_shift : 0) + int64_t(s.row) * p.rows_stride;
    m.bias_offset[slot] = (kRealign ? p.bias_shift : 0) + int64_t(s.expert - p.start_expert) * p.bias_stride;
    m.weight[slot] = s.weight;
  }
  if (lane == 0) {
    m.count = __popc(mask);
    m.token = key.token;
  }
  __syncwarp();
  return true;
}

// One slot's contribution, the same arithmetic on every path:
// acc += w * (x + b), rounded as written (no contraction across the two steps).
__device__ __forceinline__ float accumulate(float acc, float w, float x) { return fmaf(w, x, acc); }
__device__ __forceinline__ float with_bias(float x, float b) { return __fadd_rn(x, b); }

// Writes one V-element output vector (+ shared_output), rounding once.
template <typename Out, int V>
__device__ __forceinline__ void store_output(const FinalizeParams& p, Out* out, const Out* shared, int64_t token,
                                             int64_t col, const float (&acc)[V]) {
  if (p.out_vectors) {
    dev::Vec<Out, V> o;
    if (shared) {
      const dev::Vec<Out, V> sh = dev::load_ro<Out, V>(shared + token * p.shared_stride + col);
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = dev::from_float<Out>(__fadd_rn(acc[e], dev::to_float(sh.v[e])));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = dev::from_float<Out>(acc[e]);
    }
    dev::store<Out, V>(out + col, o);
  } else {  // the output row is not aligned for vectors: element stores
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float r = acc[e];
      if (shared) r = __fadd_rn(r, dev::to_float(shared[token * p.shared_stride + col + e]));
      out[col + e] = dev::from_float<Out>(r);
    }
  }
}

// The realigned path's store of one warp pass (all 32 lanes call it; lane l
// < 31 holds output vector v = first + l when v < v_end) into an output row
// that is not on the 16-byte grid: 16-byte stores realigned across lanes
// (dev::realigned_store), the run's two ends element by element. A
// shared_output row off the grid is read the way the rows are (aligned
// vectors, the neighbour's by a shuffle), and the arithmetic is store_output's.
// In place (shared_output == out) each lane reads only columns no lane has
// written yet: the pass's loads precede its stores, and the bytes an aligned
// load takes from the previous pass are ones it does not use.
template <typename Out, int V>
__device__ __forceinline__ void store_output_realigned(const FinalizeParams& p, int64_t token, int v, int v_end,
                                                       const float (&acc)[V]) {
  static_assert(sizeof(Out) * V == 16, "16-byte output vectors");
  const int lane = threadIdx.x & 31;
  // Elements of a row pointer past its 16-byte boundary (warp-uniform).
  auto shift_of = [](const void* row) { return int(reinterpret_cast<uintptr_t>(row) / sizeof(Out)) & (V - 1); };
  float r[V];
#pragma unroll
  for (int e = 0; e < V; ++e) r[e] = acc[e];
  if (p.shared) {
    const Out* srow = static_cast<const Out*>(p.shared) + token * p.shared_stride;
    const int ms = shift_of(srow);
    uint4 lo = make_uint4(0, 0, 0, 0);
    // Up to the vector after the run's last: in the row (p.vectors leaves it room).
    if (v <= v_end) {
      const dev::Vec<Out, V> x = dev::load_ro<Out, V>(srow - ms + int64_t(v) * V);
      lo = reinterpret_cast<const uint4&>(x);
    }
    const dev::Vec<Out, V> sh = dev::realign_with_next_lane<Out, V>(lo, ms);
#pragma unroll
    for (int e = 0; e < V; ++e) r[e] = __fadd_rn(r[e], dev::to_float(sh.v[e]));
  }
  dev::Vec<Out, V> o;
#pragma unroll
  for (int e = 0; e < V; ++e) o.v[e] = dev::from_float<Out>(r[e]);
  const uint4 own = reinterpret_cast<const uint4&>(o);
  const uint4 prev = dev::shfl16(own, true);
  Out* orow = static_cast<Out*>(p.out) + token * p.out_stride;
  const int mo = shift_of(orow);
  if (lane < 31 && v < v_end) {
    const dev::RealignedStore plan = dev::realigned_store(lane, lane == 30 || v + 1 == v_end, mo, V);
    if (plan.vector)
      dev::store<Out, V>(orow - mo + int64_t(v) * V, mo == 0 ? o : dev::realign16<Out, V>(prev, own, V - mo));
#pragma unroll
    for (int e = 0; e < V; ++e)  // constant indices: o stays in registers
      if (e >= plan.first && e < plan.last) orow[int64_t(v) * V + e] = o.v[e];
  }
}

// The register path. kRealign: rows (and bias rows) that are not 16-byte
// aligned, read with 16-byte loads all the same: lane l loads the aligned
// vector at its position and lanes 0..30 combine it with lane l+1's
// (realign16), so a pass yields 31 vectors per u from 32 loads. One load in
// 32 is read twice (an L1/L2 hit); the alternative, element loads, ran at
// 0.26 of copy (H = 7003).
template <typename In, typename Out, int V, int U, bool kBias, int kLoads, bool kRealign>
__device__ __forceinline__ void reduce_vectors(const FinalizeParams& p, const SlotMeta& m, int chunk) {
  static_assert(!kRealign || sizeof(In) * V == 16, "realigned loads are 16-byte vectors");
  // Slots per load group: kLoads vectors (row and bias) per thread.
  constexpr int kPerSlot = U * (kBias ? 2 : 1);
  constexpr int G = kLoads / kPerSlot > 0 ? kLoads / kPerSlot : 1;
  constexpr int kLanesOut = kRealign ? 31 : 32;  // lanes that produce a vector per u
  constexpr int kStep = kLanesOut * U;
  const In* rows = static_cast<const In*>(p.rows);
  const In* bias = static_cast<const In*>(p.bias);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  const int count = m.count;
  const int lane = threadIdx.x & 31;
  const int v_begin = chunk * p.chunk_vecs;
  const int v_end = min(p.vectors, v_begin + p.chunk_vecs);
  // Realigned: the vector after the last one produced is loaded too (it is
  // the last lane's `hi`; in bounds since p.vectors leaves a vector's room).
  const int v_load_end = kRealign ? v_end + 1 : v_end;
  // Element offset of a row's 16-byte boundary at or below its start, and
  // the start's distance from it (warp-uniform, 0 off the realigned path).
  auto aligned = [](int64_t off) { return kRealign ? off & ~int64_t(V - 1) : off; };
  auto shift = [](int64_t off) { return kRealign ? int(off & (V - 1)) : 0; };
  auto realigned = [](const dev::Vec<In, V>& x, int sh) {
    if constexpr (kRealign) {
      return dev::realign_with_next_lane<In, V>(reinterpret_cast<const uint4&>(x), sh);
    } else {
      return x;
    }
  };
  // Realigned passes are warp-uniform (every lane shuffles); otherwise a
  // lane stops after its own last vector.
  const int v_first = kRealign ? v_begin : v_begin + lane;
  const int lane_v = kRealign ? lane : 0;
  for (int v0 = v_first; v0 < v_end; v0 += kStep) {
    float acc[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
#pragma unroll 1
    for (int s0 = 0; s0 < count; s0 += G) {
      dev::Vec<In, V> x[G][U];
      dev::Vec<In, V> b[G][kBias ? U : 1];
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int v = v0 + lane_v + u * kLanesOut;
          if (s0 + g < count && v < v_load_end) {
            x[g][u] = dev::load_stream<In, V>(rows + aligned(m.row_offset[s0 + g]) + int64_t(v) * V);
            if constexpr (kBias) b[g][u] = dev::load_ro<In, V>(bias + aligned(m.bias_offset[s0 + g]) + int64_t(v) * V);
          }
        }
      // Ask L2 for the next group's rows (wrapping to the next pass of the
      // lane) while this group's loads are outstanding: more bytes in flight
      // without more registers.
#pragma unroll
      for (int g = 0; g < G; ++g) {
        int s = s0 + G + g, vv = v0 + lane_v;
        if (s >= count) {
          s -= count;
          vv += kStep;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (s < count && vv + u * kLanesOut < v_end)
            dev::prefetch_l2(rows + m.row_offset[s] + int64_t(vv + u * kLanesOut) * V);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (s0 + g >= count) break;  // uniform across the warp
        const float w = m.weight[s0 + g];
        const int row_shift = shift(m.row_offset[s0 + g]);
        const int bias_shift = kBias ? shift(m.bias_offset[s0 + g]) : 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const dev::Vec<In, V> xr = realigned(x[g][u], row_shift);
          dev::Vec<In, V> br;
          if constexpr (kBias) br = realigned(b[g][u], bias_shift);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float xv = dev::to_float(xr.v[e]);
            if constexpr (kBias) xv = with_bias(xv, dev::to_float(br.v[e]));
            acc[u][e] = accumulate(acc[u][e], w, xv);
          }
        }
      }
    }
    if constexpr (kRealign && sizeof(Out) * V == 16) {
      static_assert(U == 1, "the realigned path takes one vector per lane");
      if (!p.out_vectors) {  // uniform: the output rows are off the 16-byte grid too
        store_output_realigned<Out, V>(p, m.token, v0 + lane, v_end, acc[0]);
        continue;
      }
    }
    if (lane < kLanesOut) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + lane_v + u * kLanesOut;
        if (v >= v_end) break;
        store_output<Out, V>(p, out, shared, m.token, int64_t(v) * V, acc[u]);
      }
    }
  }
}

// The 16-byte-vector path without bias. A lane's row vectors are staged
// through a per-warp shared-memory ring with cp.async, kFinalizeStages - 1
// stages of kFinalizeStageVectors vectors ahead of their use. The bytes in
// flight then live in shared memory instead of registers, so each SM keeps
// ~150 KB of row reads outstanding (what HBM needs to run at full rate).
// A lane reads back only what it copied itself: cp.async.wait_group
// suffices, no barrier. The arithmetic and its order are those of
// reduce_vectors. Two stage layouts, chosen per item (uniform per warp):

// The 16-byte-vector path for items with at least a stage's worth of local
// slots: each stage holds G = kFinalizeStageVectors / U slots of one pass, so
// a pass spans ceil(count / G) stages.
template <typename In, typename Out, int V, int U>
__device__ __forceinline__ void reduce_vectors_async_grouped(const FinalizeParams& p, const SlotMeta& m, int chunk,
                                                     uint4* ring) {
  static_assert(sizeof(In) * V == 16, "the async path moves 16-byte vectors");
  constexpr int G = kFinalizeStageVectors / U > 0 ? kFinalizeStageVectors / U : 1;
  constexpr int kStep = 32 * U;
  const In* rows = static_cast<const In*>(p.rows);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  const int count = m.count;
  const int lane = threadIdx.x & 31;
  const int v_begin = chunk * p.chunk_vecs;
  const int v_end = min(p.vectors, v_begin + p.chunk_vecs);
  const int passes = (v_end - v_begin + kStep - 1) / kStep;
  const int groups = max(1, (count + G - 1) / G);  // steps per pass (one empty step when no slot is local)
  const int steps = passes * groups;

  auto issue = [&](int st) {
    if (st < steps && count > 0) {
      const int pass = st / groups, grp = st - pass * groups;
      uint4* stage = ring + (st % kFinalizeStages) * kFinalizeStageVectors * 32 + lane;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int s = grp * G + g;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int v = v_begin + lane + pass * kStep + u * 32;
          if (s < count && v < v_end) {
            dev::cp_async16(stage + (g * U + u) * 32, rows + m.row_offset[s] + int64_t(v) * V);
          }
        }
      }
    }
    dev::cp_async_commit();  // every lane commits every step: group counts stay uniform
  };

#pragma unroll
  for (int st = 0; st < kFinalizeStages - 1; ++st) issue(st);
  float acc[U][V];
  for (int st = 0; st < steps; ++st) {
    issue(st + kFinalizeStages - 1);
    dev::cp_async_wait<kFinalizeStages - 1>();  // step st has landed
    const int pass = st / groups, grp = st - pass * groups;
    if (grp == 0) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
    }
    const uint4* stage = ring + (st % kFinalizeStages) * kFinalizeStageVectors * 32 + lane;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int s = grp * G + g;
      if (s >= count) break;
      const float w = m.weight[s];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 xw = stage[(g * U + u) * 32];
        const dev::Vec<In, V>& x = reinterpret_cast<const dev::Vec<In, V>&>(xw);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] = accumulate(acc[u][e], w, dev::to_float(x.v[e]));
      }
    }
    if (grp == groups - 1) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v_begin + lane + pass * kStep + u * 32;
        if (v < v_end) store_output<Out, V>(p, out, shared, m.token, int64_t(v) * V, acc[u]);
      }
    }
  }
  dev::cp_async_wait<0>();  // nothing of this item is still landing when the ring is reused
}

// The 16-byte-vector path for items with one or two local slots (the common
// case under expert parallelism): a stage holds kPP whole passes of the
// kSlots slots, everything indexed by compile-time constants.
template <typename In, typename Out, int V, int U, int kSlots>
__device__ __forceinline__ void reduce_vectors_async_small(const FinalizeParams& p, const SlotMeta& m, int chunk,
                                                           uint4* ring) {
  static_assert(sizeof(In) * V == 16 && kSlots * U <= kFinalizeStageVectors, "stage geometry");
  constexpr int kPP = kFinalizeStageVectors / (kSlots * U);  // passes per stage
  constexpr int kStep = 32 * U;
  const In* rows = static_cast<const In*>(p.rows);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  const int lane = threadIdx.x & 31;
  const int v_begin = chunk * p.chunk_vecs;
  const int v_end = min(p.vectors, v_begin + p.chunk_vecs);
  const int passes = (v_end - v_begin + kStep - 1) / kStep;
  const int steps = (passes + kPP - 1) / kPP;
  int64_t row_offset[kSlots];
  float weight[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    row_offset[s] = m.row_offset[s];
    weight[s] = m.weight[s];
  }
  auto issue = [&](int st) {
    if (st < steps) {
      uint4* stage = ring + (st % kFinalizeStages) * kFinalizeStageVectors * 32 + lane;
#pragma unroll
      for (int pp = 0; pp < kPP; ++pp)
#pragma unroll
        for (int s = 0; s < kSlots; ++s)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int v = v_begin + lane + (st * kPP + pp) * kStep + u * 32;
            if (v < v_end) dev::cp_async16(stage + ((pp * kSlots + s) * U + u) * 32, rows + row_offset[s] + int64_t(v) * V);
          }
    }
    dev::cp_async_commit();  // every lane commits every step: group counts stay uniform
  };
#pragma unroll
  for (int st = 0; st < kFinalizeStages - 1; ++st) issue(st);
  for (int st = 0; st < steps; ++st) {
    issue(st + kFinalizeStages - 1);
    dev::cp_async_wait<kFinalizeStages - 1>();  // step st has landed
    const uint4* stage = ring + (st % kFinalizeStages) * kFinalizeStageVectors * 32 + lane;
#pragma unroll
    for (int pp = 0; pp < kPP; ++pp) {
      float acc[U][V];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint4 xw = stage[((pp * kSlots + s) * U + u) * 32];
          const dev::Vec<In, V>& x = reinterpret_cast<const dev::Vec<In, V>&>(xw);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[u][e] = accumulate(acc[u][e], weight[s], dev::to_float(x.v[e]));
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v_begin + lane + (st * kPP + pp) * kStep + u * 32;
        if (v < v_end) store_output<Out, V>(p, out, shared, m.token, int64_t(v) * V, acc[u]);
      }
    }
  }
  dev::cp_async_wait<0>();  // nothing of this item is still landing when the ring is reused
}

// The 16-byte-vector path for items with few local slots (expert
// parallelism): the lane's row vectors form one stream ordered (pass, slot,
// u) -- the order they are summed in -- cut into stages of
// kFinalizeStageVectors, so a stage may span passes and stays full.
template <typename In, typename Out, int V, int U>
__device__ __forceinline__ void reduce_vectors_async_stream(const FinalizeParams& p, const SlotMeta& m, int chunk,
                                                     uint4* ring) {
  static_assert(sizeof(In) * V == 16, "the async path moves 16-byte vectors");
  constexpr int kSV = kFinalizeStageVectors;
  constexpr int kStep = 32 * U;
  const In* rows = static_cast<const In*>(p.rows);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  const int count = m.count;
  const int lane = threadIdx.x & 31;
  const int v_lane = chunk * p.chunk_vecs + lane;  // this lane's first vector
  const int v_end = min(p.vectors, chunk * p.chunk_vecs + p.chunk_vecs);
  const int passes = (v_end - chunk * p.chunk_vecs + kStep - 1) / kStep;
  float acc[U][V];
  auto clear = [&] {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
  };
  auto flush = [&](int pass) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v_lane + pass * kStep + u * 32;
      if (v < v_end) store_output<Out, V>(p, out, shared, m.token, int64_t(v) * V, acc[u]);
    }
  };
  clear();
  if (count == 0) {  // filling a token with no local slot: 0 (+ shared_output)
    for (int pass = 0; pass < passes; ++pass) flush(pass);
    return;
  }
  const int total = passes * count * U;           // vectors in the stream
  const int steps = (total + kSV - 1) / kSV;

  // Position in the stream, (pass, slot, u), advanced one vector at a time.
  struct Cursor {
    int pass = 0, slot = 0, u = 0;
  };
  auto advance = [&](Cursor& c) {
    if (++c.u == U) {
      c.u = 0;
      if (++c.slot == count) {
        c.slot = 0;
        ++c.pass;
      }
    }
  };
  Cursor in_cur, out_cur;
  int issued = 0;
  auto issue_stage = [&](int st) {
    uint4* stage = ring + (st % kFinalizeStages) * kSV * 32 + lane;
#pragma unroll
    for (int i = 0; i < kSV; ++i) {
      if (issued < total) {
        const int v = v_lane + in_cur.pass * kStep + in_cur.u * 32;
        if (v < v_end) dev::cp_async16(stage + i * 32, rows + m.row_offset[in_cur.slot] + int64_t(v) * V);
        advance(in_cur);
        ++issued;
      }
    }
    dev::cp_async_commit();  // every lane commits every step: group counts stay uniform
  };

#pragma unroll
  for (int st = 0; st < kFinalizeStages - 1; ++st) issue_stage(st);
  int consumed = 0;
  for (int st = 0; st < steps; ++st) {
    issue_stage(st + kFinalizeStages - 1);
    dev::cp_async_wait<kFinalizeStages - 1>();  // stage st has landed
    const uint4* stage = ring + (st % kFinalizeStages) * kSV * 32 + lane;
#pragma unroll
    for (int i = 0; i < kSV; ++i) {
      if (consumed < total) {
        const int v = v_lane + out_cur.pass * kStep + out_cur.u * 32;
        if (v < v_end) {
          const uint4 xw = stage[i * 32];
          const dev::Vec<In, V>& x = reinterpret_cast<const dev::Vec<In, V>&>(xw);
          const float w = m.weight[out_cur.slot];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (u != out_cur.u) continue;  // keeps acc[] indexed by constants
#pragma unroll
            for (int e = 0; e < V; ++e) acc[u][e] = accumulate(acc[u][e], w, dev::to_float(x.v[e]));
          }
        }
        const bool pass_done = out_cur.u == U - 1 && out_cur.slot == count - 1;
        if (pass_done) {
          flush(out_cur.pass);
          clear();
        }
        advance(out_cur);
        ++consumed;
      }
    }
  }
  dev::cp_async_wait<0>();  // nothing of this item is still landing when the ring is reused
}

// The ring path: picks the stage layout for the item's slot count.
template <typename In, typename Out, int V, int U>
__device__ __forceinline__ void reduce_vectors_async(const FinalizeParams& p, const SlotMeta& m, int chunk,
                                                     uint4* ring) {
  if (m.count * U >= kFinalizeStageVectors) return reduce_vectors_async_grouped<In, Out, V, U>(p, m, chunk, ring);
  if (m.count == 1) return reduce_vectors_async_small<In, Out, V, U, 1>(p, m, chunk, ring);
  if constexpr (2 * U <= kFinalizeStageVectors) {
    if (m.count == 2) return reduce_vectors_async_small<In, Out, V, U, 2>(p, m, chunk, ring);
  }
  reduce_vectors_async_stream<In, Out, V, U>(p, m, chunk, ring);
}

// Columns [vectors*V, hidden): the tail that does not fill a vector. Computed,
// never dropped, with the same arithmetic as the vector path. kTailBatch > 1
// (the realigned path, whose tail is up to 2V - 1 columns of every row): a
// column's slot loads go out kTailBatch at a time, a round trip per batch
// instead of per slot (more at once spilled the kernels at their register caps).
template <typename In, typename Out, int kTailBatch>
__device__ __forceinline__ void reduce_tail(const FinalizeParams& p, const SlotMeta& m, int first_col) {
  const In* rows = static_cast<const In*>(p.rows);
  const In* bias = static_cast<const In*>(p.bias);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  for (int c = first_col + (threadIdx.x & 31); c < p.hidden; c += 32) {
    float acc = 0.0f;
    if constexpr (kTailBatch > 1) {
#pragma unroll 1
      for (int s0 = 0; s0 < m.count; s0 += kTailBatch) {
        float x[kTailBatch], b[kTailBatch];
#pragma unroll
        for (int g = 0; g < kTailBatch; ++g)
          if (s0 + g < m.count) {
            x[g] = dev::to_float(rows[m.row_offset[s0 + g] + c]);
            b[g] = bias ? dev::to_float(bias[m.bias_offset[s0 + g] + c]) : 0.0f;
          }
#pragma unroll
        for (int g = 0; g < kTailBatch; ++g)
          if (s0 + g < m.count) acc = accumulate(acc, m.weight[s0 + g], bias ? with_bias(x[g], b[g]) : x[g]);
      }
    } else {
      for (int s = 0; s < m.count; ++s) {
        float xv = dev::to_float(rows[m.row_offset[s] + c]);
        if (bias) xv = with_bias(xv, dev::to_float(bias[m.bias_offset[s] + c]));
        acc = accumulate(acc, m.weight[s], xv);
      }
    }
    if (shared) acc = __fadd_rn(acc, dev::to_float(shared[m.token * p.shared_stride + c]));
    out[c] = dev::from_float<Out>(acc);
  }
}

// Registers are capped at 85 (kMaxFinalizeThreads threads, 3 blocks per SM):
// occupancy, i.e. bytes in flight per SM, is what feeds HBM here. The decode
// variant runs at most half a round of warps, so it asks for one block per SM
// (its 8 loads in flight spilled 12 bytes at 128 registers; same speed).
//
// kDecode: the grid covers all items in one round (decode-sized T). Latency,
// not bandwidth, is then the cost, so every local slot's row load of a lane
// goes out at once (kDecodeLoadsInFlight, held in registers: up to 128 of
// them) -- one row round trip per item instead of one per group of slots.
template <typename In, typename Out, int V, int U, bool kBias, bool kDecode, bool kRealign>
__global__ void __launch_bounds__(kMaxFinalizeThreads,
                                  kDecode ? 1 : (kBias && sizeof(In) * V == 16) ? 2 : kMinFinalizeBlocksPerSm)
    finalize_moe_routing_kernel(const FinalizeParams p) {
  __shared__ SlotMeta meta[kMaxFinalizeThreads / 32];  // one record per warp
  SlotMeta& m = meta[threadIdx.x >> 5];
  extern __shared__ uint4 finalize_ring[];  // async path: kFinalizeRingVectors per warp
  uint4* ring = finalize_ring + (threadIdx.x >> 5) * kFinalizeRingVectors;
  // Everything below may read what the previous kernel on the stream wrote;
  // with prefetch_indices, only from the second wait on (the indices of the
  // first items are the caller's promise).
  if (!p.prefetch_indices) dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const int64_t num_items = p.fill ? p.items_bound : p.expert_offsets[p.num_local_experts] * p.chunks;
  const int warps = blockDim.x >> 5;
  const int64_t stride = int64_t(gridDim.x) * warps;
  const bool narrow = num_items <= int64_t(UINT32_MAX);  // the common case: 32-bit division
  auto split = [&](int64_t item, int& chunk) -> int64_t {
    if (narrow) {
      chunk = int(uint32_t(item) % uint32_t(p.chunks));
      return uint32_t(item) / uint32_t(p.chunks);
    }
    chunk = int(item % p.chunks);
    return item / p.chunks;
  };
  // Software pipeline over this warp's items, two deep: while item i's rows
  // stream, the indices of items i+1 and i+2 are in flight (and, when not
  // filling, the permuted-row map entry of item i+3). Two deep because a
  // skipped item (no-filling) takes no time: its successor's indices must
  // already have had a whole item's time to arrive.
  auto key_of = [&](int64_t it, int& ch) -> int64_t { return it < num_items ? split(it, ch) : 0; };
  auto unpermuted_of = [&](int64_t it, int64_t k) -> int32_t {
    return (!p.fill && it < num_items) ? p.p2u[k] : 0;
  };
  auto slots_of = [&](int64_t it, const ItemKey& k) -> SlotLoad {
    return it < num_items ? load_slot(p, k.token) : SlotLoad{-1, 0, 1.0f};
  };
  int64_t item = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5);
  int chunk = 0, chunk1 = 0, chunk2 = 0;
  const int64_t key0 = key_of(item, chunk);
  ItemKey ik = item_key(p, key0, unpermuted_of(item, key0));
  SlotLoad slots = slots_of(item, ik);
  const int64_t key1 = key_of(item + stride, chunk1);
  ItemKey ik1 = item_key(p, key1, unpermuted_of(item + stride, key1));
  SlotLoad slots1 = slots_of(item + stride, ik1);
  int64_t key2 = key_of(item + 2 * stride, chunk2);
  int32_t u2 = unpermuted_of(item + 2 * stride, key2);
  // The rows, bias and shared_output, and every store, come after this.
  if (p.prefetch_indices) dev::grid_dependency_wait();
  for (; item < num_items; item += stride) {
    const ItemKey ik2 = item_key(p, key2, u2);
    const SlotLoad slots2 = slots_of(item + 2 * stride, ik2);
    int chunk3 = 0;
    const int64_t key3 = key_of(item + 3 * stride, chunk3);
    const int32_t u3 = unpermuted_of(item + 3 * stride, key3);

    __syncwarp();  // the previous item's record is no longer read
    if (resolve_slots<kRealign>(p, ik, slots, m)) {
      if constexpr (kDecode) {
        reduce_vectors<In, Out, V, U, kBias, kDecodeLoadsInFlight, kRealign>(p, m, chunk);
      } else if constexpr (sizeof(In) * V == 16 && !kBias && !kRealign) {
        reduce_vectors_async<In, Out, V, U>(p, m, chunk, ring);
      } else {
        // Bias doubles the vectors per slot and its rows are L2 hits: the
        // register path with an L2 prefetch of the next group measured faster.
        reduce_vectors<In, Out, V, U, kBias, kBias && sizeof(In) * V == 16 ? kBiasLoadsInFlight : kLoadsInFlight,
                       kRealign>(p, m, chunk);
      }
      if (chunk == p.chunks - 1 && p.vectors * V < p.hidden) reduce_tail<In, Out, kRealign ? 4 : 1>(p, m, p.vectors * V);
    }
    ik = ik1;
    slots = slots1;
    chunk = chunk1;
    ik1 = ik2;
    slots1 = slots2;
    chunk1 = chunk2;
    key2 = key3;
    chunk2 = chunk3;
    u2 = u3;
  }
}

// Token blocks (tuning.schedule 2): a block per output token. Warp 0
// resolves the token's local slots into the block's record, one barrier,
// then each thread owns one 16-byte column vector per pass and sums the
// slots in order, four row loads in flight at a time (the loop unrolled by
// 4). Few loads in flight per thread, many threads: 16-bit rows without
// bias take at most 32 registers, so every SM runs 2048 threads (64
// registers with bias, whose loads double, and for fp32 rows). The block
// scheduler overlaps one block's index round trip with other blocks' row
// loads, and the last wave is one token long. prefetch_indices changes
// nothing here (every read follows the grid-dependency wait).
template <typename In, typename Out, int V, bool kBias>
__global__ void __launch_bounds__(kMaxTokenBlockThreads, kBias || sizeof(In) == 4 ? 2 : 4)
    finalize_token_block_kernel(const FinalizeParams p) {
  __shared__ SlotMeta m;
  const int64_t token = blockIdx.x;
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  if (threadIdx.x < 32) resolve_slots<false, true>(p, ItemKey{token, -1}, load_slot(p, token), m);
  __syncthreads();
  const int count = m.count;
  if (!p.fill && count == 0) return;  // uniform across the block: the token is left untouched
  const In* rows = static_cast<const In*>(p.rows);
  const In* bias = static_cast<const In*>(p.bias);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + token * p.out_stride;
  for (int v = threadIdx.x; v < p.vectors; v += blockDim.x) {
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.0f;
#pragma unroll 4
    for (int i = 0; i < count; ++i) {
      const dev::Vec<In, V> x = dev::load_ro<In, V>(rows + m.row_offset[i] + int64_t(v) * V);
      dev::Vec<In, V> b;
      if constexpr (kBias) b = dev::load_ro<In, V>(bias + m.bias_offset[i] + int64_t(v) * V);
      const float w = m.weight[i];
#pragma unroll
      for (int c = 0; c < V; ++c) {
        float xv = dev::to_float(x.v[c]);
        if constexpr (kBias) xv = with_bias(xv, dev::to_float(b.v[c]));
        acc[c] = accumulate(acc[c], w, xv);
      }
    }
    store_output<Out, V>(p, out, shared, token, int64_t(v) * V, acc);
  }
  if (threadIdx.x < 32 && p.vectors * V < p.hidden) reduce_tail<In, Out, 1>(p, m, p.vectors * V);
}

template <typename In, typename Out, int V>
Status launch_token_blocks(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  auto kernel = p.bias ? finalize_token_block_kernel<In, Out, V, true> : finalize_token_block_kernel<In, Out, V, false>;
  p.vectors = p.hidden / V;
  // Threads per block: k <= 2 at 128 (H100: 0.908-0.913 of copy at 128 and
  // 256, 0.89 at 512; H200: 0.878-0.883 at 128 against 0.860-0.864 at 256),
  // larger k at 512 (H100: 0.976 vs 0.973 at 256).
  int threads = a.tuning.threads_per_block;
  if (threads == 0) threads = a.k <= 2 ? 128 : kMaxTokenBlockThreads;
  threads = int(std::min<int64_t>(threads, std::max<int64_t>(32, (p.vectors + 31) / 32 * 32)));
  FM_RETURN_IF_ERROR(detail::cuda_status(
      dev::launch(kernel, dim3(unsigned(a.num_tokens)), dim3(threads), 0, stream, a.enable_pdl, p), kOp,
      "kernel launch"));
  return detail::check_launch(kOp);
}

bool aligned_for(const void* ptr, int64_t stride, int elems, int elem_bytes) {
  const int bytes = std::min(16, elems * elem_bytes);
  return ptr == nullptr || (dev::is_aligned(ptr, bytes) && stride % elems == 0);
}

template <typename In, typename Out, int V, int U, bool kRealign>
Status launch_finalize(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  auto kernel = p.bias ? finalize_moe_routing_kernel<In, Out, V, U, true, false, kRealign>
                       : finalize_moe_routing_kernel<In, Out, V, U, false, false, kRealign>;
  // (A token-block size past this kernel's cap, on a path token blocks do not take, is capped.)
  const int threads = a.tuning.threads_per_block ? std::min(a.tuning.threads_per_block, kMaxFinalizeThreads) : 128;
  const int warps = threads / 32;
  size_t smem =
      sizeof(In) * V == 16 && !p.bias && !kRealign ? size_t(warps) * kFinalizeRingVectors * sizeof(uint4) : 0;
  detail::DeviceProps dev;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::current_device_props(&dev), kOp, "device query"));
  int per_sm = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::blocks_per_sm(detail::kernel_key(kernel), threads, smem, &per_sm),
                                         kOp, "occupancy query"));
  const int sms = dev.sms;
  const int64_t resident_warps = int64_t(std::max(1, per_sm)) * sms * warps;

  // Realigned: the last whole vector goes to the tail path too, so that the
  // aligned vector after the last one produced is still inside the row.
  p.vectors = kRealign ? std::max(0, p.hidden / V - 1) : p.hidden / V;
  const int lanes_out = kRealign ? 31 : 32;  // vectors a warp pass yields per u
  // Chunks per output row (an item is one chunk, for one warp). By default:
  // about 16 items per resident warp, so the last round of the persistent
  // loop is a small share of the time, but never less than one 32*U-vector
  // pass of the warp per item. Decode-sized T thus spreads a row over many
  // warps and SMs; large T gives each warp a long run of columns.
  int chunks = a.tuning.chunks_per_token;
  if (chunks == 0) {
    const int passes = (p.vectors + lanes_out * U - 1) / (lanes_out * U);  // warp passes for a whole row
    const int64_t rows_of_work = std::max<int64_t>(1, a.fill ? a.num_tokens : a.num_rows);
    const int64_t want = (resident_warps * 16 + rows_of_work - 1) / rows_of_work;
    chunks = int(std::min<int64_t>(passes, want));
  }
  chunks = std::max(1, std::min(chunks, std::max(1, p.vectors)));
  // Whole warp passes per chunk: no idle lanes but in the row's last pass.
  const int pass = lanes_out * U;
  p.chunk_vecs = std::max(1, ((p.vectors + chunks - 1) / chunks + pass - 1) / pass * pass);
  p.chunks = std::max(1, (p.vectors + p.chunk_vecs - 1) / p.chunk_vecs);
  p.items_bound = (a.fill ? a.num_tokens : a.num_rows) * int64_t(p.chunks);
  if (p.items_bound == 0) return Status::Ok();

  const int64_t grid = std::min<int64_t>((p.items_bound + warps - 1) / warps, resident_warps / warps);
  // Decode-sized work (at most half a round of items) with 16-byte vectors
  // and at most 8 slots: the latency-first variant. Measured on an H200:
  // T=1 2.51 -> 2.37 us, T=16 3.01 -> 2.72 us; at T=64 (1792 items, 0.57 of
  // a round) the ring path was ahead (4.58 vs 4.72 us).
  if constexpr (sizeof(In) * V == 16 && U == 1) {
    if (a.k <= kDecodeLoadsInFlight && 2 * p.items_bound <= resident_warps && a.tuning.threads_per_block == 0) {
      kernel = p.bias ? finalize_moe_routing_kernel<In, Out, V, U, true, true, kRealign>
                      : finalize_moe_routing_kernel<In, Out, V, U, false, true, kRealign>;
      smem = 0;
    }
  }
  FM_RETURN_IF_ERROR(detail::cuda_status(
      dev::launch(kernel, dim3(unsigned(grid)), dim3(threads), smem, stream, a.enable_pdl, p), kOp, "kernel launch"));
  return detail::check_launch(kOp);
}

template <typename In, typename Out>
Status dispatch_width(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(In);
  // An output row that is not aligned for 16-byte vectors is written element
  // by element (a small share of the traffic).
  p.out_vectors =
      aligned_for(p.out, p.out_stride, kFull, sizeof(Out)) && aligned_for(p.shared, p.shared_stride, kFull, sizeof(Out));
  if (aligned_for(p.rows, p.rows_stride, kFull, sizeof(In)) && aligned_for(p.bias, p.bias_stride, kFull, sizeof(In))) {
    int schedule = a.tuning.schedule;
    if (schedule == 0) {
      detail::DeviceProps dev;
      FM_RETURN_IF_ERROR(detail::cuda_status(detail::current_device_props(&dev), kOp, "device query"));
      // Bias stays on the persistent warps: its L2-resident bias rows double a
      // token block's loads (H100: 0.949 of copy vs 0.958). So do fp32 rows
      // (FC2's deterministic mode): Mixtral's, k = 2, measured 4.7 % slower
      // on token blocks at 64 registers.
      const bool many_tokens = a.num_tokens >= int64_t(kTokenBlocksPerSm) * dev.sms;
      schedule = !p.bias && sizeof(In) == 2 && many_tokens ? 2 : 1;
    }
    if (schedule == 2) return launch_token_blocks<In, Out, kFull>(p, a, stream);
    // Persistent warps. Vectors per lane and slot, from same-run sweeps on
    // the H200: filling takes 1 (k=2, H=4096: 0.88 of copy at 1, 0.86 at 2; k=8 the same);
    // no-filling takes 2 -- its tokens have one or two local slots, and two
    // vectors per row double the contiguous run (EP rank 3 of 8: 68.6 us at
    // 1, 59.5 us at 2; 4 was slower than 2).
    int u = a.tuning.vectors_per_thread;
    if (u == 0) u = a.fill ? 1 : 2;
    if (u == 2) return launch_finalize<In, Out, kFull, 2, false>(p, a, stream);
    return launch_finalize<In, Out, kFull, 1, false>(p, a, stream);
  }
  // Rows or bias rows off the 16-byte grid (an odd stride, an offset
  // pointer): still 16-byte loads, realigned across lanes. The pointers move
  // down to their 16-byte boundary; the distance rides in every row offset.
  auto align_down = [](const void*& ptr, int& shift) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
    shift = ptr ? int((addr % 16) / sizeof(In)) : 0;  // pointers are element-aligned (validated)
    ptr = ptr ? reinterpret_cast<const void*>(addr - addr % 16) : nullptr;
  };
  align_down(p.rows, p.rows_shift);
  align_down(p.bias, p.bias_shift);
  return launch_finalize<In, Out, kFull, 1, true>(p, a, stream);
}

template <typename In>
Status dispatch_out(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  switch (a.out_dtype) {
    case DType::kFloat32: return dispatch_width<In, float>(p, a, stream);
    case DType::kFloat16: return dispatch_width<In, __half>(p, a, stream);
    case DType::kBFloat16: return dispatch_width<In, __nv_bfloat16>(p, a, stream);
  }
  return Status(StatusCode::kNotSupported, "finalize_moe_routing: out_dtype: unsupported");
}

Status run_finalize(const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  const ResolvedFinalizeStrides s = resolve_finalize_strides(a);
  FinalizeParams p{};
  p.rows = a.expanded_permuted_rows;
  p.bias = a.bias;
  p.shared = a.shared_output;
  p.out = a.out;
  p.u2p = a.unpermuted_row_to_permuted_row;
  p.experts = a.token_selected_experts;
  p.scales = a.scales;
  p.p2u = a.permuted_row_to_unpermuted_row;
  p.expert_offsets = a.expert_first_token_offset;
  p.rows_stride = s.rows;
  p.bias_stride = s.bias;
  p.shared_stride = s.shared;
  p.out_stride = s.out;
  p.num_tokens = a.num_tokens;
  p.hidden = int(a.hidden);
  p.k = a.k;
  p.start_expert = a.start_expert_id;
  p.num_local_experts = a.num_experts_per_node;
  p.fill = a.fill;
  p.prefetch_indices = a.prefetch_indices && a.enable_pdl;
  switch (a.rows_dtype) {
    case DType::kFloat32: return dispatch_out<float>(p, a, stream);
    case DType::kFloat16: return dispatch_out<__half>(p, a, stream);
    case DType::kBFloat16: return dispatch_out<__nv_bfloat16>(p, a, stream);
  }
  return Status(StatusCode::kNotSupported, "finalize_moe_routing: rows_dtype: unsupported");
}

}  // namespace

Status finalize_moe_routing(const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  return detail::gpu_entry(kOp, validate_finalize_moe_routing(a), stream, a.num_tokens == 0,
                           [&] { return run_finalize(a, stream); });
}

}  // namespace flashmix
