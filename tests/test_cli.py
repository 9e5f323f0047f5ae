"""The Hydra entry point: overrides reach the drivers, bad input exits with a clear message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pkv.config import compose
from pkv.experiments.common import engine_role_and_options, resolve_settings
from pkv.experiments.profile import NcuParseError, parse_ncu_csv

REPO = Path(__file__).resolve().parent.parent


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pkv.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_profile_scales_and_marks_results():
    cfg = compose(["out=x", "profile=cpu", "trace=bimodal", "trace.num_requests=40"])
    s = resolve_settings(cfg)
    assert s.device == "cpu" and s.dtype == "float32" and not s.performance_result
    assert s.length_scale == pytest.approx(1 / 64)
    assert s.num_requests == cfg.cpu_profile.max_requests
    assert s.measured_steps == cfg.cpu_profile.measured_steps


def test_engine_labels_fix_their_options():
    cfg = compose(["out=x", "engine.num_splits=12", "engine.merge=fused"])
    role, options = engine_role_and_options("persistentkv_masked", cfg.engine)
    assert role == "persistentkv" and options["route"] == "bucket_masked" and options["merge"] == "fused"
    # The split count reaches engines through the run's calibration, never as an engine option.
    assert "num_splits" not in options
    role, options = engine_role_and_options("persistentkv_workqueue_fused", cfg.engine)
    assert (role, options["route"], options["merge"]) == ("persistentkv", "workqueue", "fused")


def test_cli_evaluate_writes_one_result_per_engine(tmp_path):
    out = tmp_path / "evaluate" / "bimodal_b8" / "seed20260623"
    proc = _cli("experiment=evaluate", "trace=bimodal", "trace.num_requests=4", "profile=cpu",
                "experiment.measured_steps=2", "seed=20260623", f"out={out}",
                f"hydra.run.dir={out}/.run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(records) == {"adaptive", "flashinfer", "xqa"}
    assert len({r["run_id"] for r in records.values()}) == 1
    # XQA has no CPU stand-in: its file says why it did not run, the others ran.
    assert records.pop("xqa")["skipped"] == "XQA needs a CUDA device, got cpu"
    for rec in records.values():
        assert rec["performance_result"] is False
        assert rec["trace"]["name"] == "bimodal_b8" and rec["trace"]["num_requests"] == 4
        assert rec["metrics"]["steps"] == 2
        assert rec["provenance"]["seed"] == 20260623
        assert rec["provenance"]["config"]["trace"]["num_requests"] == 4
    assert (out / ".run" / ".hydra" / "config.yaml").is_file()


def test_cli_profile_on_cpu_records_why(tmp_path):
    out = tmp_path / "ncu_counters.json"
    proc = _cli("experiment=profile", "profile=cpu", f"out={out}", f"hydra.run.dir={tmp_path}/.run",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["skipped"] == "no GPU: Nsight Compute needs one"


def test_the_run_ncu_starts_passes_the_clis_checks(tmp_path):
    """What ncu launches (pkv.experiments.profile.ncu_command's command after the ncu flags), run
    here without ncu: the child's overrides pass the CLI's checks and it times its trace."""
    from pkv.experiments.profile import CHILD_ENV, child_overrides

    out = tmp_path / "profile" / "ncu_counters.json"
    outer = ["experiment=profile", "profile=cpu", "experiment.measured_steps=2", "progress=false",
             f"out={out}", f"hydra.run.dir={tmp_path}/profile/.run"]
    env = {**os.environ, CHILD_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "pkv.cli", *child_overrides(outer, out)], cwd=REPO,
                          env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                               "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "profile" / "ncu_child").is_dir() and not out.exists()


def test_cli_bad_value_exits_with_field_and_value(tmp_path):
    proc = _cli("trace.page_size=24", "out=x", f"hydra.run.dir={tmp_path}/.run", cwd=tmp_path)
    assert proc.returncode != 0
    assert "trace.page_size" in proc.stderr and "24" in proc.stderr
    assert "conf/trace/bimodal.yaml" in proc.stderr


def test_calibrate_refuses_held_out_seeds(tmp_path):
    proc = _cli("experiment=calibrate", "profile=cpu", "seed=20260623", f"out={tmp_path}/c.json",
                f"hydra.run.dir={tmp_path}/.run", cwd=tmp_path)
    assert proc.returncode != 0 and "20260622" in proc.stderr
    assert not (tmp_path / "c.json").exists()


def test_a_gpu_file_through_the_cpu_profile_keeps_its_routes_with_gates_scaled_as_the_traces(tmp_path):
    """README, "A new GPU": conf/gpu/h200.yaml on a machine without one. Its gates are in the GPU's
    tokens; the CPU profile scales them by its length scale (1/64), as it scales every trace."""
    import yaml

    from pkv.policy import load_calibration

    out = tmp_path / "c.json"
    proc = _cli("experiment=calibrate", "profile=cpu", "gpu=h200", "seed=20260622", f"out={out}",
                f"hydra.run.dir={tmp_path}/.run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = yaml.safe_load((REPO / "conf" / "gpu" / "h200.yaml").read_text())["regimes"]
    calib = load_calibration(out)
    for regime, params in start.items():
        assert calib.regime(regime).route == params["route"]
        assert calib.regime(regime).min_context_tokens == max(1, round(params["min_context_tokens"] / 64))


NCU_CSV = '''"ID","Kernel Name","thread Domain:Push/Pop_Range","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","dram__bytes_read.sum.per_second","lts__t_sector_hit_rate.pct"
"","","","usecond","%","%","Tbyte/second","%"
"0","BatchDecodeKernel","pkv:flashinfer_decode","40.0","9.5","62.0","3.30","0.10"
"1","workqueue_decode_kernel","pkv:persistentkv_decode","20.0","17.0","74.0","3.10","0.40"
"2","merge_states_kernel","pkv:persistentkv_decode","2.0","30.0","60.0","2.00","9.00"
"3","workqueue_decode_kernel","pkv:persistentkv_decode","30.0","19.0","76.0","3,300","0.60"
'''


def test_parse_ncu_csv_converts_units_and_averages():
    kernels = {k["name"]: k for k in parse_ncu_csv(NCU_CSV)}
    wq = kernels["workqueue_decode_kernel"]
    assert wq["invocations"] == 2 and wq["role"] == "PersistentKV decode"
    assert wq["time_ms"] == pytest.approx(0.025)
    assert wq["dram_gbps"] == pytest.approx((3100 + 3300e3) / 2)
    assert kernels["merge_states_kernel"]["role"] == "PersistentKV merge"
    assert kernels["BatchDecodeKernel"]["role"] == "FlashInfer decode"
    assert kernels["BatchDecodeKernel"]["sm_throughput_pct"] == pytest.approx(9.5)


def test_parse_ncu_csv_rejects_missing_columns():
    with pytest.raises(NcuParseError, match="lts__t_sector_hit_rate.pct"):
        parse_ncu_csv(NCU_CSV.replace("lts__t_sector_hit_rate.pct", "other"))


@pytest.mark.parametrize("unit, gbps", [("Tbyte/s", 3300.0), ("Gbyte/second", 3.3), ("byte/s", 3.3e-9),
                                        ("Mbyte/s", 3.3e-3)])
def test_parse_ncu_csv_reads_every_rate_prefix(unit, gbps):
    """ncu picks the rate prefix per report ("Tbyte/s" on an H200), so every decimal prefix parses."""
    kernels = {k["name"]: k for k in parse_ncu_csv(NCU_CSV.replace("Tbyte/second", unit))}
    assert kernels["BatchDecodeKernel"]["dram_gbps"] == pytest.approx(gbps)


def test_parse_ncu_csv_rejects_unknown_rate_units():
    with pytest.raises(NcuParseError, match="furlong/s"):
        parse_ncu_csv(NCU_CSV.replace("Tbyte/second", "furlong/s"))
