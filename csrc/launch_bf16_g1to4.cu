// bf16 launchers for G = 1..4: one file per dtype and half of the group sizes, so the
// four compile in parallel.
#include "launch_impl.cuh"

namespace pkv {
PKV_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 1)
PKV_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 2)
PKV_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 3)
PKV_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 4)
}
