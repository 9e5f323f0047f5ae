"""The headline of a reference set: the figures the README quotes, computed from the set's own files.

A reference set (pkv.report.reference_set) keeps its tables as rendered Markdown and its
benchmarks as JSON. This module reads those, never a number typed by hand: the kernel benchmark
per case against FlashInfer's best path, XQA and vLLM; Table 1's isolated calls; Table 2's
serving ratios; Table 9's model step, eager and replayed; and every place where the set falls
short of an aim the project holds itself to, with its figure. The README carries the block
between two markers that name the set, and ``tests/test_reference_sets.py`` holds that block to
this module's output, so a promoted set cannot leave stale numbers in the README.

    python -m pkv.report.headline artifacts/reference/h100                    # print the block
    python -m pkv.report.headline artifacts/reference/h100 --write README.md  # replace it there
    python -m pkv.report.headline artifacts/reference/h100 --check README.md  # exit 1 if it differs
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pkv.atomic_io import read_json, write_text_atomic
from pkv.config import ConfigError
from pkv.measure import host_bench
from pkv.measure.kernel_bench import case_label
from pkv.policy.route import ROUTE_FLASHINFER
from pkv.refusal import exit_on_refusal
from pkv.report.reference_set import COMMIT_LINE
from pkv.report.table_data.labels import ENGINE_LABELS, METHOD_LABELS

# The aims the project holds a set to, beside "never below 1.00x" (every ratio of the headline).
# Table 9, graph mode: the share of a row's ceiling its ratio captures, and bucketed B1's ratio.
AIM_CAPTURED = 0.5
AIM_GRAPH_B1 = 1.04
AIM_GRAPH_B1_TRACE = "Bucketed B1"
# An eager step's host time (plan plus issue, host_bench's adaptive engine), us, at B = 1, 8 and 64.
AIM_EAGER_HOST_US = 15.0
# Table 2's skewed B64 row, wall time.
AIM_SKEWED_WALL = 1.10
AIM_SKEWED_TRACE = "Skewed B64"
# One long request in the kernel benchmark: case -> the lead over FlashInfer's best path aimed at.
AIM_B1 = {"b1_32k": 1.4, "b1_64k": 1.15}
# The adaptive engine's eager modes in host_bench (the default, and its step in one op call where
# the run has it); a case it leaves to FlashInfer records the route ROUTE_FLASHINFER.
HOST_ENGINES = ("adaptive/native", "adaptive/native, one op")

ADAPTIVE = ENGINE_LABELS["adaptive"]
XQA = ENGINE_LABELS["xqa"]
GRAPH_MODE, EAGER_MODE = "CUDA graph", "eager"
NOTE = re.compile(r"\[\d+\]$")
RATIO = re.compile(r"(-?\d+(?:\.\d+)?)(?: ± (\d+(?:\.\d+)?))?×?$")
CELL_SPLIT = re.compile(r"(?<!\\)\|")
DEVICE_LINE = re.compile(r"^Device: (.+?)\. Commit:", re.MULTILINE)
BEGIN = "<!-- headline {set}: python -m pkv.report.headline {set} --write README.md; do not edit by hand -->"
END = "<!-- end headline {set} -->"


@dataclass(frozen=True)
class Ratio:
    mean: float
    std: float | None = None

    def __str__(self) -> str:
        return f"{self.mean:.3f}x" if self.std is None else f"{self.mean:.3f} ± {self.std:.3f}x"

    @property
    def below_one(self) -> bool:
        # As printed: a ratio that rounds to 1.000 is a tie, not a loss.
        return round(self.mean, 3) < 1.0


def markdown_table(path: Path) -> list[dict[str, str]]:
    """The first pipe table of a Markdown file as rows {header: cell} (footnote marks kept)."""
    lines = path.read_text().splitlines()
    for i in range(len(lines) - 1):
        if lines[i].startswith("|") and lines[i + 1].startswith("|---"):
            header = _cells(lines[i])
            rows = []
            for line in lines[i + 2:]:
                if not line.startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(line))))
            return rows
    raise ConfigError(f"{path}: no table found: a reference set's tables are the tables rule's Markdown")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in CELL_SPLIT.split(line.strip().strip("|"))]


def label(cell: str) -> str:
    """A row label without its footnote mark: "Bimodal B8[2]" -> "Bimodal B8"."""
    return NOTE.sub("", cell)


def ratio(cell: str) -> Ratio | None:
    """"1.012 ± 0.004×" -> Ratio(1.012, 0.004); a dash (no value) -> None."""
    m = RATIO.match(label(cell))
    return Ratio(float(m.group(1)), float(m.group(2)) if m.group(2) else None) if m else None


def _column(rows: list[dict], name: str, path: Path) -> None:
    if rows and name not in rows[0]:
        raise ConfigError(f"{path}: column {name!r} not found (columns {list(rows[0])}): "
                          "the headline reads the tables rule's columns by name")


def _pick(rows: list[dict], path: Path, **where) -> list[dict]:
    for name in where:
        _column(rows, name, path)
    return [row for row in rows if all(label(row[k]) == v for k, v in where.items())]


# --- what the set's files say ----------------------------------------------------------------------

def set_header(root: Path) -> dict:
    """Commit, device line and versions of a set, from its claims check and kernel benchmark."""
    claims = (root / "tables" / "claims.md").read_text()
    commit = COMMIT_LINE.search(claims)
    device = DEVICE_LINE.search(claims)
    verdicts = re.search(r"^Verdicts: (.+)$", claims, re.MULTILINE)
    if not (commit and device and verdicts):
        raise ConfigError(f"{root / 'tables' / 'claims.md'}: its Device, Commit or Verdicts line is missing")
    provenance = read_json(root / "kernel_bench" / "decode.json")["provenance"]
    return {"commit": commit.group(1)[:7], "device": device.group(1), "verdicts": verdicts.group(1).rstrip("."),
            "torch": provenance.get("torch"), "flashinfer": provenance.get("flashinfer")}


def kernel_rows(root: Path) -> list[dict]:
    """Per kernel-benchmark case: PersistentKV's best configuration against FlashInfer's best path
    (the sweep's medians and the confirming rounds'), XQA and vLLM, and both fractions of the floor."""
    bench = read_json(root / "kernel_bench" / "decode.json")
    rows = []
    for name, case in bench["cases"].items():
        engines = case["engines"]
        pkv_us = engines["persistentkv"]["median_us"]
        vllm = engines.get("vllm", {})
        rows.append({
            "case": name, "label": case_label(name, case["seq_lens"]),
            "flashinfer": Ratio(case["speedup_vs_flashinfer"]),
            "confirmed": Ratio(case["confirmed"]["speedup"]),
            "xqa": Ratio(case["speedup_vs_xqa"]) if case.get("speedup_vs_xqa") else None,
            "vllm": Ratio(vllm["median_us"] / pkv_us) if "median_us" in vllm else None,
            "floor": (case["pkv_fraction_of_floor"], case["flashinfer_fraction_of_floor"]),
        })
    return rows


def isolated_rows(root: Path) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Table 1: (contexts, [(method, ms per context)]) for PersistentKV and each baseline that ran."""
    path = root / "tables" / "table1.md"
    rows = markdown_table(path)
    contexts = [name[:-3] for name in rows[0] if name.endswith(" ms")]
    picked = []
    for method in ("persistentkv", "flashinfer", "xqa", "vllm"):
        for row in _pick(rows, path, Method=METHOD_LABELS[method]):
            picked.append((METHOD_LABELS[method], [label(row[f"{c} ms"]) for c in contexts]))
    return contexts, picked


