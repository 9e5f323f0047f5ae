"""What Table 2's attention lead predicts for Table 9's graph-replayed step, per trace.

Table 2 times one attention call per step of a trace (device time, L2 flushed); Table 9 times a
whole model step of the same trace and seeds, replayed from CUDA graphs. If each graphed layer's
attention kept Table 2's lead r (adaptive over FlashInfer, decode-token throughput), and the rest
of the step were the same for both engines, FlashInfer's step of attention share a would shrink to
1 - a (1 - 1/r) of itself: the predicted step ratio is 1 / (1 - a (1 - 1/r)). Set beside the
ratio Table 9 measured, and its ceiling (attention at the read floor), per held-out seed within
one run, then mean and sample std:

    python -m pkv.report.graph_gain artifacts/h100 [--json out.json]

A measured ratio near the prediction says the graph keeps the lead the trace's steps have; one
well below it says the lead is lost inside the step (launch gaps FlashInfer's graph removes, the
kernels' order beside the model's). Two columns say which: Table 2's device ratio over only the
steps the model step measured (matched by step index in the per-step records), and attention's
ratio inside the graph, FlashInfer's attention time per step over the adaptive route's (each the
graphed step less the step with attention left out, which is the same for both engines). Where the
second falls short of the first, the graphed kernels lost the lead that the same steps' eager
kernels had. A seed is left out where either run's output was found wrong on measured steps, or
where the step does not split into attention and the rest
(pkv.report.table_data.model_step.separable: a host-bound step).

Where a model-step run was asked for kernel traces (``experiment.kernel_profile_steps``,
pkv.measure.kernel_trace), a second table takes attention apart kernel by kernel, per layer: each
path's attention kernels (those its mode's step without attention does not run), the idle gaps next
to them, the span they add to that step, and its largest attention kernels; a third, what
attention does to the step's other kernels (each one's time less its time in the step without
attention, by name: the part of the span that is neither attention's kernels nor its gaps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pkv.atomic_io import write_text_atomic
from pkv.config import ConfigError
from pkv.measure.kernel_trace import AFTER_ATTENTION
from pkv.refusal import exit_on_refusal
from pkv.report.table_data.comparisons import metric
from pkv.report.table_data.labels import trace_label
from pkv.report.table_data.loading import held_out, load_trace_tree
from pkv.report.table_data.model_step import separable, step_ceiling

COLUMNS = ("table2_ratio", "table2_same_steps", "attention_share", "predicted", "graph_attention_ratio", "measured",
           "ceiling")
# table2_same_steps and graph_attention_ratio are None where a record lacks per-step records or the
# adaptive graph's attention time (older runs): left out of the mean, "–" where no seed has them.


def predicted_ratio(table2_ratio: float, attention_share: float) -> float:
    """The step ratio if attention alone changed by Table 2's throughput ratio: FlashInfer's step
    is 1, its attention ``attention_share`` of it, the adaptive step 1 - share (1 - 1 / ratio)."""
    return 1.0 / (1.0 - attention_share * (1.0 - 1.0 / table2_ratio))


def _by_engine(records) -> dict:
    return {record.get("engine"): record for _, record in records}


def _wrong(*records) -> bool:
    return any((metric(r, "wrong_steps") or 0) > 0 for r in records)


def seed_row(evaluate: dict, model_step: dict) -> dict | str:
    """One seed's figures, or why the seed is left out."""
    adaptive, flashinfer = evaluate.get("adaptive"), evaluate.get("flashinfer")
    graph, fi_graph = model_step.get("adaptive_graph"), model_step.get("flashinfer_graph")
    if None in (adaptive, flashinfer, graph, fi_graph):
        return "a result file is missing"
    if _wrong(adaptive, flashinfer, graph, fi_graph):
        return "an output was wrong on measured steps"
    if not separable(fi_graph):
        return "FlashInfer's graphed step is bound by its host"
    values = [metric(adaptive, "cuda_tok_s"), metric(flashinfer, "cuda_tok_s"), metric(graph, "cuda_tok_s"),
              metric(fi_graph, "cuda_tok_s"), metric(fi_graph, "attention_share"), step_ceiling(fi_graph)]
    if any(v is None or v <= 0 for v in values):
        return "a metric is missing"
    pkv_tok_s, fi_tok_s, graph_tok_s, fi_graph_tok_s, share, ceiling = values
    table2 = pkv_tok_s / fi_tok_s
    return {"table2_ratio": table2, "table2_same_steps": same_steps_ratio(adaptive, flashinfer, graph),
            "attention_share": share, "predicted": predicted_ratio(table2, share),
            "graph_attention_ratio": _ratio(metric(fi_graph, "attention_cuda_ms_per_step"),
                                            metric(graph, "attention_cuda_ms_per_step")),
            "measured": graph_tok_s / fi_graph_tok_s, "ceiling": ceiling}


