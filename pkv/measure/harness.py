"""The serving-trace harness (paper 3.6, 3.9): every engine, every decode step, one pass.

All engines of a run see the same page assignment, the same K,V tensors (allocated once, sized
by the assignment) and the same queries. Per step and engine, in an order that puts every engine
in every place and right after every other equally often over steps (``engine_order``): the L2
flush (untimed), then synchronized wall time of plan + run (+ the MLP tail); then, after another
flush, the device time of a second run of the same plan, queued behind a GPU-side hold
(pkv.gpu_state.hold_device) so the events time device work and not the host's launch latency.
Each engine's output is checked against the baseline engine's before the step counts (fp32
compare, the paper's bounds); every ``check_every`` measured steps all engines are also
compared with the float64 dense reference.

A disagreement with the baseline does not say which side is wrong: on such a step every engine,
the baseline included, is checked against the float64 reference. An engine under study
(Engine.under_study) that is wrong there stops the run, named with its relative error; a
baseline that is wrong (the baseline engine, or another library's kernel run beside it) has the
step recorded in its metrics (``wrong_steps``, ``first_wrong_step``, its per-step record) and the
run goes on, the others held to the float64 reference instead of its output on that step. The
periodic float64 check follows the same rule.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from pkv.engines.dense import dense_decode
from pkv.gpu_state import hold_device
from pkv.measure.accuracy import PAPER_MAX_ABS, PAPER_MEAN_ABS, AccuracyError, check_within, compare
from pkv.measure.kv_data import make_kv_pages, make_queries, resolve_dtype
from pkv.measure.mlp_tail import GatedMLPTail
from pkv.measure.nvtx_ranges import nvtx_range, validate_range_name
from pkv.measure.timing import DeviceTimer, L2Flusher, WallTimer
from pkv.pipeline import counters
from pkv.pipeline.serving import ContinuousDecoder, page_layout
from pkv.policy.route import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH

# Relative error against float64 above which an engine (or the baseline itself) is wrong
# rather than merely rounded: a few ulps of the output dtype.
REF_REL_LIMIT = {
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
    torch.float32: 1e-4,
    torch.float64: 1e-9,
}
PROGRESS_EVERY_S = 5.0


class CorrectnessError(AccuracyError):
    """An engine disagreed with the baseline or the float64 reference during a trace run."""


@dataclass(frozen=True)
class TraceRunSpec:
    name: str
    family: str
    seed: int
    requests: tuple
    page_size: int = 16
    hole_fraction: float = 0.0
    # pkv.pipeline.kv_pool.PAGE_LAYOUTS; kv_pool_pages None sizes the recycled pool to the run's peak
    page_layout: str = "recycled"
    page_order: str = "shuffled"  # pkv.pipeline.pages.PAGE_ORDERS
    kv_pool_pages: int | None = None
    max_active: int = 8
    warmup_steps: int = 4
    measured_steps: int = 64
    dtype: str = "float16"
    device: str = "cuda"
    check_every: int = 16
    mlp_tail: bool = False
    flush_l2: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TraceRunSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.requests, tuple) or not self.requests:
            raise ValueError(f"TraceRunSpec.requests must be a non-empty tuple, got {type(self.requests)}")
        for field_name, low in (("page_size", 1), ("max_active", 1), ("warmup_steps", 0),
                                ("measured_steps", 1), ("check_every", 1), ("seed", 0)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"TraceRunSpec.{field_name} must be an int >= {low}, got {value!r}")
        if not 0.0 <= float(self.hole_fraction) < 1.0:
            raise ValueError(f"TraceRunSpec.hole_fraction must be in [0, 1), got {self.hole_fraction!r}")
        try:
            resolve_dtype(self.dtype)
        except ValueError as exc:
            raise ValueError(f"TraceRunSpec.dtype: {exc}") from None


def query_seed(seed: int, step: int) -> int:
    """Fresh, reproducible queries per step."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0])


