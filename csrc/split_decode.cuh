// Split decode over native block tables: one CTA covers (row, KV head, a range of 32-token tiles)
// and all G query heads that share that KV head.
//
// Each of the 4 warps takes 16-token chunks of the split in turn and runs its own cp.async ring,
// so the main loop has no CTA-wide barrier. Scores and P.V run on tensor cores (mma.m16n8k16):
// the G query heads are the rows of A (padded to 16), so the KV tile is read from shared memory
// by ldmatrix exactly once and the CUDA cores only do the online softmax. The warps' states are
// combined once at the end.
#pragma once
#include <climits>
#include <cstdint>
#include <math_constants.h>

#include "cp_async.cuh"
#include "dtype_traits.cuh"
#include "mma.cuh"
#include "pkv_launch.h"
#include "softmax_state.cuh"
#include "split_rule.h"

namespace pkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkTokens = 16;  // a warp's unit of work: one k16 step of P.V
constexpr int kChunksPerTile = kTileTokens / kChunkTokens;
constexpr int kRowChunks = kHeadDim * 2 / 16;          // 16-byte pieces of one K or V row
constexpr int kCopiesPerLane = kChunkTokens * kRowChunks / 32;  // per K (and per V) per chunk
constexpr int kStageElems = 2 * kChunkTokens * kHeadDim;  // K rows then V rows
// cp.async ring depth per warp. Deeper rings (3 stages: 96 KB a CTA, 2 CTAs an SM; 4 stages:
// 128 KB, 1 CTA an SM) keep more bytes in flight per warp; 2 stages (64 KB, 3 CTAs an SM) keep
// more warps resident. The benchmark picks.
template <int Stages>
constexpr int decode_smem_bytes() { return kWarps * Stages * kStageElems * 2; }
// CTAs an SM holds by shared memory (228 KB an SM, 1 KB reserved a CTA). The kernels promise
// the compiler this many in __launch_bounds__, so registers never become the tighter limit.
template <int Stages>
constexpr int decode_ctas_per_sm() { return (228 * 1024) / (decode_smem_bytes<Stages>() + 1024); }
static_assert(decode_smem_bytes<2>() >= kPairMergeScratchFloats * 4, "the fused merge reuses the decode ring");
constexpr int kPageLookahead = 4;  // chunks between a page-table read and the copy that uses it
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kHeadDim == 128, "fragment layout assumes d = 128");
static_assert(kCopiesPerLane == 8, "copy layout assumes 8 copies per lane");
static_assert(kThreads == kMergeThreads && kThreads == kHeadDim, "finish_split and merge_pair give a thread one dim");

// Element offset of 16-byte piece `piece` of row `row` in a staged chunk. The XOR swizzle puts
// the 8 rows an ldmatrix reads in 8 different bank groups (rows are 256 bytes apart).
__device__ __forceinline__ int swizzled(int row, int piece) { return row * kHeadDim + ((piece ^ (row & 7)) << 3); }

// A row's length as the kernels use it: its seq_len clamped to what its page-table entries
// address (a block table's width, or the row's own page list), as the device planner clamps it,
// so a length past its pages never reads or attends past them. Valid input is unchanged.
__device__ __forceinline__ int row_length(const DecodeArgs& a, int row) {
  const int64_t entries = a.page_indptr == nullptr
                              ? static_cast<int64_t>(a.block_table_width)
                              : static_cast<int64_t>(__ldg(a.page_indptr + row + 1)) - __ldg(a.page_indptr + row);
  return clamped_length(a.seq_lens[row], entries > 0 ? entries << a.page_shift : 0);
}

template <typename T, int G, int kStages>
struct CtaDecoder {
  const DecodeArgs& a;
  const int row, kvh, seq_len, tile_begin, num_chunks;
  T* ring;  // this warp's ring of kStages (K, V) chunks
  const int warp, lane;
  const T* k_head;
  const T* v_head;
  const int32_t* pages;  // this row's page table entries
  int last_page;         // the last entry of `pages` a lookup may read

