// The project's binding of vLLM's CUDA PagedAttention decode kernels (paged_attention_v1 / v2).
//
// vLLM's own sources (csrc/attention/paged_attention_v{1,2}.cu and their headers, from the release
// pinned in pkv/engines/vllm_sources.py) are compiled next to this file by
// pkv.engines.vllm_sources.load_vllm_paged_attention; they are fetched into third_party/vllm, never
// committed. This file only declares vLLM's two entry points and registers them, with the schemas
// vLLM's csrc/torch_bindings.cpp gives them in that release, under the namespace pkv_vllm (not
// vLLM's _C, so a vLLM installed beside us cannot clash with it).

#include <torch/all.h>
#include <torch/library.h>

#include <optional>
#include <string>

// Declarations as in vLLM's csrc/ops.h; the definitions are in vLLM's paged_attention_v{1,2}.cu.
void paged_attention_v1(
    torch::Tensor& out, torch::Tensor& query, torch::Tensor& key_cache,
    torch::Tensor& value_cache, int64_t num_kv_heads, double scale,
    torch::Tensor& block_tables, torch::Tensor& seq_lens, int64_t block_size,
    int64_t max_seq_len, const std::optional<torch::Tensor>& alibi_slopes,
    const std::string& kv_cache_dtype, torch::Tensor& k_scale,
    torch::Tensor& v_scale, const int64_t tp_rank,
    const int64_t blocksparse_local_blocks,
    const int64_t blocksparse_vert_stride, const int64_t blocksparse_block_size,
    const int64_t blocksparse_head_sliding_step);

void paged_attention_v2(
    torch::Tensor& out, torch::Tensor& exp_sums, torch::Tensor& max_logits,
    torch::Tensor& tmp_out, torch::Tensor& query, torch::Tensor& key_cache,
    torch::Tensor& value_cache, int64_t num_kv_heads, double scale,
    torch::Tensor& block_tables, torch::Tensor& seq_lens, int64_t block_size,
    int64_t max_seq_len, const std::optional<torch::Tensor>& alibi_slopes,
    const std::string& kv_cache_dtype, torch::Tensor& k_scale,
    torch::Tensor& v_scale, const int64_t tp_rank,
    const int64_t blocksparse_local_blocks,
    const int64_t blocksparse_vert_stride, const int64_t blocksparse_block_size,
    const int64_t blocksparse_head_sliding_step);

TORCH_LIBRARY(pkv_vllm, ops) {
  // The schemas of vLLM's torch_bindings.cpp, unchanged, so the Python call is vLLM's own.
  ops.def(
      "paged_attention_v1("
      "    Tensor! out, Tensor query, Tensor key_cache,"
      "    Tensor value_cache, int num_kv_heads, float scale,"
      "    Tensor block_tables, Tensor seq_lens, int block_size,"
      "    int max_seq_len, Tensor? alibi_slopes,"
      "    str kv_cache_dtype, Tensor k_scale, Tensor v_scale,"
      "    int tp_rank, int blocksparse_local_blocks,"
      "    int blocksparse_vert_stride, int blocksparse_block_size,"
      "    int blocksparse_head_sliding_step) -> ()");
  ops.def(
      "paged_attention_v2("
      "    Tensor! out, Tensor! exp_sums, Tensor! max_logits,"
      "    Tensor! tmp_out, Tensor query, Tensor key_cache,"
      "    Tensor value_cache, int num_kv_heads, float scale,"
      "    Tensor block_tables, Tensor seq_lens, int block_size,"
      "    int max_seq_len, Tensor? alibi_slopes,"
      "    str kv_cache_dtype, Tensor k_scale, Tensor v_scale,"
      "    int tp_rank, int blocksparse_local_blocks,"
      "    int blocksparse_vert_stride, int blocksparse_block_size,"
      "    int blocksparse_head_sliding_step) -> ()");
}

TORCH_LIBRARY_IMPL(pkv_vllm, CUDA, ops) {
  ops.impl("paged_attention_v1", &paged_attention_v1);
  ops.impl("paged_attention_v2", &paged_attention_v2);
}
