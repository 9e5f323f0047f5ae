"""pkv.report.headline: the README's figures of a reference set, read from the set's own tables and
benchmarks, and every shortfall against the project's aims named with its figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.config import ConfigError
from pkv.report import headline as hl

SET = Path(__file__).resolve().parents[1] / "artifacts" / "reference" / "h100"


def test_a_markdown_table_is_read_by_its_header_with_escaped_pipes_kept_in_their_cell(tmp_path):
    path = tmp_path / "t.md"
    path.write_text("**caption**\n\n| Trace | Max \\|e\\| | CUDA ratio |\n|---|---:|---:|\n"
                    "| Bimodal B8[2] | 1e-3 | 1.012 ± 0.004× |\n| Bucketed B1 | 0 | –[1] |\n\n- [1] note\n")
    rows = hl.markdown_table(path)
    assert [hl.label(row["Trace"]) for row in rows] == ["Bimodal B8", "Bucketed B1"]
    assert rows[0]["Max \\|e\\|"] == "1e-3"
    assert hl.ratio(rows[0]["CUDA ratio"]) == hl.Ratio(1.012, 0.004)
    assert hl.ratio(rows[1]["CUDA ratio"]) is None


def test_a_file_without_a_table_or_a_column_is_refused_naming_it(tmp_path):
    path = tmp_path / "table9.md"
    path.write_text("no table here\n")
    with pytest.raises(ConfigError, match="table9.md: no table found"):
        hl.markdown_table(path)
    path.write_text("| Trace | Engine |\n|---|---|\n| Bimodal B8 | Adaptive route |\n")
    with pytest.raises(ConfigError, match=r"table9.md: column 'Mode' not found"):
        hl._pick(hl.markdown_table(path), path, Mode="eager")


def test_a_ratio_that_prints_as_one_is_a_tie_not_a_loss():
    assert not hl.Ratio(0.99999996).below_one
    assert hl.Ratio(0.9994, 0.01).below_one
    assert str(hl.Ratio(0.9994, 0.01)) == "0.999 ± 0.010x"


def _kernel(case, flashinfer, confirmed=None):
    return {"case": case, "label": case, "flashinfer": hl.Ratio(flashinfer),
            "confirmed": hl.Ratio(confirmed or flashinfer), "xqa": hl.Ratio(1.5), "vllm": None, "floor": (0.9, 0.8)}


def _step(trace, graph, ceiling, captured, eager=1.01):
    return {"trace": trace, "route": "PersistentKV workqueue, split 20; FlashInfer on 3 of 320 steps",
            "graph": hl.Ratio(graph), "graph_wall": hl.Ratio(1.02), "ceiling": hl.Ratio(ceiling),
            "captured": hl.Ratio(captured), "eager": hl.Ratio(eager), "eager_wall": hl.Ratio(1.02),
            "xqa_graph": hl.Ratio(0.9)}


def test_every_shortfall_is_named_with_its_figure_and_a_set_that_meets_every_aim_has_none():
    isolated = (["8K"], [("PersistentKV, auto split", ["0.0207"]), ("FlashInfer, best path", ["0.0200"])])
    serving = [{"trace": "Skewed B64", "route": "PersistentKV workqueue", "device": hl.Ratio(1.07),
                "wall": hl.Ratio(1.05, 0.02), "device_xqa": hl.Ratio(4.0), "wall_xqa": hl.Ratio(0.8, 0.01)}]
    steps = [_step("Bucketed B1", 1.012, 1.06, 0.2), _step("Bimodal B8", 0.995, 1.03, -0.2, eager=1.0)]
    host = [{"case": "b1_8k", "label": "B1 8K", "route": "persistentkv_bucket",
             "modes": {"adaptive/native": 52.0, "adaptive/native, one op": 31.0}, "flashinfer_us": 263.0},
            {"case": "b8_short", "label": "B8 short", "route": "flashinfer", "modes": {"adaptive/native": 240.0},
             "flashinfer_us": 231.0}]
    lines = hl.shortfalls([_kernel("b1_32k", 1.058, 1.077)], isolated, serving, steps, host)
    text = "\n".join(lines)
    assert "Table 1 8K: PersistentKV 0.0207 ms, FlashInfer, best path 0.0200 ms" in text
    assert "Table 2 Skewed B64 (PersistentKV workqueue): wall vs XQA 0.800 ± 0.010x" in text
    assert "Table 9 Bimodal B8 (PersistentKV workqueue, split 20): graph device 0.995x" in text
    assert "Bucketed B1 1.012x of 1.060x (0.20)" in text and "Bimodal B8 0.995x of 1.030x (-0.20)" in text
    assert "Bucketed B1: 1.012x against an aim of 1.04x" in text
    # The faster of the adaptive engine's eager modes is held to the aim; a step left to FlashInfer is not.
    assert "B1 8K: 31.0 us (adaptive/native, one op" in text and "B8 short" not in text
    assert "Skewed B64: wall 1.050 ± 0.020x against an aim of 1.10x" in text
    assert "b1_32k: 1.058x FlashInfer's best path (confirmed 1.077x) against an aim of 1.40x" in text

    met = hl.shortfalls(
        [_kernel("b1_32k", 1.5)],
        (["8K"], [("PersistentKV, auto split", ["0.0190"]), ("FlashInfer, best path", ["0.0200"])]),
        [dict(serving[0], wall=hl.Ratio(1.2), wall_xqa=hl.Ratio(1.1))],
        [_step("Bucketed B1", 1.05, 1.06, 0.8)],
        [dict(host[0], modes={"adaptive/native": 12.0})])
    assert met == []


def test_the_block_is_written_between_the_sets_markers_and_checked(tmp_path):
    name = hl.set_name_of(SET)
    assert name == "artifacts/reference/h100"
    begin, end = hl.markers(name)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{begin}\nstale figures\n{end}\n\nAfter.\n")
    assert hl.main([str(SET), "--check", str(readme)]) == 1
    assert hl.main([str(SET), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# Title\n\n{begin}\n") and text.endswith(f"{end}\n\nAfter.\n")
    assert hl.headline(SET) in text and "stale figures" not in text
    assert hl.main([str(SET), "--check", str(readme)]) == 0
    readme.write_text("# No markers\n")
    with pytest.raises(ConfigError, match="README.md: no marker"):
        hl.main([str(SET), "--write", str(readme)])


def test_an_engines_host_time_shows_the_range_of_its_rounds_where_the_run_kept_them(tmp_path):
    """host_bench's per-round medians (tight_plan_issue_us_by_round) give each eager host figure its
    range; a set timed before the rounds shows the figure alone."""
    import json

    def engine(plan, issue, rounds=None):
        record = {"tight": {"plan_us": plan, "issue_us": issue}, "route": "persistentkv_bucket"}
        return {**record, "tight_plan_issue_us_by_round": rounds} if rounds else record

    engines = {"flashinfer": engine(300.0, 50.0), hl.HOST_ENGINES[0]: engine(30.0, 20.0, [49.0, 50.0, 53.5])}
    (tmp_path / "host_bench").mkdir()
    (tmp_path / "host_bench" / "host.json").write_text(json.dumps(
        {"cases": {"b1_8k": {"seq_lens": [8192], "engines": engines}}}))
    (row,) = hl.host_rows(tmp_path)
    assert row["modes"] == {hl.HOST_ENGINES[0]: 50.0} and row["rounds"] == {hl.HOST_ENGINES[0]: (49.0, 53.5)}
    assert hl._host_cell(row, hl.HOST_ENGINES[0]) == "50.0 (49.0-53.5)"
    assert hl._host_cell({**row, "rounds": {}}, hl.HOST_ENGINES[0]) == "50.0"
    assert all(hl._host_cell(row, mode) == "–" for mode in hl.HOST_ENGINES[1:])