  __device__ CtaDecoder(const DecodeArgs& args, int row_, int kvh_, int seq_len_, int tb, int te, char* smem)
      : a(args), row(row_), kvh(kvh_), seq_len(seq_len_), tile_begin(tb), num_chunks((te - tb) * kChunksPerTile),
        ring(reinterpret_cast<T*>(smem) + (threadIdx.x / 32) * kStages * kStageElems),
        warp(threadIdx.x / 32), lane(threadIdx.x % 32) {
    k_head = static_cast<const T*>(a.k_pages) + kvh * a.kv_stride_head;
    v_head = static_cast<const T*>(a.v_pages) + kvh * a.kv_stride_head;
    if (a.page_indptr == nullptr) {
      pages = a.block_table + static_cast<int64_t>(row) * a.block_table_stride;
      last_page = a.block_table_width - 1;
    } else {
      // A row with no entries looks entry 0 of the flat list up (the binding requires one); its
      // length clamps to 0, so nothing it reads is used. This keeps the lookup free of a check.
      const int first = __ldg(a.page_indptr + row);
      const int count = __ldg(a.page_indptr + row + 1) - first;
      pages = a.block_table + (count > 0 ? first : 0);
      last_page = max(count, 1) - 1;
    }
  }

  // First token of this warp's j-th chunk.
  __device__ __forceinline__ int chunk_token(int j) const {
    return tile_begin * kTileTokens + (warp + kWarps * j) * kChunkTokens;
  }

  // Lane r (< 16) looks up the physical page of token r of chunk j (-1 past the split or row).
  // The read is clamped into the row instead of predicated on seq_len, so at a split's start the
  // page-table read does not wait for the seq_lens read: one dependent round trip less.
  __device__ __forceinline__ int lookup(int j) const {
    const int tok = chunk_token(j) + (lane & 15);
    const int page = __ldg(pages + min(tok >> a.page_shift, last_page));
    const bool valid = warp + kWarps * j < num_chunks && tok < seq_len;
    return valid ? page : -1;
  }

  __device__ __forceinline__ void issue(int j, int page_of_lane) const {
    T* sk = ring + (j % kStages) * kStageElems;
    T* sv = sk + kChunkTokens * kHeadDim;
    const int tok0 = chunk_token(j);
    const int page_mask = (1 << a.page_shift) - 1;
    const int piece = lane & 15;
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int r = (lane >> 4) + 2 * i;
      const int pg = __shfl_sync(0xffffffffu, page_of_lane, r);
      const bool valid = pg >= 0;
      const int in_page = ((tok0 + r) & page_mask) * a.kv_stride_token + piece * 8;
      const int64_t off = valid ? static_cast<int64_t>(pg) * a.kv_stride_page + in_page : 0;
      cp_async_16(sk + swizzled(r, piece), k_head + off, valid);  // invalid rows: zero-filled, not read
      cp_async_16(sv + swizzled(r, piece), v_head + off, valid);
    }
  }

  // One chunk: S = Q K^T (16 heads x 16 tokens), online softmax on head row lane/4, O += P V.
  __device__ __forceinline__ void compute(int j, const uint32_t (&qa)[8][2], float& m, float& l,
                                          float (&o)[16][4]) const {
    const int tok0 = chunk_token(j);
    if (tok0 >= seq_len) return;  // warp-uniform: the whole chunk is past the row's end
    const T* sk = ring + (j % kStages) * kStageElems;
    const T* sv = sk + kChunkTokens * kHeadDim;
    const int quad = lane & 3;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const int r = ((lane >> 4) & 1) * 8 + (lane & 7);  // matrices: (tok 0-7|8-15) x (d lo|hi)
      const int hi = (lane >> 3) & 1;
#pragma unroll
      for (int kc = 0; kc < 8; ++kc) {
        uint32_t b[4];
        ldmatrix_x4(b, sk + swizzled(r, 2 * kc + hi));
        Mma<T>::run(s[0], qa[kc][0], qa[kc][1], b[0], b[1]);
        Mma<T>::run(s[1], qa[kc][0], qa[kc][1], b[2], b[3]);
      }
    }
    const float q_scale = a.sm_scale * kLog2e;
    float x[4] = {s[0][0] * q_scale, s[0][1] * q_scale, s[1][0] * q_scale, s[1][1] * q_scale};
    const int tok_of[4] = {2 * quad, 2 * quad + 1, 8 + 2 * quad, 9 + 2 * quad};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (tok0 + tok_of[i] >= seq_len) x[i] = -CUDART_INF_F;
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Token tok0 is valid, so the quad's max is finite: no (-inf) - (-inf) below.
    const float m_new = fmaxf(m, mx);
    const float alpha = exp2f(m - m_new);
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = exp2f(x[i] - m_new);
    l = l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    m = m_new;
