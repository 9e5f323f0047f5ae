"""How a slot is named and where slot files live: what the device slots (pkv.device_slots, their
lock files) and the warm workers (pkv.worker, their sockets and logs) both read, so that neither
imports the other for it.

A slot is ``<host>[-slurm<job>].<kind>-<entry>``: a device of this host (``device-0``) or a CPU
worker's place (``cpu-0``), scoped by host and Slurm job so that only jobs that can share a device
wait for each other. Its files sit in one slot folder that every job of a DAG run shares.

Loads nothing heavy: the client side of every GPU job imports it.
"""

from __future__ import annotations

import os
import socket

SLOT_DIR_ENV = "PKV_SLOT_DIR"
# Where the slots live without --slot-dir or PKV_SLOT_DIR: under the default artifacts root, which
# every job of one DAG run (started from the repository root) shares.
DEFAULT_SLOT_DIR = "artifacts/.slots"

# Slot kinds: a device of this host, or a CPU worker's place (warm jobs without a device).
DEVICE, CPU = "device", "cpu"
SLOT_KINDS = (DEVICE, CPU)


def plain_name(text: str) -> str:
    """``text`` as a plain file-name part: letters, digits, ``-_.``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def host_scope() -> str:
    """``<host>[-slurm<job>]``: the part of a slot's name that says whose devices it hands out."""
    scope = socket.gethostname() or "localhost"
    if os.environ.get("SLURM_JOB_ID"):
        scope += f"-slurm{os.environ['SLURM_JOB_ID']}"
    return plain_name(scope)


def slot_name(entry: str, kind: str = DEVICE) -> str:
    """``<host>[-slurm<job>].device-<entry>`` (or ``.cpu-<k>``). Device entries name devices of one
    host (a slot folder on a shared filesystem serves several), and a Slurm job's entries name the
    cards of its own allocation ("0" in every job when Slurm constrains devices), which no other job
    can have: the names are scoped so that only jobs that can share a device wait for each other."""
    # Entries are indices, or GPU/MIG UUIDs under some schedulers; keep the file name plain.
    return f"{host_scope()}.{kind}-{plain_name(entry)}"


def host_slot_prefixes() -> tuple[str, ...]:
    """The name prefixes of every slot of this host (and Slurm job), of either kind."""
    return tuple(f"{host_scope()}.{kind}-" for kind in SLOT_KINDS)
