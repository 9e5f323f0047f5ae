"""torch.ops.pkv: loads the CUDA extension and registers fake kernels so the ops trace under
torch.compile. The ops mutate their output and scratch arguments and return nothing, so each
fake kernel is empty."""

from __future__ import annotations

import functools

import torch


def _register_fakes() -> None:
    register = getattr(torch.library, "register_fake", None)  # torch >= 2.4
    if register is None:
        return
    for name in ("pkv::bucket_decode", "pkv::workqueue_decode", "pkv::merge_states"):
        register(name)(lambda *args, **kwargs: None)


@functools.lru_cache(maxsize=1)
def load() -> object:
    """Build (or reuse) the extension for this GPU and return torch.ops.pkv."""
    from pkv.build import ensure_built

    ensure_built()
    _register_fakes()
    return torch.ops.pkv
