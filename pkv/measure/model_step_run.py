"""Time a model-shaped decode step per engine and mode over a serving trace (Table 9).

Every path (engine x mode) of a run sees the same steps, page tables, pools and inputs, as in
pkv.measure.harness. Per step: the step without attention is timed per mode (the rest of the step,
for attention's share; below); then each path, in an order balanced over steps
(pkv.measure.harness.engine_order), gets the L2 flush (untimed), the synchronized wall time of
its host plan plus the whole step, and, after another flush, the device time of the same planned
step queued behind a GPU-side hold (pkv.gpu_state.hold_device).

The step without attention depends on the batch size alone (its append writes one token per row
wherever the lengths put it), so each mode's rest is timed on the first ``REST_SAMPLES`` measured
steps of each batch size and their median stands for the later steps of that size. Timing it on
every step took a quarter of a job's step runs; no ratio between engines reads it, only
attention's share of the step and the floor of the step.

Checks: every step, each path's output against the baseline path's (the step's final hidden state,
a bound a few times the dtype's rounding over the layers). A disagreement does not say which side
is wrong, so on such a step every path, the baseline included, is held to the float64 reference
under the same bound, as in pkv.measure.harness: the step run with every layer's attention in
float64 (pkv.engines.dense; the paths differ only in their attention). A path under study
(its engine's Engine.under_study) that is wrong there stops the run, named with its relative
error; a baseline path that is wrong (the run's baseline, or another library's kernel) has the
step recorded in its metrics (``wrong_steps``, ``first_wrong_step``, its per-step record) and the
run goes on, the others held to the float64 reference instead of its output on that step. Every
``check_every`` measured steps the same float64 check runs on every path; in the same untimed
float64 pass, each eager engine's attention in every layer is held to float64 on the reference's
queries and pages (binding the paths under study; a baseline's is recorded), and each graph path
is checked against its own engine's eager output.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

from pkv.engines.base import upload_block_table
from pkv.engines.dense import dense_decode
from pkv.gpu_state import hold_device
from pkv.measure.accuracy import compare
from pkv.measure.harness import (
    REF_REL_LIMIT,
    CorrectnessError,
    Float64Checks,
    engine_order,
    float64_errors,
    is_studied,
    judge_against_float64,
    query_seed,
    step_where,
)
from pkv.measure.kernel_trace import (
    EXTERNAL_PROFILER,
    KERNEL_PROFILERS,
    KernelTally,
    KernelTraceUnavailable,
    attention_profile,
    trace_kernels,
    trace_range,
)
from pkv.measure.model_step import ModelStep
from pkv.measure.model_step_paths import EagerPath
from pkv.measure.nvtx_ranges import nvtx_range
from pkv.measure.timing import DeviceTimer, L2Flusher, WallTimer

# A path's final hidden state against the baseline's: the attention outputs differ by the dtype's
# rounding, and every later layer carries that difference on; four times the single-call bound
# leaves room for it and still catches a wrong page or length, which is an O(1) error.
STEP_REL_FACTOR = 4.0
PROGRESS_EVERY_S = 5.0
# Measured steps of one batch size whose rest of the step is timed (module docstring).
REST_SAMPLES = 3
# Where a job's seconds go, printed with its "done" line: untimed probes and graph captures, the
# rest-of-step timings, the paths' timed runs, the kernel traces (where asked for), the float64
# checks and agreement judgements.
PHASES = ("prepare", "rest", "paths", "profile", "checks")


@dataclass(frozen=True)
class ModelStepSpec:
    name: str
    seed: int
    warmup_steps: int
    measured_steps: int
    check_every: int
    beta_gbps: float  # the calibration's read bandwidth: the floor of the attention's KV read
    baseline: str  # the path every other path's output is checked against
    flush_l2: bool = True
    # The first this many measured steps are run once more per path and rest under the CUDA
    # profiler, untimed, for each path's kernels (pkv.measure.kernel_trace); 0: none.
    kernel_profile_steps: int = 0
    kernel_profiler: str = "torch"  # KERNEL_PROFILERS

    def __post_init__(self) -> None:
        if self.kernel_profiler not in KERNEL_PROFILERS:
            raise ValueError(f"ModelStepSpec.kernel_profiler must be one of {KERNEL_PROFILERS}, "
                             f"got {self.kernel_profiler!r}")


class _Record(Float64Checks):
    """One path's accumulation; its final hidden state against the float64 reference (sampled, and
    every step where a path disagreed with the baseline) is kept by Float64Checks."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = self.tokens = 0
        self.sums = dict.fromkeys(("wall_us", "cuda_us", "plan_us", "issue_us", "rest_us", "floor_us"), 0.0)
        self.kv_bytes = 0
        self.rel_vs_baseline = 0.0
        self.attention_ref_rel = None
        self.rel_vs_eager = None
        self.routes: dict = {}
        self.split_rules: dict = {}  # workqueue steps per split rule (StepRoute.split_rule)
        self.splits: Counter = Counter()  # PersistentKV steps per split count

    def add(self, step, route, position: int, split_rule: str | None = None, num_splits: int | None = None,
            **us) -> None:
        self.steps += 1
        self.tokens += step.batch_size
        for key in self.sums:
            self.sums[key] += us[key]
        self.routes[route] = self.routes.get(route, 0) + 1
        if split_rule is not None:
            self.split_rules[split_rule] = self.split_rules.get(split_rule, 0) + 1
        if num_splits is not None:
            self.splits[int(num_splits)] += 1
        self.per_step.append({"step": int(step.step), "batch": int(step.batch_size),
                              "max_len": int(max(step.seq_lens)), "route": route, "split_rule": split_rule,
                              "position": position, **{k: float(v) for k, v in us.items()},
                              "ref_rel_err": None, "wrong": False})

    def settle_rest(self, rest_by_batch: dict[int, float]) -> None:
        """Each step's rest of the step: its batch size's median (pkv.measure.model_step_run)."""
        for entry in self.per_step:
            entry["rest_us"] = float(rest_by_batch[entry["batch"]])
        self.sums["rest_us"] = sum(entry["rest_us"] for entry in self.per_step)

    def metrics(self, layers_run: int, layers_model: int, mode: str, implementation: str) -> dict:
        per = {k.replace("_us", ""): v / 1e3 / self.steps for k, v in self.sums.items()}
        attention = per["cuda"] - per["rest"]
        floor_step = per["rest"] + per["floor"]
        return {
            "mode": mode, "implementation": implementation, "layers_run": layers_run, "layers_model": layers_model,
            "steps": self.steps, "decode_tokens": self.tokens,
            "cuda_ms_per_step": per["cuda"], "wall_ms_per_step": per["wall"],
            "plan_ms_per_step": per["plan"], "issue_ms_per_step": per["issue"],
            # Host time of a step: its plan, then queueing the step until the last launch is in.
            "host_ms_per_step": per["plan"] + per["issue"],
            "cuda_tok_s": self.tokens / (self.sums["cuda_us"] / 1e6) if self.sums["cuda_us"] > 0 else math.inf,
            "wall_tok_s": self.tokens / (self.sums["wall_us"] / 1e6) if self.sums["wall_us"] > 0 else math.inf,
            # The same step with attention left out, in this mode: the rest of the model.
            "rest_cuda_ms_per_step": per["rest"],
            "attention_cuda_ms_per_step": attention,
            "attention_share": attention / per["cuda"] if per["cuda"] > 0 else None,
            # Attention at the read floor (KV bytes / beta) plus the rest: the fastest this step can be.
            "floor_attention_ms_per_step": per["floor"],
            "floor_step_ms_per_step": floor_step,
            "kv_mib_per_step": self.kv_bytes / self.steps / 2**20,
            # Against the baseline's final hidden state; on a step the baseline got wrong, against float64.
            "max_rel_err_vs_baseline": self.rel_vs_baseline,
            # The final hidden state against the float64 reference, over the steps checked.
            "ref_max_rel_err": self.ref_max_rel_err,
            # An eager path's attention against float64 in every layer, on the check_every-th steps.
            "attention_ref_max_rel_err": self.attention_ref_rel,
            "rel_err_vs_eager": self.rel_vs_eager,
            # Steps the float64 reference found this path wrong on (a baseline's; Table 9 takes no
            # ratio against a baseline with wrong measured steps), their largest relative error
            # (null: an output that was not finite) and where the first one was.
            **self.wrong_metrics(),
            "routes": dict(sorted(self.routes.items(), key=lambda kv: str(kv[0]))),
            "split_rules": dict(sorted(self.split_rules.items())),
            "selected_route": max(self.routes, key=self.routes.get) if self.routes else None,
            # The split count most of its PersistentKV steps ran (the trace harness's field).
            "num_splits": self.splits.most_common(1)[0][0] if self.splits else None,
            "per_step": self.per_step,
        }


