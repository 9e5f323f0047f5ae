"""Timing helpers, NVTX ranges, the MLP tail and accuracy metrics on the CPU."""

import math
import time

import pytest
import torch

from pkv.measure.accuracy import AccuracyError, check_within, compare, require_within
from pkv.measure.mlp_tail import GatedMLPTail
from pkv.measure.nvtx_ranges import nvtx_range
from pkv.shape import ModelShape
from pkv.measure.timing import DeviceTimer, L2Flusher, TimingStats, WallTimer, summarize_us, time_device_us


def test_time_device_us_measures_cpu_work():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    stats = time_device_us(work, reps=5, warmup=2, device="cpu")
    assert isinstance(stats, TimingStats)
    assert len(calls) == 7 and stats.n == 5
    assert 1500 < stats.median_us < 200_000
    assert stats.p10_us <= stats.median_us <= stats.p90_us


def test_time_device_us_flushes_before_every_rep():
    flushes = []

    class CountingFlusher:
        device = torch.device("cpu")

        def flush(self):
            flushes.append(1)

    time_device_us(lambda: None, reps=4, warmup=1, flusher=CountingFlusher())
    assert len(flushes) == 4


def test_summarize_percentiles():
    stats = summarize_us([float(x) for x in range(1, 12)])
    assert stats.median_us == 6 and stats.p10_us == 2 and stats.p90_us == 10
    assert stats.mean_us == 6
    with pytest.raises(ValueError):
        summarize_us([])
    with pytest.raises(ValueError, match="reps"):
        time_device_us(lambda: None, reps=0)


def test_l2_flusher_is_a_noop_on_cpu():
    flusher = L2Flusher("cpu")
    assert flusher.buffer is None
    flusher.flush()


def test_wall_and_device_timers_on_cpu():
    with WallTimer("cpu") as wall:
        with DeviceTimer("cpu") as device:
            time.sleep(0.003)
    assert wall.elapsed_us >= device.elapsed_us >= 2500


def test_nvtx_range_refuses_nesting_separator():
    with pytest.raises(ValueError, match="/"):
        with nvtx_range("a/b"):
            pass
    with pytest.raises(ValueError):
        with nvtx_range(""):
            pass
    entered = []
    with nvtx_range("reference_decode"):
        entered.append(True)
    assert entered


def test_gated_mlp_tail_shapes_and_math():
    shape = ModelShape(num_qo_heads=4, num_kv_heads=2, head_dim=8)
    tail = GatedMLPTail(hidden=32, intermediate=48, dtype="float64", device="cpu", seed=3)
    x = torch.randn(5, shape.num_qo_heads, shape.head_dim, dtype=torch.float64)
    y = tail(x)
    assert y.shape == (5, 32)
    flat = x.reshape(5, 32)
    expected = (torch.nn.functional.silu(flat @ tail.gate.T) * (flat @ tail.up.T)) @ tail.down.T
    torch.testing.assert_close(y, expected)
    with pytest.raises(ValueError, match="hidden=32"):
        tail(torch.randn(5, 3, 8, dtype=torch.float64))


def test_compare_and_bounds():
    ref = torch.ones(2, 3, 4)
    errors = compare(ref + 1e-4, ref)
    assert math.isclose(errors["max_abs_err"], 1e-4, rel_tol=1e-2)
    assert check_within(errors)
    assert not check_within(compare(ref + 3e-3, ref))
    poisoned = ref.clone()
    poisoned[0, 0, 0] = float("nan")
    assert not check_within(compare(poisoned, ref))
    with pytest.raises(AccuracyError, match="engine x"):
        require_within(compare(ref + 1.0, ref), "engine x")
    with pytest.raises(ValueError, match="shape"):
        compare(ref[:1], ref)


