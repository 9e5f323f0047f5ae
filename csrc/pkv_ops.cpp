// Thin torch binding over pkv_launch.h: validates tensors, then launches on the current stream.
// Registered as TORCH_LIBRARY(pkv) ops with mutation annotations; fake kernels live in pkv/ops.py.
#include <atomic>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include "device_plan.h"
#include "host_ops.h"
#include "pkv_launch.h"
#include "step_executor.h"
#include "step_plan.h"

namespace {

using at::Tensor;

// Whether merges drop the partial states they read (DecodeArgs::discard_merged_states): a process
// setting that every launch built after it is set carries, graph captures included.
std::atomic<bool> g_discard_merged_states{false};

bool set_discard_merged_states(bool enabled) { return g_discard_merged_states.exchange(enabled); }

void check_cuda_tensor(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "pkv: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "pkv: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_aligned(const Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "pkv: ", name,
              " must be 16-byte aligned for vector loads");
}

// q, the pages, out and the scalars: what every decode launch shares, checked once.
pkv::DecodeArgs make_core_args(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, double sm_scale,
                               const Tensor& out, int64_t stages) {
  TORCH_CHECK(q.dim() == 3, "pkv: q must be [B, Hq, d], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "pkv: q must be float16 or bfloat16, got ", q.scalar_type());
  const auto dtype = q.scalar_type();
  check_cuda_tensor(q, "q", dtype);
  TORCH_CHECK(q.size(2) == pkv::kHeadDim, "pkv: head_dim must be ", pkv::kHeadDim, ", got ", q.size(2));
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) % 8 == 0 && q.stride(0) % 8 == 0,
              "pkv: q rows must be contiguous with strides divisible by 8, got strides ", q.strides());
  check_aligned(q, "q");
  TORCH_CHECK(k_pages.dim() == 4, "pkv: k_pages must be [num_pages, Hkv, P, d], got ", k_pages.sizes());
  check_cuda_tensor(k_pages, "k_pages", dtype);
  check_cuda_tensor(v_pages, "v_pages", dtype);
  TORCH_CHECK(v_pages.sizes() == k_pages.sizes() && v_pages.strides() == k_pages.strides(),
              "pkv: v_pages must match k_pages in shape and strides, got ", v_pages.sizes(), " vs ", k_pages.sizes());
  // Any layout whose head-dim rows are contiguous and 16-byte aligned: HND [num_pages, Hkv, P, d]
  // as it is, NHD [num_pages, P, Hkv, d] passed as its view .permute(0, 2, 1, 3).
  TORCH_CHECK(k_pages.size(3) == pkv::kHeadDim && k_pages.stride(3) == 1 && k_pages.stride(2) % 8 == 0 &&
                  k_pages.stride(1) % 8 == 0 && k_pages.stride(0) % 8 == 0,
              "pkv: k_pages must be [num_pages, Hkv, P, d] with contiguous d and strides divisible by 8 (HND, or "
              "NHD viewed through permute(0, 2, 1, 3)), got strides ", k_pages.strides());
  check_aligned(k_pages, "k_pages");
  check_aligned(v_pages, "v_pages");
  const int64_t num_kv_heads = k_pages.size(1);
  const int64_t page_size = k_pages.size(2);
  TORCH_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0, "pkv: page_size must be a power of two, got ",
              page_size);
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "pkv: Hq=", q.size(1), " is not a multiple of Hkv=", num_kv_heads);
  const int64_t group_size = q.size(1) / num_kv_heads;
  TORCH_CHECK(group_size >= 1 && group_size <= pkv::kMaxGroupSize, "pkv: group size G = Hq / Hkv must be in 1..",
              pkv::kMaxGroupSize, ", got ", group_size);
  check_cuda_tensor(out, "out", dtype);
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "pkv: out must be [B, Hq, d] like q, got ",
              out.sizes());
  TORCH_CHECK(stages >= 2 && stages <= 4, "pkv: stages must be 2, 3 or 4, got ", stages);

  pkv::DecodeArgs a{};
  a.discard_merged_states = g_discard_merged_states.load();
  a.q = q.data_ptr();
  a.k_pages = k_pages.data_ptr();
  a.v_pages = v_pages.data_ptr();
  a.out = out.data_ptr();
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.group_size = static_cast<int>(group_size);
  a.page_shift = __builtin_ctzll(static_cast<unsigned long long>(page_size));
  a.q_stride_row = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.out_stride_row = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.kv_stride_page = k_pages.stride(0);
  a.kv_stride_head = k_pages.stride(1);
  // A token's offset inside a page is computed in 32 bits (DecodeArgs::kv_stride_token).
  TORCH_CHECK(k_pages.stride(2) >= 0 && (k_pages.size(2) - 1) * k_pages.stride(2) + k_pages.size(3) <= INT32_MAX,
              "pkv: k_pages' token stride ", k_pages.stride(2), " puts a page's last token past 2^31 elements");
  a.kv_stride_token = static_cast<int>(k_pages.stride(2));
  a.sm_scale = static_cast<float>(sm_scale);
  a.dtype = dtype == at::kHalf ? pkv::KvDtype::kFloat16 : pkv::KvDtype::kBFloat16;
  a.stages = static_cast<int>(stages);
  return a;
}

