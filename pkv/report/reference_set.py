"""Promote one DAG run to a GPU's reference set (artifacts/reference/<gpu>/), the figures a reader
compares against.

A reference set is one run at one commit: its tables 1-9 and claims check, the figures, the
calibration with its repeats and spread, the kernel and host benchmarks, the Nsight counters, the
isolated calls and every job's log. This command checks that the run is that (every table and the
claims name one commit; every JSON result records that commit, a clean tree and where it ran),
moves the set it replaces, whole, under ``history/<commit>/`` (its job logs packed into one
``logs.tar.gz``: sets are committed and every GPU run carries the tree) and lists it in
``history/README.md``, and writes the new set with a README of the run's provenance and, for a run with model steps,
``graph_gain.md`` (pkv.report.graph_gain, which reads per-seed files the set does not keep).
Nothing is changed where a check fails: the refusal names the file, the field and the value.

    python -m pkv.report.reference_set artifacts/h100 artifacts/reference/h100 \\
        [--dag-logs part1_dag.log part1_timing.md ...] [--notes how_it_ran.md]

The per-seed result files (evaluate/, ablate/, mlp/, model_step/: tens of MB) stay out of the set;
the tables, figures and claims are computed from them, and each job's log is kept.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import tarfile
from pathlib import Path

from pkv.atomic_io import read_json, write_text_atomic
from pkv.config import ConfigError
from pkv.refusal import exit_on_refusal
from pkv.report import graph_gain, tables
from pkv.report.figure_data import FIGURE_DATA

# The tables and figures a set holds are the ones the tables and figure rules render.
TABLES = tuple(tables.output_names())
TABLE_FORMATS = tables.FORMATS + ("html",)
FIGURES = tuple(FIGURE_DATA)
# What a set keeps of a run, as globs under the run's folder (the rules that write them: tables,
# figure, model_step_figure, calibrate, calibrate_repeat, calibration_spread, kernel_bench,
# host_bench, profile, isolated, build, vllm_sources, and every rule's log).
KEPT = ("tables/*.md", "tables/*.tex", "tables/*.html", "figures/*.png", "figures/*.pdf", "figures/*.rst",
        "calibration/calibration.json", "calibration/repeat*/calibration.json", "calibration/spread.md",
        "kernel_bench/*.json", "host_bench/*.json", "profile/*.json", "profile/*.log", "isolated/*.json",
        "build/*.json", "logs/**/*.log")
# A set is not whole without these and every figure's PNG (tests/test_reference_sets.py checks the
# committed sets, with the README this command writes).
REQUIRED = ("calibration/calibration.json", "calibration/repeat1/calibration.json", "calibration/spread.md",
            "kernel_bench/decode.json", "host_bench/host.json", "profile/ncu_counters.json")
# Provenance every JSON result of a set records.
PROVENANCE = ("git_commit", "git_dirty", "source_digest", "gpu_name", "driver_version", "cuda_version", "torch",
              "flashinfer", "python", "timestamp_utc")
COMMIT_LINE = re.compile(r"Commit: `*([0-9a-f]{7,40})")
HISTORY_INDEX = "README.md"
GRAPH_GAIN = "graph_gain.md"
# A set moved into history keeps its logs/ as this one archive.
HISTORY_LOGS = "logs.tar.gz"


def tables_commit(run: Path) -> str:
    """The one commit every table and the claims check of ``run`` name (their "Commit:" line)."""
    commits: dict[str, list[str]] = {}  # each commit named, and the tables that name it
    for name in TABLES:
        for fmt in TABLE_FORMATS:
            path = run / "tables" / f"{name}.{fmt}"
            if not path.is_file():
                raise ConfigError(f"{path}: missing: a reference set holds every table and the claims check")
        path = run / "tables" / f"{name}.md"
        found = set(COMMIT_LINE.findall(path.read_text()))
        if not found:
            raise ConfigError(f"{path}: field 'Commit' not found: the table does not name its commit")
        for commit in found:
            commits.setdefault(commit, []).append(path.name)
    if len(commits) != 1:
        raise ConfigError(f"{run / 'tables'}: field 'Commit' = {sorted(commits)}: the tables name several "
                          f"commits ({commits}); a reference set is one run at one commit")
    return next(iter(commits))


def kept_files(run: Path) -> list[Path]:
    """The files of ``run`` that a reference set keeps, relative to it, in a fixed order."""
    files = {path.relative_to(run) for pattern in KEPT for path in run.glob(pattern) if path.is_file()}
    needed = REQUIRED + tuple(f"figures/{name}.png" for name in FIGURES)
    missing = [name for name in needed if Path(name) not in files]
    if missing:
        raise ConfigError(f"{run}: missing {missing}: a reference set holds the calibration and its repeat, "
                          "the benchmarks, the Nsight counters and every figure")
    return sorted(files)


def check_provenance(run: Path, files: list[Path], commit: str) -> None:
    """Every JSON file's provenance names ``commit``, a clean tree and where it ran."""
    for rel in files:
        if rel.suffix != ".json":
            continue
        path = run / rel
        result = read_json(path)
        provenance = result.get("provenance") if isinstance(result, dict) else None
        if not isinstance(provenance, dict):
            raise ConfigError(f"{path}: field 'provenance' = {provenance!r}: a result must say where it came from")
        empty = [key for key in PROVENANCE if provenance.get(key) in (None, "")]
        if empty:
            raise ConfigError(f"{path}: field 'provenance.{empty[0]}' = {provenance.get(empty[0])!r}: not recorded")
        if not str(provenance["git_commit"]).startswith(commit):
            raise ConfigError(f"{path}: field 'provenance.git_commit' = {provenance['git_commit']!r}: "
                              f"the tables name commit {commit}")
        if provenance["git_dirty"] is not False:
            raise ConfigError(f"{path}: field 'provenance.git_dirty' = {provenance['git_dirty']!r}: "
                              "a reference set runs a committed tree")


