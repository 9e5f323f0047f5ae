// A row's length as every planner and kernel counts it, and the fixed split rule: one definition
// for the host planner (step_plan.cpp), the device planner (device_plan.cu) and the decode kernels
// (split_decode.cuh). Formulas follow pkv/pipeline/schedule.py. No CUDA headers: the host planner
// is also built without a CUDA toolkit (constexpr functions run on the device under
// --expt-relaxed-constexpr).
#pragma once
#include <cstdint>

#include "decode_constants.h"

namespace pkv {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

// Tiles of KV work of a row of this many tokens.
constexpr int64_t row_tiles(int64_t seq_len) { return ceil_div(seq_len, kTileTokens); }

// Of a row's `requested` splits, those that own a tile: ceil(n / ceil(n / S)), the first ones
// (the trailing splits of a short row are empty). 0 for a row without tiles.
constexpr int64_t nonempty_splits(int64_t n_tiles, int64_t requested) {
  return ceil_div(n_tiles, ceil_div(n_tiles, requested > 1 ? requested : 1));
}

// A row's seq_len clamped to the tokens its page-table entries address (`limit`), so a length
// past its pages never reads or attends past them. Valid input is unchanged.
constexpr int clamped_length(int64_t seq_len, int64_t limit) {
  return static_cast<int>(seq_len <= 0 || limit <= 0 ? 0 : (seq_len < limit ? seq_len : limit));
}

}  // namespace pkv
