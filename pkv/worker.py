"""Warm workers: a DAG job pays Python, torch, CUDA and FlashInfer start-up once per slot, not once per job.

A rule that runs ``python -m <module> <args>`` through ``python -m pkv.device_slots run --warm`` hands
that call to the warm worker of the slot it holds: a long-lived Python process that has torch, the
CUDA context (GPU slots), FlashInfer and every ``pkv`` module loaded, and runs each job's module in
process as ``python -m`` would (``runpy``), with the job's arguments, environment, working folder and
output streams (the job's log: its file descriptors are passed over the socket, so what the job and
the libraries under it print lands there). The job's client is the Snakemake job itself; it imports
no torch, so it starts in tens of milliseconds.

    python -m pkv.device_slots run --warm --slot-dir D -- python -m pkv.cli experiment=evaluate ...
    python -m pkv.worker status --slot-dir D     # the workers of this host in D
    python -m pkv.worker stop --slot-dir D       # stop them (the DAG does this when it ends)
    python -m pkv.worker selfcheck [--device]    # the reset between jobs, checked on this machine

One worker per slot: a device slot's worker computes on that device only (``CUDA_VISIBLE_DEVICES`` is
narrowed before it starts); on the CPU profile the slots are CPU worker slots (``PKV_CPU_WORKERS``,
default one per usable core), each with a worker of its own. The client holds the slot's lock while
its job runs and passes the lock's descriptor to the worker, which holds it until the job has ended:
as with a fresh process, the device stays taken for exactly as long as the job runs.

The worker talks over a Unix socket in the slot folder, ``<slot>.<key>.sock``. The key covers what a
process reads once at start-up and cannot take from a job later: the interpreter, the working folder,
the environment variables read at start (``CUDA_*``, ``PYTHON*``, ``LD_*``, thread counts, ``TORCH*``,
``FLASHINFER_*``, ... see STARTUP_ENV), and the size and time of every file of ``pkv/`` and ``csrc/``
(an edited module or kernel is a new worker: the old one has the old code loaded). Every other
variable is set for each job and put back after it.

Between jobs the worker puts back what a job leaves behind, so that a measurement does not depend on
what ran before it in the process (``reset``): it synchronizes the device, drops every reference the
job left (its module namespace, the ``pkv`` modules' globals and caches as they were after loading,
FlashInfer's workspace buffers), frees the cached device memory (CUDA graphs and their pools go with
the objects that held them; cuBLAS workspaces; then ``empty_cache``), restores torch's seeds and
global flags, logging, warnings, the environment and the working folder. It then checks: device
memory still allocated, a thread the job started that still runs, or a CUDA error, and the worker
retires after answering (the next job starts a fresh one) rather than carry any of it into a timing.

A job that raises returns its traceback in its log and status 1 (``SystemExit`` its code, as ``python``
would); no exception ends the worker. A worker that dies mid-job (a segfault, a kill) fails only the
job in flight: its client reports it, and the next job of the slot starts a fresh worker. A client
that goes away mid-job (Snakemake stopped it) takes the worker with it, as killing a fresh process
would end that job. A worker idle for ``PKV_WORKER_IDLE_S`` seconds (default 300) exits; the DAG
stops its workers when it ends, unless ``PKV_WORKER_KEEP=1`` keeps them warm for the next run.

``PKV_WORKER=0`` runs every job in a fresh process, as before warm workers (the A/B of
``pkv.dag_timing ab`` compares the two). Under Slurm (``SLURM_JOB_ID`` set) every job runs in a fresh
process too: one Slurm job is one slot, and a worker would end with its allocation. Rules that run a
second process around the job (the profile rule runs ``ncu``) or that build keep running as processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pkv.slot_names import DEFAULT_SLOT_DIR, SLOT_DIR_ENV, host_slot_prefixes

WORKER_ENV = "PKV_WORKER"
IDLE_ENV = "PKV_WORKER_IDLE_S"
START_TIMEOUT_ENV = "PKV_WORKER_START_S"
CPU_WORKERS_ENV = "PKV_CPU_WORKERS"
# FlashInfer's JIT cache: FlashInfer 0.7 builds under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/.
FLASHINFER_BASE_ENV = "FLASHINFER_WORKSPACE_BASE"
DEFAULT_IDLE_S = 300.0
# Loading torch, the CUDA context and FlashInfer takes about 15 s on an H100; a worker that has not
# answered after this long is taken for broken and the job runs in a fresh process instead.
DEFAULT_START_S = 300.0

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PACKAGE_DIR.parent

# Environment variables a process reads at start-up (the interpreter, the dynamic loader, torch's
# thread pools and allocator, CUDA's device list, FlashInfer's cache paths) or whose first read a
# library caches: a worker started under one value cannot serve a job that asks for another.
STARTUP_ENV = re.compile(
    r"(PATH|HOME|LANG|LC_[A-Z_]+|TZ|TMPDIR|XDG_CACHE_HOME|VIRTUAL_ENV|CONDA_PREFIX|PYTHON[A-Z_]*|LD_[A-Z_]+"
    r"|CUDA_[A-Z_]+|NVIDIA_[A-Z_]+|OMP_[A-Z_]+|MKL_[A-Z_]+|OPENBLAS_[A-Z_]+|KMP_[A-Z_]+|GOMP_[A-Z_]+"
    r"|TORCH[A-Z_]*|PYTORCH_[A-Z_]+|FLASHINFER_[A-Z_]+|TVM_FFI_[A-Z_]+|TRITON_[A-Z_]+|NCCL_[A-Z_]+|MPL[A-Z_]*"
    r"|PKV_CACHE_DIR|PKV_DEVICE_SLOT)")


# --- what both sides need ---------------------------------------------------------------------


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether jobs go to warm workers: not with PKV_WORKER=0, and not inside a Slurm job."""
    env = os.environ if environ is None else environ
    return env.get(WORKER_ENV, "1").strip() not in ("0", "no", "false", "off") and not env.get("SLURM_JOB_ID")


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The project's build cache (pkv.build.cache_root, without importing torch)."""
    env = os.environ if environ is None else environ
    return Path(env.get("PKV_CACHE_DIR") or Path.home() / ".cache" / "persistentkv")


