"""The calibration rule: measure beta and lambda, fit C_min, the split operating points, the
route of batches 2..7, the context gate of each batch regime and the group sizes that are routed.

Only the calibration seed may be used: every held-out result is judged with these constants, so
fitting on a held-out seed would leak the evaluation into the policy. The output is the JSON that
pkv.policy.load_calibration reads; the raw measurements (sweep totals, fit residual) ride along
in its provenance, with each decision between a PersistentKV route (or rule) and its default, its
measured margin and the noise band it was judged against (``measurements.decisions``).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from pkv.config import ConfigError, PkvConfig, load_trace_option
from pkv.engines import build_engine
from pkv.experiments.common import (
    gates_for_profile,
    kv_pool_pages,
    load_requests,
    model_shape,
    provenance_for,
    resolve_settings,
    trace_name,
)
from pkv.measure.calibration_probe import measure_launch_us, measure_read_gbps, time_steps_in_turn, trace_steps
from pkv.measure.kv_data import make_kv_pages, resolve_dtype
from pkv.pipeline.schedule import row_tiles
from pkv.policy.calibration import Calibration, regime_field, save_calibration
from pkv.policy.choose import PinnedRoutePolicy, RoutePolicy, RuledRoutePolicy, is_over_split, is_skewed
from pkv.policy.estimator import Estimator, total_tokens
from pkv.policy.fits import (
    REGIME_ROUTE_DEFAULT,
    SPLIT_TIE_FRACTION,
    fit_c_min,
    fit_context_gate,
    fit_regime_route,
    fit_split_count,
    group_size_holds,
    measured_gain,
)
from pkv.policy.regime import FEW_ROWS, SINGLE_ROW, regime_of
from pkv.policy.route import FLASHINFER_ROUTE, ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE, SCHEDULES, StepRoute
from pkv.shape import ModelShape


def run(cfg: PkvConfig) -> list[Path]:
    exp = cfg.experiment
    if cfg.seed != exp.calibration_seed:
        raise ConfigError(f"conf/experiment/calibrate.yaml: field 'seed' = {cfg.seed!r}: calibration runs on "
                          f"the calibration seed {exp.calibration_seed} only (held-out seeds stay unseen)")
    if not exp.calibration_traces:
        raise ConfigError("conf/experiment/calibrate.yaml: field 'experiment.calibration_traces' = []: "
                          "the split sweep needs at least one trace")
    settings = resolve_settings(cfg)
    shape = model_shape(cfg)
    for i, probe in enumerate(exp.gate_probes):
        if probe.group_size is not None and shape.num_qo_heads % probe.group_size:
            raise ConfigError(f"conf/experiment/calibrate.yaml: field 'experiment.gate_probes[{i}].group_size' = "
                              f"{probe.group_size!r}: must divide model.num_qo_heads={shape.num_qo_heads}")
    # The probes fit the gates in the run's tokens: a GPU's file on the CPU profile is scaled first.
    start = gates_for_profile(Calibration.from_mapping(dict(cfg.gpu), "conf/gpu (selected option)"), cfg)

    clock = _Clock()
    read_gbps = measure_read_gbps(settings.device, settings.probe_buffer_mib)
    launch = measure_launch_us(settings.device, launches=settings.launch_probe_reps)
    calib = dataclasses.replace(start, beta_gbps=read_gbps, lambda_us=launch["lambda_us"])
    clock.lap("bandwidth and launch probes")

    sweep = _SplitSweep(cfg, settings, shape, calib)
    for ct in exp.calibration_traces:
        sweep.run(ct)
        clock.lap(f"{ct.trace} B{ct.max_active} ({ct.fits})")
    split_points = sweep.split_points()
    uniform_ctas = sweep.uniform_target_ctas(split_points)
    balanced_fits = sweep.balanced_rule_fits(split_points)
    clock.lap("skewed steps on each rule (balanced rule fits)")
    calib = _apply(calib, split_points)
    short_row_fits = sweep.short_row_fits(split_points, calib)
    clock.lap("short single rows at each tiles a split (short-row rule fit)")
    if settings.performance_result:
        # CPU timings say nothing about a GPU: there the fits are recorded and the configured
        # rules, routes and gates kept (in the profile's tokens, gates_for_profile).
        if uniform_ctas is not None:
            calib = dataclasses.replace(calib, uniform_target_ctas=uniform_ctas)
        calib = _apply(calib, balanced_fits)
        calib = _apply(calib, short_row_fits)
    # The B2-7 route and every gate are decided on the route each step would run under the split
    # counts and step rules just fitted: a skewed B4 step on the balanced rule, a short step of a
    # regime whose over-split rule holds on that rule too.
    calib = _apply(calib, sweep.regime_routes(split_points, calib))
    probes = _GateProbes(cfg, settings, shape, calib, sweep.gate_steps(split_points, calib), exp.gate_tolerance)
    for probe in exp.gate_probes:
        probes.run(probe)
    clock.lap(f"{len(exp.gate_probes)} gate probes")
    context_gates = probes.fit_context_gates(start)
    group_fit = probes.fit_group_sizes(start)
    if settings.performance_result:
        for fit in context_gates.values():
            calib = calib.with_regime(fit["regime"], min_context_tokens=fit["fitted"])
        calib = dataclasses.replace(calib, supported_group_sizes=tuple(group_fit["fitted"]))
    calib = dataclasses.replace(calib, flashinfer_plan_us=statistics.median(sweep.flashinfer_plan_us),
                                persistentkv_plan_us=statistics.median(sweep.persistentkv_plan_us))
    estimator = Estimator(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                          head_dim=shape.head_dim, kv_dtype_bytes=sweep.kv_dtype_bytes)
    fit = fit_c_min(sweep.samples, estimator, refit_lambda=False)
    calib = dataclasses.replace(
        calib, c_min=fit.c_min,
        source=f"calibrate rule: seed {cfg.seed}, profile {settings.profile}"
               + ("" if settings.performance_result else " (not a performance model)"))
    prov = provenance_for(cfg, settings, cfg.seed)
    prov["measurements"] = {
        "read_gbps": read_gbps, "probe_buffer_mib": settings.probe_buffer_mib,
        "launch": launch, "launch_probe_reps": settings.launch_probe_reps,
        "c_min_fit": dataclasses.asdict(fit), "split_sweeps": sweep.records,
        "gate_probes": probes.records, "context_gates": context_gates, "group_sizes": group_fit,
        # Each decision the calibration took between a PersistentKV route (or rule) and its default,
        # with the measured margin and the noise band it was judged against (spread.md shows them
        # for a decision that differs between repeated calibrations).
        "decisions": {**sweep.decisions, **probes.decisions(context_gates, group_fit)},
        "flashinfer_paths": sweep.flashinfer_paths,
        "performance_result": settings.performance_result,
    }
    out = Path(cfg.out)
    save_calibration(out, calib, prov)
    clock.done()
    return [out]


class _Clock:
    """Where a calibration's time goes, one log line per part: the run's own work beside its
    start-up (docs/performance.md's per-rule table)."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        print(f"pkv calibrate: {what} in {now - self.last:.1f}s", file=sys.stderr, flush=True)
        self.last = now

    def done(self) -> None:
        print(f"pkv calibrate: done in {time.perf_counter() - self.started:.1f}s", file=sys.stderr, flush=True)


def _apply(calib: Calibration, points: dict) -> Calibration:
    """The calibration with the fitted operating points: {regime: {parameter: value}}."""
    for regime, params in points.items():
        calib = calib.with_regime(regime, **params)
    return calib


class _TimedTrace:
    """One calibration trace's steps and page pool, timed on PersistentKV and FlashInfer."""

    def __init__(self, cfg: PkvConfig, settings, shape, trace):
        run_settings = resolve_settings(dataclasses.replace(cfg, trace=trace))
        requests = load_requests(trace, cfg.seed, run_settings)
        assignment, self.steps = trace_steps(
            requests, page_size=trace.page_size, hole_fraction=trace.hole_fraction,
            max_active=trace.max_active, num_steps=run_settings.warmup_steps + run_settings.measured_steps,
            seed=cfg.seed, layout=trace.page_layout, pool_pages=kv_pool_pages(trace, run_settings, requests),
            page_order=trace.page_order)
        dtype = resolve_dtype(settings.dtype)
        k_pages, v_pages = make_kv_pages(assignment.num_physical_pages, shape, trace.page_size, dtype,
                                         settings.device, cfg.seed)
        self.kv_dtype_bytes = k_pages.element_size()
        self.shape, self.device = shape, settings.device
        self.flashinfer_paths = None  # set by timed() where FlashInfer ran: the paths its best-of engine picked
        self.timing = dict(shape=shape, k_pages=k_pages, v_pages=v_pages, dtype=dtype,
                           device=settings.device, seed=cfg.seed, reps=run_settings.reps,
                           flush_l2=cfg.experiment.flush_l2)

    def timed(self, runs: dict) -> dict:
        """Each run over the trace's steps, the runs of one step in turn (time_steps_in_turn): key ->
        TimedSteps. A run is a StepRoute, pinned on PersistentKV or FLASHINFER_ROUTE for FlashInfer's
        best path, or a RuledRoutePolicy: each step on the route its regime's step rules give it."""
        engines = {key: self._engine(run) for key, run in runs.items()}
        timed = time_steps_in_turn(engines, self.steps, **self.timing)
        for engine, route in engines.values():
            if route == FLASHINFER_ROUTE:
                # Which of FlashInfer's paths each batch class ran (its probe's pick, shared by the
                # engines of the process): the baseline's side of every route decision taken here.
                self.flashinfer_paths = engine.path_record()
        return timed

    def _engine(self, run) -> tuple:
        """(engine, the route it is pinned to, or None where its policy picks each step's)."""
        if isinstance(run, RuledRoutePolicy):
            return build_engine("persistentkv", shape=self.shape, device=self.device, policy=run), None
        if run == FLASHINFER_ROUTE:
            return build_engine("flashinfer", shape=self.shape, device=self.device), run
        return build_engine("persistentkv", shape=self.shape, device=self.device, policy=PinnedRoutePolicy(run)), run


# What measurements.decisions keeps of a decision's record: the measured margin (the default's
# device time over the candidate's: above 1, the candidate is faster), the band it was judged
# against, the margin it needed, what it falls back to, and why it came out as it did.
_DECISION_KEYS = ("measured_margin", "noise_band", "required_margin", "steps", "default", "basis", "applied",
                  "candidate_device_us_total", "default_device_us_total")


def _decision_fields(record: dict) -> dict:
    return {key: record[key] for key in _DECISION_KEYS if key in record}


def _bucket_splits(sample) -> int:
    """The splits a timed single-row step's bucket route cut its row into: the route's count, at
    most the row's tiles (pkv.pipeline.schedule.plan_buckets)."""
    return min(int(sample.route.num_splits), max(1, int(row_tiles(max(sample.step.seq_lens)))))


def _step_times(timed) -> list:
    """A run's per-step device times, us, rounded to 0.001 us (the events' resolution is coarser)."""
    return [round(sample.measured_us, 3) for sample in timed.samples]


def _gate_rows(pkv_timed, fi_timed) -> dict:
    """Per step: the longest row and both routes' device times, the inputs of fit_context_gate."""
    return {"contexts": [int(max(s.step.seq_lens)) for s in pkv_timed.samples],
            "persistentkv_us": [s.measured_us for s in pkv_timed.samples],
            "flashinfer_us": [s.measured_us for s in fi_timed.samples]}


def _median_or_none(values: list) -> float | None:
    return statistics.median(values) if values else None


class _SplitSweep:
    """The split sweep of the calibration traces: the operating point of each batch regime, and
    the timed steps that C_min, the host plan times and the context gates are fitted from.

    Traces that fit the same operating point (say a ragged and a uniform batch of 8 rows) are
    decided together, by the split count with the least device time summed over them.
    """

    def __init__(self, cfg, settings, shape, calib):
        self.cfg, self.settings, self.shape, self.calib = cfg, settings, shape, calib
        self.samples, self.flashinfer_plan_us, self.persistentkv_plan_us = [], [], []
        self.flashinfer_paths = None  # FlashInferEngine.path_record of the model's shape, where FlashInfer ran
        self.records, self.kv_dtype_bytes = {}, 2
        self._swept: list[dict] = []  # traces that fit their regime's split count
        self._uniform: list[dict] = []  # traces that fit Calibration.uniform_target_ctas
        self._skewed: list[dict] = []  # traces that fit Calibration.skew_target_ctas
        self._short_rows: list[dict] = []  # single-row traces that fit the short-row rule (bucket_tiles_per_split)
        self.decisions: dict[str, dict] = {}  # decision path -> its margin, band and value (measurements.decisions)
        # trace name -> balanced rule's target CTAs -> step index -> (lengths, device us): the skew fit's runs
        self._balanced_by_step: dict[str, dict[int, dict]] = {}

    def run(self, ct) -> None:
        base = load_trace_option(ct.trace)
        trace = dataclasses.replace(base, max_active=ct.max_active, length_scale=base.length_scale * ct.length_scale)
        timed_trace = _TimedTrace(self.cfg, self.settings, self.shape, trace)
        self.kv_dtype_bytes = timed_trace.kv_dtype_bytes
        if ct.fits == "skew_target_ctas":
            self._add_skewed(ct, trace, timed_trace)
            return
        if ct.fits == "bucket_tiles_per_split":
            # Timed in short_row_fits at the single-row regime's fitted split count; like the
            # uniform and skewed traces, its steps stay out of C_min and the plan times.
            self._short_rows.append({"name": f"{trace_name(trace)} x{ct.length_scale:g} (short rows)",
                                     "tiles": [int(t) for t in ct.tile_candidates], "timed_trace": timed_trace})
            return
        route_name, bucket_mode = SCHEDULES[ct.route]
        # The uniform traces fit their cap alone: their steps stay out of C_min and the plan times, so
        # the cap changes no other decision (their few-CTA steps carry the wave loss that the
        # roofline's C_min does not model).
        fits_cap = ct.fits == "uniform_target_ctas"
        # Every split count and FlashInfer timed step by step in turn (the key "flashinfer" beside the counts).
        timed_by_splits = timed_trace.timed(
            {**{splits: StepRoute(route_name, int(splits), self.calib.workqueue_split_kind, bucket_mode)
                for splits in ct.split_candidates}, "flashinfer": FLASHINFER_ROUTE})
        # FlashInfer-role steps at low occupancy are what pins C_min down; its plan() time is a constant too.
        timed_fi = timed_by_splits.pop("flashinfer")
        if not fits_cap:
            for timed in timed_by_splits.values():
                self.samples += timed.samples
                self.persistentkv_plan_us += timed.plan_us
        if timed_trace.flashinfer_paths is not None:
            self.flashinfer_paths = timed_trace.flashinfer_paths  # the process's picks so far, every class
        if not fits_cap:
            self.samples += timed_fi.samples
            self.flashinfer_plan_us += timed_fi.plan_us
        # The bucket sweep fits the single-row regime whatever its batch; the workqueue, its batch's.
        regime = SINGLE_ROW if route_name == ROUTE_BUCKET else regime_of(trace.max_active)
        swept = {"name": trace_name(trace), "max_active": trace.max_active, "route": route_name, "regime": regime,
                 "steps": len(timed_trace.steps), "timed_by_splits": timed_by_splits, "timed_fi": timed_fi}
        (self._uniform if fits_cap else self._swept).append(swept)

    def _fit_splits(self, traces: list[dict], field: str, problem: str,
                    preferred: int | None = None) -> tuple[dict, object]:
        """(summed device us by shared split count, fit_split_count's fit, a tie going to
        ``preferred`` where it is tied) of traces decided together, each trace's sweep recorded
        under its name as fitting ``field``."""
        shared = set.intersection(*(set(t["timed_by_splits"]) for t in traces))
        if not shared:
            raise ConfigError(f"conf/experiment/calibrate.yaml: field 'experiment.calibration_traces' = "
                              f"{[t['name'] for t in traces]}: {problem}")
        summed = {s: sum(t["timed_by_splits"][s].total_us for t in traces) for s in sorted(shared)}
        split_fit = fit_split_count(summed, preferred=preferred)
        # A split count's margin: the fastest candidate's time over the chosen one's (1 where the
        # fastest is chosen); candidates within SPLIT_TIE_FRACTION are tied and go to the
        # configured count where it is one of them, else to the fewest.
        held = split_fit.num_splits == preferred and len(split_fit.tied) > 1
        self.decisions[field] = {
            "value": split_fit.num_splits,
            "measured_margin": summed[split_fit.fastest] / summed[split_fit.num_splits],
            "noise_band": SPLIT_TIE_FRACTION, "required_margin": 1.0 / (1.0 + SPLIT_TIE_FRACTION),
            "fastest": split_fit.fastest, "tied": list(split_fit.tied), "preferred": preferred,
            "basis": ("the configured count, within the band of the fastest" if held
                      else "the fewest splits within the band of the fastest")}
        for t in traces:
            self.records[t["name"]] = {
                "route": t["route"], "fits": field, "steps": t["steps"],
                "selected_splits": split_fit.num_splits, "selected_at_edge": split_fit.at_edge,
                "fastest_splits": split_fit.fastest, "tied_splits": list(split_fit.tied),
                "preferred_splits": preferred,
                "fitted_with": [u["name"] for u in traces],
                "device_us_total_by_splits": {str(s): timed.total_us for s, timed in t["timed_by_splits"].items()},
                "flashinfer_device_us_total": t["timed_fi"].total_us,
                # Each step's time (us, in the trace's step order) behind those sums, so that two
                # calibrations can be compared step by step: noise in each step's timing, or a
                # whole count moving together.
                "device_us_by_step": {**{str(s): _step_times(timed) for s, timed in t["timed_by_splits"].items()},
                                      "flashinfer": _step_times(t["timed_fi"])},
            }
        return summed, split_fit

    def split_points(self) -> dict:
        """{regime: {"num_splits": S}} of each swept regime, recording every trace's sweep."""
        points = {}
        for regime in dict.fromkeys(t["regime"] for t in self._swept):
            field = regime_field(regime, "num_splits")
            traces = [t for t in self._swept if t["regime"] == regime]
            # A tie goes to the count the GPU's conf file starts from, where it is tied.
            summed, split_fit = self._fit_splits(traces, field, f"traces that fit {field} share no split candidate",
                                                 preferred=self.calib.regime(regime).num_splits)
            points[regime] = {"num_splits": split_fit.num_splits}
            if split_fit.at_edge:
                print(f"pkv calibrate: {field}: the fastest split count, {split_fit.num_splits}, is at the edge of "
                      f"the candidates {sorted(summed)}; widening them may find a faster one", file=sys.stderr)
        return points

    def regime_routes(self, points: dict, fitted: Calibration) -> dict:
        """{FEW_ROWS: {"route": R}} where the B2-7 traces were swept and the timings are a
        performance result, recording the decision either way.

        Paper 4.4 keeps batches 2..7 on FlashInfer (merge and launch costs at break-even on its
        GPU). Here the calibration seed's steps decide, in device time, each step timed on both
        routes and on the route the policy would run it on under ``fitted`` (the split counts of
        ``points`` and the fitted step rules: a skewed step on the balanced rule, from the skew
        fit's run of the same step, ruled_samples); the workqueue where its gain clears the noise
        band of those paired steps, and on a tie the route with the much cheaper host plan
        (fit_regime_route), by the plan times of the same sweep. As for the context gates, CPU
        timings are recorded and the configured route kept."""
        traces = [t for t in self._swept if t["regime"] == FEW_ROWS]
        if not traces:
            return {}
        splits = points[FEW_ROWS]["num_splits"]
        ruled = [self.ruled_samples(t, splits, fitted) for t in traces]
        candidate_us = [us for samples, _ in ruled for us in samples]
        flashinfer_us = [s.measured_us for t in traces for s in t["timed_fi"].samples]
        plan_us = {"candidate_plan_us": _median_or_none(self.persistentkv_plan_us),
                   "default_plan_us": _median_or_none(self.flashinfer_plan_us)}
        fit = fit_regime_route(candidate_us, flashinfer_us, ROUTE_WORKQUEUE, **plan_us)
        field = regime_field(FEW_ROWS, "route")
        measured = fit.gain.record()
        record = {"fits": field, "fitted": fit.route, "applied": self.settings.performance_result,
                  "speedup": measured["measured_margin"], **measured, "default": REGIME_ROUTE_DEFAULT,
                  "basis": fit.basis, "num_splits": splits,
                  # The steps by the route the policy runs them on, and those not timed on it.
                  "steps_by_route": dict(sum((counts for _, counts in ruled), Counter())),
                  # Both sides' sums: where repeated calibrations disagree, which one moved.
                  "candidate_device_us_total": sum(candidate_us),
                  "default_device_us_total": sum(flashinfer_us), **plan_us}
        for t in traces:
            self.records[t["name"]]["regime_route"] = record
        self.decisions[field] = {"value": fit.route, **_decision_fields(record)}
        return {FEW_ROWS: {"route": fit.route}} if self.settings.performance_result else {}

    def ruled_samples(self, t: dict, splits: int, fitted: Calibration) -> tuple[list[float], Counter]:
        """Each step's device time of the swept trace ``t`` at ``splits``, on the route the policy's
        step rules give it under ``fitted`` (its regime opened): the skew fit's time of the same
        step on the balanced rule at the fitted budget where the rules take that rule and the skew
        fit timed it, else the sweep's own (the fixed rule at ``splits``). With the count of steps
        on each route (_rule_key)."""
        policy = _opened_policy(fitted.with_regime(t["regime"], num_splits=splits), t["regime"], self.shape)
        balanced = self._balanced_by_step.get(t["name"], {})
        timed_by_splits = t["timed_by_splits"]
        times, counts = [], Counter()
        for i, sample in enumerate(timed_by_splits[splits].samples):
            route = policy.ruled_route(sample.step)
            # A step of fewer rows than the trace's regime falls in another regime, whose route (or
            # FlashInfer, where that regime is closed: None) this sweep did not time.
            key, us = (_rule_key(route) if route is not None else ROUTE_FLASHINFER), None
            if route is not None and route.name == t["route"]:
                if route.split_kind == "balanced":
                    timed = balanced.get(route.target_ctas, {}).get(sample.step.step)
                    if timed is not None and timed[0] == tuple(sample.step.seq_lens):
                        us = timed[1]
                elif route.num_splits in timed_by_splits:  # the fixed rule, or the uniform cap's count
                    us = timed_by_splits[route.num_splits].samples[i].measured_us
            if us is None:
                key, us = f"{key} (not timed: S={splits}'s time)", sample.measured_us
            times.append(us)
            counts[key] += 1
        return times, counts

    def _regime_splits(self, points: dict, regime: str) -> int:
        """The regime's split count as fitted in ``points`` (split_points), else the calibration's."""
        return points.get(regime, {}).get("num_splits", self.calib.regime(regime).num_splits)

    def uniform_target_ctas(self, points: dict) -> int | None:
        """Calibration.uniform_target_ctas from the uniform traces (None where there are none): the
        fastest split count on them (fit_split_count) times their (row, KV head) pairs, or 0 (no
        cap) where that count is not below the regime's fitted one (the cap only lowers it)."""
        if not self._uniform:
            return None
        field = "uniform_target_ctas"
        # One max_active and a shared split candidate: pkv.config.checks refuses any other set.
        _, split_fit = self._fit_splits(self._uniform, field, f"the traces that fit {field} share no split candidate")
        batch = self._uniform[0]["max_active"]
        regime_splits = self._regime_splits(points, regime_of(batch))
        target = split_fit.num_splits * batch * self.shape.num_kv_heads if split_fit.num_splits < regime_splits else 0
        for t in self._uniform:
            self.records[t["name"]]["uniform_target_ctas"] = {
                "fitted": target, "regime_splits": regime_splits, "applied": self.settings.performance_result}
        self.decisions[field].update(value=target, applied=self.settings.performance_result)
        return target

    def _add_skewed(self, ct, trace, timed_trace) -> None:
        """Keep a trace that fits skew_target_ctas for balanced_rule_fits, which cuts it to the
        steps the balanced rule may take (skewed and over-split ones: the latter depend on the
        regime's split count, fitted after every trace has run). Like the uniform traces, its
        steps stay out of C_min and the plan times."""
        name = trace_name(trace)
        if not any(_is_skewed_step(s) for s in timed_trace.steps):
            raise ConfigError(f"conf/experiment/calibrate.yaml: field 'experiment.calibration_traces' entry {name} "
                              f"fits skew_target_ctas but none of its steps is skewed (a longest row holding more "
                              f"than 2/3 of the step's tokens): use a trace family such as skewed")
        self._skewed.append({"name": name, "max_active": trace.max_active, "regime": regime_of(trace.max_active),
                             "waves": [int(w) for w in ct.wave_candidates], "timed_trace": timed_trace})

    def balanced_rule_fits(self, points: dict) -> dict:
        """{regime: {"skew_target_ctas": ..., "over_split_balanced": ...}} of each regime with
        skewed traces, fitted on that regime's traces alone: at B64 the short rows' one-tile tasks
        are most of a skewed step's tasks, at B4 the long row's, so a budget need not carry over."""
        fits = {}
        for regime in dict.fromkeys(t["regime"] for t in self._skewed):
            traces = [t for t in self._skewed if t["regime"] == regime]
            fits[regime] = self._fit_balanced_rule(traces, self._regime_splits(points, regime))
        return fits

    def _fit_balanced_rule(self, traces: list[dict], regime_splits: int) -> dict:
        """One regime's balanced-rule parameters from its skewed traces.

        skew_target_ctas: the balanced rule's budget, in CTAs, with the least device time summed
        over their skewed steps (the fewest waves among those within SPLIT_TIE_FRACTION of it),
        where its gain over the fixed rule at the regime's fitted split count clears the noise
        band of those paired steps (pkv.policy.fits.measured_gain); else 0 (the fixed rule).
        over_split_balanced: whether the balanced rule at that budget clears the noise band over
        the fixed rule on the traces' over-split steps too (false where the budget is 0 or none
        of their steps is over-split)."""
        field, regime = "skew_target_ctas", traces[0]["regime"]
        # The budgets every trace lists (pkv.config.checks refuses a regime's set without one), each
        # timed on every trace: the others could not be compared.
        shared = sorted(set.intersection(*(set(t["waves"]) for t in traces)))
        num_sms = self.calib.num_sms
        skewed, over_split = _BalancedTotals(shared), _BalancedTotals(shared)
        keys = []
        for t in traces:
            timed_trace = t.pop("timed_trace")  # its K/V pages are freed once this trace is timed
            timed_trace.steps = [s for s in timed_trace.steps
                                 if _is_skewed_step(s) or is_over_split(s.batch_size, total_tokens(s.seq_lens),
                                                                        regime_splits)]
            fixed = StepRoute(ROUTE_WORKQUEUE, regime_splits, "fixed")
            timed = timed_trace.timed({"fixed": fixed, "flashinfer": FLASHINFER_ROUTE, **{
                w: dataclasses.replace(fixed, split_kind="balanced", target_ctas=w * num_sms) for w in shared}})
            for w in shared:
                # Each step's time by budget, for the route decision on the routes the policy runs.
                self._balanced_by_step.setdefault(t["name"], {})[w * num_sms] = {
                    s.step.step: (tuple(s.step.seq_lens), s.measured_us) for s in timed[w].samples}
            # The steps kept that are not skewed are the over-split ones.
            mine_skewed, mine_over_split = skewed.add(timed, _is_skewed_step), over_split.add(timed, _not_skewed)
            # Under its name, or beside the split sweep of the same trace (listed for both fits).
            key = f"{t['name']} (skewed steps)" if t["name"] in self.records else t["name"]
            keys.append(key)
            self.records[key] = {
                "route": ROUTE_WORKQUEUE, "fits": regime_field(regime, field), "steps": mine_skewed["steps"],
                "fitted_with": [u["name"] for u in traces], "regime_splits": regime_splits,
                **_by_rule_record(mine_skewed, shared),
                "over_split_steps": {"steps": mine_over_split["steps"], **_by_rule_record(mine_over_split, shared)},
            }
        wave_fit = fit_split_count(skewed.by_waves())
        waves = wave_fit.num_splits
        # Either rule is opened over the fixed one (its default) only where its gain on the paired
        # steps clears their noise band, as a regime's route is (pkv.policy.fits.measured_gain).
        gain = measured_gain(skewed.per_step[waves], skewed.per_step["fixed"])
        target = waves * num_sms if gain.clears else 0
        over_gain = (measured_gain(over_split.per_step[waves], over_split.per_step["fixed"])
                     if over_split.steps else None)
        over_split_fitted = bool(target and over_gain is not None and over_gain.clears)
        measured = gain.record()
        skew_record = {
            "fitted": target, "selected_waves": waves, "tied_waves": list(wave_fit.tied),
            "selected_at_edge": wave_fit.at_edge, "speedup_over_fixed": measured["measured_margin"],
            "num_sms": num_sms, "applied": self.settings.performance_result, **measured, "default": 0}
        skew_record["basis"] = gain.verdict(f"the balanced rule at {waves} wave{'s' if waves != 1 else ''}",
                                            "the fixed rule")
        over_record = {
            "fits": regime_field(regime, "over_split_balanced"), "fitted": over_split_fitted,
            "steps": over_split.steps,
            "speedup_over_fixed": over_gain.record()["measured_margin"] if over_gain else None,
            "applied": self.settings.performance_result, "default": False,
            **({k: v for k, v in over_gain.record().items() if k != "steps"} if over_gain else {})}
        if over_gain is None:
            over_record["basis"] = "no over-split steps: the fixed rule"
        elif not target:
            over_record["basis"] = "no skew budget, so no over-split rule: the fixed rule"
        else:
            over_record["basis"] = over_gain.verdict("the balanced rule", "the fixed rule")
        for key in keys:
            self.records[key][field] = skew_record
            self.records[key]["over_split_balanced"] = over_record
        self.decisions[regime_field(regime, field)] = {"value": target, **_decision_fields(skew_record)}
        self.decisions[regime_field(regime, "over_split_balanced")] = {"value": over_split_fitted,
                                                                       **_decision_fields(over_record)}
        return {field: target, "over_split_balanced": over_split_fitted}

    def short_row_fits(self, points: dict, fitted: Calibration) -> dict:
        """{SINGLE_ROW: {"bucket_tiles_per_split": T}} where single-row traces fit the short-row rule
        (else {}), recording the sweep either way.

        Each tile candidate runs every step on the route the policy gives it under ``fitted`` with
        the regime's fitted split count and that rule (RuledRoutePolicy: a short row at the largest
        power of two of splits holding T tiles each, a long one at the regime's count), the
        candidates of one step timed in turn. T is the fewest tiles within SPLIT_TIE_FRACTION of
        the least device time summed over the steps, taken where its gain over one tile a split
        (the rule off, the default) clears the noise band of those paired steps
        (pkv.policy.fits.measured_gain); else 1."""
        if not self._short_rows:
            return {}
        field = regime_field(SINGLE_ROW, "bucket_tiles_per_split")
        splits = self._regime_splits(points, SINGLE_ROW)
        # The candidates every trace lists (1 among them: pkv.config.checks), each timed on every trace.
        shared = sorted(set.intersection(*(set(t["tiles"]) for t in self._short_rows)))
        per_step: dict[int, list[float]] = {tiles: [] for tiles in shared}
        for t in self._short_rows:
            timed_trace = t.pop("timed_trace")  # its K/V pages are freed once this trace is timed
            policies = {tiles: RuledRoutePolicy(_opened_policy(
                fitted.with_regime(SINGLE_ROW, num_splits=splits, bucket_tiles_per_split=tiles), SINGLE_ROW,
                self.shape)) for tiles in shared}
            timed = timed_trace.timed(policies)
            for tiles in shared:
                per_step[tiles] += [sample.measured_us for sample in timed[tiles].samples]
            self.records[t["name"]] = {
                "route": ROUTE_BUCKET, "fits": field, "steps": len(timed_trace.steps), "regime_splits": splits,
                "fitted_with": [u["name"] for u in self._short_rows],
                "device_us_total_by_tiles": {str(tiles): timed[tiles].total_us for tiles in shared},
                # The splits each candidate cut the rows into (the route's count, at most the row's
                # tiles), by steps: what the rule made of them.
                "splits_by_tiles": {str(tiles): {str(k): n for k, n in sorted(Counter(
                    _bucket_splits(sample) for sample in timed[tiles].samples).items())} for tiles in shared},
                "device_us_by_step": {str(tiles): _step_times(timed[tiles]) for tiles in shared},
            }
        tiles_fit = fit_split_count({tiles: sum(us) for tiles, us in per_step.items()})
        tiles = tiles_fit.num_splits
        gain = measured_gain(per_step[tiles], per_step[1])
        fitted_tiles = tiles if tiles != 1 and gain.clears else 1
        measured = gain.record()
        record = {"fitted": fitted_tiles, "selected_tiles": tiles, "tied_tiles": list(tiles_fit.tied),
                  "selected_at_edge": tiles_fit.at_edge, "applied": self.settings.performance_result, **measured,
                  "default": 1,
                  "candidate_device_us_total": sum(per_step[tiles]), "default_device_us_total": sum(per_step[1])}
        record["basis"] = ("one tile a split is the fastest (within the band of the fastest)" if tiles == 1 else
                           gain.verdict(f"{tiles} tiles a split", "one tile a split"))
        for t in self._short_rows:
            self.records[t["name"]][field] = record
        self.decisions[field] = {"value": fitted_tiles, **_decision_fields(record)}
        return {SINGLE_ROW: {"bucket_tiles_per_split": fitted_tiles}}

    def gate_steps(self, points: dict, fitted: Calibration) -> dict[str, list[dict]]:
        """The steps of each regime timed on the route the policy takes there (length buckets at
        B1, else the workqueue) at the fitted split count, each on the route its step rules give
        it under ``fitted`` where the calibration timed that (ruled_samples): the long end of its
        context gate."""
        steps: dict[str, list[dict]] = {}
        for t in self._swept:
            if (t["route"] == ROUTE_BUCKET) == (t["max_active"] == 1):
                splits = points[t["regime"]]["num_splits"]
                ruled, counts = self.ruled_samples(t, splits, fitted)
                rows = _gate_rows(t["timed_by_splits"][splits], t["timed_fi"])
                rows["persistentkv_us"] = ruled
                steps.setdefault(regime_of(t["max_active"]), []).append(
                    {"source": f"split sweep {t['name']}", **rows, "steps_by_route": dict(counts)})
        return steps


def _opened_policy(calib: Calibration, regime: str, shape: ModelShape) -> RoutePolicy:
    """``calib``'s policy for ``shape`` with ``regime`` opened to the workqueue where it is closed:
    the routes a calibration times the regime's steps on, to decide whether to open it."""
    if calib.regime(regime).route == ROUTE_FLASHINFER:
        calib = calib.with_regime(regime, route=ROUTE_WORKQUEUE)
    return RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size, head_dim=shape.head_dim)


