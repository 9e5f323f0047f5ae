import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from pkv.policy import Calibration, RegimeParams, save_calibration
from pkv.policy.calibration import LEGACY_SCHEMA
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal
from pkv.report import claims, evidence, table_data, tables
from pkv.report.results import result_envelope, write_json_atomic
from pkv.report.table_data import Inputs, MeanStd, Missing, NotApplicable, Num, Sci, Text

FIXTURE = Path(__file__).parent / "fixtures" / "results" / "fake_gpu"


def _row(rows, key, value):
    matches = [r for r in rows if r.get(key) == value]
    assert len(matches) == 1, (key, value, rows)
    return matches[0]


def _note_text(ctx, cell):
    assert isinstance(cell, Missing), cell
    return dict(ctx["notes"])[cell.note]


# ---------------------------------------------------------------- aggregation on the synthetic tree


def test_table2_ratios_within_run_and_over_held_out_seeds():
    ctx = table_data.table2(FIXTURE)
    row = _row(ctx["rows"], "trace", "bimodal_b8")
    # seed 20260622 is the calibration seed and seed 20260625 mixes two runs: only 23 and 24 count.
    cuda = [1100.0 / 1000.0, 1200.0 / 1000.0]
    wall = [1050.0 / 1000.0, 1100.0 / 1000.0]
    assert row["seeds"] == 2
    assert row["cuda"].mean == pytest.approx(statistics.fmean(cuda))
    assert row["cuda"].std == pytest.approx(statistics.stdev(cuda))
    assert row["wall"].mean == pytest.approx(statistics.fmean(wall))
    assert row["wall"].std == pytest.approx(statistics.stdev(wall))
    assert row["max_err"].value == pytest.approx(6.1e-5)
    assert row["mean_err"].value == pytest.approx(5.0e-6)
    assert row["route"].text == "PersistentKV workqueue, split 20"
    marks = [dict(ctx["notes"])[m] for m in row["marks"]]
    assert any("different runs" in m and "20260625" in m for m in marks)


def test_table2_skipped_and_not_run_rows():
    ctx = table_data.table2(FIXTURE)
    b1 = _row(ctx["rows"], "trace", "bucketed_b1")
    assert "skipped: fixture: engine unavailable" in _note_text(ctx, b1["wall"])
    zipf = _row(ctx["rows"], "trace", "zipf_b8")
    assert "not run" in _note_text(ctx, zipf["cuda"])
    assert "evaluate/zipf_b8" in ctx["not_run"]
    assert ctx["performance_result"] is True
    assert "FAKE-GPU" in ctx["device"]


def test_table1_milliseconds_and_skipped_method():
    ctx = table_data.table1(FIXTURE)
    assert [c["tokens"] for c in ctx["contexts"]] == [8192, 32768]
    assert "isolated/ctx65536.json" in ctx["not_run"]
    fi = _row(ctx["rows"], "method", "flashinfer")
    assert fi["cells"][0]["ms"].value == pytest.approx(0.1201)
    assert fi["rel_err"].value == pytest.approx(3.0e-3)
    vllm = _row(ctx["rows"], "method", "vllm")
    assert "vllm not installed" in _note_text(ctx, vllm["cells"][1]["ms"])


def test_table3_per_engine_mean_std_and_ratio_row():
    ctx = table_data.table3(FIXTURE)
    block = ctx["blocks"][0]
    adaptive = _row(block["rows"], "engine", "adaptive")
    assert adaptive["cuda_tok_s"].mean == pytest.approx(120.0)
    assert adaptive["cuda_tok_s"].std == pytest.approx(statistics.stdev([110.0, 130.0]))
    assert adaptive["wall_ms_per_step"].mean == pytest.approx(4.0)
    ratios = [105.0 / 100.0, 120.0 / 100.0]
    assert block["ratio"]["wall"].mean == pytest.approx(statistics.fmean(ratios))
    assert block["ratio"]["wall"].suffix == "×"


