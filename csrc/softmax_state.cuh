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
constexpr int kMaxMergeSlots = 1024;  // host code keeps split counts at or under this
constexpr int kMergeScratchFloats = 8 + kMaxMergeSlots + kMergeSlotGroups * kHeadDim;

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

// Merges query head g of one (row, kvh) pair over its slots, with kMergeThreads threads:
// out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s. The split weights are computed once
// into shared memory; then 4 slot groups stream acc with 16-byte loads, so a pair with many
// splits is read with many loads in flight instead of one dependent chain per slot. Loads
// bypass L1 (__ldcg): in the fused path other CTAs wrote these slots just before.
template <typename T, int G>
__device__ void merge_head(const DecodeArgs& a, int slot_begin, int num_slots, int row, int kvh, int g,
                           float* scratch) {
  float* red = scratch;
  float* weight = scratch + 8;
  float* partial = weight + kMaxMergeSlots;
  const int t = threadIdx.x;
  float m = -CUDART_INF_F;
  for (int s = t; s < num_slots; s += kMergeThreads) m = fmaxf(m, __ldcg(a.part_m + (slot_begin + s) * G + g));
  m = block_reduce<true>(m, red);
  float l = 0.f;
  for (int s = t; s < num_slots; s += kMergeThreads) {
    const int slot = slot_begin + s;
    const float ms = __ldcg(a.part_m + slot * G + g);
    const float w = (ms == -CUDART_INF_F) ? 0.f : __expf(ms - m);  // neutral (empty) splits weigh 0
    weight[s] = w;
    l += w * __ldcg(a.part_l + slot * G + g);
  }
  l = block_reduce<false>(l, red);  // its barriers also publish weight[]
  const int lane_dims = (t % 32) * 4;
  const int group = t / 32;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = group; s < num_slots; s += kMergeSlotGroups) {
    const float w = weight[s];
    const float4 v = __ldcg(reinterpret_cast<const float4*>(
        a.part_acc + (static_cast<int64_t>(slot_begin + s) * G + g) * kHeadDim + lane_dims));
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
  __syncthreads();
  const float total = partial[t] + partial[kHeadDim + t] + partial[2 * kHeadDim + t] + partial[3 * kHeadDim + t];
  T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
  out[t] = Vec8<T>::from_float(total / l);
  __syncthreads();  // scratch is reused by the next head
}

}  // namespace pkv
