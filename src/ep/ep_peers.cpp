// The direct transport's set-up (spec §14.7): every rank maps every other
// rank's workspace. Each rank publishes its workspace's allocation (a CUDA
// IPC handle and the workspace's offset in it, its process id and device)
// through one NCCL all-gather; a rank in another process is opened by its
// handle, one in this process (a communicator over several GPUs of one
// process) is reached by its pointer with peer access enabled. Every rank
// then zeroes its handshake words, and an all-reduce of the ranks' failures
// makes the outcome the same on all of them: either every rank holds a
// complete table or every rank gets the error.
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <cuda.h>  // CUdeviceptr / CUresult for the driver entry point only
#include <cuda_runtime.h>

#include "common/check.h"
#include "ep/ep_internal.h"
#include "flashmix/ep.h"

namespace flashmix {

struct EpPeers {
  EpShape shape;
  void* workspace = nullptr;
  int device = -1;
  char** bases = nullptr;       // device [W]: PeerBases::ws
  std::vector<void*> opened;    // IPC mappings to close
};

namespace ep {
namespace {

constexpr const char* kCreateOp = "ep_peers_create";

// What a rank publishes about its workspace.
struct Published {
  cudaIpcMemHandle_t handle;  // of the allocation holding the workspace
  uint64_t offset;            // the workspace's byte offset in that allocation
  uint64_t pointer;           // the workspace's address in its own process
  int64_t pid;
  int32_t device;
  int32_t pad;
};

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRange address_range_fn() {
  static const GetAddressRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return GetAddressRange(nullptr);
    }
    return reinterpret_cast<GetAddressRange>(f);
  }();
  return fn;
}

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  return Status(StatusCode::kCommError, detail::concat(kCreateOp, ": ", what, ": ", ncclGetErrorString(r)));
}

// This rank's record; a failure is reported, not returned, so that the
// exchange still happens on every rank.
Status describe(void* workspace, int device, Published* me) {
  std::memset(me, 0, sizeof(*me));
  me->pointer = reinterpret_cast<uintptr_t>(workspace);
  me->pid = int64_t(getpid());
  me->device = device;
  const GetAddressRange range = address_range_fn();
  if (range == nullptr)
    return Status(StatusCode::kNotSupported, detail::concat(kCreateOp, ": the driver offers no cuMemGetAddressRange"));
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, CUdeviceptr(reinterpret_cast<uintptr_t>(workspace))) != CUDA_SUCCESS)
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(kCreateOp, ": workspace: not device memory this process allocated"));
  me->offset = uint64_t(reinterpret_cast<uintptr_t>(workspace) - uintptr_t(base));
  const cudaError_t e = cudaIpcGetMemHandle(&me->handle, reinterpret_cast<void*>(uintptr_t(base)));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kNotSupported,
                  detail::concat(kCreateOp, ": workspace: its allocation cannot be shared with other processes "
                                            "(cudaIpcGetMemHandle: ",
                                 cudaGetErrorName(e), "); allocate it with cudaMalloc"));
  }
  return Status::Ok();
}

// Rank p's workspace as this process reaches it.
Status open_peer(const Published& p, int my_device, EpPeers* peers, char** base) {
  if (p.pid == int64_t(getpid())) {
    if (p.device != my_device) {
      int can = 0;
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaDeviceCanAccessPeer(&can, my_device, p.device), kCreateOp,
                                             "cudaDeviceCanAccessPeer"));
      if (!can)
        return Status(StatusCode::kNotSupported,
                      detail::concat(kCreateOp, ": GPU ", my_device, " cannot reach GPU ", p.device, " (no peer access)"));
      const cudaError_t e = cudaDeviceEnablePeerAccess(p.device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        (void)cudaGetLastError();
      else
        FM_RETURN_IF_ERROR(detail::cuda_status(e, kCreateOp, "cudaDeviceEnablePeerAccess"));
    }
    *base = reinterpret_cast<char*>(uintptr_t(p.pointer));
    return Status::Ok();
  }
  void* mapped = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&mapped, p.handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kNotSupported,
                  detail::concat(kCreateOp, ": cannot map a peer's workspace (cudaIpcOpenMemHandle: ",
                                 cudaGetErrorName(e), "): the GPUs need peer access to each other"));
  }
  peers->opened.push_back(mapped);
  *base = static_cast<char*>(mapped) + p.offset;
  return Status::Ok();
}

