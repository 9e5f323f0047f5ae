"""FlashInferEngine's best-path pick, on the CPU with a stand-in flashinfer module.

The engine's own kernels need a GPU; what is tested here is the probe bookkeeping: one probe per
batch class for every best-of engine of the process, so the baseline and the adaptive engine's
fallback run the same FlashInfer path on the same steps, and each path's times are recorded.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pkv.engines import flashinfer as fi
from pkv.shape import ModelShape


class _Wrapper:
    """Counts plan() and run() calls; run() advances a clock by the path's decode time."""

    def __init__(self, workspace, kv_layout, use_tensor_cores, backend=None):
        self.path = "fa3" if backend == "fa3" else ("tc" if use_tensor_cores else "cc")
        self.plans = 0
        self.runs = 0

    def plan(self, *args, **kwargs):
        self.plans += 1

    def run(self, q, kv):
        self.runs += 1
        _Clock.now_us += _Clock.decode_us[self.path]
        return q


class _Holistic(_Wrapper):
    def __init__(self, kv_layout, device):
        self.path, self.plans, self.runs = "holistic", 0, 0
        self.kv_len = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, *args, **kwargs):
        self.plans += 1
        self.kv_len = kv_len.tolist()

    def run(self, q, kv):
        return super().run(q, kv), None


class _Clock:
    now_us = 0.0
    decode_us = {"tc": 10.0, "cc": 12.0, "holistic": 13.0, "fa3": 40.0}


class _Flusher:
    """The probe's L2 eviction: a no-op, counted."""

    flushes = 0

    def flush(self):
        _Flusher.flushes += 1


class _Queue:
    """QueuedReps' device operations on the stand-in clock: every repetition is queued in time."""

    def event(self):
        return _Event(enable_timing=True)

    def hold(self, cycles):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, enable_timing=False):
        self.at_us = None

    def record(self):
        self.at_us = _Clock.now_us

    def synchronize(self):
        pass

    def query(self):  # the device has not reached it: the host queued the repetition in time
        return False

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event
        return (end.at_us - self.at_us) / 1e3


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(__version__="fake", BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
                                   BatchAttention=_Holistic)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi, "_allocate_workspace", lambda device: None)
    monkeypatch.setattr(fi, "_upload", lambda tensor, device: tensor)
    monkeypatch.setattr(fi, "_probe_flusher", lambda device: _Flusher())
    monkeypatch.setattr(fi, "_probe_queue", lambda device: _Queue())
    monkeypatch.setattr(fi, "_PATH_PICKS", {})
    monkeypatch.setattr(fi, "_PATH_PROBES", {})
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(_Clock, "decode_us", {"tc": 10.0, "cc": 12.0, "holistic": 13.0, "fa3": 40.0})
    return module


def _inputs(dtype=torch.float16):
    q = torch.zeros(2, 32, 128, dtype=dtype)
    k = torch.zeros(64, 8, 16, 128, dtype=dtype)
    return q, k, k.clone()


def _probe_runs(engine):
    return sum(getattr(p, "wrapper").runs for p in engine._paths.values())


def test_second_engine_reuses_the_first_engines_pick(fake_flashinfer, make_step):
    baseline = fi.FlashInferEngine(ModelShape(), device="cuda")
    fallback = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([3000, 1000])
    q, k, v = _inputs()

    baseline.prepare(step, q, k, v)
    # every path: two untimed runs, then its rounds
    assert _probe_runs(baseline) == 3 * (fi.PROBE_ROUNDS * fi.PROBE_REPS + 2)
    fallback.prepare(step, q, k, v)
    assert _probe_runs(fallback) == 0  # no second probe that could pick the other path

    assert baseline.plan(step).kernel_variant == "tc"  # the faster stand-in
    assert fallback.plan(step).kernel_variant == "tc"
    assert fallback.choices == baseline.choices == {fi.probe_key(step): "tc"}