def serving_rows(root: Path) -> list[dict]:
    """Table 2: per trace, the route and the adaptive engine's ratios."""
    path = root / "tables" / "table2.md"
    rows = markdown_table(path)
    for name in ("Trace", "Selected route", "CUDA tok/s ratio", "Wall tok/s ratio", "CUDA ratio vs XQA",
                 "Wall ratio vs XQA"):
        _column(rows, name, path)
    return [{"trace": label(row["Trace"]), "route": row["Selected route"],
             "device": ratio(row["CUDA tok/s ratio"]), "wall": ratio(row["Wall tok/s ratio"]),
             "device_xqa": ratio(row["CUDA ratio vs XQA"]), "wall_xqa": ratio(row["Wall ratio vs XQA"])}
            for row in rows]


def model_step_rows(root: Path) -> list[dict]:
    """Table 9: per trace, the adaptive engine's graph and eager ratios, the graph row's ceiling and
    captured share, and XQA's own graph ratio."""
    path = root / "tables" / "table9.md"
    rows = markdown_table(path)
    for name in ("Trace", "Engine", "Mode", "Route", "CUDA ratio", "Wall ratio", "Ceiling", "Captured"):
        _column(rows, name, path)
    out = []
    for trace in dict.fromkeys(label(row["Trace"]) for row in rows):
        def one(engine, mode, trace=trace):
            found = _pick(rows, path, Trace=trace, Engine=engine, Mode=mode)
            return found[0] if found else None
        graph, eager, xqa = one(ADAPTIVE, GRAPH_MODE), one(ADAPTIVE, EAGER_MODE), one(XQA, GRAPH_MODE)
        if graph is None:
            continue
        out.append({"trace": trace, "route": graph["Route"],
                    "graph": ratio(graph["CUDA ratio"]), "graph_wall": ratio(graph["Wall ratio"]),
                    "ceiling": ratio(graph["Ceiling"]), "captured": ratio(graph["Captured"]),
                    "eager": ratio(eager["CUDA ratio"]) if eager else None,
                    "eager_wall": ratio(eager["Wall ratio"]) if eager else None,
                    "xqa_graph": ratio(xqa["CUDA ratio"]) if xqa else None})
    return out


