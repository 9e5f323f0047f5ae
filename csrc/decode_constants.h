// Compile-time shape constants shared by the kernels, their launchers and the host planner.
// No CUDA headers here: the planner is also built for machines without a CUDA toolkit.
#pragma once

namespace pkv {

constexpr int kHeadDim = 128;
constexpr int kTileTokens = 32;
// Most splits one (row, KV head) may have: the merge keeps a weight per split in shared memory.
constexpr int kMaxMergeSlots = 1024;

}  // namespace pkv
