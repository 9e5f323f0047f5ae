// Split softmax states: the CTA-local combine buffer and the exact merge of a pair's splits.
#pragma once
#include <cstdint>
#include <math_constants.h>

#include "dtype_traits.cuh"
#include "pkv_launch.h"

namespace pkv {

constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMergeThreads = 128;
constexpr int kMergeSlotGroups = 4;  // slots are read by 4 groups of 32 threads, 4 dims (16 bytes) each
constexpr int kMergeScratchFloats = 8 + 2 * kMaxMergeSlots + kMergeSlotGroups * kHeadDim;
// merge_pair's shared memory: m (then the weight) of every (slot, head), two floats per head and
// the completion flag; well inside the decode ring it reuses.
constexpr int kPairMergeScratchFloats = kMaxMergeSlots * kMaxGroupSize + 2 * kMaxGroupSize + 1;

// Per-warp states laid out in (reused) shared memory: acc[warp][g][d], then m[warp][g], l[warp][g].
template <int G>
struct CombineBuffer {
  static constexpr int kWarpsMax = 4;
  float* base;
  __device__ explicit CombineBuffer(char* smem) : base(reinterpret_cast<float*>(smem)) {}
  __device__ float* acc(int w, int g) const { return base + (w * G + g) * kHeadDim; }
  __device__ float& m(int w, int g) const { return base[kWarpsMax * G * kHeadDim + w * G + g]; }
  __device__ float& l(int w, int g) const { return base[kWarpsMax * G * (kHeadDim + 1) + w * G + g]; }
};

template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* red) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32;
  __syncthreads();  // red[] may still be read from an earlier reduction
  if (threadIdx.x % 32 == 0) red[warp] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) x = kMax ? fmaxf(x, red[w]) : x + red[w];
  return x;
}

// Invalidates, without a write-back, the L2 lines of the partial states one warp of merge_head read
// (slots group, group + kMergeSlotGroups, ...: 512 bytes, four 128-byte lines each). Lanes 0, 8, 16
// and 24 each drop the line that starts at their own 16 bytes. Call it only once every lane of the
// warp has consumed its loads. A line not 128-byte aligned (a state buffer at an odd offset) is
// left alone: discard takes whole lines.
template <int G>
__device__ void discard_read_states(const float* acc_of_slot, int num_slots, int group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(kHeadDim * sizeof(float) == 4 * 128, "a state row is four 128-byte lines, one per 8 lanes");
  if ((threadIdx.x & 7) != 0) return;
  for (int s = group; s < num_slots; s += kMergeSlotGroups) {
    const float* line = acc_of_slot + static_cast<int64_t>(s) * G * kHeadDim;
    if ((reinterpret_cast<uintptr_t>(line) & 127) == 0)
      asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
  }
#endif
}

// Merges query head g of one (row, kvh) pair over its slots, with kMergeThreads threads:
// out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s. The merge runs after the decode grid,
// so its cost is its chain of dependent reads: every m and l, and the accumulators of the first
// kPrefetchSlots slots, are read in one round before any reduction, so a pair of up to 32
// splits costs a single round of L2 reads. 4 slot groups read acc with 16-byte loads. Loads
// bypass L1 (__ldcg): another kernel (or, fused, another CTA) wrote these slots just before.
template <typename T, int G>
__device__ void merge_head(const DecodeArgs& a, int slot_begin, int num_slots, int row, int kvh, int g,
                           float* scratch) {
  constexpr int kPrefetch = 8;  // accumulator loads per thread issued before the weights are known
  float* red = scratch;
  float* weight = scratch + 8;
  float* lsum = weight + kMaxMergeSlots;
  float* partial = lsum + kMaxMergeSlots;
  const int t = threadIdx.x;
  const int lane_dims = (t % 32) * 4;
  const int group = t / 32;
  const float* acc_of_slot = a.part_acc + (static_cast<int64_t>(slot_begin) * G + g) * kHeadDim + lane_dims;
  float4 early[kPrefetch];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int s = group + i * kMergeSlotGroups;
    early[i] = s < num_slots ? __ldcg(reinterpret_cast<const float4*>(acc_of_slot + static_cast<int64_t>(s) * G * kHeadDim))
                             : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float m = -CUDART_INF_F;
  for (int s = t; s < num_slots; s += kMergeThreads) {
    const float ms = __ldcg(a.part_m + (slot_begin + s) * G + g);
    weight[s] = ms;
    lsum[s] = __ldcg(a.part_l + (slot_begin + s) * G + g);
    m = fmaxf(m, ms);
  }
  m = block_reduce<true>(m, red);
  float l = 0.f;
  for (int s = t; s < num_slots; s += kMergeThreads) {
    const float ms = weight[s];
    const float w = (ms == -CUDART_INF_F) ? 0.f : __expf(ms - m);  // neutral (empty) splits weigh 0
    weight[s] = w;
    l += w * lsum[s];
  }
  l = block_reduce<false>(l, red);  // its barriers also publish weight[]
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int s = group + i * kMergeSlotGroups;
    const float w = s < num_slots ? weight[s] : 0.f;
    acc.x += w * early[i].x;
    acc.y += w * early[i].y;
    acc.z += w * early[i].z;
    acc.w += w * early[i].w;
  }