// Row indptr of page lists (FlashInfer's paged_kv_indptr): int32 [B + 1] on the device.
void check_page_indptr(const Tensor& page_indptr, int64_t batch) {
  check_cuda_tensor(page_indptr, "page_indptr", at::kInt);
  TORCH_CHECK(page_indptr.dim() == 1 && page_indptr.size(0) == batch + 1 && page_indptr.is_contiguous(),
              "pkv: page_indptr must be contiguous [B + 1] = [", batch + 1, "], got ", page_indptr.sizes());
}

// The page table: a block table [B, max_pages], or with page_indptr the concatenated page lists
// (FlashInfer's paged_kv_indices) in `block_table`.
void set_page_table(pkv::DecodeArgs& a, const Tensor& block_table, const std::optional<Tensor>& page_indptr,
                    int64_t batch) {
  if (page_indptr.has_value()) {
    check_page_indptr(*page_indptr, batch);
    check_cuda_tensor(block_table, "page_indices", at::kInt);
    // At least one entry: a row with an empty list looks entry 0 up (split_decode.cuh, CtaDecoder).
    TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous() && block_table.numel() >= 1 &&
                    block_table.numel() <= INT32_MAX,
                "pkv: with page_indptr the page table must be the contiguous page lists [num_entries >= 1], got ",
                block_table.sizes());
    a.page_indptr = page_indptr->data_ptr<int32_t>();
    a.block_table_stride = 0;
    a.block_table_width = static_cast<int>(block_table.numel());
  } else {
    check_cuda_tensor(block_table, "block_table", at::kInt);
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch && block_table.size(1) >= 1 &&
                    block_table.stride(1) == 1,
                "pkv: block_table must be [B, max_pages] with contiguous rows, got ", block_table.sizes());
    a.block_table_stride = static_cast<int>(block_table.stride(0));
    a.block_table_width = static_cast<int>(block_table.size(1));
  }
  a.block_table = block_table.data_ptr<int32_t>();
}

pkv::DecodeArgs make_args(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table,
                          const Tensor& seq_lens, double sm_scale, const Tensor& out, const Tensor& part_m,
                          const Tensor& part_l, const Tensor& part_acc, int64_t stages,
                          const std::optional<Tensor>& page_indptr = std::nullopt) {
  pkv::DecodeArgs a = make_core_args(q, k_pages, v_pages, sm_scale, out, stages);
  set_page_table(a, block_table, page_indptr, q.size(0));
  check_cuda_tensor(seq_lens, "seq_lens", at::kInt);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "pkv: seq_lens must be contiguous [B], got ", seq_lens.sizes());
  for (const auto* t : {&part_m, &part_l, &part_acc}) {
    check_cuda_tensor(*t, "partial state", at::kFloat);
    TORCH_CHECK(t->is_contiguous(), "pkv: partial-state tensors must be contiguous");
  }
  TORCH_CHECK(part_m.dim() == 2 && part_m.size(1) == a.group_size && part_l.sizes() == part_m.sizes(),
              "pkv: part_m and part_l must be [num_slots, G], got ", part_m.sizes(), " and ", part_l.sizes());
  TORCH_CHECK(part_acc.dim() == 3 && part_acc.size(0) == part_m.size(0) && part_acc.size(1) == a.group_size &&
                  part_acc.size(2) == pkv::kHeadDim,
              "pkv: part_acc must be [num_slots, G, d], got ", part_acc.sizes());
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.part_m = part_m.data_ptr<float>();
  a.part_l = part_l.data_ptr<float>();
  a.part_acc = part_acc.data_ptr<float>();
  return a;
}

// The fused variant's completion counters: one per (row, KV head) pair of the launch, or none.
int32_t* pair_counters_of(const std::optional<Tensor>& pair_counters, int64_t num_pairs) {
  if (!pair_counters.has_value()) return nullptr;
  check_cuda_tensor(*pair_counters, "pair_counters", at::kInt);
  TORCH_CHECK(pair_counters->numel() >= num_pairs && pair_counters->is_contiguous(),
              "pkv: pair_counters must hold ", num_pairs, " contiguous counters, got ", pair_counters->numel());
  return pair_counters->data_ptr<int32_t>();
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "pkv: ", what, " launch failed: ", cudaGetErrorString(status));
}