def with_jit_cache(environ: dict) -> dict:
    """``environ`` with FlashInfer's JIT cache under the project's build cache, unless one is set:
    a carried build cache then holds FlashInfer's compiled modules beside the extension."""
    environ.setdefault(FLASHINFER_BASE_ENV, str(cache_root(environ) / "flashinfer"))
    return environ


def module_call(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """(interpreter, module, arguments) of ``<python> -m <module> [args...]``, else None."""
    if len(command) >= 3 and command[1] == "-m" and Path(command[0]).name.startswith("python"):
        return command[0], command[2], list(command[3:])
    return None


def cpu_worker_count(environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw = env.get(CPU_WORKERS_ENV)
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def source_fingerprint() -> str:
    """Size and modification time of every file of pkv/ and csrc/: what a worker has loaded."""
    digest = hashlib.sha256()
    for root in (_PACKAGE_DIR, _REPO_DIR / "csrc"):
        if not root.is_dir():
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def worker_key(interpreter: str, environ: Mapping[str, str], cwd: str) -> str:
    startup = sorted((k, v) for k, v in environ.items() if STARTUP_ENV.fullmatch(k))
    text = json.dumps([os.path.abspath(interpreter), cwd, startup, source_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def socket_path(slot_dir: str | os.PathLike, slot_name: str, key: str) -> Path:
    return Path(os.path.abspath(slot_dir)) / f"{slot_name}.{key}.sock"


def log_path(slot_dir: str | os.PathLike, slot_name: str) -> Path:
    return Path(os.path.abspath(slot_dir)) / f"{slot_name}.worker.log"


# A Unix socket's address holds at most 107 bytes; a deeper slot folder is reached through the
# process's descriptor of the folder instead (/proc/self/fd/N/<name>), which Linux resolves.
_SUN_PATH_MAX = 100


@contextlib.contextmanager
def _address(path: Path):
    text = str(path)
    if len(os.fsencode(text)) <= _SUN_PATH_MAX:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


_HEADER = struct.Struct("!I")


def _send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        # The descriptors ride on the header's bytes; the body follows as a plain stream.
        socket.send_fds(conn, [header], list(fds))
        conn.sendall(data)
    else:
        conn.sendall(header + data)


def _recv_exact(conn: socket.socket, size: int, head: bytes = b"") -> bytes | None:
    data = bytearray(head)
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _recv(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream."""
    fds: list[int] = []
    if max_fds:
        head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, max_fds)
    else:
        head = conn.recv(_HEADER.size)
    if not head:
        return None, fds
    head = _recv_exact(conn, _HEADER.size, head)
    if head is None:
        return None, fds
    (size,) = _HEADER.unpack(head)
    body = _recv_exact(conn, size)
    if body is None:
        return None, fds
    return json.loads(body.decode()), fds


def _connect(path: Path, timeout: float | None = None) -> socket.socket | None:
    """A connection to the worker at ``path``; None where none listens (a stale file is removed:
    only the holder of the slot's lock calls this, so no worker of the slot can be starting)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        with _address(path) as address:
            conn.connect(address)
    except FileNotFoundError:
        conn.close()
        return None
    except (ConnectionRefusedError, ConnectionResetError):
        conn.close()
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    except OSError:
        conn.close()
        return None
    return conn


def _slot_sockets(slot_dir: Path, slot_name: str | None = None) -> list[Path]:
    """The worker sockets of this host in ``slot_dir`` (of one slot, or of all of this host's)."""
    prefixes = (f"{slot_name}.",) if slot_name else host_slot_prefixes()
    try:
        names = sorted(os.listdir(slot_dir))
    except OSError:
        return []
    folder = Path(os.path.abspath(slot_dir))
    return [folder / n for n in names if n.endswith(".sock") and n.startswith(prefixes)]


def _ask(path: Path, message: dict, timeout: float) -> dict | None:
    conn = _connect(path, timeout)
    if conn is None:
        return None
    try:
        with conn:
            _send(conn, message)
            reply, _ = _recv(conn)
            return reply
    except OSError:  # a worker busy with a job does not answer in time
        return None


def stop_workers(slot_dir: str | os.PathLike, slot_name: str | None = None, keep: Path | None = None,
                 timeout: float = 2.0) -> list[dict]:
    """Ask the idle workers of this host in ``slot_dir`` to exit; what each answered. A worker busy
    with a job answers only after it; it is left to finish and to exit when idle."""
    answers = []
    for path in _slot_sockets(Path(slot_dir), slot_name):
        if keep is not None and path == keep:
            continue
        reply = _ask(path, {"op": "stop"}, timeout)
        if reply is not None:
            answers.append(reply)
    return answers


def worker_status(slot_dir: str | os.PathLike, timeout: float = 2.0) -> list[dict]:
    rows = []
    for path in _slot_sockets(Path(slot_dir)):
        reply = _ask(path, {"op": "status"}, timeout)
        rows.append(reply if reply is not None else {"socket": str(path), "state": "busy or not answering"})
    return rows


# --- the client: one job -----------------------------------------------------------------------


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _spawn(interpreter: str, path: Path, key: str, env: dict, cwd: str, device: bool, log: Path,
           idle_s: float) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        command = [interpreter, "-m", "pkv.worker", "serve", "--socket", str(path), "--key", key,
                   "--idle-timeout", str(idle_s)] + (["--device"] if device else [])
        # A session of its own: the worker outlives this job and must not take its signals.
        return subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(fd)


def _wait_ready(path: Path, proc: subprocess.Popen, timeout_s: float) -> socket.socket | None:
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while time.monotonic() < deadline:
        conn = _connect(path)
        if conn is not None:
            return conn
        if proc.poll() is not None:
            return None
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    return None


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name, default))
    except ValueError:
        return default


def run_in_worker(command: Sequence[str], env: dict, slot_dir: str | os.PathLike, slot_name: str,
                  lock_fd: int | None = None, device: bool = False, log=sys.stderr) -> int | None:
    """Run ``command`` (``<python> -m <module> ...``) in the warm worker of slot ``slot_name`` and
    return its exit status; None where it cannot run there (the caller then runs a fresh process).
    The caller holds the slot's lock (``lock_fd``) and has put the slot's device in ``env``."""
    call = module_call(command)
    if call is None:
        return None
    interpreter, module, args = call
    cwd = os.getcwd()
    key = worker_key(interpreter, env, cwd)
    path = socket_path(slot_dir, slot_name, key)
    worker_log = log_path(slot_dir, slot_name)
    # A worker of this slot with another key has other code or start-up settings loaded: it can serve
    # no job of this run, so it goes now rather than hold device memory until its idle timeout.
    stop_workers(slot_dir, slot_name, keep=path)
    request = {"op": "run", "key": key, "module": module, "argv": args, "env": env, "cwd": cwd}
    fds = [sys.stdout.fileno(), sys.stderr.fileno()] + ([lock_fd] if lock_fd is not None else [])
    sys.stdout.flush()
    sys.stderr.flush()
    conn = None
    for attempt in range(2):
        spawned = None
        conn = _connect(path)
        if conn is None:
            spawned = _spawn(interpreter, path, key, env, cwd, device, worker_log, _float_env(env, IDLE_ENV,
                                                                                              DEFAULT_IDLE_S))
            conn = _wait_ready(path, spawned, _float_env(env, START_TIMEOUT_ENV, DEFAULT_START_S))
            if conn is None:
                if spawned.poll() is None:
                    spawned.kill()
                print(f"pkv.worker: the warm worker of {slot_name} did not start (its log: {worker_log}); "
                      "running this job in a fresh process", file=log, flush=True)
                return None
        try:
            _send(conn, request, fds)
            reply, _ = _recv(conn)
        except OSError:
            reply = None
        if reply is not None and reply.get("op") == "started":
            break
        conn.close()
        conn = None
        # An idle worker may have been exiting just as this job came: the next try starts a fresh one.
        if spawned is not None or attempt:
            why = reply.get("why") if reply else "it closed the connection"
            print(f"pkv.worker: the warm worker of {slot_name} refused the job ({why}; its log: {worker_log}); "
                  "running this job in a fresh process", file=log, flush=True)
            return None

    def interrupted(signum, _frame):
        raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        with conn:
            try:
                done, _ = _recv(conn)
            except OSError:
                done = None
    except _Interrupted as exc:
        # The connection is closed: the worker's watchdog ends the job, and the worker with it.
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if done is None or done.get("op") != "done":
        print(f"pkv.worker: the warm worker (pid {reply.get('pid')}) of {slot_name} ended during this job "
              f"(its log: {worker_log}); the next job starts a fresh one", file=log, flush=True)
        return 1
    for reason in done.get("retired") or []:
        print(f"pkv.worker: after this job: {reason}; the worker retires and the next job starts a fresh one",
              file=log, flush=True)
    return int(done["status"])


# --- the worker ----------------------------------------------------------------------------------

# lru caches of pkv that hold loaded libraries, not results: clearing them would load a library twice
# (torch refuses a second registration of the extension's fake kernels). nvidia-smi's device list is
# the machine's and is kept too. Every other lru cache of pkv is cleared after each job.
KEEP_CACHES = {"pkv.ops.load", "pkv.ops.load_planner", "pkv.provenance.nvidia_smi_devices"}
# Module globals that hold loaded libraries (vLLM's kernels), kept for the same reason.
KEEP_GLOBALS = {("pkv.engines.vllm_build", "_PAGED_LOADED"), ("pkv.engines.vllm_build", "_TRITON_LOADED")}
# FlashInfer's process-wide workspace buffers (flashinfer.utils._cache_buf), dropped after each job.
FLASHINFER_BUFFERS = (("flashinfer.utils", "_cache_buf"),)


def _preload(device: bool) -> dict[str, str]:
    """Load what every job would load: torch, the CUDA context (device workers), FlashInfer, Hydra
    and every pkv module. What cannot load is noted and left to the job that needs it."""
    import importlib
    import pkgutil

    notes = {}
    import torch

    if device and torch.cuda.is_available():
        torch.cuda.init()
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    if device:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # an optional baseline: its jobs record why it is missing
            notes["flashinfer"] = f"{type(exc).__name__}: {exc}"
    import pkv

    for info in pkgutil.walk_packages(pkv.__path__, "pkv."):
        if info.name in ("pkv.worker",):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            notes[info.name] = f"{type(exc).__name__}: {exc}"
    return notes


_PLAIN = (dict, list, set, bytearray)
# The seed of torch's default generators in a process that set none (torch.initial_seed()), where
# torch does not seed them at random at start.
_TORCH_DEFAULT_SEED = 67280421310721


class _State:
    """What the process holds after loading; ``reset`` puts it back after each job and returns why
    the worker must retire instead (what it cannot put back)."""

    def __init__(self, device: bool):
        import logging
        import threading
        import warnings

        import torch

        self.device = device and torch.cuda.is_available()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.streams = (sys.stdout, sys.stderr)
        self.warnings = list(warnings.filters)
        self.signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        root = logging.getLogger()
        self.root_logging = (root.level, list(root.handlers))
        self.loggers = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
                        for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
        self.threads = {t.ident for t in threading.enumerate()}
        self.seed = torch.initial_seed()
        self.torch_flags = _torch_flags(torch)
        self.modules = _module_state()
        self.caches = _lru_caches()
        self.memory = self._device_memory()
        self.stream = torch.cuda.current_stream() if self.device else None
        self.logging_disabled = logging.root.manager.disable
        import tempfile

        self.tempdir = tempfile.tempdir

    def _device_memory(self) -> tuple[int, int]:
        if not self.device:
            return 0, 0
        import torch

        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    def reset(self) -> list[str]:
        import gc
        import logging
        import random
        import tempfile
        import threading
        import warnings

        import torch

        retire = []
        if self.device:
            try:
                torch.cuda.synchronize()
                if torch.cuda.current_stream() != self.stream:  # a job that left a side stream current
                    torch.cuda.set_stream(self.stream)
            except Exception as exc:  # a sticky CUDA error: this context cannot time anything again
                retire.append(f"the CUDA context reports an error ({type(exc).__name__}: {exc})")
        try:
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()
        except ImportError:
            pass
        for (module, name), value, contents in self.modules:
            mod = sys.modules.get(module)
            if mod is None:
                continue
            if getattr(mod, name, None) is not value:
                setattr(mod, name, value)
            if contents is not None:
                _restore_contents(value, contents)
        # The extension's process settings: a job's merges that dropped their states
        # (engine.discard_merged_states, on by default on a GPU) must not carry into the next job's,
        # which sets its own.
        ops = sys.modules.get("pkv.ops")
        if self.device and ops is not None and ops.load.cache_info().currsize:
            try:
                ops.discard_merged_states(False)
            except Exception as exc:
                retire.append(f"the extension's merge setting could not be put back ({type(exc).__name__}: {exc})")
        for module, name in FLASHINFER_BUFFERS:
            buffers = getattr(sys.modules.get(module), name, None)
            if isinstance(buffers, dict):
                buffers.clear()
        for cached in self.caches:
            cached.cache_clear()
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        # logging: handlers the job added (Hydra's file handler in its run folder) are closed.
        for handler in logging.getLogger().handlers:
            if handler not in self.root_logging[1]:
                with contextlib.suppress(Exception):
                    handler.close()
        root = logging.getLogger()
        logging.disable(self.logging_disabled)
        root.setLevel(self.root_logging[0])
        root.handlers[:] = self.root_logging[1]
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            lg = logging.Logger.manager.loggerDict.get(name)
            if isinstance(lg, logging.Logger):
                for handler in lg.handlers:
                    if handler not in handlers:
                        with contextlib.suppress(Exception):
                            handler.close()
                lg.setLevel(level)
                lg.handlers[:] = handlers
                lg.propagate, lg.disabled = propagate, disabled
        warnings.filters[:] = self.warnings
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
        if mutated is not None:
            with contextlib.suppress(Exception):
                mutated()  # "once" and "default" warnings are said again, as in a fresh process
        for sig, handler in self.signals.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler)
        sys.stdout, sys.stderr = self.streams
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        tempfile.tempdir = self.tempdir
        for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, attr):
                setattr(sys, attr, None)
        gc.collect()
        # Seeds as a fresh process has them: torch's fixed default seed where this torch starts from
        # one (2.5 does), a new random one where it seeds itself at start (2.13 does); numpy's and
        # random's from the OS.
        if self.seed == _TORCH_DEFAULT_SEED:
            torch.manual_seed(self.seed)
        else:
            torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _restore_torch_flags(torch, self.torch_flags)
        if "torch._dynamo" in sys.modules:
            with contextlib.suppress(Exception):
                sys.modules["torch._dynamo"].reset()
        if self.device:
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:
                with contextlib.suppress(Exception):
                    host_empty()
            with contextlib.suppress(Exception):
                torch.cuda.reset_peak_memory_stats()
            allocated, reserved = self._device_memory()
            if allocated > self.memory[0] or reserved > self.memory[1]:
                retire.append(f"{allocated - self.memory[0]} bytes of device memory stay allocated and "
                              f"{reserved - self.memory[1]} reserved (a tensor, workspace or CUDA graph outlived "
                              "its job)")
        left = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive() and not t.daemon]
        if left:
            retire.append(f"threads still running: {', '.join(sorted(t.name for t in left))}")
        _reap_children()
        return retire


def _torch_flags(torch) -> dict:
    flags = {"grad": torch.is_grad_enabled(), "dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
             "deterministic": (torch.are_deterministic_algorithms_enabled(),
                               torch.is_deterministic_algorithms_warn_only_enabled()),
             "matmul_precision": torch.get_float32_matmul_precision()}
    backends = {}
    for path in ("cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
                 "cuda.matmul.allow_bf16_reduced_precision_reduction", "cudnn.allow_tf32", "cudnn.benchmark",
                 "cudnn.deterministic", "cudnn.enabled"):
        owner_path, _, attr = path.rpartition(".")
        owner = torch.backends
        try:
            for part in owner_path.split("."):
                owner = getattr(owner, part)
            backends[path] = (owner, attr, getattr(owner, attr))
        except Exception:
            continue
    flags["backends"] = backends
    sdp = {}
    for name in ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp"):
        getter = getattr(torch.backends.cuda, f"{name}_enabled", None)
        setter = getattr(torch.backends.cuda, f"enable_{name}", None)
        if getter is not None and setter is not None:
            with contextlib.suppress(Exception):
                sdp[name] = (setter, getter())
    flags["sdp"] = sdp
    return flags


def _restore_torch_flags(torch, flags: dict) -> None:
    # Each setter only where the job changed it: some are costly (use_deterministic_algorithms loads
    # torch._inductor, over a second).
    if torch.is_grad_enabled() != flags["grad"]:
        torch.set_grad_enabled(flags["grad"])
    if torch.get_default_dtype() != flags["dtype"]:
        torch.set_default_dtype(flags["dtype"])
    if torch.get_num_threads() != flags["threads"]:
        torch.set_num_threads(flags["threads"])
    if (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) != flags["deterministic"]:
        on, warn_only = flags["deterministic"]
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    if torch.get_float32_matmul_precision() != flags["matmul_precision"]:
        torch.set_float32_matmul_precision(flags["matmul_precision"])
    for owner, attr, value in flags["backends"].values():
        with contextlib.suppress(Exception):
            if getattr(owner, attr) != value:
                setattr(owner, attr, value)
    for name, (setter, value) in flags["sdp"].items():
        with contextlib.suppress(Exception):
            if getattr(torch.backends.cuda, f"{name}_enabled")() != value:
                setter(value)


def _module_state() -> list:
    """((module, name), value, contents) of every global of the loaded pkv modules (contents: a
    copy of a dict, list, set or bytearray's items), to put back after each job."""
    state = []
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "pkv" or module_name.startswith("pkv.")) or module is None:
            continue
        for name, value in list(vars(module).items()):
            if name.startswith("__") or (module_name, name) in KEEP_GLOBALS:
                continue
            contents = None
            if type(value) in _PLAIN:
                contents = dict(value) if isinstance(value, dict) else list(value)
            state.append(((module_name, name), value, contents))
    return state


