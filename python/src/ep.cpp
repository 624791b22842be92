// flashmix._C's expert parallelism (spec §14; include/flashmix/ep.h): NCCL
// communicators and the two ways of running the layer across ranks. Built
// only with flashmix_ep; python/flashmix/ep.py is the package's side.
#include <cstring>
#include <memory>
#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "flashmix/ep.h"
#include "flashmix/moe.h"

namespace flashmix::python {

namespace {

void raise_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(concat(what, ": ", ncclGetErrorString(r)));
}

// An NCCL communicator: made here from a unique id (and destroyed with the
// object), or the caller's (a raw ncclComm_t as an int; not destroyed).
class NcclComm {
 public:
  NcclComm(nb::bytes unique_id, int world, int rank, int device) : owned_(true) {
    if (unique_id.size() != sizeof(ncclUniqueId))
      throw nb::value_error(concat("NcclComm: unique_id must be ", sizeof(ncclUniqueId), " bytes (got ",
                                   unique_id.size(), ")")
                                .c_str());
    ncclUniqueId id;
    std::memcpy(&id, unique_id.c_str(), sizeof(id));
    CudaDeviceGuard guard(device, "NcclComm");
    nb::gil_scoped_release release;
    raise_nccl(ncclCommInitRank(&comm_, world, id, rank), "NcclComm: ncclCommInitRank");
  }
  explicit NcclComm(uintptr_t handle) : comm_(reinterpret_cast<ncclComm_t>(handle)), owned_(false) {
    if (comm_ == nullptr) throw nb::value_error("NcclComm.wrap: the handle must not be 0");
  }
  ~NcclComm() { destroy(); }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  void destroy() {
    if (owned_ && comm_ != nullptr) ncclCommDestroy(comm_);
    comm_ = nullptr;
  }
  ncclComm_t get() const {
    if (comm_ == nullptr) throw nb::value_error("NcclComm: destroyed");
    return comm_;
  }
  int rank() const {
    int r = 0;
    raise_nccl(ncclCommUserRank(get(), &r), "ncclCommUserRank");
    return r;
  }
  int world() const {
    int n = 0;
    raise_nccl(ncclCommCount(get(), &n), "ncclCommCount");
    return n;
  }
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(get()); }

 private:
  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
};

nb::bytes nccl_unique_id() {
  ncclUniqueId id;
  raise_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

const EnumNames<fm::EpSizing>& ep_sizings() {
  static const EnumNames<fm::EpSizing> names = {{"capacity", fm::EpSizing::kCapacity}, {"exact", fm::EpSizing::kExact}};
  return names;
}

const EnumNames<fm::EpReduce>& ep_reduces() {
  static const EnumNames<fm::EpReduce> names = {{"all_reduce", fm::EpReduce::kAllReduce},
                                                {"reduce_scatter", fm::EpReduce::kReduceScatter}};
  return names;
}

fm::EpShape ep_shape(const NcclComm& comm, int64_t hidden, int k, int num_experts, int64_t max_tokens_per_rank,
                     int64_t recv_capacity, const std::string& sizing, bool fp8_rows, bool direct_only) {
  fm::EpShape s;
  s.rank = comm.rank();
  s.world = comm.world();
  s.hidden = hidden;
  s.k = k;
  s.num_experts = num_experts;
  s.max_tokens_per_rank = max_tokens_per_rank;
  s.recv_capacity = recv_capacity;
  s.sizing = parse_enum(sizing, ep_sizings(), "ep_moe_forward", "sizing");
  s.fp8_rows = fp8_rows;
  s.direct_only = direct_only;
  return s;
}

// The direct transport of one workspace (spec §14.7): ep_peers_create on
// the workspace's device (collective, synchronises the stream). release()
// is the collective teardown (ep_peers_destroy with the communicator); an
// object dropped without it unmaps locally once its device is idle.
class EpPeers {
 public:
  EpPeers(const NcclComm& comm, const Out& workspace, int64_t hidden, int k, int num_experts,
          int64_t max_tokens_per_rank, int64_t recv_capacity, bool fp8_rows, bool direct_only, uintptr_t stream) {
    constexpr const char* op = "ep_peers_create";
    Placement w(op);
    w.add(workspace, "workspace");
    if (!w.cuda()) fail(op, "workspace", "must be a CUDA array");
    const fm::EpShape s =
        ep_shape(comm, hidden, k, num_experts, max_tokens_per_rank, recv_capacity, "capacity", fp8_rows, direct_only);
    const Workspace ws = workspace_of(workspace, op);
    const ncclComm_t c = comm.get();
    device_ = w.device();
    dispatch(
        w, op, [&] { return fm::ep_peers_create(s, ws.ptr, ws.bytes, c, as_stream(stream), &peers_); },
        [&] { return fm::Status(fm::StatusCode::kNotSupported, "ep_peers_create: CUDA only"); });
  }
  void release(const NcclComm& comm, uintptr_t stream) {
    if (peers_ == nullptr) return;
    const ncclComm_t c = comm.get();
    fm::Status st;
    {
      CudaDeviceGuard guard(device_, "EpPeers.release");
      nb::gil_scoped_release unlocked;
      st = fm::ep_peers_destroy(peers_, c, as_stream(stream));
    }
    peers_ = nullptr;
    raise_if_error(st);
  }
  ~EpPeers() {
    if (peers_ == nullptr) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) current = -1;
    if (current != device_) (void)cudaSetDevice(device_);
    (void)cudaDeviceSynchronize();  // this rank's work on the mappings
    (void)fm::ep_peers_destroy(peers_, nullptr, nullptr);
    if (current >= 0 && current != device_) (void)cudaSetDevice(current);
  }
  EpPeers(const EpPeers&) = delete;
  EpPeers& operator=(const EpPeers&) = delete;
  const fm::EpPeers* get() const { return peers_; }

 private:
  fm::EpPeers* peers_ = nullptr;
  int device_ = 0;
};

