// The untyped entry points of pkv_launch.h: dispatch on the KV dtype and the group size G to the
// launchers that launch_impl.cuh defines and the launch_{fp16,bf16}_g*.cu files instantiate.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "pkv_launch.h"

namespace pkv {

template <typename T, int G>
cudaError_t bucket_decode_typed(const DecodeArgs&, const int32_t*, int, int, int32_t*, cudaStream_t, bool);
template <typename T, int G>
cudaError_t bucket_cluster_decode_typed(const DecodeArgs&, const int32_t*, int, int, cudaStream_t);
template <typename T, int G>
cudaError_t workqueue_decode_typed(const DecodeArgs&, const int32_t*, int, const int32_t*, int32_t*, cudaStream_t,
                                   const int32_t*);
template <typename T, int G>
cudaError_t merge_states_typed(const DecodeArgs&, const int32_t*, const int32_t*, int, int, cudaStream_t);

namespace {

template <typename F>
cudaError_t dispatch_group_size(int group_size, F&& launch) {
  static_assert(kMaxGroupSize == 8, "one case per G");
  switch (group_size) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 3: return launch(std::integral_constant<int, 3>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    case 5: return launch(std::integral_constant<int, 5>{});
    case 6: return launch(std::integral_constant<int, 6>{});
    case 7: return launch(std::integral_constant<int, 7>{});
    case 8: return launch(std::integral_constant<int, 8>{});
    default: return cudaErrorInvalidValue;
  }
}

// Calls launch(T{}, G) for the launch's dtype and group size.
template <typename F>
cudaError_t dispatch(const DecodeArgs& args, F&& launch) {
  return dispatch_group_size(args.group_size, [&](auto g) {
    return args.dtype == KvDtype::kFloat16 ? launch(__half{}, g) : launch(__nv_bfloat16{}, g);
  });
}

}  // namespace

cudaError_t launch_bucket_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows, int num_splits,
                                 int32_t* pair_counters, cudaStream_t stream, bool live_splits_only) {
  if (num_rows == 0) return cudaSuccess;
  return dispatch(args, [&](auto t, auto g) {
    return bucket_decode_typed<decltype(t), decltype(g)::value>(args, row_indices, num_rows, num_splits,
                                                                pair_counters, stream, live_splits_only);
  });
}

cudaError_t launch_bucket_cluster_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                         int num_splits, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  return dispatch(args, [&](auto t, auto g) {
    return bucket_cluster_decode_typed<decltype(t), decltype(g)::value>(args, row_indices, num_rows, num_splits,
                                                                        stream);
  });
}

cudaError_t launch_workqueue_decode(const DecodeArgs& args, const int32_t* tasks, int num_tasks,
                                    const int32_t* split_offsets, int32_t* pair_counters, cudaStream_t stream,
                                    const int32_t* live_tasks) {
  if (num_tasks == 0) return cudaSuccess;
  return dispatch(args, [&](auto t, auto g) {
    return workqueue_decode_typed<decltype(t), decltype(g)::value>(args, tasks, num_tasks, split_offsets,
                                                                   pair_counters, stream, live_tasks);
  });
}

cudaError_t launch_merge_states(const DecodeArgs& args, const int32_t* row_indices, const int32_t* split_offsets,
                                int num_pairs, int num_splits, cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  return dispatch(args, [&](auto t, auto g) {
    return merge_states_typed<decltype(t), decltype(g)::value>(args, row_indices, split_offsets, num_pairs,
                                                               num_splits, stream);
  });
}

}  // namespace pkv
