// Typed launchers of one dtype and one G: grid shapes, the ring-depth dispatch and the dynamic
// shared-memory opt-in.
#pragma once
#include <atomic>

#include <cuda_runtime.h>

#include "merge_states.cuh"
#include "pkv_launch.h"
#include "split_decode.cuh"

namespace pkv {

// Sets a kernel's function attribute once per device: the template parameters are the kernel,
// the attribute and its value, so each (dtype, G, route, attribute) has its own flags, and a
// process that launches on several GPUs sets it on each (an attribute holds for the device that
// was current when it was set).
constexpr int kMaxAttributeDevices = 64;
template <auto Kernel, cudaFuncAttribute Attribute, int Value>
cudaError_t set_attribute_once() {
  static std::atomic<bool> done[kMaxAttributeDevices];
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const bool tracked = device >= 0 && device < kMaxAttributeDevices;
  if (tracked && done[device].load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(Kernel, Attribute, Value);
  if (status == cudaSuccess && tracked) done[device].store(true, std::memory_order_relaxed);
  return status;
}

// Raises a decode kernel's dynamic shared-memory limit (48 KB is the default cap).
template <auto Kernel, int Bytes>
cudaError_t allow_decode_smem() {
  return set_attribute_once<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Bytes>();
}

// The configuration of a launch that may start while the previous grid on its stream drains
// (programmatic dependent launch); the kernel waits for that grid in griddepcontrol.wait.
struct ProgrammaticLaunch {
  cudaLaunchAttribute attribute{};
  cudaLaunchConfig_t config{};
  ProgrammaticLaunch(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream) {
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &attribute;  // a member: the struct is neither copied nor moved
    config.numAttrs = 1;
  }
  ProgrammaticLaunch(const ProgrammaticLaunch&) = delete;
  ProgrammaticLaunch& operator=(const ProgrammaticLaunch&) = delete;
};

template <typename F>
cudaError_t dispatch_stages(int stages, F&& launch) {
  switch (stages) {
    case 2: return launch(std::integral_constant<int, 2>{});
    case 3: return launch(std::integral_constant<int, 3>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int G>
cudaError_t bucket_decode_typed(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                int num_splits, int32_t* pair_counters, cudaStream_t stream, bool live_splits_only) {
  return dispatch_stages(args.stages, [&](auto st) {
    constexpr int S = decltype(st)::value, bytes = decode_smem_bytes<S>();
    constexpr auto kernel = bucket_decode_kernel<T, G, S>;
    if (cudaError_t e = allow_decode_smem<kernel, bytes>(); e != cudaSuccess) return e;
    const dim3 grid(num_rows, args.num_kv_heads, num_splits);
    kernel<<<grid, kThreads, bytes, stream>>>(args, row_indices, num_splits, pair_counters, live_splits_only);
    return cudaGetLastError();
  });
}

// Clusters of more than 8 CTAs are outside the portable size: each kernel opts in once.
template <auto Kernel>
cudaError_t allow_large_clusters() {
  return set_attribute_once<Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1>();
}

template <typename T, int G>
cudaError_t bucket_cluster_decode_typed(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                        int num_splits, cudaStream_t stream) {
  if (num_splits < 2 || num_splits > kMaxClusterSplits) return cudaErrorInvalidValue;
  return dispatch_stages(args.stages, [&](auto st) {
    constexpr int S = decltype(st)::value, bytes = decode_smem_bytes<S>();
    constexpr auto kernel = bucket_cluster_decode_kernel<T, G, S>;
    if (cudaError_t e = allow_decode_smem<kernel, bytes>(); e != cudaSuccess) return e;
    if (cudaError_t e = allow_large_clusters<kernel>(); e != cudaSuccess) return e;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(num_rows, args.num_kv_heads, num_splits);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;  // one cluster: the splits of one (row, KV head)
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = num_splits;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args, row_indices, num_splits);
  });
}

template <typename T, int G>
cudaError_t workqueue_decode_typed(const DecodeArgs& args, const int32_t* tasks, int num_tasks,
                                   const int32_t* split_offsets, int32_t* pair_counters, cudaStream_t stream,
                                   const int32_t* live_tasks) {
  return dispatch_stages(args.stages, [&](auto st) {
    constexpr int S = decltype(st)::value, bytes = decode_smem_bytes<S>();
    constexpr auto kernel = workqueue_decode_kernel<T, G, S>;
    if (cudaError_t e = allow_decode_smem<kernel, bytes>(); e != cudaSuccess) return e;
    if (live_tasks == nullptr) {
      kernel<<<num_tasks, kThreads, bytes, stream>>>(args, tasks, split_offsets, pair_counters, live_tasks);
      return cudaGetLastError();
    }
    // After a device planner: launched programmatically, so the grid is resident when the plan ends.
    const ProgrammaticLaunch launch(dim3(num_tasks), dim3(kThreads), bytes, stream);
    return cudaLaunchKernelEx(&launch.config, kernel, args, tasks, split_offsets, pair_counters, live_tasks);
  });
}

template <typename T, int G>
cudaError_t merge_states_typed(const DecodeArgs& args, const int32_t* row_indices, const int32_t* split_offsets,
                               int num_pairs, int num_splits, cudaStream_t stream) {
  if (num_splits > kMaxMergeSlots) return cudaErrorInvalidValue;
  // Programmatic dependent launch: the merge grid is set up while the decode grid drains.
  const ProgrammaticLaunch launch(dim3(num_pairs, G), dim3(kMergeThreads), 0, stream);
  return cudaLaunchKernelEx(&launch.config, merge_states_kernel<T, G>, args, row_indices, split_offsets,
                            num_splits);
}

// The launchers of one dtype and one G; the instantiation files split the (dtype, G) pairs so
// that they compile in parallel; launch.cu declares them and dispatches on G.
#define PKV_INSTANTIATE_LAUNCHERS(T, G)                                                                  \
  template cudaError_t bucket_decode_typed<T, G>(const DecodeArgs&, const int32_t*, int, int, int32_t*,       \
                                                 cudaStream_t, bool);                                    \
  template cudaError_t bucket_cluster_decode_typed<T, G>(const DecodeArgs&, const int32_t*, int, int,       \
                                                         cudaStream_t);                                  \
  template cudaError_t workqueue_decode_typed<T, G>(const DecodeArgs&, const int32_t*, int, const int32_t*,  \
                                                    int32_t*, cudaStream_t, const int32_t*);              \
  template cudaError_t merge_states_typed<T, G>(const DecodeArgs&, const int32_t*, const int32_t*, int, int, \
                                                cudaStream_t);

}  // namespace pkv