def test_table4_counter_means():
    ctx = table_data.table4(FIXTURE)
    exact = _row(ctx["rows"], "label", "PersistentKV exact buckets")
    assert exact["launches_per_step"].value == pytest.approx(statistics.fmean([16.0, 17.0]))
    wq = _row(ctx["rows"], "label", "PersistentKV workqueue")
    assert wq["launches_per_step"].value == pytest.approx(2.5)
    fi = _row(ctx["rows"], "label", "FlashInfer")
    assert fi["launches_per_step"].value == pytest.approx(1.0)
    assert "decode_ctas_per_sm not reported" in _note_text(ctx, fi["decode_ctas_per_sm"])
    adaptive = _row(ctx["rows"], "label", "Adaptive route")
    assert adaptive["launches_per_step"].value == pytest.approx(3.0)  # seeds 23 and 24 report it


def test_table5_kernels_and_missing_counter():
    ctx = table_data.table5(FIXTURE)
    assert ctx["skipped"] is None
    merge = _row(ctx["rows"], "name", "pkv_merge")
    assert merge["time_ms"].value == pytest.approx(0.014)
    assert "l2_hit_pct not captured" in _note_text(ctx, merge["l2_hit_pct"])


def test_table7_and_table8():
    t7 = table_data.table7(FIXTURE)
    row = t7["rows"][0]
    assert [p["splits"] for p in row["points"]] == [16, 20]
    assert row["points"][0]["cuda"].mean == pytest.approx(1.3)
    assert row["points"][1]["wall"].mean == pytest.approx(1.15)
    t8 = table_data.table8(FIXTURE)
    assert [(r["group"].value, r["hkv"].value) for r in t8["rows"]] == [(1, 32), (4, 8)]
    assert t8["rows"][0]["route"].text == "FlashInfer"
    assert t8["rows"][1]["wall"].mean == pytest.approx(1.24)


def test_evidence_statuses_from_measured_ratios():
    ctx = evidence.evidence_map(FIXTURE)
    rows = {r["regime"]: r for r in ctx["rows"]}
    assert rows["Bimodal B8 serving"]["status"] == evidence.POSITIVE
    assert "2 held-out seeds" in rows["Bimodal B8 serving"]["evidence"]
    assert "raggedness ablation (2 variants)" in rows["Bimodal B8 serving"]["evidence"]
    # The policy ran FlashInfer itself on these (0.95 and 0.99 in the fixture): no grade either way.
    assert rows["Bimodal B4 serving"]["status"] == evidence.NOT_GRADED
    assert rows["GQA sweep G=1, Bimodal B8"]["status"] == evidence.NOT_GRADED
    assert rows["GQA sweep G=4, Bimodal B8"]["status"] == evidence.POSITIVE
    assert rows["Zipf B8 serving"]["status"] == evidence.NOT_RUN
    assert rows["Bucketed B1 serving"]["status"] == evidence.NOT_RUN  # only a skipped record
    assert rows["Cost-model constants"]["status"] == evidence.RECORDED
    assert all(r["qualifier"] is None for r in ctx["rows"])


