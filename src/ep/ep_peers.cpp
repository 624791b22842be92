// The direct transport's set-up and teardown (spec §14.7): every rank maps
// every other rank's workspace. Each rank publishes its workspace's
// allocation (a CUDA IPC handle and the workspace's offset in it), a token
// that identifies its process, its device and a fingerprint of its shape
// through one NCCL all-gather; a rank in another process is opened by its
// handle, one in this process (one thread per GPU) is reached by its pointer
// with peer access enabled. Every rank then zeroes its handshake words, and
// an all-reduce of the ranks' failures makes the outcome the same on all of
// them: either every rank holds a complete table or every rank gets an
// error. Failures before the all-gather that a rank can see locally (bad
// arguments, a capturing stream) return before any collective on every rank
// that sees them; failures after it are folded into the all-reduce.
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include <cuda.h>  // CUdeviceptr / CUresult for the driver entry point only
#include <cuda_runtime.h>

#include "common/check.h"
#include "common/driver.h"
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
constexpr const char* kDestroyOp = "ep_peers_destroy";

// What a rank publishes about its workspace.
struct Published {
  cudaIpcMemHandle_t handle;  // of the allocation holding the workspace
  uint64_t offset;            // the workspace's byte offset in that allocation
  uint64_t pointer;           // the workspace's address in its own process
  uint64_t process;           // this process's token (process_token)
  uint64_t shape;             // shape_fingerprint of the publisher's shape
  int32_t device;
  int32_t ok;                 // 0: this rank failed before the exchange (its record is not usable)
};

// A random 64-bit token per process: two ranks share a process exactly when
// their tokens are equal (pids repeat across containers and hosts). Made
// again after a fork (a child must not look like its parent).
uint64_t process_token() {
  static uint64_t token = 0;
  static pid_t owner = -1;
  static std::mutex lock;
  const std::lock_guard<std::mutex> hold(lock);
  if (owner != getpid()) {
    std::random_device rd;
    const uint64_t t = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    owner = getpid();
    token = (uint64_t(rd()) << 32 ^ uint64_t(rd())) ^ (uint64_t(owner) << 17) ^ t;
  }
  return token;
}

// What every rank must agree on for the layouts to match (not the rank).
uint64_t shape_fingerprint(const EpShape& s) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(uint64_t(s.world));
  mix(uint64_t(s.hidden));
  mix(uint64_t(s.k));
  mix(uint64_t(s.num_experts));
  mix(uint64_t(s.max_tokens_per_rank));
  mix(uint64_t(ep_recv_capacity(s)));
  mix(uint64_t(s.fp8_rows));
  mix(uint64_t(s.direct_only));  // moves the receive slabs' offsets
  return h;
}

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRange address_range_fn() {
  static const GetAddressRange fn =
      reinterpret_cast<GetAddressRange>(detail::driver_entry_point("cuMemGetAddressRange"));
  return fn;
}

Status nccl_status(ncclResult_t r, const char* op, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  return Status(StatusCode::kCommError, detail::concat(op, ": ", what, ": ", ncclGetErrorString(r)));
}

// This rank's record. A failure is reported, not returned early, so that the
// exchange still happens on every rank.
Status describe(const EpShape& shape, void* workspace, int device, Published* me) {
  std::memset(me, 0, sizeof(*me));
  me->pointer = reinterpret_cast<uintptr_t>(workspace);
  me->process = process_token();
  me->shape = shape_fingerprint(shape);
  me->device = device;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, workspace) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    (void)cudaGetLastError();
    return Status(StatusCode::kInvalidArgument, detail::concat(kCreateOp, ": workspace: not device memory"));
  }
  if (attr.device != device)
    return Status(StatusCode::kInvalidArgument, detail::concat(kCreateOp, ": workspace: is on GPU ", attr.device,
                                                               ", the current GPU is ", device));
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
  me->ok = 1;
  return Status::Ok();
}