def engine_order(names: list[str], index: int) -> list[str]:
    """The order the engines of step ``index`` run in, from a Williams design over ``names``.

    Rotating one order puts every engine in every place equally often but keeps the cyclic
    order, so each engine runs right after the same one on most steps; an engine that plans
    right after another engine's plan through the same library (the adaptive route's FlashInfer
    fallback, then FlashInfer itself) finds that code and its data warm on the host, which was
    worth about 70 us of a 480 us FlashInfer plan on an H100's host. The design's rows (n of
    them for an even count n, those and their reverses for an odd one) put every engine in
    every place, and right after every other engine, equally often; step ``index`` takes row
    ``index`` modulo their count."""
    count = len(names)
    if count == 0:
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...: the first row of the design
    low, high = 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    rows = [[(slot + shift) % count for slot in first] for shift in range(count)]
    if count % 2:
        rows += [row[::-1] for row in rows]
    return [names[slot] for slot in rows[index % len(rows)]]


def default_num_sms(device) -> int:
    """SMs for the structural counters; on the CPU profile one core plays the role of an SM."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return os.cpu_count() or 1


def step_counters(plan, step, shape, num_sms: int, kv_dtype_bytes: int):
    """Structural counters from the plan's type (workqueue, buckets, or one library call) and the
    merge kind of the route it was planned for."""
    merge = getattr(plan, "merge", MERGE_LAUNCH)
    fused_merge, cluster_merge = merge == MERGE_FUSED, merge == MERGE_CLUSTER
    schedule = getattr(plan, "schedule", None)
    if hasattr(schedule, "tasks"):
        return counters.counters_for_workqueue(schedule, step, num_sms, shape.head_dim,
                                               kv_dtype_bytes, fused_merge=fused_merge)
    if hasattr(schedule, "launches"):
        return counters.counters_for_buckets(schedule, step, num_sms, shape.head_dim, kv_dtype_bytes,
                                             fused_merge=fused_merge, cluster_merge=cluster_merge)
    return counters.counters_for_flashinfer(step, num_sms, shape.head_dim, kv_dtype_bytes,
                                            num_kv_heads=shape.num_kv_heads)


class Float64Checks:
    """What the float64 reference found of one engine's (or model-step path's) outputs: its largest
    relative error and the steps it was wrong on (only a baseline's get here: an engine under study
    that is wrong stops the run). Both harnesses keep these, so their result files say it alike."""

    def __init__(self) -> None:
        self.ref_max_rel_err = 0.0
        self.wrong_steps = 0
        self.wrong_warmup_steps = 0
        self.wrong_max_rel_err = 0.0
        self.first_wrong_step: str | None = None
        self.per_step: list[dict] = []

    def checked_against_float64(self, where: str, rel: float, limit: float, measured: bool) -> bool:
        """The step's relative error against the float64 reference, on the step's own record where
        it is measured (add_step ran first); True where it is wrong (not below ``limit``). A
        non-finite output's error is infinite, which a result file cannot hold (JSON has no inf):
        the record says null there and the step is wrong all the same."""
        finite = math.isfinite(rel)
        wrong = not rel < limit
        if finite:
            self.ref_max_rel_err = max(self.ref_max_rel_err, rel)
        if measured:
            self.per_step[-1]["ref_rel_err"] = rel if finite else None
            self.per_step[-1]["wrong"] = wrong
        if wrong:
            if measured:
                self.wrong_steps += 1
            else:
                self.wrong_warmup_steps += 1
            self.wrong_max_rel_err = max(self.wrong_max_rel_err, rel)
            if self.first_wrong_step is None:
                error = f"relative error {rel:.3e}" if finite else "an output that is not finite"
                self.first_wrong_step = (f"{where}{'' if measured else ' (warmup)'}: {error} "
                                         f"against the float64 reference (limit {limit:.0e})")
        return wrong

    def wrong_metrics(self) -> dict:
        """The wrong-step fields of a result's metrics; an infinite error (an output that was not
        finite) is null there, since JSON has no inf."""
        return {
            "wrong_steps": self.wrong_steps,
            "wrong_warmup_steps": self.wrong_warmup_steps,
            "wrong_max_rel_err": self.wrong_max_rel_err if math.isfinite(self.wrong_max_rel_err) else None,
            "first_wrong_step": self.first_wrong_step,
        }


class _EngineRecord(Float64Checks):
    """Per-engine accumulation over the measured steps."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.decode_tokens = 0
        self.wall_us = 0.0
        self.plan_us = 0.0
        self.issue_us = 0.0
        self.cuda_us = 0.0
        self.max_abs_err = 0.0
        self.abs_err_sum = 0.0
        self.checked_steps = 0
        self.routes: Counter = Counter()
        self.splits: Counter = Counter()
        self.split_rules: Counter = Counter()  # workqueue steps per split rule (StepRoute.split_rule)
        self.counters: list = []

    def add_step(self, step, plan, plan_us: float, issue_us: float, wall_us: float, cuda_us: float,
                 position: int = 0, after: str | None = None) -> None:
        """One measured step: the totals, the route and split counts, and the step's own record.
        ``position`` is the engine's place in the step's order (0: it ran first), ``after`` the
        engine that ran right before it in that step (None where it ran first)."""
        route = getattr(plan, "route", None)
        splits = getattr(plan, "num_splits", None)
        split_rule = getattr(plan, "split_rule", None)
        if route is not None:
            self.routes[route] += 1
        if splits is not None:
            self.splits[int(splits)] += 1
        if split_rule is not None:
            self.split_rules[split_rule] += 1
        self.steps += 1
        self.decode_tokens += step.batch_size
        self.wall_us += wall_us
        self.plan_us += plan_us
        self.issue_us += issue_us
        self.cuda_us += cuda_us
        self.per_step.append({
            "step": int(step.step), "batch": int(step.batch_size), "max_len": int(max(step.seq_lens)),
            "route": route, "split_rule": split_rule, "variant": getattr(plan, "kernel_variant", None),
            "plan_us": plan_us, "issue_us": issue_us, "wall_us": wall_us, "cuda_us": cuda_us,
            "position": int(position), "after": after, "ref_rel_err": None, "wrong": False})

    def metrics(self, implementation: str) -> dict:
        selected = self.routes.most_common(1)[0][0] if self.routes else None
        splits = self.splits.most_common(1)[0][0] if self.splits else None

        return {
            "steps": self.steps,
            "decode_tokens": self.decode_tokens,
            "cuda_ms_total": self.cuda_us / 1e3,
            "wall_ms_total": self.wall_us / 1e3,
            "cuda_ms_per_step": self.cuda_us / 1e3 / self.steps,
            "wall_ms_per_step": self.wall_us / 1e3 / self.steps,
            # Where the wall step goes on the host: plan(), then run() until its last launch is
            # queued; the rest of wall_ms_per_step is the wait for the device.
            "plan_ms_per_step": self.plan_us / 1e3 / self.steps,
            "issue_ms_per_step": self.issue_us / 1e3 / self.steps,
            "cuda_tok_s": self.decode_tokens / (self.cuda_us / 1e6) if self.cuda_us > 0 else math.inf,
            "wall_tok_s": self.decode_tokens / (self.wall_us / 1e6) if self.wall_us > 0 else math.inf,
            "max_abs_err": self.max_abs_err,
            "mean_abs_err": self.abs_err_sum / self.checked_steps if self.checked_steps else 0.0,
            "ref_max_rel_err": self.ref_max_rel_err,
            # Steps the float64 reference found this engine wrong on (a baseline's; tables take no
            # ratio against a baseline with wrong measured steps), the largest relative error of
            # those steps and where the first one was.
            **self.wrong_metrics(),
            "routes": dict(sorted(self.routes.items())),
            "selected_route": selected,
            "num_splits": splits,
            # Workqueue steps per split rule: the skew rule's balanced steps beside the fixed ones.
            "split_rules": dict(sorted(self.split_rules.items())),
            "counters": counters.summarize(self.counters),
            "implementation": implementation,
            # One entry per measured step, so a ratio can be traced to the steps behind it.
            "per_step": self.per_step,
        }


