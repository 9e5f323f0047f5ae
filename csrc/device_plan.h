// The workqueue's plan made on the GPU, from seq_lens already there: no host synchronization, no
// device-to-host copy, no upload. A decode step planned this way has fixed launch shapes for a
// batch size, so a CUDA graph captured once replays it for any lengths. Framework-free.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "split_rule.h"

namespace pkv {

// The most rows one device plan serves: the planner is one CTA with a thread per row.
constexpr int kMaxDevicePlanRows = 1024;

// The workqueue under `policy` (split_rule.h; pkv.pipeline.schedule.SplitPolicy): under the fixed
// rule row i gets min(num_splits, row_tiles_i) splits, under the balanced rule about the same
// number of tiles a task over the batch's total; fewer where the last ones would own no tile, so
// every task is non-empty; split ranges are those of docs/architecture.md. Writes
//   split_offsets[batch * Hkv + 1]  pair p = row * Hkv + kvh owns slots [split_offsets[p], split_offsets[p+1])
//   tasks[live, 5]                  (row, kvh, split, tile_begin, tile_end), the host plan's order:
//                                   longest tasks first (csrc/step_plan.cpp, fill_workqueue)
//   counts[2]                       (live task count, most splits of a row)
// `tasks` must hold max_workqueue_tasks(policy, batch, Hkv) rows (the capacity the decode grid is
// launched with).
// Lengths are clamped to what the page table addresses (split_rule.h, clamped_length): a block
// table's max_tokens (its width times the page size) or, with page lists (page_indptr non-null,
// [batch + 1]), each row's own entries times page_size, as the decode kernels clamp them; the
// balanced rule's total counts the clamped lengths. A row of length 0 gets no task and its output
// is not written.
cudaError_t launch_plan_workqueue_on_device(const int32_t* seq_lens, const int32_t* page_indptr, int batch,
                                            int num_kv_heads, const SplitPolicyArgs& policy, int max_tokens,
                                            int page_size, int32_t* tasks, int32_t* split_offsets, int32_t* counts,
                                            cudaStream_t stream);

}  // namespace pkv
