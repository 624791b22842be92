// finalize_moe_routing (SPEC §2): un-permute the expert outputs, weight them
// by the router, reduce the top-k, add bias and an optional shared output.
//
//   out[t, c] = sum over local slots j (in order j = 0..k-1) of
//                 w[t, j] * (rows[u2p[j*T + t], c] + bias[e - start, c])   (+ shared_output[t, c])
//
// Roofline: memory bound. It must read every local row once (P rows x H) and
// write T x H outputs (tokens with a local slot only, when not filling); the
// index and scale reads are k*T*12 bytes. At T=8192, k=8, H=7168 in bf16 that
// is 0.94 GB read + 0.12 GB written: ~350 us at 3 TB/s of copy bandwidth.
// Everything else (bias rows) stays in L2.
//
// Work decomposition: a work item is (output row, chunk of its columns) and
// belongs to one warp. The warp resolves the item's local slots (expert,
// permuted row, weight: lane j reads slot j) into its own shared-memory
// record, then each lane reduces U 16-byte column vectors over those slots,
// keeping up to kLoadsInFlight row loads in flight before the first use.
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
// The async path: a ring of kFinalizeStages stages per warp, each holding
// kFinalizeStageVectors 16-byte vectors per lane (8 KB per warp).
constexpr int kFinalizeStages = 4;
constexpr int kFinalizeStageVectors = 4;
constexpr int kFinalizeRingVectors = kFinalizeStages * kFinalizeStageVectors * 32;

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
  bool out_vectors;  // out (and shared_output) aligned for V-element vectors; else element stores
};

