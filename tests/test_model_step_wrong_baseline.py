"""The model step (Table 9) under the trace harness's rule: where a path disagrees with the baseline,
the float64 reference decides who is wrong. A baseline path that is wrong is recorded and the run
goes on; a path under study that is wrong stops it, named with its float64 error."""

from __future__ import annotations

import math
import re

import pytest
import torch

from pkv.engines.sdpa import SdpaEngine
from pkv.measure.harness import CorrectnessError
from pkv.measure.model_step import ModelStep, StepShape
from pkv.measure.model_step_paths import EagerPath
from pkv.measure.model_step_run import ModelStepSpec, run_model_step
from pkv.pipeline.serving import ContinuousDecoder, page_layout
from pkv.policy import ROUTE_WORKQUEUE, PinnedRoutePolicy, StepRoute
from pkv.report.results import read_result, result_envelope, write_json_atomic
from wrong_engines import WrongReference, WrongSdpa

traces = pytest.importorskip("pkv.pipeline.traces")

SHAPE = StepShape(hidden=64, intermediate=96, num_qo_heads=8, num_kv_heads=2, head_dim=16, num_layers=2)
PAGE = 4
WARMUP, MEASURED, CHECK_EVERY = 2, 6, 2
BASELINE = "sdpa_eager"


class CorruptOutput:
    """A path whose final hidden state is wrong on the given steps (counted as CorruptsSteps
    counts them), as a replayed graph that read stale buffers would be; it wraps an eager path and
    is not one, so the run treats it as a graph path is treated."""

    def __init__(self, inner: EagerPath, bad=()):
        self.inner, self.bad = inner, frozenset(bad)
        self.label, self.mode, self.implementation = inner.label, inner.mode, inner.implementation
        self.ordinal: dict[int, int] = {}
        self._step = None

    @property
    def under_study(self):
        return self.inner.under_study

    @property
    def route(self):
        return self.inner.route

    @property
    def split_rule(self):
        return self.inner.split_rule

    @property
    def num_splits(self):
        return self.inner.num_splits

    def prepare(self, step, x):
        self.inner.prepare(step, x)

    def plan(self, step, x):
        self.ordinal.setdefault(int(step.step), len(self.ordinal))
        self._step = int(step.step)
        self.inner.plan(step, x)

    def issue(self):
        out = self.inner.issue()
        if self.ordinal[self._step] in self.bad:
            out = out.clone()
            out[0] += 10.0
        return out


def _studied_engine(**kwargs):
    return WrongReference(SHAPE.attention, policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 4)), **kwargs)


def _run(make_paths, baseline=BASELINE, rest=None, progress=False, kernel_profile_steps=0, kernel_profiler="torch"):
    """The tiny trace's model step over the paths ``make_paths(model)`` builds, float32 on the CPU;
    ``rest(model)`` makes the eager rest-of-step path where given."""
    lens = [(0, 30, 6), (0, 9, 4), (1, 61, 8), (2, 5, 5), (3, 22, 6)]
    requests = tuple(traces.Request(i, a, p, d) for i, (a, p, d) in enumerate(lens))
    total = WARMUP + MEASURED
    assignment = page_layout(requests, layout="recycled", page_size=PAGE, hole_fraction=0.0, seed=11, max_active=3,
                             max_steps=total)
    model = ModelStep(SHAPE, layers=2, num_pages=assignment.num_physical_pages, page_size=PAGE,
                      dtype=torch.float32, device="cpu", seed=11)
    spec = ModelStepSpec(name="tiny_b3", seed=11, warmup_steps=WARMUP, measured_steps=MEASURED,
                         check_every=CHECK_EVERY, beta_gbps=100.0, baseline=baseline, flush_l2=False,
                         kernel_profile_steps=kernel_profile_steps, kernel_profiler=kernel_profiler)
    decoder = ContinuousDecoder(requests, assignment, 3, max_steps=total)
    rests = {"eager": (rest or (lambda m: EagerPath("rest_eager", None, m)))(model)}
    return run_model_step(spec, model, decoder, make_paths(model), rests, layers_model=2, progress=progress)


def _eager(label, engine):
    return lambda model: EagerPath(label, engine, model)


def _paths(*makers):
    return lambda model: {path.label: path for path in (make(model) for make in makers)}


def test_the_path_roles():
    model = ModelStep(SHAPE, layers=1, num_pages=8, page_size=PAGE, dtype=torch.float32, device="cpu", seed=1)
    assert EagerPath("a", _studied_engine(), model).under_study
    assert not EagerPath("b", SdpaEngine(SHAPE.attention, "cpu"), model).under_study
    assert not EagerPath("rest", None, model).under_study


