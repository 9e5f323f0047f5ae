import os
from pathlib import Path

import numpy as np
import pytest

from pkv.atomic_io import JsonFileError, read_json, write_json_atomic
from pkv.report import results
from pkv.report.results import RESULT_SCHEMA, ResultFileError, iter_results, read_result, result_envelope, validate_result

FIXTURE = Path(__file__).parent / "fixtures" / "results" / "fake_gpu"


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_write_creates_parents_and_round_trips(tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    obj = {"x": 1.5, "n": np.int64(3), "v": np.arange(3), "f": np.float32(0.25)}
    assert write_json_atomic(path, obj) == path
    assert read_json(path) == {"x": 1.5, "n": 3, "v": [0, 1, 2], "f": 0.25}
    assert _leftovers(path.parent) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), np.float64("-inf")])
def test_non_finite_refused_and_names_field(tmp_path, bad):
    path = tmp_path / "r.json"
    with pytest.raises(JsonFileError, match=r"r\.json.*\$\.metrics\.times\[1\]"):
        write_json_atomic(path, {"metrics": {"times": [1.0, bad]}})
    assert not path.exists()
    assert _leftovers(tmp_path) == []


def test_allow_nan_writes_it(tmp_path):
    path = write_json_atomic(tmp_path / "r.json", {"x": float("nan")}, allow_nan=True)
    assert "NaN" in path.read_text()


def test_failed_replace_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"version": 1})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_json_atomic(path, {"version": 2})
    monkeypatch.undo()
    assert read_json(path) == {"version": 1}
    assert _leftovers(tmp_path) == []


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"

    def broken_fsync(fd):
        raise OSError("io error")

    monkeypatch.setattr(results.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="io error"):
        write_json_atomic(path, {"big": list(range(1000))})
    assert not path.exists()
    assert _leftovers(tmp_path) == []


def test_unserializable_object_leaves_nothing(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(JsonFileError, match="r.json"):
        write_json_atomic(path, {"o": object()})
    assert list(tmp_path.iterdir()) == []


def test_read_json_errors_name_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"a": ')
    with pytest.raises(JsonFileError, match="broken.json"):
        read_json(bad)
    with pytest.raises(FileNotFoundError, match="absent.json"):
        read_json(tmp_path / "absent.json")


def _envelope(**overrides):
    kwargs = dict(baseline_engine="flashinfer", run_id="run-1", performance_result=False,
                  metrics={"wall_tok_s": 1.0}, provenance={"gpu_name": None})
    kwargs.update(overrides)
    return result_envelope("evaluate", {"name": "bimodal_b8", "seed": 20260623}, "adaptive", **kwargs)


def test_envelope_fields_and_validation_round_trip(tmp_path):
    rec = _envelope()
    assert rec["schema"] == RESULT_SCHEMA and rec["variant"] is None
    assert rec["metrics"] == {"wall_tok_s": 1.0} and "skipped" not in rec
    path = write_json_atomic(tmp_path / "adaptive.json", rec)
    assert read_result(path) == rec
    skipped = _envelope(metrics=None, skipped="no GPU")
    assert skipped["skipped"] == "no GPU" and "metrics" not in skipped
    validate_result(skipped)


@pytest.mark.parametrize("overrides, field", [
    ({"metrics": None}, "exactly one"),
    ({"skipped": "why"}, "exactly one"),
    ({"performance_result": "yes"}, "performance_result"),
    ({"run_id": ""}, "run_id"),
    ({"provenance": None}, "provenance"),
])
def test_envelope_rejects_bad_fields(overrides, field):
    with pytest.raises(ResultFileError, match=field):
        _envelope(**overrides)


def test_envelope_needs_trace_name():
    with pytest.raises(ResultFileError, match="trace"):
        result_envelope("evaluate", {"family": "bimodal"}, "adaptive", baseline_engine=None, run_id="r",
                        performance_result=True, metrics={}, provenance={})


def test_validate_names_source_and_field():
    rec = _envelope()
    rec["performance_result"] = None
    with pytest.raises(ResultFileError, match=r"x/adaptive.json: performance_result"):
        validate_result(rec, "x/adaptive.json")
    with pytest.raises(ResultFileError, match="schema"):
        validate_result({"schema": "other/1"}, "y.json")


def test_iter_results_only_trace_results_sorted():
    found = list(iter_results(FIXTURE))
    paths = [p for p, _ in found]
    assert paths == sorted(paths)
    assert all(r["schema"] == RESULT_SCHEMA for _, r in found)
    rel = {p.relative_to(FIXTURE).as_posix() for p in paths}
    assert "evaluate/bimodal_b8/seed20260623/adaptive.json" in rel
    # Isolated timings, profiler counters and calibration constants are other schemas.
    assert not any(r.startswith(("isolated/", "profile/", "calibration/")) for r in rel)


def test_iter_results_raises_on_broken_result(tmp_path):
    write_json_atomic(tmp_path / "evaluate" / "bad.json", {"schema": RESULT_SCHEMA, "engine": "adaptive"})
    with pytest.raises(ResultFileError, match="bad.json"):
        list(iter_results(tmp_path))


def test_iter_results_skips_rendered_tables_and_temp_files(tmp_path):
    rec = _envelope()
    write_json_atomic(tmp_path / "evaluate" / "t" / "seed1" / "adaptive.json", rec)
    write_json_atomic(tmp_path / "tables" / "x.json", rec)
    (tmp_path / "evaluate" / ".adaptive.json.abc.tmp.json").write_text("{")
    assert [p.name for p, _ in iter_results(tmp_path)] == ["adaptive.json"]
    assert os.path.exists(tmp_path / "tables" / "x.json")


def test_written_files_are_readable_by_the_group(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "shared" / "r.json", {"x": 1})
        # The file's mode follows the umask as a plain open() would, and reading it changes it not.
        os.umask(0o027)
        private = write_json_atomic(tmp_path / "shared" / "p.json", {"x": 1})
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644 and private.stat().st_mode & 0o777 == 0o640
