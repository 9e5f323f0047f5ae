"""NVTX ranges in the "pkv" domain, so Nsight captures can be filtered to our stages."""

from __future__ import annotations

import contextlib

import torch

DOMAIN = "pkv"

try:  # the nvtx package supports domains; torch.cuda.nvtx does not
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None


def validate_range_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"NVTX range name must be a non-empty string, got {name!r}")
    # Nsight's --nvtx-include syntax uses "/" to separate nested ranges, so a "/" inside a
    # name could never be matched by a filter.
    if "/" in name:
        raise ValueError(f"NVTX range name {name!r} contains '/', which Nsight reads as nesting")
    return name


@contextlib.contextmanager
def nvtx_range(name: str):
    """Push an NVTX range for the block: the nvtx package (domain "pkv") when importable,
    torch.cuda.nvtx when CUDA is available, nothing otherwise."""
    validate_range_name(name)
    if _nvtx is not None:
        with _nvtx.annotate(name, domain=DOMAIN):
            yield
    elif torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield
