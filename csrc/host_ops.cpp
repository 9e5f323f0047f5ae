// Thin torch binding over step_plan.h: the step planners as CPU ops (torch.ops.pkv.plan_*).
// Built into the CUDA extension and, on machines without CUDA, into a CPU-only library, so the
// planner is tested against pkv/pipeline/schedule.py everywhere.
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "step_plan.h"

namespace {

using at::Tensor;

// Step metadata as the planner reads it: int32 CPU seq_lens [B] and block_table [B, W].
void check_step(const Tensor& seq_lens, const Tensor& block_table, int64_t num_kv_heads) {
  TORCH_CHECK(seq_lens.device().is_cpu() && seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "pkv: seq_lens must be a contiguous int32 CPU tensor [B], got ", seq_lens.scalar_type(), " ",
              seq_lens.sizes(), " on ", seq_lens.device());
  TORCH_CHECK(seq_lens.size(0) >= 1, "pkv: seq_lens is empty; a decode step needs a row");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.is_contiguous() && block_table.size(0) == seq_lens.size(0) && block_table.size(1) >= 1,
              "pkv: block_table must be a contiguous int32 CPU tensor [B=", seq_lens.size(0),
              ", max_pages >= 1], got ", block_table.scalar_type(), " ", block_table.sizes());
  TORCH_CHECK(num_kv_heads >= 1, "pkv: num_kv_heads must be >= 1, got ", num_kv_heads);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 0, "pkv: seq_lens[", i, "] must be >= 0, got ", lens[i]);
  }
}

// [block_table][seq_lens][route_ints] in one int32 buffer; returns the route part's start.
int32_t* pack_step(Tensor& packed, const Tensor& seq_lens, const Tensor& block_table) {
  int32_t* base = packed.data_ptr<int32_t>();
  std::copy_n(block_table.data_ptr<int32_t>(), block_table.numel(), base);
  std::copy_n(seq_lens.data_ptr<int32_t>(), seq_lens.numel(), base + block_table.numel());
  return base + block_table.numel() + seq_lens.numel();
}

std::tuple<Tensor, std::vector<int64_t>> plan_workqueue(const Tensor& seq_lens, const Tensor& block_table,
                                                        int64_t num_kv_heads, bool balanced, int64_t num_splits,
                                                        int64_t max_splits, int64_t target_ctas,
                                                        int64_t min_tiles_per_split) {
  check_step(seq_lens, block_table, num_kv_heads);
  TORCH_CHECK(num_splits >= 1 && max_splits >= 1 && target_ctas >= 0 && min_tiles_per_split >= 1,
              "pkv: split policy needs num_splits >= 1, max_splits >= 1, target_ctas >= 0 and "
              "min_tiles_per_split >= 1, got ", num_splits, ", ", max_splits, ", ", target_ctas, ", ",
              min_tiles_per_split);
  const int64_t batch = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int32_t> row_splits(batch);
  const pkv::SplitPolicyArgs policy{balanced, num_splits, max_splits, target_ctas, min_tiles_per_split};
  const int64_t widest = pkv::workqueue_row_splits(lens, batch, num_kv_heads, policy, row_splits.data());
  const int64_t num_tasks = pkv::workqueue_num_tasks(row_splits.data(), batch, num_kv_heads);
  const int64_t num_pairs = batch * num_kv_heads;
  Tensor packed = at::empty({block_table.numel() + batch + 5 * num_tasks + num_pairs + 1}, seq_lens.options());
  int32_t* tasks = pack_step(packed, seq_lens, block_table);
  int32_t* split_offsets = tasks + 5 * num_tasks;
  pkv::fill_workqueue(lens, row_splits.data(), batch, num_kv_heads, tasks, split_offsets);
  std::vector<int64_t> layout{pkv::kRouteWorkqueue, batch, block_table.size(1), split_offsets[num_pairs],
                              num_tasks, widest};
  return {packed, layout};
}

std::tuple<Tensor, std::vector<int64_t>> plan_buckets(const Tensor& seq_lens, const Tensor& block_table,
                                                      int64_t num_kv_heads, int64_t num_splits, bool exact) {
  check_step(seq_lens, block_table, num_kv_heads);
  TORCH_CHECK(num_splits >= 1, "pkv: num_splits must be >= 1, got ", num_splits);
  const int64_t batch = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < batch; ++i) {
    TORCH_CHECK(lens[i] >= 1, "pkv: bucket plans need seq_lens >= 1, seq_lens[", i, "] is ", lens[i]);
  }
  Tensor packed = at::empty({block_table.numel() + 2 * batch}, seq_lens.options());
  int32_t* rows = pack_step(packed, seq_lens, block_table);
  const auto launches = pkv::plan_bucket_launches(lens, batch, num_splits, exact, rows);
  std::vector<int64_t> layout{pkv::kRouteBuckets, batch, block_table.size(1), 0,
                              static_cast<int64_t>(launches.size())};
  int64_t slots = 0;
  for (const auto& launch : launches) {
    layout.push_back(launch.num_rows);
    layout.push_back(launch.num_splits);
    slots += launch.num_rows * num_kv_heads * launch.num_splits;
  }
  layout[pkv::kLayoutNumSlots] = slots;
  return {packed, layout};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pkv, m) {
  m.def(
      "plan_workqueue(Tensor seq_lens, Tensor block_table, int num_kv_heads, bool balanced, int num_splits, "
      "int max_splits, int target_ctas, int min_tiles_per_split) -> (Tensor, int[])");
  m.def(
      "plan_buckets(Tensor seq_lens, Tensor block_table, int num_kv_heads, int num_splits, bool exact) "
      "-> (Tensor, int[])");
}

TORCH_LIBRARY_IMPL(pkv, CPU, m) {
  m.impl("plan_workqueue", &plan_workqueue);
  m.impl("plan_buckets", &plan_buckets);
}