// ep_moe_forward's arguments from the arrays (sizes only when `X` is absent).
fm::EpMoeForwardArgs ep_forward_args(const NcclComm& comm, const In& W1, const In& W2, int k, int num_experts,
                                     int64_t max_tokens_per_rank, int64_t recv_capacity, const std::string& sizing,
                                     bool fp8_rows, bool direct_only,
                                     const OptIn& b1, const OptIn& b2, const std::string& w1_layout,
                                     const std::string& activation, float limit, float alpha, const std::string& mode,
                                     const std::string& fp8, const OptIn& w1_scales, const OptIn& w2_scales,
                                     const std::string& weights, const OptIn& w1_mx_scales,
                                     const OptIn& w2_mx_scales, const char* op) {
  fm::EpMoeForwardArgs a;
  set_layer_experts(a.moe, W1, W2, b1, b2, true, w1_layout, activation, limit, alpha, mode, fp8, w1_scales, w2_scales,
                    weights, w1_mx_scales, w2_mx_scales, op);
  a.shape = ep_shape(comm, a.moe.hidden, k, num_experts, max_tokens_per_rank, recv_capacity, sizing, fp8_rows,
                     direct_only);
  return a;
}

size_t ep_moe_forward_workspace_size(const NcclComm& comm, const In& W1, const In& W2, int k, int num_experts,
                                     int64_t max_tokens_per_rank, int64_t recv_capacity, const std::string& sizing,
                                     bool fp8_rows, bool direct_only, const std::string& mode, const std::string& fp8,
                                     const OptIn& w1_scales, const OptIn& w2_scales, const std::string& weights,
                                     const OptIn& w1_mx_scales, const OptIn& w2_mx_scales) {
  const fm::EpMoeForwardArgs a =
      ep_forward_args(comm, W1, W2, k, num_experts, max_tokens_per_rank, recv_capacity, sizing, fp8_rows, direct_only,
                      std::nullopt,
                      std::nullopt, "gate_up", "swiglu", 0.f, 0.f, mode, fp8, w1_scales, w2_scales, weights,
                      w1_mx_scales, w2_mx_scales, "ep_moe_forward_workspace_size");
  return fm::ep_moe_forward_workspace_size(a);
}