def _float64_step(model: ModelStep, step, x, eager: dict | None = None):
    """Untimed: the step with every layer's attention in float64 (dense_decode, the trace harness's
    reference), the rest of the step as every path runs it: what each path's final hidden state is
    held to. ``eager`` (label -> EagerPath) also holds each eager engine's attention to the float64
    attention in every layer, on the reference's own queries and pages, in the same pass: returns
    (final hidden state, {label: largest relative error over the layers}). It runs after the paths,
    so its append is the last to write the step's token into the pools: the steps after one a path
    got wrong read none of that path's K and V."""
    tables, _ = upload_block_table(step, model.device)
    plans = {label: path.engine.plan(step) for label, path in (eager or {}).items()}
    worst = dict.fromkeys(plans, 0.0)

    def attend(layer, q):
        # pkv.measure.model_step.dense_attend's float64 attention, kept in float64 for the comparison.
        exact = dense_decode(q, model.k_pages[layer], model.v_pages[layer], step.seq_lens, step.block_table,
                             sm_scale=model.shape.attention.sm_scale)
        for label, plan in plans.items():
            got = eager[label].engine.run(q, model.k_pages[layer], model.v_pages[layer], plan)
            worst[label] = max(worst[label], compare(got, exact)["rel_err"])
        return exact.to(q.dtype)

    final = model.forward(x, tables["block_table"], tables["seq_lens"], attend).float()
    return final, worst