def step_where(step) -> str:
    return f"decode step {step.step} (B={step.batch_size}, seq_lens={step.seq_lens.tolist()})"


def _agreement(engine, out, expected, rel_limit: float) -> tuple[dict, bool, str]:
    """The errors of ``out`` against ``expected`` (the baseline's output, or the float64 reference
    on a step the baseline got wrong), whether they lie within the bound that binds ``engine`` (the
    paper's where it binds the engine, Engine.held_to_paper_bound, else ``rel_limit``, the relative
    error that separates a wrong output from a rounded one), and the errors and bound as text."""
    errors = compare(out.float(), expected.float())
    if engine.held_to_paper_bound:
        within = check_within(errors, max_abs=PAPER_MAX_ABS, mean_abs=PAPER_MEAN_ABS)
        bound = f"(bound {PAPER_MAX_ABS}), mean|e|={errors['mean_abs_err']:.3e} (bound {PAPER_MEAN_ABS})"
    else:
        within = errors["rel_err"] < rel_limit
        bound = f"mean|e|={errors['mean_abs_err']:.3e}, relative error {errors['rel_err']:.3e} (bound {rel_limit:.0e})"
    return errors, within, f"max|e|={errors['max_abs_err']:.3e} {bound}"


def is_studied(name: str, engine, baseline: str) -> bool:
    """Whether a wrong output of this engine stops the run: an engine under study that is not the
    run's baseline. The baseline and other libraries' kernels beside it are what is compared with."""
    return name != baseline and engine.under_study