Status create(const EpShape& shape, void* workspace, ncclComm_t comm, cudaStream_t stream, EpPeers* peers) {
  const int W = shape.world;
  const Layout l = layout(shape);
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaGetDevice(&peers->device), kCreateOp, "cudaGetDevice"));
  // One device buffer: the records [W], then the failure count.
  const size_t rec = (sizeof(Published) + 15) / 16 * 16;
  void* scratch = nullptr;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMalloc(&scratch, rec * size_t(W) + 16), kCreateOp, "cudaMalloc"));
  std::unique_ptr<void, void (*)(void*)> free_scratch(scratch, [](void* p) { (void)cudaFree(p); });
  char* recs = static_cast<char*>(scratch);
  int32_t* failed = reinterpret_cast<int32_t*>(recs + rec * size_t(W));

  Published me;
  Status mine = describe(workspace, peers->device, &me);
  FM_RETURN_IF_ERROR(detail::cuda_status(
      cudaMemcpyAsync(recs + rec * size_t(shape.rank), &me, sizeof(me), cudaMemcpyHostToDevice, stream), kCreateOp,
      "copying the record"));
  FM_RETURN_IF_ERROR(nccl_status(
      ncclAllGather(recs + rec * size_t(shape.rank), recs, rec, ncclUint8, comm, stream), "ncclAllGather"));
  std::vector<char> all(rec * size_t(W));
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpyAsync(all.data(), recs, all.size(), cudaMemcpyDeviceToHost, stream),
                                         kCreateOp, "copying the records"));
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaStreamSynchronize(stream), kCreateOp, "cudaStreamSynchronize"));

  std::vector<char*> bases(size_t(W), nullptr);
  bases[size_t(shape.rank)] = static_cast<char*>(workspace);
  for (int p = 0; p < W && mine.ok(); ++p) {
    if (p == shape.rank) continue;
    Published theirs;
    std::memcpy(&theirs, all.data() + rec * size_t(p), sizeof(theirs));
    mine = open_peer(theirs, peers->device, peers, &bases[size_t(p)]);
  }
  if (mine.ok()) {
    mine = detail::cuda_status(cudaMalloc(reinterpret_cast<void**>(&peers->bases), size_t(W) * sizeof(char*)),
                               kCreateOp, "cudaMalloc");
  }
  if (mine.ok()) {
    mine = detail::cuda_status(cudaMemcpyAsync(peers->bases, bases.data(), size_t(W) * sizeof(char*),
                                               cudaMemcpyHostToDevice, stream),
                               kCreateOp, "copying the table");
  }
  if (mine.ok()) {
    mine = detail::cuda_status(cudaMemsetAsync(static_cast<char*>(workspace) + l.sync, 0, sync_bytes(W), stream),
                               kCreateOp, "zeroing the handshake words");
  }
  // Every rank learns whether any rank failed; the all-reduce also orders
  // every rank's zeroing before any rank's first handshake.
  const int32_t flag = mine.ok() ? 0 : 1;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpyAsync(failed, &flag, 4, cudaMemcpyHostToDevice, stream), kCreateOp,
                                         "copying the outcome"));
  FM_RETURN_IF_ERROR(nccl_status(ncclAllReduce(failed, failed, 1, ncclInt32, ncclSum, comm, stream), "ncclAllReduce"));
  int32_t any = 0;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpyAsync(&any, failed, 4, cudaMemcpyDeviceToHost, stream), kCreateOp,
                                         "copying the outcome"));
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaStreamSynchronize(stream), kCreateOp, "cudaStreamSynchronize"));
  if (!mine.ok()) return mine;
  if (any != 0)
    return Status(StatusCode::kNotSupported,
                  detail::concat(kCreateOp, ": ", any, " rank(s) could not map the others' workspaces (see their error)"));
  return Status::Ok();
}

bool same_shape(const EpShape& a, const EpShape& b) {
  return a.rank == b.rank && a.world == b.world && a.hidden == b.hidden && a.k == b.k &&
         a.num_experts == b.num_experts && a.max_tokens_per_rank == b.max_tokens_per_rank &&
         ep_recv_capacity(a) == ep_recv_capacity(b) && a.fp8_rows == b.fp8_rows;
}

}  // namespace

Status check_peers(const char* op, const EpPeers* peers, const EpShape& s, const void* workspace) {
  if (peers == nullptr) return Status::Ok();
  FM_REQUIRE(peers->workspace == workspace, op, "peers", "was made for another workspace (ep_peers_create maps one)");
  FM_REQUIRE(same_shape(peers->shape, s), op, "peers", "was made for another shape");
  int device = -1;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaGetDevice(&device), op, "cudaGetDevice"));
  FM_REQUIRE(device == peers->device, op, "peers", "was made on GPU ", peers->device, ", the current GPU is ", device);
  return Status::Ok();
}

PeerBases peer_bases(const EpPeers* peers) {
  PeerBases b;
  if (peers != nullptr) b.ws = peers->bases;
  return b;
}

}  // namespace ep

Status ep_peers_create(const EpShape& shape, void* workspace, size_t workspace_bytes, ncclComm_t comm,
                       cudaStream_t stream, EpPeers** peers) {
  using namespace ep;
  FM_REQUIRE(peers != nullptr, kCreateOp, "peers", "must not be null");
  *peers = nullptr;
  FM_REQUIRE(comm != nullptr, kCreateOp, "comm", "must not be null");
  FM_RETURN_IF_ERROR(check_shape(kCreateOp, shape, comm));
  const Layout l = layout(shape);
  FM_RETURN_IF_ERROR(check_workspace(kCreateOp, workspace, workspace_bytes, l.total, "ep_workspace_size"));
  auto made = std::make_unique<EpPeers>();
  made->shape = shape;
  made->workspace = workspace;
  const Status st = detail::without_cuda_error_left(kCreateOp, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, kCreateOp));
    return create(shape, workspace, comm, stream, made.get());
  });
  if (!st.ok()) {
    ep_peers_destroy(made.release());
    return st;
  }
  *peers = made.release();
  return Status::Ok();
}

void ep_peers_destroy(EpPeers* peers) {
  if (peers == nullptr) return;
  const bool pending = cudaPeekAtLastError() != cudaSuccess;  // the caller's: left as it is
  int current = -1;
  const bool switch_device = cudaGetDevice(&current) == cudaSuccess && peers->device >= 0 && current != peers->device;
  if (switch_device) (void)cudaSetDevice(peers->device);
  for (void* p : peers->opened) (void)cudaIpcCloseMemHandle(p);
  if (peers->bases != nullptr) (void)cudaFree(peers->bases);
  if (switch_device) (void)cudaSetDevice(current);
  if (!pending) (void)cudaGetLastError();  // nothing of ours is left set
  delete peers;
}

}  // namespace flashmix
