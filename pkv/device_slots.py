"""Device slots: each GPU job of a DAG run gets one device of its own.

Snakemake counts GPU jobs (``--resources gpu=N``) but does not say which device a job should use,
so every job would otherwise run on device 0. Here a slot directory holds one lock file per device
(``<host>.device-<entry>.lock``); a job takes the first device whose file it can ``flock``, waits while
every device is busy, and runs its command with ``CUDA_VISIBLE_DEVICES`` narrowed to that device:

    python -m pkv.device_slots run [--slot-dir D] [--devices N] [--timeout S] -- <command...>

flock locks belong to open files, so the kernel drops a slot whose holders died (a killed job needs
no cleanup), and the command inherits the lock's file descriptor: the slot is held for exactly as
long as the process that uses the device runs, even if this wrapper is killed first. The lock file
also records its holder (pid, host, command, start) for a human who wonders who has a device; it is
a lock, not an artifact, so that text goes through the locked descriptor, not the atomic writer.

The devices to choose from are the entries of ``CUDA_VISIBLE_DEVICES`` when a scheduler has set it
(a Slurm job's cards: a slot never widens them), else the devices ``nvidia-smi`` lists;
``PKV_FAKE_DEVICE_COUNT=N`` stands in for detection on a machine without GPUs (tests). With no
device at all (the CPU profile) the command runs without a slot.

``--warm`` runs a ``python -m <module>`` command in the slot's warm worker (pkv.worker): a process
that keeps torch, the CUDA context, FlashInfer and the package loaded from one job to the next and
puts back what each job leaves behind. Without a device, ``--warm`` takes a CPU worker slot
(``<host>.cpu-<k>.lock``, one per usable core or ``PKV_CPU_WORKERS``) instead, so that each CPU
worker runs one job at a time. ``PKV_WORKER=0``, a Slurm job, or a command that is not
``python -m`` runs the command in a fresh process as without ``--warm``.

This module is the client side of every GPU job, so it loads nothing heavy: no torch, no Hydra
(a refusal loads pkv.refusal only when there is one to print).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pkv import worker
from pkv.slot_names import CPU, DEFAULT_SLOT_DIR, DEVICE, SLOT_DIR_ENV, slot_name

FAKE_COUNT_ENV = "PKV_FAKE_DEVICE_COUNT"
# What the command sees of its slot: the device entry it holds, for the result's provenance
# (pkv.provenance.DEVICE_SLOT_ENV, which reads it; named here so that the client imports no more).
SLOT_ENV = "PKV_DEVICE_SLOT"
# A waiting job looks again this often: short next to a job (seconds to minutes), long enough that
# a few waiters cost nothing.
POLL_S = 0.2


def _visible_entries(value: str) -> list[str]:
    """Entries of a CUDA_VISIBLE_DEVICES value as CUDA reads them: it stops at the first invalid
    one (empty, negative), so "0,-1,2" makes only device 0 visible and "" or "-1" none."""
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry or entry.startswith("-") or entry == "NoDevFiles":  # NoDevFiles: Slurm, no GPU
            break
        entries.append(entry)
    return entries


def _config_error(message: str) -> Exception:
    # pkv.config loads Hydra: only when there is something to refuse.
    from pkv.config import ConfigError

    return ConfigError(message)


def _nvidia_smi_indices() -> list[str] | None:
    """Device indices nvidia-smi lists (the provenance's one call), or None without a working nvidia-smi."""
    from pkv.provenance import nvidia_smi_devices

    name, _, uuids = nvidia_smi_devices()
    return None if name is None else list(uuids)


def _torch_device_count() -> int:
    # Only without nvidia-smi. Counting devices does not create a CUDA context, and the command
    # runs in a fresh process anyway, so nothing of this one's CUDA state reaches it.
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # no torch, a CPU build or a broken driver: no device to hand out
        return 0


def available_devices(devices: int | None = None, environ: dict | None = None) -> list[str]:
    """The device entries slots are over: CUDA_VISIBLE_DEVICES's when set, else every detected
    device's index; ``devices`` keeps only the first N (it narrows, it never adds devices)."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        entries = _visible_entries(env["CUDA_VISIBLE_DEVICES"])
    elif env.get(FAKE_COUNT_ENV) is not None:
        raw = env[FAKE_COUNT_ENV]
        try:
            count = int(raw)
        except ValueError:
            count = -1
        if count < 0:
            raise _config_error(f"environment: field '{FAKE_COUNT_ENV}' = {raw!r}: must be a whole number >= 0")
        entries = [str(i) for i in range(count)]
    elif devices is not None:
        # An explicit count needs no detection: the devices are 0..N-1 of this machine.
        entries = [str(i) for i in range(devices)]
    else:
        indices = _nvidia_smi_indices()
        entries = indices if indices is not None else [str(i) for i in range(_torch_device_count())]
    return entries if devices is None else entries[:devices]


# How a waiting or refused job names a slot of each kind.
_NOUN = {DEVICE: "device", CPU: "CPU worker slot"}


def _lock_name(entry: str, kind: str = DEVICE) -> str:
    return f"{slot_name(entry, kind)}.lock"


def lock_path(slot_dir: str | os.PathLike, entry: str, kind: str = DEVICE) -> Path:
    """The lock file of device ``entry`` (or CPU worker slot) in ``slot_dir``, for this host (and Slurm job)."""
    return Path(slot_dir) / _lock_name(entry, kind)


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder not recorded"
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started', '?')}: "
            f"{holder.get('command', '?')}")


class DeviceSlot:
    """One held device: ``entry`` (what CUDA_VISIBLE_DEVICES is set to), its lock ``path`` and fd."""

    def __init__(self, entry: str, path: Path, fd: int, kind: str = DEVICE):
        self.entry, self.path, self.fd, self.kind = entry, path, fd, kind
        self.name = path.name.removesuffix(".lock")
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def record(self, command: Sequence[str], child_pid: int | None = None) -> None:
        """Write who holds the device into its lock file, through the locked descriptor."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "device": self.entry,
                  "command": shlex.join(command),
                  "started": self.started}
        if child_pid is not None:
            holder["child_pid"] = child_pid
        data = (json.dumps(holder) + "\n").encode("utf-8")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            # The file stays (a waiter may have it open); an empty one reads as "free, no holder".
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = -1


