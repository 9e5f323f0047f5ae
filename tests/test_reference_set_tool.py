"""pkv.report.reference_set: a run becomes a GPU's reference set only whole and at one commit, and
the set it replaces moves, whole, under history/ with an index entry."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from pkv.config import ConfigError
from pkv.report import reference_set as rs

GPU = "NVIDIA H100 80GB HBM3"


def _provenance(commit: str, dirty=False) -> dict:
    return {"git_commit": commit, "git_dirty": dirty, "source_digest": "abc", "gpu_name": GPU,
            "driver_version": "580", "cuda_version": "13.0", "torch": "2.11", "flashinfer": "0.7.2",
            "python": "3.12", "timestamp_utc": "2026-12-06T00:00:00+00:00"}


def _run(root: Path, commit: str) -> Path:
    for name in rs.TABLES:
        for fmt in rs.TABLE_FORMATS:
            path = root / "tables" / f"{name}.{fmt}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {name}\n\nDevice: {GPU}. Commit: {commit[:12]}.\n")
    for rel in rs.REQUIRED + ("isolated/ctx8192.json",):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"provenance": _provenance(commit)}) if rel.endswith(".json") else "spread\n")
    figures = tuple(f"figures/{name}.png" for name in rs.FIGURES)
    for rel in figures + ("logs/evaluate/b1/seed1/x.log", "logs/calibrate.log"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    (root / "evaluate" / "b1").mkdir(parents=True)
    (root / "evaluate" / "b1" / "pkv.json").write_text("{}")  # per-seed results stay out of the set
    return root


def test_a_run_becomes_the_set_and_the_set_it_replaces_moves_to_history(tmp_path):
    dest = tmp_path / "reference" / "h100"
    first = _run(tmp_path / "a", "1" * 40)
    rs.promote(first, dest)
    assert (dest / "tables" / "table9.html").is_file() and (dest / "logs" / "evaluate" / "b1" / "seed1" / "x.log").is_file()
    assert not (dest / "evaluate").exists()
    assert "commit 1111111" in (dest / "README.md").read_text()
    assert oct((dest / "tables" / "table1.md").stat().st_mode & 0o777) == "0o644"

    log = tmp_path / "part1_dag.log"
    log.write_text("dag\n")
    replaced = rs.promote(_run(tmp_path / "b", "2" * 40), dest, [log], "## How it ran\n\ntwo parts\n")
    assert replaced == dest / "history" / "1111111"
    assert (replaced / "tables" / "table1.md").read_text().count("Commit: 111111111111") == 1
    assert (replaced / "README.md").is_file() and not (replaced / "history").exists()
    # Its job logs are one archive there, the same files under logs/.
    assert not (replaced / "logs").exists()
    with tarfile.open(replaced / "logs.tar.gz") as archive:
        assert "logs/evaluate/b1/seed1/x.log" in archive.getnames()
        assert archive.extractfile("logs/evaluate/b1/seed1/x.log").read() == (
            dest / "logs" / "evaluate" / "b1" / "seed1" / "x.log").read_bytes()
    index = (dest / "history" / "README.md").read_text()
    assert "| `1111111/` | 1111111 |" in index and "replaced it" in index
    assert (dest / "logs" / "dag" / "part1_dag.log").is_file()
    readme = (dest / "README.md").read_text()
    assert "commit 2222222" in readme and "two parts" in readme
    assert not list(tmp_path.glob("reference/.*"))  # no staging left behind


def test_a_run_with_model_steps_keeps_what_the_graph_kept_of_table_2s_lead(tmp_path):
    """graph_gain needs the per-seed files a set leaves behind: the promotion writes it first."""
    from test_graph_gain import _run as model_step_run

    run = _run(tmp_path / "a", "1" * 40)
    model_step_run(run)
    dest = tmp_path / "reference" / "h100"
    rs.promote(run, dest)
    text = (dest / rs.GRAPH_GAIN).read_text()
    assert f"Device: {GPU}. Commit: 111111111111." in text and "| Bimodal B8 | 1 | 1.100 |" in text
    assert f"`{rs.GRAPH_GAIN}`" in (dest / "README.md").read_text()


def test_a_dag_log_in_json_is_refused_before_anything_changes(tmp_path):
    """A set's JSON files are results that name their run; the DAG's timing JSON names none."""
    dest = tmp_path / "reference" / "h100"
    timing = tmp_path / "part1_dag_timing.json"
    timing.write_text("{}")
    with pytest.raises(ConfigError, match="part1_dag_timing.json: field 'dag-logs'"):
        rs.promote(_run(tmp_path / "a", "1" * 40), dest, [timing])
    assert not dest.exists()


@pytest.mark.parametrize("spoil", ["two_commits", "dirty", "other_commit", "no_repeat"])
def test_a_run_that_is_not_one_clean_commit_is_refused_and_nothing_changes(tmp_path, spoil):
    dest = tmp_path / "reference" / "h100"
    rs.promote(_run(tmp_path / "a", "1" * 40), dest)
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    run = _run(tmp_path / "b", "2" * 40)
    if spoil == "two_commits":
        (run / "tables" / "table4.md").write_text("Commit: 333333333333.\n")
    elif spoil == "dirty":
        (run / "host_bench" / "host.json").write_text(json.dumps({"provenance": _provenance("2" * 40, dirty=True)}))
    elif spoil == "other_commit":
        (run / "isolated" / "ctx8192.json").write_text(json.dumps({"provenance": _provenance("4" * 40)}))
    else:
        (run / "calibration" / "repeat1" / "calibration.json").unlink()
    with pytest.raises(ConfigError, match=str(run)):
        rs.promote(run, dest)
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before


def test_the_command_refuses_in_one_line(tmp_path, capsys):
    run = _run(tmp_path / "a", "1" * 40)
    (run / "tables" / "claims.md").unlink()
    with pytest.raises(SystemExit) as exit_:
        rs.main([str(run), str(tmp_path / "dest")])
    assert exit_.value.code == 2
    assert "claims.md: missing" in capsys.readouterr().err


def test_packed_logs_are_the_same_bytes_each_time(tmp_path):
    for name in ("a", "b"):
        logs = tmp_path / name / "logs" / "x"
        logs.mkdir(parents=True)
        (logs / "job.log").write_text("one\n")
        (logs.parent / "build.log").write_text("two\n")
        rs.pack_logs(tmp_path / name)
    assert (tmp_path / "a" / "logs.tar.gz").read_bytes() == (tmp_path / "b" / "logs.tar.gz").read_bytes()
    assert not (tmp_path / "a" / "logs").exists()
