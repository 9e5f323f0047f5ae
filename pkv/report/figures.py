"""Draw the reproduction's figures from a results root (numbers from pkv.report.figure_data).

    python -m pkv.report.figures --root artifacts/<gpu> --out artifacts/<gpu>/figures [--figure NAME ...]

Each figure is written three times: <name>.png for `snakemake --report`, <name>.pdf for a paper, and
<name>.rst, its caption: what is drawn, the result files it was computed from and the commit they
came from. The figure's own footer repeats the device, the commit and whether it is a performance
result, so a copied image still says where it came from. A figure whose input was skipped (the
GPU benchmarks on the CPU profile) is drawn as a panel that says so.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections import defaultdict
from pathlib import Path

# Optional dependency (the `workflow` extra): only the figure rule and its tests import this module.
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

from pkv.report.figure_data import FIGURE_DATA, FigureData  # noqa: E402
from pkv.report.results import write_text_atomic  # noqa: E402

FORMATS = ("png", "pdf")
SIZE = (7.5, 4.2)
# Fixed metadata, so that a figure redrawn from the same files is the same file.
_PDF_METADATA = {"CreationDate": None, "Creator": "pkv.report.figures"}
_PNG_METADATA = {"Software": "pkv.report.figures"}


def _footer(data: FigureData) -> str:
    header = data.header()
    note = header["performance_note"] or "performance result"
    return f"{header['device']} · commit {header['commit']} · {note}"


def _draw_isolated(fig, s) -> None:
    ax = fig.add_subplot()
    x = range(len(s["contexts"]))
    for label, times in s["methods"].items():
        points = [(i, t) for i, t in zip(x, times) if t is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    floor = [(i, f) for i, f in zip(x, s["floor_ms"]) if f is not None]
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="read floor")
    ax.set_xticks(list(x), s["labels"])
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)" + (", measured at " + ", ".join(str(m) for m in s["measured_contexts"])
                                        if s["measured_contexts"] else ""))
    ax.set_ylabel("median ms per call")
    ax.legend(fontsize=8)
    if s["skipped"]:
        ax.text(0.01, 0.99, "not run: " + "; ".join(f"{k}" for k in s["skipped"]), transform=ax.transAxes,
                va="top", fontsize=7)


def _grouped_bars(ax, groups: list[str], series: dict[str, list], width_total: float = 0.8) -> None:
    width = width_total / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        xs = [i - width_total / 2 + width * (k + 0.5) for i in range(len(groups))]
        ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None],
               width=width, label=label)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)


def _draw_kernel_floor(fig, s) -> None:
    ax = fig.add_subplot()
    _grouped_bars(ax, s["cases"], s["engines"])
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_ylabel("fraction of the read floor")
    ax.legend(fontsize=8)


def _ratio_bars(ax, xs, means, **kwargs) -> None:
    """Ratio bars that rise from parity (1.0) or fall below it, so a gain or a loss of a few
    percent reads as a bar and not as the top of a bar drawn from zero."""
    ax.bar(xs, [m - 1.0 for m in means], bottom=1.0, **kwargs)


def _draw_serving(fig, s) -> None:
    ax = fig.add_subplot()
    rows = s["rows"]
    for k, (key, label) in enumerate((("wall", "wall"), ("device", s["timer"]))):
        offset = -0.18 if k == 0 else 0.18
        means = [sum(r[key]) / len(r[key]) for r in rows]
        spreads = [(sum((v - m) ** 2 for v in r[key]) / (len(r[key]) - 1)) ** 0.5 if len(r[key]) > 1 else 0.0
                   for r, m in zip(rows, means)]
        xs = [i + offset for i in range(len(rows))]
        _ratio_bars(ax, xs, means, width=0.34, yerr=spreads, capsize=3, alpha=0.6, label=f"{label} tok/s ratio")
        for x, r in zip(xs, rows):
            ax.plot([x] * len(r[key]), r[key], "k.", markersize=4)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("adaptive / baseline")
    ax.legend(fontsize=8)


def _draw_route_mix(fig, s) -> None:
    ax = fig.add_subplot()
    rows = s["rows"]
    routes = sorted({r for row in rows for r in row["shares"]})
    left = [0.0] * len(rows)
    for route in routes:
        shares = [row["shares"].get(route, 0.0) for row in rows]
        ax.barh(range(len(rows)), shares, left=left, label=route)
        left = [a + b for a, b in zip(left, shares)]
    ax.set_yticks(range(len(rows)), [f"{r['label']} ({r['steps']} steps)" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of measured steps")
    ax.legend(fontsize=8, loc="lower right")


def _draw_host_device(fig, s) -> None:
    cases = s["cases"]
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases):
        engines = case["engines"]
        bottom = [0.0] * len(engines)
        parts = defaultdict(list)
        for e in engines:
            for label, us in e["parts"].items():
                parts[label].append(us)
        for label, values in parts.items():
            ax.bar(range(len(engines)), values, bottom=bottom, label=label)
            bottom = [a + b for a, b in zip(bottom, values)]
        device = [(i, e["device_us"]) for i, e in enumerate(engines) if e["device_us"] is not None]
        ax.plot([d[0] for d in device], [d[1] for d in device], "kD", markersize=4, label="device time")
        ax.set_xticks(range(len(engines)), [e["engine"] for e in engines], rotation=60, ha="right", fontsize=6)
        ax.set_title(case["case"], fontsize=9)
    axes[0].set_ylabel("us per step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=7)


def _draw_model_step(fig, s) -> None:
    ax = fig.add_subplot()
    rows = s["rows"]
    keys = sorted({k for r in rows for k in r["series"]})
    width = 0.8 / max(1, len(keys))
    for k, key in enumerate(keys):
        for i, r in enumerate(rows):
            vals = r["series"].get(key)
            if not vals:
                continue
            x = i - 0.4 + width * (k + 0.5)
            mean = sum(vals) / len(vals)
            spread = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
            _ratio_bars(ax, [x], [mean], width=width, yerr=spread, capsize=3, alpha=0.6, color=f"C{k}",
                        label=key if i == next(j for j, rr in enumerate(rows) if rr["series"].get(key)) else None)
            ax.plot([x] * len(vals), vals, "k.", markersize=4)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("adaptive / FlashInfer, whole step")
    ax.legend(fontsize=8)


_DRAW = {
    "isolated_time": _draw_isolated,
    "kernel_floor": _draw_kernel_floor,
    "serving_ratio": _draw_serving,
    "route_mix": _draw_route_mix,
    "host_device": _draw_host_device,
    "model_step_ratio": _draw_model_step,
}


def draw(data: FigureData):
    """The matplotlib figure of one FigureData: its series, or a panel that says why there are none."""
    fig = plt.figure(figsize=SIZE, layout="constrained")
    fig.suptitle(data.title, fontsize=11)
    if data.empty:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, f"Nothing to draw: {data.empty}", ha="center", va="center", wrap=True)
    else:
        _DRAW[data.name](fig, data.series)
    fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    fig.text(0.01, 0.01, _footer(data), fontsize=6, color="0.3")
    return fig


def _sources_text(sources: list[str]) -> str:
    """The result files, grouped by their top folder: listed when few, counted when many."""
    groups: dict[str, list[str]] = defaultdict(list)
    for path in sources:
        groups[path.split("/", 1)[0]].append(path)
    parts = []
    for top, paths in groups.items():
        if len(paths) <= 6:
            parts.append(", ".join(f"``{p}``" for p in paths))
        else:
            parts.append(f"``{top}/`` ({len(paths)} files: ``{paths[0]}`` ... ``{paths[-1]}``)")
    return "; ".join(parts) if parts else "none"


def caption(data: FigureData, root: Path) -> str:
    """The figure's caption in reStructuredText: what, from which files, from which commit."""
    header = data.header()
    lines = [f"**{data.title}.** {data.what}", ""]
    if data.empty:
        lines += [f"Nothing is drawn: {data.empty}.", ""]
    note = header["performance_note"]
    lines += [f"**{note}.**" if note else "Performance result: measured on the device below.", "",
              f"Result files under ``{root}``: {_sources_text(data.sources)}.", "",
              f"Device: {header['device']}. Commit: ``{header['commit']}``.", ""]
    return "\n".join(lines)


