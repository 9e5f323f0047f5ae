"""Who is wrong when an engine disagrees with the baseline: the float64 reference decides. A baseline
that is wrong is recorded and the run goes on; an engine under study that is wrong stops it. Tables
and the claims check take no ratio against a wrong baseline."""

import math
import re

import pytest

from pkv.engines.sdpa import SdpaEngine
from pkv.measure.harness import CorrectnessError, TraceRunSpec, run_trace
from pkv.policy import ROUTE_WORKQUEUE, PinnedRoutePolicy, StepRoute
from pkv.report import claims, evidence, table_data, tables
from pkv.report.results import ResultFileError, read_result, result_envelope, write_json_atomic
from pkv.report.table_data import BaselineWrong, MeanStd
from pkv.shape import ModelShape
from wrong_engines import WrongReference, WrongSdpa

traces = pytest.importorskip("pkv.pipeline.traces")

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
WARMUP, MEASURED, CHECK_EVERY = 2, 6, 2


def tiny_spec():
    lens = [(0, 300, 6), (0, 33, 4), (1, 700, 8), (2, 16, 5), (3, 120, 6)]
    requests = tuple(traces.Request(i, a, p, d) for i, (a, p, d) in enumerate(lens))
    return TraceRunSpec(name="tiny_b3", family="mixed", seed=11, requests=requests, max_active=3,
                        warmup_steps=WARMUP, measured_steps=MEASURED, dtype="float32", device="cpu",
                        check_every=CHECK_EVERY)


def studied(**kwargs):
    return WrongReference(SHAPE, policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 4)), **kwargs)


def test_the_engine_roles():
    assert studied().under_study and not SdpaEngine(SHAPE, "cpu").under_study


def test_a_wrong_baseline_is_recorded_and_the_run_goes_on(tmp_path):
    # Wrong on one warmup step, on measured step 1 (no periodic check: found through the
    # disagreement) and on measured step 2 (a periodic check step).
    engines = {"sdpa": WrongSdpa(SHAPE, "cpu", bad={0, WARMUP + 1, WARMUP + 2}), "workqueue": studied(),
               "other": SdpaEngine(SHAPE, "cpu")}
    results = run_trace(tiny_spec(), SHAPE, engines, "sdpa", progress=False)
    base = results["sdpa"]
    assert (base["wrong_steps"], base["wrong_warmup_steps"], base["steps"]) == (2, 1, MEASURED)
    assert base["wrong_max_rel_err"] > 1e-1
    assert re.fullmatch(r"decode step \d+ \(B=\d+, seq_lens=\[[\d, ]+\]\) \(warmup\): relative error "
                        r"\d\.\d{3}e[+-]\d+ against the float64 reference \(limit 1e-04\)", base["first_wrong_step"])
    assert [i for i, s in enumerate(base["per_step"]) if s["wrong"]] == [1, 2]
    assert all(s["ref_rel_err"] > 1e-1 for s in base["per_step"] if s["wrong"])
    # The others were held to the float64 reference on those steps instead, and are intact.
    for name in ("workqueue", "other"):
        m = results[name]
        assert (m["wrong_steps"], m["wrong_warmup_steps"], m["first_wrong_step"]) == (0, 0, None), name
        assert m["max_abs_err"] < 1e-5 and m["ref_max_rel_err"] < 1e-4, name
        assert m["steps"] == MEASURED and not any(s["wrong"] for s in m["per_step"]), name
        assert m["per_step"][1]["ref_rel_err"] < 1e-4 and m["per_step"][2]["ref_rel_err"] < 1e-4, name
    # The record round-trips through a result file and its validation.
    path = tmp_path / "sdpa.json"
    write_json_atomic(path, result_envelope("evaluate", {"name": "tiny_b3"}, "sdpa", baseline_engine="sdpa",
                                            run_id="r", performance_result=False, metrics=base, provenance={}))
    assert read_result(path)["metrics"]["wrong_steps"] == 2


def test_the_periodic_float64_check_records_a_wrong_baseline_it_finds():
    # Alone, the baseline disagrees with nobody: only the check_every-th measured steps look at float64.
    results = run_trace(tiny_spec(), SHAPE, {"sdpa": WrongSdpa(SHAPE, "cpu", bad={WARMUP + 1, WARMUP + 2})},
                        "sdpa", progress=False)
    assert results["sdpa"]["wrong_steps"] == 1  # measured step 2; step 1 is not a check step
    assert [s["wrong"] for s in results["sdpa"]["per_step"]][:3] == [False, False, True]


