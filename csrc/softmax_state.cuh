// Split softmax states: the CTA-local combine buffer and the exact merge of a pair's splits.
#pragma once
#include <cstdint>
#include <math_constants.h>

#include "dtype_traits.cuh"
#include "pkv_launch.h"

namespace pkv {

constexpr float kLn2 = 0.6931471805599453f;

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

// out[row, kvh*G + g, t] = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s, thread t = head-dim
// element. Loads bypass L1 (__ldcg): in the fused path other CTAs wrote these slots just before.
template <typename T, int G>
__device__ void merge_pair(const DecodeArgs& a, int slot_begin, int num_slots, int row, int kvh) {
  const int t = threadIdx.x;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float m = -CUDART_INF_F;
    for (int s = 0; s < num_slots; ++s) m = fmaxf(m, __ldcg(a.part_m + (slot_begin + s) * G + g));
    float l = 0.f, acc = 0.f;
    for (int s = 0; s < num_slots; ++s) {
      const int slot = slot_begin + s;
      const float ms = __ldcg(a.part_m + slot * G + g);
      const float w = (ms == -CUDART_INF_F) ? 0.f : __expf(ms - m);  // neutral (empty) splits weigh 0
      l += w * __ldcg(a.part_l + slot * G + g);
      acc += w * __ldcg(a.part_acc + (static_cast<int64_t>(slot) * G + g) * kHeadDim + t);
    }
    T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
    out[t] = Vec8<T>::from_float(acc / l);
  }
}

}  // namespace pkv