def test_a_wrong_baseline_path_is_recorded_and_the_run_goes_on(tmp_path):
    # Wrong on one warmup step, on measured step 1 (no periodic check: found through the
    # disagreement) and on measured step 2 (a periodic check step).
    results = _run(_paths(_eager(BASELINE, WrongSdpa(SHAPE.attention, "cpu", bad={0, WARMUP + 1, WARMUP + 2})),
                          _eager("adaptive_eager", _studied_engine()),
                          _eager("xqa_eager", SdpaEngine(SHAPE.attention, "cpu"))))
    base = results[BASELINE]
    assert (base["wrong_steps"], base["wrong_warmup_steps"], base["steps"]) == (2, 1, MEASURED)
    assert base["wrong_max_rel_err"] > 1e-2
    assert re.fullmatch(r"decode step \d+ \(B=\d+, seq_lens=\[[\d, ]+\]\) \(warmup\): relative error "
                        r"\d\.\d{3}e[+-]\d+ against the float64 reference \(limit 4e-04\)", base["first_wrong_step"])
    assert [i for i, s in enumerate(base["per_step"]) if s["wrong"]] == [1, 2]
    assert all(s["ref_rel_err"] > 1e-2 for s in base["per_step"] if s["wrong"])
    # Its attention's own float64 error, from the periodic check, is recorded and was not fatal.
    assert base["attention_ref_max_rel_err"] > 1e-4
    # The others were held to the float64 reference on those steps instead, and are intact.
    for label in ("adaptive_eager", "xqa_eager"):
        m = results[label]
        assert (m["wrong_steps"], m["wrong_warmup_steps"], m["first_wrong_step"]) == (0, 0, None), label
        assert m["steps"] == MEASURED and not any(s["wrong"] for s in m["per_step"]), label
        assert m["max_rel_err_vs_baseline"] < 4e-4 and m["ref_max_rel_err"] < 4e-4, label
        assert m["attention_ref_max_rel_err"] < 1e-4, label
        assert m["per_step"][1]["ref_rel_err"] < 4e-4 and m["per_step"][2]["ref_rel_err"] < 4e-4, label
    # The record round-trips through a result file and its validation.
    path = tmp_path / f"{BASELINE}.json"
    write_json_atomic(path, result_envelope("model_step", {"name": "tiny_b3"}, BASELINE, baseline_engine=BASELINE,
                                            run_id="r", performance_result=False, metrics=base, provenance={}))
    assert read_result(path)["metrics"]["wrong_steps"] == 2


def test_without_a_wrong_path_nothing_is_wrong_and_the_periodic_checks_are_on_their_steps():
    results = _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")),
                          _eager("adaptive_eager", _studied_engine())))
    for m in results.values():
        assert (m["wrong_steps"], m["wrong_warmup_steps"], m["first_wrong_step"]) == (0, 0, None)
        checked = [i for i, s in enumerate(m["per_step"]) if s["ref_rel_err"] is not None]
        assert checked == list(range(0, MEASURED, CHECK_EVERY))
        assert max(s["ref_rel_err"] for s in m["per_step"] if s["ref_rel_err"] is not None) == m["ref_max_rel_err"]


def test_a_non_finite_baseline_output_is_recorded_in_a_file_that_can_be_written(tmp_path):
    results = _run(_paths(_eager(BASELINE, WrongSdpa(SHAPE.attention, "cpu", bad={WARMUP + 1}, shift=math.nan)),
                          _eager("adaptive_eager", _studied_engine())))
    base = results[BASELINE]
    assert base["wrong_steps"] == 1 and base["wrong_max_rel_err"] is None
    assert base["per_step"][1]["wrong"] and base["per_step"][1]["ref_rel_err"] is None
    assert "an output that is not finite" in base["first_wrong_step"]
    assert results["adaptive_eager"]["wrong_steps"] == 0
    write_json_atomic(tmp_path / "b.json", result_envelope(
        "model_step", {"name": "tiny_b3"}, BASELINE, baseline_engine=BASELINE, run_id="r", performance_result=False,
        metrics=base, provenance={}))


def test_a_wrong_path_under_study_stops_the_run_named_with_its_float64_error():
    with pytest.raises(CorrectnessError) as info:
        _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")),
                    _eager("adaptive_eager", _studied_engine(bad={WARMUP + 1}))))
    msg = str(info.value)
    assert re.match(r"model step: engine 'adaptive_eager' disagrees with baseline 'sdpa_eager' at decode step \d+ "
                    r"\(B=\d+, seq_lens=\[[\d, ]+\]\): relative error \S+ of the final hidden state, bound 4\.0e-04; "
                    r"against the float64 reference it is wrong: relative error \d\.\d{3}e[+-]\d+ exceeds 4e-04 for "
                    r"torch.float32", msg), msg
    # The baseline is named right: its own float64 error is small and not marked wrong.
    rel = re.search(r"'sdpa_eager' \(baseline\) (\S+?)(,| \(wrong\)|\))", msg)
    assert rel and float(rel.group(1)) < 4e-4 and rel.group(2) != " (wrong)", msg