def test_a_non_finite_baseline_output_is_recorded_in_a_file_that_can_be_written(tmp_path):
    engines = {"sdpa": WrongSdpa(SHAPE, "cpu", bad={WARMUP}, shift=math.nan), "workqueue": studied()}
    base = run_trace(tiny_spec(), SHAPE, engines, "sdpa", progress=False)["sdpa"]
    assert base["wrong_steps"] == 1 and base["wrong_max_rel_err"] is None
    assert base["per_step"][0]["wrong"] and base["per_step"][0]["ref_rel_err"] is None
    assert "an output that is not finite" in base["first_wrong_step"]
    write_json_atomic(tmp_path / "sdpa.json", result_envelope(
        "evaluate", {"name": "tiny_b3"}, "sdpa", baseline_engine="sdpa", run_id="r", performance_result=False,
        metrics=base, provenance={}))


def test_a_wrong_engine_under_study_stops_the_run_named_with_its_float64_error():
    engines = {"sdpa": SdpaEngine(SHAPE, "cpu"), "studied": studied(bad={WARMUP + 1})}
    with pytest.raises(CorrectnessError) as info:
        run_trace(tiny_spec(), SHAPE, engines, "sdpa", progress=False)
    msg = str(info.value)
    assert re.match(r"engine 'studied' disagrees with baseline 'sdpa' at decode step \d+ \(B=\d+, "
                    r"seq_lens=\[[\d, ]+\]\): max\|e\|=.*; against the float64 reference it is wrong: "
                    r"relative error \d\.\d{3}e[+-]\d+ exceeds 1e-04 for torch.float32", msg), msg
    # The baseline is named right: its own float64 error is small and not marked wrong.
    rel = re.search(r"'sdpa' \(baseline\) (\S+?)(,| \(wrong\)|\))", msg)
    assert rel and float(rel.group(1)) < 1e-4 and rel.group(2) != " (wrong)", msg
    assert re.search(r"'studied' \S+ \(wrong\)", msg), msg


def test_an_engine_under_study_wrong_like_the_baseline_is_stopped_by_the_periodic_check():
    # Both wrong the same way: they agree, and the periodic float64 check finds them; the baseline's
    # wrong step is no excuse for the engine under study.
    engines = {"sdpa": WrongSdpa(SHAPE, "cpu", bad={WARMUP + 2}), "studied": studied(bad={WARMUP + 2})}
    with pytest.raises(CorrectnessError, match=r"^engine 'studied' at decode step \d+ \(B=\d+, seq_lens=\[[\d, ]+\]\): "
                       r"relative error \S+ against the float64 reference exceeds 1e-04.*'sdpa' \(baseline\) \S+ "
                       r"\(wrong\)"):
        run_trace(tiny_spec(), SHAPE, engines, "sdpa", progress=False)


def test_the_run_baseline_is_a_baseline_whatever_engine_it_is():
    # A PersistentKV stand-in as the run's baseline: its wrong steps are recorded, not fatal.
    engines = {"workqueue": studied(bad={WARMUP + 3}), "sdpa": SdpaEngine(SHAPE, "cpu")}
    results = run_trace(tiny_spec(), SHAPE, engines, "workqueue", progress=False)
    assert results["workqueue"]["wrong_steps"] == 1 and results["sdpa"]["wrong_steps"] == 0


def test_results_refuse_a_malformed_wrong_step_record():
    def envelope(**metrics):
        return result_envelope("evaluate", {"name": "t"}, "sdpa", baseline_engine="sdpa", run_id="r",
                               performance_result=False, metrics={"steps": 4, **metrics}, provenance={})

    envelope(wrong_steps=0, wrong_warmup_steps=0, wrong_max_rel_err=0.0, first_wrong_step=None)
    for bad, match in (({"wrong_steps": -1}, "wrong_steps"), ({"wrong_steps": True}, "wrong_steps"),
                       ({"wrong_steps": 5, "first_wrong_step": "x"}, "exceeds metrics.steps"),
                       ({"wrong_steps": 1}, "no first_wrong_step"),
                       ({"wrong_max_rel_err": "big"}, "wrong_max_rel_err")):
        with pytest.raises(ResultFileError, match=match):
            envelope(**bad)


# ---------------------------------------------------------------- tables and claims

SEEDS = (20260623, 20260624)
GPU_PROVENANCE = {"git_commit": "a" * 40, "git_dirty": False, "gpu_name": "FAKE-GPU"}


