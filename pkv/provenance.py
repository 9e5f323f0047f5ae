"""Provenance attached to every result file: code version, machine, software stack, config, seed.

Every field degrades to "unknown" / None instead of raising, because a result must still be
written on a machine without git, without a GPU or without FlashInfer. Collection is cheap: git
and nvidia-smi are each asked once per process, with a timeout, so a hung driver cannot stall a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pkv.atomic_io import write_text_atomic

UNKNOWN = "unknown"
NOT_INSTALLED = "not installed"

# Short enough that a wedged driver or a slow network filesystem does not hold up a benchmark.
_SUBPROCESS_TIMEOUT_S = 5.0

# The checkout the package was imported from, not the caller's working directory: a rule may run
# with its cwd under artifacts/, but the commit that matters is the code's.
_SOURCE_DIR = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a command, or None if it is missing, fails or times out."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout


@functools.lru_cache(maxsize=1)
def _git_state() -> tuple[str, bool | None]:
    stamped = _stamped_commit()
    if stamped is not None:
        return stamped, False
    if shutil.which("git") is None:
        return UNKNOWN, None
    found = _run(["git", "-C", str(_SOURCE_DIR), "rev-parse", "--show-toplevel", "HEAD"])
    lines = [] if found is None else found.splitlines()
    # A tree exported inside another checkout (a baseline under .device/) finds that checkout's
    # git, whose commit is not the one that ran: only a checkout of this very tree names a commit.
    if len(lines) != 2 or Path(lines[0]).resolve() != _SOURCE_DIR.resolve():
        return UNKNOWN, None
    head = lines[1]
    # Untracked files (build outputs, artifacts) do not change what the tracked code computes.
    status = _run(["git", "-C", str(_SOURCE_DIR), "status", "--porcelain", "--untracked-files=no"])
    dirty = None if status is None else bool(status.strip())
    return head, dirty


# What decides a result: the package, kernels, workflow and configs. Their digest identifies the
# tree that ran even where git metadata is missing or describes another commit (a copied tree).
_DIGESTED = ("pkv", "csrc", "workflow", "conf", "config", "Snakefile")
_DIGESTED_SUFFIXES = {".py", ".cu", ".cuh", ".h", ".cpp", ".smk", ".yaml", ""}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the relative paths and bytes of the source files that decide a result.

    ``python -m pkv.provenance`` prints it for a checkout, so a result can be matched to a commit.
    """
    digest = hashlib.sha256()
    files = []
    for name in _DIGESTED:
        root = _SOURCE_DIR / name
        candidates = [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []
        files += [p for p in candidates
                  if p.is_file() and p.suffix in _DIGESTED_SUFFIXES and "__pycache__" not in p.parts]
    for path in files:
        digest.update(str(path.relative_to(_SOURCE_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# A copied tree (a GPU machine that receives the files but not the repository, or stale git
# metadata) can still name its commit: `python -m pkv.provenance --stamp FILE` writes the commit
# and source digest of a clean checkout, and a process started with PKV_SOURCE_STAMP=FILE records
# that commit only if its own sources have the same digest. A stamp that does not match is ignored.
SOURCE_STAMP_ENV = "PKV_SOURCE_STAMP"


def write_source_stamp(path) -> dict:
    """Write {git_commit, source_digest} of this checkout to `path`; it must be clean."""
    head = _run(["git", "-C", str(_SOURCE_DIR), "rev-parse", "HEAD"]) if shutil.which("git") else None
    status = _run(["git", "-C", str(_SOURCE_DIR), "status", "--porcelain", "--untracked-files=no"])
    if not head or not head.strip() or status is None:
        raise ValueError(f"source stamp: {_SOURCE_DIR} is not a git checkout, so there is no commit to stamp")
    if status.strip():
        raise ValueError(f"source stamp: {_SOURCE_DIR} has uncommitted changes; commit them first, "
                         f"since a stamp names a commit:\n{status.rstrip()}")
    stamp = {"git_commit": head.strip(), "source_digest": source_digest()}
    write_text_atomic(path, json.dumps(stamp, indent=2) + "\n")
    return stamp


def _stamped_commit() -> str | None:
    """The commit of PKV_SOURCE_STAMP when its digest is this tree's; None otherwise."""
    name = os.environ.get(SOURCE_STAMP_ENV)
    if not name:
        return None
    try:
        stamp = json.loads(Path(name).read_text())
        commit, digest = stamp["git_commit"], stamp["source_digest"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(commit, str) or not commit or digest != source_digest():
        return None
    return commit


@functools.lru_cache(maxsize=1)
def nvidia_smi_devices() -> tuple[str | None, str | None, dict[str, str]]:
    """(name of GPU 0, driver version, {index: UUID} of every GPU) from one nvidia-smi call;
    (None, None, {}) without one."""
    if shutil.which("nvidia-smi") is None:
        return None, None, {}
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,index,uuid", "--format=csv,noheader"])
    if not out or not out.strip():
        return None, None, {}
    rows = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]
    name, driver = (rows[0] + [""])[:2]
    uuids = {row[2]: row[3] for row in rows if len(row) >= 4 and row[3]}
    return (name or None), (driver or None), uuids


# Set by pkv.device_slots for the command it runs: the CUDA_VISIBLE_DEVICES entry of the device the
# job holds, i.e. the physical device behind the job's cuda:0.
DEVICE_SLOT_ENV = "PKV_DEVICE_SLOT"


def _torch_device_uuid() -> str | None:
    """UUID of the device this process computes on, as nvidia-smi writes it (GPU-...), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    except Exception:  # no torch, or a broken driver: the UUID is only provenance
        return None
    if uuid is None or not str(uuid).strip():
        return None
    text = str(uuid).strip()
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _device_identity(gpu_seen: bool, smi_uuids: Mapping[str, str]) -> tuple[int | None, str | None]:
    """(physical index, UUID) of the device a result ran on; (None, None) without a GPU.

    The index is the device slot's entry, else the first CUDA_VISIBLE_DEVICES entry, else 0 (CUDA's
    default device); None when that entry is a UUID rather than an index.
    """
    if not gpu_seen:
        return None, None
    entry = os.environ.get(DEVICE_SLOT_ENV) or (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    entry = entry.strip()
    index = int(entry) if entry.isdigit() else None
    uuid = _torch_device_uuid()
    if uuid is None:
        # nvidia-smi numbers devices by PCI bus; a device slot has CUDA do the same, so its index is nvidia-smi's.
        uuid = entry if entry.startswith(("GPU-", "MIG-")) else smi_uuids.get(str(index))
    return index, uuid


def _torch_info() -> tuple[str, str | None, str | None]:
    """(torch version, torch.version.cuda, device name of cuda:0 or None)."""
    # The source stamp and build records are written before torch is known to import.
    try:
        import torch
    except ImportError:
        return NOT_INSTALLED, None, None
    cuda_version = getattr(torch.version, "cuda", None)
    device_name = None
    try:
        if torch.cuda.is_available():
            device_name = torch.cuda.get_device_name(0)
    except Exception:  # a broken driver must not stop a CPU-side result from being written
        device_name = None
    return str(torch.__version__), cuda_version, device_name


def _distribution_version(*names: str) -> str:
    # Reading package metadata avoids importing flashinfer, whose import can start JIT work.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def _plain(value: Any, where: str) -> Any:
    """A JSON-ready copy of a config value; raises ValueError naming the field it cannot convert."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # omegaconf is a dependency, but provenance must not need it
        DictConfig = ListConfig = ()  # type: ignore[assignment]
        OmegaConf = None  # type: ignore[assignment]
    if OmegaConf is not None and isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"provenance: {where} = {value!r} is not a finite number")
        return value
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return _plain(item(), where)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"provenance: {where} = {value!r} is not a plain value") from exc
    raise ValueError(f"provenance: {where} has type {type(value).__name__}, which cannot be stored in JSON")


def collect_provenance(config: Any = None, seed: int | None = None) -> dict:
    """Where and how a result was produced.

    `config` may be a mapping, a dataclass instance or an OmegaConf config; it is stored resolved,
    as a plain dict ({} when not given). Values that cannot be determined are "unknown" (strings)
    or None (GPU name, driver, device index and UUID on a machine without a GPU;
    cuda_visible_devices when the variable is not set).
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"provenance: seed = {seed!r} must be an int or None")
    plain_config = {} if config is None else _plain(config, "config")
    if not isinstance(plain_config, dict):
        raise ValueError(f"provenance: config must be a mapping, got {type(config).__name__}")
    json.dumps(plain_config)  # fail here, naming provenance, rather than later in the result writer

    commit, dirty = _git_state()
    torch_version, cuda_version, torch_device = _torch_info()
    smi_name, driver, smi_uuids = nvidia_smi_devices()
    gpu_name = torch_device or smi_name
    device_index, device_uuid = _device_identity(gpu_name is not None, smi_uuids)
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "source_digest": source_digest(),
        "host": socket.gethostname() or UNKNOWN,
        "gpu_name": gpu_name,
        "driver_version": driver,
        # Which of the machine's devices: with --resources gpu=N, jobs run on different ones.
        "device_index": device_index,
        "device_uuid": device_uuid,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_version": cuda_version,
        "torch": torch_version,
        "flashinfer": _distribution_version("flashinfer-python", "flashinfer"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": plain_config,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkv.provenance",
                                     description="Print the source digest of this checkout, or write a source stamp.")
    parser.add_argument("--stamp", metavar="FILE",
                        help=f"write the commit and digest of this clean checkout to FILE (read back through "
                             f"{SOURCE_STAMP_ENV}=FILE on a machine with a copy of the tree)")
    args = parser.parse_args(argv)
    if args.stamp:
        try:
            stamp = write_source_stamp(args.stamp)
        except ValueError as exc:
            parser.exit(2, f"{exc}\n")
        print(f"{stamp['git_commit']} {stamp['source_digest']} -> {args.stamp}")
    else:
        print(source_digest())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
