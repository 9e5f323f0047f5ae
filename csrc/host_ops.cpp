// Thin torch binding over step_plan.h: the step planners as CPU ops (torch.ops.pkv.plan_*).
// Built into the CUDA extension and, on machines without CUDA, into a CPU-only library, so the
// planner is tested against pkv/pipeline/schedule.py everywhere.
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "host_ops.h"
#include "route_policy.h"
#include "step_plan.h"

namespace {

using at::Tensor;

// A step's lengths as the planner and the route policy read them: int32 CPU [B >= 1], each >= 0.
void check_seq_lens(const Tensor& seq_lens) {
  TORCH_CHECK(seq_lens.device().is_cpu() && seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "pkv: seq_lens must be a contiguous int32 CPU tensor [B], got ", seq_lens.scalar_type(), " ",
              seq_lens.sizes(), " on ", seq_lens.device());
  TORCH_CHECK(seq_lens.size(0) >= 1, "pkv: seq_lens is empty; a decode step needs a row");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 0, "pkv: seq_lens[", i, "] must be >= 0, got ", lens[i]);
  }
}

// Step metadata as the planner reads it: int32 CPU seq_lens [B] and the page table, a block table
// [B, W] or, with page_indptr [B + 1], the concatenated page lists [N >= 1] in `pages`.
void check_step(const Tensor& seq_lens, const Tensor& pages, const std::optional<Tensor>& page_indptr,
                int64_t num_kv_heads) {
  check_seq_lens(seq_lens);
  const int64_t batch = seq_lens.size(0);
  if (page_indptr.has_value()) {
    const Tensor& indptr = *page_indptr;
    TORCH_CHECK(indptr.device().is_cpu() && indptr.scalar_type() == at::kInt && indptr.dim() == 1 &&
                    indptr.is_contiguous() && indptr.size(0) == batch + 1,
                "pkv: page_indptr must be a contiguous int32 CPU tensor [B + 1 = ", batch + 1, "], got ",
                indptr.scalar_type(), " ", indptr.sizes());
    TORCH_CHECK(pages.device().is_cpu() && pages.scalar_type() == at::kInt && pages.dim() == 1 &&
                    pages.is_contiguous() && pages.size(0) >= 1,
                "pkv: with page_indptr, the page table must be the contiguous int32 CPU page lists [N >= 1], got ",
                pages.scalar_type(), " ", pages.sizes());
    const int32_t* ptr = indptr.data_ptr<int32_t>();
    TORCH_CHECK(ptr[0] == 0 && ptr[batch] == pages.size(0), "pkv: page_indptr must run from 0 to the ",
                pages.size(0), " entries of the page lists, got ", ptr[0], "..", ptr[batch]);
    for (int64_t i = 0; i < batch; ++i) {
      TORCH_CHECK(ptr[i + 1] >= ptr[i], "pkv: page_indptr must not fall, row ", i, " runs from ", ptr[i], " to ",
                  ptr[i + 1]);
    }
  } else {
    TORCH_CHECK(pages.device().is_cpu() && pages.scalar_type() == at::kInt && pages.dim() == 2 &&
                    pages.is_contiguous() && pages.size(0) == batch && pages.size(1) >= 1,
                "pkv: block_table must be a contiguous int32 CPU tensor [B=", batch, ", max_pages >= 1], got ",
                pages.scalar_type(), " ", pages.sizes());
  }
  TORCH_CHECK(num_kv_heads >= 1, "pkv: num_kv_heads must be >= 1, got ", num_kv_heads);
}

// The ints the page table takes in a packed plan.
int64_t page_table_ints(const Tensor& pages, const std::optional<Tensor>& page_indptr) {
  return pages.numel() + (page_indptr.has_value() ? page_indptr->numel() : 0);
}

// [block_table] or [page_indptr][page lists], then [seq_lens], then the route's ints, in one int32
// buffer; returns the route part's start.
int32_t* pack_step(Tensor& packed, const Tensor& seq_lens, const Tensor& pages,
                   const std::optional<Tensor>& page_indptr) {
  int32_t* cursor = packed.data_ptr<int32_t>();
  if (page_indptr.has_value()) cursor = std::copy_n(page_indptr->data_ptr<int32_t>(), page_indptr->numel(), cursor);
  cursor = std::copy_n(pages.data_ptr<int32_t>(), pages.numel(), cursor);
  return std::copy_n(seq_lens.data_ptr<int32_t>(), seq_lens.numel(), cursor);
}

// The packed plan's buffer. Pinned (CUDA builds of torch only), its upload is a true async copy,
// and torch's host allocator keeps the block until that copy has run; pageable, the copy stages it
// before returning.
Tensor packed_buffer(int64_t ints, bool pinned) {
  return at::empty({ints}, at::TensorOptions().dtype(at::kInt).pinned_memory(pinned));
}

// The layout's first fields (step_plan.h): the page table's form and size, then the route's.
std::vector<int64_t> layout_head(int64_t route, int64_t batch, const Tensor& pages,
                                 const std::optional<Tensor>& page_indptr) {
  const bool lists = page_indptr.has_value();
  return {route, batch, lists ? 0 : pages.size(1), 0, lists ? pages.size(0) : 0};
}