def _gpu_run(root, wrong_seeds, baseline="flashinfer"):
    """Bimodal B8 on two held-out seeds, adaptive at 1.08x the baseline; the baseline wrong on 3 of
    64 measured steps of ``wrong_seeds``."""
    for seed in SEEDS:
        for engine, tok_s in (("adaptive", 1080.0), ("flashinfer", 1000.0)):
            metrics = {"steps": 64, "cuda_tok_s": tok_s, "wall_tok_s": tok_s, "max_abs_err": 1e-5,
                       "mean_abs_err": 1e-6, "ref_max_rel_err": 1e-4, "selected_route": "persistentkv_workqueue",
                       "routes": {"persistentkv_workqueue": 64}, "num_splits": 20,
                       "wrong_steps": 0, "wrong_warmup_steps": 0, "wrong_max_rel_err": 0.0, "first_wrong_step": None}
            if engine == baseline and seed in wrong_seeds:
                metrics.update(wrong_steps=3, wrong_max_rel_err=2.158, first_wrong_step=(
                    "decode step 0 (B=8, seq_lens=[65540]): relative error 2.158e+00 against the float64 reference "
                    "(limit 1e-02)"), ref_max_rel_err=2.158)
            rec = result_envelope("evaluate", {"name": "bimodal_b8", "seed": seed}, engine,
                                  baseline_engine="flashinfer", run_id=f"r{seed}", performance_result=True,
                                  metrics=metrics, provenance=GPU_PROVENANCE)
            write_json_atomic(root / "evaluate" / "bimodal_b8" / f"seed{seed}" / f"{engine}.json", rec)


def test_no_ratio_is_taken_against_a_wrong_baseline(tmp_path):
    _gpu_run(tmp_path, wrong_seeds=SEEDS)
    ctx = table_data.table2(tmp_path)
    row = next(r for r in ctx["rows"] if r["trace"] == "bimodal_b8")
    assert isinstance(row["wall"], BaselineWrong) and isinstance(row["cuda"], BaselineWrong)
    assert (row["wall"].steps, row["wall"].of, row["wall"].rel_err) == (6, 128, pytest.approx(2.158))
    note = dict(ctx["notes"])[row["wall"].note]
    assert "baseline flashinfer wrong against the float64 reference on 3 of 64 measured steps" in note
    assert "first: decode step 0 (B=8, seq_lens=[65540])" in note and "no ratio taken" in note
    md, tex = tables.render_table(2, tmp_path, "md"), tables.render_table(2, tmp_path, "tex")
    assert f"baseline wrong on 6/128 steps (rel. err 2.2e+00 vs float64)[{row['wall'].note}]" in md
    assert "1.080" not in md
    assert r"baseline wrong on 6/128 steps (rel.~err $2.2{\cdot}10^{0}$ vs float64)\textsuperscript{" in tex
    # Table 6 does not grade the row, and no claim is reproduced from it.
    t6 = evidence.evidence_map(tmp_path)
    assert any(r["status"] == evidence.BASELINE_WRONG and isinstance(r["wall"], BaselineWrong) for r in t6["rows"])
    assert "Not graded (baseline wrong)" in tables.render_table(6, tmp_path, "md")
    rows = {r["claim"]: r for r in claims.claims_check(tmp_path)["rows"]}
    for claim in ("Bimodal B8: wall gain", "Bimodal B8: device-time gain"):
        verdict = rows[claim]["verdict"]
        assert verdict.startswith(f"{claims.NOT_APPLICABLE}: ") and \
            "baseline flashinfer wrong against the float64 reference" in verdict, verdict
    assert "baseline flashinfer wrong" in tables.render_named("claims", tmp_path, "md")


def test_a_seed_with_a_wrong_baseline_is_left_out_and_named(tmp_path):
    _gpu_run(tmp_path, wrong_seeds=(SEEDS[0],))
    ctx = table_data.table2(tmp_path)
    row = next(r for r in ctx["rows"] if r["trace"] == "bimodal_b8")
    assert isinstance(row["wall"], MeanStd) and row["wall"].n == 1 and row["wall"].mean == pytest.approx(1.08)
    marks = [dict(ctx["notes"])[m] for m in row["marks"]]
    assert any(f"seed {SEEDS[0]}: baseline flashinfer wrong" in m for m in marks), marks
    rows = {r["claim"]: r for r in claims.claims_check(tmp_path)["rows"]}
    value = rows["Bimodal B8: wall gain"]["value"]
    assert value == f"1.080 (1 seed) (left out, baseline wrong against float64: seed {SEEDS[0]})", value