// The cluster merge replaces both the separate merge and the fused one, for up to
// kMaxClusterSplits splits (one thread-block cluster per (row, KV head)).
void check_cluster_merge(int64_t num_splits, const std::optional<Tensor>& pair_counters) {
  TORCH_CHECK(!pair_counters.has_value(), "pkv: cluster_merge and pair_counters (the fused merge) exclude each other");
  TORCH_CHECK(num_splits <= pkv::kMaxClusterSplits, "pkv: the cluster merge takes at most ", pkv::kMaxClusterSplits,
              " splits (one cluster per (row, KV head)), got num_splits=", num_splits);
}

void bucket_decode(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table,
                   const Tensor& seq_lens, const Tensor& row_indices, int64_t num_splits, double sm_scale,
                   const Tensor& out, const Tensor& part_m, const Tensor& part_l, const Tensor& part_acc,
                   const std::optional<Tensor>& pair_counters, int64_t stages, bool cluster_merge,
                   const std::optional<Tensor>& page_indptr, bool live_splits_only) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto args = make_args(q, k_pages, v_pages, block_table, seq_lens, sm_scale, out, part_m, part_l, part_acc, stages,
                        page_indptr);
  check_cuda_tensor(row_indices, "row_indices", at::kInt);
  TORCH_CHECK(row_indices.dim() == 1 && row_indices.is_contiguous(), "pkv: row_indices must be contiguous [R]");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, "pkv: num_splits must be in 1..65535, got ", num_splits);
  const int64_t num_rows = row_indices.size(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (cluster_merge && num_splits > 1) {
    check_cluster_merge(num_splits, pair_counters);
    check_launch(pkv::launch_bucket_cluster_decode(args, row_indices.data_ptr<int32_t>(), static_cast<int>(num_rows),
                                                   static_cast<int>(num_splits), stream),
                 "bucket_decode (cluster merge)");
    return;
  }
  TORCH_CHECK(num_splits == 1 || part_m.size(0) >= num_rows * args.num_kv_heads * num_splits,
              "pkv: partial-state buffers hold ", part_m.size(0), " slots, the launch needs ",
              num_rows * args.num_kv_heads * num_splits);
  int32_t* counters = num_splits > 1 ? pair_counters_of(pair_counters, num_rows * args.num_kv_heads) : nullptr;
  // The fused merge keeps a weight per (split, head) in shared memory, as the merge launch does.
  TORCH_CHECK(counters == nullptr || num_splits <= pkv::kMaxMergeSlots, "pkv: the fused merge takes at most ",
              pkv::kMaxMergeSlots, " splits, got num_splits=", num_splits);
  check_launch(pkv::launch_bucket_decode(args, row_indices.data_ptr<int32_t>(), static_cast<int>(num_rows),
                                         static_cast<int>(num_splits), counters, stream, live_splits_only),
               "bucket_decode");
}

void workqueue_decode(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table,
                      const Tensor& seq_lens, const Tensor& tasks, const Tensor& split_offsets, double sm_scale,
                      const Tensor& out, const Tensor& part_m, const Tensor& part_l, const Tensor& part_acc,
                      const std::optional<Tensor>& pair_counters, int64_t stages,
                      const std::optional<Tensor>& page_indptr) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto args = make_args(q, k_pages, v_pages, block_table, seq_lens, sm_scale, out, part_m, part_l, part_acc, stages,
                        page_indptr);
  check_cuda_tensor(tasks, "tasks", at::kInt);
  TORCH_CHECK(tasks.dim() == 2 && tasks.size(1) == 5 && tasks.is_contiguous(),
              "pkv: tasks must be contiguous [T, 5] (row, kvh, split, tile_begin, tile_end), got ", tasks.sizes());
  check_cuda_tensor(split_offsets, "split_offsets", at::kInt);
  TORCH_CHECK(split_offsets.dim() == 1 && split_offsets.size(0) == q.size(0) * args.num_kv_heads + 1 &&
                  split_offsets.is_contiguous(),
              "pkv: split_offsets must be [B * Hkv + 1] = [", q.size(0) * args.num_kv_heads + 1, "], got ",
              split_offsets.sizes());
  int32_t* counters = pair_counters_of(pair_counters, q.size(0) * args.num_kv_heads);
  check_launch(pkv::launch_workqueue_decode(args, tasks.data_ptr<int32_t>(), static_cast<int>(tasks.size(0)),
                                            split_offsets.data_ptr<int32_t>(), counters,
                                            c10::cuda::getCurrentCUDAStream().stream()),
               "workqueue_decode");
}