def _graph_gain_text(run: Path, commit: str, provenance: dict, gpu: str) -> str | None:
    """pkv.report.graph_gain of the run, which needs the per-seed files a set does not keep: made
    here, before they are left behind. None for a run without model steps."""
    if not (run / "model_step").is_dir():
        return None
    return (f"# Table 2's attention lead inside Table 9's graphed step\n\n"
            f"Device: {provenance['gpu_name']}. Commit: {commit[:12]}. "
            f"`python -m pkv.report.graph_gain artifacts/{gpu}` on the run, before promotion "
            f"(its docstring says what each column is).\n\n"
            + graph_gain.render_markdown(graph_gain.graph_gain(run)))


def _readme(commit: str, provenance: dict, gpu: str, notes: str) -> str:
    versions = (f"torch {provenance['torch']}, FlashInfer {provenance['flashinfer']}, "
                f"Python {provenance['python']}")
    head = (f"# Reference set: {provenance['gpu_name']}, commit {commit[:7]}\n\n"
            f"Every file here (outside `history/`) comes from one run of the DAG at commit "
            f"`{provenance['git_commit']}` (sources `{provenance['source_digest']}`, not dirty) on one "
            f"{provenance['gpu_name']} (driver {provenance['driver_version']}, CUDA {provenance['cuda_version']}), "
            f"{versions}. Every JSON file's provenance block names that commit, the GPU, the driver and "
            f"the versions; every table and the claims check name the commit and the device in their "
            f"header. Promoted with `python -m pkv.report.reference_set artifacts/{gpu} "
            f"artifacts/reference/{gpu}`.\n\n")
    contents = (
        "## Contents\n\n"
        "| path | what | rule |\n|---|---|---|\n"
        "| `tables/table1` ... `table9` (`.md`, `.tex`, `.html`) | the paper's eight tables and Table 9 "
        "(the model step) | `tables` |\n"
        "| `tables/claims.*` | every numeric claim of the paper against this run | `tables` |\n"
        "| `figures/` | the figures (`.png`, `.pdf`, and each one's `.rst` caption) | `figure`, "
        "`model_step_figure` |\n"
        "| `calibration/` | the calibration, its repeats on the same seed and `spread.md` | `calibrate`, "
        "`calibrate_repeat`, `calibration_spread` |\n"
        "| `kernel_bench/decode.json` | the decode-kernel benchmark | `kernel_bench` |\n"
        "| `host_bench/host.json` | host time of one step per engine | `host_bench` |\n"
        "| `profile/` | Table 5's Nsight Compute counters and the profiler's log | `profile` |\n"
        "| `isolated/` | Table 1's isolated B1 calls | `isolated` |\n"
        f"| `{GRAPH_GAIN}` | Table 2's attention lead carried into Table 9's graphed step, per trace "
        "(`python -m pkv.report.graph_gain`, made at promotion) | – |\n"
        "| `logs/` | every job's log (`logs/dag/`: the DAG's own logs and per-rule times) | every rule |\n\n"
        "The per-seed result files of Tables 2-4 and 6-9 (`evaluate/`, `ablate/`, `mlp/`, `model_step/`) "
        "are not kept here; the tables, figures and claims are computed from them, and each job's log "
        "is.\n\n`history/` holds earlier runs, each at its own commit (`history/README.md`).\n")
    return head + (notes.rstrip() + "\n\n" if notes.strip() else "") + contents


def _index_with(index: str, name: str, count: int, note: str, gpu_title: str) -> str:
    """``index`` (history/README.md) with the entry of folder ``name``, named by its commit."""
    row = f"| `{name}/` | {name} | {count} files |"
    if not index.strip():
        index = (f"# Earlier {gpu_title} runs\n\nEach entry ran at its own commit (the commit its files' "
                 "provenance names); none is part of the reference set one folder up, and their figures are "
                 "not compared with it.\n\n| entry | commit | contents |\n|---|---|---|\n")
    lines = index.rstrip("\n").split("\n")
    rows = [i for i, line in enumerate(lines) if line.startswith("| `")]
    at = rows[-1] + 1 if rows else len(lines)
    lines.insert(at, row)
    return "\n".join(lines) + f"\n\n- `{name}/`: {note}\n"


