"""The real CPU DAG, end to end, in a copy of the checkout on reduced axes.

It runs every rule (build, calibrate, every trace experiment and ablation, profile, tables,
figures) with the CPU profile, then checks that all nine tables exist, that `snakemake --report`
holds every table, the claims check and every figure, that a second run has nothing to do and that
deleting one result file reruns only the job that wrote it, the tables and the figures drawn from it.
"""

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The DAG needs Snakemake (the `workflow` extra); without it there is nothing to run.
pytest.importorskip("snakemake", reason="snakemake is not installed (pip install -e '.[workflow]')")

REPO = Path(__file__).resolve().parent.parent
COPIED = ("Snakefile", "workflow", "config", "conf", "pkv", "csrc", "paper_tables", "traces",
          "pyproject.toml", "environment.yml")

# Snakemake merges this over config/config.yaml key by key: traces not wanted are emptied.
AXES = """\
gpu: cpu
held_out_seeds: [20260623]
evaluate_traces: [bimodal_b8]
mlp_traces: [bimodal_b8]
model_step_traces: [bimodal_b8]
isolated_contexts: [8192]
ablations:
  splits: {seeds: [20260623], variants: {bimodal_b8: [splits=20], bucketed_b1: []}}
  raggedness: {seeds: [20260623], variants: {bimodal_b8: [route=bucket_exact]}}
  gqa: {seeds: [20260623], variants: {bimodal_b8: [G=4]}}
  graph: {seeds: [20260623], variants: {bimodal_b4: [splits=28]}}
  fused_merge: {seeds: [20260623], variants: {bimodal_b4: [splits=28], bimodal_b8: []}}
  b4: {seeds: [20260623], variants: {bimodal_b4: [splits=28]}}
"""