def test_pick_follows_the_faster_variant(fake_flashinfer, monkeypatch, make_step):
    monkeypatch.setattr(_Clock, "decode_us", {"tc": 15.0, "cc": 11.0, "holistic": 14.0, "fa3": 40.0})
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
        assert _probe_runs(engine) - before == 3 * (fi.PROBE_ROUNDS * fi.PROBE_REPS + 2)


def test_pinned_variant_never_probes(fake_flashinfer, make_step):
    engine = fi.FlashInferEngine(ModelShape(), paths=("cc",), device="cuda")
    step = make_step([3000])
    engine.prepare(step, *_inputs())
    assert _probe_runs(engine) == 0
    assert engine.plan(step).kernel_variant == "cc"


def test_a_tie_goes_to_the_cheaper_plan():
    measured = {"tc": {"device_us": 100.0, "plan_us": 90.0},
                "holistic": {"device_us": 99.5, "plan_us": 400.0},
                "cc": {"device_us": 130.0, "plan_us": 80.0}}
    assert fi.pick_path(measured) == "tc"  # holistic is 0.5% faster: within noise, plan 4x dearer
    measured["holistic"]["device_us"] = 90.0
    assert fi.pick_path(measured) == "holistic"  # 10% faster wins whatever its plan costs


def test_a_tie_on_the_plan_too_goes_to_the_faster_kernel_whichever_plan_was_timed_cheaper():
    # cc and tc within 2% on the device and within 10% on the plan: the faster decode, every time
    for cc_plan, tc_plan in ((250.0, 240.0), (240.0, 250.0)):
        measured = {"cc": {"device_us": 100.0, "plan_us": cc_plan},
                    "tc": {"device_us": 101.0, "plan_us": tc_plan},
                    "holistic": {"device_us": 99.5, "plan_us": 400.0}}  # faster, but its plan is dearer
        assert fi.pick_path(measured) == "cc"
    # a plan clearly cheaper (by more than PLAN_TIE_FRACTION) still takes the tie
    measured["tc"]["plan_us"] = 200.0
    assert fi.pick_path(measured) == "tc"


def test_the_record_names_every_path_and_its_times(fake_flashinfer, make_step):
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([3000, 1000])
    engine.prepare(step, *_inputs())
    record = engine.path_record()
    assert set(record["paths"]) == {"cc", "tc", "holistic"} and record["missing_paths"] == {}
    (probe,) = record["probed"]
    assert probe["picked"] == "tc" and (probe["batch"], probe["longest_pow2"]) == fi.probe_key(step)
    assert {p: m["device_us"] for p, m in probe["measured"].items()} == pytest.approx(
        {"tc": 10.0, "cc": 12.0, "holistic": 13.0})
    assert all(m["plan_us"] >= 0 for m in probe["measured"].values())
    assert all(m["rounds_us"] == pytest.approx([m["device_us"]] * fi.PROBE_ROUNDS) for m in probe["measured"].values())


def test_every_timed_probe_run_comes_after_an_l2_eviction(fake_flashinfer, monkeypatch, make_step):
    monkeypatch.setattr(_Flusher, "flushes", 0)
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    engine.prepare(make_step([3000, 1000]), *_inputs())
    assert _Flusher.flushes == 3 * fi.PROBE_ROUNDS * fi.PROBE_REPS


def test_a_slow_start_of_the_probe_does_not_pick_against_the_path_timed_first(fake_flashinfer, monkeypatch, make_step):
    # cc is 5% faster, but the first timed runs of the probe (a clock still rising, caches still cold)
    # are 30% slower: timed path by path, cc would take all of that and lose; timed in alternating
    # rounds with each path's median, it takes one slow round of five and wins.
    monkeypatch.setattr(_Clock, "decode_us", {"tc": 10.0, "cc": 9.5, "holistic": 13.0, "fa3": 40.0})
    runs = {"count": 0}
    fast_run = _Wrapper.run

    def slow_start(self, q, kv):
        runs["count"] += 1
        warm_runs = 2 * 3  # two untimed runs per path come first
        if warm_runs < runs["count"] <= warm_runs + fi.PROBE_REPS:
            _Clock.now_us += 0.3 * _Clock.decode_us[self.path]
        return fast_run(self, q, kv)

    monkeypatch.setattr(_Wrapper, "run", slow_start)
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([3000, 1000])
    engine.prepare(step, *_inputs())
    (probe,) = engine.path_record()["probed"]
    assert probe["measured"]["cc"]["rounds_us"][0] == pytest.approx(9.5 * 1.3)
    assert probe["measured"]["cc"]["device_us"] == pytest.approx(9.5)
    assert probe["picked"] == "cc"


