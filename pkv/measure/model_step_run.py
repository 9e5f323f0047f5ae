"""Time a model-shaped decode step per engine and mode over a serving trace (Table 9).

Every path (engine x mode) of a run sees the same steps, page tables, pools and inputs, as in
pkv.measure.harness. Per step: the step without attention is timed once per mode (the rest of the
step, for attention's share); then each path, in a rotated order, gets the L2 flush (untimed), the
synchronized wall time of its host plan plus the whole step, and, after another flush, the device
time of the same planned step queued behind a GPU-side hold (pkv.measure.timing.hold_device).

Checks: every step, each path's output against the baseline path's (the step's final hidden state,
a bound a few times the dtype's rounding over the layers); every ``check_every`` measured steps,
each eager engine's attention in every layer against float64 (pkv.engines.dense) in an untimed pass,
and each graph path against its own engine's eager output.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from pkv.engines.base import upload_block_table
from pkv.engines.dense import dense_decode
from pkv.measure.accuracy import compare
from pkv.measure.harness import REF_REL_LIMIT, CorrectnessError, query_seed
from pkv.measure.model_step import ModelStep
from pkv.measure.model_step_paths import EagerPath
from pkv.measure.timing import DeviceTimer, L2Flusher, WallTimer, hold_device

# A path's final hidden state against the baseline's: the attention outputs differ by the dtype's
# rounding, and every later layer carries that difference on; four times the single-call bound
# leaves room for it and still catches a wrong page or length, which is an O(1) error.
STEP_REL_FACTOR = 4.0
PROGRESS_EVERY_S = 5.0


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


class _Record:
    def __init__(self) -> None:
        self.steps = self.tokens = 0
        self.sums = dict.fromkeys(("wall_us", "cuda_us", "plan_us", "issue_us", "rest_us", "floor_us"), 0.0)
        self.kv_bytes = 0
        self.rel_vs_baseline = 0.0
        self.ref_rel = None
        self.rel_vs_eager = None
        self.routes: dict = {}
        self.split_rules: dict = {}  # workqueue steps per split rule (StepRoute.split_rule)
        self.per_step: list = []

    def add(self, step, route, position: int, split_rule: str | None = None, **us) -> None:
        self.steps += 1
        self.tokens += step.batch_size
        for key in self.sums:
            self.sums[key] += us[key]
        self.routes[route] = self.routes.get(route, 0) + 1
        if split_rule is not None:
            self.split_rules[split_rule] = self.split_rules.get(split_rule, 0) + 1
        self.per_step.append({"step": int(step.step), "batch": int(step.batch_size),
                              "max_len": int(max(step.seq_lens)), "route": route, "split_rule": split_rule,
                              "position": position, **{k: float(v) for k, v in us.items()}})

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
            "max_rel_err_vs_baseline": self.rel_vs_baseline,
            "ref_max_rel_err": self.ref_rel,
            "rel_err_vs_eager": self.rel_vs_eager,
            "routes": dict(sorted(self.routes.items(), key=lambda kv: str(kv[0]))),
            "split_rules": dict(sorted(self.split_rules.items())),
            "selected_route": max(self.routes, key=self.routes.get) if self.routes else None,
            "per_step": self.per_step,
        }


def _verify_eager(path: EagerPath, model: ModelStep, step, x) -> float:
    """Untimed: the engine's attention in every layer against float64 over the same q and pages."""
    worst = 0.0
    plan = path.engine.plan(step)
    tables, _ = upload_block_table(step, model.device)
    table, lens = tables["block_table"], tables["seq_lens"]

    def attend(layer, q):
        nonlocal worst
        out = path.engine.run(q, model.k_pages[layer], model.v_pages[layer], plan)
        ref = dense_decode(q, model.k_pages[layer], model.v_pages[layer], step.seq_lens, step.block_table,
                           sm_scale=model.shape.attention.sm_scale)
        worst = max(worst, compare(out, ref)["rel_err"])
        return out

    model.forward(x, table, lens, attend)
    return worst


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
    started = last = time.perf_counter()
    index = -1
    for index, step in enumerate(decoder.steps()):
        measured_index = index - spec.warmup_steps
        measured = measured_index >= 0
        x = model.hidden_input(step.batch_size, query_seed(spec.seed, step.step))
        for path in (*rests.values(), *paths.values()):
            path.prepare(step, x)  # untimed: probes, and a capture for a batch size not seen yet
        rest_us = {mode: _time(rest, step, x, flusher, device, measured)[4] for mode, rest in rests.items()}
        kv_bytes = model.kv_bytes_read(step.seq_lens)
        floor_us = kv_bytes / (spec.beta_gbps * 1e3)
        outs = {}
        order = labels[index % len(labels):] + labels[:index % len(labels)]
        for position, label in enumerate(order):
            path = paths[label]
            outs[label], plan_us, issue_us, wall_us, cuda_us = _time(path, step, x, flusher, device, measured)
            if measured:
                records[label].add(step, path.route, position, path.split_rule, plan_us=plan_us, issue_us=issue_us,
                                   wall_us=wall_us, cuda_us=cuda_us, rest_us=rest_us[path.mode], floor_us=floor_us)
                records[label].kv_bytes += kv_bytes
        for label in labels:
            rel = compare(outs[label], outs[spec.baseline])["rel_err"]
            if not rel <= STEP_REL_FACTOR * limit:
                raise CorrectnessError(
                    f"model step: path {label!r} disagrees with {spec.baseline!r} at decode step {step.step} "
                    f"(B={step.batch_size}, seq_lens={step.seq_lens.tolist()}): relative error {rel:.3e} of the "
                    f"final hidden state, bound {STEP_REL_FACTOR * limit:.1e}")
            records[label].rel_vs_baseline = max(records[label].rel_vs_baseline, rel)
        if measured and measured_index % spec.check_every == 0:
            _check(spec, model, step, x, paths, outs, records, limit)
        now = time.perf_counter()
        if progress and now - last >= PROGRESS_EVERY_S:
            print(f"[{spec.name} model step] step {index + 1} elapsed {now - started:.1f}s", file=sys.stderr, flush=True)
            last = now
    if records[spec.baseline].steps == 0:
        raise ValueError(f"trace {spec.name!r} has {index + 1} decode steps, none after the "
                         f"{spec.warmup_steps} warmup steps")
    return {label: records[label].metrics(model.layers, layers_model, paths[label].mode,
                                          paths[label].implementation) for label in labels}


def _check(spec, model, step, x, paths, outs, records, limit) -> None:
    for label, path in paths.items():
        rec = records[label]
        if isinstance(path, EagerPath):
            rel = _verify_eager(path, model, step, x)
            if not rel < limit:
                raise CorrectnessError(f"model step: path {label!r} at decode step {step.step}: attention relative "
                                       f"error {rel:.3e} against float64 exceeds {limit:.0e} for {model.dtype}")
            rec.ref_rel = max(rec.ref_rel or 0.0, rel)
        else:
            eager = label.rsplit("_", 1)[0] + "_eager"
            if eager in outs:
                rel = compare(outs[label], outs[eager])["rel_err"]
                rec.rel_vs_eager = max(rec.rel_vs_eager or 0.0, rel)
