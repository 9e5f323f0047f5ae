"""What the paper reports and the names the tables print: expected rows, method, route, engine and
trace labels, the selected route of a row and its seeds."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

# What the paper reports; rows it names but the artifact lacks are listed as "not run".
PAPER_ISOLATED_CONTEXTS = (8192, 32768, 65536)
PAPER_SERVING_TRACES = ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "bimodal_b4")
PAPER_MLP_TRACES = ("bimodal_b8",)
COUNTER_TRACE = "bimodal_b8"
GQA_TRACE = "bimodal_b8"

ISOLATED_METHOD_ORDER = ("flashinfer", "vllm", "vllm_triton", "persistentkv", "trtllm", "xqa", "sdpa",
                         "reference")
METHOD_LABELS = {
    "flashinfer": "FlashInfer, best path",
    "vllm": "vLLM PagedAttention v2",
    "vllm_triton": "vLLM Triton unified attention",
    "persistentkv": "PersistentKV, auto split",
    "trtllm": "TensorRT-LLM MMHA",
    "xqa": "TensorRT-LLM XQA (via FlashInfer)",
    "sdpa": "Repack + PyTorch SDPA",
    "reference": "PersistentKV reference (torch)",
    "dense": "Dense float64 reference",
}
# What runs a method where its own library cannot (the CPU profile, pkv.engines): method -> the first
# word of the implementation the result records -> (what that is, why it stands in).
STAND_INS = {
    "flashinfer": {"sdpa": ("repack + PyTorch SDPA", "FlashInfer needs a CUDA GPU")},
    "persistentkv": {"reference": ("the torch reference engine on the same plans", "the CUDA kernels need a GPU")},
}
# Methods of the paper's Table 1 that no engine here runs, and why; the table keeps their row.
ABSENT_METHODS = {
    "trtllm": "TensorRT-LLM MMHA not run: its masked multi-head attention kernel is built only inside "
              "TensorRT-LLM's own C++ runtime, which installs with its own CUDA stack and runs no other "
              "engine's page tables; TensorRT-LLM's decode kernel for GQA on Hopper is XQA, which the "
              "row TensorRT-LLM XQA runs on the same pages",
}
ROUTE_LABELS = {
    "flashinfer": "FlashInfer",
    "sdpa": "SDPA (FlashInfer role)",
    "persistentkv_bucket": "PersistentKV bucket",
    "persistentkv_buckets": "PersistentKV bucket",
    "persistentkv_exact": "PersistentKV exact buckets",
    "persistentkv_masked": "PersistentKV masked bucket",
    "persistentkv_workqueue": "PersistentKV workqueue",
    "persistentkv_fused": "PersistentKV fused workqueue",
    "xqa": "TensorRT-LLM XQA",
}
ENGINE_LABELS = {
    "flashinfer": "FlashInfer",
    "xqa": "TensorRT-LLM XQA (via FlashInfer)",
    "sdpa": "SDPA (FlashInfer role)",
    "adaptive": "Adaptive route",
    "persistentkv": "PersistentKV",
    "reference": "PersistentKV reference",
}
_FAMILY_LABELS = {
    "bucketed": "Bucketed",
    "bimodal": "Bimodal",
    "uniform": "Uniform",
    "zipf": "Zipf",
    "homogeneous": "Homogeneous",
    "skewed": "Skewed",
}


def trace_label(name: str) -> str:
    """"bimodal_b8" -> "Bimodal B8"; a replayed request file keeps its own name: "fixture_mixed B8"."""
    m = re.fullmatch(r"(.+)_b(\d+)", name)
    if not m:
        return name
    return f"{_FAMILY_LABELS.get(m.group(1), m.group(1))} B{m.group(2)}"


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def route_label(route: str | None, num_splits: Any = None) -> str:
    if not route:
        return "unknown route"
    label = ROUTE_LABELS.get(route, route)
    if route.startswith("persistentkv") and isinstance(num_splits, int) and not isinstance(num_splits, bool):
        label += f", split {num_splits}"
    return label


def selected_route(subjects: list[dict]) -> tuple[str | None, str]:
    """(most common raw route, display text with split and how many seeds agree)."""
    routes = []
    for rec in subjects:
        m = rec.get("metrics") or {}
        routes.append((m.get("selected_route"), m.get("num_splits")))
    if not routes:
        return None, ""
    (route, splits), count = Counter(routes).most_common(1)[0]
    text = route_label(route, splits)
    if count < len(routes):
        text += f" ({count}/{len(routes)} seeds)"
    # Steps a calibrated rule moved off the fixed split count (the skew and over-split rules' balanced steps).
    rules: Counter = Counter()
    for rec in subjects:
        rules.update((rec.get("metrics") or {}).get("split_rules") or {})
    total = sum(rules.values())
    for rule, n in sorted(rules.items()):
        if rule != "fixed":
            text += f"; {rule} on {n} of {total} workqueue steps"
    return route, text


def other_routes(subjects: list[dict], selected: str | None) -> str:
    """Table 2's route cell after selected_route: each route other than ``selected`` that the runs'
    steps took, with its steps over the seeds ("; FlashInfer on 12 of 320 steps"), so a row whose
    steps the context gate split between routes names both; "" where every step took one route
    (or the records do not count steps by route)."""
    routes: Counter = Counter()
    for rec in subjects:
        routes.update((rec.get("metrics") or {}).get("routes") or {})
    total = sum(routes.values())
    return "".join(f"; {route_label(route)} on {n} of {total} steps"
                   for route, n in sorted(routes.items()) if route != selected and n)


def routes_taken(subjects: list[dict]) -> str:
    """A row's route cell (Tables 2 and 9): selected_route's text, then other_routes'."""
    selected, text = selected_route(subjects)
    return text + other_routes(subjects, selected)


def seeds_phrase(text: str) -> str:
    """seeds_text with its noun: "seed 20260623", "seeds 20260623–20260627", "no seeds"."""
    if text == "none":
        return "no seeds"
    return f"seed {text}" if text.isdigit() else f"seeds {text}"


def seeds_text(seeds: Iterable[int]) -> str:
    seeds = sorted(set(seeds))
    if not seeds:
        return "none"
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)


def ordered(found: Iterable[str], expected: Iterable[str]) -> list[str]:
    """The expected names that were found, in their order, then the others found, sorted."""
    found = list(found)
    expected = list(expected)
    return [t for t in expected if t in found] + sorted(t for t in found if t not in expected)


def paper_then_found(expected: Iterable[str], found: Iterable[str]) -> list[str]:
    """Every name the paper reports (found or not, so absent ones show as not run), then the others found, sorted."""
    expected = list(expected)
    return expected + sorted(set(found) - set(expected))