// The workqueue plan of a checked step under `policy`, packed.
std::tuple<Tensor, std::vector<int64_t>> pack_workqueue(const Tensor& seq_lens, const Tensor& block_table,
                                                        int64_t num_kv_heads, const pkv::SplitPolicyArgs& policy,
                                                        const std::optional<Tensor>& page_indptr, bool pinned) {
  const int64_t batch = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int32_t> row_splits(batch);
  const int64_t widest = pkv::workqueue_row_splits(lens, batch, num_kv_heads, policy, row_splits.data());
  const int64_t num_tasks = pkv::workqueue_num_tasks(row_splits.data(), batch, num_kv_heads);
  const int64_t num_pairs = batch * num_kv_heads;
  Tensor packed =
      packed_buffer(page_table_ints(block_table, page_indptr) + batch + 5 * num_tasks + num_pairs + 1, pinned);
  int32_t* tasks = pack_step(packed, seq_lens, block_table, page_indptr);
  int32_t* split_offsets = tasks + 5 * num_tasks;
  pkv::fill_workqueue(lens, row_splits.data(), batch, num_kv_heads, tasks, split_offsets);
  std::vector<int64_t> layout = layout_head(pkv::kRouteWorkqueue, batch, block_table, page_indptr);
  layout[pkv::kLayoutNumSlots] = split_offsets[num_pairs];
  layout.push_back(num_tasks);
  layout.push_back(widest);
  return {packed, layout};
}

void check_bucket_lengths(const Tensor& seq_lens) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 1, "pkv: bucket plans need seq_lens >= 1, seq_lens[", i, "] is ", lens[i]);
  }
}

// The bucket plan of a checked step whose lengths are all >= 1, packed.
std::tuple<Tensor, std::vector<int64_t>> pack_buckets(const Tensor& seq_lens, const Tensor& block_table,
                                                      int64_t num_kv_heads, int64_t num_splits, bool exact,
                                                      const std::optional<Tensor>& page_indptr, bool pinned) {
  const int64_t batch = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  Tensor packed = packed_buffer(page_table_ints(block_table, page_indptr) + 2 * batch, pinned);
  int32_t* rows = pack_step(packed, seq_lens, block_table, page_indptr);
  const auto launches = pkv::plan_bucket_launches(lens, batch, num_splits, exact, rows);
  std::vector<int64_t> layout = layout_head(pkv::kRouteBuckets, batch, block_table, page_indptr);
  layout.push_back(static_cast<int64_t>(launches.size()));
  int64_t slots = 0;
  for (const auto& launch : launches) {
    layout.push_back(launch.num_rows);
    layout.push_back(launch.num_splits);
    slots += launch.num_rows * num_kv_heads * launch.num_splits;
  }
  layout[pkv::kLayoutNumSlots] = slots;
  return {packed, layout};
}

std::tuple<Tensor, std::vector<int64_t>> plan_workqueue(const Tensor& seq_lens, const Tensor& block_table,
                                                        int64_t num_kv_heads, bool balanced, int64_t num_splits,
                                                        int64_t max_splits, int64_t target_ctas,
                                                        int64_t min_tiles_per_split,
                                                        const std::optional<Tensor>& page_indptr, bool pinned) {
  check_step(seq_lens, block_table, page_indptr, num_kv_heads);
  TORCH_CHECK(num_splits >= 1 && max_splits >= 1 && target_ctas >= 0 && min_tiles_per_split >= 1,
              "pkv: split policy needs num_splits >= 1, max_splits >= 1, target_ctas >= 0 and "
              "min_tiles_per_split >= 1, got ", num_splits, ", ", max_splits, ", ", target_ctas, ", ",
              min_tiles_per_split);
  const pkv::SplitPolicyArgs policy{balanced, num_splits, max_splits, target_ctas, min_tiles_per_split};
  return pack_workqueue(seq_lens, block_table, num_kv_heads, policy, page_indptr, pinned);
}

std::tuple<Tensor, std::vector<int64_t>> plan_buckets(const Tensor& seq_lens, const Tensor& block_table,
                                                      int64_t num_kv_heads, int64_t num_splits, bool exact,
                                                      const std::optional<Tensor>& page_indptr, bool pinned) {
  check_step(seq_lens, block_table, page_indptr, num_kv_heads);
  TORCH_CHECK(num_splits >= 1, "pkv: num_splits must be >= 1, got ", num_splits);
  check_bucket_lengths(seq_lens);
  return pack_buckets(seq_lens, block_table, num_kv_heads, num_splits, exact, page_indptr, pinned);
}

