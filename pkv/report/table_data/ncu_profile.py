"""Table 5: the Nsight Compute counters of the profiled kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pkv.report.results import ResultFileError, read_json
from pkv.report.table_data.cells import Notes, Num
from pkv.report.table_data.inputs import Inputs

NCU_COLUMNS = (("time_ms", 3), ("sm_throughput_pct", 2), ("mem_throughput_pct", 2), ("dram_gbps", 1),
               ("l2_hit_pct", 2))


def table5(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    path = root / "profile" / "ncu_counters.json"
    rows, skipped = [], None
    if not path.exists():
        inputs.missing_input("profile/ncu_counters.json")
        skipped = "not run"
    else:
        record = read_json(path)
        if not isinstance(record, dict):
            raise ResultFileError(f"{path}: expected a JSON object")
        inputs.add(record)
        if "skipped" in record:
            skipped = str(record["skipped"])
        else:
            kernels = record.get("kernels")
            if not isinstance(kernels, list):
                raise ResultFileError(f"{path}: 'kernels' = {kernels!r} must be a list")
            for i, k in enumerate(kernels):
                if not isinstance(k, dict) or not isinstance(k.get("name"), str):
                    raise ResultFileError(f"{path}: kernels[{i}] needs a string 'name'")
                row = {"name": k["name"], "role": k.get("role") or k["name"]}
                for key, decimals in NCU_COLUMNS:
                    v = k.get(key)
                    row[key] = Num(v, decimals) if isinstance(v, (int, float)) and not isinstance(v, bool) \
                        else notes.missing(f"{k['name']}: {key} not captured")
                rows.append(row)
    return {**inputs.header(), "rows": rows, "skipped": skipped, "notes": notes.items}