def render(name: str, root: Path, out_dir: Path) -> list[Path]:
    """Write <name>.png, <name>.pdf and <name>.rst under out_dir; returns the files written."""
    if name not in FIGURE_DATA:
        raise ValueError(f"no figure {name!r}; figures are {sorted(FIGURE_DATA)}")
    data = FIGURE_DATA[name](Path(root))
    fig = draw(data)
    written = []
    try:
        for fmt in FORMATS:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=fmt, dpi=150, metadata=_PDF_METADATA if fmt == "pdf" else _PNG_METADATA)
            written.append(_write_bytes(Path(out_dir) / f"{name}.{fmt}", buffer.getvalue()))
    finally:
        plt.close(fig)
    written.append(write_text_atomic(Path(out_dir) / f"{name}.rst", caption(data, Path(root))))
    return written


def _write_bytes(path: Path, payload: bytes) -> Path:
    # Rename into place, as pkv.atomic_io does for text: a reader never sees half an image. A plain
    # write creates the file with 0666 less the umask, like every other output.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(payload)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkv.report.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="results root, e.g. artifacts/<gpu>")
    parser.add_argument("--out", type=Path, required=True, help="folder for <name>.png, .pdf and .rst")
    parser.add_argument("--figure", action="append", choices=sorted(FIGURE_DATA),
                        help="figure to draw (repeatable); all of them by default")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"pkv.report.figures: {args.root}: results root is not a directory", file=sys.stderr)
        return 1
    for name in args.figure or list(FIGURE_DATA):
        for path in render(name, args.root, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
