"""The CPU DAG through a real SLURM scheduler (the `slurm` marker).

It needs a cluster that answers `sinfo` with SLURM_CONF set: the single-node test cluster of
scripts/slurm_cluster.sh (`eval "$(scripts/slurm_cluster.sh start)"`, then `pytest -m slurm`);
without one it skips, unless PKV_REQUIRE_SLURM=1 (CI) makes that a failure. It copies the checkout
once, runs the reduced CPU DAG of tests/test_dag_cpu.py through workflow/profiles/slurm-local and
locally (from the SLURM run's calibration) from that same copy, then checks that every job of the
SLURM run was a SLURM job that the scheduler recorded as COMPLETED (its jobcomp/filetxt log), and
that both runs wrote the same result files and the same tables once the timings are masked (on the
CPU profile every time, and every ratio or "fastest" verdict drawn from times, changes from run to
run).
"""

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("snakemake", reason="snakemake is not installed (pip install -e '.[workflow]')")

from test_dag_cpu import AXES, _copy_checkout, _planned_rules, _snakemake  # noqa: E402

from pkv.report.table_data.model_step import HOST_BOUND  # noqa: E402


PROFILE = "workflow/profiles/slurm-local"


def _cluster_problem() -> str | None:
    """Why no SLURM cluster can take the run, or None when one answers."""
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is not set (start the test cluster: eval \"$(scripts/slurm_cluster.sh start)\")"
    if shutil.which("sinfo") is None:
        return "sinfo is not installed (scripts/slurm_cluster.sh start installs slurm-wlm)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %a %T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    if proc.returncode != 0:
        return f"sinfo failed: {(proc.stderr or proc.stdout).strip()[-500:]}"
    if not proc.stdout.strip():
        return "sinfo lists no partition"
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        return "snakemake-executor-plugin-slurm is not installed (pip install -e '.[workflow]')"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = _cluster_problem()
    if problem:
        if os.environ.get("PKV_REQUIRE_SLURM") == "1":
            pytest.fail(f"PKV_REQUIRE_SLURM=1 but no SLURM cluster answers: {problem}")
        pytest.skip(f"no SLURM cluster: {problem}")
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    settings = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", config, flags=re.M))
    assert settings.get("JobCompType") == "jobcomp/filetxt", (
        "the test reads each job's record from a jobcomp/filetxt log (scripts/slurm_cluster.sh writes one); "
        f"this cluster has JobCompType={settings.get('JobCompType')}"
    )
    return Path(settings["JobCompLoc"])


def _mask(text: str) -> str:
    """A table with every number replaced by #: the CPU profile's numbers are timings or drawn from them."""
    return re.sub(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", text)


def _claims_without_measurements(text: str) -> str:
    """The claims check without its "This run" column, whose text ("8K: <the fastest method>") is a timing."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = line.split(" | ")
            if len(cells) == 7:
                del cells[4]
            line = " | ".join(cells)
        rows.append(line)
    return _mask("\n".join(rows))


def _model_step_without_measurements(text: str) -> str:
    """Table 9 with its rows' labels only: every other cell is a timing or a ratio of timings, and
    whether a row's step is bound by its host (its cells then show the HOST_BOUND note) is decided
    from its host and device times, so it too differs between two runs on the CPU."""
    rows = []
    for line in text.splitlines():
        if line.startswith("- [") and HOST_BOUND in line:
            continue
        if line.startswith("|"):
            cells = line.split(" | ")
            line = " | ".join(cells[:3] + ["·"] * (len(cells) - 3))
        rows.append(line)
    return _mask("\n".join(rows))


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """(local run folder, SLURM run folder, the SLURM run's output) from one copy of the checkout.

    The SLURM run goes first and runs every job. The local run starts from its build and
    calibration: on the CPU profile the calibration's constants are measured times, and the routes
    the tables report follow from them, so a calibration of its own would make the two runs'
    routes differ by chance."""
    base = tmp_path_factory.mktemp("slurm_dag")
    source = base / "source"
    source.mkdir()
    _copy_checkout(source)
    (source / "axes.yaml").write_text(AXES)
    local, on_slurm = base / "local", base / "slurm"
    shutil.copytree(source, on_slurm)
    shutil.copytree(source, local)

    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--configfile", "axes.yaml", "--workflow-profile", PROFILE],
        cwd=on_slurm, capture_output=True, text=True, timeout=1800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]

    for name in ("build", "calibration"):  # copytree keeps the times, so both stay up to date
        shutil.copytree(on_slurm / "artifacts/cpu" / name, local / "artifacts/cpu" / name)
    proc = _snakemake(local, "--cores", "2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert not re.search(r"^rule (build|calibrate):", proc.stdout, flags=re.M), proc.stdout[-3000:]
    return local, on_slurm, output


@pytest.mark.slurm
@pytest.mark.slow
def test_every_job_ran_as_a_completed_slurm_job(runs, cluster):
    _, _, output = runs
    run_id = re.search(r"SLURM run ID: (\S+)", output).group(1)
    # "Job 4 has been submitted with SLURM jobid 3 (log: .../slurm_logs/rule_build/3.log)."
    submitted = {
        int(slurm_id): rule
        for slurm_id, rule in re.findall(r"has been submitted with SLURM jobid (\d+) \(log: \S*/rule_([a-z_0-9]+)/", output)
    }
    # The DAG's own job count, the table Snakemake prints before it starts; the target rule `all` has
    # no command and is not submitted.
    planned = _planned_rules(subprocess.CompletedProcess([], 0, output.split("Select jobs to execute")[0], ""))
    assert planned.pop("all") == 1
    assert Counter(submitted.values()) == Counter(planned), (sorted(submitted.items()), planned)

    # jobcomp/filetxt: one line per finished job, "JobId=3 ... Name=<run id> JobState=COMPLETED ...".
    records = {}
    for line in cluster.read_text().splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("Name") == run_id:
            records[int(fields["JobId"])] = fields["JobState"]
    assert set(records) == set(submitted), (sorted(records), sorted(submitted))
    assert set(records.values()) == {"COMPLETED"}, records
    assert len(records) == sum(planned.values())


@pytest.mark.slurm
@pytest.mark.slow
def test_both_runs_write_the_same_result_files(runs):
    local, on_slurm, _ = runs

    def files(root):
        top = root / "artifacts" / "cpu"
        paths = (str(p.relative_to(top)) for p in top.rglob("*") if p.is_file())
        return {p for p in paths if "/.run/" not in f"/{p}"}

    here, there = files(local), files(on_slurm)
    # The logs of the jobs the local run did not rerun (build, the calibration) are
    # only in the SLURM run's folder.
    assert {p for p in here if not p.startswith("logs/")} == {p for p in there if not p.startswith("logs/")}
    assert here <= there
    assert "logs/build.log" in there and "logs/calibrate.log" in there


@pytest.mark.slurm
@pytest.mark.slow
def test_the_tables_are_the_local_runs_but_for_timings(runs):
    local, on_slurm, _ = runs
    tables = sorted((local / "artifacts/cpu/tables").glob("*.md"))
    names = {p.name for p in tables}
    assert names >= {"claims.md"} | {f"table{k}.md" for k in range(1, 9)}, names
    assert names == {p.name for p in (on_slurm / "artifacts/cpu/tables").glob("*.md")}
    for path in tables:
        here, there = path.read_text(), (on_slurm / "artifacts/cpu/tables" / path.name).read_text()
        strip = {"claims.md": _claims_without_measurements,
                 "table9.md": _model_step_without_measurements}.get(path.name, _mask)
        assert strip(there) == strip(here), path.name


# --- the profile for real clusters, without a cluster ------------------------------------------

# Rules that time on the device (gpu=GPU_SLOTS in workflow/rules/); rules added later are held to
# at most one GPU.
GPU_RULES = {"build", "calibrate", "evaluate", "mlp", "isolated", "profile", "kernel_bench", "host_bench",
             "ablate_splits", "ablate_raggedness", "ablate_gqa", "ablate_graph", "ablate_fused_merge", "ablate_b4",
             "ablate_short_rows"}
NO_GPU_RULES = {"tables", "figure"}


def test_the_cluster_profile_plans_the_gpu_dag_with_one_gpu_per_timed_job(tmp_path):
    """workflow/profiles/slurm: the plugin accepts its options, every job names the partition and
    account, the rules that time on the device ask for gpu=1 (the plugin's --gpus=1) and the others
    for none, and no slurm_extra carries an option the plugin refuses there."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="snakemake-executor-plugin-slurm is not installed")
    import yaml
    from snakemake_executor_plugin_slurm.validation import get_forbidden_slurm_options

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--workflow-profile", "workflow/profiles/slurm",
         "--config", "gpu=h200", "profile=gpu", f"artifacts_root={tmp_path}"],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", proc.stdout, flags=re.M)
    assert {rule for rule, _ in jobs} >= GPU_RULES | NO_GPU_RULES
    for rule, resources in jobs:
        res = dict(item.split("=", 1) for item in resources.split(", "))
        assert res["slurm_partition"] and res["slurm_account"], (rule, res)
        gpus = res.get("gpu", "0")
        assert gpus in ("0", "1"), (rule, res)
        if rule in GPU_RULES:
            assert gpus == "1", (rule, res)
        if rule in NO_GPU_RULES:
            assert gpus == "0", (rule, res)
    profile = yaml.safe_load((repo / "workflow/profiles/slurm/config.yaml").read_text())
    for rule, resources in {"default": profile["default-resources"], **profile["set-resources"]}.items():
        extra = str(resources.get("slurm_extra", ""))
        for pattern, option in get_forbidden_slurm_options().items():
            assert not re.search(pattern, extra), (rule, option, extra)