// The local slots of one work item, in slot order.
struct SlotMeta {
  int64_t row_offset[kMaxFinalizeK];   // element offset of the permuted row
  int64_t bias_offset[kMaxFinalizeK];  // element offset of the expert's bias row
  float weight[kMaxFinalizeK];
  int64_t token;
  int count;  // local slots; -1: this item is skipped (no-filling, not the token's first local slot)
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

// Lane j's view of slot j of an item, loaded one item ahead of its use so the
// index round trip overlaps the previous item's row loads.
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
// to the item of its first local slot).
__device__ __forceinline__ bool resolve_slots(const FinalizeParams& p, const ItemKey& key, const SlotLoad& s,
                                              SlotMeta& m) {
  const int lane = threadIdx.x & 31;
  const bool local = lane < p.k && s.expert >= p.start_expert && s.expert - p.start_expert < p.num_local_experts;
  const unsigned mask = __ballot_sync(dev::kFullMask, local);
  if (!p.fill && __ffs(mask) - 1 != key.first_slot) return false;  // uniform across the warp
  if (local) {
    const int slot = __popc(mask & ((1u << lane) - 1u));
    m.row_offset[slot] = int64_t(s.row) * p.rows_stride;
    m.bias_offset[slot] = int64_t(s.expert - p.start_expert) * p.bias_stride;
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

template <typename In, typename Out, int V, int U, bool kBias>
__device__ __forceinline__ void reduce_vectors(const FinalizeParams& p, const SlotMeta& m, int chunk) {
  // Slots per load group: kLoadsInFlight vectors (row and bias) per thread.
  constexpr int kPerSlot = U * (kBias ? 2 : 1);
  constexpr int G = kLoadsInFlight / kPerSlot > 0 ? kLoadsInFlight / kPerSlot : 1;
  const In* rows = static_cast<const In*>(p.rows);
  const In* bias = static_cast<const In*>(p.bias);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  const int count = m.count;
  const int lane = threadIdx.x & 31;
  const int v_begin = chunk * p.chunk_vecs;
  const int v_end = min(p.vectors, v_begin + p.chunk_vecs);
  constexpr int kStep = 32 * U;
  for (int v0 = v_begin + lane; v0 < v_end; v0 += kStep) {
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
          const int v = v0 + u * 32;
          if (s0 + g < count && v < v_end) {
            x[g][u] = dev::load_stream<In, V>(rows + m.row_offset[s0 + g] + int64_t(v) * V);
            if constexpr (kBias) b[g][u] = dev::load_ro<In, V>(bias + m.bias_offset[s0 + g] + int64_t(v) * V);
          }
        }
      // Ask L2 for the next group's rows (wrapping to the next pass of the
      // lane) while this group's loads are outstanding: more bytes in flight
      // without more registers.
#pragma unroll
      for (int g = 0; g < G; ++g) {
        int s = s0 + G + g, vv = v0;
        if (s >= count) {
          s -= count;
          vv += kStep;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (s < count && vv + u * 32 < v_end) dev::prefetch_l2(rows + m.row_offset[s] + int64_t(vv + u * 32) * V);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (s0 + g >= count) break;
        const float w = m.weight[s0 + g];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float xv = dev::to_float(x[g][u].v[e]);
            if constexpr (kBias) xv = with_bias(xv, dev::to_float(b[g][u].v[e]));
            acc[u][e] = accumulate(acc[u][e], w, xv);
          }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * 32;
      if (v >= v_end) break;
      store_output<Out, V>(p, out, shared, m.token, int64_t(v) * V, acc[u]);
    }
  }
}

// Columns [vectors*V, hidden): the tail that does not fill a vector. Computed,
// never dropped, with the same arithmetic as the vector path.
template <typename In, typename Out>
__device__ __forceinline__ void reduce_tail(const FinalizeParams& p, const SlotMeta& m, int first_col) {
  const In* rows = static_cast<const In*>(p.rows);
  const In* bias = static_cast<const In*>(p.bias);
  const Out* shared = static_cast<const Out*>(p.shared);
  Out* out = static_cast<Out*>(p.out) + m.token * p.out_stride;
  for (int c = first_col + (threadIdx.x & 31); c < p.hidden; c += 32) {
    float acc = 0.0f;
    for (int s = 0; s < m.count; ++s) {
      float xv = dev::to_float(rows[m.row_offset[s] + c]);
      if (bias) xv = with_bias(xv, dev::to_float(bias[m.bias_offset[s] + c]));
      acc = accumulate(acc, m.weight[s], xv);
    }
    if (shared) acc = __fadd_rn(acc, dev::to_float(shared[m.token * p.shared_stride + c]));
    out[c] = dev::from_float<Out>(acc);
  }
}

// ---------------------------------------------------------------------------
// The continuous stream: the 16-byte path without bias.
//
// A warp's items are resolved one after another into a small ring of records
// in shared memory, and the lane's row vectors of all its items form ONE
// stream, ordered (item, pass, slot, u) -- within an item exactly the order
// they are summed in. The stream is staged through the warp's cp.async ring,
// kFinalizeStageVectors vectors per stage, kFinalizeStages - 1 stages ahead
// of their use. So the ring never drains at an item boundary: short items
// (k = 2, or one or two local slots under expert parallelism) and skipped
// items (no-filling) cost no pipeline bubble, and the index loads of the
// next items are issued while earlier rows are still landing. A lane reads
// back only what it copied itself (cp.async.wait_group, no barrier).

struct StreamRecord {
  int32_t row[kMaxFinalizeK];  // permuted rows of the local slots, in slot order
  float weight[kMaxFinalizeK];
  int64_t token;
  int count;  // local slots
  int chunk;
};
constexpr int kStreamRecords = 8;  // open items per warp (issue side ahead of the consume side)
// Shared memory of one warp, in 16-byte units: the ring, then the records.
constexpr int kFinalizeWarpSmemVectors =
    kFinalizeRingVectors + int((kStreamRecords * sizeof(StreamRecord) + 15) / 16);

template <typename In, typename Out, int V, int U>
__device__ __forceinline__ void finalize_stream(const FinalizeParams& p, int64_t num_items, int64_t first,
                                                int64_t stride, uint4* ring, StreamRecord* rec) {
  static_assert(sizeof(In) * V == 16, "the stream moves 16-byte vectors");
  constexpr int kSV = kFinalizeStageVectors;
  constexpr int kS = kFinalizeStages;
  constexpr int kStep = 32 * U;
  const int lane = threadIdx.x & 31;
  const In* rows = static_cast<const In*>(p.rows);
  const Out* shared = static_cast<const Out*>(p.shared);
  const bool narrow = num_items <= int64_t(UINT32_MAX);
  auto split = [&](int64_t item, int& chunk) -> int64_t {
    if (narrow) {
      chunk = int(uint32_t(item) % uint32_t(p.chunks));
      return uint32_t(item) / uint32_t(p.chunks);
    }
    chunk = int(item % p.chunks);
    return item / p.chunks;
  };
  auto passes_of = [&](int chunk) {
    const int begin = chunk * p.chunk_vecs, end = min(p.vectors, begin + p.chunk_vecs);
    return (end - begin + kStep - 1) / kStep;
  };

  // ---- item source, its index loads one item (and the p2u entry two) ahead
  int64_t item = first;
  int chunk = 0, chunk_next = 0;
  int64_t key = item < num_items ? split(item, chunk) : 0;
  ItemKey ik = item_key(p, key, (!p.fill && item < num_items) ? p.p2u[key] : 0);
  SlotLoad slots = item < num_items ? load_slot(p, ik.token) : SlotLoad{-1, 0, 1.0f};
  int64_t key_next = item + stride < num_items ? split(item + stride, chunk_next) : 0;
  int32_t u_next = (!p.fill && item + stride < num_items) ? p.p2u[key_next] : 0;

  // ---- issue side
  int opened = 0;  // records written
  int in_rec = 0, in_pass = 0, in_slot = 0, in_u = 0, in_count = 0, in_vbase = 0, in_vend = 0;
  int in_left = 0;  // vectors of the current record still to issue
  // Resolves items until one is opened (false: none left). Uniform per warp.
  auto open_next = [&]() -> bool {
    while (item < num_items) {
      StreamRecord& r = rec[opened % kStreamRecords];
      const int lane_local = lane < p.k && slots.expert >= p.start_expert &&
                             slots.expert - p.start_expert < p.num_local_experts;
      const unsigned mask = __ballot_sync(dev::kFullMask, lane_local);
      const bool take = p.fill || __ffs(mask) - 1 == ik.first_slot;
      if (take) {
        if (lane_local) {
          const int slot = __popc(mask & ((1u << lane) - 1u));
          r.row[slot] = slots.row;
          r.weight[slot] = slots.weight;
        }
        if (lane == 0) {
          r.token = ik.token;
          r.count = __popc(mask);
          r.chunk = chunk;
        }
        in_rec = opened % kStreamRecords;
        in_count = __popc(mask);
        in_vbase = chunk * p.chunk_vecs;
        in_vend = min(p.vectors, in_vbase + p.chunk_vecs);
        in_left = passes_of(chunk) * in_count * U;
        in_pass = in_slot = in_u = 0;
      }
      // Advance the source: the next item's index loads go out now.
      item += stride;
      ik = item_key(p, key_next, u_next);
      chunk = chunk_next;
      slots = item < num_items ? load_slot(p, ik.token) : SlotLoad{-1, 0, 1.0f};
      key_next = item + stride < num_items ? split(item + stride, chunk_next) : 0;
      u_next = (!p.fill && item + stride < num_items) ? p.p2u[key_next] : 0;
      if (take) {
        __syncwarp();
        ++opened;
        return true;
      }
    }
    return false;
  };

  // ---- consume side
  int closed = 0;  // records finished
  bool out_open = false;
  int out_rec = 0, out_pass = 0, out_slot = 0, out_u = 0, out_count = 0, out_vbase = 0, out_vend = 0, out_left = 0;
  int out_passes = 0;
  int64_t out_token = 0;
  float acc[U][V];
  auto clear = [&] {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
  };
  auto flush = [&](int pass) {
    Out* out = static_cast<Out*>(p.out) + out_token * p.out_stride;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = out_vbase + lane + pass * kStep + u * 32;
      if (v < out_vend) store_output<Out, V>(p, out, shared, out_token, int64_t(v) * V, acc[u]);
    }
  };
  // The columns past the last full vector, for the row's last chunk.
  auto finish_record = [&] {
    if (rec[out_rec].chunk == p.chunks - 1 && p.vectors * V < p.hidden) {
      Out* out = static_cast<Out*>(p.out) + out_token * p.out_stride;
      for (int c = p.vectors * V + lane; c < p.hidden; c += 32) {
        float a = 0.0f;
        for (int s = 0; s < out_count; ++s)
          a = accumulate(a, rec[out_rec].weight[s], dev::to_float(rows[int64_t(rec[out_rec].row[s]) * p.rows_stride + c]));
        if (shared) a = __fadd_rn(a, dev::to_float(shared[out_token * p.shared_stride + c]));
        out[c] = dev::from_float<Out>(a);
      }
    }
    out_open = false;
    ++closed;
  };
  // Opens the next record on the consume side; a record with no local slot
  // (filling) is written out at once: 0 (+ shared_output).
  auto settle = [&] {
    while (!out_open && closed < opened) {
      out_rec = closed % kStreamRecords;
      out_count = rec[out_rec].count;
      out_token = rec[out_rec].token;
      out_vbase = rec[out_rec].chunk * p.chunk_vecs;
      out_vend = min(p.vectors, out_vbase + p.chunk_vecs);
      out_passes = passes_of(rec[out_rec].chunk);
      out_left = out_passes * out_count * U;
      out_pass = out_slot = out_u = 0;
      out_open = true;
      clear();
      if (out_count == 0) {
        for (int pass = 0; pass < out_passes; ++pass) flush(pass);
        finish_record();
      }
    }
  };

  uint32_t stage_counts = 0;  // vectors in each stage, 8 bits a stage
  auto issue_stage = [&](int st) {
    uint4* stage = ring + (st % kS) * kSV * 32 + lane;
    int n = 0;
#pragma unroll
    for (int i = 0; i < kSV; ++i) {
      while (in_left == 0 && opened - closed < kStreamRecords && open_next()) {
      }
      if (in_left > 0) {
        const int v = in_vbase + lane + in_pass * kStep + in_u * 32;
        if (v < in_vend)
          dev::cp_async16(stage + i * 32, rows + int64_t(rec[in_rec].row[in_slot]) * p.rows_stride + int64_t(v) * V);
        if (++in_u == U) {
          in_u = 0;
          if (++in_slot == in_count) {
            in_slot = 0;
            ++in_pass;
          }
        }
        --in_left;
        ++n;
      }
    }
    dev::cp_async_commit();  // every lane commits every step: group counts stay uniform
    const int shift = 8 * (st % kS);
    stage_counts = (stage_counts & ~(0xffu << shift)) | (uint32_t(n) << shift);
  };
  auto consume_stage = [&](int st) {
    const int n = int((stage_counts >> (8 * (st % kS))) & 0xffu);
    const uint4* stage = ring + (st % kS) * kSV * 32 + lane;
#pragma unroll
    for (int i = 0; i < kSV; ++i) {
      if (i < n) {
        settle();
        const int v = out_vbase + lane + out_pass * kStep + out_u * 32;
        if (v < out_vend) {
          const uint4 xw = stage[i * 32];
          const dev::Vec<In, V>& x = reinterpret_cast<const dev::Vec<In, V>&>(xw);
          const float w = rec[out_rec].weight[out_slot];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (u != out_u) continue;  // keeps acc[] indexed by constants
#pragma unroll
            for (int e = 0; e < V; ++e) acc[u][e] = accumulate(acc[u][e], w, dev::to_float(x.v[e]));
          }
        }
        if (out_u == U - 1 && out_slot == out_count - 1) {
          flush(out_pass);
          clear();
        }
        if (++out_u == U) {
          out_u = 0;
          if (++out_slot == out_count) {
            out_slot = 0;
            ++out_pass;
          }
        }
        if (--out_left == 0) finish_record();
      }
    }
    settle();  // records with no local slot queued behind this stage
  };

#pragma unroll
  for (int st = 0; st < kS - 1; ++st) issue_stage(st);
  for (int st = 0;; ++st) {
    issue_stage(st + kS - 1);
    dev::cp_async_wait<kS - 1>();  // stage st has landed
    consume_stage(st);
    if (stage_counts == 0 && in_left == 0 && item >= num_items && closed == opened) break;
  }
  dev::cp_async_wait<0>();
}

