"""What the benchmark commands share: their arguments and the record of a run without a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pkv.atomic_io import write_json_atomic
from pkv.engines.flashinfer import BEST_OF_ROLES
from pkv.provenance import collect_provenance


def bench_parser(doc: str, cases, *, reps: int, seed: int) -> argparse.ArgumentParser:
    """--out, --cases (every case by default), --reps and --seed; a command adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=list(cases), choices=list(cases))
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--seed", type=int, default=seed)
    return parser


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def flashinfer_roles(device) -> tuple[str, ...]:
    """The FlashInfer roles a benchmark times on ``device``: each path of the best-of set on a GPU;
    on the CPU the one role with a stand-in (repack + SDPA), since the pinned paths have none."""
    return BEST_OF_ROLES if is_cuda(device) else ("flashinfer",)


def write_skipped_no_gpu(out: Path, schema: str, config: dict | None, seed: int) -> int:
    """The record of a benchmark that cannot run here (tables and figures show the reason)."""
    write_json_atomic(out, {"schema": schema, "skipped": "no GPU",
                            "provenance": collect_provenance(config=config, seed=seed)})
    print("skipped: no GPU")
    return 0
