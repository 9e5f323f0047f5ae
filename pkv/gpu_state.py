"""What a timed call finds on the GPU: the L2 cache's contents (``L2Flusher`` evicts them, as a
serving step finds its KV evicted by the rest of the model) and a GPU busy long enough for the
host to queue the call behind (``hold_device``; ``QueuedReps`` keeps only repetitions the host
queued ahead of the device). Timing (pkv.measure.timing) and the engines' own probes (FlashInfer's
choice of path) share them, so a probe times a kernel as the tables do."""

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


class CudaQueue:
    """The three device operations QueuedReps needs, on the current CUDA stream."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def hold(self, cycles: int) -> None:
        hold_device(self.device, cycles)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class QueuedReps:
    """Event-timed repetitions of a call, each queued before the device reaches it.

    A repetition is clean when its start event had not yet been reached by the device when the
    host finished queueing its end event: then every launch of the call was waiting in the queue
    and the events time device work alone. Only clean repetitions are kept; a caught one (the
    device drained the queue while the host was still issuing) is timed again.

    A GPU-side hold (``hold_device``) gives the host its lead. One hold at the start is enough
    while the call's device time exceeds its issue time, because the host then stays ahead; a
    call the device runs faster than the host issues it gets a hold before every repetition (as
    every repetition once had, at HEAD_START_CYCLES each: half a millisecond, most of a
    calibration's time). A held repetition that is still caught doubles the hold. Nothing carries
    over from one call of ``time`` to the next.
    """

    FIRST_HOLD_CYCLES = HEAD_START_CYCLES // 4
    MAX_HOLD_CYCLES = HEAD_START_CYCLES * 32
    MAX_ROUNDS = 8

    def __init__(self, queue, *, hold_every: bool = False, hold_cycles: int | None = None) -> None:
        self.queue = queue
        self.hold_cycles = int(hold_cycles or self.FIRST_HOLD_CYCLES)
        self.hold_every = hold_every  # set when the device outruns the host on this call
        self.caught = 0          # repetitions dropped and timed again

    def time(self, fn, reps: int, flusher=None) -> list[float]:
        samples: list[float] = []
        for _ in range(self.MAX_ROUNDS):
            samples += self._round(fn, reps - len(samples), flusher)
            if len(samples) >= reps:
                return samples[:reps]
        raise RuntimeError(f"QueuedReps: {self.caught} repetitions were caught by the device in "
                           f"{self.MAX_ROUNDS} rounds; the host could not queue the call ahead of the "
                           f"device even behind a {self.hold_cycles}-cycle hold")

    def _round(self, fn, count: int, flusher) -> list[float]:
        queued = []
        self.queue.synchronize()
        hold_next = True
        for _ in range(count):
            if flusher is not None:
                flusher.flush()
            held = hold_next or self.hold_every
            if held:
                self.queue.hold(self.hold_cycles)
            start, end = self.queue.event(), self.queue.event()
            start.record()
            fn()
            end.record()
            clean = not start.query()
            queued.append((start, end, clean))
            hold_next = not clean
            if clean:
                continue
            self.caught += 1
            if held:
                self.hold_cycles = min(2 * self.hold_cycles, self.MAX_HOLD_CYCLES)
            else:
                self.hold_every = True
        self.queue.synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end, clean in queued if clean]