def _rule_key(route: StepRoute) -> str:
    """A step's route as a record counts it: the split count, or the balanced rule's budget."""
    if route.split_kind == "balanced":
        return f"{route.name} balanced ({route.target_ctas} CTAs)"
    return f"{route.name} S={route.num_splits}"


def _is_skewed_step(step) -> bool:
    return is_skewed(step.batch_size, int(max(step.seq_lens)), total_tokens(step.seq_lens))


def _not_skewed(step) -> bool:
    return not _is_skewed_step(step)


class _BalancedTotals:
    """Device time of one kind of step of the skewed traces (the skewed steps, or the over-split
    ones), by the rule that ran them: "fixed", "flashinfer", or the balanced rule's budget in
    waves. Each kept step's time is kept, in one step order for every rule: the paired steps
    whose spread gives a decision's noise band, and whose sums are the totals."""

    def __init__(self, waves):
        self.waves = list(waves)
        self.per_step: dict = {rule: [] for rule in ["fixed", "flashinfer", *self.waves]}

    @property
    def steps(self) -> int:
        return len(self.per_step["fixed"])

    @property
    def totals(self) -> dict:
        return {rule: sum(times) for rule, times in self.per_step.items()}

    def add(self, timed: dict, keep) -> dict:
        """Add the samples of ``timed`` (rule -> TimedSteps, one sample a step in the same order)
        whose step ``keep`` accepts; return this trace's own sums."""
        mine = dict.fromkeys(self.per_step, 0.0)
        for rule, steps in timed.items():
            kept = [sample.measured_us for sample in steps.samples if keep(sample.step)]
            self.per_step[rule] += kept
            mine[rule] = sum(kept)
        mine["steps"] = sum(1 for sample in timed["fixed"].samples if keep(sample.step))
        return mine

    def by_waves(self) -> dict:
        totals = self.totals
        return {w: totals[w] for w in self.waves}


