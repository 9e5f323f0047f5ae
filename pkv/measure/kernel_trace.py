"""Which kernels one call runs on the device, and for how long, kernel by kernel.

A step's device time (CUDA events around it) says how long the step took, not where the time went:
inside a graphed model step, attention is the step less the step with attention left out, which
folds attention's kernels, their launch gaps and their effect on their neighbours into one number.
Here the CUDA profiler (CUPTI, through ``torch.profiler``) records every kernel the call ran, a
graph replay's kernels included, with its start and end on the device. ``KernelTally`` sums such
traces over steps: per kernel name its time and count, the step's span on the device (first
kernel's start to the last one's end), the time some kernel was running (``busy``) and the rest of
the span, where the device had no kernel of the step (launch gaps and dependency waits), and the
gap between each two consecutive kernels by their names.

A path's attention kernels are the kernels of its step whose names the step without attention
(its mode's rest) does not run: ``attention_profile`` splits a path's tally that way, with the
gaps next to an attention kernel (before it, or after it up to the next kernel) as attention's.

Profiling adds its own host work around the call, so these traces are taken on extra untimed runs
of steps that were timed without it; device-side kernel times are what CUPTI measured on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Who traces a model step's profiled steps: the CUDA profiler inside the run (trace_kernels), or a
# profiler started around the run (ncu, nsys), which shares no process with torch's and filters on
# each run's NVTX range instead (trace_range).
EXTERNAL_PROFILER = "external"
KERNEL_PROFILERS = ("torch", EXTERNAL_PROFILER)


def trace_range(label: str) -> str:
    """The NVTX range (domain pkv) a profiled step's run of path or rest ``label`` sits in when a
    profiler around the run traces it."""
    return f"trace_{label}"


class KernelTraceUnavailable(RuntimeError):
    """This device or build has no kernel trace (not a CUDA device, or no CUPTI)."""


@dataclass(frozen=True)
class KernelSpan:
    """One kernel (or device copy) of a traced call: its name and device start and end, us."""

    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def trace_kernels(fn: Callable[[], object], device) -> list[KernelSpan]:
    """The device work ``fn`` runs on ``device``, in start order. KernelTraceUnavailable where the
    device is not a CUDA device or the profiler recorded no device activity for a call that ran."""
    import torch  # here, not at import: the reports read this module's records and labels without torch

    device = torch.device(device)
    if device.type != "cuda":
        raise KernelTraceUnavailable(f"no kernel trace on a {device.type} device")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    spans = [KernelSpan(event.name, float(event.time_range.start), float(event.time_range.end))
             for event in prof.events() if event.device_type == DeviceType.CUDA]
    if not spans:
        raise KernelTraceUnavailable("the CUDA profiler recorded no device activity (CUPTI unavailable?)")
    return sorted(spans, key=lambda span: (span.start_us, span.end_us))


# Joins a kernel's name to the attention kernel that ran right before it, in other_kernels_extra's labels.
AFTER_ATTENTION = " after "


@dataclass
class KernelTally:
    """Kernel traces of one path over steps: each traced step's kernels in start order, from which
    every sum is taken. A path's steps and its rest's, traced on the same steps in the same order,
    line up kernel by kernel once attention's are taken out."""

    sequences: list = field(default_factory=list)

    def add(self, spans: list[KernelSpan]) -> None:
        if not spans:
            raise ValueError("KernelTally.add: a traced step has at least one kernel")
        self.sequences.append(sorted(spans, key=lambda s: (s.start_us, s.end_us)))

    @property
    def steps(self) -> int:
        return len(self.sequences)

    @property
    def kernels(self) -> dict:
        """name -> [total us, count] over the steps."""
        kernels: dict = {}
        for span in (span for ordered in self.sequences for span in ordered):
            entry = kernels.setdefault(span.name, [0.0, 0])
            entry[0] += span.duration_us
            entry[1] += 1
        return kernels

    def _span_and_gaps(self) -> tuple[float, dict]:
        """The steps' summed span (first start to last end) and (previous kernel, next kernel) ->
        total idle us between them."""
        span_us, gaps = 0.0, {}
        for ordered in self.sequences:
            reach = ordered[0].end_us
            for before, after in zip(ordered, ordered[1:]):
                # Idle time only: a kernel that starts before the ones so far have ended (a graph's
                # branches, a programmatic launch's prologue) leaves none.
                key = (before.name, after.name)
                gaps[key] = gaps.get(key, 0.0) + max(after.start_us - reach, 0.0)
                reach = max(reach, after.end_us)
            span_us += reach - ordered[0].start_us
        return span_us, gaps

    def record(self) -> dict:
        """Per step: the span, the busy time, the idle rest of the span, and each kernel's time and
        count (most time first)."""
        steps = max(self.steps, 1)
        kernels = sorted(self.kernels.items(), key=lambda kv: -kv[1][0])
        span_us, gaps = self._span_and_gaps()
        idle = sum(gaps.values())  # the span less the union of the kernels
        return {"steps": self.steps, "span_us_per_step": span_us / steps,
                "busy_us_per_step": (span_us - idle) / steps,
                "idle_us_per_step": idle / steps,
                "kernels": {name: {"us_per_step": us / steps, "count_per_step": count / steps}
                            for name, (us, count) in kernels},
                "gaps": [{"previous": a, "next": b, "us_per_step": us / steps}
                         for (a, b), us in sorted(gaps.items(), key=lambda kv: -kv[1])]}


