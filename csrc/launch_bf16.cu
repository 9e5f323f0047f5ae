// bf16 instantiations (one file per dtype so the two compile in parallel).
#include "launch_impl.cuh"

namespace pkv {
PKV_INSTANTIATE_LAUNCHERS(__nv_bfloat16)
}
