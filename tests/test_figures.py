"""pkv.report.figures and figure_data: series computed from result files, drawn as PNG, PDF and a
caption naming the files and the commit; a skipped benchmark is drawn as a panel that says so."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[workflow]')")

from pkv.report import figure_data, figures  # noqa: E402
from pkv.report.results import write_json_atomic  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "results" / "fake_gpu"
PROV = {"git_commit": "b" * 40, "gpu_name": "FAKE-GPU (test)"}


def _bench_root(tmp_path: Path) -> Path:
    root = tmp_path / "artifacts" / "fake"
    kernel = {"schema": "pkv.kernel_bench/1", "performance_result": True, "provenance": PROV, "cases": {
        "b1_8k": {"floor_us": 8.0, "engines": {"flashinfer_tc": {"median_us": 20.0},
                                              "persistentkv": {"median_us": 16.0}}},
        "b8_32k": {"floor_us": 50.0, "engines": {"flashinfer_tc": {"median_us": 51.0},
                                                "persistentkv": {"median_us": 50.5}}}}}
    host = {"schema": "pkv.host_bench/1", "performance_result": True, "provenance": PROV, "cases": {
        "b1_8k": {"engines": {"flashinfer": {"tight": {"plan_us": 200.0, "issue_us": 60.0, "wait_us": 40.0},
                                             "device_us": 21.0, "route": "flashinfer"},
                              "persistentkv_adaptive_route/native": {"skipped": "left to FlashInfer",
                                                                     "route": "flashinfer"}}}}}
    write_json_atomic(root / "kernel_bench" / "decode.json", kernel)
    write_json_atomic(root / "host_bench" / "host.json", host)
    return root


def test_every_figure_is_drawn_with_its_caption(tmp_path):
    out = tmp_path / "figures"
    for name in figure_data.FIGURE_DATA:
        written = figures.render(name, FIXTURE, out)
        assert [p.name for p in written] == [f"{name}.png", f"{name}.pdf", f"{name}.rst"]
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
        caption = (out / f"{name}.rst").read_text()
        assert "Commit: ``f1x7ure00000``" in caption or "not run" in caption, name


def test_serving_ratio_is_table2s_per_seed_ratios():
    data = figure_data.serving_ratio(FIXTURE)
    rows = {r["trace"]: r for r in data.series["rows"]}
    from pkv.report import table_data

    t2 = {r["trace"]: r for r in table_data.table2(FIXTURE)["rows"]}
    assert statistics.fmean(rows["bimodal_b8"]["wall"]) == pytest.approx(t2["bimodal_b8"]["wall"].mean)
    assert statistics.fmean(rows["bimodal_b8"]["device"]) == pytest.approx(t2["bimodal_b8"]["cuda"].mean)
    assert 20260622 not in rows["bimodal_b8"]["seeds"]  # the calibration seed is never evidence
    assert all(src.startswith("evaluate/") for src in data.sources)


def test_route_mix_counts_the_adaptive_steps():
    rows = {r["trace"]: r for r in figure_data.route_mix(FIXTURE).series["rows"]}
    assert sum(rows["bimodal_b8"]["shares"].values()) == pytest.approx(1.0)
    assert rows["bimodal_b4"]["shares"] == {"FlashInfer": 1.0}


def test_isolated_time_reads_times_and_the_floor():
    data = figure_data.isolated_time(FIXTURE)
    s = data.series
    assert s["contexts"] == [8192, 32768]
    assert s["methods"]["FlashInfer, best path"] == pytest.approx([0.1201, 0.4404])
    # No floor_us in the fixture: median x fraction of the floor.
    assert s["floor_ms"][0] == pytest.approx(0.1201 * 0.81)
    assert "vllm" in s["skipped"]


def test_benchmark_figures_from_their_files(tmp_path):
    root = _bench_root(tmp_path)
    kernel = figure_data.kernel_floor(root)
    assert kernel.empty is None
    assert kernel.series["engines"]["persistentkv"] == pytest.approx([0.5, 50.0 / 50.5])
    host = figure_data.host_device(root)
    (engine,) = host.series["cases"][0]["engines"]  # the skipped row draws nothing
    assert engine["parts"] == {"plan()": 200.0, "run() issue": 60.0, "wait for the device": 40.0}
    assert engine["device_us"] == 21.0
    for name in ("kernel_floor", "host_device"):
        figures.render(name, root, tmp_path / "out")
        caption = (tmp_path / "out" / f"{name}.rst").read_text()
        assert "Commit: ``bbbbbbbbbbbb``" in caption and "Performance result" in caption


def test_a_skipped_benchmark_draws_a_figure_that_says_so(tmp_path):
    root = tmp_path / "artifacts" / "cpu"
    write_json_atomic(root / "kernel_bench" / "decode.json",
                      {"schema": "pkv.measure.kernel_bench/1", "skipped": "no GPU",
                       "provenance": {"git_commit": "c" * 40, "gpu_name": None}})
    data = figure_data.kernel_floor(root)
    assert data.empty == "kernel_bench/decode.json: skipped: no GPU"
    figures.render("kernel_floor", root, tmp_path / "out")
    caption = (tmp_path / "out" / "kernel_floor.rst").read_text()
    assert "Nothing is drawn: kernel_bench/decode.json: skipped: no GPU." in caption
    assert "CPU profile: not a performance result" in caption
    assert "``kernel_bench/decode.json``" in caption and "Commit: ``cccccccccccc``" in caption
    # A missing file is "not run", not an error.
    assert figure_data.host_device(root).empty == "host_bench/host.json: not run"


def test_cli_writes_every_figure(tmp_path, capsys):
    assert figures.main(["--root", str(FIXTURE), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 3 * len(figure_data.FIGURE_DATA)
    assert figures.main(["--root", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1


def test_figure_is_the_same_file_when_redrawn(tmp_path):
    figures.render("serving_ratio", FIXTURE, tmp_path / "a")
    figures.render("serving_ratio", FIXTURE, tmp_path / "b")
    for ext in ("png", "pdf", "rst"):
        assert (tmp_path / "a" / f"serving_ratio.{ext}").read_bytes() == \
            (tmp_path / "b" / f"serving_ratio.{ext}").read_bytes(), ext
    json.dumps(figure_data.serving_ratio(FIXTURE).series)  # series are plain data


def test_ratio_bars_rise_from_parity_or_fall_below_it():
    """A ratio of 0.957 is a bar below the 1.0 line and 1.06 one above it, each ending at its value."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from pkv.report.figures import _ratio_bars

    ax = Figure().add_subplot()
    _ratio_bars(ax, [0, 1], [0.957, 1.06], width=0.4)
    (low, high) = ax.patches
    assert low.get_y() == 1.0 and low.get_height() == pytest.approx(-0.043)
    assert high.get_y() == 1.0 and high.get_y() + high.get_height() == pytest.approx(1.06)