void merge_states(const Tensor& part_m, const Tensor& part_l, const Tensor& part_acc,
                  const std::optional<Tensor>& row_indices, const std::optional<Tensor>& split_offsets,
                  int64_t num_kv_heads, int64_t num_splits, const Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(out.dim() == 3 && out.size(2) == pkv::kHeadDim && out.stride(2) == 1,
              "pkv: out must be [B, Hq, d], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16,
              "pkv: out must be float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(num_kv_heads >= 1 && out.size(1) % num_kv_heads == 0, "pkv: Hq=", out.size(1),
              " is not a multiple of num_kv_heads=", num_kv_heads);
  TORCH_CHECK(row_indices.has_value() != split_offsets.has_value(),
              "pkv: merge_states takes row_indices (uniform buckets) or split_offsets (workqueue), not both");
  pkv::DecodeArgs a{};
  a.discard_merged_states = g_discard_merged_states.load();
  a.out = out.data_ptr();
  a.part_m = part_m.data_ptr<float>();
  a.part_l = part_l.data_ptr<float>();
  a.part_acc = part_acc.data_ptr<float>();
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.group_size = static_cast<int>(out.size(1) / num_kv_heads);
  a.out_stride_row = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.dtype = out.scalar_type() == at::kHalf ? pkv::KvDtype::kFloat16 : pkv::KvDtype::kBFloat16;
  int num_pairs;
  const int32_t* rows = nullptr;
  const int32_t* offsets = nullptr;
  if (row_indices.has_value()) {
    check_cuda_tensor(*row_indices, "row_indices", at::kInt);
    rows = row_indices->data_ptr<int32_t>();
    num_pairs = static_cast<int>(row_indices->size(0) * num_kv_heads);
  } else {
    check_cuda_tensor(*split_offsets, "split_offsets", at::kInt);
    offsets = split_offsets->data_ptr<int32_t>();
    num_pairs = static_cast<int>(split_offsets->size(0) - 1);
  }
  check_launch(pkv::launch_merge_states(a, rows, offsets, num_pairs, static_cast<int>(num_splits),
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "merge_states");
}

int64_t merge_code(pkv::MergeKind merge) { return static_cast<int64_t>(merge); }

// Whether a packed plan has a (row, KV head) of more than one split, that is a merge to run: the
// workqueue's widest split count, or any bucket launch's.
bool plan_merges(at::IntArrayRef layout) {
  if (layout[pkv::kLayoutRoute] == pkv::kRouteWorkqueue) return layout[pkv::kLayoutRouteFields + 1] > 1;
  const int64_t num_launches = layout[pkv::kLayoutRouteFields];
  for (int64_t j = 0; j < num_launches; ++j) {
    if (layout[pkv::kLayoutRouteFields + 2 + 2 * j] > 1) return true;
  }
  return false;
}

// What the step executor assumes of a plan, checked here so that a bad plan fails with the field
// named before any launch: split bounds and what the merge kind needs (counters for the fused
// merge, bucket launches of at most one cluster's splits for the cluster merge). Returns the fused
// merge's counters, or null where the plan merges no splits or merges them otherwise.
int32_t* check_plan(at::IntArrayRef layout, int64_t hkv, int64_t merge_kind,
                    const std::optional<Tensor>& pair_counters) {
  using pkv::MergeKind;
  const int64_t route = layout[pkv::kLayoutRoute], batch = layout[pkv::kLayoutBatch];
  const int64_t slots = layout[pkv::kLayoutNumSlots];
  TORCH_CHECK(merge_kind == merge_code(MergeKind::kLaunch) || merge_kind == merge_code(MergeKind::kFused) ||
                  merge_kind == merge_code(MergeKind::kCluster),
              "pkv: merge_kind must be ", merge_code(MergeKind::kLaunch), " (merge launch), ",
              merge_code(MergeKind::kFused), " (fused merge) or ", merge_code(MergeKind::kCluster),
              " (cluster merge), got ", merge_kind);
  const auto merge = static_cast<MergeKind>(merge_kind);
  // Counters with another merge kind would mean the caller expects the fused merge it did not ask for.
  TORCH_CHECK(!pair_counters.has_value() || merge == MergeKind::kFused, "pkv: pair_counters belong to the fused "
              "merge (merge_kind ", merge_code(MergeKind::kFused), "); merge_kind ", merge_kind, " takes none");
  if (route == pkv::kRouteWorkqueue) {
    TORCH_CHECK(merge != MergeKind::kCluster, "pkv: the cluster merge (merge_kind ", merge_kind,
                ") is a bucket-route option; workqueue tasks of one pair are not one cluster");
    const int64_t max_splits = layout[pkv::kLayoutRouteFields + 1];
    TORCH_CHECK(max_splits <= pkv::kMaxMergeSlots, "pkv: the plan has ", max_splits,
                " splits for one (row, KV head); the merge takes at most ", pkv::kMaxMergeSlots);
  } else {
    const int64_t num_launches = layout[pkv::kLayoutRouteFields];
    TORCH_CHECK(static_cast<int64_t>(layout.size()) == pkv::kLayoutRouteFields + 1 + 2 * num_launches,
                "pkv: bucket plan layout must list (rows, splits) for each of its ", num_launches, " launches");
    int64_t row_offset = 0, slot_offset = 0;
    for (int64_t j = 0; j < num_launches; ++j) {
      const int64_t rows = layout[pkv::kLayoutRouteFields + 1 + 2 * j];
      const int64_t splits = layout[pkv::kLayoutRouteFields + 2 + 2 * j];
      TORCH_CHECK(rows >= 0 && splits >= 1 && splits <= pkv::kMaxMergeSlots && row_offset + rows <= batch &&
                      slot_offset + rows * hkv * splits <= slots,
                  "pkv: bucket launch ", j, " (", rows, " rows, ", splits, " splits) does not fit its plan");
      TORCH_CHECK(merge != MergeKind::kCluster || splits <= pkv::kMaxClusterSplits,
                  "pkv: the cluster merge takes at most ", pkv::kMaxClusterSplits,
                  " splits (one cluster per (row, KV head)), got num_splits=", splits, " in bucket launch ", j);
      row_offset += rows;
      slot_offset += rows * hkv * splits;
    }
  }
  // A plan whose every launch has one split writes `out` directly: only a merge needs counters.
  if (merge != MergeKind::kFused || !plan_merges(layout)) return nullptr;
  TORCH_CHECK(pair_counters.has_value(), "pkv: the fused merge (merge_kind ", merge_kind, ") needs pair_counters "
              "for a plan with more than one split per (row, KV head)");
  return pair_counters_of(pair_counters, batch * hkv);
}

// One decode step from a packed plan (step_plan.h's layout, already on the device): output and
// partial-state scratch are allocated here and step_executor.h issues every launch of the route,
// so a step costs one dispatcher call instead of a Python loop over launches and allocations.
// merge_kind (step_plan.h's MergeKind) is the caller's choice of merge for launches with more
// than one split.
Tensor run_plan(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& meta,
                at::IntArrayRef layout, double sm_scale, int64_t stages, int64_t merge_kind,
                const std::optional<Tensor>& pair_counters) {
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(layout.size() >= pkv::kLayoutRouteFields + 1, "pkv: plan layout is too short: ", layout);
  const int64_t route = layout[pkv::kLayoutRoute], batch = layout[pkv::kLayoutBatch];
  const int64_t width = layout[pkv::kLayoutTableWidth], slots = layout[pkv::kLayoutNumSlots];
  const int64_t page_entries = layout[pkv::kLayoutPageEntries];
  TORCH_CHECK(route == pkv::kRouteWorkqueue || route == pkv::kRouteBuckets, "pkv: unknown plan route ", route);
  TORCH_CHECK(route == pkv::kRouteBuckets || layout.size() >= pkv::kLayoutRouteFields + 2,
              "pkv: workqueue plan layout must hold num_tasks and max_splits: ", layout);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == batch, "pkv: q must be [B=", batch, ", Hq, d], got ", q.sizes());
  TORCH_CHECK(k_pages.dim() == 4, "pkv: k_pages must be [num_pages, Hkv, P, d], got ", k_pages.sizes());
  const int64_t hkv = k_pages.size(1);
  TORCH_CHECK(hkv >= 1 && q.size(1) % hkv == 0, "pkv: Hq=", q.size(1), " is not a multiple of Hkv=", hkv);
  const int64_t group_size = q.size(1) / hkv;
  check_cuda_tensor(meta, "plan metadata", at::kInt);
  TORCH_CHECK(meta.dim() == 1 && meta.is_contiguous(), "pkv: plan metadata must be a contiguous 1-D tensor");
  const int64_t num_tasks = route == pkv::kRouteWorkqueue ? layout[pkv::kLayoutRouteFields] : 0;
  const int64_t route_ints = route == pkv::kRouteWorkqueue ? 5 * num_tasks + batch * hkv + 1 : batch;
  // A block table (width W >= 1, no entries) or page lists (width 0, N >= 1 entries), never both.
  const bool lists = width == 0;
  TORCH_CHECK(lists ? page_entries >= 1 && page_entries <= INT32_MAX : width >= 1 && width <= INT32_MAX &&
                                                                         page_entries == 0,
              "pkv: plan layout has block-table width ", width, " and ", page_entries, " page-list entries");
  const int64_t table_ints = lists ? batch + 1 + page_entries : batch * width;
  TORCH_CHECK(meta.numel() == table_ints + batch + route_ints, "pkv: plan metadata holds ", meta.numel(),
              " ints, its layout needs ", table_ints + batch + route_ints, " (plan built for another Hkv?)");
  TORCH_CHECK(slots >= 0, "pkv: plan layout has ", slots, " slots");
  int32_t* counters = check_plan(layout, hkv, merge_kind, pair_counters);

  Tensor out = at::empty_like(q);
  auto args = make_core_args(q, k_pages, v_pages, sm_scale, out, stages);
  // One scratch allocation, carved by pointer (no view tensors on the per-step path): acc, then m
  // and l, each starting on a 16-byte boundary like a buffer of its own.
  const int64_t states = slots * group_size, states_padded = (states + 3) / 4 * 4;
  Tensor scratch = at::empty({states * pkv::kHeadDim + 2 * states_padded}, q.options().dtype(at::kFloat));
  args.part_acc = scratch.data_ptr<float>();
  args.part_m = args.part_acc + states * pkv::kHeadDim;
  args.part_l = args.part_m + states_padded;
  if (lists) {  // [page_indptr B+1][page lists N], the indptr checked by the planner that packed it
    args.page_indptr = meta.data_ptr<int32_t>();
    args.block_table = args.page_indptr + batch + 1;
    args.block_table_stride = 0;
    args.block_table_width = static_cast<int>(page_entries);
  } else {
    args.block_table = meta.data_ptr<int32_t>();
    args.block_table_stride = static_cast<int>(width);
    args.block_table_width = static_cast<int>(width);
  }
  args.seq_lens = meta.data_ptr<int32_t>() + table_ints;
  const int32_t* route_data = args.seq_lens + batch;
  const char* failed = "run_plan";
  check_launch(pkv::run_step_plan(args, layout.data(), static_cast<int64_t>(layout.size()), route_data,
                                  static_cast<pkv::MergeKind>(merge_kind), counters,
                                  c10::cuda::getCurrentCUDAStream().stream(), &failed),
               failed);
  return out;
}

