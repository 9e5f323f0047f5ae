// A row's length as every planner and kernel counts it, and the split rules: one definition
// for the host planner (step_plan.cpp), the device planner (device_plan.cu) and the decode kernels
// (split_decode.cuh). Formulas follow pkv/pipeline/schedule.py. No CUDA headers: the host planner
// is also built without a CUDA toolkit (constexpr functions run on the device under
// --expt-relaxed-constexpr).
#pragma once
#include <cstdint>

#include "decode_constants.h"

namespace pkv {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

// Tiles of KV work of a row of this many tokens.
constexpr int64_t row_tiles(int64_t seq_len) { return ceil_div(seq_len, kTileTokens); }

// Of a row's `requested` splits, those that own a tile: ceil(n / ceil(n / S)), the first ones
// (the trailing splits of a short row are empty). 0 for a row without tiles.
constexpr int64_t nonempty_splits(int64_t n_tiles, int64_t requested) {
  return ceil_div(n_tiles, ceil_div(n_tiles, requested > 1 ? requested : 1));
}

// A workqueue's split rule; mirrors pkv.pipeline.schedule.SplitPolicy.
struct SplitPolicyArgs {
  bool balanced;
  int64_t num_splits;
  int64_t max_splits;
  int64_t target_ctas;  // 0: (rows with tokens) * Hkv * num_splits
  int64_t min_tiles_per_split;
};

// The tiles each task holds under the balanced rule, from the batch's total tiles (of its
// clamped lengths) and its rows that have any; 0 under the fixed rule, which does not read it.
// A row of length 0 (a padding row of a graph's batch bucket) takes no share of the default
// budget, so a bucket's graph plans a batch as the host plans it alone.
constexpr int64_t balanced_tiles_per_task(const SplitPolicyArgs& policy, int64_t total_tiles, int64_t rows_with_tiles,
                                          int64_t num_kv_heads) {
  if (!policy.balanced) return 0;
  const int64_t rows = rows_with_tiles > 1 ? rows_with_tiles : 1;
  const int64_t target = policy.target_ctas ? policy.target_ctas : rows * num_kv_heads * policy.num_splits;
  const int64_t per_task = ceil_div(total_tiles * num_kv_heads, target);
  return per_task > policy.min_tiles_per_split ? per_task : policy.min_tiles_per_split;
}

// A row's non-empty splits under the rule: fixed min(num_splits, n); balanced
// clamp(ceil(n / tiles_per_task), 1, max_splits); then only the splits that own a tile.
constexpr int64_t row_split_count(const SplitPolicyArgs& policy, int64_t n_tiles, int64_t tiles_per_task) {
  int64_t requested = policy.num_splits < n_tiles ? policy.num_splits : n_tiles;
  if (policy.balanced) {
    requested = ceil_div(n_tiles, tiles_per_task);
    requested = requested < 1 ? 1 : (requested > policy.max_splits ? policy.max_splits : requested);
  }
  return nonempty_splits(n_tiles, requested);
}

// The most tasks the rule can give `batch` rows, whatever their lengths: the capacity of a device
// plan's buffers and decode grid. Balanced: each row's splits are at most n_i / tiles_per_task + 1,
// and tiles_per_task >= total * Hkv / target, so the tasks are at most batch * Hkv + target (the
// default target is at most batch * Hkv * num_splits).
constexpr int64_t max_workqueue_tasks(const SplitPolicyArgs& policy, int64_t batch, int64_t num_kv_heads) {
  const int64_t pairs = batch * num_kv_heads;
  if (!policy.balanced) return pairs * policy.num_splits;
  const int64_t target = policy.target_ctas ? policy.target_ctas : pairs * policy.num_splits;
  const int64_t widest = pairs * policy.max_splits;
  return pairs + target < widest ? pairs + target : widest;
}

// A row's seq_len clamped to the tokens its page-table entries address (`limit`), so a length
// past its pages never reads or attends past them. Valid input is unchanged.
constexpr int clamped_length(int64_t seq_len, int64_t limit) {
  return static_cast<int>(seq_len <= 0 || limit <= 0 ? 0 : (seq_len < limit ? seq_len : limit));
}

}  // namespace pkv
