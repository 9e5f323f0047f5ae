// The step executor of step_executor.h: host code only, built with the kernels so it links
// against their launchers without the torch binding in between.
#include "step_executor.h"

namespace pkv {

namespace {

cudaError_t fail(cudaError_t status, const char* launch, const char** failed_launch) {
  if (status != cudaSuccess && failed_launch != nullptr) *failed_launch = launch;
  return status;
}

constexpr const char* kLayoutError = "run_plan (plan layout or merge kind)";

cudaError_t run_workqueue(const DecodeArgs& args, const int64_t* layout, int64_t layout_len,
                          const int32_t* route_data, MergeKind merge, int32_t* pair_counters, cudaStream_t stream,
                          const char** failed_launch) {
  // Tasks of one pair are spread over the grid, never one cluster.
  if (layout_len < kLayoutRouteFields + 2 || merge == MergeKind::kCluster) {
    return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
  }
  const int64_t batch = layout[kLayoutBatch];
  const int64_t num_tasks = layout[kLayoutRouteFields], max_splits = layout[kLayoutRouteFields + 1];
  const bool merged = max_splits > 1;
  const bool fused = merged && merge == MergeKind::kFused;
  if (num_tasks < 0 || max_splits > kMaxMergeSlots || (fused && pair_counters == nullptr)) {
    return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
  }
  const int32_t* split_offsets = route_data + 5 * num_tasks;
  cudaError_t status = launch_workqueue_decode(args, route_data, static_cast<int>(num_tasks), split_offsets,
                                               fused ? pair_counters : nullptr, stream);
  if (status != cudaSuccess) return fail(status, "workqueue_decode", failed_launch);
  if (!merged || fused) return cudaSuccess;
  status = launch_merge_states(args, nullptr, split_offsets, static_cast<int>(batch * args.num_kv_heads), 0, stream);
  return fail(status, "merge_states", failed_launch);
}

cudaError_t run_buckets(const DecodeArgs& args, const int64_t* layout, int64_t layout_len, const int32_t* row_data,
                        MergeKind merge, int32_t* pair_counters, cudaStream_t stream, const char** failed_launch) {
  const int64_t batch = layout[kLayoutBatch], slots = layout[kLayoutNumSlots];
  const int64_t num_launches = layout[kLayoutRouteFields];
  if (num_launches < 0 || layout_len != kLayoutRouteFields + 1 + 2 * num_launches) {
    return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
  }
  const int64_t hkv = args.num_kv_heads, state_size = args.group_size;
  int64_t row_offset = 0, slot_offset = 0;
  for (int64_t j = 0; j < num_launches; ++j) {
    const int64_t rows = layout[kLayoutRouteFields + 1 + 2 * j];
    const int64_t splits = layout[kLayoutRouteFields + 2 + 2 * j];
    const bool merged = splits > 1;
    const bool cluster = merged && merge == MergeKind::kCluster, fused = merged && merge == MergeKind::kFused;
    if (rows < 0 || splits < 1 || splits > kMaxMergeSlots || row_offset + rows > batch ||
        slot_offset + rows * hkv * splits > slots || (cluster && splits > kMaxClusterSplits) ||
        (fused && pair_counters == nullptr)) {
      return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
    }
    DecodeArgs launch = args;  // this launch's slots start after the previous launches'
    launch.part_m += slot_offset * state_size;
    launch.part_l += slot_offset * state_size;
    launch.part_acc += slot_offset * state_size * kHeadDim;
    const int32_t* row_indices = row_data + row_offset;
    const int num_rows = static_cast<int>(rows), num_splits = static_cast<int>(splits);
    cudaError_t status;
    if (cluster) {
      status = fail(launch_bucket_cluster_decode(launch, row_indices, num_rows, num_splits, stream),
                    "bucket_decode (cluster merge)", failed_launch);
    } else {
      status = fail(launch_bucket_decode(launch, row_indices, num_rows, num_splits, fused ? pair_counters : nullptr,
                                         stream),
                    "bucket_decode", failed_launch);
      if (status == cudaSuccess && merged && !fused) {
        status = fail(launch_merge_states(launch, row_indices, nullptr, num_rows * args.num_kv_heads, num_splits,
                                          stream),
                      "merge_states", failed_launch);
      }
    }
    if (status != cudaSuccess) return status;
    row_offset += rows;
    slot_offset += rows * hkv * splits;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t run_step_plan(const DecodeArgs& args, const int64_t* layout, int64_t layout_len,
                          const int32_t* route_data, MergeKind merge, int32_t* pair_counters, cudaStream_t stream,
                          const char** failed_launch) {
  const bool known_merge =
      merge == MergeKind::kLaunch || merge == MergeKind::kFused || merge == MergeKind::kCluster;
  if (layout == nullptr || layout_len < kLayoutRouteFields + 1 || !known_merge) {
    return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
  }
  switch (layout[kLayoutRoute]) {
    case kRouteWorkqueue:
      return run_workqueue(args, layout, layout_len, route_data, merge, pair_counters, stream, failed_launch);
    case kRouteBuckets:
      return run_buckets(args, layout, layout_len, route_data, merge, pair_counters, stream, failed_launch);
    default:
      return fail(cudaErrorInvalidValue, kLayoutError, failed_launch);
  }
}

}  // namespace pkv