// Rank p's workspace as this process reaches it.
Status open_peer(const Published& p, int my_device, EpPeers* peers, char** base) {
  if (p.process == process_token()) {
    if (p.device != my_device) {
      int can = 0;
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaDeviceCanAccessPeer(&can, my_device, p.device), kCreateOp,
                                             "cudaDeviceCanAccessPeer"));
      if (!can)
        return Status(StatusCode::kNotSupported,
                      detail::concat(kCreateOp, ": GPU ", my_device, " cannot reach GPU ", p.device,
                                     " (no peer access)"));
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

// An all-reduce (sum) of one int32 on `buf`, read back: every rank's `flag`
// summed, and a barrier (the stream is synchronised).
Status all_sum(int32_t* buf, int32_t flag, int32_t* sum, ncclComm_t comm, cudaStream_t stream, const char* op) {
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpyAsync(buf, &flag, 4, cudaMemcpyHostToDevice, stream), op,
                                         "copying the outcome"));
  FM_RETURN_IF_ERROR(nccl_status(ncclAllReduce(buf, buf, 1, ncclInt32, ncclSum, comm, stream), op, "ncclAllReduce"));
  FM_RETURN_IF_ERROR(
      detail::cuda_status(cudaMemcpyAsync(sum, buf, 4, cudaMemcpyDeviceToHost, stream), op, "copying the outcome"));
  return detail::cuda_status(cudaStreamSynchronize(stream), op, "cudaStreamSynchronize");
}

// The device scratch of the exchange: the records [W], then one int32.
struct Scratch {
  void* p = nullptr;
  ~Scratch() {
    if (p != nullptr) (void)cudaFree(p);
  }
};

Status create(const EpShape& shape, void* workspace, ncclComm_t comm, cudaStream_t stream, EpPeers* peers) {
  const int W = shape.world;
  const Layout l = layout(shape);
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaGetDevice(&peers->device), kCreateOp, "cudaGetDevice"));
  const size_t rec = (sizeof(Published) + 15) / 16 * 16;
  Scratch scratch;
  FM_RETURN_IF_ERROR(
      detail::cuda_status(cudaMalloc(&scratch.p, rec * size_t(W) + 16), kCreateOp, "cudaMalloc (the exchange)"));
  char* recs = static_cast<char*>(scratch.p);
  int32_t* failed = reinterpret_cast<int32_t*>(recs + rec * size_t(W));

  Published me;
  Status mine = describe(shape, workspace, peers->device, &me);
  FM_RETURN_IF_ERROR(detail::cuda_status(
      cudaMemcpyAsync(recs + rec * size_t(shape.rank), &me, sizeof(me), cudaMemcpyHostToDevice, stream), kCreateOp,
      "copying the record"));
  FM_RETURN_IF_ERROR(nccl_status(ncclAllGather(recs + rec * size_t(shape.rank), recs, rec, ncclUint8, comm, stream),
                                 kCreateOp, "ncclAllGather"));
  std::vector<char> all(rec * size_t(W));
  cudaError_t e = cudaMemcpyAsync(all.data(), recs, all.size(), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (mine.ok() && e != cudaSuccess) mine = detail::cuda_status(e, kCreateOp, "copying the records");

  std::vector<char*> bases(size_t(W), nullptr);
  bases[size_t(shape.rank)] = static_cast<char*>(workspace);
  for (int p = 0; p < W && mine.ok(); ++p) {
    if (p == shape.rank) continue;
    Published theirs;
    std::memcpy(&theirs, all.data() + rec * size_t(p), sizeof(theirs));
    if (!theirs.ok) break;  // that rank reports its own error; the all-reduce below fails every rank
    if (theirs.shape != me.shape) {
      mine = Status(StatusCode::kInvalidArgument,
                    detail::concat(kCreateOp, ": shape: rank ", p, " gave another shape (hidden, k, num_experts, "
                                                                  "max_tokens_per_rank, recv_capacity, fp8_rows or "
                                                                  "direct_only)"));
      break;
    }
    mine = open_peer(theirs, peers->device, peers, &bases[size_t(p)]);
  }
  if (mine.ok())
    mine = detail::cuda_status(cudaMalloc(reinterpret_cast<void**>(&peers->bases), size_t(W) * sizeof(char*)),
                               kCreateOp, "cudaMalloc");
  if (mine.ok())
    mine = detail::cuda_status(cudaMemcpyAsync(peers->bases, bases.data(), size_t(W) * sizeof(char*),
                                               cudaMemcpyHostToDevice, stream),
                               kCreateOp, "copying the table");
  if (mine.ok())
    mine = detail::cuda_status(cudaMemsetAsync(static_cast<char*>(workspace) + l.sync, 0, sync_bytes(W), stream),
                               kCreateOp, "zeroing the handshake words");
  if (!mine.ok()) (void)cudaGetLastError();  // reported through the Status; the collective still runs
  // Every rank learns whether any rank failed; the all-reduce also orders
  // every rank's zeroing before any rank's first handshake.
  int32_t any = 0;
  FM_RETURN_IF_ERROR(all_sum(failed, mine.ok() ? 0 : 1, &any, comm, stream, kCreateOp));
  if (!mine.ok()) return mine;
  if (any != 0)
    return Status(StatusCode::kNotSupported,
                  detail::concat(kCreateOp, ": ", any,
                                 " rank(s) could not map the others' workspaces (see their error)"));
  return Status::Ok();
}