// An eager adaptive step in one dispatcher call: pkv_host::adaptive_plan decides the route and,
// where it is PersistentKV's, plans the step into pinned memory and starts its upload; run_plan
// then issues the route's launches behind that copy on the same stream. A plan without a split to
// merge runs the plain launch, with no counters. Returns adaptive_plan's five values and the
// output, or no plan and no output where the step is FlashInfer's.
using AdaptiveStep = std::tuple<std::vector<int64_t>, std::vector<double>, std::optional<Tensor>,
                                std::optional<Tensor>, std::vector<int64_t>, std::optional<Tensor>>;

AdaptiveStep adaptive_step(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& seq_lens,
                           const Tensor& pages, const std::optional<Tensor>& page_indptr, const Tensor& policy,
                           double sm_scale, int64_t stages, int64_t merge_kind,
                           const std::optional<Tensor>& pair_counters) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto [ints, reals, host_meta, meta, layout] =
      pkv_host::adaptive_plan(seq_lens, pages, page_indptr, policy, /*pinned=*/true, q.device());
  if (!meta.has_value()) return {ints, reals, std::nullopt, std::nullopt, layout, std::nullopt};
  const bool merges = plan_merges(layout);
  const int64_t merge = merges ? merge_kind : merge_code(pkv::MergeKind::kLaunch);
  const bool fused = merge == merge_code(pkv::MergeKind::kFused);
  Tensor out = run_plan(q, k_pages, v_pages, *meta, layout, sm_scale, stages, merge,
                        fused ? pair_counters : std::nullopt);
  return {ints, reals, host_meta, meta, layout, out};
}

