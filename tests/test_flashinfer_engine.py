"""FlashInferEngine's best-of-both variant pick, on the CPU with a stand-in flashinfer module.

The engine's own kernels need a GPU; what is tested here is the probe bookkeeping: one probe per
batch class for every best-of-both engine of the process, so the baseline and the adaptive
engine's fallback run the same FlashInfer path on the same steps.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pkv.engines import flashinfer as fi
from pkv.shape import ModelShape


class _Wrapper:
    """Counts plan() and run() calls; run() advances a clock by the variant's decode time."""

    def __init__(self, workspace, kv_layout, use_tensor_cores):
        self.tc = use_tensor_cores
        self.plans = 0
        self.runs = 0

    def plan(self, *args, **kwargs):
        self.plans += 1

    def run(self, q, kv):
        self.runs += 1
        _Clock.now_us += _Clock.decode_us[self.tc]
        return q


class _Clock:
    now_us = 0.0
    decode_us = {True: 10.0, False: 12.0}


class _Event:
    def __init__(self, enable_timing=False):
        self.at_us = None

    def record(self):
        self.at_us = _Clock.now_us

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event
        return (end.at_us - self.at_us) / 1e3


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(__version__="fake", BatchDecodeWithPagedKVCacheWrapper=_Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi, "_allocate_workspace", lambda device: None)
    monkeypatch.setattr(fi, "_VARIANT_PICKS", {})
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(_Clock, "decode_us", {True: 10.0, False: 12.0})
    return module


def _inputs(dtype=torch.float16):
    q = torch.zeros(2, 32, 128, dtype=dtype)
    k = torch.zeros(64, 8, 16, 128, dtype=dtype)
    return q, k, k.clone()


def _probe_runs(engine):
    return sum(w.runs for w in engine._wrappers.values())


def test_second_engine_reuses_the_first_engines_pick(fake_flashinfer, make_step):
    baseline = fi.FlashInferEngine(ModelShape(), device="cuda")
    fallback = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([3000, 1000])
    q, k, v = _inputs()

    baseline.prepare(step, q, k, v)
    assert _probe_runs(baseline) == 2 * (fi.PROBE_REPS + 1)  # both variants, warm run + timed reps
    fallback.prepare(step, q, k, v)
    assert _probe_runs(fallback) == 0  # no second probe that could pick the other path

    assert baseline.plan(step).kernel_variant == "tc"  # the faster stand-in
    assert fallback.plan(step).kernel_variant == "tc"
    assert fallback.choices == baseline.choices == {fi.probe_key(step): True}


def test_pick_follows_the_faster_variant(fake_flashinfer, monkeypatch, make_step):
    monkeypatch.setattr(_Clock, "decode_us", {True: 15.0, False: 11.0})
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([5000])
    engine.prepare(step, *_inputs())
    assert engine.plan(step).kernel_variant == "cc"


def test_picks_are_kept_apart_by_dtype_shape_and_batch_class(fake_flashinfer, make_step):
    fp16 = fi.FlashInferEngine(ModelShape(), device="cuda")
    bf16 = fi.FlashInferEngine(ModelShape(), device="cuda")
    group1 = fi.FlashInferEngine(ModelShape(num_qo_heads=32, num_kv_heads=32), device="cuda")
    step, longer = make_step([3000, 1000]), make_step([9000, 1000])

    fp16.prepare(step, *_inputs(torch.float16))
    for engine, other_step, dtype in ((bf16, step, torch.bfloat16), (group1, step, torch.float16),
                                      (fp16, longer, torch.float16)):
        before = _probe_runs(engine)
        q, k, v = _inputs(dtype)
        if engine is group1:
            k = v = torch.zeros(64, 32, 16, 128, dtype=dtype)
        engine.prepare(other_step, q, k, v)
        assert _probe_runs(engine) - before == 2 * (fi.PROBE_REPS + 1)


def test_pinned_variant_never_probes(fake_flashinfer, make_step):
    engine = fi.FlashInferEngine(ModelShape(), use_tensor_cores=False, device="cuda")
    step = make_step([3000])
    engine.prepare(step, *_inputs())
    assert _probe_runs(engine) == 0
    assert engine.plan(step).kernel_variant == "cc"