bool same_shape(const EpShape& a, const EpShape& b) {
  return a.rank == b.rank && shape_fingerprint(a) == shape_fingerprint(b);
}

// Unmaps and frees what this rank holds (no collective).
void release_local(EpPeers* peers) {
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

}  // namespace

Status check_peers(const char* op, const EpPeers* peers, const EpShape& s, const void* workspace) {
  FM_REQUIRE(peers != nullptr || !s.direct_only, op, "peers",
             "must be given: shape.direct_only's workspace has no NCCL slabs (spec §14.7)");
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
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FM_RETURN_IF_ERROR(detail::cuda_status(cudaStreamGetCaptureInfo(stream, &capture), kCreateOp, "stream"));
    FM_REQUIRE(capture == cudaStreamCaptureStatusNone, kCreateOp, "stream",
               "is being captured: ep_peers_create synchronises (a set-up step; make it before the capture)");
    return create(shape, workspace, comm, stream, made.get());
  });
  if (!st.ok()) {
    release_local(made.release());
    return st;
  }
  *peers = made.release();
  return Status::Ok();
}

Status ep_peers_destroy(EpPeers* peers, ncclComm_t comm, cudaStream_t stream) {
  using namespace ep;
  if (peers == nullptr) return Status::Ok();
  if (comm == nullptr) {
    release_local(peers);
    return Status::Ok();
  }
  int current = -1;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaGetDevice(&current), kDestroyOp, "cudaGetDevice"));
  FM_REQUIRE(current == peers->device, kDestroyOp, "peers", "was made on GPU ", peers->device,
             ", the current GPU is ", current);  // nothing done: the caller may retry on that GPU
  // This GPU's work on the mappings ends, this rank unmaps, then a barrier:
  // after it every rank has unmapped every workspace, so each may free its
  // own. A failure on the way is reported after the barrier, which still
  // runs (the other ranks wait in it).
  const bool pending = cudaPeekAtLastError() != cudaSuccess;  // the caller's: left as it is
  Status st = detail::cuda_status(cudaDeviceSynchronize(), kDestroyOp, "cudaDeviceSynchronize");
  release_local(peers);
  Scratch scratch;
  Status barrier = detail::cuda_status(cudaMalloc(&scratch.p, 16), kDestroyOp, "cudaMalloc");
  int32_t sum = 0;
  if (barrier.ok()) barrier = all_sum(static_cast<int32_t*>(scratch.p), 0, &sum, comm, stream, kDestroyOp);
  if (!pending) (void)cudaGetLastError();  // ours are reported through the Status
  return st.ok() ? barrier : st;
}

}  // namespace flashmix
