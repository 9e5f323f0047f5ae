// Compile-time shape constants shared by the kernels, their launchers and the host planner.
// No CUDA headers here: the planner is also built for machines without a CUDA toolkit.
#pragma once

namespace pkv {

constexpr int kHeadDim = 128;
constexpr int kTileTokens = 32;
// Most splits one (row, KV head) may have: the merge keeps a weight per split in shared memory.
constexpr int kMaxMergeSlots = 1024;
// Most splits a cluster-merged bucket launch may have: its splits of one (row, KV head) form one
// thread-block cluster, and 16 is the largest cluster Hopper allows (8 without the opt-in).
constexpr int kMaxClusterSplits = 16;
// Most query heads per KV head (G): the G heads are the rows of one m16 tensor-core tile, and the
// merge keeps G weights per split in shared memory. Every G from 1 to 8 is instantiated.
constexpr int kMaxGroupSize = 8;

}  // namespace pkv
