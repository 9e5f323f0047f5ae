// Host-side decode-step planning in C++: the same plans as pkv/pipeline/schedule.py (which stays the
// specification; tests compare the two element by element), produced in a few microseconds
// instead of the tens that numpy's per-call overhead costs on a fast GPU's decode step.
//
// Every plan is written into one packed int32 buffer, so a step's metadata reaches the device in
// a single copy:
//   [block_table B*W][seq_lens B][route data], or with page lists
//   [page_indptr B+1][page_indices N][seq_lens B][route data]
// (page lists hold each row's own pages, where a block table pads every row to the longest).
// workqueue route data: [tasks T*5][split_offsets B*Hkv+1]
// bucket route data:    [row_indices B] (rows of launch 0, then launch 1, ...)
// Framework-free: plain pointers and sizes; the torch binding (host_ops.cpp) owns allocation.
#pragma once
#include <cstdint>
#include <vector>

#include "split_rule.h"

namespace pkv {

// The int list that travels with a packed plan (host_ops.cpp writes it, pkv_ops.cpp reads it):
//   [route, batch, table_width, num_slots, page_entries, then
//    workqueue: num_tasks, max_splits | buckets: num_launches, (num_rows, num_splits) per launch]
// A block table has table_width W >= 1 and page_entries 0; page lists table_width 0 and N >= 1.
enum PlanRoute : int64_t { kRouteWorkqueue = 0, kRouteBuckets = 1 };
enum PlanLayoutField : int {
  kLayoutRoute = 0,
  kLayoutBatch,
  kLayoutTableWidth,
  kLayoutNumSlots,
  kLayoutPageEntries,
  kLayoutRouteFields
};

// How a step's launches with more than one split merge them; the route policy picks it per step
// and passes it to run_plan as an int (pkv/ops.py mirrors the codes as MERGE_*). kLaunch: a
// merge_states launch after the decode; kFused: the last split of each (row, KV head) merges it,
// counted by pair_counters; kCluster: the bucket route's splits merge through a thread-block
// cluster (at most kMaxClusterSplits). A launch with one split writes `out` whatever the kind.
enum class MergeKind : int { kLaunch = 0, kFused = 1, kCluster = 2 };

// The balanced rule's tiles per task of this batch (split_rule.h, balanced_tiles_per_task, over its
// total tiles and the rows that have any); 0 under the fixed rule.
int64_t workqueue_tiles_per_task(const int32_t* seq_lens, int64_t batch, int64_t num_kv_heads,
                                 const SplitPolicyArgs& policy);

// Non-empty splits of each row (the same for every KV head), written to row_splits[0..batch).
// Returns the largest of them (0 for an empty batch).
int64_t workqueue_row_splits(const int32_t* seq_lens, int64_t batch, int64_t num_kv_heads,
                             const SplitPolicyArgs& policy, int32_t* row_splits);

// Task count of a workqueue whose rows have row_splits splits each: sum(row_splits) * Hkv.
int64_t workqueue_num_tasks(const int32_t* row_splits, int64_t batch, int64_t num_kv_heads);

// Tasks (row, kvh, split, tile_begin, tile_end), longest first and ties by slot, exactly as
// pkv.pipeline.schedule.plan_workqueue orders them, and split_offsets [B * Hkv + 1].
void fill_workqueue(const int32_t* seq_lens, const int32_t* row_splits, int64_t batch, int64_t num_kv_heads,
                    int32_t* tasks, int32_t* split_offsets);

// One bucket launch: `num_rows` consecutive entries of the row-index array, `num_splits` splits.
struct BucketLaunchShape {
  int64_t num_rows;
  int64_t num_splits;
  int64_t route_len;
};

// pkv.pipeline.schedule.plan_buckets: exact mode makes one launch per distinct length, longest first
// (rows of one launch in ascending order); masked mode one launch over every row at the longest
// length. Writes the rows to row_indices[0..batch) and returns the launches.
std::vector<BucketLaunchShape> plan_bucket_launches(const int32_t* seq_lens, int64_t batch, int64_t num_splits,
                                                    bool exact, int32_t* row_indices);

}  // namespace pkv