def test_a_graph_without_the_picked_path_runs_the_faster_of_the_paths_it_has(fake_flashinfer, monkeypatch,
                                                                             make_step):
    # holistic wins the probe, but FlashInfer's graph wrapper runs fa2 only: the faster fa2 path by
    # the same probe (cc here), not tensor cores whatever they measured
    monkeypatch.setattr(_Clock, "decode_us", {"tc": 15.0, "cc": 11.0, "holistic": 8.0, "fa3": 40.0})
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([5000])
    assert engine.path_among(step, fi.GRAPH_PATHS) is None  # nothing probed yet
    engine.prepare(step, *_inputs())
    assert engine.path_for(step) == "holistic"
    assert engine.path_among(step, fi.GRAPH_PATHS) == "cc"
    assert engine.path_among(step, fi.PATHS) == "holistic"
    pinned = fi.FlashInferEngine(ModelShape(), paths=("tc",), device="cuda")
    assert pinned.path_among(step, fi.GRAPH_PATHS) == "tc"


def test_holistic_plans_the_token_lengths_of_the_step(fake_flashinfer, make_step):
    engine = fi.FlashInferEngine(ModelShape(), paths=("holistic",), device="cuda")
    step = make_step([3000, 17, 16, 1])
    q, k, v = _inputs()
    engine.run(q, k, v, engine.plan(step))
    assert engine._paths["holistic"].wrapper.kv_len == [3000, 17, 16, 1]


def test_a_flashinfer_without_batch_attention_runs_the_other_paths(fake_flashinfer, monkeypatch, make_step):
    monkeypatch.delattr(fake_flashinfer, "BatchAttention")
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    assert set(engine._paths) == {"cc", "tc"}
    assert "no BatchAttention" in engine.path_record()["missing_paths"]["holistic"]
    with pytest.raises(fi.EngineUnavailable, match="no BatchAttention"):
        fi.FlashInferEngine(ModelShape(), paths=("holistic",), device="cuda")


def test_fa3_is_a_pinned_path_only(fake_flashinfer, make_step):
    engine = fi.FlashInferEngine(ModelShape(), paths=("fa3",), device="cuda", name="flashinfer_fa3")
    assert engine.plan(make_step([3000])).kernel_variant == "fa3"
    assert "fa3" not in fi.PATHS
    with pytest.raises(ValueError, match="known paths"):
        fi.FlashInferEngine(ModelShape(), paths=("fa4",), device="cuda")


@pytest.mark.parametrize("role", ["flashinfer", "flashinfer_cc", "flashinfer_tc", "flashinfer_holistic",
                                  "flashinfer_fa3", "xqa"])
def test_baseline_roles_name_why_they_cannot_run_on_the_cpu(role):
    from pkv.engines import EngineUnavailable, build_engine

    if role == "flashinfer":
        # The CPU profile's FlashInfer role is its stand-in, repack + SDPA.
        assert build_engine(role, shape=ModelShape(), device="cpu").implementation.startswith("sdpa")
        return
    with pytest.raises(EngineUnavailable, match="CUDA device"):
        build_engine(role, shape=ModelShape(), device="cpu")


def test_xqa_without_the_entry_point_says_which_flashinfer_has_it(monkeypatch):
    from pkv.engines import xqa

    flashinfer = types.ModuleType("flashinfer")
    flashinfer.__version__ = "0.5.3"
    flashinfer.decode = types.ModuleType("flashinfer.decode")
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", flashinfer.decode)
    with pytest.raises(fi.EngineUnavailable, match=r"flashinfer 0\.5\.3 has no .*xqa.*>= 0\.7"):
        xqa._import_xqa()


