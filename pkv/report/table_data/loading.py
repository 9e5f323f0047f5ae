"""Reading result files: a trace tree <trace>/seed<S>/<engine>.json, an ablation's variants, and
which seeds are held out from the calibration."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pkv.report.results import read_json, validate_result

CALIBRATION_SEED = 20260622

Loaded = tuple[Path, dict]


def _seed_of(dirname: str) -> int | None:
    m = re.fullmatch(r"seed(\d+)", dirname)
    return int(m.group(1)) if m else None


def load_seed_dir(seed_dir: Path) -> list[Loaded]:
    out = []
    for path in sorted(seed_dir.glob("*.json")):
        if path.name.startswith("."):
            continue
        out.append((path, validate_result(read_json(path), path)))
    return out


def load_trace_tree(base: Path) -> dict[str, dict[int, list[Loaded]]]:
    """<base>/<trace>/seed<S>/<engine>.json -> {trace: {seed: [(path, record)]}}."""
    tree: dict[str, dict[int, list[Loaded]]] = {}
    if not base.is_dir():
        return tree
    for trace_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for seed_dir in sorted(p for p in trace_dir.iterdir() if p.is_dir()):
            seed = _seed_of(seed_dir.name)
            if seed is None:
                continue
            records = load_seed_dir(seed_dir)
            if records:
                tree.setdefault(trace_dir.name, {})[seed] = records
    return tree


def load_ablation(root: Path, ablation: str) -> dict[str, dict[str, dict[int, list[Loaded]]]]:
    """ablate/<ablation>/<variant>/<trace>/seed<S>/ -> {variant: {trace: {seed: records}}}."""
    base = root / "ablate" / ablation
    if not base.is_dir():
        # The experiment configs name ablations "ablate_<name>"; accept that folder name too.
        base = root / "ablate" / f"ablate_{ablation}"
    if not base.is_dir():
        return {}
    out = {}
    for variant_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        tree = load_trace_tree(variant_dir)
        if tree:
            out[variant_dir.name] = tree
    return out


def held_out(seeds: Mapping[int, Any]) -> list[int]:
    """Seeds other than the calibration seed: constants are fitted on that one, so it is not evidence."""
    return sorted(s for s in seeds if s != CALIBRATION_SEED)