def host_rows(root: Path) -> list[dict]:
    """host_bench: per case, the eager host time (plan plus issue, tight loop) of each of the adaptive
    engine's HOST_ENGINES the run timed, its route, and FlashInfer's own."""
    bench = read_json(root / "host_bench" / "host.json")
    rows = []
    for name, case in bench["cases"].items():
        engines = case["engines"]

        def host_us(record):
            return record["tight"]["plan_us"] + record["tight"]["issue_us"]
        modes = {mode: host_us(engines[mode]) for mode in HOST_ENGINES if "tight" in engines.get(mode, {})}
        # The range of each engine's per-round medians, where the run timed its engines in rounds.
        rounds = {mode: (min(by_round), max(by_round)) for mode in modes
                  if (by_round := engines[mode].get("tight_plan_issue_us_by_round"))}
        rows.append({"case": name, "label": case_label(name, case["seq_lens"], host_bench.CASE_LABELS),
                     "route": engines[HOST_ENGINES[0]].get("route"), "modes": modes, "rounds": rounds,
                     "flashinfer_us": host_us(engines["flashinfer"])})
    return rows


# --- the block --------------------------------------------------------------------------------------

def _r(value) -> str:
    return "–" if value is None else str(value)


def _ms(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:  # a dash: not run
        return None


def _main_route(row: dict) -> str:
    """A row's route as the route most steps took (the table's cell before its first ";")."""
    return row["route"].split(";")[0]


def _host_cell(row: dict, mode: str) -> str:
    """One engine's eager host time, with the range of its rounds where the run recorded them."""
    if mode not in row["modes"]:
        return "–"
    low_high = (row.get("rounds") or {}).get(mode)
    return f"{row['modes'][mode]:.1f}" + (f" ({low_high[0]:.1f}-{low_high[1]:.1f})" if low_high else "")


def _share(value: Ratio | None) -> str:
    return "–" if value is None else f"{value.mean:.2f}"


def shortfalls(kernels, isolated, serving, steps, host) -> list[str]:
    """Every place the set falls short of an aim, with its figure: each ratio below 1.00x, then the
    aims of AIM_*. Empty where the set meets them all."""
    below = []
    contexts, methods = isolated
    times = dict(methods)
    ours = times.get(METHOD_LABELS["persistentkv"])
    for method, cells in methods:
        for context, theirs, mine in zip(contexts, cells, ours or []):
            if method != METHOD_LABELS["persistentkv"] and _ms(theirs) and _ms(mine) and _ms(mine) > _ms(theirs):
                below.append(f"Table 1 {context}: PersistentKV {mine} ms, {method} {theirs} ms")
    for row in kernels:
        for key, against in (("flashinfer", "FlashInfer's best path"), ("confirmed", "FlashInfer, confirming rounds"),
                             ("xqa", "XQA"), ("vllm", "vLLM")):
            if row[key] is not None and row[key].below_one:
                below.append(f"kernel benchmark {row['label']}: {row[key]} {against}")
    for row in serving:
        for key, what in (("device", "device"), ("wall", "wall"), ("device_xqa", "device vs XQA"),
                          ("wall_xqa", "wall vs XQA")):
            if row[key] is not None and row[key].below_one:
                below.append(f"Table 2 {row['trace']} ({_main_route(row)}): {what} {row[key]}")
    for row in steps:
        for key, what in (("graph", "graph device"), ("graph_wall", "graph wall"), ("eager", "eager device"),
                          ("eager_wall", "eager wall")):
            if row[key] is not None and row[key].below_one:
                below.append(f"Table 9 {row['trace']} ({_main_route(row)}): {what} {row[key]}")
    lines = [f"Below 1.00x: {entry}." for entry in below]
    uncaptured = [row for row in steps if row["captured"] is not None and row["captured"].mean < AIM_CAPTURED]
    if uncaptured:
        lines.append(f"Table 9, graph mode, under {AIM_CAPTURED} of the ceiling captured: " + "; ".join(
            f"{row['trace']} {row['graph']} of {row['ceiling']} ({row['captured'].mean:.2f})" for row in uncaptured)
            + ".")
    for row in steps:
        if row["trace"] == AIM_GRAPH_B1_TRACE and row["graph"] is not None and row["graph"].mean < AIM_GRAPH_B1:
            lines.append(f"Table 9, graph mode, {row['trace']}: {row['graph']} against an aim of {AIM_GRAPH_B1:.2f}x.")
    for row in host:
        if row["route"] == ROUTE_FLASHINFER or not row["modes"]:
            continue
        mode, best = min(row["modes"].items(), key=lambda item: item[1])
        if best > AIM_EAGER_HOST_US:
            lines.append(f"Eager host time, {row['label']}: {best:.1f} us ({mode}, host_bench's plan plus issue) "
                         f"against an aim of {AIM_EAGER_HOST_US:.0f} us (FlashInfer's {row['flashinfer_us']:.1f}).")
    for row in serving:
        if row["trace"] == AIM_SKEWED_TRACE and row["wall"] is not None and row["wall"].mean < AIM_SKEWED_WALL:
            lines.append(f"Table 2 {row['trace']}: wall {row['wall']} against an aim of {AIM_SKEWED_WALL:.2f}x.")
    for row in kernels:
        aim = AIM_B1.get(row["case"])
        if aim is not None and row["flashinfer"].mean < aim:
            lines.append(f"Kernel benchmark {row['label']}: {row['flashinfer']} FlashInfer's best path (confirmed "
                         f"{row['confirmed']}) against an aim of {aim:.2f}x.")
    return lines


def headline(root: Path) -> str:
    """The README block of the set at ``root`` (Markdown, no markers)."""
    head = set_header(root)
    kernels, serving, steps, host = kernel_rows(root), serving_rows(root), model_step_rows(root), host_rows(root)
    contexts, isolated = isolated_rows(root)
    out = [f"**{head['device']}, commit {head['commit']}**, torch {head['torch']}, FlashInfer {head['flashinfer']}. "
           f"Claims check: {head['verdicts']}. Ratios are the other engine's time over PersistentKV's "
           "(above 1.00x: PersistentKV is faster), each engine checked against float64 on the same page tables.",
           "",
           "Kernel benchmark, device time per call after an L2 eviction (PersistentKV's best configuration of "
           "its sweep; \"confirmed\": the median of five interleaved rounds of the chosen configurations):",
           "",
           "| case | / FlashInfer's best path | confirmed | / XQA | / vLLM | fraction of the read floor, "
           "PersistentKV / FlashInfer |",
           "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {row['label']} | {row['flashinfer']} | {row['confirmed']} | {_r(row['xqa'])} | {_r(row['vllm'])} | "
            f"{row['floor'][0]:.2f} / {row['floor'][1]:.2f} |" for row in kernels]
    out += ["", "Isolated B1 call (Table 1), ms:", "",
            "| method | " + " | ".join(contexts) + " |", "|---|" + "---:|" * len(contexts)]
    out += [f"| {method} | " + " | ".join(cells) + " |" for method, cells in isolated]
    out += ["", "Serving (Table 2), the adaptive engine over five held-out seeds, mean ± std of per-seed ratios:", "",
            "| trace | route | / FlashInfer, device | / FlashInfer, wall | / XQA, device | / XQA, wall |",
            "|---|---|---:|---:|---:|---:|"]
    out += [f"| {row['trace']} | {row['route']} | {_r(row['device'])} | {_r(row['wall'])} | {_r(row['device_xqa'])} | "
            f"{_r(row['wall_xqa'])} |" for row in serving]
    out += ["", "One decode step of the whole model (Table 9), the adaptive engine over FlashInfer in the same mode "
            "(graph: FlashInfer's CUDA-graph wrapper); ceiling: the ratio with attention at the read floor; "
            "captured: the share of it the graph ratio takes:", "",
            "| trace | route | graph, device | graph, wall | ceiling | captured | eager, device | eager, wall | "
            "XQA's graph / FlashInfer's |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {row['trace']} | {row['route']} | {_r(row['graph'])} | {_r(row['graph_wall'])} | "
            f"{_r(row['ceiling'])} | {_share(row['captured'])} | {_r(row['eager'])} | {_r(row['eager_wall'])} | "
            f"{_r(row['xqa_graph'])} |" for row in steps]
    routed = [row for row in host if row["route"] != ROUTE_FLASHINFER and row["modes"]]
    if routed:
        ranged = any(row.get("rounds") for row in routed)
        out += ["", "Eager host time a step (host_bench, plan plus issue in a tight loop, us"
                + ("; in brackets, the range of its rounds' medians" if ranged else "") + "):", "",
                "| case | " + " | ".join(HOST_ENGINES) + " | FlashInfer |", "|---|" + "---:|" * (len(HOST_ENGINES) + 1)]
        out += [f"| {row['label']} | " + " | ".join(_host_cell(row, mode) for mode in HOST_ENGINES)
                + f" | {row['flashinfer_us']:.1f} |" for row in routed]
    falls = shortfalls(kernels, (contexts, isolated), serving, steps, host)
    out += ["", "Where this set falls short:" if falls else "This set meets every aim the headline checks.", ""]
    out += [f"- {line}" for line in falls]
    return "\n".join(out).rstrip() + "\n"


def markers(set_name: str) -> tuple[str, str]:
    return BEGIN.format(set=set_name), END.format(set=set_name)


def readme_block(readme: Path, set_name: str) -> tuple[int, int] | None:
    """The character span between the set's markers in ``readme`` (None: no markers)."""
    text = readme.read_text()
    begin, end = markers(set_name)
    start = text.find(begin)
    if start < 0:
        return None
    stop = text.find(end, start)
    if stop < 0:
        raise ConfigError(f"{readme}: {begin!r} has no {end!r} after it")
    return start + len(begin) + 1, stop


def set_name_of(root: Path) -> str:
    """How the README's markers name a set: its path from the repository root (from the last
    "artifacts" folder, which a checkout's own path may contain too)."""
    parts = root.resolve().parts
    if "artifacts" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("artifacts"):])
    return root.as_posix()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("set", type=Path, help="a reference set, e.g. artifacts/reference/h100")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, help="replace the block between the set's markers in this file")
    action.add_argument("--check", type=Path, help="exit 1 where the block in this file differs from the set's")
    args = parser.parse_args(argv)
    block = headline(args.set)
    if not (args.write or args.check):
        sys.stdout.write(block)
        return 0
    readme = args.write or args.check
    name = set_name_of(args.set)
    span = readme_block(readme, name)
    if span is None:
        raise ConfigError(f"{readme}: no marker {markers(name)[0]!r}: put the two markers where the block goes")
    text = readme.read_text()
    if args.check:
        if text[span[0]:span[1]] != block:
            print(f"{readme}: the headline of {name} differs from the set's; run "
                  f"python -m pkv.report.headline {name} --write {readme}", file=sys.stderr)
            return 1
        return 0
    write_text_atomic(readme, text[:span[0]] + block + text[span[1]:])
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
