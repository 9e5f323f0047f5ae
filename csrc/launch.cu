// The untyped entry points of pkv_launch.h: dispatch on the KV dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pkv_launch.h"

namespace pkv {

template <typename T>
cudaError_t bucket_decode_typed(const DecodeArgs&, const int32_t*, int, int, int32_t*, cudaStream_t, bool);
template <typename T>
cudaError_t bucket_cluster_decode_typed(const DecodeArgs&, const int32_t*, int, int, cudaStream_t);
template <typename T>
cudaError_t workqueue_decode_typed(const DecodeArgs&, const int32_t*, int, const int32_t*, int32_t*, cudaStream_t,
                                   const int32_t*);
template <typename T>
cudaError_t merge_states_typed(const DecodeArgs&, const int32_t*, const int32_t*, int, int, cudaStream_t);

cudaError_t launch_bucket_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows, int num_splits,
                                 int32_t* pair_counters, cudaStream_t stream, bool live_splits_only) {
  if (num_rows == 0) return cudaSuccess;
  return args.dtype == KvDtype::kFloat16
             ? bucket_decode_typed<__half>(args, row_indices, num_rows, num_splits, pair_counters, stream,
                                           live_splits_only)
             : bucket_decode_typed<__nv_bfloat16>(args, row_indices, num_rows, num_splits, pair_counters, stream,
                                                  live_splits_only);
}

cudaError_t launch_bucket_cluster_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                         int num_splits, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  return args.dtype == KvDtype::kFloat16
             ? bucket_cluster_decode_typed<__half>(args, row_indices, num_rows, num_splits, stream)
             : bucket_cluster_decode_typed<__nv_bfloat16>(args, row_indices, num_rows, num_splits, stream);
}

cudaError_t launch_workqueue_decode(const DecodeArgs& args, const int32_t* tasks, int num_tasks,
                                    const int32_t* split_offsets, int32_t* pair_counters, cudaStream_t stream,
                                    const int32_t* live_tasks) {
  if (num_tasks == 0) return cudaSuccess;
  return args.dtype == KvDtype::kFloat16
             ? workqueue_decode_typed<__half>(args, tasks, num_tasks, split_offsets, pair_counters, stream,
                                              live_tasks)
             : workqueue_decode_typed<__nv_bfloat16>(args, tasks, num_tasks, split_offsets, pair_counters, stream,
                                                     live_tasks);
}

cudaError_t launch_merge_states(const DecodeArgs& args, const int32_t* row_indices, const int32_t* split_offsets,
                                int num_pairs, int num_splits, cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  return args.dtype == KvDtype::kFloat16
             ? merge_states_typed<__half>(args, row_indices, split_offsets, num_pairs, num_splits, stream)
             : merge_states_typed<__nv_bfloat16>(args, row_indices, split_offsets, num_pairs, num_splits, stream);
}

}  // namespace pkv