def test_model_shape_validation():
    assert ModelShape().group_size == 4
    assert math.isclose(ModelShape().sm_scale, 128 ** -0.5)
    with pytest.raises(ValueError, match="divisible"):
        ModelShape(num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape(head_dim=0)


def test_time_interleaved_us_rotates_the_order_and_keeps_round_medians():
    from pkv.measure.timing import time_interleaved_us

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    medians = time_interleaved_us(fns, rounds=3, reps=2, device="cpu")
    assert set(medians) == {"a", "b", "c"} and all(len(v) == 3 for v in medians.values())
    # one warmup and two timed calls per callable per round; who goes first rotates
    firsts = [calls[i * 9] for i in range(3)]
    assert firsts == ["a", "b", "c"]
    slow = time_interleaved_us({"slow": lambda: time.sleep(0.002), "fast": lambda: None}, rounds=2, reps=3,
                               device="cpu")
    assert min(slow["slow"]) > max(slow["fast"])
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved_us(fns, rounds=0)


class _ScriptedQueue:
    """A device queue whose start events report, in turn, whether the device had reached them by
    the time the host queued the matching end event (True: the repetition was caught)."""

    def __init__(self, reached):
        self.reached = list(reached)
        self.log = []

    def event(self):
        queue = self

        class Event:
            def __init__(self):
                self.index = None

            def record(self):
                queue.log.append("record")
                self.index = sum(1 for entry in queue.log if entry == "record")

            def query(self):
                return queue.reached.pop(0) if queue.reached else False

            def elapsed_time(self, end):
                return end.index / 1000  # ms: the end event's record count, a rep's fingerprint

        return Event()

    def hold(self, cycles):
        self.log.append(("hold", cycles))

    def synchronize(self):
        self.log.append("sync")


def _holds(log):
    return [entry[1] for entry in log if isinstance(entry, tuple)]


def test_queued_reps_hold_once_while_the_host_stays_ahead():
    from pkv.measure.timing import QueuedReps

    queue = _ScriptedQueue(reached=[])
    samples = QueuedReps(queue).time(lambda: None, 5)
    assert len(samples) == 5
    assert _holds(queue.log) == [QueuedReps.FIRST_HOLD_CYCLES]


def test_queued_reps_time_a_caught_repetition_again_behind_a_hold():
    from pkv.measure.timing import QueuedReps

    # rep 3 (unheld) is caught: it is dropped, every later rep is held, and a second round times
    # one more; its hold stays the same length, since the caught rep had none
    queue = _ScriptedQueue(reached=[False, False, True, False, False])
    timer = QueuedReps(queue)
    samples = timer.time(lambda: None, 5)
    assert len(samples) == 5 and timer.caught == 1 and timer.hold_every
    assert 6 / 1000 * 1e3 not in samples  # the caught rep's end event is the 6th record
    assert _holds(queue.log) == [QueuedReps.FIRST_HOLD_CYCLES] * 4
    assert queue.log.count("sync") == 4


def test_queued_reps_double_a_hold_that_was_too_short_and_give_up_past_the_rounds():
    from pkv.measure.timing import QueuedReps

    queue = _ScriptedQueue(reached=[True, False])
    timer = QueuedReps(queue)
    assert len(timer.time(lambda: None, 1)) == 1
    assert _holds(queue.log) == [QueuedReps.FIRST_HOLD_CYCLES, 2 * QueuedReps.FIRST_HOLD_CYCLES]
    always = _ScriptedQueue(reached=[True] * 100)
    with pytest.raises(RuntimeError, match="caught by the device"):
        QueuedReps(always).time(lambda: None, 2)
    assert max(_holds(always.log)) == QueuedReps.MAX_HOLD_CYCLES


def test_queued_reps_every_holds_before_each_repetition_and_bad_holds_are_refused(tmp_path):
    import json

    from pkv.measure import timing_ab
    from pkv.measure.timing import HEAD_START_CYCLES, QueuedReps

    queue = _ScriptedQueue(reached=[])
    QueuedReps(queue, hold_every=True, hold_cycles=HEAD_START_CYCLES).time(lambda: None, 3)
    assert _holds(queue.log) == [HEAD_START_CYCLES] * 3
    with pytest.raises(ValueError, match="hold must be one of"):
        time_device_us(lambda: None, reps=1, hold="never")
    # The A/B of the two holds needs a GPU: without one it records why it did not run.
    assert timing_ab.main(["--out", str(tmp_path / "ab.json")]) == 0
    assert json.loads((tmp_path / "ab.json").read_text())["skipped"] == "no GPU"