// The route policy of pkv/policy/native.py's flat float64 array (route_policy.h).
pkv::RoutePolicyParams read_policy(const Tensor& policy) {
  TORCH_CHECK(policy.device().is_cpu() && policy.scalar_type() == at::kDouble && policy.dim() == 1 &&
                  policy.is_contiguous(),
              "pkv: the route policy must be a contiguous float64 CPU tensor [", pkv::kPolicyValues, "], got ",
              policy.scalar_type(), " ", policy.sizes(), " on ", policy.device());
  pkv::RoutePolicyParams params{};
  const char* error = nullptr;
  int64_t index = 0;
  const double* values = policy.data_ptr<double>();
  TORCH_CHECK(pkv::parse_route_policy(values, policy.numel(), &params, &error, &index), "pkv: route policy: ", error,
              index < 0 ? std::string(" (") + std::to_string(policy.numel()) + " values, expected " +
                              std::to_string(pkv::kPolicyValues) + ")"
                        : std::string(" (value [") + std::to_string(index) + "] = " + std::to_string(values[index]) +
                              ")");
  return params;
}

// [basis, route, candidate route, num_splits, balanced, target_ctas, max_splits, min_tiles_per_split] and
// [flashinfer_us, candidate_us, speedup, margin]: what pkv/policy/native.py reads back.
std::tuple<std::vector<int64_t>, std::vector<double>> choice_lists(const pkv::RouteChoice& c) {
  const pkv::SplitPolicyArgs& s = c.candidate.split;
  return {{static_cast<int64_t>(c.basis), c.route, c.candidate.route, s.num_splits, s.balanced, s.target_ctas,
           s.max_splits, s.min_tiles_per_split},
          {c.flashinfer_us, c.candidate_us, c.speedup, c.margin}};
}

pkv::RouteChoice checked_choice(const Tensor& seq_lens, const pkv::RoutePolicyParams& params) {
  const pkv::RouteChoice choice = pkv::choose_route(seq_lens.data_ptr<int32_t>(), seq_lens.size(0), params);
  TORCH_CHECK(choice.basis != pkv::RouteBasis::kNoTokens,
              "pkv: the route policy cannot estimate a step whose rows have no tokens (seq_lens all 0)");
  return choice;
}

// RoutePolicy.choose in C++ (route_policy.h): the decision and the estimates behind it.
std::tuple<std::vector<int64_t>, std::vector<double>> choose_route(const Tensor& seq_lens, const Tensor& policy) {
  const pkv::RoutePolicyParams params = read_policy(policy);
  check_seq_lens(seq_lens);
  return choice_lists(checked_choice(seq_lens, params));
}

}  // namespace

// An eager step's host work in one call: the route policy decides, and where it picks a PersistentKV
// route the step is planned and packed (into pinned memory with `pinned`) and, with `upload_to`,
// copied to that device asynchronously. A step left to FlashInfer returns no plan.
pkv_host::AdaptivePlan pkv_host::adaptive_plan(const Tensor& seq_lens, const Tensor& pages,
                                               const std::optional<Tensor>& page_indptr, const Tensor& policy,
                                               bool pinned, std::optional<at::Device> upload_to) {
  const pkv::RoutePolicyParams params = read_policy(policy);
  check_step(seq_lens, pages, page_indptr, params.num_kv_heads);
  const pkv::RouteChoice choice = checked_choice(seq_lens, params);
  auto [ints, reals] = choice_lists(choice);
  if (choice.route == pkv::kRouteFlashInfer) return {ints, reals, std::nullopt, std::nullopt, {}};
  const pkv::SplitPolicyArgs& split = choice.candidate.split;
  std::tuple<Tensor, std::vector<int64_t>> planned;
  if (choice.route == pkv::kRouteWorkqueue) {
    planned = pack_workqueue(seq_lens, pages, params.num_kv_heads, split, page_indptr, pinned);
  } else {
    check_bucket_lengths(seq_lens);
    planned = pack_buckets(seq_lens, pages, params.num_kv_heads, split.num_splits, params.exact_buckets, page_indptr,
                           pinned);
  }
  auto& [packed, layout] = planned;
  Tensor meta = upload_to.has_value() ? packed.to(*upload_to, /*non_blocking=*/true) : packed;
  return {ints, reals, packed, meta, layout};
}

TORCH_LIBRARY_FRAGMENT(pkv, m) {
  m.def(
      "plan_workqueue(Tensor seq_lens, Tensor block_table, int num_kv_heads, bool balanced, int num_splits, "
      "int max_splits, int target_ctas, int min_tiles_per_split, Tensor? page_indptr=None, bool pinned=False) "
      "-> (Tensor, int[])");
  m.def(
      "plan_buckets(Tensor seq_lens, Tensor block_table, int num_kv_heads, int num_splits, bool exact, "
      "Tensor? page_indptr=None, bool pinned=False) -> (Tensor, int[])");
  m.def("choose_route(Tensor seq_lens, Tensor policy) -> (int[], float[])");
  m.def(
      "adaptive_plan(Tensor seq_lens, Tensor pages, Tensor? page_indptr, Tensor policy, bool pinned=False, "
      "Device? upload_to=None) -> (int[], float[], Tensor?, Tensor?, int[])");
}

TORCH_LIBRARY_IMPL(pkv, CPU, m) {
  m.impl("plan_workqueue", &plan_workqueue);
  m.impl("plan_buckets", &plan_buckets);
  m.impl("choose_route", &choose_route);
  m.impl("adaptive_plan", &pkv_host::adaptive_plan);
}
