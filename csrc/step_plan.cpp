// Host-side decode-step planning; see step_plan.h. Formulas and orders follow pkv/pipeline/schedule.py.
#include "step_plan.h"

#include <algorithm>
#include <numeric>

#include "split_rule.h"

namespace pkv {

int64_t workqueue_tiles_per_task(const int32_t* seq_lens, int64_t batch, int64_t num_kv_heads,
                                 const SplitPolicyArgs& policy) {
  int64_t total_tiles = 0, rows_with_tiles = 0;
  if (policy.balanced) {
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t n = row_tiles(seq_lens[i]);
      total_tiles += n;
      rows_with_tiles += n > 0;
    }
  }
  return balanced_tiles_per_task(policy, total_tiles, rows_with_tiles, num_kv_heads);
}

int64_t workqueue_row_splits(const int32_t* seq_lens, int64_t batch, int64_t num_kv_heads,
                             const SplitPolicyArgs& policy, int32_t* row_splits) {
  const int64_t tiles_per_task = workqueue_tiles_per_task(seq_lens, batch, num_kv_heads, policy);
  int64_t widest = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t k = row_split_count(policy, row_tiles(seq_lens[i]), tiles_per_task);
    row_splits[i] = static_cast<int32_t>(k);
    widest = std::max(widest, k);
  }
  return widest;
}

int64_t workqueue_num_tasks(const int32_t* row_splits, int64_t batch, int64_t num_kv_heads) {
  int64_t splits = 0;
  for (int64_t i = 0; i < batch; ++i) splits += row_splits[i];
  return splits * num_kv_heads;
}

void fill_workqueue(const int32_t* seq_lens, const int32_t* row_splits, int64_t batch, int64_t num_kv_heads,
                    int32_t* tasks, int32_t* split_offsets) {
  // Every split of a row holds tiles_per_split tiles except possibly the last (the tail), so a
  // row is one group of full-length splits plus, when shorter, a group of its tail alone.
  // Sorting those <= 2B groups (length descending, then row) orders the tasks longest first
  // with ties in slot order, without sorting the tasks themselves.
  struct Group {
    int64_t row, length, first, count;
  };
  std::vector<Group> groups;
  groups.reserve(2 * batch);
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t n = row_tiles(seq_lens[row]);
    const int64_t k = row_splits[row];
    if (k == 0) continue;
    const int64_t tiles_per_split = ceil_div(n, k);
    const int64_t tail = n - (k - 1) * tiles_per_split;
    const bool tail_differs = tail != tiles_per_split;
    groups.push_back({row, tiles_per_split, 0, k - (tail_differs ? 1 : 0)});
    if (tail_differs) groups.push_back({row, tail, k - 1, 1});
  }
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.length != b.length ? a.length > b.length : a.row < b.row;
  });
  int32_t* task = tasks;
  for (const Group& group : groups) {
    if (group.count == 0) continue;
    const int64_t tiles_per_split = ceil_div(row_tiles(seq_lens[group.row]), row_splits[group.row]);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      for (int64_t split = group.first; split < group.first + group.count; ++split, task += 5) {
        const int64_t begin = split * tiles_per_split;
        task[0] = static_cast<int32_t>(group.row);
        task[1] = static_cast<int32_t>(kvh);
        task[2] = static_cast<int32_t>(split);
        task[3] = static_cast<int32_t>(begin);
        task[4] = static_cast<int32_t>(begin + group.length);
      }
    }
  }
  split_offsets[0] = 0;
  for (int64_t row = 0, pair = 0; row < batch; ++row) {
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh, ++pair) {
      split_offsets[pair + 1] = split_offsets[pair] + row_splits[row];
    }
  }
}

std::vector<BucketLaunchShape> plan_bucket_launches(const int32_t* seq_lens, int64_t batch, int64_t num_splits,
                                                    bool exact, int32_t* row_indices) {
  std::vector<BucketLaunchShape> launches;
  if (batch == 0) return launches;
  std::iota(row_indices, row_indices + batch, 0);
  if (!exact) {
    const int32_t route_len = *std::max_element(seq_lens, seq_lens + batch);
    launches.push_back({batch, std::min(num_splits, row_tiles(route_len)), route_len});
    return launches;
  }
  // Longest first; stable, so the rows of one length stay in ascending order.
  std::stable_sort(row_indices, row_indices + batch,
                   [seq_lens](int32_t a, int32_t b) { return seq_lens[a] > seq_lens[b]; });
  for (int64_t start = 0; start < batch;) {
    const int32_t route_len = seq_lens[row_indices[start]];
    int64_t end = start + 1;
    while (end < batch && seq_lens[row_indices[end]] == route_len) ++end;
    launches.push_back({end - start, std::min(num_splits, row_tiles(route_len)), route_len});
    start = end;
  }
  return launches;
}

}  // namespace pkv