class _OverflowingHolistic(_Holistic):
    """BatchAttention whose plan needs ``need`` bytes of float workspace and raises as FlashInfer
    0.7.2's allocator does when it gets less."""

    need = 5 * 1024

    def __init__(self, kv_layout, device):
        super().__init__(kv_layout, device)
        self.float_workspace_buffer = torch.empty(1024, dtype=torch.uint8)

    def plan(self, *args, **kwargs):
        have = self.float_workspace_buffer.numel()
        if have < self.need:
            raise RuntimeError(f"Error in function 'aligned_alloc': Buffer overflow when allocating memory for "
                               f"holistic_partial_o with size {self.need} and alignment 16, but only {have} bytes "
                               f"available in AlignedAllocator")
        super().plan(*args, **kwargs)


def test_holistic_plan_grows_its_workspace_until_the_plan_fits(fake_flashinfer, make_step, monkeypatch):
    monkeypatch.setattr(fake_flashinfer, "BatchAttention", _OverflowingHolistic)
    engine = fi.FlashInferEngine(ModelShape(), paths=("holistic",), device="cuda")
    q, k, v = _inputs()
    engine.run(q, k, v, engine.plan(make_step([3000, 1000])))
    wrapper = engine._paths["holistic"].wrapper
    assert wrapper.plans == 1 and wrapper.float_workspace_buffer.numel() == 8 * 1024  # 1K doubled to cover 5K


def test_holistic_plan_error_stands_past_the_workspace_limit_or_for_other_errors(fake_flashinfer, make_step,
                                                                                monkeypatch):
    monkeypatch.setattr(fake_flashinfer, "BatchAttention", _OverflowingHolistic)
    monkeypatch.setattr(fi, "HOLISTIC_WORKSPACE_LIMIT", 4 * 1024)
    engine = fi.FlashInferEngine(ModelShape(), paths=("holistic",), device="cuda")
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="Buffer overflow"):
        engine.run(q, k, v, engine.plan(make_step([3000, 1000])))
    assert engine._paths["holistic"].wrapper.float_workspace_buffer.numel() == 4 * 1024

    monkeypatch.setattr(_OverflowingHolistic, "plan", lambda self, *a, **k: (_ for _ in ()).throw(
        RuntimeError("some other failure")))
    with pytest.raises(RuntimeError, match="some other failure"):
        engine.run(q, k, v, engine.plan(make_step([3000, 1000])))


def test_a_path_that_cannot_plan_a_batch_is_left_out_of_the_pick_with_its_reason(fake_flashinfer, make_step,
                                                                                 monkeypatch):
    monkeypatch.setattr(fake_flashinfer, "BatchAttention", _OverflowingHolistic)
    monkeypatch.setattr(fi, "HOLISTIC_WORKSPACE_LIMIT", 2 * 1024)
    monkeypatch.setattr(_Clock, "decode_us", {"tc": 10.0, "cc": 12.0, "holistic": 5.0, "fa3": 40.0})
    engine = fi.FlashInferEngine(ModelShape(), device="cuda")
    step = make_step([3000, 1000])
    q, k, v = _inputs()
    engine.prepare(step, q, k, v)
    assert engine.path_for(step) == "tc"  # holistic would be fastest, but it could not plan
    (probe,) = engine.path_record()["probed"]
    assert "Buffer overflow" in probe["measured"]["holistic"]["error"]
    assert set(probe["measured"]["tc"]) == {"device_us", "plan_us", "rounds_us"}


def test_no_path_that_can_plan_a_batch_is_an_error_naming_each_reason():
    with pytest.raises(RuntimeError, match="no path ran this batch: holistic: too big; tc: too small"):
        fi.pick_path({"holistic": {"error": "too big"}, "tc": {"error": "too small"}})