def _ratio(numerator, denominator) -> float | None:
    return numerator / denominator if numerator and denominator and numerator > 0 and denominator > 0 else None


def _step_cuda_us(record) -> dict:
    steps = (record.get("metrics") or {}).get("per_step") or []
    return {s["step"]: s["cuda_us"] for s in steps if isinstance(s, dict) and "step" in s and "cuda_us" in s}


def same_steps_ratio(adaptive, flashinfer, graph) -> float | None:
    """Table 2's device ratio (FlashInfer's time over the adaptive route's, summed) over the steps
    the graphed model step measured, matched by step index; None where no step matches."""
    ours, theirs = _step_cuda_us(adaptive), _step_cuda_us(flashinfer)
    steps = [s for s in _step_cuda_us(graph) if s in ours and s in theirs]
    if not steps:
        return None
    return _ratio(sum(theirs[s] for s in steps), sum(ours[s] for s in steps))


def graph_gain(run: Path) -> dict:
    """{trace: {"seeds": {seed: row or reason}, "mean": {column: mean}, "std": {column: std}}} for
    the model-step traces of ``run`` (artifacts/<gpu>) that Table 2 also ran."""
    evaluate = load_trace_tree(run / "evaluate")
    model_step = load_trace_tree(run / "model_step")
    if not model_step:
        raise ConfigError(f"{run / 'model_step'}: no model-step results (Table 9's) under this folder")
    out = {}
    for trace, seeds in model_step.items():
        if trace not in evaluate:
            continue
        rows = {seed: seed_row(_by_engine(evaluate[trace].get(seed, [])), _by_engine(seeds[seed]))
                for seed in held_out(seeds)}
        kept = [row for row in rows.values() if isinstance(row, dict)]
        summary = {"seeds": rows, "mean": {}, "std": {}}
        for column in COLUMNS:
            values = [row[column] for row in kept if row[column] is not None]
            if values:
                summary["mean"][column] = statistics.fmean(values)
                summary["std"][column] = statistics.stdev(values) if len(values) > 1 else None
        out[trace] = summary
    return out


def _cell(summary: dict, column: str) -> str:
    mean, std = summary["mean"].get(column), summary["std"].get(column)
    if mean is None:
        return "–"
    return f"{mean:.3f}" + (f" ± {std:.3f}" if std is not None else "")


KERNEL_NAME_CHARS = 48
KERNELS_SHOWN = 3


def kernel_rows(run: Path) -> list[dict]:
    """Per (trace, path) of the model-step records that carry kernel traces, over every seed that
    has them: attention's kernels per layer (us), the idle gaps next to them, the span attention
    adds per layer, and the largest attention kernels (name, us and launches per layer)."""
    rows = []
    for trace, seeds in load_trace_tree(run / "model_step").items():
        by_path: dict[str, list[tuple[dict, int]]] = {}
        for seed in sorted(seeds):
            for _, record in seeds[seed]:
                metrics = record.get("metrics") or {}
                profile, layers = metrics.get("kernel_profile") or {}, (metrics.get("model") or {}).get("layers_run")
                if profile.get("steps") and layers:
                    by_path.setdefault(record.get("engine"), []).append((profile, int(layers)))
        for path, profiles in sorted(by_path.items()):
            def per_layer(key, profiles=profiles):
                return statistics.fmean(p.get(key, 0.0) / layers for p, layers in profiles)
            kernels: dict[str, list[float]] = {}
            for profile, layers in profiles:
                for name, entry in profile["kernels"].items():
                    if entry.get("attention"):
                        got = kernels.setdefault(name, [0.0, 0.0])
                        got[0] += entry["us_per_step"] / layers / len(profiles)
                        got[1] += entry["count_per_step"] / layers / len(profiles)
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:KERNELS_SHOWN]
            others: dict[str, float] = {}
            for profile, layers in profiles:
                for name, extra in (profile.get("other_kernels_extra") or {}).items():
                    others[name] = others.get(name, 0.0) + extra / layers / len(profiles)
            other_top = sorted(others.items(), key=lambda kv: -abs(kv[1]))[:KERNELS_SHOWN]
            rows.append({"trace": trace, "path": path, "seeds": len(profiles),
                         "steps": sum(p["steps"] for p, _ in profiles),
                         "attention_kernel_us": per_layer("attention_kernel_us_per_step"),
                         "attention_gap_us": per_layer("attention_gap_us_per_step"),
                         "attention_span_us": (per_layer("attention_span_us_per_step")
                                               if all("attention_span_us_per_step" in p for p, _ in profiles)
                                               else None),
                         "other_kernels_extra_us": (per_layer("other_kernels_extra_us_per_step")
                                                    if all("other_kernels_extra_us_per_step" in p
                                                           for p, _ in profiles)
                                                    else None),
                         "kernels": [(name, us, count) for name, (us, count) in top],
                         "other_kernels": other_top})
    return rows


