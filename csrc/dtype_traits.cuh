// Conversions between the KV storage types and float32, 8 elements (16 bytes) at a time.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pkv {

template <typename T>
struct Vec8;

template <>
struct Vec8<__half> {
  __device__ __forceinline__ static void to_float(const uint4& raw, float (&out)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Vec8<__nv_bfloat16> {
  __device__ __forceinline__ static void to_float(const uint4& raw, float (&out)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

}  // namespace pkv