void ep_moe_forward(const NcclComm& comm, const In& X, const In& W1, const In& W2, const In& topk_ids,
                    const In& topk_weights, const Out& out, int num_experts, int64_t max_tokens_per_rank,
                    int64_t recv_capacity, const std::string& sizing, bool fp8_rows, bool direct_only, const OptIn& b1,
                    const OptIn& b2, const std::string& w1_layout, const std::string& activation, float limit,
                    float alpha, const std::string& mode, const std::string& fp8, const OptIn& w1_scales,
                    const OptIn& w2_scales,
                    const std::string& weights, const OptIn& w1_mx_scales, const OptIn& w2_mx_scales,
                    const OptIn& shared_output, const OptOut& dropped, const OptOut& workspace, const EpPeers* peers,
                    uintptr_t stream) {
  constexpr const char* op = "ep_moe_forward";
  Placement w(op);
  w.add(out, "out", X, "X", W1, "W1", W2, "W2", topk_ids, "topk_ids", topk_weights, "topk_weights", b1, "b1", b2,
        "b2", w1_scales, "w1_scales", w2_scales, "w2_scales", w1_mx_scales, "w1_mx_scales", w2_mx_scales,
        "w2_mx_scales", shared_output, "shared_output", dropped, "dropped", workspace, "workspace");
  if (!w.cuda()) fail(op, "X", "expert parallelism runs on CUDA tensors only");
  require_ndim(topk_ids, 2, op, "topk_ids");
  const int k = int(dim(topk_ids, 1));
  fm::EpMoeForwardArgs a = ep_forward_args(comm, W1, W2, k, num_experts, max_tokens_per_rank, recv_capacity, sizing,
                                           fp8_rows, direct_only, b1, b2, w1_layout, activation, limit, alpha, mode,
                                           fp8, w1_scales, w2_scales, weights, w1_mx_scales, w2_mx_scales, op);
  const int64_t H = a.moe.hidden;
  require_dtype(X, kBFloat16, op, "X");
  if (dim(X, 1) != H) fail(op, "X", "must have H = ", H, " columns, as W2 (got shape ", shape_str(X), ")");
  const int64_t T = dim(X, 0);
  require_dense(topk_ids, kInt32, {T, k}, op, "topk_ids");
  require_dense(topk_weights, kFloat32, {T, k}, op, "topk_weights");
  require_dtype(out, kBFloat16, op, "out");
  if (dim(out, 0) != T || dim(out, 1) != H)
    fail(op, "out", "must have shape [T = ", T, ", H = ", H, "] (got ", shape_str(out), ")");
  a.shared_stride = shared_output_stride(shared_output, kBFloat16, T, H, op);
  if (dropped) require_dense(*dropped, kInt32, {1}, op, "dropped");
  a.num_tokens = T;
  a.X = ptr(X);
  a.x_stride = row_stride(X, op, "X");
  a.topk_ids = static_cast<const int32_t*>(ptr(topk_ids));
  a.topk_weights = static_cast<const float*>(ptr(topk_weights));
  a.shared_output = ptr(shared_output);
  a.out = mut(out);
  a.out_stride = row_stride(out, op, "out");
  a.dropped = dropped ? static_cast<int32_t*>(mut(*dropped)) : nullptr;
  a.peers = peers ? peers->get() : nullptr;
  const Workspace ws = workspace_of(workspace, op);
  const ncclComm_t c = comm.get();
  dispatch(
      w, op, [&] { return fm::ep_moe_forward(a, c, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::Status(fm::StatusCode::kNotSupported, "ep_moe_forward: CUDA only"); });
}

fm::EpReplicatedArgs replicated_args(const NcclComm& comm, const In& W1, const In& W2, int k, int num_experts,
                                     const std::string& reduce, const OptIn& b1, const OptIn& b2,
                                     const std::string& w1_layout, const std::string& activation, float limit,
                                     float alpha, const std::string& mode, const std::string& fp8,
                                     const OptIn& w1_scales, const OptIn& w2_scales, const std::string& weights,
                                     const OptIn& w1_mx_scales, const OptIn& w2_mx_scales, const char* op) {
  fm::EpReplicatedArgs a;
  set_layer_experts(a.moe, W1, W2, b1, b2, true, w1_layout, activation, limit, alpha, mode, fp8, w1_scales, w2_scales,
                    weights, w1_mx_scales, w2_mx_scales, op);
  a.reduce = parse_enum(reduce, ep_reduces(), op, "reduce");
  a.moe.k = k;
  a.moe.num_experts = num_experts;
  a.moe.start_expert_id = comm.rank() * a.moe.num_experts_per_node;
  return a;
}

size_t ep_moe_forward_replicated_workspace_size(const NcclComm& comm, const In& W1, const In& W2, int64_t num_tokens,
                                                int k, int num_experts, const std::string& reduce,
                                                const std::string& mode, const std::string& fp8,
                                                const OptIn& w1_scales, const OptIn& w2_scales,
                                                const std::string& weights, const OptIn& w1_mx_scales,
                                                const OptIn& w2_mx_scales) {
  fm::EpReplicatedArgs a = replicated_args(comm, W1, W2, k, num_experts, reduce, std::nullopt, std::nullopt,
                                           "gate_up", "swiglu", 0.f, 0.f, mode, fp8, w1_scales, w2_scales, weights,
                                           w1_mx_scales, w2_mx_scales, "ep_moe_forward_replicated_workspace_size");
  a.moe.num_tokens = num_tokens;
  return fm::ep_moe_forward_replicated_workspace_size(a, comm.world());
}

void ep_moe_forward_replicated(const NcclComm& comm, const In& X, const In& W1, const In& W2, const In& topk_ids,
                               const In& topk_weights, const Out& out, int num_experts, const std::string& reduce,
                               const OptIn& b1, const OptIn& b2, const std::string& w1_layout,
                               const std::string& activation, float limit, float alpha, const std::string& mode,
                               const std::string& fp8, const OptIn& w1_scales, const OptIn& w2_scales,
                               const std::string& weights, const OptIn& w1_mx_scales, const OptIn& w2_mx_scales,
                               const OptIn& shared_output, const OptOut& workspace, uintptr_t stream) {
  constexpr const char* op = "ep_moe_forward_replicated";
  Placement w(op);
  w.add(out, "out", X, "X", W1, "W1", W2, "W2", topk_ids, "topk_ids", topk_weights, "topk_weights", b1, "b1", b2,
        "b2", w1_scales, "w1_scales", w2_scales, "w2_scales", w1_mx_scales, "w1_mx_scales", w2_mx_scales,
        "w2_mx_scales", shared_output, "shared_output", workspace, "workspace");
  if (!w.cuda()) fail(op, "X", "expert parallelism runs on CUDA tensors only");
  require_ndim(topk_ids, 2, op, "topk_ids");
  const int k = int(dim(topk_ids, 1));
  fm::EpReplicatedArgs a = replicated_args(comm, W1, W2, k, num_experts, reduce, b1, b2, w1_layout, activation, limit,
                                           alpha, mode, fp8, w1_scales, w2_scales, weights, w1_mx_scales,
                                           w2_mx_scales, op);
  const int64_t H = a.moe.hidden;
  require_dtype(X, kBFloat16, op, "X");
  if (dim(X, 1) != H) fail(op, "X", "must have H = ", H, " columns, as W2 (got shape ", shape_str(X), ")");
  const int64_t T = dim(X, 0), W = comm.world();
  require_dense(topk_ids, kInt32, {T, k}, op, "topk_ids");
  require_dense(topk_weights, kFloat32, {T, k}, op, "topk_weights");
  const int64_t rows = a.reduce == fm::EpReduce::kAllReduce ? T : (W > 0 ? T / W : T);
  require_dense(out, kBFloat16, {rows, H}, op, "out");
  a.moe.shared_stride = shared_output_stride(shared_output, kBFloat16, T, H, op);
  a.moe.num_tokens = T;
  a.moe.X = ptr(X);
  a.moe.x_stride = row_stride(X, op, "X");
  a.moe.token_selected_experts = static_cast<const int32_t*>(ptr(topk_ids));
  a.moe.token_final_scales = static_cast<const float*>(ptr(topk_weights));
  a.moe.shared_output = ptr(shared_output);
  a.out = mut(out);
  const Workspace ws = workspace_of(workspace, op);
  const ncclComm_t c = comm.get();
  dispatch(
      w, op, [&] { return fm::ep_moe_forward_replicated(a, c, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::Status(fm::StatusCode::kNotSupported, "ep_moe_forward_replicated: CUDA only"); });
}

}  // namespace

void register_ep(nb::module_& m) {
  using namespace nb::literals;
  m.def("ep_available", [] { return true; }, "True: this build has flashmix_ep (expert parallelism on NCCL).");
  m.attr("EP_SIZINGS") = enum_names_tuple(ep_sizings());
  m.attr("EP_REDUCES") = enum_names_tuple(ep_reduces());
  m.def("nccl_unique_id", &nccl_unique_id, "A fresh ncclUniqueId (bytes) for NcclComm; make it on one rank.");
  m.def("nccl_version", [] {
    int v = 0;
    raise_nccl(ncclGetVersion(&v), "ncclGetVersion");
    return v;
  }, "The loaded NCCL's version code (e.g. 22809).");
  nb::class_<NcclComm>(m, "NcclComm", "An NCCL communicator (ncclComm_t).")
      .def(nb::init<nb::bytes, int, int, int>(), "unique_id"_a, "world"_a, "rank"_a, "device"_a,
           "ncclCommInitRank on CUDA device `device`; destroyed with the object (or destroy()).")
      .def_static("wrap", [](uintptr_t handle) { return new NcclComm(handle); }, "handle"_a, nb::rv_policy::take_ownership,
                  "The caller's ncclComm_t (an int); never destroyed here.")
      .def_prop_ro("rank", &NcclComm::rank)
      .def_prop_ro("world", &NcclComm::world)
      .def_prop_ro("handle", &NcclComm::handle)
      .def("destroy", &NcclComm::destroy);
  nb::class_<EpPeers>(m, "EpPeers", "The direct EP transport of one workspace (spec §14.7, ep_peers_create).")
      .def(nb::init<const NcclComm&, const Out&, int64_t, int, int, int64_t, int64_t, bool, bool, uintptr_t>(),
           "comm"_a, "workspace"_a, nb::kw_only(), "hidden"_a, "k"_a, "num_experts"_a, "max_tokens_per_rank"_a,
           "recv_capacity"_a, "fp8_rows"_a, "direct_only"_a, "stream"_a,
           "Maps every rank's workspace into every other (collective over comm; synchronises the stream).")
      .def("release", &EpPeers::release, "comm"_a, "stream"_a,
           "ep_peers_destroy: waits for this GPU, then every rank (collective), then unmaps.");
  m.def("ep_moe_forward_workspace_size", &ep_moe_forward_workspace_size, "comm"_a, "W1"_a, "W2"_a, nb::kw_only(),
        "k"_a, "num_experts"_a, "max_tokens_per_rank"_a, "recv_capacity"_a, "sizing"_a, "fp8_rows"_a, "direct_only"_a,
        "mode"_a, "fp8"_a,
        "w1_scales"_a.none(), "w2_scales"_a.none(), "weights"_a, "w1_mx_scales"_a.none(), "w2_mx_scales"_a.none(),
        "Bytes of workspace ep_moe_forward needs (spec §14.4).");
  m.def("ep_moe_forward", &ep_moe_forward, "comm"_a, "X"_a, "W1"_a, "W2"_a, "topk_ids"_a, "topk_weights"_a, "out"_a,
        nb::kw_only(), "num_experts"_a, "max_tokens_per_rank"_a, "recv_capacity"_a, "sizing"_a, "fp8_rows"_a,
        "direct_only"_a, "b1"_a.none(),
        "b2"_a.none(), "w1_layout"_a, "activation"_a, "limit"_a, "alpha"_a, "mode"_a, "fp8"_a, "w1_scales"_a.none(),
        "w2_scales"_a.none(), "weights"_a, "w1_mx_scales"_a.none(), "w2_mx_scales"_a.none(), "shared_output"_a.none(),
        "dropped"_a.none(), "workspace"_a.none(), "peers"_a.none(), "stream"_a,
        "spec §14.3: dispatch, this rank's experts, combine into `out` [T, H]; with `peers` over the direct "
        "transport made for `workspace` (spec §14.7).");
  m.def("ep_moe_forward_replicated_workspace_size", &ep_moe_forward_replicated_workspace_size, "comm"_a, "W1"_a, "W2"_a,
        nb::kw_only(), "num_tokens"_a, "k"_a, "num_experts"_a, "reduce"_a, "mode"_a, "fp8"_a, "w1_scales"_a.none(),
        "w2_scales"_a.none(), "weights"_a, "w1_mx_scales"_a.none(), "w2_mx_scales"_a.none(),
        "Bytes of workspace ep_moe_forward_replicated needs.");
  m.def("ep_moe_forward_replicated", &ep_moe_forward_replicated, "comm"_a, "X"_a, "W1"_a, "W2"_a, "topk_ids"_a,
        "topk_weights"_a, "out"_a, nb::kw_only(), "num_experts"_a, "reduce"_a, "b1"_a.none(), "b2"_a.none(),
        "w1_layout"_a, "activation"_a, "limit"_a, "alpha"_a, "mode"_a, "fp8"_a, "w1_scales"_a.none(),
        "w2_scales"_a.none(), "weights"_a, "w1_mx_scales"_a.none(), "w2_mx_scales"_a.none(), "shared_output"_a.none(),
        "workspace"_a.none(), "stream"_a,
        "spec §14.2: this rank's experts over the replicated tokens, summed across ranks into `out`.");
}

}  // namespace flashmix::python