def _copy_checkout(dest: Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "artifacts"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def _snakemake(cwd: Path, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--configfile", "axes.yaml", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=900, env={**os.environ, **env})


def _planned_rules(proc) -> dict[str, int]:
    counts = {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"\s*([a-z_0-9]+)\s+(\d+)\s*", line)
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


@pytest.fixture(scope="module")
def finished_dag(tmp_path_factory):
    work = tmp_path_factory.mktemp("dag")
    _copy_checkout(work)
    (work / "axes.yaml").write_text(AXES)
    # The CPU workers stay warm for the runs the tests make in this tree (the last of them, with
    # PKV_WORKER_KEEP unset, stops them; the teardown stops whatever a failed test left).
    proc = _snakemake(work, "--cores", "2", PKV_WORKER_KEEP="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    yield work
    subprocess.run([sys.executable, "-m", "pkv.worker", "stop", "--slot-dir", "artifacts/.slots"], cwd=work,
                   capture_output=True, timeout=120)


def test_all_nine_tables_are_rendered(finished_dag):
    tables = finished_dag / "artifacts" / "cpu" / "tables"
    for k in range(1, 10):
        for ext in ("md", "tex"):
            path = tables / f"table{k}.{ext}"
            assert path.is_file() and path.stat().st_size > 0, path
    logs = finished_dag / "artifacts" / "cpu" / "logs"
    assert (logs / "calibrate.log").is_file() and (logs / "tables.log").is_file()


def test_gpu_benchmarks_record_why_they_did_not_run(finished_dag):
    import json

    for name in ("kernel_bench/decode.json", "host_bench/host.json"):
        record = json.loads((finished_dag / "artifacts" / "cpu" / name).read_text())
        assert record["skipped"] == "no GPU" and record["provenance"]["git_commit"], name


def test_calibration_records_every_gate_fit_but_keeps_the_cpu_gates(finished_dag):
    import json

    record = json.loads((finished_dag / "artifacts/cpu/calibration/calibration.json").read_text())
    measured = record["provenance"]["measurements"]
    gates = measured["context_gates"]
    assert set(gates) == {f"regimes.{r}.min_context_tokens" for r in ("single_row", "few_rows", "many_rows")}
    for name, gate in gates.items():
        assert gate["applied"] is False and gate["classes"] and gate["reason"], name
        # Each regime's gate draws on its split sweep and on the short-context probes of conf/experiment.
        assert any(src.startswith("split sweep") for src in gate["sources"]), name
        assert any(src.startswith("probe") for src in gate["sources"]), name
    probes = measured["gate_probes"]
    assert {p["group_size"] for p in probes} == {1, 4, 8}
    assert all(p["persistentkv_device_us_total"] > 0 and p["flashinfer_device_us_total"] > 0 for p in probes)
    groups = measured["group_sizes"]
    assert groups["applied"] is False and groups["probed"] == [1, 8]
    # conf/gpu/cpu.yaml: CPU times decide nothing
    regimes = record["calibration"]["regimes"]
    assert [regimes[r]["min_context_tokens"] for r in ("single_row", "few_rows", "many_rows")] == [256] * 3
    assert record["calibration"]["supported_group_sizes"] == [4]
    from pkv.report.calibration_report import report

    text = report(finished_dag / "artifacts/cpu/calibration/calibration.json")
    assert "context gates" in text and "gate probes" in text and "(not applied)" in text


def test_calibration_fits_the_few_rows_split_count_and_records_its_route(finished_dag):
    import json

    record = json.loads((finished_dag / "artifacts/cpu/calibration/calibration.json").read_text())
    sweep = record["provenance"]["measurements"]["split_sweeps"]["bimodal_b4"]
    assert sweep["fits"] == "regimes.few_rows.num_splits"
    assert record["calibration"]["regimes"]["few_rows"]["num_splits"] == sweep["selected_splits"]
    totals = {int(s): us for s, us in sweep["device_us_total_by_splits"].items()}
    fastest = min(totals, key=totals.get)
    # Candidates within SPLIT_TIE_FRACTION of the fastest are tied; the tie goes to the fewest splits.
    from pkv.policy.fits import SPLIT_TIE_FRACTION

    tied = sorted(s for s, us in totals.items() if us <= totals[fastest] * (1 + SPLIT_TIE_FRACTION))
    assert (sweep["fastest_splits"], sweep["tied_splits"], sweep["selected_splits"]) == (fastest, tied, tied[0])
    edges = (min(totals), max(totals))
    assert sweep["selected_at_edge"] == (fastest in edges or tied[0] in edges)
    # The steps behind each sum, in step order, FlashInfer's beside the counts'.
    by_step = sweep["device_us_by_step"]
    assert set(by_step) == {str(s) for s in totals} | {"flashinfer"}
    assert all(len(times) == sweep["steps"] for times in by_step.values())
    for s, us in totals.items():
        assert sum(by_step[str(s)]) == pytest.approx(us, abs=1e-3 * sweep["steps"])  # each step rounded to 0.001 us
    route = sweep["regime_route"]
    assert route["applied"] is False and route["fitted"] in ("flashinfer", "persistentkv_workqueue")
    # conf/gpu/cpu.yaml: CPU times decide nothing
    assert record["calibration"]["regimes"]["few_rows"]["route"] == "flashinfer"


def test_every_result_keeps_its_steps(finished_dag):
    import json

    record = json.loads((finished_dag / "artifacts/cpu/evaluate/bimodal_b8/seed20260623/adaptive.json").read_text())
    metrics = record["metrics"]
    assert len(metrics["per_step"]) == metrics["steps"]
    assert {s["route"] for s in metrics["per_step"]} == set(metrics["routes"])


FIGURES = ("isolated_time", "kernel_floor", "serving_ratio", "route_mix", "host_device", "model_step_ratio")


def test_report_holds_every_table_figure_and_the_claims_check(finished_dag):
    proc = _snakemake(finished_dag, "--report", "report.html")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    page = (finished_dag / "report.html").read_text()
    entries = dict(re.findall(r'"(artifacts/cpu/[^"]+)": (\{"name".*?"data_uri": "[^"]*")', page))
    wanted = [f"artifacts/cpu/tables/table{k}.html" for k in range(1, 10)] + ["artifacts/cpu/tables/claims.html"]
    wanted += [f"artifacts/cpu/figures/{name}.png" for name in FIGURES]
    assert sorted(entries) == sorted(wanted), sorted(entries)
    for path in wanted:
        entry = entries[path]
        # Every entry has a caption and a category; a figure's caption names its result files and commit.
        assert re.search(r'"caption": "<p>.+?</p>', entry), path
        if path.endswith(".png"):
            assert "Result files under" in entry and "Commit:" in entry, path
    assert all(f'"{c}"' in page for c in ("Tables", "Figures", "Claims check"))
    claims = entries["artifacts/cpu/tables/claims.html"]
    text = base64.b64decode(claims.rsplit("base64,", 1)[1]).decode()
    performance_rows = [row for row in re.findall(r"<tr>.*?</tr>", text) if "<td>performance</td>" in row]
    assert performance_rows and all("no verdict on performance is possible" in row for row in performance_rows)
    for k in (2, 3, 7, 8, 9):
        table = base64.b64decode(entries[f"artifacts/cpu/tables/table{k}.html"].rsplit("base64,", 1)[1]).decode()
        assert "CPU profile: not a performance result" in table and "CUDA tok/s" not in table, k


def test_table9_has_the_cpu_rows_and_says_why_graph_and_xqa_did_not_run(finished_dag):
    import json

    md = (finished_dag / "artifacts/cpu/tables/table9.md").read_text()
    adaptive_row = next(line for line in md.splitlines() if line.startswith("| Bimodal B8 | Adaptive route | eager |"))
    route = adaptive_row.split(" | ")[3]  # the route its steps took on the CPU profile's policy
    assert route.startswith(("PersistentKV", "FlashInfer")) and " | 2/32 | 1 | " in adaptive_row, adaptive_row
    assert "| Bimodal B8 | FlashInfer | eager | FlashInfer |" in md
    assert "not available: CUDA graphs need a CUDA device" in md and "not available: XQA needs a CUDA device" in md
    record = json.loads((finished_dag / "artifacts/cpu/model_step/bimodal_b8/seed20260623/adaptive_eager.json")
                        .read_text())
    assert record["performance_result"] is False and record["provenance"]["git_commit"]
    metrics = record["metrics"]
    assert (metrics["layers_run"], metrics["layers_model"]) == (2, 32) and metrics["ref_max_rel_err"] < 1e-4
    assert 0 < metrics["attention_share"] < 1 and len(metrics["per_step"]) == metrics["steps"]


def test_the_jobs_ran_in_warm_workers(finished_dag):
    import json

    proc = subprocess.run([sys.executable, "-m", "pkv.dag_timing", "rules", "--workdir", str(finished_dag),
                           "--json", str(finished_dag / "rules.json")], cwd=finished_dag, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["rule"]: r for r in json.loads((finished_dag / "rules.json").read_text())["rules"]}
    # Every job but the build ran warm (on the CPU profile the tables and figures too).
    for rule in ("calibrate", "evaluate", "mlp", "model_step", "isolated", "ablate_b4", "profile", "kernel_bench",
                 "tables", "figure"):
        assert rows[rule]["warm_jobs"] == rows[rule]["jobs"] >= 1, rows[rule]
    assert rows["build"]["warm_jobs"] == 0
    assert rows["evaluate"]["median_s_not_measuring"] is not None
    assert "| evaluate |" in proc.stdout and "s from the first job's start" in proc.stdout


ABLATION_RUN = "ablate/graph/splits=28/bimodal_b4/seed20260623"


def test_the_ab_reruns_a_dag_run_fresh_and_warm_and_sets_them_side_by_side(finished_dag, tmp_path):
    import json

    out = tmp_path / "ab"
    # No device here: the fresh arm's slot wrapper need not look for one.
    proc = subprocess.run([sys.executable, "-m", "pkv.dag_timing", "ab", "--root", "artifacts/cpu", "--out", str(out),
                           "--rounds", "1", "evaluate/bimodal_b8/seed20260623", ABLATION_RUN], cwd=finished_dag,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PKV_FAKE_DEVICE_COUNT": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "ab.json").read_text())
    for name in ("evaluate/bimodal_b8/seed20260623", ABLATION_RUN):  # a variant folder holds "="
        runs = report["runs"][name]
        assert set(runs) == {"fresh", "warm"} and all("failed" not in r for rounds in runs.values() for r in rounds)
    summary = report["summary"]["evaluate/bimodal_b8/seed20260623"]
    assert {"adaptive.speedup_cuda", "adaptive.cuda_ms_per_step", "flashinfer.wall_ms_per_step"} <= set(summary)
    assert "| evaluate/bimodal_b8/seed20260623 | adaptive.speedup_cuda |" in (out / "ab.md").read_text()
    # The warm arm ran in the worker the DAG's jobs had run in, the fresh one in a process of its own.
    logs = {arm: (out / "logs" / arm / "round0" / "evaluate/bimodal_b8/seed20260623.log").read_text()
            for arm in ("fresh", "warm")}
    assert re.match(r"pkv\.worker: job (\d+)", logs["warm"]) and int(re.match(r"pkv\.worker: job (\d+)",
                                                                            logs["warm"]).group(1)) > 1
    assert "pkv.worker: job" not in logs["fresh"]
    # What the two arms wrote is the same but for what a clock decides (CPU times are noise, not
    # results): the run in a worker that ran the DAG's other jobs first, and the one in a fresh process.
    arms = {arm: out / arm / "round0" / "evaluate/bimodal_b8/seed20260623" for arm in ("fresh", "warm")}
    names = sorted(p.name for p in arms["fresh"].glob("*.json"))
    assert names == ["adaptive.json", "flashinfer.json", "xqa.json"]
    for name in names:
        fresh, warm = (json.loads((arms[arm] / name).read_text()) for arm in ("fresh", "warm"))
        assert _untimed(fresh) == _untimed(warm), name
    configs = [(arms[arm] / ".run" / ".hydra" / "config.yaml").read_text().replace(str(arms[arm]), "OUT")
               for arm in ("fresh", "warm")]
    assert configs[0] == configs[1]


# Keys of what a clock measured: milliseconds, microseconds, seconds, tokens per second.
_CLOCKED = re.compile(r"(^|_)(ms|us|s|tok_s)(_|$)")


def _untimed(record):
    """A result without what a clock decides: times, rates, timestamps, run ids and paths."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items()
                if not _CLOCKED.search(k) and k not in ("run_id", "timestamp_utc", "out", "provenance")}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    return record


def test_second_run_has_nothing_to_do(finished_dag):
    proc = _snakemake(finished_dag, "-n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_deleting_one_result_reruns_only_its_dependents(finished_dag):
    result = finished_dag / "artifacts/cpu/evaluate/bimodal_b8/seed20260623/adaptive.json"
    assert result.is_file()
    result.unlink()
    proc = _snakemake(finished_dag, "-n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The two figures drawn from evaluate/ (the serving ratios and the route mix), not the others.
    assert _planned_rules(proc) == {"evaluate": 1, "tables": 1, "figure": 2, "all": 1}, proc.stdout[-3000:]
    proc = _snakemake(finished_dag, "--cores", "2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert result.is_file()
    assert "Nothing to be done" in _snakemake(finished_dag, "-n").stdout
    # The rerun's jobs ran in the workers the earlier runs kept warm, and its end stopped them.
    log = (finished_dag / "artifacts/cpu/logs/evaluate/bimodal_b8/seed20260623.log").read_text()
    assert int(re.match(r"pkv\.worker: job (\d+)", log).group(1)) > 1
    assert not list((finished_dag / "artifacts" / ".slots").glob("*.sock"))
