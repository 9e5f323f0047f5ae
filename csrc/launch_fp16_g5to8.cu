// fp16 launchers for G = 5..8: one file per dtype and half of the group sizes, so the
// four compile in parallel.
#include "launch_impl.cuh"

namespace pkv {
PKV_INSTANTIATE_LAUNCHERS(__half, 5)
PKV_INSTANTIATE_LAUNCHERS(__half, 6)
PKV_INSTANTIATE_LAUNCHERS(__half, 7)
PKV_INSTANTIATE_LAUNCHERS(__half, 8)
}
