"""Where a DAG run's time went, and whether warm workers change what it measures.

    python -m pkv.dag_timing rules [--workdir .] [--json FILE]
        per rule: jobs, summed job wall seconds, the median job, the seconds of a job that are not
        its measured loops (wall minus the "[trace] done: N steps in X s" lines of its log, where
        it prints them), and how many jobs ran in a warm worker; from Snakemake's own record of
        each job's start and end (.snakemake/metadata) and the jobs' logs.

    python -m pkv.dag_timing ab --root artifacts/<gpu> --out DIR [--rounds 3] [--slot-dir D] RUN...
        reruns each RUN (a result folder or file of the DAG, relative to --root: evaluate/bimodal_b8/seed20260623,
        model_step/bimodal_b4/seed20260623, isolated/ctx32768.json) with the overrides its saved Hydra
        config records, in a fresh process (PKV_WORKER=0) and in the slot's warm worker, alternating,
        ``--rounds`` times; then sets each engine's ratio to its run's baseline (the tables' ratios) and
        its per-step times side by side, fresh against warm, with the spread over the rounds. The
        warm arm's worker stays up afterwards (python -m pkv.worker stop, or its idle timeout).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
# The thread counts Snakemake sets in a job's environment (to the job's threads).
_SNAKEMAKE_THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                          "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
_DONE = re.compile(r"^\[[^\]]+\] done: \d+ steps in ([0-9.]+)s", re.M)
_WARM = re.compile(r"^pkv\.worker: job \d+ of warm worker", re.M)


# --- per rule ------------------------------------------------------------------------------------


def snakemake_jobs(workdir: str | os.PathLike = ".") -> list[dict]:
    """One record per finished job: rule, start, end and log, from .snakemake/metadata (one file
    per output; the outputs of one job share its log)."""
    folder = Path(workdir) / ".snakemake" / "metadata"
    jobs = {}
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("incomplete") or record.get("starttime") is None or record.get("endtime") is None:
            continue
        try:
            output = base64.b64decode(path.name.replace("@", "/")).decode()
        except ValueError:
            output = path.name
        # Every job of this workflow has a log of its own; each output's record stamps its own times.
        logs = tuple(record.get("log") or ())
        key = (record.get("rule"), logs or (record.get("job_hash"), record["starttime"]))
        job = jobs.setdefault(key, {"rule": record.get("rule"), "start": float(record["starttime"]),
                                    "end": float(record["endtime"]), "log": list(logs), "outputs": []})
        job["start"] = min(job["start"], float(record["starttime"]))
        job["end"] = max(job["end"], float(record["endtime"]))
        job["outputs"].append(output)
    return sorted(jobs.values(), key=lambda j: j["start"])


def _log_facts(workdir: Path, logs: list[str]) -> tuple[float | None, bool]:
    """(seconds of measured loops the job's log reports, or None; whether it ran in a warm worker)."""
    measured, warm, found = 0.0, False, False
    for name in logs:
        try:
            text = (workdir / name).read_text(errors="replace")
        except OSError:
            continue
        loops = [float(s) for s in _DONE.findall(text)]
        if loops:
            measured += sum(loops)
            found = True
        warm = warm or bool(_WARM.search(text))
    return (measured if found else None), warm


def rule_table(workdir: str | os.PathLike = ".") -> dict:
    workdir = Path(workdir)
    jobs = snakemake_jobs(workdir)
    rules = defaultdict(list)
    for job in jobs:
        measured, warm = _log_facts(workdir, job["log"])
        job.update(wall_s=job["end"] - job["start"], measured_s=measured, warm=warm)
        rules[job["rule"]].append(job)
    rows = []
    for rule, members in sorted(rules.items(), key=lambda kv: min(j["start"] for j in kv[1])):
        walls = [j["wall_s"] for j in members]
        before = [j["wall_s"] - j["measured_s"] for j in members if j["measured_s"] is not None]
        rows.append({"rule": rule, "jobs": len(members), "wall_s": round(sum(walls), 1),
                     "median_job_s": round(statistics.median(walls), 2),
                     "median_s_not_measuring": round(statistics.median(before), 2) if before else None,
                     "warm_jobs": sum(j["warm"] for j in members)})
    span = (max(j["end"] for j in jobs) - min(j["start"] for j in jobs)) if jobs else 0.0
    return {"jobs": len(jobs), "span_s": round(span, 1), "rules": rows}


def rule_markdown(table: dict) -> str:
    lines = [f"{table['jobs']} jobs, {table['span_s']:.0f} s from the first job's start to the last one's end.", "",
             "| rule | jobs | wall s (sum) | median job s | median s not measuring | warm jobs |",
             "|---|---|---|---|---|---|"]
    for row in table["rules"]:
        before = "–" if row["median_s_not_measuring"] is None else f"{row['median_s_not_measuring']:.2f}"
        lines.append(f"| {row['rule']} | {row['jobs']} | {row['wall_s']:.1f} | {row['median_job_s']:.2f} | {before} "
                     f"| {row['warm_jobs']} |")
    return "\n".join(lines) + "\n"


# --- A/B: fresh processes against the warm worker --------------------------------------------------


def _overrides(run: Path) -> list[str]:
    """The task overrides a run was made with (its .run/.hydra/overrides.yaml), without out=."""
    import yaml

    folder = run if run.is_dir() else run.parent
    candidates = [folder / ".run" / ".hydra" / "overrides.yaml"]
    if run.suffix == ".json":  # isolated/ctx<N>.json keeps its config in .run_ctx<N>/
        candidates.insert(0, folder / f".run_{run.stem}" / ".hydra" / "overrides.yaml")
    for path in candidates:
        if path.is_file():
            return [o for o in yaml.safe_load(path.read_text()) if not o.startswith("out=")]
    raise FileNotFoundError(f"{run}: no saved overrides (.run/.hydra/overrides.yaml) beside it")


def _result_files(out: Path) -> list[Path]:
    return sorted(out.glob("*.json")) if out.is_dir() else [out]


def _metrics(files: list[Path]) -> dict[str, dict]:
    """{file stem: {ratio and per-step times}} of one run: each engine's per-step device and wall
    time, and its speed-up over its run's baseline (baseline time / its time)."""
    records = {}
    for path in files:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record.get("metrics"), dict):
            records[path.stem] = record
    facts = {}
    for stem, record in records.items():
        m = record["metrics"]
        row = {k: m[k] for k in ("cuda_ms_per_step", "wall_ms_per_step") if isinstance(m.get(k), (int, float))}
        base = records.get(record.get("baseline_engine") or "")
        if base is not None and base is not record:
            for k in ("cuda_ms_per_step", "wall_ms_per_step"):
                if k in row and isinstance(base["metrics"].get(k), (int, float)) and row[k] > 0:
                    row[f"speedup_{k.split('_')[0]}"] = base["metrics"][k] / row[k]
        facts[stem] = row
    return facts