def _restore_contents(value, contents) -> None:
    if isinstance(value, dict):
        if value != contents or len(value) != len(contents):
            value.clear()
            value.update(contents)
    elif isinstance(value, set):
        value.clear()
        value.update(contents)
    else:  # list, bytearray
        value[:] = contents


def _lru_caches() -> list:
    caches = []
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "pkv" or module_name.startswith("pkv.")) or module is None:
            continue
        for name, value in list(vars(module).items()):
            if (callable(value) and hasattr(value, "cache_clear") and getattr(value, "__module__", None) == module_name
                    and f"{module_name}.{name}" not in KEEP_CACHES):
                caches.append(value)
    return caches


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_job_traceback(exc: BaseException) -> None:
    """The traceback as ``python -m`` prints it: from the job's module down, without the worker's frames."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, getattr(sys.modules.get("runpy"), "__file__",
                                                                                  None)):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _watch(conn: socket.socket, wake_fd: int, worker_err: int, cleanup) -> None:
    """Ends the worker when the job's client goes away mid-job (Snakemake stopped the job)."""
    import select

    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
    poller.register(wake_fd, select.POLLIN)
    while True:
        try:
            events = poller.poll()
        except InterruptedError:
            continue
        if any(fd == wake_fd for fd, _ in events):
            return
        os.write(worker_err, f"pkv.worker {os.getpid()}: the job's client went away; ending the job\n".encode())
        cleanup()
        os._exit(75)