def promote(run: Path, dest: Path, dag_logs: list[Path] = (), notes: str = "") -> Path:
    """Write ``run``'s reference set to ``dest`` (see the module's docstring); returns where the set
    it replaced went (or ``dest`` where there was none)."""
    run, dest = Path(run), Path(dest)
    commit = tables_commit(run)
    files = kept_files(run)
    check_provenance(run, files, commit)
    # The README quotes one result's provenance: check_provenance held every file's to the same run.
    provenance = read_json(run / "kernel_bench" / "decode.json")["provenance"]
    gain = _graph_gain_text(run, commit, provenance, dest.name)
    for log in dag_logs:
        if not Path(log).is_file():
            raise ConfigError(f"{log}: field 'dag-logs' names a file that does not exist")
        if Path(log).suffix == ".json":
            # Every JSON file of a set is a result that names its run; the DAG's timing JSON
            # names none, and its .md twin carries the same table.
            raise ConfigError(f"{log}: field 'dag-logs' names a JSON file: a set's JSON files are results "
                              f"with provenance; keep the DAG's .log and .md files")
    replaced = None
    if (dest / "tables").is_dir():
        old = tables_commit(dest)
        if old.startswith(commit) or commit.startswith(old):
            raise ConfigError(f"{dest}: field 'Commit' = {old}: the set there is already commit {commit}'s")
        replaced = dest / "history" / old[:7]
        if replaced.exists():
            raise ConfigError(f"{replaced}: exists: an earlier set of commit {old[:7]} is already in history")
    staging = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for rel in files:
            _copy(run / rel, staging / rel)
        for log in dag_logs:
            _copy(Path(log), staging / "logs" / "dag" / Path(log).name)
        if (dest / "history").is_dir():
            shutil.copytree(dest / "history", staging / "history")
        if replaced is not None:
            old_set = staging / "history" / replaced.name
            for entry in dest.iterdir():
                if entry.name != "history":
                    (shutil.copytree if entry.is_dir() else _copy)(entry, old_set / entry.name)
            pack_logs(old_set)
            count = sum(1 for p in old_set.rglob("*") if p.is_file())
            index_path = staging / "history" / HISTORY_INDEX
            index = index_path.read_text() if index_path.is_file() else ""
            note = (f"the reference set of commit {replaced.name} until commit {commit[:7]}'s replaced it; "
                    f"its README says how it ran, its `{HISTORY_LOGS}` holds every job's log.")
            write_text_atomic(index_path, _index_with(index, replaced.name, count, note, dest.name.upper()))
        write_text_atomic(staging / "README.md", _readme(commit, provenance, dest.name, notes))
        if gain is not None:
            write_text_atomic(staging / GRAPH_GAIN, gain)
        for path in staging.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        # The swap: the old folder aside, the staged one in its place, then the old one removed; a
        # crash between the renames leaves both folders whole.
        aside = dest.with_name(f".{dest.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        if dest.exists():
            os.replace(dest, aside)
        os.replace(staging, dest)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return (dest / "history" / replaced.name) if replaced is not None else dest


def pack_logs(folder: Path) -> None:
    """Replace ``folder``'s logs/ by logs.tar.gz of the same files (paths under logs/, sorted, with
    no dates or owners in the archive, so packing the same logs twice gives the same bytes). A
    history set is read rarely; its text logs are most of its size and pack about twentyfold."""
    logs = folder / "logs"
    if not logs.is_dir():
        return
    target = folder / HISTORY_LOGS
    partial = target.with_name(f".{target.name}.partial")
    with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed, \
            tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(p for p in logs.rglob("*") if p.is_file()):
            info = archive.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(path, "rb") as handle:
                archive.addfile(info, handle)
    os.replace(partial, target)
    shutil.rmtree(logs)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkv.report.reference_set", description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run's artifacts folder, artifacts/<gpu>")
    parser.add_argument("dest", type=Path, help="the set's folder, artifacts/reference/<gpu>")
    parser.add_argument("--dag-logs", type=Path, nargs="*", default=[],
                        help="the DAG's own logs and per-rule tables (scripts/gpu_dag.sh's $OUT), kept in logs/dag/")
    parser.add_argument("--notes", type=Path, help="markdown for the README: how it ran, what falls short")
    args = parser.parse_args(argv)

    def run() -> int:
        notes = args.notes.read_text() if args.notes else ""
        replaced = promote(args.run, args.dest, args.dag_logs, notes)
        print(f"{args.dest}: the set of {tables_commit(args.dest)[:7]}"
              + (f"; the one it replaced is in {replaced}" if replaced != args.dest else ""))
        # The README quotes every set through pkv.report.headline; the test suite holds it to the set.
        print(f"README.md: python -m pkv.report.headline {args.dest} --write README.md (between the set's markers)")
        return 0

    return exit_on_refusal(run) or 0


if __name__ == "__main__":
    raise SystemExit(main())