// The workqueue plan made on the GPU from seq_lens (device_plan.h), into caller-owned buffers:
// no host synchronization, no copy, so a CUDA graph can hold it. With page lists, page_indptr
// and page_size clamp each row to its own pages. The split rule is the fixed one unless
// `balanced` (then num_splits is its budget where target_ctas is 0, as SplitPolicy's).
void plan_workqueue_on_device(const Tensor& seq_lens, int64_t num_kv_heads, int64_t num_splits, int64_t max_tokens,
                              const Tensor& tasks, const Tensor& split_offsets, const Tensor& counts,
                              const std::optional<Tensor>& page_indptr, int64_t page_size, bool balanced,
                              int64_t max_splits, int64_t target_ctas, int64_t min_tiles_per_split) {
  const c10::cuda::CUDAGuard guard(seq_lens.device());
  check_cuda_tensor(seq_lens, "seq_lens", at::kInt);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "pkv: seq_lens must be contiguous [B], got ",
              seq_lens.sizes());
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(batch >= 1 && batch <= pkv::kMaxDevicePlanRows, "pkv: a device plan serves 1..",
              pkv::kMaxDevicePlanRows, " rows, got B=", batch);
  TORCH_CHECK(num_kv_heads >= 1 && num_splits >= 1 && num_splits <= pkv::kMaxMergeSlots,
              "pkv: num_kv_heads must be >= 1 and num_splits in 1..", pkv::kMaxMergeSlots, ", got ", num_kv_heads,
              " and ", num_splits);
  TORCH_CHECK(max_tokens >= 1 && max_tokens <= INT32_MAX, "pkv: max_tokens must be in 1..2^31-1, got ", max_tokens);
  // The fixed rule reads none of the balanced rule's fields.
  TORCH_CHECK(!balanced || (max_splits >= 1 && max_splits <= pkv::kMaxMergeSlots && target_ctas >= 0 &&
                            target_ctas <= INT32_MAX && min_tiles_per_split >= 1 && min_tiles_per_split <= INT32_MAX),
              "pkv: the balanced rule needs max_splits in 1..", pkv::kMaxMergeSlots,
              ", target_ctas in 0..2^31-1 and min_tiles_per_split in 1..2^31-1, got ", max_splits, ", ", target_ctas,
              " and ", min_tiles_per_split);
  const pkv::SplitPolicyArgs policy{balanced, num_splits, max_splits, target_ctas, min_tiles_per_split};
  // The planner counts tasks, slots and (row, KV head) pairs in 32 bits; the capacity bounds all three
  // (B <= 1024 and both split counts <= 1024, so with Hkv < 2^31 it is computed without overflow).
  TORCH_CHECK(num_kv_heads <= INT32_MAX, "pkv: num_kv_heads must be < 2^31, got ", num_kv_heads);
  const int64_t capacity = pkv::max_workqueue_tasks(policy, batch, num_kv_heads);
  TORCH_CHECK(capacity <= INT32_MAX, "pkv: B=", batch, " rows of ", num_kv_heads, " KV heads can take ", capacity,
              " tasks under this split rule; a device plan holds at most 2^31-1");
  check_cuda_tensor(tasks, "tasks", at::kInt);
  TORCH_CHECK(tasks.dim() == 2 && tasks.size(1) == 5 && tasks.is_contiguous() && tasks.size(0) >= capacity,
              "pkv: tasks must be contiguous [>= ", capacity, " (the most tasks the split rule gives B=", batch,
              " rows), 5], got ", tasks.sizes());
  check_cuda_tensor(split_offsets, "split_offsets", at::kInt);
  TORCH_CHECK(split_offsets.is_contiguous() && split_offsets.numel() == batch * num_kv_heads + 1,
              "pkv: split_offsets must be contiguous [B * Hkv + 1] = [", batch * num_kv_heads + 1, "], got ",
              split_offsets.sizes());
  check_cuda_tensor(counts, "counts", at::kInt);
  TORCH_CHECK(counts.is_contiguous() && counts.numel() == 2, "pkv: counts must be contiguous [2], got ",
              counts.sizes());
  // page_size turns page-list entries into tokens, so page lists need theirs; it has no default
  // that could pass for one (a block table's rows are clamped by max_tokens and never read it).
  TORCH_CHECK(page_size >= 0 && page_size <= INT32_MAX, "pkv: page_size must be in 0..2^31-1, got ", page_size);
  if (page_indptr.has_value()) {
    check_page_indptr(*page_indptr, batch);
    TORCH_CHECK(page_size >= 1, "pkv: with page_indptr, page_size (tokens a page) must be given, got ", page_size);
  }
  check_launch(pkv::launch_plan_workqueue_on_device(seq_lens.data_ptr<int32_t>(),
                                                    page_indptr.has_value() ? page_indptr->data_ptr<int32_t>() : nullptr,
                                                    static_cast<int>(batch), static_cast<int>(num_kv_heads),
                                                    policy, static_cast<int>(max_tokens),
                                                    static_cast<int>(page_size), tasks.data_ptr<int32_t>(),
                                                    split_offsets.data_ptr<int32_t>(), counts.data_ptr<int32_t>(),
                                                    c10::cuda::getCurrentCUDAStream().stream()),
               "plan_workqueue_on_device");
}

