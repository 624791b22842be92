// GPU test helpers: skip cleanly without a GPU, RAII device buffers, and
// checked CUDA calls.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#define CUDA_OK(x)                                                                  \
  do {                                                                              \
    cudaError_t err_ = (x);                                                         \
    ASSERT_EQ(err_, cudaSuccess) << #x << ": " << cudaGetErrorString(err_);          \
  } while (0)

// Skips the test (reported as skipped, never passed) without an sm_90 GPU;
// `op` names the op that needs it.
#define SKIP_WITHOUT_HOPPER_FOR(op)                                                   \
  do {                                                                               \
    SKIP_WITHOUT_GPU();                                                              \
    if (!::flashmix::testing::have_hopper()) GTEST_SKIP() << op " needs an sm_90 GPU"; \
  } while (0)

#define SKIP_WITHOUT_GPU()                                                          \
  do {                                                                              \
    if (!::flashmix::testing::have_gpu()) GTEST_SKIP() << "no CUDA GPU on this machine"; \
  } while (0)

namespace flashmix::testing {

#ifdef __CUDACC__
// The start of a stand-in for the kernel ahead of an op with a PDL option:
// it lets its dependents launch at once, then spins for `delay_ns` before it
// writes what the dependent must only read after its grid dependency wait.
__device__ inline void launch_dependents_then_wait_ns(long long delay_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < (unsigned long long)delay_ns);
}
#endif

// Whether the current device is an sm_90 (Hopper) GPU, which the TMA + wgmma
// ops need.
inline bool have_hopper();

inline bool have_gpu() {
  static const bool yes = [] {
    int n = 0;
    bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    (void)cudaGetLastError();
    return ok;
  }();
  return yes;
}

inline bool have_hopper() {
  if (!have_gpu()) return false;
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major == 9;
}

// Runs `issue` on `stream` once directly, or (graph) once to set the
// kernels' attributes up outside a capture, then `reset` and a captured
// graph of `issue` replayed three times; synchronises either way.
inline void run_direct_or_graph(cudaStream_t stream, bool graph, const std::function<void()>& issue,
                                const std::function<void()>& reset) {
  if (graph) {
    issue();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    reset();
    cudaGraph_t g;
    cudaGraphExec_t ge;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    issue();
    EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(cudaGraphLaunch(ge, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  } else {
    issue();
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
}

// A device allocation; freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes && cudaMalloc(&ptr_, bytes) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc(" << bytes << ") failed";
    }
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host.data(), bytes_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }

  // A cudaMemcpy from pageable host memory may return before its DMA has
  // landed (CUDA's API synchronization rules), and work on a non-blocking
  // stream does not wait for it: wait here, so no kernel reads (or poisoned
  // output is written over) before the upload is complete.
  void upload(const void* src, size_t n) {
    if (n) {
      EXPECT_EQ(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }
  void download(void* dst, size_t n) const {
    if (n) EXPECT_EQ(cudaMemcpy(dst, ptr_, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  template <typename T>
  std::vector<T> to_host() const {
    std::vector<T> v(bytes_ / sizeof(T));
    download(v.data(), v.size() * sizeof(T));
    return v;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A device buffer of `bytes` filled with `byte`: a pattern no kernel writes
// by accident, so a missed output shows.
inline DeviceBuffer poisoned_buffer(size_t bytes, uint8_t byte) {
  DeviceBuffer b(bytes);
  if (bytes) {
    EXPECT_EQ(cudaMemset(b.get(), byte, bytes), cudaSuccess);
    // cudaMemset runs on the legacy default stream, which a non-blocking
    // stream does not wait for: finish it here, or it may land on top of a
    // result written on such a stream afterwards.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  return b;
}

// A device buffer of `bytes` zeros (a workspace that must start zeroed),
// ready before any stream's work.
inline DeviceBuffer zeroed_buffer(size_t bytes) { return poisoned_buffer(bytes, 0); }

}  // namespace flashmix::testing