def render_kernels(rows: list[dict]) -> str:
    lines = ["| Trace | Path | Seeds | Steps | Attention kernels, us a layer | Gaps next to them "
             "| Span attention adds | Other kernels' extra | Largest attention kernels (us, launches a layer) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def cell(value):
        return "–" if value is None else f"{value:.2f}"
    for row in rows:
        kernels = "; ".join(f"`{name[:KERNEL_NAME_CHARS]}` {us:.2f} ({count:.2f})"
                            for name, us, count in row["kernels"])
        lines.append(f"| {trace_label(row['trace'])} | {row['path']} | {row['seeds']} | {row['steps']} | "
                     f"{row['attention_kernel_us']:.2f} | {row['attention_gap_us']:.2f} | "
                     f"{cell(row['attention_span_us'])} | {cell(row.get('other_kernels_extra_us'))} | {kernels} |")
    return "\n".join(lines) + "\n"


def render_other_kernels(rows: list[dict]) -> str:
    """What attention does to the rest of the step: per path, the step's other kernels whose time
    differs most from the step without attention (us a layer, + where slower), by name."""
    lines = ["| Trace | Path | Other kernels' extra, us a layer | Largest differences (us a layer) |",
             "|---|---|---:|---|"]
    for row in rows:
        extra = row.get("other_kernels_extra_us")
        if not row.get("other_kernels") or extra is None:
            continue
        # A label is a kernel's name, or "<name> after <attention kernel>": each name shortened.
        names = "; ".join("`" + AFTER_ATTENTION.join(part[:KERNEL_NAME_CHARS]
                                                     for part in label.split(AFTER_ATTENTION, 1))
                          + f"` {us:+.2f}" for label, us in row["other_kernels"])
        lines.append(f"| {trace_label(row['trace'])} | {row['path']} | {extra:+.2f} | {names} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def render_markdown(report: dict) -> str:
    lines = ["| Trace | Seeds | Table 2 device ratio | Table 2, Table 9's steps | Attention share "
             "| Predicted step ratio | Attention ratio in the graph | Table 9 graph ratio | Ceiling |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for trace, summary in report.items():
        kept = sum(isinstance(row, dict) for row in summary["seeds"].values())
        lines.append(f"| {trace_label(trace)} | {kept} | " + " | ".join(_cell(summary, c) for c in COLUMNS) + " |")
        notes += [f"- {trace_label(trace)}, seed {seed}: left out, {row}"
                  for seed, row in summary["seeds"].items() if isinstance(row, str)]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's artifacts folder, artifacts/<gpu>")
    parser.add_argument("--json", type=Path, help="also write the figures per seed here")

    def run() -> int:
        report, kernels = graph_gain(args.run), kernel_rows(args.run)
        print(render_markdown(report), end="")
        if kernels:
            print("\nAttention's kernels, per layer (pkv.measure.kernel_trace):\n\n" + render_kernels(kernels), end="")
            others = render_other_kernels(kernels)
            if others:
                print("\nThe step's other kernels beside attention, against the step without it:\n\n" + others,
                      end="")
        if args.json is not None:
            write_text_atomic(args.json, json.dumps({"run": str(args.run), "traces": report, "kernels": kernels},
                                                    indent=1) + "\n")
        return 0

    args = parser.parse_args(argv)
    return exit_on_refusal(run)


if __name__ == "__main__":
    sys.exit(main())