#pragma unroll 4
  for (int s = group + kPrefetch * kMergeSlotGroups; s < num_slots; s += kMergeSlotGroups) {
    const float w = weight[s];
    const float4 v = __ldcg(reinterpret_cast<const float4*>(acc_of_slot + static_cast<int64_t>(s) * G * kHeadDim));
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  float* mine = partial + group * kHeadDim + lane_dims;
  mine[0] = acc.x;
  mine[1] = acc.y;
  mine[2] = acc.z;
  mine[3] = acc.w;
  __syncthreads();  // every lane's loads are consumed: the states it read may go
  if (a.discard_merged_states) discard_read_states<G>(acc_of_slot, num_slots, group);
  const float total = partial[t] + partial[kHeadDim + t] + partial[2 * kHeadDim + t] + partial[3 * kHeadDim + t];
  T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
  out[t] = Vec8<T>::from_float(total / l);
}

// Merges every query head of one (row, kvh) pair at once, with kMergeThreads threads: the fused
// path's merge, run by the pair's last split. Thread t owns head-dim element t of every head and
// keeps G * 4 independent loads in flight. `scratch` holds kPairMergeScratchFloats.
template <typename T, int G>
__device__ void merge_pair(const DecodeArgs& a, int slot_begin, int num_slots, int row, int kvh, float* scratch) {
  static_assert(G <= kMaxGroupSize, "merge_pair scratch is sized for G <= kMaxGroupSize");
  const int n = num_slots * G;  // (slot, head) entries, slot-major like part_m
  float* weight = scratch;      // m first, overwritten by the normalized weight
  float* head_m = scratch + kMaxMergeSlots * kMaxGroupSize;
  float* head_inv_l = head_m + kMaxGroupSize;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  for (int i = t; i < n; i += kMergeThreads) weight[i] = __ldcg(a.part_m + slot_begin * G + i);
  __syncthreads();
  for (int g = warp; g < G; g += kMergeThreads / 32) {  // one warp per head
    float m = -CUDART_INF_F;
    for (int s = lane; s < num_slots; s += 32) m = fmaxf(m, weight[s * G + g]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
    for (int s = lane; s < num_slots; s += 32) {
      const float ms = weight[s * G + g];
      if (ms != -CUDART_INF_F) l += __expf(ms - m) * __ldcg(a.part_l + (slot_begin + s) * G + g);  // empty: 0
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      head_m[g] = m;
      head_inv_l[g] = 1.f / l;
    }
  }
  __syncthreads();
  for (int i = t; i < n; i += kMergeThreads) {
    const float ms = weight[i];
    const int g = i % G;
    weight[i] = (ms == -CUDART_INF_F) ? 0.f : __expf(ms - head_m[g]) * head_inv_l[g];
  }
  __syncthreads();
  const float* acc = a.part_acc + static_cast<int64_t>(slot_begin) * G * kHeadDim + t;
  float total[G];
#pragma unroll
  for (int g = 0; g < G; ++g) total[g] = 0.f;
#pragma unroll 4
  for (int s = 0; s < num_slots; ++s) {
#pragma unroll
    for (int g = 0; g < G; ++g) total[g] += weight[s * G + g] * __ldcg(acc + (s * G + g) * kHeadDim);
  }
  T* out = static_cast<T*>(a.out) + row * a.out_stride_row + kvh * G * a.out_stride_head + t;
#pragma unroll
  for (int g = 0; g < G; ++g) out[g * a.out_stride_head] = Vec8<T>::from_float(total[g]);
}

}  // namespace pkv
