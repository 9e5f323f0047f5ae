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
  __shared__ int tiles_of[kPlanThreads];
  __shared__ int splits_of[kPlanThreads];
  __shared__ int row_at[kPlanThreads];      // sorted position -> row, longest first
  __shared__ int task_begin[kPlanThreads];  // sorted position -> its first task
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
  tiles_of[tid] = tiles;
  splits_of[tid] = splits;
  __syncthreads();

  // Rank by length, longest first (ties by row), so the block scheduler starts the long tasks first.
  if (tid < batch) {
    int rank = 0;
    for (int j = 0; j < batch; ++j) {
      const int other = tiles_of[j];
      rank += other > tiles || (other == tiles && j < tid);
    }
    row_at[rank] = tid;
  }
  int slots_total;
  const int slot_begin = block_exclusive_scan(splits, warp_totals, &slots_total);
  if (tid < batch) {
    for (int h = 0; h < hkv; ++h) split_offsets[tid * hkv + h] = slot_begin * hkv + h * splits;
  }
  if (tid == 0) split_offsets[batch * hkv] = slots_total * hkv;

  // row_at is complete after the scan's barriers.
  const int my_tasks = tid < batch ? hkv * splits_of[row_at[tid]] : 0;
  int live;
  task_begin[tid] = block_exclusive_scan(my_tasks, warp_totals, &live);
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

  // Every thread writes tasks; task t belongs to the last sorted position whose first task is <= t.
  for (int t = tid; t < live; t += kPlanThreads) {
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (task_begin[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int row = row_at[lo], local = t - task_begin[lo];
    const int row_splits = splits_of[row], row_tiles = tiles_of[row];
    const int kvh = local / row_splits, split = local % row_splits;
    const int per_split = (row_tiles + row_splits - 1) / row_splits;
    const int begin = split * per_split;
    int32_t* task = tasks + static_cast<int64_t>(t) * 5;
    task[0] = row;
    task[1] = kvh;
    task[2] = split;
    task[3] = begin;
    task[4] = min(begin + per_split, row_tiles);
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
