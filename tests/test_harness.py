"""The trace-run harness on a tiny CPU trace: contract keys, checks, routes and counters."""

from collections import Counter

import numpy as np
import pytest
import torch

from pkv.measure import harness
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.harness import CorrectnessError, TraceRunSpec, run_trace
from pkv.policy import ROUTE_BUCKET, ROUTE_WORKQUEUE, PinnedRoutePolicy, StepRoute
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
    "ref_max_rel_err", "routes", "selected_route", "num_splits", "split_rules", "counters", "implementation",
    "per_step", "wrong_steps", "wrong_warmup_steps", "wrong_max_rel_err", "first_wrong_step",
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


def pinned(route: StepRoute) -> ReferenceEngine:
    return ReferenceEngine(SHAPE, policy=PinnedRoutePolicy(route))


def engines():
    return {
        "sdpa": SdpaEngine(SHAPE, "cpu"),
        "workqueue": pinned(StepRoute(ROUTE_WORKQUEUE, 4)),
        "buckets": pinned(StepRoute(ROUTE_BUCKET, 3)),
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
        # Nobody was wrong; the sampled float64 checks are on their steps' records.
        assert (metrics["wrong_steps"], metrics["wrong_warmup_steps"], metrics["first_wrong_step"]) == (0, 0, None)
        assert not any(s["wrong"] for s in per_step)
        checked = [s["ref_rel_err"] for s in per_step if s["ref_rel_err"] is not None]
        assert len(checked) == len(range(0, steps, spec.check_every))
        assert max(checked) == metrics["ref_max_rel_err"]
    assert results["sdpa"]["max_abs_err"] == 0.0
    assert results["workqueue"]["routes"] == {"persistentkv_workqueue": steps}
    assert results["workqueue"]["num_splits"] == 4
    # Workqueue steps are counted by split rule; other routes have none.
    assert results["workqueue"]["split_rules"] == {"fixed": steps}
    assert results["buckets"]["split_rules"] == {} and results["sdpa"]["split_rules"] == {}
    assert {s["split_rule"] for s in results["workqueue"]["per_step"]} == {"fixed"}
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
    # The float64 reference decides which side is wrong: the engine under study, named with its error.
    with pytest.raises(CorrectnessError, match=r"'broken' disagrees with baseline 'sdpa' at decode step \d+ "
                       r"\(B=\d+, seq_lens=\[.*\]\).*against the float64 reference it is wrong: relative error"):
        run_trace(tiny_spec(), SHAPE, broken, "sdpa", progress=False)


class OffByRounding(SdpaEngine):
    """Another library's kernel that rounds differently: one output element off by 4e-3, twice
    the paper's max |e|, which is far below a wrong output's relative error."""

    def run(self, q, k_pages, v_pages, plan):
        out = super().run(q, k_pages, v_pages, plan).clone()
        out.view(-1)[0] += 4e-3
        return out


def test_the_papers_bound_binds_the_engines_under_study_and_other_baselines_are_held_to_the_relative_limit(
        monkeypatch):
    # The float16 limit, so that one element's 4e-3 is a rounding difference at this tiny shape.
    monkeypatch.setitem(harness.REF_REL_LIMIT, torch.float32, 1e-2)
    engines = {"sdpa": SdpaEngine(SHAPE, "cpu"), "other": OffByRounding(SHAPE, "cpu")}
    results = run_trace(tiny_spec(), SHAPE, engines, "sdpa", progress=False)
    assert results["other"]["max_abs_err"] == pytest.approx(4e-3, rel=1e-3)  # recorded, not refused
    held = OffByRounding(SHAPE, "cpu")
    held.held_to_paper_bound = True
    with pytest.raises(CorrectnessError, match=r"'held' disagrees with baseline 'sdpa'.*bound 0.002"):
        run_trace(tiny_spec(), SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu"), "held": held}, "sdpa", progress=False)
    # Another library's kernel that is wrong against float64 is a baseline's wrong output: recorded,
    # not a reason to stop the run (tests/test_wrong_baseline.py).
    broken = DropsLastTile(SHAPE)
    broken.held_to_paper_bound = False
    results = run_trace(tiny_spec(), SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu"), "broken": broken}, "sdpa",
                        progress=False)
    assert results["broken"]["wrong_steps"] == results["broken"]["steps"]
    assert results["broken"]["wrong_max_rel_err"] > 1e-2 and results["sdpa"]["wrong_steps"] == 0


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
    routes_part, places_part, after_part = text.split("\n\n")
    # The CPU profile's line, the header (its device column the host clock), one route group per engine.
    assert routes_part.startswith("CPU profile: not a performance result") and "cpu-clock us" in routes_part
    assert "cuda us" not in text and len(routes_part.splitlines()) == 2 + len(results)
    assert "ran first" in places_part and "ran second" in places_part
    assert "ran right after" in after_part and "(ran first)" in after_part and "sdpa" in after_part
    with pytest.raises(FileNotFoundError, match="no result files"):
        report(tmp_path / "missing")


def test_counters_follow_the_merge_of_the_route_the_plan_was_made_for():
    """step_counters reads plan.merge: a fused merge has no merge launch, a cluster merge neither
    and no partial states; a plan without one (FlashInfer's) is one library call."""
    from pkv.engines import build_engine
    from pkv.pipeline.step import build_step
    from pkv.policy import FLASHINFER_ROUTE, Calibration, KernelVariants, RegimeParams, RoutePolicy

    lens = [300, 700, 40, 500]
    step = build_step(0, np.arange(len(lens)), lens, pages_mod.assign_pages(lens, 16, 0.0, 0).pages, 16)

    def counters_of(engine):
        plan = engine.plan(step)
        return plan, harness.step_counters(plan, step, SHAPE, num_sms=2, kv_dtype_bytes=4)

    _, launch = counters_of(pinned(StepRoute(ROUTE_WORKQUEUE, 4)))
    plan, fused = counters_of(pinned(StepRoute(ROUTE_WORKQUEUE, 4, merge="fused")))
    assert plan.merge == "fused"
    assert (launch.merge_launches, fused.merge_launches) == (1, 0)
    assert fused.launches == launch.launches - 1 and fused.merge_bytes == launch.merge_bytes > 0
    _, bucket_launch = counters_of(pinned(StepRoute(ROUTE_BUCKET, 4)))
    plan, cluster = counters_of(pinned(StepRoute(ROUTE_BUCKET, 4, merge="cluster")))
    assert plan.merge == "cluster" and bucket_launch.merge_launches > 0
    assert (cluster.merge_launches, cluster.merge_bytes) == (0, 0)
    assert cluster.decode_ctas == bucket_launch.decode_ctas
    # The adaptive engine's plan carries the merge of the route its policy chose.
    calib = Calibration(gpu="cpu", num_sms=2, beta_gbps=10.0, lambda_us=5.0, c_min=1.0,
                        single_row=RegimeParams("persistentkv_bucket", 4, 0, 1.05),
                        few_rows=RegimeParams("persistentkv_workqueue", 4, 0, 1e-3),
                        many_rows=RegimeParams("persistentkv_workqueue", 4, 0, 1.05))
    policy = RoutePolicy(calib, num_kv_heads=SHAPE.num_kv_heads, group_size=SHAPE.group_size,
                         head_dim=SHAPE.head_dim, variants=KernelVariants(merge="fused"))
    plan, adaptive = counters_of(build_engine("adaptive", shape=SHAPE, device="cpu", policy=policy))
    assert plan.route == ROUTE_WORKQUEUE and plan.merge == "fused"
    assert adaptive == fused
    flashinfer = SdpaEngine(SHAPE, "cpu").plan(step)
    assert flashinfer.route == FLASHINFER_ROUTE.name and flashinfer.schedule is None
    counted = harness.step_counters(flashinfer, step, SHAPE, num_sms=2, kv_dtype_bytes=4)
    assert (counted.launches, counted.merge_launches, counted.merge_bytes) == (1, 0, 0)


def test_run_trace_counts_merge_launches_by_the_route_merge():
    spec = tiny_spec()
    engines_by_merge = {"sdpa": SdpaEngine(SHAPE, "cpu"), "launch": pinned(StepRoute(ROUTE_WORKQUEUE, 4)),
                        "fused": pinned(StepRoute(ROUTE_WORKQUEUE, 4, merge="fused"))}
    results = run_trace(spec, SHAPE, engines_by_merge, "sdpa", progress=False)
    assert results["launch"]["counters"]["merge_launches"] == 1.0
    assert results["fused"]["counters"]["merge_launches"] == 0.0
    assert results["fused"]["implementation"] == "reference:workqueue+fused_merge"


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_engine_order_puts_every_engine_after_every_other_equally_often(count):
    """Rotation alone keeps one cyclic order, so an engine always follows the same one; the
    Williams design balances places and predecessors over its rows, each row holding every engine."""
    from pkv.measure.harness import engine_order

    names = [f"e{i}" for i in range(count)]
    rows = count if count % 2 == 0 else 2 * count
    places, after = Counter(), Counter()
    for index in range(3 * rows):  # three passes over the design
        order = engine_order(names, index)
        assert sorted(order) == names
        assert order == engine_order(names, index + rows)  # the design repeats
        places.update((name, place) for place, name in enumerate(order))
        after.update(zip(order, order[1:]))
    assert set(places.values()) == {3 * rows // count}
    assert len(after) == count * (count - 1)
    assert len(set(after.values())) <= 1


def test_engine_order_of_no_engines_is_empty():
    from pkv.measure.harness import engine_order

    assert engine_order([], 3) == []


def test_step_records_name_the_engine_that_ran_right_before():
    spec = tiny_spec()
    results = run_trace(spec, SHAPE, engines(), "sdpa", progress=False)
    for metrics in results.values():
        for record in metrics["per_step"]:
            assert (record["after"] is None) == (record["position"] == 0)
            assert record["after"] in (None, *results)