def attention_profile(path: KernelTally, rest: KernelTally | None) -> dict:
    """A path's tally as a record, with its attention kernels (names its mode's rest does not run)
    marked and summed, and the span it adds to the rest's: attention's kernels plus the gaps
    around them, the number the step-less-rest device time estimates."""
    record = path.record()
    rest_names = set(rest.kernels) if rest is not None else set()
    attention_us = 0.0
    for name, entry in record["kernels"].items():
        entry["attention"] = name not in rest_names
        if entry["attention"]:
            attention_us += entry["us_per_step"]
    record["attention_kernel_us_per_step"] = attention_us
    # Idle time next to attention's kernels: the launch gaps and waits attention brings into the step.
    record["attention_gap_us_per_step"] = sum(gap["us_per_step"] for gap in record["gaps"]
                                              if gap["previous"] not in rest_names or gap["next"] not in rest_names)
    if rest is not None and rest.steps:
        rest_record = rest.record()
        record["rest_span_us_per_step"] = rest_record["span_us_per_step"]
        record["rest_idle_us_per_step"] = rest_record["idle_us_per_step"]
        record["attention_span_us_per_step"] = record["span_us_per_step"] - rest_record["span_us_per_step"]
        # The span attention adds is its kernels, its gaps and what it does to the other kernels
        # (L2 state, clocks and overlap change with what ran before them): each other kernel's
        # time in this path less its time in the rest, largest difference first.
        others = _aligned_extra(path, rest, rest_names)
        record["other_kernels_aligned"] = others is not None
        if others is None:  # the steps do not line up: by name, over the step
            rest_us = {name: entry["us_per_step"] for name, entry in rest_record["kernels"].items()}
            others = {name: entry["us_per_step"] - rest_us.get(name, 0.0)
                      for name, entry in record["kernels"].items() if not entry["attention"]}
            others.update({name: -us for name, us in rest_us.items() if name not in record["kernels"]})
        record["other_kernels_extra_us_per_step"] = sum(others.values())
        record["other_kernels_extra"] = dict(sorted(others.items(), key=lambda kv: -abs(kv[1])))
    return record


def _aligned_extra(path: KernelTally, rest: KernelTally, rest_names: set) -> dict | None:
    """Per step, the path's kernels other than attention's against the rest's kernels of the same
    step, one to one in order: each one's time less its counterpart's, per step, summed by name,
    with " after <kernel>" where an attention kernel ran right before it (the GEMM that reads
    attention's output is told apart from the step's other launches of the same GEMM). None where
    the two did not trace the same steps or a step's kernels do not line up by name."""
    if len(path.sequences) != len(rest.sequences) or not path.sequences:
        return None
    extra: dict[str, float] = {}
    for mine, theirs in zip(path.sequences, rest.sequences):
        kept = [(span, before) for before, span in zip([None, *mine[:-1]], mine) if span.name in rest_names]
        if len(kept) != len(theirs) or any(span.name != base.name for (span, _), base in zip(kept, theirs)):
            return None
        for (span, before), base in zip(kept, theirs):
            after_attention = before is not None and before.name not in rest_names
            label = f"{span.name}{AFTER_ATTENTION}{before.name}" if after_attention else span.name
            extra[label] = extra.get(label, 0.0) + span.duration_us - base.duration_us
    return {label: us / len(path.sequences) for label, us in extra.items()}
