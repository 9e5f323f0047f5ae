"""Warm workers (pkv.worker) on the CPU, through the slot wrapper as the DAG's jobs call it: a job's
output reaches its log, a failure returns its traceback and status and leaves the worker serving,
a worker that dies fails only the job in flight, what a job leaves behind is put back before the
next, and PKV_WORKER=0 runs fresh processes. That a DAG run gives in a worker, after other jobs,
what it gives in a fresh process is tests/test_dag_cpu.py's A/B."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pkv import worker

REPO = Path(__file__).resolve().parent.parent

# A job module: each action does one thing a DAG job might, "report" says what the process holds.
JOB = textwrap.dedent("""\
    import json, logging, os, signal, subprocess, sys, threading, time, warnings
    import torch
    from pkv.engines import flashinfer as fi
    from pkv import provenance

    action = sys.argv[1]
    if action == "report":
        print(json.dumps({
            "pid": os.getpid(), "cwd": os.getcwd(), "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slot": os.environ.get("PKV_DEVICE_SLOT"), "leftover": os.environ.get("PKV_TEST_LEFTOVER"),
            "job_var": os.environ.get("PKV_TEST_JOB_VAR"), "argv": sys.argv[1:],
            "seed": torch.initial_seed(), "rand": torch.rand(3).tolist(), "grad": torch.is_grad_enabled(),
            "dtype": str(torch.get_default_dtype()), "picks": len(fi._PATH_PICKS),
            "warning_filters": len(warnings.filters), "root_handlers": len(logging.getLogger().handlers),
            "path_tail": sys.path[-1], "main": __name__,
            "digest_cached": provenance.source_digest.cache_info().currsize}))
    elif action == "dirty":
        os.environ["PKV_TEST_LEFTOVER"] = "1"
        os.chdir("/")
        torch.manual_seed(5)
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        fi._PATH_PICKS[(1, 2)] = "cc"
        warnings.simplefilter("ignore")
        logging.getLogger().addHandler(logging.StreamHandler())
        sys.path.append("/nonexistent-path-of-a-job")
        provenance.source_digest()
        print("dirtied")
    elif action == "fail":
        raise ValueError("boom from the job")
    elif action == "exit":
        sys.exit(int(sys.argv[2]))
    elif action == "crash":
        print("about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "thread":
        threading.Thread(target=time.sleep, args=(1.0,), name="left-behind").start()
    elif action == "child":
        print("from the job", flush=True)
        subprocess.run(["sh", "-c", "echo from the child; echo child to stderr >&2"], check=True)
        print("job to stderr", file=sys.stderr)
    elif action == "sleep":
        with open(sys.argv[2] + ".part", "w") as f:
            json.dump({"pid": os.getpid(), "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
                       "slot": os.environ.get("PKV_DEVICE_SLOT")}, f)
        os.rename(sys.argv[2] + ".part", sys.argv[2])
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(slot folder, environment) with the job module on the path and one CPU worker slot. The slot
    folder is deeper than a Unix socket's address can name: every job reaches its worker through
    the folder's descriptor."""
    root = tmp_path_factory.mktemp("worker")
    (root / "mods").mkdir()
    (root / "mods" / "pkv_test_job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PKV_WORKER", "PKV_SLOT_DIR", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "PKV_CPU_WORKERS",
                        "PKV_FAKE_DEVICE_COUNT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(root / "mods")]), OMP_NUM_THREADS="1",
               PKV_CPU_WORKERS="1", PKV_WORKER_IDLE_S="120")
    slots = root / ("d" * 60) / ("e" * 60) / "slots"
    yield slots, env
    subprocess.run([sys.executable, "-m", "pkv.worker", "stop", "--slot-dir", str(slots)], env=env,
                   capture_output=True, timeout=60)


def _cmd(slots, *args, warm=True):
    return [sys.executable, "-m", "pkv.device_slots", "run", "--devices", "0", "--slot-dir", str(slots),
            *(["--warm"] if warm else []), "--", sys.executable, "-m", "pkv_test_job", *args]


def _job(jobs, *args, warm=True, **extra):
    slots, env = jobs
    return subprocess.run(_cmd(slots, *args, warm=warm), env={**env, **extra}, capture_output=True, text=True,
                          timeout=180, cwd=str(REPO))


def _report(jobs, **extra):
    proc = _job(jobs, "report", **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"worker {pid} is still running"
        time.sleep(0.05)


def _wait_file(path, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_a_job_runs_in_the_warm_worker_with_its_own_output_and_environment(jobs):
    slots, _ = jobs
    first, second = _report(jobs, PKV_TEST_JOB_VAR="a"), _report(jobs, PKV_TEST_JOB_VAR="b")
    assert first["pid"] == second["pid"] != os.getpid()  # one worker served both
    assert (first["job_var"], second["job_var"]) == ("a", "b")  # each job's own environment
    assert first["cwd"] == second["cwd"] == str(REPO) and first["main"] == "__main__"
    assert first["argv"] == ["report"]
    proc = _job(jobs, "child")
    assert proc.returncode == 0, proc.stderr
    # The job's streams are the client's (the rule's log): the job's, and a child process's, output.
    assert proc.stdout.splitlines()[-2:] == ["from the job", "from the child"]
    assert "child to stderr" in proc.stderr and "job to stderr" in proc.stderr
    assert proc.stderr.startswith("pkv.worker: job ")  # the log says the job ran warm
    sockets = list(slots.glob("*.sock"))
    assert len(sockets) == 1 and len(str(sockets[0])) > 107
    log = next(slots.glob("*.worker.log")).read_text()
    assert "ready on" in log and "status 0" in log


def test_a_failed_job_returns_its_traceback_and_status_and_the_worker_serves_on(jobs):
    before = _report(jobs)["pid"]
    proc = _job(jobs, "fail")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "ValueError: boom from the job" in proc.stderr
    assert "pkv/worker.py" not in proc.stderr  # the job's frames, not the worker's
    assert _job(jobs, "exit", "3").returncode == 3
    assert _job(jobs, "exit", "0").returncode == 0
    assert _report(jobs)["pid"] == before


def test_what_a_job_leaves_behind_is_put_back_and_pkv_worker_0_runs_fresh(jobs, tmp_path):
    _, env = jobs
    # PKV_WORKER=0: a fresh process, no worker (another slot folder, which stays without a socket).
    fresh = _report((tmp_path / "slots", env), PKV_WORKER="0")
    assert not (tmp_path / "slots").exists() or not list((tmp_path / "slots").glob("*.sock"))
    worker_pid = _report(jobs)["pid"]
    assert fresh["pid"] != worker_pid
    proc = _job(jobs, "dirty")
    assert proc.returncode == 0 and "dirtied" in proc.stdout, proc.stderr
    after = _report(jobs)
    assert after["pid"] == worker_pid
    for key in ("cwd", "leftover", "grad", "dtype", "picks", "warning_filters", "root_handlers", "path_tail",
                "digest_cached"):
        assert after[key] == fresh[key], key
    # torch's seed as in a fresh process: its fixed default where torch has one, else a new one.
    if fresh["seed"] == 67280421310721:
        assert (after["seed"], after["rand"]) == (fresh["seed"], fresh["rand"])
    else:
        assert after["seed"] != 5 and after["seed"] != _report(jobs)["seed"]
    # A Slurm job runs fresh too: one Slurm job is one slot.
    assert not worker.enabled({"SLURM_JOB_ID": "7"}) and worker.enabled({}) and not worker.enabled({"PKV_WORKER": "0"})


def test_other_start_up_settings_get_their_own_worker_and_a_crash_fails_only_its_job(jobs):
    slots, env = jobs
    one = _report(jobs)["pid"]
    # Another thread count is another worker's job; the old worker goes.
    proc = _job(jobs, "crash", OMP_NUM_THREADS="2")
    _wait_gone(one)
    assert proc.returncode != 0
    assert "about to die" in proc.stdout and "ended during this job" in proc.stderr
    # The crashed worker failed only its job: the next job starts a fresh worker.
    after = _report(jobs)
    assert after["pid"] != one and _alive(after["pid"])
    assert len(list(slots.glob("*.sock"))) == 1
    status = subprocess.run([sys.executable, "-m", "pkv.worker", "status", "--slot-dir", str(slots)], env=env,
                            capture_output=True, text=True, timeout=60)
    rows = [json.loads(line) for line in status.stdout.splitlines()]
    assert [r["pid"] for r in rows] == [after["pid"]] and rows[0]["jobs"] == 1


def test_a_job_that_leaves_a_thread_running_retires_its_worker(jobs):
    before = _report(jobs)["pid"]
    proc = _job(jobs, "thread")
    assert proc.returncode == 0
    assert "threads still running: left-behind" in proc.stderr and "next job starts a fresh one" in proc.stderr
    _wait_gone(before)


def test_a_client_stopped_mid_job_ends_the_job_and_frees_the_slot(jobs, tmp_path):
    import fcntl

    slots, env = jobs
    flag = tmp_path / "started"
    proc = subprocess.Popen(_cmd(slots, "sleep", str(flag)), env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    worker_pid = _wait_file(flag, proc)["pid"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    _wait_gone(worker_pid)
    assert not list(slots.glob("*.sock"))
    # The slot's lock is free: nothing holds it once the job is gone.
    with open(next(slots.glob("*.cpu-0.lock")), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_each_device_slot_has_a_worker_that_sees_only_its_device(jobs, tmp_path):
    """Two fake devices, two jobs at once: each runs in its own device's worker, which was started
    with CUDA_VISIBLE_DEVICES narrowed to that device."""
    _, env = jobs
    env = {**env, "PKV_FAKE_DEVICE_COUNT": "2"}
    slots = tmp_path / "slots"
    flags = [tmp_path / f"job{i}" for i in range(2)]
    cmd = [sys.executable, "-m", "pkv.device_slots", "run", "--slot-dir", str(slots), "--warm", "--", sys.executable,
           "-m", "pkv_test_job", "sleep"]
    procs = [subprocess.Popen([*cmd, str(flag)], env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for flag in flags]
    try:
        seen = [_wait_file(flag, proc) for flag, proc in zip(flags, procs)]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert len({s["pid"] for s in seen}) == 2  # both devices busy at once, each with a worker of its own
    assert sorted((s["device"], s["slot"]) for s in seen) == [("0", "0"), ("1", "1")]
    assert sorted(p.name.split(".")[-3] for p in slots.glob("*.worker.log")) == ["device-0", "device-1"]
    for s in seen:
        _wait_gone(s["pid"])


def test_module_calls_and_the_jit_cache_place():
    assert worker.module_call(["/usr/bin/python3", "-m", "pkv.cli", "a=1"]) == ("/usr/bin/python3", "pkv.cli", ["a=1"])
    assert worker.module_call(["/bin/sh", "-c", "true"]) is None
    env = worker.with_jit_cache({"PKV_CACHE_DIR": "/c/pkv"})
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/c/pkv/flashinfer"
    assert worker.with_jit_cache({"FLASHINFER_WORKSPACE_BASE": "/mine"})["FLASHINFER_WORKSPACE_BASE"] == "/mine"


def test_the_reset_check_passes_on_this_machine():
    """`python -m pkv.worker selfcheck` (with --device on a GPU: CUDA graphs, cuBLAS, device memory)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pkv.worker", "selfcheck"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout and "all checks as expected" in proc.stdout