// Registers are capped at 85 (kMaxFinalizeThreads threads, 3 blocks per SM):
// occupancy, i.e. bytes in flight per SM, is what feeds HBM here. The stream
// path keeps its bytes in flight in shared memory, which bounds its occupancy
// anyway; its larger state may use up to 128 registers.
template <typename In, typename Out, int V, int U, bool kBias>
__global__ void __launch_bounds__(kMaxFinalizeThreads,
                                  sizeof(In) * V == 16 && !kBias ? 2 : kMinFinalizeBlocksPerSm)
    finalize_moe_routing_kernel(const FinalizeParams p) {
  __shared__ SlotMeta meta[kMaxFinalizeThreads / 32];  // one record per warp
  SlotMeta& m = meta[threadIdx.x >> 5];
  // Continuous-stream path: the warp's cp.async ring, then its item records.
  extern __shared__ uint4 finalize_ring[];
  uint4* ring = finalize_ring + (threadIdx.x >> 5) * kFinalizeWarpSmemVectors;
  // Everything below may read what the previous kernel on the stream wrote.
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const int64_t num_items = p.fill ? p.items_bound : p.expert_offsets[p.num_local_experts] * p.chunks;
  const int warps = blockDim.x >> 5;
  const int64_t stride = int64_t(gridDim.x) * warps;
  if constexpr (sizeof(In) * V == 16 && !kBias) {
    finalize_stream<In, Out, V, U>(p, num_items, int64_t(blockIdx.x) * warps + (threadIdx.x >> 5), stride, ring,
                                   reinterpret_cast<StreamRecord*>(ring + kFinalizeRingVectors));
    return;
  }
  const bool narrow = num_items <= int64_t(UINT32_MAX);  // the common case: 32-bit division
  auto split = [&](int64_t item, int& chunk) -> int64_t {
    if (narrow) {
      chunk = int(uint32_t(item) % uint32_t(p.chunks));
      return uint32_t(item) / uint32_t(p.chunks);
    }
    chunk = int(item % p.chunks);
    return item / p.chunks;
  };
  // Software pipeline over this warp's items: the indices of item i+1 (and,
  // when not filling, the permuted-row map entry of item i+2) are in flight
  // while item i's rows stream.
  int64_t item = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5);
  int chunk = 0, chunk_next = 0;
  int64_t key = item < num_items ? split(item, chunk) : 0;
  auto unpermuted_of = [&](int64_t it, int64_t k) -> int32_t {
    return (!p.fill && it < num_items) ? p.p2u[k] : 0;
  };
  ItemKey ik = item_key(p, key, unpermuted_of(item, key));
  SlotLoad slots = item < num_items ? load_slot(p, ik.token) : SlotLoad{-1, 0, 1.0f};
  int64_t key_next = item + stride < num_items ? split(item + stride, chunk_next) : 0;
  int32_t u_next = unpermuted_of(item + stride, key_next);
  for (; item < num_items; item += stride) {
    const int64_t item_next = item + stride;
    const ItemKey ik_next = item_key(p, key_next, u_next);
    const SlotLoad slots_next = item_next < num_items ? load_slot(p, ik_next.token) : SlotLoad{-1, 0, 1.0f};
    int chunk_after = 0;
    const int64_t key_after = item_next + stride < num_items ? split(item_next + stride, chunk_after) : 0;
    const int32_t u_after = unpermuted_of(item_next + stride, key_after);

    __syncwarp();  // the previous item's record is no longer read
    if (resolve_slots(p, ik, slots, m)) {
      // Bias doubles the vectors per slot and its rows are L2 hits: the
      // register path with an L2 prefetch of the next group measured faster.
      reduce_vectors<In, Out, V, U, kBias>(p, m, chunk);
      if (chunk == p.chunks - 1 && p.vectors * V < p.hidden) reduce_tail<In, Out>(p, m, p.vectors * V);
    }
    ik = ik_next;
    slots = slots_next;
    chunk = chunk_next;
    key_next = key_after;
    chunk_next = chunk_after;
    u_next = u_after;
  }
}