def _agreement(out, expected, bound: float) -> tuple[float, bool, str]:
    """The relative error of a final hidden state against ``expected`` (the baseline's, or the
    float64 reference's), whether it is below ``bound``, and both as text."""
    rel = compare(out, expected)["rel_err"]
    return rel, rel < bound, f"relative error {rel:.3e} of the final hidden state, bound {bound:.1e}"


def _time(path, step, x, flusher, device, measured: bool):
    """(output, plan_us, issue_us, wall_us, cuda_us) of one step on one path."""
    if flusher is not None:
        flusher.flush()
    with WallTimer(device) as wall:
        path.plan(step, x)
        planned = time.perf_counter()
        out = path.issue()
        issued = time.perf_counter()
    out = out.float().clone()  # a graph's output buffer is overwritten by its next replay
    cuda_us = math.nan
    if measured:
        if flusher is not None:
            flusher.flush()
        hold_device(device)
        with DeviceTimer(device) as timer:
            path.issue()
        cuda_us = timer.elapsed_us
    return out, (planned - wall.started) * 1e6, (issued - planned) * 1e6, wall.elapsed_us, cuda_us


def run_model_step(spec: ModelStepSpec, model: ModelStep, decoder, paths: dict, rests: dict, *,
                   layers_model: int, progress: bool = True) -> dict[str, dict]:
    """Metrics per path label. ``paths``: label -> path (pkv.measure.model_step_paths); ``rests``:
    mode -> the path that runs the step without attention in that mode."""
    if spec.baseline not in paths:
        raise ValueError(f"baseline path {spec.baseline!r} is not among {sorted(paths)}")
    device = model.device
    limit = REF_REL_LIMIT[model.dtype]
    flusher = L2Flusher(device) if spec.flush_l2 else None
    labels = list(paths)
    records = {label: _Record() for label in labels}
    rest_samples: dict[tuple[str, int], list[float]] = {}
    tallies = {label: KernelTally() for label in (*labels, *(_rest_label(mode) for mode in rests))}
    untraced = None  # why no kernel trace could be taken here
    spent = dict.fromkeys(PHASES, 0.0)
    started = last = time.perf_counter()
    index = -1
    for index, step in enumerate(decoder.steps()):
        measured_index = index - spec.warmup_steps
        measured = measured_index >= 0
        x = model.hidden_input(step.batch_size, query_seed(spec.seed, step.step))
        mark = time.perf_counter()
        for path in (*rests.values(), *paths.values()):
            path.prepare(step, x)  # untimed: probes, and a capture for a batch size not seen yet
        spent["prepare"] += time.perf_counter() - mark
        mark = time.perf_counter()
        _time_rest(rests, rest_samples, step, x, flusher, device, measured)
        spent["rest"] += time.perf_counter() - mark
        mark = time.perf_counter()
        kv_bytes = model.kv_bytes_read(step.seq_lens)
        floor_us = kv_bytes / (spec.beta_gbps * 1e3)
        outs = {}
        order = engine_order(labels, index)
        for position, label in enumerate(order):
            path = paths[label]
            outs[label], plan_us, issue_us, wall_us, cuda_us = _time(path, step, x, flusher, device, measured)
            if measured:
                records[label].add(step, path.route, position, path.split_rule, path.num_splits, plan_us=plan_us,
                                   issue_us=issue_us, wall_us=wall_us, cuda_us=cuda_us, rest_us=math.nan,
                                   floor_us=floor_us)
                records[label].kv_bytes += kv_bytes
        spent["paths"] += time.perf_counter() - mark
        mark = time.perf_counter()
        if measured and measured_index < spec.kernel_profile_steps and untraced is None:
            # Before the checks: their float64 pass must stay the last to append the step's token.
            if spec.kernel_profiler == EXTERNAL_PROFILER:
                _mark_step(rests, paths, order, step, x, device)
            else:
                untraced = _trace_step(rests, paths, order, step, x, tallies, device)
        spent["profile"] += time.perf_counter() - mark
        mark = time.perf_counter()
        check = measured and measured_index % spec.check_every == 0
        reference = _check(spec, model, step, x, paths, outs, records, limit) if check else None
        _judge(spec, model, step, x, paths, outs, records, STEP_REL_FACTOR * limit, measured, reference)
        now = time.perf_counter()
        spent["checks"] += now - mark
        if progress and now - last >= PROGRESS_EVERY_S:
            print(f"[{spec.name} model step] step {index + 1} elapsed {now - started:.1f}s", file=sys.stderr, flush=True)
            last = now
    if records[spec.baseline].steps == 0:
        raise ValueError(f"trace {spec.name!r} has {index + 1} decode steps, none after the "
                         f"{spec.warmup_steps} warmup steps")
    for label, path in paths.items():
        records[label].settle_rest({batch: statistics.median(times) for (mode, batch), times in rest_samples.items()
                                    if mode == path.mode and times})
    if progress:
        # The "done" line pkv.dag_timing reads a job's measured loop from, with where its time went.
        phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in spent.items())
        print(f"[{spec.name} model step] done: {index + 1} steps in {time.perf_counter() - started:.1f}s "
              f"({phases})", file=sys.stderr, flush=True)
    metrics = {label: records[label].metrics(model.layers, layers_model, paths[label].mode,
                                             paths[label].implementation) for label in labels}
    if spec.kernel_profile_steps:
        for label, path in paths.items():
            if spec.kernel_profiler == EXTERNAL_PROFILER:
                metrics[label]["kernel_profile"] = {
                    "skipped": f"traced by a profiler around the run, in NVTX ranges {trace_range(label)} and "
                               f"{trace_range(_rest_label(path.mode))} (domain pkv)"}
            else:
                metrics[label]["kernel_profile"] = (
                    {"skipped": f"not available: {untraced}"} if untraced is not None
                    else attention_profile(tallies[label], tallies.get(_rest_label(path.mode))))
    return metrics