#pragma unroll
    for (int nd = 0; nd < 16; ++nd) {
      o[nd][0] *= alpha;
      o[nd][1] *= alpha;
    }
    // The two n8 score tiles are exactly the A fragment of P for one k16 step.
    const uint32_t pa0 = Mma<T>::pack(p[0], p[1]);
    const uint32_t pa2 = Mma<T>::pack(p[2], p[3]);
    const int r = ((lane >> 3) & 1) * 8 + (lane & 7);  // matrices: (tok 0-7|8-15) x (d block 2pp|2pp+1)
    const int hi = lane >> 4;
#pragma unroll
    for (int pp = 0; pp < 8; ++pp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sv + swizzled(r, 2 * pp + hi));
      Mma<T>::run(o[2 * pp], pa0, pa2, b[0], b[1]);
      Mma<T>::run(o[2 * pp + 1], pa0, pa2, b[2], b[3]);
    }
  }

  // Runs the split and leaves the CTA's combined state in shared memory (see CombineBuffer).
  __device__ void run(char* smem) const {
    const int head = lane >> 2;  // A-fragment row: the query head this lane's scores belong to
    const int quad = lane & 3;
    uint32_t qa[8][2];
    {
      const T* q_row = static_cast<const T*>(a.q) + row * a.q_stride_row + (kvh * G + head) * a.q_stride_head;
#pragma unroll
      for (int kc = 0; kc < 8; ++kc) {
        const bool real = head < G;  // rows G..15 of A are zero padding
        qa[kc][0] = real ? *reinterpret_cast<const uint32_t*>(q_row + 16 * kc + 2 * quad) : 0u;
        qa[kc][1] = real ? *reinterpret_cast<const uint32_t*>(q_row + 16 * kc + 2 * quad + 8) : 0u;
      }
    }
    float m = -CUDART_INF_F, l = 0.f;
    float o[16][4];
#pragma unroll
    for (int nd = 0; nd < 16; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

    const int n = num_chunks > warp ? (num_chunks - warp + kWarps - 1) / kWarps : 0;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      issue(j, lookup(j));
      cp_async_commit();
    }
    // Page-table reads run kPageLookahead chunks ahead of the copies that use them. With the
    // read one chunk ahead, every iteration waited for it (an L2 or DRAM round trip) whatever
    // the ring depth, so a deeper ring bought nothing. pages[u] serves iterations j = u mod D;
    // the inner loop is unrolled so each slot stays a register and no value is moved (a move
    // would wait for the load just as a use does).
    int pages[kPageLookahead];
#pragma unroll
    for (int u = 0; u < kPageLookahead; ++u) pages[u] = lookup(kStages - 1 + u);
    for (int j0 = 0; j0 < n; j0 += kPageLookahead) {
#pragma unroll
      for (int u = 0; u < kPageLookahead; ++u) {
        const int j = j0 + u;
        if (j >= n) break;
        issue(j + kStages - 1, pages[u]);
        cp_async_commit();
        pages[u] = lookup(j + kStages - 1 + kPageLookahead);
        cp_async_wait<kStages - 1>();
        __syncwarp();
        compute(j, qa, m, l, o);
        __syncwarp();  // the next issue overwrites the stage just read
      }
    }
    cp_async_wait<0>();
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    __syncthreads();  // every warp is done with its ring: reuse it for the combine
    CombineBuffer<G> buf(smem);
    if (head < G) {
#pragma unroll
      for (int nd = 0; nd < 16; ++nd) {
        buf.acc(warp, head)[8 * nd + 2 * quad] = o[nd][0];
        buf.acc(warp, head)[8 * nd + 2 * quad + 1] = o[nd][1];
      }
      if (quad == 0) {
        buf.m(warp, head) = m;
        buf.l(warp, head) = l;
      }
    }
    __syncthreads();
  }
};

