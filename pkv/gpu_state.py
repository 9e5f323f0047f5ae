"""What a timed call finds on the GPU: the L2 cache's contents (``L2Flusher`` evicts them, as a
serving step finds its KV evicted by the rest of the model) and a GPU busy long enough for the
host to queue the call behind (``hold_device``). Timing (pkv.measure.timing) and the engines' own
probes (FlashInfer's choice of path) share them, so a probe times a kernel as the tables do."""

from __future__ import annotations

import torch

# Used when the device does not report its L2 size; larger than any current GPU's L2.
_FALLBACK_FLUSH_BYTES = 120 * 1024 * 1024


def is_cuda_device(device) -> bool:
    return torch.device(device).type == "cuda"


class L2Flusher:
    """Evicts the L2 cache between timed launches by streaming a buffer twice its size.

    Without it, back-to-back repetitions over the same pages read from L2 and report more
    bandwidth than a serving step (whose KV was evicted by the rest of the model) would see.
    ``mode="read"`` (the default) evicts with a reduction and leaves clean lines; ``"write"``
    fills the buffer, which leaves the L2 full of dirty lines that the timed call then writes
    back to HBM (about 15 us on an H200, most of a B1 8K decode). A no-op on the CPU.
    """

    MODES = ("read", "write")

    def __init__(self, device, bytes: int | None = None, mode: str = "read") -> None:  # noqa: A002
        if mode not in self.MODES:
            raise ValueError(f"L2Flusher mode must be one of {self.MODES}, got {mode!r}")
        self.device = torch.device(device)
        self.mode = mode
        self.buffer = None
        self.nbytes = 0
        if not is_cuda_device(self.device):
            return
        if bytes is None:
            props = torch.cuda.get_device_properties(self.device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 0)
            bytes = 2 * l2 if l2 > 0 else _FALLBACK_FLUSH_BYTES
        if bytes < 1:
            raise ValueError(f"L2Flusher bytes must be positive, got {bytes}")
        self.nbytes = int(bytes)
        self.buffer = torch.ones(self.nbytes // 2, dtype=torch.float16, device=self.device)

    def flush(self) -> None:
        if self.buffer is None:
            return
        if self.mode == "read":
            self.buffer.sum(dtype=torch.float32)
        else:
            self.buffer.fill_(1)

    __call__ = flush

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "mode": self.mode}


# A GPU-side spin queued before the start event, long enough (about half a millisecond at H200
# clocks) for the host to queue the timed call's launches behind it.
HEAD_START_CYCLES = 1_000_000


def hold_device(device, cycles: int = HEAD_START_CYCLES) -> None:
    """Keep the GPU busy while the host queues the next call, so that CUDA events around that
    call time its device work and not the host's issue latency. Without it, a call whose kernels
    take less time than Python takes to launch them reports the host's speed. No-op on the CPU."""
    if is_cuda_device(device):
        torch.cuda._sleep(int(cycles))