def test_evidence_names_the_calibrated_operating_points(tmp_path):
    path = tmp_path / "calibration" / "calibration.json"
    calib = Calibration(gpu="fake", num_sms=4, beta_gbps=100.0, lambda_us=5.0, c_min=1.0,
                        single_row=RegimeParams("persistentkv_bucket", 36, 8192, 1.05),
                        few_rows=RegimeParams("persistentkv_workqueue", 24, 1024, 1.50),
                        many_rows=RegimeParams("persistentkv_workqueue", 28, 8192, 1.05),
                        supported_group_sizes=(4, 8))
    save_calibration(path, calib, {"git_commit": "0" * 40})
    row = {r["regime"]: r for r in evidence.evidence_map(tmp_path)["rows"]}["Cost-model constants"]
    assert row["status"] == evidence.RECORDED
    assert row["evidence"].endswith(
        "B1 bucket S=36 from 8192 tokens; B2-7 workqueue S=24 from 1024 tokens; "
        "B8+ workqueue S=28 from 8192 tokens; G routed: 4, 8")
    # The short-row rule, where the file sets it.
    short = dataclasses.replace(calib, single_row=RegimeParams("persistentkv_bucket", 36, 8192, 1.05,
                                                               bucket_tiles_per_split=4))
    save_calibration(path, short, {"git_commit": "0" * 40})
    assert "B1 short rows at least 4 tiles a split (fewer splits, a power of two); G routed" in \
        evidence.calibration_evidence(path)
    # A flat calibration written before the boundary was fitted reads with the default: FlashInfer.
    legacy = {"gpu": "fake", "num_sms": 4, "beta_gbps": 100.0, "lambda_us": 5.0, "c_min": 1.0,
              "min_context_tokens": 8192, "bucket_num_splits": 36, "workqueue_num_splits": 28,
              "boundary_min_context_tokens": 1024, "supported_group_sizes": [4, 8]}
    path.write_text(json.dumps({"schema": LEGACY_SCHEMA, "calibration": legacy}))
    assert "B2-7 FlashInfer;" in evidence.calibration_evidence(path)


@pytest.mark.parametrize("ratio, status", [
    (1.02, evidence.POSITIVE), (1.0199, evidence.NO_REGRESSION), (0.98, evidence.NO_REGRESSION),
    (0.9799, evidence.REGRESSION),
])
def test_status_thresholds(ratio, status):
    assert evidence.status_of(ratio) == status


# ---------------------------------------------------------------- CPU profile marker


def _write_run(root, trace, seed, run_id, adaptive_wall, baseline_wall, performance_result, prov, stage="evaluate",
               adaptive_routes=None):
    for engine, wall in (("adaptive", adaptive_wall), ("flashinfer", baseline_wall)):
        metrics = {"cuda_tok_s": wall, "wall_tok_s": wall, "max_abs_err": 1e-6, "mean_abs_err": 1e-7,
                   "selected_route": "persistentkv_workqueue" if engine == "adaptive" else "flashinfer",
                   "num_splits": 4}
        if engine == "adaptive" and adaptive_routes:
            metrics["routes"] = adaptive_routes
        rec = result_envelope("evaluate", {"name": trace, "seed": seed}, engine, baseline_engine="flashinfer",
                              run_id=run_id, performance_result=performance_result, metrics=metrics,
                              provenance=prov)
        write_json_atomic(root / stage / trace / f"seed{seed}" / f"{engine}.json", rec)


@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu") / "artifacts" / "cpu"
    prov = collect_provenance({"profile": "cpu"}, 0)
    prov["gpu_name"] = None  # the CPU profile, whatever machine runs the tests
    _write_run(root, "bimodal_b8", 20260623, "a", 30.0, 20.0, False, prov)
    _write_run(root, "bimodal_b8", 20260624, "b", 33.0, 30.0, False, prov)
    write_json_atomic(root / "profile" / "ncu_counters.json",
                      {"performance_result": False, "skipped": "no GPU", "provenance": prov})
    return root


def test_cpu_profile_marked_not_a_performance_result(cpu_root, tmp_path):
    ctx = table_data.table2(cpu_root)
    assert ctx["performance_result"] is False
    assert ctx["performance_note"] == "CPU profile: not a performance result"
    assert ctx["device"] == "CPU only (no GPU)"
    out = tmp_path / "tables"
    written = tables.render_all(cpu_root, out)
    assert sorted(p.name for p in written) == sorted(
        f"{name}.{f}" for name in tables.output_names() for f in ("md", "tex", "html"))
    for path in written:
        assert "not a performance result" in path.read_text().lower(), path.name
    t6 = (out / "table6.md").read_text()
    assert "Positive (CPU profile: not a performance result)" in t6
    t5 = (out / "table5.md").read_text()
    assert "no GPU" in t5
    # No CUDA events on the CPU: the device-time columns say which clock they read.
    for fmt in ("md", "tex"):
        text = (out / f"table2.{fmt}").read_text()
        assert "CUDA tok/s" not in text and "CPU-clock tok/s" in text, fmt
        assert "reads the host clock" in text, fmt


