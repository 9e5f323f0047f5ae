// Split decode over native block tables: one CTA covers (row, KV head, a range of 32-token tiles)
// and all G query heads that share that KV head. Each of the 4 warps owns 8 tokens of every tile
// and runs its own cp.async ring, so the main loop needs no CTA-wide barrier; the warps' online
// softmax states are combined once at the end.
#pragma once
#include <cstdint>
#include <math_constants.h>

#include "cp_async.cuh"
#include "dtype_traits.cuh"
#include "pkv_launch.h"
#include "softmax_state.cuh"

namespace pkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kTileTokens / kWarps;  // tokens of each tile a warp owns
constexpr int kCopiesPerLane = kRowsPerWarp * kHeadDim * 2 / 16 / 32;  // 16-byte copies per lane per K (or V)
constexpr int kStages = 3;
constexpr int kStageElems = 2 * kRowsPerWarp * kHeadDim;  // K rows then V rows
constexpr int kDecodeSmemBytes = kWarps * kStages * kStageElems * 2;
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kHeadDim == 128, "lane layout assumes 16 lanes x 8 elements per row");
static_assert(kCopiesPerLane == 4, "copy layout assumes 4 copies per lane");

// Per-warp online-softmax state over its tokens, in the log2 domain of the scaled score.
template <int G>
struct WarpState {
  float m[G];
  float l[G];        // this half-warp's share; halves are summed at the end
  float acc[G][8];   // the 8 head-dim elements this lane owns
};

template <typename T, int G>
struct CtaDecoder {
  const DecodeArgs& a;
  const int row, kvh, seq_len, tile_begin, tile_end;
  T* ring;  // this warp's ring of kStages (K, V) chunks
  const int warp, lane, half, col;
  const T* k_head;
  const T* v_head;
  const int32_t* pages;

  __device__ CtaDecoder(const DecodeArgs& args, int row_, int kvh_, int seq_len_, int tb, int te, char* smem)
      : a(args), row(row_), kvh(kvh_), seq_len(seq_len_), tile_begin(tb), tile_end(te),
        ring(reinterpret_cast<T*>(smem) + (threadIdx.x / 32) * kStages * kStageElems),
        warp(threadIdx.x / 32), lane(threadIdx.x % 32), half((threadIdx.x % 32) >> 4),
        col(threadIdx.x & 15) {
    k_head = static_cast<const T*>(a.k_pages) + kvh * a.kv_stride_head + col * 8;
    v_head = static_cast<const T*>(a.v_pages) + kvh * a.kv_stride_head + col * 8;
    pages = a.block_table + static_cast<int64_t>(row) * a.block_table_stride;
  }

  // Physical page of each token this lane copies for stage j, or -1 past the row's end.
  __device__ __forceinline__ void lookup(int j, int (&pg)[kCopiesPerLane]) const {
    const int tok0 = (tile_begin + j) * kTileTokens + warp * kRowsPerWarp + half;
    const bool in_split = tile_begin + j < tile_end;
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int tok = tok0 + 2 * i;
      pg[i] = (in_split && tok < seq_len) ? __ldg(pages + (tok >> a.page_shift)) : -1;
    }
  }

  __device__ __forceinline__ void issue(int j, const int (&pg)[kCopiesPerLane]) const {
    T* sk = ring + (j % kStages) * kStageElems;
    T* sv = sk + kRowsPerWarp * kHeadDim;
    const int tok0 = (tile_begin + j) * kTileTokens + warp * kRowsPerWarp + half;
    const int page_mask = (1 << a.page_shift) - 1;
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int r = half + 2 * i;
      const int tok = tok0 + 2 * i;
      const bool valid = pg[i] >= 0;
      const int64_t off = valid ? static_cast<int64_t>(pg[i]) * a.kv_stride_page +
                                      static_cast<int64_t>(tok & page_mask) * kHeadDim
                                : 0;
      cp_async_16(sk + r * kHeadDim + col * 8, k_head + off, valid);
      cp_async_16(sv + r * kHeadDim + col * 8, v_head + off, valid);
    }
  }

  __device__ __forceinline__ void compute(int j, const float (&q)[G][8], WarpState<G>& st) const {
    const int tok0 = (tile_begin + j) * kTileTokens + warp * kRowsPerWarp;
    if (tok0 >= seq_len) return;  // warp-uniform: this warp's 8 tokens are all past the end
    const T* sk = ring + (j % kStages) * kStageElems;
    const T* sv = sk + kRowsPerWarp * kHeadDim;
    float s[kCopiesPerLane][G];
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int r = half + 2 * i;
      float k[8];
      Vec8<T>::to_float(*reinterpret_cast<const uint4*>(sk + r * kHeadDim + col * 8), k);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[g][e], k[e], dot);
        s[i][g] = dot;
      }
    }
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int off = 8; off >= 1; off >>= 1) s[i][g] += __shfl_xor_sync(0xffffffffu, s[i][g], off);
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      if (tok0 + half + 2 * i >= seq_len) {
#pragma unroll
        for (int g = 0; g < G; ++g) s[i][g] = -CUDART_INF_F;
      }
    }
    float p[kCopiesPerLane][G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int i = 1; i < kCopiesPerLane; ++i) mx = fmaxf(mx, s[i][g]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      // tok0 < seq_len, so token tok0 is valid and m_new is finite: no -inf - -inf below.
      const float m_new = fmaxf(st.m[g], mx);
      const float alpha = exp2f(st.m[g] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kCopiesPerLane; ++i) {
        p[i][g] = exp2f(s[i][g] - m_new);
        sum += p[i][g];
      }
      st.l[g] = st.l[g] * alpha + sum;
#pragma unroll
      for (int e = 0; e < 8; ++e) st.acc[g][e] *= alpha;
      st.m[g] = m_new;
    }
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int r = half + 2 * i;
      float v[8];
      Vec8<T>::to_float(*reinterpret_cast<const uint4*>(sv + r * kHeadDim + col * 8), v);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) st.acc[g][e] = fmaf(p[i][g], v[e], st.acc[g][e]);
    }
  }

  // Runs the split and leaves the CTA's combined state in shared memory (see CombineBuffer).
  __device__ void run(char* smem) const {
    float q[G][8];
    const float q_scale = a.sm_scale * kLog2e;
    const T* q_row = static_cast<const T*>(a.q) + row * a.q_stride_row;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      Vec8<T>::to_float(
          *reinterpret_cast<const uint4*>(q_row + (kvh * G + g) * a.q_stride_head + col * 8), q[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] *= q_scale;
    }
    WarpState<G> st;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      st.m[g] = -CUDART_INF_F;
      st.l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) st.acc[g][e] = 0.f;
    }

    const int n = tile_end - tile_begin;
    int pg[kCopiesPerLane];
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      lookup(j, pg);
      issue(j, pg);
      cp_async_commit();
    }
    lookup(kStages - 1, pg);
    for (int j = 0; j < n; ++j) {
      issue(j + kStages - 1, pg);  // rows past the split are zero-filled without a read
      cp_async_commit();
      lookup(j + kStages, pg);  // the page-table read overlaps this stage's math
      cp_async_wait<kStages - 1>();
      __syncwarp();
      compute(j, q, st);
      __syncwarp();  // the next issue overwrites the stage just read
    }
    cp_async_wait<0>();

