"""Table 1: isolated single-request kernels, per method and context."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pkv.report.results import ResultFileError, read_json
from pkv.report.table_data.cells import Notes, Num, Sci
from pkv.report.table_data.inputs import Inputs
from pkv.report.table_data.labels import (
    ABSENT_METHODS,
    ISOLATED_METHOD_ORDER,
    METHOD_LABELS,
    PAPER_ISOLATED_CONTEXTS,
    STAND_INS,
    context_label,
)


def _skip_reason(method: str, skipped: str) -> str:
    """Why a method did not run, naming it once: the engine's own reason where it begins with the
    library's name ("XQA needs a CUDA device"), else '<method's label>: <why>'."""
    library = method.split("_", 1)[0]
    if skipped.lower().startswith(library):
        return skipped
    return f"{METHOD_LABELS.get(method, method)}: {skipped}"


def _stand_in_note(method: str, implementation: object) -> str | None:
    """The footnote of a method that ran as another engine's stand-in (the CPU profile), else None."""
    if not isinstance(implementation, str):
        return None
    kind = implementation.split(":", 1)[0]
    stand_in = STAND_INS.get(method, {}).get(kind)
    if stand_in is None:
        return None
    what, why = stand_in
    return f"{METHOD_LABELS.get(method, method)}: run by its stand-in, {what} (implementation {implementation}); {why}"


def table1(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    base = root / "isolated"
    files: dict[int, dict] = {}
    if base.is_dir():
        for path in sorted(base.glob("ctx*.json")):
            m = re.fullmatch(r"ctx(\d+)", path.stem)
            if not m:
                continue
            record = read_json(path)
            methods = record.get("methods") if isinstance(record, dict) else None
            if methods is None and isinstance(record, dict):
                methods = (record.get("metrics") or {}).get("methods")
            if not isinstance(methods, dict):
                raise ResultFileError(f"{path}: 'methods' must be an object of method -> result")
            files[int(m.group(1))] = record
            inputs.add(record)
    for ctx in PAPER_ISOLATED_CONTEXTS:
        if ctx not in files:
            inputs.missing_input(f"isolated/ctx{ctx}.json")
    contexts = sorted(files)

    def methods_of(rec: dict) -> dict:
        return rec.get("methods") if "methods" in rec else rec["metrics"]["methods"]

    names = {name for rec in files.values() for name in methods_of(rec)}
    if files:
        names |= set(ABSENT_METHODS)
    order = [n for n in ISOLATED_METHOD_ORDER if n in names] + sorted(names - set(ISOLATED_METHOD_ORDER))
    rows = []
    for name in order:
        cells, errs, skips, marks, ran = [], [], [], [], {}
        for ctx in contexts:
            entry = methods_of(files[ctx]).get(name)
            if entry is None and name in ABSENT_METHODS:
                miss = notes.missing(ABSENT_METHODS[name])
                skips.append(miss)
                cells.append({"ms": miss, "floor": miss})
                continue
            if entry is None:
                miss = notes.missing(f"{name} not run at {context_label(ctx)}")
                cells.append({"ms": miss, "floor": miss})
                continue
            if "skipped" in entry:
                miss = notes.missing(_skip_reason(name, str(entry["skipped"])))
                skips.append(miss)
                cells.append({"ms": miss, "floor": miss})
                continue
            stand_in = _stand_in_note(name, entry.get("implementation"))
            if stand_in is not None and notes.number(stand_in) not in marks:
                marks.append(notes.number(stand_in))
            # A method's own one engine (implementation and selection its own name) needs no note.
            implementation, selected = str(entry.get("implementation") or ""), entry.get("selected")
            if stand_in is None and implementation and implementation != name:
                ran.setdefault(implementation, []).append(
                    f"{context_label(ctx)} {selected}" if selected and selected != name else context_label(ctx))
            median_us = entry.get("median_us")
            if not isinstance(median_us, (int, float)):
                raise ResultFileError(f"{base / f'ctx{ctx}.json'}: methods.{name}.median_us = {median_us!r}")
            floor = entry.get("fraction_of_floor")
            cells.append({
                "ms": Num(median_us / 1000.0, 4),
                "floor": Num(floor, 2) if isinstance(floor, (int, float)) else notes.missing(
                    f"{name}: fraction of the read-bandwidth floor not reported"),
            })
            if isinstance(entry.get("rel_err"), (int, float)):
                errs.append(float(entry["rel_err"]))
        if errs:
            rel = Sci(max(errs))
        elif skips and len(skips) == len(contexts):
            rel = skips[0]  # skipped everywhere: the same reason, not a second footnote
        else:
            rel = notes.missing(f"{name}: no relative error reported")
        if ran:
            # Which code each number is: the library version and, for a method with several
            # candidates (FlashInfer's paths, PersistentKV's splits), the one that was fastest.
            marks.append(notes.number(f"{METHOD_LABELS.get(name, name)}: " + "; ".join(
                f"{impl} ({', '.join(where)})" for impl, where in ran.items())))
        rows.append({"method": name, "label": METHOD_LABELS.get(name, name), "cells": cells, "rel_err": rel,
                     "marks": marks})
    return {
        **inputs.header(),
        "contexts": [{"tokens": c, "label": context_label(c)} for c in contexts],
        "rows": rows,
        "notes": notes.items,
    }