def test_a_path_whose_final_output_is_wrong_is_judged_as_an_eager_one_is():
    # A non-eager path (as a graph path is) under study whose output is wrong on a measured step.
    def studied_graph(model):
        return CorruptOutput(EagerPath("adaptive_graph", _studied_engine(), model), bad={WARMUP + 3})

    with pytest.raises(CorrectnessError, match=r"^model step: engine 'adaptive_graph' disagrees with baseline "
                       r"'sdpa_eager'.*against the float64 reference it is wrong"):
        _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")), studied_graph))
    # The same path as another library's (not under study): recorded, the run goes on.
    def baseline_graph(model):
        return CorruptOutput(EagerPath("xqa_graph", SdpaEngine(SHAPE.attention, "cpu"), model), bad={WARMUP + 3})

    results = _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")), baseline_graph,
                          _eager("adaptive_eager", _studied_engine())))
    assert results["xqa_graph"]["wrong_steps"] == 1 and results["xqa_graph"]["per_step"][3]["wrong"]
    assert results[BASELINE]["wrong_steps"] == 0 and results["adaptive_eager"]["wrong_steps"] == 0


def test_a_path_under_study_wrong_like_the_baseline_is_stopped_by_the_periodic_check():
    # Both wrong the same way on a check step: they agree, and the periodic float64 check finds the
    # path under study; the baseline's wrong step is no excuse for it.
    with pytest.raises(CorrectnessError, match=r"^model step: path 'adaptive_eager' at decode step \d+ \(B=\d+, "
                       r"seq_lens=\[[\d, ]+\]\): attention relative error \S+ against float64 exceeds 1e-04"):
        _run(_paths(_eager(BASELINE, WrongSdpa(SHAPE.attention, "cpu", bad={WARMUP + 2})),
                    _eager("adaptive_eager", _studied_engine(bad={WARMUP + 2}))))


def test_the_run_baseline_is_a_baseline_whatever_engine_it_is():
    # A PersistentKV stand-in as the run's baseline: its wrong steps are recorded, not fatal.
    results = _run(_paths(_eager("adaptive_eager", _studied_engine(bad={WARMUP + 3})),
                          _eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu"))), baseline="adaptive_eager")
    assert results["adaptive_eager"]["wrong_steps"] == 1 and results[BASELINE]["wrong_steps"] == 0


class CountingRest(EagerPath):
    """The step without attention, counting the batch size of each step it times."""

    def __init__(self, model):
        super().__init__("rest_eager", None, model)
        self.timed: list[int] = []

    def plan(self, step, x):
        self.timed.append(step.batch_size)
        super().plan(step, x)


def test_the_rest_of_the_step_is_timed_on_its_first_measured_steps_of_each_batch_size(capsys):
    from pkv.dag_timing import _DONE
    from pkv.measure.model_step_run import REST_SAMPLES

    rests = []
    metrics = _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention))),
                   rest=lambda model: rests.append(CountingRest(model)) or rests[0], progress=True)
    steps = metrics[BASELINE]["per_step"]
    batches = [s["batch"] for s in steps]
    want = [b for b in sorted(set(batches)) for _ in range(min(batches.count(b), REST_SAMPLES))]
    assert sorted(rests[0].timed) == want
    assert len(rests[0].timed) < len(steps)  # the tiny trace repeats a batch size past REST_SAMPLES
    # Every step of one batch size reads the same rest time, a median of its samples.
    by_batch = {}
    for s in steps:
        by_batch.setdefault(s["batch"], set()).add(s["rest_us"])
    assert all(len(times) == 1 and all(math.isfinite(t) for t in times) for times in by_batch.values())
    # The job's "done" line is the one pkv.dag_timing reads its measured loop from.
    done = _DONE.search(capsys.readouterr().err)
    assert done and float(done.group(1)) >= 0


def test_a_check_step_runs_one_float64_pass_that_holds_every_eager_engine(monkeypatch):
    """On the check_every-th steps one float64 step holds every eager engine's attention, layer by
    layer, on its own queries: one float64 attention a layer, however many eager engines there are."""
    from pkv.measure import model_step_run

    calls = []
    exact = model_step_run.dense_decode
    monkeypatch.setattr(model_step_run, "dense_decode", lambda *a, **k: calls.append(1) or exact(*a, **k))
    metrics = _run(_paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")),
                          _eager("adaptive_eager", _studied_engine())))
    checks = -(-MEASURED // CHECK_EVERY)
    assert len(calls) == checks * SHAPE.num_layers  # no step disagreed: no other float64 pass
    for label in (BASELINE, "adaptive_eager"):
        assert 0 < metrics[label]["attention_ref_max_rel_err"] < 1e-4, label