#pragma unroll
    for (int g = 0; g < G; ++g) {
      st.l[g] += __shfl_xor_sync(0xffffffffu, st.l[g], 16);
#pragma unroll
      for (int e = 0; e < 8; ++e) st.acc[g][e] += __shfl_xor_sync(0xffffffffu, st.acc[g][e], 16);
    }
    __syncthreads();  // every warp is done with its ring: reuse it for the combine
    CombineBuffer<G> buf(smem);
    if (half == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) buf.acc(warp, g)[col * 8 + e] = st.acc[g][e];
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        buf.m(warp, g) = st.m[g];
        buf.l(warp, g) = st.l[g];
      }
    }
    __syncthreads();
  }
};

// Combines the warps' states for head-dim element threadIdx.x and writes either the output row
// (single split) or the split's partial state (natural-log domain, as docs/architecture.md says).
template <typename T, int G>
__device__ void finish_split(const DecodeArgs& a, char* smem, int row, int kvh, bool direct, int slot) {
  CombineBuffer<G> buf(smem);
  const int t = threadIdx.x;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float m = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, buf.m(w, g));
    float l = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float scale = exp2f(buf.m(w, g) - m);  // warps that saw no token have m = -inf
      l += scale * buf.l(w, g);
      acc += scale * buf.acc(w, g)[t];
    }
    if (direct) {
      T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
      out[t] = Vec8<T>::from_float(acc / l);
    } else {
      a.part_acc[(static_cast<int64_t>(slot) * G + g) * kHeadDim + t] = acc;
      if (t == 0) {
        a.part_m[slot * G + g] = m * kLn2;
        a.part_l[slot * G + g] = l;
      }
    }
  }
}

template <int G>
__device__ void write_neutral(const DecodeArgs& a, int slot) {
  const int t = threadIdx.x;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    a.part_acc[(static_cast<int64_t>(slot) * G + g) * kHeadDim + t] = 0.f;
    if (t == 0) {
      a.part_m[slot * G + g] = -CUDART_INF_F;
      a.part_l[slot * G + g] = 0.f;
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) bucket_decode_kernel(DecodeArgs a, const int32_t* row_indices,
                                                                 int num_splits) {
  extern __shared__ __align__(16) char smem[];
  const int r = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int row = row_indices[r];
  const int seq_len = a.seq_lens[row];
  const int n_tiles = (seq_len + kTileTokens - 1) / kTileTokens;
  const int per_split = (n_tiles + num_splits - 1) / num_splits;
  const int tb = split * per_split;
  const int te = min(tb + per_split, n_tiles);
  const int slot = (r * a.num_kv_heads + kvh) * num_splits + split;
  if (tb >= n_tiles) {  // row-local bounds leave this split empty: no Q load, no staging
    write_neutral<G>(a, slot);
    return;
  }
  CtaDecoder<T, G>(a, row, kvh, seq_len, tb, te, smem).run(smem);
  finish_split<T, G>(a, smem, row, kvh, num_splits == 1, slot);
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) workqueue_decode_kernel(DecodeArgs a, const int32_t* tasks,
                                                                    const int32_t* split_offsets,
                                                                    int32_t* pair_counters) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int is_last;
  const int32_t* task = tasks + blockIdx.x * 5;
  const int row = task[0], kvh = task[1], split = task[2], tb = task[3], te = task[4];
  const int pair = row * a.num_kv_heads + kvh;
  const int slot_begin = split_offsets[pair];
  const int num_slots = split_offsets[pair + 1] - slot_begin;
  const int seq_len = a.seq_lens[row];
  CtaDecoder<T, G>(a, row, kvh, seq_len, tb, te, smem).run(smem);
  finish_split<T, G>(a, smem, row, kvh, num_slots == 1, slot_begin + split);
  if (pair_counters == nullptr || num_slots == 1) return;
  // Fused merge: publish this split's state, then the last split of the pair to arrive merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int seen = atomicAdd(pair_counters + pair, 1);
    is_last = (seen == num_slots - 1);
    if (is_last) pair_counters[pair] = 0;  // every split of the pair has arrived: reset for replay
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_pair<T, G>(a, slot_begin, num_slots, row, kvh);
}

}  // namespace pkv
