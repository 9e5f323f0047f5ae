"""Device timing (CUDA events, median of many) and synchronized wall time (paper 3.9)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

# The L2 eviction, the GPU-side hold and the queued repetitions live in pkv.gpu_state, where
# FlashInfer's path probe uses them too; the timers here use them, and callers that pass a flusher
# to them take L2Flusher from this module as before.
from pkv.gpu_state import HEAD_START_CYCLES, CudaQueue, L2Flusher, QueuedReps
from pkv.gpu_state import is_cuda_device as _is_cuda


def synchronize(device) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


@dataclass(frozen=True)
class TimingStats:
    median_us: float
    mean_us: float
    p10_us: float
    p90_us: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def _percentile(sorted_values: list[float], fraction: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    position = fraction * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize_us(samples: list[float]) -> TimingStats:
    if not samples:
        raise ValueError("no timing samples")
    ordered = sorted(samples)
    return TimingStats(
        median_us=statistics.median(ordered),
        mean_us=statistics.fmean(ordered),
        p10_us=_percentile(ordered, 0.10),
        p90_us=_percentile(ordered, 0.90),
        n=len(ordered),
    )


# How time_device_us gives the host its lead on CUDA (QueuedReps): "queued" holds the device only
# where a repetition needs it; "every" holds it HEAD_START_CYCLES before every repetition, as all
# timings did before (pkv.measure.timing_ab times one against the other).
HOLDS = ("queued", "every")


def time_device_us(fn, *, reps: int = 30, warmup: int = 5, flusher: L2Flusher | None = None,
                   device=None, hold: str = "queued") -> TimingStats:
    """Time ``fn()`` ``reps`` times: CUDA events around each call on CUDA, perf_counter on CPU.

    The L2 flush runs before each repetition, outside the events. On CUDA every timed repetition
    is queued while the device is still busy with earlier work (``QueuedReps``, ``hold`` of
    HOLDS), so the events time the queued device work and never the host's issue latency.
    ``device`` defaults to CUDA when available and the flusher's device otherwise.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if hold not in HOLDS:
        raise ValueError(f"hold must be one of {HOLDS}, got {hold!r}")
    if device is None:
        device = flusher.device if flusher is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if _is_cuda(device):
        every = hold == "every"
        samples = QueuedReps(CudaQueue(device), hold_every=every,
                             hold_cycles=HEAD_START_CYCLES if every else None).time(fn, reps, flusher)
    else:
        for _ in range(reps):
            if flusher is not None:
                flusher.flush()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return summarize_us(samples)


def rotated(names: list, turn: int) -> list:
    """``names`` in the order of turn ``turn`` of a rotation: the first name moves on by one each
    turn, so over a run every name takes every place equally often and a drift of clocks or
    temperature falls on all of them alike. (The serving harness balances which engine runs right
    before which as well, pkv.measure.harness.engine_order; a timing of device or host time alone
    needs only the places.)"""
    start = turn % len(names)
    return names[start:] + names[:start]


def time_interleaved_us(fns, *, rounds: int = 5, reps: int = 10, flusher: L2Flusher | None = None,
                        device=None) -> dict[str, list[float]]:
    """{name: per-round median us} of several callables timed in turns by ``time_device_us``.

    Each round times every callable once (``reps`` repetitions), in an order that rotates from
    round to round, so a drift of clocks or temperature falls on all of them alike; ratios are
    then taken round by round. A benchmark that picks the fastest of many configurations re-times
    the winners this way: the sweep's minimum is biased low by its own noise, these are not.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            medians[name].append(time_device_us(fns[name], reps=reps, warmup=1, flusher=flusher,
                                                device=device).median_us)
    return medians


def time_host_us(fn, *, reps: int, device="cuda") -> float:
    """Median host time to return from ``fn`` (its launches queued, not finished), with the
    device idle before each call: what a serving engine's step pays on the CPU."""
    samples = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    synchronize(device)
    return statistics.median(samples)


def time_wall_us(fn, *, reps: int, device="cuda") -> float:
    """Median synchronized wall time of ``fn`` (WallTimer around each call)."""
    samples = []
    for _ in range(reps):
        with WallTimer(device) as wall:
            fn()
        samples.append(wall.elapsed_us)
    return statistics.median(samples)


class WallTimer:
    """Synchronized host wall time of a block: sync, start, block, sync, stop.

    ``with WallTimer(device) as timer: ...`` then ``timer.elapsed_us``. Both syncs matter: the
    first keeps earlier queued work out of the block, the second keeps the block's own queued
    work in it.
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.elapsed_us = float("nan")
        self.started = 0.0  # perf_counter() at the start of the block, after the first sync

    def __enter__(self) -> "WallTimer":
        synchronize(self.device)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed_us = (time.perf_counter() - self.started) * 1e6


class DeviceTimer:
    """Device time of the work queued inside a block (CUDA events; perf_counter on CPU).

    ``elapsed_us`` is only valid after the device has been synchronized (WallTimer's exit
    does that when the two are nested).
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._cuda = _is_cuda(self.device)
        self._start = self._end = None
        self._t0 = self._t1 = 0.0

    def __enter__(self) -> "DeviceTimer":
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    @property
    def elapsed_us(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) * 1e3
        return (self._t1 - self._t0) * 1e6