def _rest_label(mode: str) -> str:
    return f"rest_{mode}"


def _profiled_runs(rests: dict, paths: dict, order: list) -> list:
    """(label, path) of every rest and path a profiled step runs once more: the rests first, then
    the paths in the step's timed ``order``. Each run appends the step's token to the KV pages from
    its own layers, which differ from another path's in the last bits; where no check follows, the
    step's last path leaves the pages the next step reads, so a profiled step ends with the same
    path as the timed pass and leaves them as an unprofiled run does."""
    return [(_rest_label(mode), rest) for mode, rest in rests.items()] + [(label, paths[label]) for label in order]


def _mark_step(rests: dict, paths: dict, order: list, step, x, device) -> None:
    """One more untimed run of the step on every rest and path, each in its NVTX range and
    synchronized, for a profiler started around the run to filter on."""
    for label, path in _profiled_runs(rests, paths, order):
        path.plan(step, x)
        with nvtx_range(trace_range(label)):
            path.issue()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)


def _trace_step(rests: dict, paths: dict, order: list, step, x, tallies: dict, device) -> str | None:
    """One more untimed run of the step on every rest and path under the CUDA profiler, into
    ``tallies``; why not, where this device has no kernel trace (None when traced)."""
    for label, path in _profiled_runs(rests, paths, order):
        path.plan(step, x)
        try:
            spans = trace_kernels(path.issue, device)
        except KernelTraceUnavailable as exc:
            return str(exc)
        tallies[label].add(spans)
    return None


