"""pkv.report.claims: every claim gets the paper's value, this run's value from the result files, a
tolerance and a verdict; the CPU profile gives no verdict on performance."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.report import claims, tables
from pkv.report.results import result_envelope, write_json_atomic

FIXTURE = Path(__file__).parent / "fixtures" / "results" / "fake_gpu"


def _rows(root):
    return {r["claim"]: r for r in claims.claims_check(root)["rows"]}


def test_every_claim_has_a_value_a_tolerance_and_a_verdict():
    ctx = claims.claims_check(FIXTURE)
    assert len(ctx["rows"]) == len(claims.CLAIMS)
    for row in ctx["rows"]:
        assert row["paper"] and row["tolerance"] and row["value"], row
        assert row["verdict"].split(":")[0] in (claims.REPRODUCED, claims.DIFFERS, claims.NOT_APPLICABLE), row
    assert sum(ctx["counts"].values()) == len(ctx["rows"])


def test_fixture_verdicts_follow_the_tolerances():
    rows = _rows(FIXTURE)
    # Bimodal B8 wall 1.05 / 1.10 in the fixture: mean 1.075, within 2 x 0.050 of 1.080.
    row = rows["Bimodal B8: wall gain"]
    assert row["value"].startswith("1.075 ± 0.035 (2 seeds)") and row["verdict"] == claims.REPRODUCED
    assert rows["B4 boundary routed to FlashInfer"]["verdict"] == claims.REPRODUCED
    assert rows["Launches per step, exact length buckets (held-out bimodal B8)"]["verdict"] == claims.DIFFERS
    assert rows["Uniform B8: wall gain"]["verdict"] == f"{claims.NOT_APPLICABLE}: evaluate/uniform_b8: not run"
    # vLLM was skipped in the fixture: nothing to compare.
    assert rows["Isolated B1: PersistentKV over vLLM time"]["verdict"] == \
        f"{claims.NOT_APPLICABLE}: vLLM PagedAttention v2: fixture: vllm not installed"


def _cpu_run(root: Path) -> None:
    prov = {"git_commit": "c" * 40, "gpu_name": None}
    for seed in (20260623, 20260624):
        for engine, wall, route in (("adaptive", 30.0, "persistentkv_workqueue"), ("flashinfer", 20.0, "flashinfer")):
            metrics = {"cuda_tok_s": wall, "wall_tok_s": wall, "max_abs_err": 1e-6, "mean_abs_err": 1e-7,
                       "selected_route": route, "num_splits": 20}
            rec = result_envelope("evaluate", {"name": "bimodal_b8", "seed": seed}, engine,
                                  baseline_engine="flashinfer", run_id=f"r{seed}", performance_result=False,
                                  metrics=metrics, provenance=prov)
            write_json_atomic(root / "evaluate" / "bimodal_b8" / f"seed{seed}" / f"{engine}.json", rec)


def test_cpu_profile_gives_no_performance_verdict(tmp_path):
    root = tmp_path / "artifacts" / "cpu"
    _cpu_run(root)
    ctx = claims.claims_check(root)
    assert ctx["performance_note"] == "CPU profile: not a performance result"
    for row in ctx["rows"]:
        if row["kind"] == claims.PERFORMANCE:
            assert claims.NO_PERFORMANCE_VERDICT in row["verdict"], row
    rows = {r["claim"]: r for r in ctx["rows"]}
    # The value is still computed and shown: 1.5 on both seeds.
    assert rows["Bimodal B8: wall gain"]["value"] == "1.500 ± 0.000 (2 seeds)"
    assert rows["Bimodal B8 routed to the PersistentKV workqueue"]["verdict"].startswith(claims.NOT_APPLICABLE)
    # Correctness is checked on every profile.
    errors = rows["Serving errors within max|e| < 2e-3 and mean|e| < 3e-4 (largest max 6.104e-05)"]
    assert errors["verdict"] == claims.REPRODUCED and errors["value"] == "max 1.000e-06, mean 1.000e-07"


def test_claims_table_renders_in_both_formats(tmp_path):
    root = tmp_path / "artifacts" / "cpu"
    _cpu_run(root)
    md, tex = tables.render_named("claims", root, "md"), tables.render_named("claims", root, "tex")
    assert "| Bimodal B8: wall gain | Table 2 | performance | 1.080 ± 0.050 | 1.500 ± 0.000 (2 seeds) |" in md
    assert "no verdict on performance is possible" in md and "CPU profile: not a performance result" in md
    assert "\\label{tab:claims}" in tex and "1.080 $\\pm$ 0.050" in tex


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.claim[:40])
def test_no_claim_fails_on_an_empty_root(tmp_path, claim):
    measured = claim.measure(claims.Results(tmp_path))
    assert measured.missing, claim.claim
