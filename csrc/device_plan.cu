// The workqueue plan on the GPU (device_plan.h): one CTA, a thread per row.
#include "device_plan.h"

namespace pkv {
namespace {

constexpr int kPlanThreads = kMaxDevicePlanRows;
constexpr int kWarps = kPlanThreads / 32;

// Exclusive prefix sum of `value` over the CTA's threads, and the total.
__device__ int block_exclusive_scan(int value, int* warp_totals, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = warp_totals[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum += other;
    }
    warp_totals[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  const int before_warp = warp == 0 ? 0 : warp_totals[warp - 1];
  *total = warp_totals[kWarps - 1];
  __syncthreads();  // warp_totals is reused by the next scan
  return before_warp + inclusive - value;
}

// Sum of `value` over the CTA's threads, in 64 bits (a batch's tiles can pass 2^31).
__device__ int64_t block_sum(int64_t value, int64_t* warp_sums) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = value;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  __syncthreads();  // warp_sums may be reused
  return total;
}

__global__ void __launch_bounds__(kPlanThreads)
    plan_workqueue_kernel(const int32_t* seq_lens, const int32_t* page_indptr, int batch, int hkv,
                          SplitPolicyArgs policy, int max_tokens, int page_size, int32_t* tasks,
                          int32_t* split_offsets, int32_t* counts) {
  // A row's tasks form at most two groups: its full-length splits, and its last split (the tail)
  // where that is shorter. Group g = tid holds row tid's full-length splits, g = kPlanThreads + tid
  // its tail; both indexed by row, so a group's row is g % kPlanThreads.
  __shared__ int tiles_of[kPlanThreads];
  __shared__ int splits_of[kPlanThreads];
  __shared__ int group_len[2 * kPlanThreads];    // tiles of each of the group's tasks (0: no group)
  __shared__ int group_splits[2 * kPlanThreads];  // splits of the group per KV head (0: no group)
  __shared__ int group_at[2 * kPlanThreads];      // sorted position -> group, longest first; -1 past the last
  __shared__ int task_begin[2 * kPlanThreads];    // sorted position -> its first task
  __shared__ int warp_totals[32];
  __shared__ int64_t warp_sums[32];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The decode grid may launch now; its CTAs wait in griddepcontrol.wait until this plan is written.
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
  const int tid = threadIdx.x;
  int tiles = 0, splits = 0;
  if (tid < batch) {
    // A block table addresses max_tokens a row, page lists each row's own entries (row_length in
    // split_decode.cuh clamps the same way).
    const int64_t limit = page_indptr == nullptr
                              ? max_tokens
                              : (static_cast<int64_t>(page_indptr[tid + 1]) - page_indptr[tid]) * page_size;
    tiles = static_cast<int>(row_tiles(clamped_length(seq_lens[tid], limit)));
  }
  // Every thread takes the same branch (policy is a kernel argument), so the sum's barriers hold.
  // One sum carries both totals: the tiles in the low 40 bits (at most 1024 rows of 2^26 tiles)
  // and the rows that have any above them.
  int64_t tiles_per_task = 0;
  if (policy.balanced) {
    constexpr int kRowsShift = 40;
    const int64_t sums = block_sum(tiles + (static_cast<int64_t>(tiles > 0) << kRowsShift), warp_sums);
    const int64_t total_tiles = sums & ((int64_t{1} << kRowsShift) - 1);
    tiles_per_task = balanced_tiles_per_task(policy, total_tiles, sums >> kRowsShift, hkv);
  }
  if (tid < batch) splits = static_cast<int>(row_split_count(policy, tiles, tiles_per_task));
  const int per_split = splits > 0 ? (tiles + splits - 1) / splits : 0;
  const int tail = tiles - (splits - 1) * per_split;  // 1..per_split; 0 for a row without tiles
  const int tail_differs = tail != per_split;
  tiles_of[tid] = tiles;
  splits_of[tid] = splits;
  group_len[tid] = per_split;
  group_splits[tid] = splits - tail_differs;
  group_len[kPlanThreads + tid] = tail_differs ? tail : 0;
  group_splits[kPlanThreads + tid] = tail_differs;
  group_at[2 * tid] = group_at[2 * tid + 1] = -1;
  __syncthreads();

  // The host plan's order (pkv.pipeline.schedule.plan_workqueue, csrc/step_plan.cpp): groups by
  // tiles a task, longest first, ties by row (a row's two groups never tie), so the block scheduler
  // starts the long tasks first and the shorter tails of long rows after their full-length splits.
  // A group's length is 0 only where it has no task, and both of a row's groups are ranked in one
  // pass over the rows: two shared-memory reads a row.
  const int full_len = group_len[tid], tail_len = group_len[kPlanThreads + tid];
  if (tid < batch && full_len > 0) {
    int full_rank = 0, tail_rank = 0;
    for (int j = 0; j < batch; ++j) {
      const int a = group_len[j], b = group_len[kPlanThreads + j];
      const int earlier = j < tid;
      full_rank += (a > full_len) + (b > full_len) + earlier * ((a == full_len) + (b == full_len));
      tail_rank += (a > tail_len) + (b > tail_len) + earlier * ((a == tail_len) + (b == tail_len));
    }
    group_at[full_rank] = tid;
    if (tail_len > 0) group_at[tail_rank] = kPlanThreads + tid;
  }
  int slots_total;
  const int slot_begin = block_exclusive_scan(splits, warp_totals, &slots_total);
  if (tid < batch) {
    for (int h = 0; h < hkv; ++h) split_offsets[tid * hkv + h] = slot_begin * hkv + h * splits;
  }
  if (tid == 0) split_offsets[batch * hkv] = slots_total * hkv;

  // group_at is complete after the scan's barriers. Each thread holds sorted positions 2 tid and
  // 2 tid + 1; positions past the last group hold no tasks, so their first task is the count.
  const int first = group_at[2 * tid], second = group_at[2 * tid + 1];
  const int first_tasks = first < 0 ? 0 : hkv * group_splits[first];
  const int second_tasks = second < 0 ? 0 : hkv * group_splits[second];
  int live;
  const int begin_of_pair = block_exclusive_scan(first_tasks + second_tasks, warp_totals, &live);
  task_begin[2 * tid] = begin_of_pair;
  task_begin[2 * tid + 1] = begin_of_pair + first_tasks;
  int widest = splits;
  for (int offset = 16; offset > 0; offset >>= 1) widest = max(widest, __shfl_xor_sync(0xffffffffu, widest, offset));
  if ((tid & 31) == 0) warp_totals[tid >> 5] = widest;
  __syncthreads();
  if (tid == 0) {
    int most = 0;
    for (int w = 0; w < kWarps; ++w) most = max(most, warp_totals[w]);
    counts[0] = live;
    counts[1] = most;
  }

  // Every thread writes tasks; task t belongs to the last sorted position whose first task is <= t
  // (positions past the last group start at the count, after every task).
  for (int t = tid; t < live; t += kPlanThreads) {
    int lo = 0, hi = 2 * batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (task_begin[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int g = group_at[lo], row = g % kPlanThreads, local = t - task_begin[lo];
    const int in_group = group_splits[g], row_splits = splits_of[row];
    const int split = (g < kPlanThreads ? 0 : row_splits - 1) + local % in_group;
    const int begin = split * ((tiles_of[row] + row_splits - 1) / row_splits);
    int32_t* task = tasks + static_cast<int64_t>(t) * 5;
    task[0] = row;
    task[1] = local / in_group;
    task[2] = split;
    task[3] = begin;
    task[4] = begin + group_len[g];
  }
}

}  // namespace

cudaError_t launch_plan_workqueue_on_device(const int32_t* seq_lens, const int32_t* page_indptr, int batch,
                                            int num_kv_heads, const SplitPolicyArgs& policy, int max_tokens,
                                            int page_size, int32_t* tasks, int32_t* split_offsets, int32_t* counts,
                                            cudaStream_t stream) {
  // page_size is read with page lists only (a block table's rows are clamped by max_tokens).
  if (batch < 1 || batch > kMaxDevicePlanRows || num_kv_heads < 1 || policy.num_splits < 1 ||
      policy.num_splits > kMaxMergeSlots || max_tokens < 1 || (page_indptr != nullptr && page_size < 1) ||
      (policy.balanced && (policy.max_splits < 1 || policy.max_splits > kMaxMergeSlots ||
                           policy.target_ctas < 0 || policy.min_tiles_per_split < 1)))
    return cudaErrorInvalidValue;
  plan_workqueue_kernel<<<1, kPlanThreads, 0, stream>>>(seq_lens, page_indptr, batch, num_kv_heads, policy, max_tokens,
                                                        page_size, tasks, split_offsets, counts);
  return cudaGetLastError();
}

}  // namespace pkv