bool aligned_for(const void* ptr, int64_t stride, int elems, int elem_bytes) {
  const int bytes = std::min(16, elems * elem_bytes);
  return ptr == nullptr || (dev::is_aligned(ptr, bytes) && stride % elems == 0);
}

template <typename In, typename Out, int V, int U>
Status launch_finalize(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  auto kernel = p.bias ? finalize_moe_routing_kernel<In, Out, V, U, true>
                       : finalize_moe_routing_kernel<In, Out, V, U, false>;
  const int threads = a.tuning.threads_per_block ? a.tuning.threads_per_block : 128;
  int device = 0, sms = 0, per_sm = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaGetDevice(&device), kOp, "cudaGetDevice"));
  FM_RETURN_IF_ERROR(detail::cuda_status(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp, "multiprocessor count"));
  const int warps = threads / 32;
  const size_t smem = sizeof(In) * V == 16 && !p.bias ? size_t(warps) * kFinalizeWarpSmemVectors * sizeof(uint4) : 0;
  if (smem > 48 * 1024)
    FM_RETURN_IF_ERROR(detail::cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), kOp, "shared memory size"));
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem),
                                         kOp, "occupancy query"));
  const int64_t resident_warps = int64_t(std::max(1, per_sm)) * sms * warps;

  p.vectors = p.hidden / V;
  // Chunks per output row (an item is one chunk, for one warp). By default:
  // about 16 items per resident warp, so the last round of the persistent
  // loop is a small share of the time, but never less than one 32*U-vector
  // pass of the warp per item. Decode-sized T thus spreads a row over many
  // warps and SMs; large T gives each warp a long run of columns.
  int chunks = a.tuning.chunks_per_token;
  if (chunks == 0) {
    const int passes = (p.vectors + 32 * U - 1) / (32 * U);  // warp passes for a whole row
    const int64_t rows_of_work = std::max<int64_t>(1, a.fill ? a.num_tokens : a.num_rows);
    const int64_t want = (resident_warps * 16 + rows_of_work - 1) / rows_of_work;
    chunks = int(std::min<int64_t>(passes, want));
  }
  chunks = std::max(1, std::min(chunks, std::max(1, p.vectors)));
  // Whole warp passes per chunk: no idle lanes but in the row's last pass.
  const int pass = 32 * U;
  p.chunk_vecs = std::max(1, ((p.vectors + chunks - 1) / chunks + pass - 1) / pass * pass);
  p.chunks = std::max(1, (p.vectors + p.chunk_vecs - 1) / p.chunk_vecs);
  p.items_bound = (a.fill ? a.num_tokens : a.num_rows) * int64_t(p.chunks);
  if (p.items_bound == 0) return Status::Ok();

  const int64_t grid = std::min<int64_t>((p.items_bound + warps - 1) / warps, resident_warps / warps);
  FM_RETURN_IF_ERROR(detail::cuda_status(
      dev::launch(kernel, dim3(unsigned(grid)), dim3(threads), smem, stream, a.enable_pdl, p), kOp, "kernel launch"));
  return detail::check_launch(kOp);
}