def _by_rule_record(sums: dict, waves) -> dict:
    """A kind of step's device time by rule (_BalancedTotals.add) as the calibration records it."""
    return {"fixed_device_us_total": sums["fixed"], "device_us_total_by_waves": {str(w): sums[w] for w in waves},
            "flashinfer_device_us_total": sums["flashinfer"]}


class _GateProbes:
    """Traces timed on both routes at the fitted operating points, only to place gates: the short
    contexts of each regime's context gate, and the group sizes other than the model's."""

    def __init__(self, cfg, settings, shape, fitted, gate_steps: dict[str, list[dict]], tolerance: float):
        self.cfg, self.settings, self.shape, self.fitted, self.tolerance = cfg, settings, shape, fitted, tolerance
        self.gate_steps = {name: list(rows) for name, rows in gate_steps.items()}
        self.records: list[dict] = []
        self.group_totals: dict[int, list[dict]] = {}

    def run(self, probe) -> None:
        base = load_trace_option(probe.trace)
        trace = dataclasses.replace(
            base, max_active=probe.max_active, length_scale=base.length_scale * probe.length_scale,
            num_requests=probe.num_requests or base.num_requests)
        group = probe.group_size or self.shape.group_size
        shape = self.shape if group == self.shape.group_size else ModelShape(
            num_qo_heads=self.shape.num_qo_heads, num_kv_heads=self.shape.num_qo_heads // group,
            head_dim=self.shape.head_dim)
        regime = regime_of(probe.max_active)
        # The routes the policy would estimate this regime's steps on, opened where the calibration
        # closed it: a probe measures the candidate under its step rules, not the gate.
        policy = _opened_policy(self.fitted, regime, shape)
        route = policy.candidate(probe.max_active)
        timed_trace = _TimedTrace(self.cfg, self.settings, shape, trace)
        timed = timed_trace.timed({"ruled": RuledRoutePolicy(policy, route), "flashinfer": FLASHINFER_ROUTE})
        timed, timed_fi = timed["ruled"], timed["flashinfer"]
        name = f"{trace_name(trace)} x{probe.length_scale:g} G={group}"
        record = {"probe": name, "route": route.name, "num_splits": route.num_splits, "group_size": group,
                  "steps": len(timed_trace.steps), "persistentkv_device_us_total": timed.total_us,
                  "flashinfer_device_us_total": timed_fi.total_us,
                  # How many of its steps each rule's route ran (the regime's candidate, the balanced
                  # rule of a skewed or over-split step, the uniform cap's count).
                  "steps_by_route": dict(Counter(_rule_key(sample.route) for sample in timed.samples))}
        self.records.append(record)
        if group == self.shape.group_size:
            record["fits"] = regime_field(regime, "min_context_tokens")
            self.gate_steps.setdefault(regime, []).append({"source": f"probe {name}", **_gate_rows(timed, timed_fi)})
        else:
            record["fits"] = "supported_group_sizes"
            # The gain's interval over the probe's steps: group_size_holds keeps a probe whose
            # noise band (this interval, at least ROUTE_NOISE_FLOOR) straddles the required
            # margin on FlashInfer.
            gain = measured_gain([s.measured_us for s in timed.samples], [s.measured_us for s in timed_fi.samples])
            record["interval_half_width"] = gain.record()["interval_half_width"]
            # The FlashInfer path picked for each batch class of this shape probed so far (this
            # probe's among them): measurements.flashinfer_paths holds the model's shape only, and
            # this side of the margin moves with the pick.
            record["flashinfer_picks"] = {f"B{p['batch']} {p['longest_pow2']}": p["picked"]
                                          for p in (timed_trace.flashinfer_paths or {}).get("probed", [])}
            self.group_totals.setdefault(group, []).append(record)

    def fit_context_gates(self, start: Calibration) -> dict:
        """Each regime's gate from every step timed in it (split sweep and probes)."""
        fits = {}
        for regime, sources in self.gate_steps.items():
            rows = {key: [v for src in sources for v in src[key]]
                    for key in ("contexts", "persistentkv_us", "flashinfer_us")}
            gate = fit_context_gate(rows["contexts"], rows["persistentkv_us"], rows["flashinfer_us"],
                                    start.regime(regime).min_context_tokens, self.tolerance)
            fits[regime_field(regime, "min_context_tokens")] = {
                            "regime": regime, "fitted": gate.min_context_tokens,
                            "applied": self.settings.performance_result,
                            "tolerance": self.tolerance, "reason": gate.reason,
                            "sources": [src["source"] for src in sources],
                            "classes": {str(k): v for k, v in gate.classes.items()}}
        return fits

    def decisions(self, context_gates: dict, group_fit: dict) -> dict:
        """measurements.decisions of the gates and group sizes. Their rule holds PersistentKV where
        its device time is at most FlashInfer's x (1 + tolerance), so the band is the tolerance and
        a tie inside it goes to PersistentKV (the cheaper host path); the margin of a gate is its
        boundary class's (the shortest that held, else the longest measured), with the next shorter
        class's beside it, and a group size's is its worst probe's, with that probe's interval
        half-width (a group size opens only where every probe's interval clears the required
        margin: pkv.policy.fits.group_size_holds)."""
        required = 1.0 / (1.0 + self.tolerance)
        band = {"noise_band": self.tolerance, "required_margin": required}
        out = {}
        for field, fit in context_gates.items():
            ratios = {int(c): t["flashinfer_us"] / t["persistentkv_us"] for c, t in fit["classes"].items()}
            ordered = sorted(ratios)
            boundary = fit["fitted"] if fit["fitted"] in ratios else ordered[-1]
            below = [c for c in ordered if c < boundary]
            out[field] = {"value": fit["fitted"], "measured_margin": ratios[boundary], "boundary_class": boundary,
                          "margin_below": ratios[below[-1]] if below else None, **band,
                          "basis": fit["reason"], "applied": fit["applied"]}
        by_group = {}
        for group, records in sorted(self.group_totals.items()):
            worst = min(records, key=lambda r: r["flashinfer_device_us_total"] / r["persistentkv_device_us_total"])
            by_group[str(group)] = {
                "measured_margin": worst["flashinfer_device_us_total"] / worst["persistentkv_device_us_total"],
                "interval_half_width": worst.get("interval_half_width"), "opened": group in group_fit["opened"],
                # Both sides of the worst probe and FlashInfer's picks on it, so calibrations that
                # disagree show which side moved.
                **{key: worst[key] for key in ("probe", "flashinfer_device_us_total", "persistentkv_device_us_total",
                                               "flashinfer_picks") if key in worst}}
        if by_group:
            out["supported_group_sizes"] = {"value": group_fit["fitted"], "by_group": by_group, **band,
                                            "applied": group_fit["applied"]}
        return out

    def fit_group_sizes(self, start: Calibration) -> dict:
        """The configured group sizes, and each probed one where PersistentKV's device time held
        (beat FlashInfer's, or came within the tolerance) on every probe of that G."""
        opened = [g for g, records in self.group_totals.items() if group_size_holds(records, self.tolerance)]
        fitted = sorted(set(start.supported_group_sizes) | set(opened))
        return {"fitted": fitted, "applied": self.settings.performance_result, "tolerance": self.tolerance,
                "probed": sorted(self.group_totals), "opened": sorted(opened)}
