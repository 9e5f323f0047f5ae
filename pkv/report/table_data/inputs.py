"""The header facts of a table: device, commits, performance flag, inputs that are absent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Inputs:
    """What a table was computed from: device, commits, performance flag, inputs that are absent."""

    devices: set[str] = field(default_factory=set)
    commits: set[str] = field(default_factory=set)
    files: int = 0
    any_not_performance: bool = False
    any_cpu_only: bool = False
    not_run: list[str] = field(default_factory=list)
    _seen: dict[int, Mapping[str, Any]] = field(default_factory=dict)

    def add(self, record: Mapping[str, Any]) -> None:
        # Several rows may read the same file; count it once. Holding the record keeps its id
        # from being reused by another record.
        if id(record) in self._seen:
            return
        self._seen[id(record)] = record
        self.files += 1
        prov = record.get("provenance") if isinstance(record.get("provenance"), Mapping) else {}
        self.devices.add(_device_label(prov))
        commit = prov.get("git_commit") or "unknown"
        if commit != "unknown":
            commit = commit[:12] + ("-dirty" if prov.get("git_dirty") else "")
            # A dirty commit does not say which code ran; the digest of the sources does
            # (`python -m pkv.provenance` prints it for a checkout).
            if prov.get("git_dirty") and prov.get("source_digest"):
                commit += f" (sources {prov['source_digest']})"
        self.commits.add(commit)
        if not is_performance_record(record):
            self.any_not_performance = True
            if not prov.get("gpu_name"):
                self.any_cpu_only = True

    def missing_input(self, what: str) -> None:
        if what not in self.not_run:
            self.not_run.append(what)

    def performance_note(self) -> str | None:
        """None for a performance result, else the reason the table is not one."""
        if self.files == 0:
            return "Not a performance result: none of its inputs ran"
        if self.any_cpu_only:
            return "CPU profile: not a performance result"
        if self.any_not_performance:
            return "Not a performance result: an input is marked performance_result = false"
        return None

    def header(self) -> dict[str, Any]:
        return {
            "performance_note": self.performance_note(),
            "device": "; ".join(sorted(self.devices)) if self.devices else "unknown (no inputs)",
            "commit": ", ".join(sorted(self.commits)) if self.commits else "unknown (no inputs)",
            # With nothing measured there is no performance result either.
            "performance_result": self.files > 0 and not self.any_not_performance,
            "input_files": self.files,
            "not_run": list(self.not_run),
            # What the "device" time column measured: CUDA events on a GPU; on the CPU profile the
            # same timer reads the host clock around the call, so the column must not say CUDA.
            "timer": "CPU-clock" if self.any_cpu_only else "CUDA",
        }


def _device_label(prov: Mapping[str, Any]) -> str:
    gpu = prov.get("gpu_name")
    if gpu:
        details = [f"driver {prov['driver_version']}" if prov.get("driver_version") else None,
                   f"CUDA {prov['cuda_version']}" if prov.get("cuda_version") else None]
        details = [d for d in details if d]
        return f"{gpu} ({', '.join(details)})" if details else str(gpu)
    return "CPU only (no GPU)" if prov else "unknown device"


def is_performance_record(record: Mapping[str, Any]) -> bool:
    """A record counts as a performance result only if it says so and ran on a GPU."""
    flag = record.get("performance_result")
    if isinstance(flag, bool):
        return flag
    prov = record.get("provenance")
    return isinstance(prov, Mapping) and bool(prov.get("gpu_name"))
