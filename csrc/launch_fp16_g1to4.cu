// fp16 launchers for G = 1..4: one file per dtype and half of the group sizes, so the
// four compile in parallel.
#include "launch_impl.cuh"

namespace pkv {
PKV_INSTANTIATE_LAUNCHERS(__half, 1)
PKV_INSTANTIATE_LAUNCHERS(__half, 2)
PKV_INSTANTIATE_LAUNCHERS(__half, 3)
PKV_INSTANTIATE_LAUNCHERS(__half, 4)
}