// The CTA's state of query head g at head-dim element t (m in the log2 domain): the warps'
// states rescaled to their common maximum.
struct CtaState {
  float m, l, acc;
};
template <int G>
__device__ __forceinline__ CtaState combine_warps(const CombineBuffer<G>& buf, int g, int t) {
  CtaState c{-CUDART_INF_F, 0.f, 0.f};
#pragma unroll
  for (int w = 0; w < kWarps; ++w) c.m = fmaxf(c.m, buf.m(w, g));
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float scale = exp2f(buf.m(w, g) - c.m);  // warps that saw no token have m = -inf
    c.l += scale * buf.l(w, g);
    c.acc += scale * buf.acc(w, g)[t];
  }
  return c;
}

// Combines the warps' states for head-dim element threadIdx.x and writes either the output row
// (single split) or the split's partial state (natural-log domain, as docs/architecture.md says).
template <typename T, int G>
__device__ void finish_split(const DecodeArgs& a, char* smem, int row, int kvh, bool direct, int slot) {
  CombineBuffer<G> buf(smem);
  const int t = threadIdx.x;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const CtaState c = combine_warps(buf, g, t);
    if (direct) {
      T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
      out[t] = Vec8<T>::from_float(c.acc / c.l);
    } else {
      a.part_acc[(static_cast<int64_t>(slot) * G + g) * kHeadDim + t] = c.acc;
      if (t == 0) {
        a.part_m[slot * G + g] = c.m * kLn2;
        a.part_l[slot * G + g] = c.l;
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

// Lets a dependent launch (the merge, launched with programmatic stream serialization) start
// its prologue while this grid drains; the merge waits for our writes in griddepcontrol.wait.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// Fused merge: publishes this split's state; the last split of the pair to arrive merges the
// pair in place and resets the counter, so the launch can be replayed from a CUDA graph.
template <typename T, int G>
__device__ void merge_if_last(const DecodeArgs& a, int32_t* counter, int slot_begin, int num_slots, int row,
                              int kvh, char* smem) {
  // The flag lives past merge_pair's scratch, in the ring, so the kernel declares no static
  // shared memory and keeps the ring's occupancy.
  int& is_last = reinterpret_cast<int*>(smem)[kPairMergeScratchFloats - 1];
  __threadfence();
  __syncthreads();  // also: every thread is done with the combine buffer that merge_pair reuses
  if (threadIdx.x == 0) {
    const int seen = atomicAdd(counter, 1);
    is_last = (seen == num_slots - 1);
    if (is_last) *counter = 0;  // every split of the pair has arrived
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_pair<T, G>(a, slot_begin, num_slots, row, kvh, reinterpret_cast<float*>(smem));
}

// The tile range [tile_begin, tile_end) of split `split` of a bucket launch's row: the row's
// tiles in num_splits equal, row-local ranges. Trailing splits of a short row own no tiles.
struct BucketSplit {
  int row, seq_len, tile_begin, tile_end;
  __device__ BucketSplit(const DecodeArgs& a, int row_, int split, int num_splits)
      : row(row_), seq_len(row_length(a, row_)) {
    const int n_tiles = static_cast<int>(row_tiles(seq_len));
    const int per_split = static_cast<int>(ceil_div(n_tiles, num_splits));
    tile_begin = split * per_split;
    tile_end = min(tile_begin + per_split, n_tiles);
  }
  __device__ bool empty() const { return tile_begin >= tile_end; }
  // Splits of the row that own tiles (of num_splits): the first ones, 0 .. live_splits() - 1.
  __device__ int live_splits(int num_splits) const {
    return static_cast<int>(nonempty_splits(row_tiles(seq_len), num_splits));
  }
};

template <typename T, int G, int Stages>
__global__ void __launch_bounds__(kThreads, decode_ctas_per_sm<Stages>())
    bucket_decode_kernel(DecodeArgs a, const int32_t* row_indices, int num_splits, int32_t* pair_counters,
                         bool live_splits_only) {
  extern __shared__ __align__(128) char smem[];
  {
    const BucketSplit b(a, row_indices[blockIdx.x], blockIdx.z, num_splits);
    if (!b.empty())  // row-local bounds leave a split empty: no Q load, no staging
      CtaDecoder<T, G, Stages>(a, b.row, blockIdx.y, b.seq_len, b.tile_begin, b.tile_end, smem).run(smem);
  }
  // What follows the decode is derived again from the grid indices and the row's (cached) index
  // and length instead of being held through the decode loop: at stages = 2 the kernel is at its
  // register cap, and values held through the loop spill there.
  const int r = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const BucketSplit b(a, row_indices[r], split, num_splits);
  const int pair = r * a.num_kv_heads + kvh;
  const int slot = pair * num_splits + split;
  // live_splits_only (fused merge only): a pair merges just the splits that own tiles, so an
  // empty split writes nothing and a pair with one live split writes `out` directly. Otherwise
  // every split of the grid holds a state (empty ones the neutral state) and all are merged.
  const bool fused = pair_counters != nullptr && num_splits > 1;
  const bool live_only = fused && live_splits_only;
  const int merged = live_only ? b.live_splits(num_splits) : num_splits;
  if (b.empty()) {
    if (!live_only) write_neutral<G>(a, slot);
  } else {
    finish_split<T, G>(a, smem, b.row, kvh, merged == 1, slot);
  }
  allow_dependent_launch();
  if (fused && merged > 1 && !(live_only && b.empty()))
    merge_if_last<T, G>(a, pair_counters + pair, pair * num_splits, merged, b.row, kvh, smem);
}

// A split's combined state kept in its own shared memory for the cluster merge: acc[g][d], then
// m[g] (log2 domain, as the combine buffer holds it) and l[g]. It sits past the combine buffer,
// which finish_split reads while the state is written.
template <int G>
struct SplitState {
  static constexpr int kOffsetFloats = (CombineBuffer<G>::kWarpsMax * G * (kHeadDim + 2) + 3) / 4 * 4;
  static constexpr int kFloats = G * (kHeadDim + 2);
  float* base;
  __device__ explicit SplitState(char* smem) : base(reinterpret_cast<float*>(smem) + kOffsetFloats) {}
  __device__ float* acc(int g) const { return base + g * kHeadDim; }
  __device__ float& m(int g) const { return base[G * kHeadDim + g]; }
  __device__ float& l(int g) const { return base[G * kHeadDim + G + g]; }
};
static_assert(SplitState<kMaxGroupSize>::kOffsetFloats + SplitState<kMaxGroupSize>::kFloats <=
                  decode_smem_bytes<2>() / 4,
              "the cluster merge keeps a split's state inside the decode ring");

// finish_split for the cluster merge: the CTA's state goes to its SplitState, not to global memory.
template <int G>
__device__ void keep_split_state(char* smem, bool empty) {
  CombineBuffer<G> buf(smem);
  SplitState<G> state(smem);
  const int t = threadIdx.x;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const CtaState c = empty ? CtaState{-CUDART_INF_F, 0.f, 0.f} : combine_warps(buf, g, t);  // empty: neutral
    state.acc(g)[t] = c.acc;
    if (t == 0) {
      state.m(g) = c.m;
      state.l(g) = c.l;
    }
  }
}

// Cluster barrier with release/acquire semantics: shared-memory writes before it are visible to
// every CTA of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// A float in the shared memory of cluster CTA `rank`, at the offset `local` has in ours.
__device__ __forceinline__ float load_cluster_shared(const float* local, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  float value;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote));
  return value;
#else
  return *local;
#endif
}

// Bucket route with the cluster merge (Hopper): grid (rows, Hkv, S) in clusters of (1, 1, S), so
// the S splits of one (row, KV head) are one cluster. Each split keeps its state in shared
// memory; after a cluster barrier, CTA r merges query heads r, r + S, ... by reading every split's
// state through distributed shared memory and writes the output rows. No partial state goes to
// global memory and no merge kernel follows: at B1 the separate merge's launch and round trip
// cost 2.2-2.7 us on the H200. A second barrier keeps each CTA's state alive until all have read it.
template <typename T, int G, int Stages>
__global__ void __launch_bounds__(kThreads, decode_ctas_per_sm<Stages>())
    bucket_cluster_decode_kernel(DecodeArgs a, const int32_t* row_indices, int num_splits) {
  extern __shared__ __align__(128) char smem[];
  {
    // An empty split (row-local bounds) loads no Q and stages nothing; its state is neutral.
    const BucketSplit b(a, row_indices[blockIdx.x], blockIdx.z, num_splits);
    if (!b.empty()) CtaDecoder<T, G, Stages>(a, b.row, blockIdx.y, b.seq_len, b.tile_begin, b.tile_end, smem).run(smem);
  }
  // Derived again after the decode, as in bucket_decode_kernel: not held through its loop.
  const int kvh = blockIdx.y, split = blockIdx.z;  // split is the CTA's cluster rank
  const BucketSplit b(a, row_indices[blockIdx.x], split, num_splits);
  const int row = b.row;
  keep_split_state<G>(smem, b.empty());
  cluster_sync();
  const SplitState<G> state(smem);
  const int t = threadIdx.x;
  for (int g = split; g < G; g += num_splits) {
    float m_of[kMaxClusterSplits];
    float m = -CUDART_INF_F;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      m_of[s] = s < num_splits ? load_cluster_shared(&state.m(g), s) : -CUDART_INF_F;
      m = fmaxf(m, m_of[s]);
    }
    float l = 0.f, acc = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s >= num_splits || m_of[s] == -CUDART_INF_F) continue;  // empty splits weigh 0
      const float w = exp2f(m_of[s] - m);
      l += w * load_cluster_shared(&state.l(g), s);
      acc += w * load_cluster_shared(state.acc(g) + t, s);
    }
    T* out = static_cast<T*>(a.out) + row * a.out_stride_row + (kvh * G + g) * a.out_stride_head;
    out[t] = Vec8<T>::from_float(acc / l);
  }
  cluster_sync();
}