def _time_rest(rests: dict, samples: dict, step, x, flusher, device, measured: bool) -> None:
    """Per mode, the device time of the step without attention, into ``samples[(mode, batch)]``
    while that batch size has fewer than REST_SAMPLES (module docstring)."""
    for mode, rest in rests.items():
        taken = samples.setdefault((mode, step.batch_size), [])
        if measured and len(taken) < REST_SAMPLES:
            taken.append(_time(rest, step, x, flusher, device, measured)[4])


def _judge(spec, model, step, x, paths, outs, records, bound: float, measured: bool, reference=None) -> None:
    """Every path's final hidden state against the baseline's; where one disagrees, and on the
    check_every-th measured steps (``reference``: _check's float64 step), every path's against the
    float64 reference (the trace harness's rule and its bookkeeping: pkv.measure.harness)."""
    check = reference is not None
    baseline = spec.baseline
    agreement = {label: _agreement(outs[label], outs[baseline], bound) for label in paths if label != baseline}
    disagreeing = {label: text for label, (_, within, text) in agreement.items() if not within}
    rels, wrong = {}, set()
    if disagreeing or check:
        if reference is None:
            reference, _ = _float64_step(model, step, x)
        try:
            rels, wrong = judge_against_float64(step, outs, reference, paths, baseline, records, bound,
                                                 model.dtype, measured, disagreeing)
        except CorrectnessError as exc:
            raise CorrectnessError(f"model step: {exc}") from None
    for label, (rel, within, text) in agreement.items():
        if label in wrong:
            continue  # a baseline's wrong step, recorded as such; it agrees with nothing
        against = f"baseline {baseline!r}"
        if baseline in wrong:
            # The baseline's output is wrong on this step: the others are held to the float64
            # reference instead, under the same bound, and their errors are taken against it.
            rel, within, text = _agreement(outs[label], reference, bound)
            against = f"the float64 reference (baseline {baseline!r} is wrong at this step)"
        if not within and is_studied(label, paths[label], baseline):
            # Not wrong against float64, yet outside the bound against what it is held to.
            also = f"; float64 relative errors of the step: {float64_errors(rels, baseline, bound)}" if rels else ""
            raise CorrectnessError(f"model step: path {label!r} disagrees with {against} at {step_where(step)}: "
                                   f"{text}{also}")
        # Another library's path is judged by the float64 reference alone (above): outside the bound
        # against a right baseline but within it against float64 is rounding.
        records[label].rel_vs_baseline = max(records[label].rel_vs_baseline, rel)


def _check(spec, model, step, x, paths, outs, records, limit):
    """The check_every-th step's float64 pass: every eager engine's attention in every layer held to
    float64 (binding the paths under study; a baseline's is recorded), each graph path against its
    own engine's eager output. Returns the float64 step's final hidden state for _judge."""
    eager = {label: path for label, path in paths.items() if isinstance(path, EagerPath)}
    reference, attention_rels = _float64_step(model, step, x, eager)
    for label, rel in attention_rels.items():
        if not rel < limit and is_studied(label, paths[label], spec.baseline):
            raise CorrectnessError(f"model step: path {label!r} at {step_where(step)}: attention relative "
                                   f"error {rel:.3e} against float64 exceeds {limit:.0e} for {model.dtype}")
        # A baseline's attention error is recorded; whether its step was wrong is the float64
        # check of its final hidden state, which the ratios of its timings rest on.
        records[label].attention_ref_rel = max(records[label].attention_ref_rel or 0.0, rel)
    for label in paths.keys() - eager.keys():
        own_eager = label.rsplit("_", 1)[0] + "_eager"
        if own_eager in outs:
            rel = compare(outs[label], outs[own_eager])["rel_err"]
            records[label].rel_vs_eager = max(records[label].rel_vs_eager or 0.0, rel)
    return reference
