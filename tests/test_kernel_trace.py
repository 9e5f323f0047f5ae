"""Kernel traces of a step (pkv.measure.kernel_trace): the busy time of overlapping kernels, a
path's tally per step, its attention kernels told from its rest's, the model step's record of them
(on the CPU, why there is none), and (GPU) a graph replay's kernels one by one."""

from __future__ import annotations

import pytest
import torch

from pkv.measure.kernel_trace import (
    KernelSpan,
    KernelTally,
    KernelTraceUnavailable,
    attention_profile,
    trace_kernels,
)


def _spans(*triples):
    return [KernelSpan(name, start, end) for name, start, end in triples]


def test_busy_time_is_the_union_of_the_kernels():
    tally = KernelTally()
    # a gap of 2 between b and c; d starts inside c (a prologue overlapping) and outlasts it
    tally.add(_spans(("a", 0, 3), ("b", 3, 5), ("c", 7, 10), ("d", 9, 12), ("e", 10, 11)))
    record = tally.record()
    assert record["span_us_per_step"] == pytest.approx(12)
    assert record["busy_us_per_step"] == pytest.approx(3 + 2 + 5)
    assert record["idle_us_per_step"] == pytest.approx(2)


def test_a_tally_is_per_step_and_attention_is_what_the_rest_does_not_run():
    path, rest = KernelTally(), KernelTally()
    for offset in (0, 100):
        path.add(_spans(("gemm", offset, offset + 10), ("decode", offset + 11, offset + 15),
                        ("merge", offset + 16, offset + 17), ("gemm", offset + 18, offset + 28)))
        rest.add(_spans(("gemm", offset, offset + 10), ("gemm", offset + 11, offset + 21)))
    record = attention_profile(path, rest)
    assert record["steps"] == 2
    assert record["span_us_per_step"] == pytest.approx(28)
    assert record["busy_us_per_step"] == pytest.approx(25)
    assert record["idle_us_per_step"] == pytest.approx(3)
    assert list(record["kernels"]) == ["gemm", "decode", "merge"]  # most time first
    assert record["kernels"]["gemm"] == {"us_per_step": 20, "count_per_step": 2, "attention": False}
    assert record["kernels"]["decode"]["attention"] and record["kernels"]["merge"]["attention"]
    assert record["attention_kernel_us_per_step"] == pytest.approx(5)
    # 1 us before the decode, between decode and merge, and after the merge
    assert {(g["previous"], g["next"]): g["us_per_step"] for g in record["gaps"]} == {
        ("gemm", "decode"): 1, ("decode", "merge"): 1, ("merge", "gemm"): 1}
    assert record["attention_gap_us_per_step"] == pytest.approx(3)
    # the span attention adds: its 5 us of kernels and 3 us of gaps around them, less the 1 us gap
    # the rest has between its two GEMMs
    assert record["rest_span_us_per_step"] == pytest.approx(21)
    assert record["attention_span_us_per_step"] == pytest.approx(7)
    # the GEMMs take the same time with attention between them as without it
    assert record["other_kernels_extra_us_per_step"] == pytest.approx(0)
    assert record["other_kernels_extra"] == {"gemm": pytest.approx(0), "gemm after merge": pytest.approx(0)}
    with pytest.raises(ValueError, match="at least one kernel"):
        path.add([])


def test_the_kernel_after_attention_is_told_apart_from_the_same_kernel_elsewhere():
    path, rest = KernelTally(), KernelTally()
    for offset, slower in ((0, 2), (100, 4)):
        # the GEMM right after the merge runs slower than its counterpart in the rest; the first
        # GEMM of the step, the same kernel, does not
        path.add(_spans(("gemm", offset, offset + 10), ("decode", offset + 10, offset + 14),
                        ("merge", offset + 14, offset + 15), ("gemm", offset + 15, offset + 25 + slower)))
        rest.add(_spans(("gemm", offset, offset + 10), ("gemm", offset + 10, offset + 20)))
    record = attention_profile(path, rest)
    assert record["other_kernels_aligned"]
    assert record["other_kernels_extra"] == {"gemm after merge": pytest.approx(3), "gemm": pytest.approx(0)}
    assert record["other_kernels_extra_us_per_step"] == pytest.approx(3)
    # span added (5 us of attention, 3 us more GEMM) = kernels + gaps + the other kernels' extra
    assert record["attention_span_us_per_step"] == pytest.approx(8)


def test_steps_that_do_not_line_up_are_compared_by_name():
    path, rest = KernelTally(), KernelTally()
    # the norm runs only in the rest: no one-to-one order, so each name's time over the step
    path.add(_spans(("gemm", 0, 10), ("decode", 10, 14), ("gemm", 14, 26)))
    rest.add(_spans(("gemm", 0, 10), ("norm", 10, 11), ("gemm", 11, 21)))
    record = attention_profile(path, rest)
    assert not record["other_kernels_aligned"]
    assert record["attention_kernel_us_per_step"] == pytest.approx(4)
    assert record["attention_span_us_per_step"] == pytest.approx(5)
    assert record["other_kernels_extra"] == {"gemm": pytest.approx(2), "norm": pytest.approx(-1)}
    assert record["other_kernels_extra_us_per_step"] == pytest.approx(1)