def test_cpu_profile_ratio_values_in_both_formats(cpu_root):
    wall = [30.0 / 20.0, 33.0 / 30.0]
    mean, std = statistics.fmean(wall), statistics.stdev(wall)
    md = tables.render_table(2, cpu_root, "md")
    tex = tables.render_table(2, cpu_root, "tex")
    assert f"{mean:.3f} ± {std:.3f}" in md
    assert f"${mean:.3f}{{\\pm}}{std:.3f}$" in tex


# ---------------------------------------------------------------- rendering


def test_render_all_fixture_contains_computed_numbers(tmp_path):
    written = tables.render_all(FIXTURE, tmp_path)
    assert len(written) == 3 * 10  # tables 1-9 and the claims check, as md, tex and html
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    ctx = table_data.table2(FIXTURE)
    row = _row(ctx["rows"], "trace", "bimodal_b8")
    md, tex = (tmp_path / "table2.md").read_text(), (tmp_path / "table2.tex").read_text()
    assert f"{row['cuda'].mean:.3f} ± {row['cuda'].std:.3f}" in md
    assert f"${row['wall'].mean:.3f}{{\\pm}}{row['wall'].std:.3f}$" in tex
    assert "6.100e-05" in md and r"$6.100{\cdot}10^{-5}$" in tex
    assert "bimodal\\_b8" in tex  # LaTeX text is escaped
    assert "Not run: `evaluate/uniform_b8`" in md
    assert "Commit: f1x7ure00000" in md
    for k in range(1, 9):
        assert "FAKE-GPU" in (tmp_path / f"table{k}.md").read_text()
        assert "\\begin{table}" in (tmp_path / f"table{k}.tex").read_text()
    t1 = (tmp_path / "table1.md").read_text()
    assert "| FlashInfer, best path | 0.1201 | 0.81 | 0.4404 | 0.88 |" in t1
    # The paper's MMHA row stays, saying why it is absent and which row runs TensorRT-LLM's kernel.
    assert "| TensorRT-LLM MMHA | –[" in t1 and "TensorRT-LLM XQA runs on the same pages" in t1
    assert "fixture: vllm not installed" in t1
    assert "CUDA tok/s ratio" in md and "host clock" not in md  # a GPU run keeps its CUDA columns
    # The HTML page of a table holds the Markdown's text and numbers.
    page = (tmp_path / "table2.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<table>" in page
    assert f"{row['cuda'].mean:.3f} ± {row['cuda'].std:.3f}" in page and "Max |e|" in page


def test_table1_skip_footnote_names_the_method_once_and_stand_ins_are_named(tmp_path):
    root = tmp_path / "artifacts" / "cpu"
    prov = {"git_commit": "c" * 40, "gpu_name": None}
    methods = {"flashinfer": {"median_us": 200.0, "fraction_of_floor": 0.1, "rel_err": 1e-7, "implementation": "sdpa"},
               "persistentkv": {"median_us": 100.0, "fraction_of_floor": 0.2, "rel_err": 1e-7,
                                "implementation": "reference:workqueue"},
               "vllm": {"skipped": "vLLM PagedAttention v2 needs a CUDA device, got cpu"},
               "xqa": {"skipped": "no build for this GPU"},
               "sdpa": {"median_us": 300.0, "fraction_of_floor": 0.05, "rel_err": 1e-7, "implementation": "sdpa",
                        "selected": "sdpa"}}
    record = {"schema": "pkv.result/1", "performance_result": False, "provenance": prov,
              "metrics": {"methods": methods}}
    write_json_atomic(root / "isolated" / "ctx8192.json", record)
    ctx = table_data.table1(root)
    notes = [reason for _, reason in ctx["notes"]]
    # A reason that names its library stands as it is; one that does not gets the method's label.
    assert "vLLM PagedAttention v2 needs a CUDA device, got cpu" in notes
    assert "TensorRT-LLM XQA (via FlashInfer): no build for this GPU" in notes
    assert not any("vllm: " in n for n in notes) and not any("no relative error" in n for n in notes)
    # A method that ran as itself, its one engine, needs no note of what ran.
    assert _row(ctx["rows"], "method", "sdpa")["marks"] == []
    fi = _row(ctx["rows"], "method", "flashinfer")
    assert "repack + PyTorch SDPA" in dict(ctx["notes"])[fi["marks"][0]]
    pk = _row(ctx["rows"], "method", "persistentkv")
    assert "torch reference engine" in dict(ctx["notes"])[pk["marks"][0]]
    md = tables.render_table(1, root, "md")
    assert f"| FlashInfer, best path[{fi['marks'][0]}] | 0.2000 |" in md


def test_table1_names_the_code_and_the_path_behind_each_number(tmp_path):
    root = tmp_path / "artifacts" / "gpu"
    prov = {"git_commit": "c" * 40, "gpu_name": "H"}
    for ctx, selected in ((8192, "flashinfer_cc"), (32768, "flashinfer_tc")):
        methods = {"flashinfer": {"median_us": 50.0, "fraction_of_floor": 0.6, "rel_err": 1e-4,
                                  "implementation": "flashinfer-0.7.2.post1-cc", "selected": selected},
                   "xqa": {"median_us": 49.0, "fraction_of_floor": 0.6, "rel_err": 2e-4,
                           "implementation": "trtllm-xqa-via-flashinfer-0.7.2.post1"}}
        write_json_atomic(root / "isolated" / f"ctx{ctx}.json",
                          {"schema": "pkv.result/1", "performance_result": True, "provenance": prov,
                           "metrics": {"methods": methods}})
    ctx = table_data.table1(root)
    notes = dict(ctx["notes"])
    fi, xqa = _row(ctx["rows"], "method", "flashinfer"), _row(ctx["rows"], "method", "xqa")
    assert "8K flashinfer_cc, 32K flashinfer_tc" in notes[fi["marks"][0]]
    assert xqa["label"] == "TensorRT-LLM XQA (via FlashInfer)"
    assert "trtllm-xqa-via-flashinfer-0.7.2.post1" in notes[xqa["marks"][0]]


def test_table7_names_the_seeds_of_each_row(tmp_path):
    prov = collect_provenance({"profile": "gpu"}, 0)
    for variant, seeds in (("splits=16", (20260623,)), ("splits=20", (20260623,))):
        for seed in seeds:
            _write_run(tmp_path / "ablate" / "splits", "bimodal_b8", seed, f"{variant}{seed}", 1.2, 1.0, True,
                       prov, stage=variant)
    for seed in (20260623, 20260624, 20260625):
        _write_run(tmp_path / "ablate" / "b4", "bimodal_b4", seed, f"b4{seed}", 1.0, 1.0, True, prov,
                   stage="splits=28")
    rows = {r["trace"]: r for r in table_data.table7(tmp_path)["rows"]}
    assert rows["bimodal_b8"]["seeds"] == "20260623"
    assert rows["bimodal_b4"]["seeds"] == "20260623–20260625"
    md = tables.render_table(7, tmp_path, "md")
    assert "| Bimodal B8 (policy with fixed split count) | 20260623 | 16 / 20 |" in md
    assert "seeds 20260623–20260625. Ratios" not in md  # no seed range over the whole table


def test_table7_and_the_claims_check_name_a_sweep_that_never_left_flashinfer(tmp_path):
    prov = collect_provenance({"profile": "gpu"}, 0)
    for variant, routes in (("splits=32", {"flashinfer": 6}), ("splits=36", {"flashinfer": 4, "persistentkv_bucket": 2})):
        _write_run(tmp_path / "ablate" / "splits", "bucketed_b1", 20260623, variant, 1.0, 1.0, True, prov,
                   stage=variant, adaptive_routes=routes)
    t7 = table_data.table7(tmp_path)
    (row,) = t7["rows"]
    gated, mixed = row["points"]
    assert gated["baseline_route_only"] and not mixed["baseline_route_only"]
    assert "the split count was never applied" in dict(t7["notes"])[gated["marks"][-1]] and not mixed["marks"]
    (claim,) = [r for r in claims.claims_check(tmp_path)["rows"]
                if r["claim"] == "B1 split counts near the optimum stay wall-positive"]
    # The split count that ran is graded; the one that never left FlashInfer is named, not graded.
    assert claim["value"] == "wall: S=36 1.000 (not applied, every step on FlashInfer's route: S=32)"


def test_empty_root_renders_every_table_as_not_run(tmp_path):
    root = tmp_path / "artifacts" / "nothing"
    root.mkdir(parents=True)
    written = tables.render_all(root, tmp_path / "out")
    assert len(written) == 3 * 10
    assert "none of its inputs ran" in (tmp_path / "out" / "table2.md").read_text()
    assert "Not run" in (tmp_path / "out" / "table6.md").read_text()


@pytest.mark.parametrize("value, md, tex", [
    (Num(1.23456, 3), "1.235", "1.235"),
    (MeanStd(1.0, 0.05, 5, 3, "×"), "1.000 ± 0.050×", r"$1.000{\pm}0.050\times$"),
    (MeanStd(1.25, None, 1, 3), "1.250", "$1.250$"),
    (Sci(6.104e-5), "6.104e-05", r"$6.104{\cdot}10^{-5}$"),
    (Sci(9.9996e-4), "1.000e-03", r"$1.000{\cdot}10^{-3}$"),
    (Sci(0.0), "0", "0"),
    (Text("a_b | c"), r"a_b \| c", r"a\_b \textbar{} c"),
    (Missing("why", 2), "–[2]", r"--\textsuperscript{2}"),
    (NotApplicable(), "–", "--"),
])
def test_format_cell(value, md, tex):
    assert tables.format_cell(value, "md") == md
    assert tables.format_cell(value, "tex") == tex


def test_cli(tmp_path, capsys):
    assert tables.main(["--root", str(FIXTURE), "--out", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "table8.tex").is_file()
    # A missing root is a refusal: one line and exit status 2 through pkv.refusal.
    with pytest.raises(SystemExit) as exit_info:
        exit_on_refusal(lambda: tables.main(["--root", str(tmp_path / "absent"), "--out", str(tmp_path / "u")]))
    assert exit_info.value.code == 2
    assert "absent" in capsys.readouterr().err


def test_corrupt_result_fails_naming_file(tmp_path):
    bad = tmp_path / "evaluate" / "bimodal_b8" / "seed20260623" / "adaptive.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="adaptive.json"):
        tables.render_all(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("name, label", [
    ("bimodal_b8", "Bimodal B8"), ("bucketed_b1", "Bucketed B1"), ("fixture_mixed_b8", "fixture_mixed B8"),
    ("plain", "plain"),
])
def test_trace_labels(name, label):
    assert table_data.trace_label(name) == label


def test_header_names_the_sources_of_a_dirty_commit():
    inputs = Inputs()
    inputs.add({"provenance": {"git_commit": "0123456789abcdef", "git_dirty": True, "source_digest": "feedbeef"}})
    inputs.add({"provenance": {"git_commit": "fedcba9876543210", "git_dirty": False, "source_digest": "00aa"}})
    assert inputs.header()["commit"] == "0123456789ab-dirty (sources feedbeef), fedcba987654"


def test_the_selected_route_names_the_steps_a_calibrated_rule_moved_off_the_fixed_split_count():
    """Table 2's route cell: the most common route and split count, then each rule other than the
    fixed count with its steps over the seeds (the skew rule's balanced steps)."""
    from pkv.report.table_data.labels import selected_route

    def rec(rules):
        return {"metrics": {"selected_route": "persistentkv_workqueue", "num_splits": 20, "split_rules": rules}}

    route, text = selected_route([rec({"fixed": 25, "balanced (396 CTAs)": 39}), rec({"fixed": 17, "balanced (396 CTAs)": 47})])
    assert route == "persistentkv_workqueue"
    assert text == "PersistentKV workqueue, split 20; balanced (396 CTAs) on 86 of 128 workqueue steps"
    # Every step on the fixed count, or results from before steps were counted by rule: no clause.
    assert selected_route([rec({"fixed": 64})])[1] == "PersistentKV workqueue, split 20"
    assert selected_route([{"metrics": {"selected_route": "persistentkv_workqueue", "num_splits": 20}}])[1] == (
        "PersistentKV workqueue, split 20")


def test_table2_names_the_flashinfer_path_its_baseline_ran(tmp_path):
    """A row's baseline is the FlashInfer path its probe picked per batch class: a footnote counts
    the measured steps of each, named as the results name them."""
    root = tmp_path / "artifacts" / "fake"
    prov = collect_provenance({"profile": "gpu"}, 0)
    for seed, variants in ((20260623, ["holistic"] * 3 + ["cc"]), (20260624, ["holistic"] * 4)):
        _write_run(root, "bucketed_b1", seed, f"b1{seed}", 1.2, 1.0, True, prov)
        path = root / "evaluate" / "bucketed_b1" / f"seed{seed}" / "flashinfer.json"
        rec = json.loads(path.read_text())
        rec["metrics"]["per_step"] = [{"step": i, "variant": v} for i, v in enumerate(variants)]
        rec["metrics"]["flashinfer_paths"] = {"paths": {"cc": "fa2 decode, CUDA cores",
                                                       "holistic": "holistic BatchAttention"}}
        write_json_atomic(path, rec)
    ctx = table_data.table2(root)
    marks = [dict(ctx["notes"])[m] for m in _row(ctx["rows"], "trace", "bucketed_b1")["marks"]]
    assert ("FlashInfer's path on the measured steps (its probe's pick per batch class): holistic BatchAttention "
            "on 7 of 8, fa2 decode, CUDA cores on 1 of 8") in marks
    # Results that record no path (the fixture's): no such footnote.
    fixture_notes = dict(table_data.table2(FIXTURE)["notes"]).values()
    assert not any("FlashInfer's path on the measured steps" in n for n in fixture_notes)


def test_table2s_bimodal_b4_row_names_the_route_its_run_took(tmp_path):
    """Bimodal B4's route is the calibration's B2-7 decision: the row names it, and where the
    context gate sent some steps to the other route, those too."""
    ctx = table_data.table2(FIXTURE)
    assert _row(ctx["rows"], "trace", "bimodal_b4")["route"].text == "FlashInfer"  # a closed B2-7 regime

    root = tmp_path / "artifacts" / "fake"
    prov = collect_provenance({"profile": "gpu"}, 0)
    for seed, routes in ((20260623, {"persistentkv_workqueue": 60, "flashinfer": 4}),
                         (20260624, {"persistentkv_workqueue": 62, "flashinfer": 2})):
        _write_run(root, "bimodal_b4", seed, f"b4{seed}", 1.1, 1.0, True, prov, adaptive_routes=routes)
    row = _row(table_data.table2(root)["rows"], "trace", "bimodal_b4")
    assert row["route"].text == "PersistentKV workqueue, split 4; FlashInfer on 6 of 128 steps"
    # Every step on one route: that route alone.
    from pkv.report.table_data.labels import other_routes

    assert other_routes([{"metrics": {"routes": {"flashinfer": 64}}}], "flashinfer") == ""
    assert other_routes([{"metrics": {}}], "flashinfer") == ""
