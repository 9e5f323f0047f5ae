"""The trace-run harness on a tiny CPU trace: contract keys, checks, routes and counters."""

import numpy as np
import pytest

from pkv.measure import harness
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.harness import CorrectnessError, TraceRunSpec, run_trace
from pkv.shape import ModelShape

traces = pytest.importorskip("pkv.pipeline.traces")
serving = pytest.importorskip("pkv.pipeline.serving")
pages_mod = pytest.importorskip("pkv.pipeline.pages")
schedule = pytest.importorskip("pkv.pipeline.schedule")
pytest.importorskip("pkv.pipeline.counters")

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
METRIC_KEYS = {
    "steps", "decode_tokens", "cuda_ms_total", "wall_ms_total", "cuda_ms_per_step",
    "wall_ms_per_step", "plan_ms_per_step", "issue_ms_per_step", "cuda_tok_s", "wall_tok_s", "max_abs_err", "mean_abs_err",
    "ref_max_rel_err", "routes", "selected_route", "num_splits", "counters", "implementation", "per_step",
}
COUNTER_KEYS = {"launches_per_step", "decode_ctas_per_sm", "useful_kv_mib", "merge_mib",
                "merge_launches"}


def tiny_requests():
    lens = [(0, 300, 6), (0, 33, 4), (1, 700, 8), (2, 16, 5), (3, 120, 6)]
    return tuple(traces.Request(i, a, p, d) for i, (a, p, d) in enumerate(lens))


def tiny_spec(**overrides):
    fields = dict(name="tiny_b3", family="mixed", seed=11, requests=tiny_requests(), max_active=3,
                  warmup_steps=2, measured_steps=6, dtype="float32", device="cpu", check_every=2,
                  flush_l2=True)
    fields.update(overrides)
    return TraceRunSpec(**fields)


def engines():
    return {
        "sdpa": SdpaEngine(SHAPE, "cpu"),
        "workqueue": ReferenceEngine(SHAPE, split_policy=schedule.SplitPolicy(num_splits=4)),
        "buckets": ReferenceEngine(SHAPE, route="bucket_exact", bucket_num_splits=3),
    }


def expected_tokens(spec):
    assignment = pages_mod.assign_pages([r.total_len for r in spec.requests], spec.page_size,
                                        spec.hole_fraction, spec.seed)
    steps = list(serving.ContinuousDecoder(list(spec.requests), assignment, spec.max_active,
                                           spec.warmup_steps + spec.measured_steps).steps())
    measured = steps[spec.warmup_steps:]
    return len(measured), sum(s.batch_size for s in measured)


def test_run_trace_returns_the_contract_metrics_for_every_engine():
    spec = tiny_spec()
    results = run_trace(spec, SHAPE, engines(), "sdpa", progress=False)
    steps, tokens = expected_tokens(spec)
    assert set(results) == {"sdpa", "workqueue", "buckets"}
    for name, metrics in results.items():
        assert set(metrics) == METRIC_KEYS, name
        assert set(metrics["counters"]) == COUNTER_KEYS
        assert metrics["steps"] == steps and metrics["decode_tokens"] == tokens
        # Device time comes from a second run of each step, so it is not bounded by the wall
        # time of the first; the host parts are timed inside the wall step and are.
        assert metrics["wall_ms_total"] > 0 and metrics["cuda_ms_total"] > 0
        assert 0 < metrics["plan_ms_per_step"] + metrics["issue_ms_per_step"] <= metrics["wall_ms_per_step"]
        assert metrics["wall_tok_s"] == pytest.approx(tokens / (metrics["wall_ms_total"] / 1e3))
        assert metrics["ref_max_rel_err"] < 1e-4
        assert sum(metrics["routes"].values()) == steps
        per_step = metrics["per_step"]
        assert len(per_step) == steps and sum(s["batch"] for s in per_step) == tokens
        assert sum(s["wall_us"] for s in per_step) == pytest.approx(metrics["wall_ms_total"] * 1e3)
        assert sum(s["cuda_us"] for s in per_step) == pytest.approx(metrics["cuda_ms_total"] * 1e3)
        assert {s["route"] for s in per_step} == set(metrics["routes"])
    assert results["sdpa"]["max_abs_err"] == 0.0
    assert results["workqueue"]["routes"] == {"persistentkv_workqueue": steps}
    assert results["workqueue"]["num_splits"] == 4
    assert results["buckets"]["selected_route"] == "persistentkv_bucket"
    assert results["sdpa"]["selected_route"] == "flashinfer"
    assert results["sdpa"]["counters"]["launches_per_step"] == 1.0
    assert results["workqueue"]["counters"]["launches_per_step"] == 2.0
    assert results["workqueue"]["implementation"] == "reference:workqueue"
    # Every engine reads the same pages, so the useful KV traffic is identical.
    kv = {m["counters"]["useful_kv_mib"] for m in results.values()}
    assert len(kv) == 1


class DropsLastTile(ReferenceEngine):
    """A broken engine: forgets the last tile of every row longer than one tile."""

    def run(self, q, k_pages, v_pages, plan):
        step = plan.step
        lens = np.asarray(step.seq_lens).copy()
        lens[lens > 32] -= 32
        short = type(step)(**{**step.__dict__, "seq_lens": lens.astype(np.int32)})
        return super().run(q, k_pages, v_pages, self.plan(short))


