"""Device slots on the CPU, with a fake device count: N devices go to N jobs and are never shared, a
failed or killed job gives its device back, a scheduler's CUDA_VISIBLE_DEVICES bounds the choice,
no device runs the command unslotted, and the DAG's GPU rules run through the wrapper."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pkv import provenance
from pkv.device_slots import available_devices, lock_path

REPO = Path(__file__).resolve().parent.parent
WRAPPER = [sys.executable, "-m", "pkv.device_slots", "run"]

# A job: records the device it was given and when it held it, then waits until `need` jobs have
# started (a barrier: the first `need` jobs can only all start if they run side by side) and sleeps.
JOB = textwrap.dedent("""\
    import json, os, sys, time
    folder, name, need, nap = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    start = time.time()
    open(os.path.join(folder, name + ".start"), "w").close()
    deadline = time.time() + 15
    while sum(f.endswith(".start") for f in os.listdir(folder)) < need and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(nap)
    record = {"device": os.environ.get("CUDA_VISIBLE_DEVICES"), "slot": os.environ.get("PKV_DEVICE_SLOT"),
              "start": start, "end": time.time()}
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(record, f)
""")


def _env(fake=None, visible=None, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "PKV_FAKE_DEVICE_COUNT", "PKV_SLOT_DIR", "PKV_DEVICE_SLOT",
                        "SLURM_JOB_ID")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if fake is not None:
        env["PKV_FAKE_DEVICE_COUNT"] = str(fake)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env.update(extra)
    return env


def _run(slot_dir, command, env, *options, timeout=30):
    return subprocess.run([*WRAPPER, "--slot-dir", str(slot_dir), *options, "--", *command],
                          env=env, capture_output=True, text=True, timeout=timeout)


def _start(slot_dir, command, env, *options, **popen):
    return subprocess.Popen([*WRAPPER, "--slot-dir", str(slot_dir), *options, "--", *command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _wait_for(path: Path, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _kill_job(proc):
    """Kill a job started with start_new_session=True, the wrapper and its command alike."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _sleeper(flag: Path, seconds=30):
    return [sys.executable, "-c", f"import time; open({str(flag)!r}, 'w').close(); time.sleep({seconds})"]