// A step planned by plan_workqueue_on_device: the decode grid is the capacity of `tasks` (CTAs
// past the live count leave at once), then the merge over every (row, KV head) pair, which skips
// single-split pairs. Shapes depend on the batch size only, never on the lengths.
void run_workqueue_planned_on_device(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                                     const Tensor& block_table, const Tensor& seq_lens, const Tensor& tasks,
                                     const Tensor& split_offsets, const Tensor& counts, double sm_scale,
                                     int64_t stages, const Tensor& out, const Tensor& part_m, const Tensor& part_l,
                                     const Tensor& part_acc, const std::optional<Tensor>& page_indptr,
                                     const std::optional<Tensor>& pair_counters) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto args = make_args(q, k_pages, v_pages, block_table, seq_lens, sm_scale, out, part_m, part_l, part_acc, stages,
                        page_indptr);
  const int64_t pairs = q.size(0) * args.num_kv_heads;
  check_cuda_tensor(tasks, "tasks", at::kInt);
  TORCH_CHECK(tasks.dim() == 2 && tasks.size(1) == 5 && tasks.is_contiguous() && tasks.size(0) >= 1,
              "pkv: tasks must be contiguous [capacity, 5], got ", tasks.sizes());
  TORCH_CHECK(part_m.size(0) >= tasks.size(0), "pkv: the partial states hold ", part_m.size(0),
              " slots, the plan's capacity is ", tasks.size(0));
  check_cuda_tensor(split_offsets, "split_offsets", at::kInt);
  TORCH_CHECK(split_offsets.is_contiguous() && split_offsets.numel() == pairs + 1,
              "pkv: split_offsets must be contiguous [B * Hkv + 1] = [", pairs + 1, "], got ", split_offsets.sizes());
  check_cuda_tensor(counts, "counts", at::kInt);
  TORCH_CHECK(counts.is_contiguous() && counts.numel() == 2, "pkv: counts must be contiguous [2], got ",
              counts.sizes());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // With pair_counters the last task of each pair merges it (fused); otherwise a merge launch follows.
  int32_t* counters = pair_counters_of(pair_counters, pairs);
  check_launch(pkv::launch_workqueue_decode(args, tasks.data_ptr<int32_t>(), static_cast<int>(tasks.size(0)),
                                            split_offsets.data_ptr<int32_t>(), counters, stream,
                                            counts.data_ptr<int32_t>()),
               "workqueue_decode (planned on the device)");
  if (counters != nullptr) return;
  check_launch(pkv::launch_merge_states(args, nullptr, split_offsets.data_ptr<int32_t>(), static_cast<int>(pairs), 0,
                                        stream),
               "merge_states (planned on the device)");
}

}  // namespace