def _run_arm(arm: str, overrides: list[str], out: Path, slot_dir: str | None, log: Path) -> int:
    """One run of an arm, through the slot wrapper as the DAG's rules call it; its exit status."""
    wrapper = [sys.executable, "-m", "pkv.device_slots", "run"] + (["--slot-dir", slot_dir] if slot_dir else [])
    if arm == "warm":
        wrapper.append("--warm")
    run_dir = out.parent / f".run_{out.stem}" if out.suffix == ".json" else out / ".run"
    # Quoted for Hydra, which reads "=" inside a value only when quoted (variant folders: splits=28).
    command = [*wrapper, "--", sys.executable, "-m", "pkv.cli", *overrides, f"out='{out}'",
               f"hydra.run.dir='{run_dir}'"]
    # As the DAG's rules run their jobs, so that the warm arm finds the worker the DAG's jobs ran in
    # where it is still up: the checkout first on the path and one thread (workflow/rules/common.smk),
    # and what Snakemake sets for a job of one thread (its thread counts, its temporary folder).
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PKV_WORKER="1" if arm == "warm" else "0",
               PYTHONPATH=str(_REPO) + (os.pathsep + path if path else ""),
               **dict.fromkeys(_SNAKEMAKE_THREAD_VARS, "1"))
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    env.update(dict.fromkeys(("TMPDIR", "TEMP", "TMP", "TEMPDIR"), tmp))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        return subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode


def ab(root: Path, runs: list[str], out: Path, rounds: int, slot_dir: str | None) -> dict:
    results: dict = {}
    plans = [(name, _overrides(root / name)) for name in runs]
    for r in range(rounds):
        # Alternate which arm goes first, so a drift of the machine falls on both alike.
        arms = ("fresh", "warm") if r % 2 == 0 else ("warm", "fresh")
        for name, overrides in plans:
            for arm in arms:
                target = out / arm / f"round{r}" / name
                status = _run_arm(arm, overrides, target, slot_dir, out / "logs" / arm / f"round{r}" / f"{name}.log")
                entry = results.setdefault(name, {}).setdefault(arm, [])
                entry.append(_metrics(_result_files(target)) if status == 0 else {"failed": status})
                print(f"ab: {name} {arm} round {r}: status {status}", file=sys.stderr, flush=True)
    summary = {name: _summarize(arms) for name, arms in results.items()}
    return {"rounds": rounds, "runs": results, "summary": summary}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _summarize(arms: dict) -> dict:
    """Per engine and quantity: each arm's mean and spread over the rounds, and whether the means
    lie within the larger of the two spreads (at least 1% of the mean, the timing's own grain)."""
    out = {}
    ok_rounds = {arm: [r for r in rounds if "failed" not in r] for arm, rounds in arms.items()}
    stems = sorted({s for rounds in ok_rounds.values() for r in rounds for s in r})
    for stem in stems:
        for quantity in ("speedup_cuda", "speedup_wall", "cuda_ms_per_step", "wall_ms_per_step"):
            series = {arm: [r[stem][quantity] for r in rounds if quantity in r.get(stem, {})]
                      for arm, rounds in ok_rounds.items()}
            if not all(series.get(arm) for arm in ("fresh", "warm")):
                continue
            (fm, fs), (wm, ws) = _mean_sd(series["fresh"]), _mean_sd(series["warm"])
            spread = max(fs, ws, 0.01 * abs(fm))
            out[f"{stem}.{quantity}"] = {"fresh_mean": fm, "fresh_sd": fs, "warm_mean": wm, "warm_sd": ws,
                                         "warm_over_fresh": wm / fm if fm else None,
                                         "within_spread": abs(wm - fm) <= 2 * spread}
    return out


def ab_markdown(report: dict) -> str:
    lines = [f"{report['rounds']} rounds, fresh process against warm worker, alternating; "
             "mean ± sd over the rounds.", "",
             "| run | engine.quantity | fresh | warm | warm / fresh | within 2 sd |", "|---|---|---|---|---|---|"]
    for name, rows in report["summary"].items():
        for key, s in rows.items():
            ratio = "–" if s["warm_over_fresh"] is None else f"{s['warm_over_fresh']:.3f}"
            within = "yes" if s["within_spread"] else "NO"
            lines.append(f"| {name} | {key} | {s['fresh_mean']:.4g} ± {s['fresh_sd']:.2g} | "
                         f"{s['warm_mean']:.4g} ± {s['warm_sd']:.2g} | {ratio} | {within} |")
    failed = [(name, arm) for name, arms in report["runs"].items() for arm, rounds in arms.items()
              if any("failed" in r for r in rounds)]
    if failed:
        lines += ["", "Failed: " + ", ".join(f"{n} ({a})" for n, a in failed)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkv.dag_timing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("rules", help="per-rule job times of a finished DAG run")
    p.add_argument("--workdir", type=Path, default=Path("."), help="the folder Snakemake ran in")
    p.add_argument("--json", type=Path, help="also write the table as JSON here")
    p = sub.add_parser("ab", help="rerun DAG runs fresh and warm, alternating, and compare what they measure")
    p.add_argument("--root", type=Path, required=True, help="artifacts/<gpu>")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slot-dir", default=None)
    p.add_argument("runs", nargs="+")
    args = parser.parse_args(argv)
    if args.action == "rules":
        table = rule_table(args.workdir)
        if args.json:
            args.json.write_text(json.dumps(table, indent=1) + "\n")
        print(rule_markdown(table), end="")
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    report = ab(args.root, args.runs, args.out, args.rounds, args.slot_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps(report, indent=1) + "\n")
    text = ab_markdown(report)
    (args.out / "ab.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