def test_run_trace_stops_when_an_engine_disagrees_with_the_baseline():
    broken = {"sdpa": SdpaEngine(SHAPE, "cpu"), "broken": DropsLastTile(SHAPE)}
    with pytest.raises(CorrectnessError, match="'broken' disagrees with baseline 'sdpa'"):
        run_trace(tiny_spec(), SHAPE, broken, "sdpa", progress=False)


def test_run_trace_with_mlp_tail_and_progress(monkeypatch, capsys):
    monkeypatch.setattr(harness, "PROGRESS_EVERY_S", 0.0)
    spec = tiny_spec(mlp_tail=True, measured_steps=3)
    results = run_trace(spec, SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu")}, "sdpa", progress=True)
    assert results["sdpa"]["steps"] == 3
    err = capsys.readouterr().err
    assert "[tiny_b3] step 1/5" in err and "done" in err


def test_run_trace_rejects_bad_arguments():
    with pytest.raises(ValueError, match="baseline engine 'flashinfer'"):
        run_trace(tiny_spec(), SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu")}, "flashinfer")
    with pytest.raises(ValueError, match="page_size"):
        tiny_spec(page_size=0)
    with pytest.raises(ValueError, match="dtype"):
        tiny_spec(dtype="float8")
    with pytest.raises(ValueError, match="requests"):
        tiny_spec(requests=[])
    with pytest.raises(ValueError, match="warmup steps"):
        run_trace(tiny_spec(warmup_steps=500), SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu")}, "sdpa",
                  progress=False)
    with pytest.raises(ValueError, match="'/'"):
        run_trace(tiny_spec(), SHAPE, {"a/b": SdpaEngine(SHAPE, "cpu")}, "a/b", progress=False)


def test_queries_are_fresh_per_step_and_reproducible():
    assert harness.query_seed(1, 2) == harness.query_seed(1, 2)
    assert harness.query_seed(1, 2) != harness.query_seed(1, 3)


class CountsCalls(SdpaEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plans = 0
        self.runs = 0

    def plan(self, step):
        self.plans += 1
        return super().plan(step)

    def run(self, q, k_pages, v_pages, plan):
        self.runs += 1
        return super().run(q, k_pages, v_pages, plan)


def test_device_time_comes_from_a_second_run_of_each_measured_step():
    """The wall pass plans and runs once per step; measured steps run the same plan once more
    behind the device hold, for the device timer."""
    spec = tiny_spec(warmup_steps=2, measured_steps=4)
    engine = CountsCalls(SHAPE, "cpu")
    results = run_trace(spec, SHAPE, {"sdpa": engine}, "sdpa", progress=False)
    steps = results["sdpa"]["steps"]
    assert steps == 4
    assert engine.plans == 2 + steps and engine.runs == 2 + 2 * steps


def test_step_report_groups_the_per_step_records(tmp_path):
    from pkv.report.results import result_envelope, write_json_atomic
    from pkv.report.step_report import group_steps, report, wall_by_position

    spec = tiny_spec()
    results = run_trace(spec, SHAPE, engines(), "sdpa", progress=False)
    steps, _ = expected_tokens(spec)
    for name, metrics in results.items():
        groups = group_steps(metrics["per_step"])
        assert sum(g["steps"] for g in groups.values()) == steps
        mean_wall = sum(g["steps"] * g["wall_us"] for g in groups.values()) / steps
        assert mean_wall == pytest.approx(metrics["wall_ms_per_step"] * 1e3)
        write_json_atomic(tmp_path / f"{name}.json", result_envelope(
            "evaluate", {"name": spec.name, "seed": spec.seed}, name, baseline_engine="sdpa", run_id="r",
            performance_result=False, metrics=metrics, provenance={}))
        # The order rotates each step: every engine ran first, second and third equally often
        # (give or take one step), and the by-place means add back up to the run's mean.
        by_position = wall_by_position(metrics["per_step"])
        counts = [g["steps"] for g in by_position.values()]
        assert sum(counts) == steps and max(counts) - min(counts) <= 1
        assert sum(g["steps"] * g["wall_us"] for g in by_position.values()) / steps == \
            pytest.approx(metrics["wall_ms_per_step"] * 1e3)
    text = report(tmp_path)
    assert "persistentkv_workqueue" in text and "persistentkv_bucket" in text
    routes_part, places_part = text.split("\n\n")
    assert len(routes_part.splitlines()) == 1 + len(results)  # one route group per engine here
    assert "ran first" in places_part and "ran second" in places_part
    with pytest.raises(FileNotFoundError, match="no result files"):
        report(tmp_path / "missing")


def test_counters_follow_the_merge_option_of_the_engine_or_the_one_inside_it():
    import types

    plain = types.SimpleNamespace()
    assert harness.merge_options(plain) == {"fused_merge": False, "cluster_merge": False}
    cluster = types.SimpleNamespace(cluster_merge=True, fused_merge=False)
    assert harness.merge_options(cluster) == {"fused_merge": False, "cluster_merge": True}
    adaptive = types.SimpleNamespace(persistent=types.SimpleNamespace(fused_merge=True))
    assert harness.merge_options(adaptive) == {"fused_merge": True, "cluster_merge": False}
