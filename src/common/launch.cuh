// The device toolkit's launch half: kernel launches with programmatic
// dependent launch (PDL) and the in-kernel hooks that go with it.
//
// With PDL a kernel may start while the previous kernel on the stream is
// still finishing; it must call grid_dependency_wait() before touching any
// global memory the previous kernel may write (or read). It calls
// allow_dependents_launch() once it no longer needs its launch slot to be
// exclusive, so the next kernel's blocks can be scheduled early.
#pragma once

#include <cuda_runtime.h>

namespace flashmix::dev {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), with the PDL
// attribute when `pdl` is set. Returns the launch error (never sticky).
template <typename... KernelArgs, typename... Args>
cudaError_t launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// A launch configuration for clusters of `cluster_x` CTAs along x, with the
// PDL attribute when `pdl` is set; `attr` backs config.attrs and must
// outlive the launch.
inline cudaLaunchConfig_t cluster_launch_config(cudaLaunchAttribute (&attr)[2], dim3 grid, dim3 block, size_t smem,
                                                cudaStream_t stream, unsigned cluster_x, bool pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_x;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 2 : 1;
  return config;
}

}  // namespace flashmix::dev