template <typename In, typename Out>
Status dispatch_width(FinalizeParams p, const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(In);
  // The vector width follows the inputs; an output row that is not aligned
  // for it is written element by element (a small share of the traffic).
  auto fits = [&](int v) {
    return aligned_for(p.rows, p.rows_stride, v, sizeof(In)) && aligned_for(p.bias, p.bias_stride, v, sizeof(In));
  };
  auto out_fits = [&](int v) {
    return aligned_for(p.out, p.out_stride, v, sizeof(Out)) && aligned_for(p.shared, p.shared_stride, v, sizeof(Out));
  };
  if (fits(kFull)) {
    p.out_vectors = out_fits(kFull);
    int u = a.tuning.vectors_per_thread;
    if (u == 0) u = a.k >= 5 ? 1 : 2;  // keep several row loads in flight per lane
    if (u == 2) return launch_finalize<In, Out, kFull, 2>(p, a, stream);
    return launch_finalize<In, Out, kFull, 1>(p, a, stream);
  }
  // Misaligned pointers or strides: a narrower path that does not need them.
  if constexpr (sizeof(In) == 2) {
    if (fits(2)) {
      p.out_vectors = out_fits(2);
      return launch_finalize<In, Out, 2, 1>(p, a, stream);
    }
  }
  p.out_vectors = true;
  return launch_finalize<In, Out, 1, 1>(p, a, stream);
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

}  // namespace

Status finalize_moe_routing(const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  FM_RETURN_IF_ERROR(validate_finalize_moe_routing(a));
  FM_RETURN_IF_ERROR(detail::check_stream(stream, kOp));
  if (a.num_tokens == 0) return Status::Ok();
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
  switch (a.rows_dtype) {
    case DType::kFloat32: return dispatch_out<float>(p, a, stream);
    case DType::kFloat16: return dispatch_out<__half>(p, a, stream);
    case DType::kBFloat16: return dispatch_out<__nv_bfloat16>(p, a, stream);
  }
  return Status(StatusCode::kNotSupported, "finalize_moe_routing: rows_dtype: unsupported");
}

}  // namespace flashmix
