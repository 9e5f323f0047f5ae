// The merge launch that follows a multi-split decode launch: one CTA per (row, KV head) pair and
// query head, so even a single long row's merge spreads over Hkv * G CTAs.
#pragma once
#include <cstdint>

#include "pkv_launch.h"
#include "softmax_state.cuh"

namespace pkv {

template <typename T, int G>
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(DecodeArgs a, const int32_t* row_indices,
                                                                     const int32_t* split_offsets, int num_splits) {
  __shared__ __align__(16) float scratch[kMergeScratchFloats];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the decode grid's states are complete
#endif
  const int pair = blockIdx.x;
  const int g = blockIdx.y;
  const int kvh = pair % a.num_kv_heads;
  if (split_offsets == nullptr) {  // uniform bucket layout
    merge_head<T, G>(a, pair * num_splits, num_splits, row_indices[pair / a.num_kv_heads], kvh, g, scratch);
    return;
  }
  const int slot_begin = split_offsets[pair];
  const int num_slots = split_offsets[pair + 1] - slot_begin;
  if (num_slots <= 1) return;  // the decode kernel already wrote this pair's output
  merge_head<T, G>(a, slot_begin, num_slots, pair / a.num_kv_heads, kvh, g, scratch);
}

}  // namespace pkv