template <typename T, int G, int Stages>
__global__ void __launch_bounds__(kThreads, decode_ctas_per_sm<Stages>())
    workqueue_decode_kernel(DecodeArgs a, const int32_t* tasks, const int32_t* split_offsets,
                            int32_t* pair_counters, const int32_t* live_tasks) {
  const int32_t* task = tasks + blockIdx.x * 5;
  // A plan made on the device launches a grid of its capacity; CTAs past its task count leave at
  // once. That grid starts while the planner runs (programmatic dependent launch) and waits here
  // for the plan to be complete and visible. The count and the CTA's task are then loaded together
  // rather than one after the other: a grid of the capacity has a task slot for every CTA (a CTA
  // past the count reads a slot it does not use), so every CTA starts one load latency sooner.
  int live = INT_MAX;
  if (live_tasks != nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    live = *live_tasks;
  }
  const int task_row = task[0], task_kvh = task[1], task_begin = task[3], task_end = task[4];
  if (static_cast<int>(blockIdx.x) >= live) return;
  extern __shared__ __align__(128) char smem[];
  CtaDecoder<T, G, Stages>(a, task_row, task_kvh, row_length(a, task_row), task_begin, task_end, smem).run(smem);
  // The task is read again (cached) after the decode instead of being held through its loop,
  // where at stages = 2 the kernel is at its register cap and held values spill.
  const int row = task[0], kvh = task[1], split = task[2];
  const int pair = row * a.num_kv_heads + kvh;
  const int slot_begin = split_offsets[pair];
  const int num_slots = split_offsets[pair + 1] - slot_begin;
  finish_split<T, G>(a, smem, row, kvh, num_slots == 1, slot_begin + split);
  allow_dependent_launch();
  if (pair_counters != nullptr && num_slots > 1)
    merge_if_last<T, G>(a, pair_counters + pair, slot_begin, num_slots, row, kvh, smem);
}

}  // namespace pkv
