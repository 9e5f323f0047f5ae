"""The Snakemake workflow: lint clean, config schema enforced, the full DAG resolves."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _snakemake(*args, cwd=REPO):
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def job_counts(dry_run_output: str) -> dict[str, int]:
    """{rule: jobs} from the table `snakemake -n` prints."""
    counts = {}
    for line in dry_run_output.splitlines():
        m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s+(\d+)\s*", line)
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def test_lint_is_clean():
    proc = _snakemake("--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr


def test_dry_run_plans_every_rule_for_the_cpu(tmp_path):
    proc = _snakemake("-n", "--config", "gpu=cpu", f"artifacts_root={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = job_counts(proc.stdout)
    for rule in ("build", "calibrate", "evaluate", "mlp", "isolated", "profile", "tables", "ablate_splits",
                 "ablate_raggedness", "ablate_gqa", "ablate_graph", "ablate_fused_merge", "ablate_b4",
                 "ablate_short_rows"):
        assert counts.get(rule, 0) >= 1, (rule, counts)
    assert counts["calibrate"] == 1 and counts["tables"] == 1
    # config.yaml calibrates once more on the same seed and compares the two (calibration/spread.md).
    assert counts["calibrate_repeat"] == 1 and counts["calibration_spread"] == 1
    assert f"{tmp_path}/cpu/calibration/repeat1/calibration.json" in proc.stdout
    # 7 synthetic traces, the fixture and two Azure traces, each on the 5 held-out seeds
    assert counts["evaluate"] == 50
    assert counts["isolated"] == 3
    assert f"{tmp_path}/cpu/tables/table8.tex" in proc.stdout
    # vLLM's rows need PyPI the first time and cannot run on the CPU: the CPU profile leaves its build
    # out (its GPU-profile job: tests/test_device_slots.py).
    assert "vllm_sources" not in counts
    # An edit of the calibration's sweeps, probes or tolerance is a new calibration.
    assert re.search(r"rule calibrate:\n\s+input: .*conf/experiment/calibrate\.yaml", proc.stdout)


def test_gpu_smoke_axes_cover_every_family(tmp_path):
    proc = _snakemake("-n", "--configfile", "config/gpu_smoke.yaml", "--config", "gpu=h200",
                      f"artifacts_root={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for family in ("bucketed", "homogeneous", "bimodal", "uniform", "zipf", "skewed"):
        assert re.search(rf"evaluate/{family}_b\d+/seed20260623/adaptive\.json", proc.stdout), family
    assert "seed20260624" not in proc.stdout
    assert "gpu=h200" in proc.stdout or "h200/" in proc.stdout


def test_calibration_repeats_are_an_axis(tmp_path):
    proc = _snakemake("-n", "--config", "gpu=cpu", f"artifacts_root={tmp_path}", "calibration_repeats=3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert job_counts(proc.stdout)["calibrate_repeat"] == 3
    proc = _snakemake("-n", "--config", "gpu=cpu", f"artifacts_root={tmp_path}", "calibration_repeats=0")
    assert "calibration_spread" not in job_counts(proc.stdout)
    assert _snakemake("-n", "--config", "gpu=cpu", "calibration_repeats=-1").returncode != 0


def test_schema_rejects_a_bad_axis():
    proc = _snakemake("-n", "--config", "gpu=cpu", "held_out_seeds=[-1]")
    assert proc.returncode != 0
    assert "held_out_seeds" in proc.stdout + proc.stderr


def test_unknown_gpu_is_a_clear_error():
    proc = _snakemake("-n", "--config", "gpu=tpu9000")
    assert proc.returncode != 0
    assert "conf/gpu/tpu9000.yaml" in proc.stdout + proc.stderr


def test_a_gpus_constants_run_through_the_cpu_profile_into_their_own_folder(tmp_path):
    proc = _snakemake("-n", "--config", "gpu=h200", "profile=cpu", f"artifacts_root={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{tmp_path}/h200-cpu/calibration/calibration.json" in proc.stdout
    assert f"{tmp_path}/h200/" not in proc.stdout
    refused = _snakemake("-n", "--config", "gpu=cpu", "profile=gpu")
    assert refused.returncode != 0
    assert "field 'profile' = 'gpu'" in refused.stdout + refused.stderr


def test_the_tables_command_refuses_a_corrupt_result_with_one_line(tmp_path):
    bad = tmp_path / "root" / "evaluate" / "bimodal_b8" / "seed1" / "adaptive.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{")
    proc = subprocess.run([sys.executable, "-m", "pkv.report.tables", "--root", str(tmp_path / "root"),
                           "--out", str(tmp_path / "tables")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pkv: {bad}: invalid JSON"), proc.stderr
    assert not (tmp_path / "tables").exists()