class Worker:
    def __init__(self, key: str, device: bool):
        self.key, self.device = key, device
        self.started = time.time()
        self.jobs = 0
        self.idle_since = time.time()

    def run_job(self, message: dict, fds: list[int], conn: socket.socket) -> tuple[int, list[str]]:
        import runpy
        import threading

        out_fd, err_fd = fds[0], fds[1]
        self.jobs += 1
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        wake_r, wake_w = os.pipe()
        watcher = threading.Thread(target=_watch, args=(conn, wake_r, saved[1], self.cleanup), name="pkv-worker-watch",
                                   daemon=True)
        status = 1
        started = time.monotonic()
        try:
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.environ.clear()
            os.environ.update(message["env"])
            os.chdir(message["cwd"])
            sys.argv[:] = [message["module"], *message["argv"]]
            print(f"pkv.worker: job {self.jobs} of warm worker pid {os.getpid()}, "
                  f"up {time.time() - self.started:.1f} s", file=sys.stderr, flush=True)
            watcher.start()
            namespace = None
            # As in a fresh `python -m`, the module is not imported yet when it runs as __main__ (the
            # loaded copy goes back after the job).
            loaded = sys.modules.pop(message["module"], None)
            try:
                namespace = runpy.run_module(message["module"], run_name="__main__", alter_sys=True)
                status = 0
            except SystemExit as exc:
                status = _exit_status(exc)
            except KeyboardInterrupt as exc:
                _print_job_traceback(exc)
                status = 130
            except BaseException as exc:  # the job's error, never the worker's
                _print_job_traceback(exc)
                status = 1
                del exc
            finally:
                if namespace is not None:
                    namespace.clear()
                namespace = None
                if loaded is not None:
                    sys.modules[message["module"]] = loaded
                else:
                    sys.modules.pop(message["module"], None)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.write(wake_w, b"x")
            if watcher.is_alive():
                watcher.join()
            os.close(wake_r)
            os.close(wake_w)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        reset_started = time.monotonic()
        retire = self.state.reset()
        for fd in fds:  # the job's log and the slot's lock: the slot is free once they are closed
            with contextlib.suppress(OSError):
                os.close(fd)
        print(f"pkv.worker {os.getpid()}: job {self.jobs} ({message['module']} {' '.join(message['argv'])[:200]}) "
              f"status {status} in {reset_started - started:.2f} s, reset {time.monotonic() - reset_started:.2f} s"
              + (f"; retiring: {'; '.join(retire)}" if retire else ""), flush=True)
        return status, retire

    def serve(self, path: Path, idle_s: float) -> int:
        notes = _preload(self.device)
        for name, why in notes.items():
            print(f"pkv.worker {os.getpid()}: not loaded: {name}: {why}", flush=True)
        self.state = _State(self.device)
        import gc

        # What loading made stays for the worker's life: out of the collector's way, so that the
        # collection after each job walks only what the job made.
        gc.collect()
        gc.freeze()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead worker's socket: the client that started this one holds the slot
        with _address(path) as address:
            listener.bind(address)
        inode = os.stat(path).st_ino
        self.cleanup = lambda: _unlink_if_ours(path, inode)
        listener.listen(8)
        print(f"pkv.worker {os.getpid()}: ready on {path} after {time.time() - self.started:.1f} s", flush=True)
        try:
            while True:
                listener.settimeout(idle_s)
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    print(f"pkv.worker {os.getpid()}: idle for {idle_s:.0f} s, exiting", flush=True)
                    return 0
                conn.settimeout(None)
                with conn:
                    try:
                        message, fds = _recv(conn, max_fds=3)
                    except (OSError, ValueError):
                        continue
                    if message is None:
                        for fd in fds:
                            os.close(fd)
                        continue
                    op = message.get("op")
                    if op == "stop":
                        _unlink_if_ours(path, inode)
                        _reply(conn, {"op": "stopped", "pid": os.getpid()})
                        print(f"pkv.worker {os.getpid()}: stopped after {self.jobs} jobs", flush=True)
                        return 0
                    if op == "status":
                        _reply(conn, {"op": "status", "pid": os.getpid(), "socket": str(path), "jobs": self.jobs,
                                      "up_s": round(time.time() - self.started, 1),
                                      "idle_s": round(time.time() - self.idle_since, 1)})
                        continue
                    if op != "run" or message.get("key") != self.key or len(fds) < 2:
                        for fd in fds:
                            os.close(fd)
                        _reply(conn, {"op": "refused", "why": "not a job of this worker's key"})
                        continue
                    _reply(conn, {"op": "started", "pid": os.getpid(), "jobs": self.jobs + 1})
                    status, retire = self.run_job(message, fds, conn)
                    self.idle_since = time.time()
                    if retire:
                        # Gone from the folder before the answer: the next job cannot reach this worker.
                        _unlink_if_ours(path, inode)
                    _reply(conn, {"op": "done", "status": status, "retired": retire})
                    if retire:
                        return 0
        finally:
            _unlink_if_ours(path, inode)
            listener.close()