def float64_errors(rels: dict, baseline: str, limit: float) -> str:
    return ", ".join(f"{name!r}{' (baseline)' if name == baseline else ''} {rel:.3e}"
                     f"{' (wrong)' if not rel < limit else ''}" for name, rel in rels.items())


def judge_against_float64(step, outputs: dict, reference, engines: dict, baseline: str, records: dict,
                           limit: float, dtype, measured: bool, disagreeing: dict) -> tuple[dict, set]:
    """Every engine's output of the step against the float64 reference: (relative error per engine,
    the engines that are wrong, not below ``limit``). An engine under study that is wrong stops the
    run, named with its relative error (and its disagreement with the baseline, from
    ``disagreeing``, where that led to the check); a baseline's wrong step is recorded in its
    record and the run goes on."""
    where = step_where(step)
    rels = {name: compare(outputs[name], reference)["rel_err"] for name in engines}
    for name, rel in rels.items():
        if not rel < limit and is_studied(name, engines[name], baseline):
            if name in disagreeing:
                head = (f"engine {name!r} disagrees with baseline {baseline!r} at {where}: {disagreeing[name]}; "
                        f"against the float64 reference it is wrong: relative error {rel:.3e}")
            else:
                head = f"engine {name!r} at {where}: relative error {rel:.3e} against the float64 reference"
            raise CorrectnessError(f"{head} exceeds {limit:.0e} for {dtype} (float64 relative errors of the "
                                   f"step: {float64_errors(rels, baseline, limit)})")
    wrong = {name for name, rel in rels.items() if records[name].checked_against_float64(where, rel, limit, measured)}
    return rels, wrong