def test_n_devices_go_to_n_jobs_and_are_never_shared(tmp_path):
    n, jobs = 3, 6
    records = tmp_path / "records"
    records.mkdir()
    env = _env(fake=n)
    procs = [_start(tmp_path / "slots", [sys.executable, "-c", JOB, str(records), f"job{j}", str(n), "0.2"], env)
             for j in range(jobs)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    got = [json.loads((records / f"job{j}.json").read_text()) for j in range(jobs)]
    assert all(r["device"] == r["slot"] for r in got)
    # The barrier held the first n jobs until all n had started: they ran at once, on every device.
    assert {r["device"] for r in got} == {str(i) for i in range(n)}
    by_device = {}
    for r in got:
        by_device.setdefault(r["device"], []).append((r["start"], r["end"]))
    for device, spans in by_device.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end, f"two jobs held device {device} at once: {spans}"


def test_a_failed_job_gives_its_device_back_and_its_status_out(tmp_path):
    env = _env(fake=1)
    failed = _run(tmp_path, [sys.executable, "-c", "import sys; sys.exit(7)"], env)
    assert failed.returncode == 7, failed.stderr
    # --timeout 0: the device must be free at once.
    again = _run(tmp_path, [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"], env,
                 "--timeout", "0")
    assert again.returncode == 0 and again.stdout.strip() == "0", again.stderr
    assert lock_path(tmp_path, "0").read_text() == ""  # released: no holder recorded


def test_a_killed_job_frees_its_device(tmp_path):
    env = _env(fake=1)
    slots = tmp_path / "slots"
    flag = tmp_path / "running"
    job = _start(slots, _sleeper(flag), env, start_new_session=True)
    _wait_for(flag)
    busy = _run(slots, ["true"], env, "--timeout", "0")
    assert busy.returncode == 2
    line = busy.stderr.strip()
    assert line.startswith("pkv: ") and "\n" not in line and "field 'timeout'" in line
    assert f"pid {job.pid}" in line  # the holder is named
    _kill_job(job)  # the whole job, as a scheduler kills it
    free = _run(slots, ["true"], env, "--timeout", "0")
    assert free.returncode == 0, free.stderr


def test_the_command_holds_its_device_even_when_the_wrapper_dies_first(tmp_path):
    env = _env(fake=1)
    flag = tmp_path / "running"
    job = _start(tmp_path, _sleeper(flag), env, start_new_session=True)
    try:
        _wait_for(flag)
        holder = json.loads(lock_path(tmp_path, "0").read_text())
        assert holder["pid"] == job.pid and holder["device"] == "0" and "time.sleep" in holder["command"]
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        # The command still runs on the device, so the device is still taken.
        assert _run(tmp_path, ["true"], env, "--timeout", "0").returncode == 2
        os.kill(holder["child_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _run(tmp_path, ["true"], env, "--timeout", "0").returncode != 0:
            assert time.monotonic() < deadline, "the device stayed taken after its command died"
            time.sleep(0.1)
    finally:
        _kill_job(job)


def test_sigterm_reaches_the_command(tmp_path):
    env = _env(fake=1)
    flag = tmp_path / "running"
    job = _start(tmp_path, _sleeper(flag), env)
    _wait_for(flag)
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=10)
    assert job.returncode == 128 + signal.SIGTERM
    assert _run(tmp_path, ["true"], env, "--timeout", "0").returncode == 0


def test_a_schedulers_devices_bound_the_slots(tmp_path):
    env = _env(fake=4, visible="5,7")
    show = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['PKV_DEVICE_SLOT'])"]
    first = _run(tmp_path, show, env)
    assert first.stdout.split() == ["5", "5"], first.stderr
    holders = []
    try:
        for k in range(2):
            flag = tmp_path / f"running{k}"
            holders.append(_start(tmp_path, _sleeper(flag), env, start_new_session=True))
            _wait_for(flag)
        held = {json.loads(lock_path(tmp_path, d).read_text())["pid"]: d for d in ("5", "7")}
        assert held == {holders[0].pid: "5", holders[1].pid: "7"}
        # Both of the scheduler's devices are taken: no third one is made up.
        third = _run(tmp_path, show, env, "--timeout", "0")
        assert third.returncode == 2 and "every device of ['5', '7'] stayed busy" in third.stderr
    finally:
        for holder in holders:
            _kill_job(holder)
    assert sorted(p.name.rsplit(".device-", 1)[1] for p in tmp_path.glob("*.lock")) == ["5.lock", "7.lock"]


def test_visible_devices_are_read_as_cuda_reads_them(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert available_devices(environ={"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]
    assert available_devices(environ={"CUDA_VISIBLE_DEVICES": ""}) == []
    assert available_devices(environ={"CUDA_VISIBLE_DEVICES": "GPU-abc, GPU-def"}) == ["GPU-abc", "GPU-def"]
    assert available_devices(2, environ={"CUDA_VISIBLE_DEVICES": "3,4,5"}) == ["3", "4"]
    assert available_devices(environ={"PKV_FAKE_DEVICE_COUNT": "3"}) == ["0", "1", "2"]
    assert available_devices(8, environ={"PKV_FAKE_DEVICE_COUNT": "2"}) == ["0", "1"]  # never widened
    from pkv.config import ConfigError

    with pytest.raises(ConfigError, match="field 'PKV_FAKE_DEVICE_COUNT' = 'two'"):
        available_devices(environ={"PKV_FAKE_DEVICE_COUNT": "two"})


def test_jobs_of_different_slurm_allocations_do_not_wait_for_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    mine = lock_path(tmp_path, "0")
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert lock_path(tmp_path, "0") != mine


def test_pkv_slot_dir_wins_over_the_commands_folder(tmp_path):
    shared = tmp_path / "shared"
    proc = _run(tmp_path / "dag", ["true"], _env(fake=1, PKV_SLOT_DIR=str(shared)))
    assert proc.returncode == 0, proc.stderr
    assert lock_path(shared, "0").exists() and not (tmp_path / "dag").exists()


def test_without_devices_the_command_runs_unslotted(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    env = _env(fake=0)
    proc = _run(not_a_folder, [sys.executable, "-c", "import os, sys; print(os.environ.get('CUDA_VISIBLE_DEVICES'), "
                               "os.environ.get('PKV_DEVICE_SLOT')); sys.exit(3)"], env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["None", "None"]


def test_a_bad_slot_dir_is_one_refusal_line(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    proc = _run(not_a_folder / "slots", ["true"], _env(fake=1))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"pkv: {not_a_folder / 'slots'}: field 'slot_dir' = "), lines[0]


def test_provenance_names_the_slots_device(monkeypatch):
    provenance.nvidia_smi_devices.cache_clear()
    real_run, real_which = subprocess.run, provenance.shutil.which

    def fake_smi(cmd, **kwargs):
        if cmd[0] == "nvidia-smi":
            rows = "".join(f"NVIDIA H200, 570.1, {i}, GPU-{i}{i}{i}\n" for i in range(4))
            return subprocess.CompletedProcess(cmd, 0, stdout=rows, stderr="")
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(provenance.subprocess, "run", fake_smi)
    monkeypatch.setattr(provenance.shutil, "which",
                        lambda n: "/usr/bin/nvidia-smi" if n == "nvidia-smi" else real_which(n))
    monkeypatch.setattr(provenance, "_torch_info", lambda: ("2.5.0", "12.4", "NVIDIA H200"))
    monkeypatch.setattr(provenance, "_torch_device_uuid", lambda: None)  # only nvidia-smi knows it here
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setenv("PKV_DEVICE_SLOT", "2")
    try:
        prov = provenance.collect_provenance()
        assert (prov["device_index"], prov["device_uuid"], prov["cuda_visible_devices"]) == (2, "GPU-222", "2")
        monkeypatch.delenv("PKV_DEVICE_SLOT")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        prov = provenance.collect_provenance()
        assert (prov["device_index"], prov["device_uuid"], prov["cuda_visible_devices"]) == (0, "GPU-000", None)
        monkeypatch.setattr(provenance, "_torch_device_uuid", lambda: "GPU-from-torch")
        assert provenance.collect_provenance()["device_uuid"] == "GPU-from-torch"
        monkeypatch.setattr(provenance, "_torch_info", lambda: ("2.5.0", None, None))
        provenance.nvidia_smi_devices.cache_clear()
        monkeypatch.setattr(provenance.shutil, "which", lambda n: None if n == "nvidia-smi" else real_which(n))
        prov = provenance.collect_provenance()
        assert prov["device_index"] is None and prov["device_uuid"] is None
    finally:
        provenance.nvidia_smi_devices.cache_clear()


def _shell_commands(dry_run: str) -> dict[str, set[str]]:
    """{rule: its shell commands} from `snakemake -n -p`; `resources` marks the rules that hold a GPU."""
    commands, rule = {}, None
    for line in dry_run.splitlines():
        m = re.match(r"(?:local)?rule (\w+):", line)
        if m:
            rule = m.group(1)
        elif line.startswith("Shell command:") and rule:
            commands.setdefault(rule, set()).add(line.removeprefix("Shell command:").strip())
    return commands


def _gpu_rules(dry_run: str) -> set[str]:
    rules, rule = set(), None
    for line in dry_run.splitlines():
        m = re.match(r"(?:local)?rule (\w+):", line)
        if m:
            rule = m.group(1)
        elif re.match(r"\s+resources: .*\bgpu=1\b", line) and rule:
            rules.add(rule)
    return rules


def test_the_dags_gpu_rules_run_through_the_wrapper_and_vllms_build_beside_them(tmp_path):
    # profile=gpu with a GPU's conf file plans the GPU profile without touching a device.
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--config", "gpu=h200", "profile=gpu",
                           f"artifacts_root={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands, gpu_rules = _shell_commands(proc.stdout), _gpu_rules(proc.stdout)
    assert {"calibrate", "evaluate", "ablate_splits", "profile", "kernel_bench"} <= gpu_rules
    wrapper = f"-m pkv.device_slots run --slot-dir {tmp_path}/.slots "
    for rule in gpu_rules - {"build"}:
        for command in commands[rule]:
            assert wrapper in command, (rule, command)
            # The package's path and thread count reach the command through the wrapper's environment.
            assert command.index("PYTHONPATH=") < command.index(wrapper)
            # Every timed job runs in its slot's warm worker but the profile, which runs ncu around
            # a second process: a fresh process on its device.
            warm = f"{wrapper}--warm -- "
            assert (warm in command) == (rule != "profile"), (rule, command)
    # The builds (the extension, vLLM's kernels) time nothing: no slot. vLLM's nvcc work holds no
    # GPU either, so it runs beside the calibration.
    assert "vllm_sources" not in gpu_rules
    # vLLM's kernels compile in a job of their own, which the timing rules that run its rows wait for.
    assert len(commands["vllm_sources"]) == 1
    for rule in ("kernel_bench", "isolated"):
        assert re.search(rf"rule {rule}:\n\s+input: [^\n]*{tmp_path}/h200/build/vllm\.json", proc.stdout), rule
    assert not any("pkv.device_slots" in c for c in commands["build"])
    assert not any("pkv.device_slots" in c for c in commands["vllm_sources"])
    assert not any("pkv.device_slots" in c for c in commands["tables"])


def test_the_client_loads_no_torch_and_names_the_slot_as_provenance_reads_it():
    """The slot wrapper is the client of every GPU job: it starts without torch or Hydra, and the
    variable it sets for the job is the one pkv.provenance records."""
    from pkv import device_slots

    assert device_slots.SLOT_ENV == provenance.DEVICE_SLOT_ENV
    code = "import sys, pkv.device_slots; print(sorted(m for m in ('torch', 'hydra') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
