// One decode step from a packed plan (step_plan.h's layout and metadata, already on the device):
// walks the plan and issues its decode and merge launches (pkv_launch.h) on one stream. Framework-
// free, like the launchers, so the planner, the launches and this executor stay apart and the torch
// binding only checks, allocates and dispatches.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "pkv_launch.h"
#include "step_plan.h"

namespace pkv {

// args: block_table and seq_lens point into the plan metadata; part_m, part_l and part_acc hold
// the plan's num_slots slots (bucket launch j's after launch j-1's). route_data is the metadata's
// route part. pair_counters (batch * Hkv, zero on entry and on exit) is read only with kFused.
//
// The caller checks the plan first, with messages naming the field (pkv_ops.cpp's run_plan). The
// executor still refuses a launch that would read past the layout, the scratch or the counters, or
// that its merge kind cannot run, with cudaErrorInvalidValue instead of a fault; launches before it
// have been issued. On an error *failed_launch, when given, names the launch that failed.
cudaError_t run_step_plan(const DecodeArgs& args, const int64_t* layout, int64_t layout_len,
                          const int32_t* route_data, MergeKind merge, int32_t* pair_counters, cudaStream_t stream,
                          const char** failed_launch = nullptr);

}  // namespace pkv