def run_trace(spec: TraceRunSpec, shape, engines: dict, baseline: str, *, progress: bool = True,
              num_sms: int | None = None) -> dict[str, dict]:
    """Run every engine on every decode step of the trace; return each engine's metrics dict
    (the result contract's "metrics", plus "implementation")."""
    if not engines:
        raise ValueError("run_trace needs at least one engine")
    if baseline not in engines:
        raise ValueError(f"baseline engine {baseline!r} is not among the engines {sorted(engines)}")
    for name in engines:
        validate_range_name(f"{name}_decode")
    device = torch.device(spec.device)
    dtype = resolve_dtype(spec.dtype)
    requests = list(spec.requests)
    total_steps = spec.warmup_steps + spec.measured_steps
    assignment = page_layout(requests, layout=spec.page_layout, page_size=spec.page_size,
                             hole_fraction=spec.hole_fraction, seed=spec.seed, max_active=spec.max_active,
                             max_steps=total_steps, pool_pages=spec.kv_pool_pages, page_order=spec.page_order)
    k_pages, v_pages = make_kv_pages(assignment.num_physical_pages, shape, spec.page_size, dtype,
                                     device, spec.seed)
    decoder = ContinuousDecoder(requests, assignment, spec.max_active, max_steps=total_steps)
    flusher = L2Flusher(device) if spec.flush_l2 else None
    mlp = GatedMLPTail(hidden=shape.num_qo_heads * shape.head_dim, dtype=dtype, device=device,
                       seed=spec.seed) if spec.mlp_tail else None
    sms = default_num_sms(device) if num_sms is None else int(num_sms)
    kv_dtype_bytes = k_pages.element_size()
    ref_limit = REF_REL_LIMIT[dtype]

    names = list(engines)
    records = {name: _EngineRecord() for name in names}
    started = last_report = time.perf_counter()
    index = -1
    for index, step in enumerate(decoder.steps()):
        measured_index = index - spec.warmup_steps
        measured = measured_index >= 0
        q = make_queries(step.batch_size, shape, dtype, device, query_seed(spec.seed, step.step))
        outputs = {}
        order = engine_order(names, index)
        for position, name in enumerate(order):
            engine = engines[name]
            engine.prepare(step, q, k_pages, v_pages)
            if flusher is not None:
                flusher.flush()
            with WallTimer(device) as wall:
                with nvtx_range(f"{name}_plan"):
                    plan = engine.plan(step)
                planned = time.perf_counter()
                with nvtx_range(f"{name}_decode"):
                    out = engine.run(q, k_pages, v_pages, plan)
                issued = time.perf_counter()
                if mlp is not None:
                    with nvtx_range(f"{name}_mlp_tail"):
                        mlp(out)
            outputs[name] = out
            if measured:
                # Device time is taken on a second run of the same plan, queued behind a GPU-side
                # hold: events around the wall pass would time the host's launch latency too
                # whenever the kernels are shorter than the Python that issues them.
                if flusher is not None:
                    flusher.flush()
                hold_device(device)
                with DeviceTimer(device) as device_timer:
                    again = engine.run(q, k_pages, v_pages, plan)
                    if mlp is not None:
                        mlp(again)
            if measured:
                record = records[name]
                record.add_step(step, plan, plan_us=(planned - wall.started) * 1e6,
                                issue_us=(issued - planned) * 1e6, wall_us=wall.elapsed_us,
                                cuda_us=device_timer.elapsed_us, position=position,
                                after=order[position - 1] if position else None)
                record.counters.append(step_counters(plan, step, shape, sms, kv_dtype_bytes))

        agreement = {name: _agreement(engines[name], outputs[name], outputs[baseline], ref_limit)
                     for name in names if name != baseline}
        disagreeing = {name: text for name, (_, within, text) in agreement.items() if not within}
        # A disagreement does not say which side is wrong, so every engine of the step, the
        # baseline included, goes to the float64 reference; so does every check_every-th measured step.
        reference, rels, wrong = None, {}, set()
        if disagreeing or (measured and measured_index % spec.check_every == 0):
            reference = dense_decode(q, k_pages, v_pages, step.seq_lens, step.block_table,
                                     sm_scale=shape.sm_scale)
            rels, wrong = judge_against_float64(step, outputs, reference, engines, baseline, records,
                                                 ref_limit, dtype, measured, disagreeing)
        for name, (errors, within, text) in agreement.items():
            if name in wrong:
                continue  # a baseline's wrong step, recorded as such; it agrees with nothing
            against = f"baseline {baseline!r}"
            if baseline in wrong:
                # The baseline's output is wrong on this step: the others are held to the float64
                # reference instead, under the same bound, and their errors are taken against it.
                errors, within, text = _agreement(engines[name], outputs[name], reference, ref_limit)
                against = f"the float64 reference (baseline {baseline!r} is wrong at this step)"
            if not within and is_studied(name, engines[name], baseline):
                # Not wrong against float64, yet outside the paper's bound against what it is held to.
                also = f"; float64 relative errors of the step: {float64_errors(rels, baseline, ref_limit)}" \
                    if rels else ""
                raise CorrectnessError(
                    f"engine {name!r} disagrees with {against} at {step_where(step)}: {text}{also}")
            # Another library's kernel is judged by the float64 reference alone (above): outside the
            # relative limit against a right baseline but within it against float64 is rounding.
            record = records[name]
            record.max_abs_err = max(record.max_abs_err, errors["max_abs_err"])
            record.abs_err_sum += errors["mean_abs_err"]
            record.checked_steps += 1

        now = time.perf_counter()
        if progress and now - last_report >= PROGRESS_EVERY_S:
            print(f"[{spec.name}] step {index + 1}/{total_steps} elapsed {now - started:.1f}s",
                  file=sys.stderr, flush=True)
            last_report = now

    if records[baseline].steps == 0:
        raise ValueError(
            f"trace {spec.name!r} has {index + 1} decode steps, none after the "
            f"{spec.warmup_steps} warmup steps")
    if progress:
        print(f"[{spec.name}] done: {index + 1} steps in {time.perf_counter() - started:.1f}s",
              file=sys.stderr, flush=True)
    results = {name: records[name].metrics(engines[name].implementation) for name in names}
    for name in names:
        # Which FlashInfer path each batch class ran, and what every path measured in its probe.
        path_record = engines[name].path_record()
        if path_record is not None:
            results[name]["flashinfer_paths"] = path_record
    return results