def _reply(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        _send(conn, message)


def _unlink_if_ours(path: Path, inode: int | None) -> None:
    """Remove the socket file if it is still the one this worker bound."""
    try:
        if inode is not None and os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def serve(socket_file: str, key: str, idle_s: float, device: bool) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)
    import faulthandler

    # On fd 2, which is the job's log while a job runs: a crash there leaves its stack in that log.
    faulthandler.enable()
    return Worker(key, device).serve(Path(socket_file), idle_s)


def selfcheck(device: bool) -> int:
    """The reset on this machine, job by job: what a job may leave behind that the reset puts back
    (the worker serves on), and what it cannot (the worker retires). Exit status 0 when each check
    went as expected."""
    import gc
    import threading

    notes = _preload(device)
    import torch

    for name, why in notes.items():
        print(f"not loaded: {name}: {why}")
    state = _State(device)
    gc.collect()
    gc.freeze()
    on_device = state.device
    where = "cuda" if on_device else "cpu"
    failures = 0

    def check(name: str, job, retires: bool, after=None) -> None:
        nonlocal failures
        job()
        retire = state.reset()
        extra = after() if after is not None else None
        ok = bool(retire) == retires and not extra
        failures += not ok
        said = "; ".join(retire) if retire else "nothing left behind"
        print(f"{'ok' if ok else 'FAILED'}: {name}: {said}{f' ({extra})' if extra else ''}", flush=True)

    flashinfer_engine = sys.modules.get("pkv.engines.flashinfer")

    def module_caches():
        flashinfer_engine._PATH_PICKS[(1, 1024)] = "tc"
        flashinfer_engine._PATH_PROBES[(1, 1024)] = {"tc": {"buffer": torch.ones(1 << 20, device=where)}}

    check("pkv's module caches (FlashInfer's path picks, with a tensor in them)", module_caches, False,
          lambda: "path picks kept" if flashinfer_engine._PATH_PICKS or flashinfer_engine._PATH_PROBES else None)

    def seeded():
        torch.manual_seed(5)

    check("torch's seed", seeded, False, lambda: "seed kept" if torch.initial_seed() == 5 else None)
    if on_device:
        from pkv.cuda_graphs import capture_graph

        def graph():
            x = torch.ones(1 << 20, device="cuda")
            g = capture_graph(lambda: x.mul_(2))
            g.replay()
            torch.cuda.synchronize()

        check("a CUDA graph and its pool, dropped with the objects that held them", graph, False)

        def matmul():
            a = torch.randn(512, 512, device="cuda", dtype=torch.float16)
            (a @ a).sum().item()

        check("cuBLAS's workspace", matmul, False)
        from pkv import ops

        def merges_that_discard():
            ops.discard_merged_states(True)

        check("merges left dropping their states (engine.discard_merged_states)", merges_that_discard, False,
              lambda: "the setting was kept" if ops.discard_merged_states(False) else None)
        leaked = []

        def leak():
            leaked.append(torch.ones(1 << 20, device="cuda"))

        check("a device tensor the job left in a global the reset does not know", leak, True)
        leaked.clear()
        check("the same, released", lambda: None, False)
    left = threading.Event()

    def thread():
        threading.Thread(target=left.wait, args=(5.0,), name="left-behind").start()

    check("a thread the job left running", thread, True)
    left.set()
    print(f"{'all checks as expected' if not failures else f'{failures} checks not as expected'} "
          f"({'device ' + torch.cuda.get_device_name() if on_device else 'CPU'})")
    return 1 if failures else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pkv.worker", description="Warm workers of the device slots.")
    sub = parser.add_subparsers(dest="action", required=True)
    for action, text in (("status", "list this host's workers in the slot folder"),
                         ("stop", "stop this host's idle workers in the slot folder")):
        p = sub.add_parser(action, help=text)
        p.add_argument("--slot-dir", type=Path, default=None,
                       help="the slot folder (default: $PKV_SLOT_DIR, else artifacts/.slots)")
    p = sub.add_parser("selfcheck", help="check the reset between jobs on this machine")
    p.add_argument("--device", action="store_true", help="on the visible GPU (CUDA graphs, cuBLAS, device memory)")
    p = sub.add_parser("serve", help="run a worker (started by the first job of a slot)")
    p.add_argument("--socket", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_S)
    p.add_argument("--device", action="store_true", help="a device slot's worker: load CUDA and FlashInfer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "serve":
        return serve(args.socket, args.key, args.idle_timeout, args.device)
    if args.action == "selfcheck":
        return selfcheck(args.device)
    slot_dir = Path(os.environ.get(SLOT_DIR_ENV) or args.slot_dir or DEFAULT_SLOT_DIR)
    if args.action == "stop":
        for answer in stop_workers(slot_dir):
            print(f"stopped worker pid {answer.get('pid')}")
        return 0
    for row in worker_status(slot_dir):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