def test_a_gap_is_idle_time_only():
    tally = KernelTally()
    # b starts inside a (an overlapping prologue): no gap; c starts 2 us after the later end (b's)
    tally.add(_spans(("a", 0, 10), ("b", 8, 12), ("c", 14, 15)))
    gaps = {(g["previous"], g["next"]): g["us_per_step"] for g in tally.record()["gaps"]}
    assert gaps == {("a", "b"): 0.0, ("b", "c"): 2.0}


def test_without_a_rest_every_kernel_counts_as_attention():
    path = KernelTally()
    path.add(_spans(("decode", 0, 4)))
    record = attention_profile(path, None)
    assert record["attention_kernel_us_per_step"] == 4 and "attention_span_us_per_step" not in record


def test_no_kernel_trace_on_the_cpu():
    with pytest.raises(KernelTraceUnavailable, match="cpu device"):
        trace_kernels(lambda: None, "cpu")


def test_a_model_step_asked_for_kernel_traces_on_the_cpu_says_why_it_has_none():
    from test_model_step_wrong_baseline import BASELINE, SHAPE, _eager, _paths, _run, _studied_engine

    from pkv.engines.sdpa import SdpaEngine

    make = _paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")), _eager("adaptive_eager", _studied_engine()))
    plain = _run(make)
    traced = _run(make, kernel_profile_steps=2)
    for label in plain:
        assert "kernel_profile" not in plain[label]
        assert traced[label]["kernel_profile"] == {"skipped": "not available: no kernel trace on a cpu device"}
        # the same steps timed and checked either way
        assert [s["step"] for s in traced[label]["per_step"]] == [s["step"] for s in plain[label]["per_step"]]
        assert traced[label]["max_rel_err_vs_baseline"] == pytest.approx(plain[label]["max_rel_err_vs_baseline"])


def test_a_model_step_traced_from_outside_runs_each_profiled_step_in_its_nvtx_range(monkeypatch):
    """kernel_profiler "external": each profiled step runs once more per rest and path inside its
    NVTX range, for a profiler around the run (ncu) to filter on, and the record says where."""
    from test_model_step_wrong_baseline import BASELINE, SHAPE, _eager, _paths, _run, _studied_engine

    from pkv.engines.sdpa import SdpaEngine
    from pkv.measure import model_step_run

    ranges = []
    real = model_step_run.nvtx_range
    monkeypatch.setattr(model_step_run, "nvtx_range", lambda name: ranges.append(name) or real(name))
    make = _paths(_eager(BASELINE, SdpaEngine(SHAPE.attention, "cpu")), _eager("adaptive_eager", _studied_engine()))
    plain = _run(make)
    marked = _run(make, kernel_profile_steps=2, kernel_profiler="external")
    # Each profiled step: the rest, then both paths in that step's timed order (which rotates), so
    # the pages the next step reads are the ones an unprofiled run leaves: the errors below agree.
    assert len(ranges) == 6
    for first in (0, 3):
        assert ranges[first] == "trace_rest_eager"
        assert sorted(ranges[first + 1:first + 3]) == sorted([f"trace_{BASELINE}", "trace_adaptive_eager"])
    assert ranges[1:3] != ranges[4:6]
    for label in plain:
        assert marked[label]["kernel_profile"] == {
            "skipped": f"traced by a profiler around the run, in NVTX ranges trace_{label} and trace_rest_eager "
                       "(domain pkv)"}
        assert [s["step"] for s in marked[label]["per_step"]] == [s["step"] for s in plain[label]["per_step"]]
        assert marked[label]["max_rel_err_vs_baseline"] == pytest.approx(plain[label]["max_rel_err_vs_baseline"])
    with pytest.raises(ValueError, match="kernel_profiler must be one of"):
        _run(make, kernel_profile_steps=1, kernel_profiler="nsys")


@pytest.mark.gpu
def test_a_graph_replay_is_traced_kernel_by_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a = torch.randn(512, 512, device="cuda")
    out = torch.empty_like(a)

    def step():
        torch.mm(a, a, out=out)
        out.exp_()

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    eager = trace_kernels(step, "cuda")
    replayed = trace_kernels(graph.replay, "cuda")
    assert len(replayed) >= 2, replayed  # the matmul's kernel and the exp's, one by one
    assert {s.name for s in replayed} <= {s.name for s in eager}, (replayed, eager)
    tally = KernelTally()
    tally.add(replayed)
    assert 0 < tally.record()["busy_us_per_step"] <= tally.record()["span_us_per_step"]
