// Host entry points of the PersistentKV kernels. Framework-free: plain pointers, strides in
// elements and a CUDA stream, so the torch binding stays a thin layer over these calls.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "decode_constants.h"

namespace pkv {

enum class KvDtype : int { kFloat16 = 0, kBFloat16 = 1 };

// What every decode launch reads and writes. Layouts follow docs/architecture.md.
struct DecodeArgs {
  const void* q;            // [B, Hq, d]
  const void* k_pages;      // [num_pages, Hkv, P, d]
  const void* v_pages;      // [num_pages, Hkv, P, d]
  // The page table, in one of two forms. Block table (page_indptr null): row r's pages are
  // block_table[r * block_table_stride ..]. Page lists (FlashInfer's paged_kv_indptr / indices):
  // row r's pages are block_table[page_indptr[r] .. page_indptr[r + 1]).
  const int32_t* block_table;  // [B, block_table_stride], or the concatenated page lists
  const int32_t* page_indptr;  // [B + 1], or null for a block table
  const int32_t* seq_lens;     // [B]
  void* out;                // [B, Hq, d]
  float* part_m;            // [num_slots, G]
  float* part_l;            // [num_slots, G]
  float* part_acc;          // [num_slots, G, d]
  int num_kv_heads;
  int group_size;
  int page_shift;  // page size is 1 << page_shift tokens
  int block_table_stride;  // unused with page lists
  // Block table: entries per row that may be read (lookups are clamped to it). Page lists: the
  // lists' entries, recorded only; a row reads its own indptr range, which the caller vouches for.
  int block_table_width;
  int64_t q_stride_row, q_stride_head;
  int64_t out_stride_row, out_stride_head;
  // Element strides of k_pages and v_pages (the same for both), viewed as [num_pages, Hkv, P, d]
  // with d contiguous: kv_stride_token is d for HND pages and Hkv * d for NHD pages
  // ([num_pages, P, Hkv, d], vLLM's and FlashAttention's layout), which are read in place.
  // A token's offset inside a page fits 32 bits (the binding checks it), so the copy loop
  // computes it in 32-bit registers: a 64-bit stride there cost the stages = 2 kernels spills.
  int64_t kv_stride_page, kv_stride_head;
  int kv_stride_token;
  float sm_scale;
  KvDtype dtype;
  int stages;  // cp.async ring depth per warp: 2, 3 or 4
  // The merge kernel (merge_states; not the fused or cluster merges) drops each partial state's
  // L2 lines once it has read them (discard.global.L2, sm_80 and later), so the dead states are
  // never written back to memory while the next kernels stream their own data; the states are
  // undefined afterwards. Off: the states stay readable.
  bool discard_merged_states;
};

// Length-bucket route: grid (num_rows, Hkv, num_splits) over batch rows row_indices[0..num_rows).
// Split bounds are row-local (seq_lens); splits with no tiles write the neutral state and return.
// With num_splits == 1 the kernel writes `out` directly.
// When `pair_counters` is non-null (num_rows * Hkv of them, zero on entry and zero again on exit)
// the last split of each (row, KV head) merges it in the same launch (fused variant). With
// `live_splits_only` the fused merge counts and merges only the splits that own tiles (the
// first ones of the row), so empty splits write nothing; partial states past them stay unwritten.
cudaError_t launch_bucket_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                 int num_splits, int32_t* pair_counters, cudaStream_t stream,
                                 bool live_splits_only = false);

// Length-bucket route with the cluster merge (Hopper, sm_90): the same grid in clusters of
// (1, 1, num_splits), 2 <= num_splits <= kMaxClusterSplits. The splits of a (row, KV head) merge
// through distributed shared memory and write `out`; part_m, part_l and part_acc are not used.
cudaError_t launch_bucket_cluster_decode(const DecodeArgs& args, const int32_t* row_indices, int num_rows,
                                         int num_splits, cudaStream_t stream);

// Compact workqueue route: one CTA per task (row, kvh, split, tile_begin, tile_end).
// split_offsets has B * Hkv + 1 entries. A pair with one split is written to `out` directly.
// When `pair_counters` is non-null the last task of each pair merges it (fused variant); the
// counters must be zero on entry and are zero again on exit.
// When `live_tasks` is non-null (a plan made on the device, device_plan.h), num_tasks is the
// capacity of `tasks` and only the first *live_tasks of them run.
cudaError_t launch_workqueue_decode(const DecodeArgs& args, const int32_t* tasks, int num_tasks,
                                    const int32_t* split_offsets, int32_t* pair_counters,
                                    cudaStream_t stream, const int32_t* live_tasks = nullptr);

// Exact merge of split states into `out`, one CTA per (row, kvh) pair.
// Uniform mode (split_offsets == nullptr): pair p owns slots [p * num_splits, (p + 1) * num_splits)
// and its batch row is row_indices[p / Hkv]. Segmented mode: pair p = row * Hkv + kvh owns
// slots [split_offsets[p], split_offsets[p + 1]); pairs with one slot are skipped.
cudaError_t launch_merge_states(const DecodeArgs& args, const int32_t* row_indices,
                                const int32_t* split_offsets, int num_pairs, int num_splits,
                                cudaStream_t stream);

}  // namespace pkv