def _slot_dir_error(slot_dir: Path, exc: OSError) -> OSError:
    why = exc.strerror or str(exc)
    return OSError(f"{slot_dir}: field 'slot_dir' = {str(slot_dir)!r}: cannot hold device lock files there "
                   f"({why}); pass --slot-dir or set {SLOT_DIR_ENV} to a writable folder every job of the run shares")


def try_acquire(slot_dir: Path, entries: Sequence[str], kind: str = DEVICE) -> DeviceSlot | None:
    """The first free device of ``entries`` in order, locked; None when every one is busy."""
    try:
        slot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _slot_dir_error(slot_dir, exc) from None
    for entry in entries:
        path = lock_path(slot_dir, entry, kind)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise _slot_dir_error(slot_dir, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except OSError as exc:
            # No flock on this filesystem (some network mounts): slots cannot be kept apart here.
            os.close(fd)
            raise _slot_dir_error(slot_dir, exc) from None
        return DeviceSlot(entry, path, fd, kind)
    return None


def busy_holders(slot_dir: Path, entries: Sequence[str], kind: str = DEVICE) -> list[str]:
    """"<entry>: <holder>" of each device's lock file, for the waiting and timeout messages."""
    from pkv.atomic_io import read_lock_holder

    lines = []
    for entry in entries:
        try:
            fd = os.open(lock_path(slot_dir, entry, kind), os.O_RDONLY)
        except OSError:
            continue
        try:
            lines.append(f"{_NOUN[kind]} {entry}: {_describe(read_lock_holder(fd))}")
        finally:
            os.close(fd)
    return lines


def acquire(slot_dir: Path, entries: Sequence[str], timeout_s: float | None = None,
            log=sys.stderr, kind: str = DEVICE) -> DeviceSlot:
    """A free device of ``entries``, waiting while all are busy; TimeoutError after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    said = False
    while True:
        slot = try_acquire(slot_dir, entries, kind)
        if slot is not None:
            return slot
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{slot_dir}: field 'timeout' = {timeout_s!r}: every {_NOUN[kind]} of {list(entries)} "
                               f"stayed busy ({'; '.join(busy_holders(slot_dir, entries, kind))})")
        if not said:
            # Once per job: the log then says why it started late.
            print(f"device slots: all {len(entries)} {_NOUN[kind]}s in {slot_dir} are busy, waiting "
                  f"({'; '.join(busy_holders(slot_dir, entries, kind))})", file=log, flush=True)
            said = True
        time.sleep(POLL_S)


def _exit_status(returncode: int) -> int:
    # A child killed by signal N exits as a shell reports it, 128 + N.
    return 128 - returncode if returncode < 0 else returncode


def run_in_slot(command: Sequence[str], slot_dir: Path, devices: int | None = None,
                timeout_s: float | None = None, warm: bool = False) -> int:
    """Run ``command`` on a device of its own and return its exit status (128+N if signal N killed it).
    With ``warm``, a ``python -m`` command runs in the slot's warm worker (pkv.worker)."""
    if not command:
        raise _config_error("command line: field 'command' = '': name the command after --")
    entries = available_devices(devices)
    env = worker.with_jit_cache(dict(os.environ))
    use_worker = warm and worker.enabled(env) and worker.module_call(command) is not None
    slot = None
    if entries:
        slot = acquire(slot_dir, entries, timeout_s)
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            # The entries are nvidia-smi's indices, which follow the PCI bus; CUDA's own order puts
            # the fastest device first. Same order, so the index recorded is the one nvidia-smi shows.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env["CUDA_VISIBLE_DEVICES"] = slot.entry
        env[SLOT_ENV] = slot.entry
    elif use_worker:
        # No device: a CPU worker's place, so that each CPU worker runs one job at a time.
        cpu_entries = [str(k) for k in range(worker.cpu_worker_count(env))]
        slot = acquire(slot_dir, cpu_entries, timeout_s, kind=CPU)
    try:
        if slot is not None:
            slot.record(command)
        if use_worker:
            status = worker.run_in_worker(command, env, slot_dir, slot.name, slot.fd, device=slot.kind == DEVICE)
            if status is not None:
                return status
            if slot.kind == CPU:
                # A fresh process runs without the CPU worker's place, as without --warm.
                slot.release()
                slot = None
        try:
            # pass_fds: the command holds the lock with us, so the slot stays taken while it runs
            # even if this wrapper is killed alone.
            child = subprocess.Popen(list(command), env=env, pass_fds=(slot.fd,) if slot is not None else ())
        except OSError as exc:
            raise OSError(f"{command[0]}: field 'command' = {shlex.join(command)!r}: cannot run it "
                          f"({exc.strerror or exc})") from None
        if slot is not None:
            slot.record(command, child.pid)

        def forward(signum, _frame):
            if child.poll() is None:
                child.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return _exit_status(returncode)
    finally:
        if slot is not None:
            slot.release()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pkv.device_slots",
                                     description="Run a command on a device of its own (one lock file per device).")
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="take a free device, run the command on it, give the device back")
    run.add_argument("--slot-dir", type=Path, default=None,
                     help=f"folder of the lock files, shared by every job of the run (default: "
                          f"{DEFAULT_SLOT_DIR}); ${SLOT_DIR_ENV}, when set, wins over it")
    run.add_argument("--devices", type=int, default=None, metavar="N",
                     help="use only the first N devices (default: every visible one)")
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="give up after S seconds of every device busy (default: wait)")
    run.add_argument("--warm", action="store_true",
                     help="run a `python -m <module>` command in the slot's warm worker (pkv.worker); "
                          f"{worker.WORKER_ENV}=0 or a Slurm job runs it in a fresh process instead")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.devices is not None and args.devices < 0:
        parser.error(f"--devices {args.devices}: must be >= 0")
    if args.timeout is not None and args.timeout < 0:
        parser.error(f"--timeout {args.timeout}: must be >= 0")
    # PKV_SLOT_DIR wins over --slot-dir: the DAG passes its artifacts root's folder in the command,
    # and a user who runs DAGs with other artifacts roots on one machine points them at one folder
    # without changing the command text (which Snakemake would take for a code change).
    slot_dir = Path(os.environ.get(SLOT_DIR_ENV) or args.slot_dir or DEFAULT_SLOT_DIR)
    return run_in_slot(command, slot_dir, args.devices, args.timeout, warm=args.warm)


def _main_refusing(argv: list[str] | None = None) -> int | None:
    """main, with a refusal as its one line and exit status 2 (pkv.refusal, loaded only then)."""
    try:
        return main(argv)
    except Exception as exc:
        from pkv.refusal import REFUSALS, refuse

        if isinstance(exc, REFUSALS):
            refuse(exc)
        raise


if __name__ == "__main__":
    raise SystemExit(_main_refusing())