TORCH_LIBRARY(pkv, m) {
  m.def(
      "bucket_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_lens, "
      "Tensor row_indices, int num_splits, float sm_scale, Tensor(a!) out, Tensor(b!) part_m, "
      "Tensor(c!) part_l, Tensor(d!) part_acc, Tensor(e!)? pair_counters, int stages=3, "
      "bool cluster_merge=False, Tensor? page_indptr=None, bool live_splits_only=False) -> ()");
  m.def(
      "workqueue_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_lens, "
      "Tensor tasks, Tensor split_offsets, float sm_scale, Tensor(a!) out, Tensor(b!) part_m, "
      "Tensor(c!) part_l, Tensor(d!) part_acc, Tensor(e!)? pair_counters, int stages=3, "
      "Tensor? page_indptr=None) -> ()");
  // Returns the setting before the call.
  m.def("set_discard_merged_states(bool enabled) -> bool", &set_discard_merged_states);
  m.def(
      "merge_states(Tensor part_m, Tensor part_l, Tensor part_acc, Tensor? row_indices, "
      "Tensor? split_offsets, int num_kv_heads, int num_splits, Tensor(a!) out) -> ()");
  m.def(
      "run_plan(Tensor q, Tensor k_pages, Tensor v_pages, Tensor meta, int[] layout, float sm_scale, int stages, "
      "int merge_kind, Tensor(a!)? pair_counters) -> Tensor");
  m.def(
      "adaptive_step(Tensor q, Tensor k_pages, Tensor v_pages, Tensor seq_lens, Tensor pages, Tensor? page_indptr, "
      "Tensor policy, float sm_scale, int stages, int merge_kind, Tensor(a!)? pair_counters) "
      "-> (int[], float[], Tensor?, Tensor?, int[], Tensor?)");
  m.def(
      "plan_workqueue_on_device(Tensor seq_lens, int num_kv_heads, int num_splits, int max_tokens, "
      "Tensor(a!) tasks, Tensor(b!) split_offsets, Tensor(c!) counts, Tensor? page_indptr=None, "
      "int page_size=0, bool balanced=False, int max_splits=0, int target_ctas=0, "
      "int min_tiles_per_split=1) -> ()");
  m.def(
      "run_workqueue_planned_on_device(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, "
      "Tensor seq_lens, Tensor tasks, Tensor split_offsets, Tensor counts, float sm_scale, int stages, "
      "Tensor(a!) out, Tensor(b!) part_m, Tensor(c!) part_l, Tensor(d!) part_acc, Tensor? page_indptr=None, "
      "Tensor(e!)? pair_counters=None) -> ()");
}

TORCH_LIBRARY_IMPL(pkv, CUDA, m) {
  m.impl("bucket_decode", &bucket_decode);
  m.impl("workqueue_decode", &workqueue_decode);
  m.impl("merge_states", &merge_states);
  m.impl("run_plan", &run_plan);
  m.impl("adaptive_step", &adaptive_step);
  m.impl("plan_workqueue_on_device", &plan_workqueue_on_device);
  m.impl("run_workqueue_planned_on_device", &run_workqueue_planned_on_device);
}
