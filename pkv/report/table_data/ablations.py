"""Tables 7 and 8: the split-count sweeps and the GQA sweep."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pkv.report.results import ResultFileError
from pkv.report.table_data.cells import Notes, Num, Text
from pkv.report.table_data.comparisons import (
    BASELINE_ROUTE_ONLY,
    aggregate_serving,
    note_partial,
    ratio_cells,
    took_baseline_route_only,
)
from pkv.report.table_data.inputs import Inputs
from pkv.report.table_data.labels import GQA_TRACE, ordered, seeds_text, selected_route, trace_label
from pkv.report.table_data.loading import held_out, load_ablation


def _variant_int(variant: str, pattern: str) -> int | None:
    m = re.search(pattern, variant, flags=re.IGNORECASE)
    return int(m.group(1)) if m else None


# (ablation folder, engines preferred as the subject, row note). The B4 sweep times PersistentKV's
# workqueue directly: the policy would route B4 to FlashInfer, so the sweep asks what that avoids.
SPLIT_SWEEPS = (
    ("splits", ("adaptive",), "policy with fixed split count"),
    ("b4", ("persistentkv_workqueue", "persistentkv"), "PersistentKV workqueue, B4 allowed"),
    # The B1 short-row rule's sweep: its points are tiles a split (1: off), not split counts.
    ("short_rows", ("adaptive",), "policy, B1 short rows at the tiles a split shown"),
)


def table7(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    rows, all_seeds = [], set()
    for ablation, prefer, what in SPLIT_SWEEPS:
        sweep = load_ablation(root, ablation)
        if not sweep:
            inputs.missing_input(f"ablate/{ablation}")
            continue
        by_trace: dict[str, list[tuple[int, str]]] = {}
        for variant in sweep:
            splits = _variant_int(variant, r"(\d+)\s*$")
            if splits is None:
                raise ResultFileError(f"{root / 'ablate' / ablation / variant}: variant names no split count "
                                      "(or tiles a split)")
            for trace in sweep[variant]:
                by_trace.setdefault(trace, []).append((splits, variant))
        for trace in ordered(by_trace, ("bucketed_b1", "bimodal_b8", "bimodal_b4", "azure_conv_b8")):
            points, row_seeds = [], set()
            for splits, variant in sorted(by_trace[trace]):
                # A sensitivity check on held-out data: the calibration seed is left out.
                seeds = {s: sweep[variant][trace][s] for s in held_out(sweep[variant][trace])}
                agg = aggregate_serving(seeds, f"ablate/{ablation}/{variant}/{trace}", inputs, prefer)
                all_seeds.update(agg.seeds)
                row_seeds.update(agg.seeds)
                cuda, wall = ratio_cells(agg, notes, "no held-out seeds")
                marks = note_partial(agg, notes)
                # A routed sweep whose steps all went to FlashInfer never applied its split count.
                baseline_only = agg.ok and took_baseline_route_only(agg.subjects)
                if baseline_only:
                    marks.append(notes.number(f"{BASELINE_ROUTE_ONLY}; the split count was never applied"))
                points.append({"splits": splits, "cuda": cuda, "wall": wall, "seeds": len(agg.seeds),
                               "marks": marks, "baseline_route_only": baseline_only})
            # Each sweep runs on its own seeds (config/config.yaml), so a row names the seeds it comes from.
            rows.append({"trace": trace, "label": f"{trace_label(trace)} ({what})", "points": points,
                         "seeds": seeds_text(row_seeds)})
    return {**inputs.header(), "rows": rows, "seeds": seeds_text(all_seeds), "notes": notes.items}


def _find_int(config: Any, keys: tuple[str, ...]) -> int | None:
    """First integer under any of `keys` anywhere in a nested config."""
    if isinstance(config, Mapping):
        for key in keys:
            v = config.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        for v in config.values():
            found = _find_int(v, keys)
            if found is not None:
                return found
    return None


def table8(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    ablation = load_ablation(root, "gqa")
    if not ablation:
        inputs.missing_input("ablate/gqa")
    rows, all_seeds = [], set()
    for variant in ablation:
        seeds_all = ablation[variant].get(GQA_TRACE)
        if not seeds_all:
            continue
        seeds = {s: seeds_all[s] for s in held_out(seeds_all)}
        agg = aggregate_serving(seeds, f"ablate/gqa/{variant}/{GQA_TRACE}", inputs)
        all_seeds.update(agg.seeds)
        cuda, wall = ratio_cells(agg, notes, "no held-out seeds")
        group = _variant_int(variant, r"\bG\s*=\s*(\d+)")
        hkv = _variant_int(variant, r"hkv\s*=\s*(\d+)")
        if agg.subjects:
            cfg = (agg.subjects[0].get("provenance") or {}).get("config") or {}
            hq = _find_int(cfg, ("num_q_heads", "num_qo_heads", "hq"))
            if hkv is None:
                hkv = _find_int(cfg, ("num_kv_heads", "hkv"))
            if group is None and hq and hkv:
                group = hq // hkv
            if hkv is None and hq and group:
                hkv = hq // group
        route = Text(selected_route(agg.subjects)[1]) if agg.ok else cuda
        rows.append({
            "variant": variant,
            "group": Num(group, 0) if group is not None else notes.missing(f"{variant}: G not recorded"),
            "hkv": Num(hkv, 0) if hkv is not None else notes.missing(f"{variant}: Hkv not recorded"),
            "route": route, "cuda": cuda, "wall": wall, "sort": group if group is not None else 1 << 30,
            "marks": note_partial(agg, notes),
        })
    rows.sort(key=lambda r: (r["sort"], r["variant"]))
    return {**inputs.header(), "rows": rows, "trace": trace_label(GQA_TRACE), "seeds": seeds_text(all_seeds),
            "notes": notes.items}
