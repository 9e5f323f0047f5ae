"""The isolated native-paged benchmark on the CPU: errors, floors and skipped engines."""

import pytest

from pkv.engines.base import Engine, EngineUnavailable
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.isolated import autotune_splits, isolated_batch, kv_bytes_read
from pkv.shape import ModelShape
from policy_constants import pinned

schedule = pytest.importorskip("pkv.pipeline.schedule")
pytest.importorskip("pkv.pipeline.pages")
pytest.importorskip("pkv.pipeline.step")

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)


class NotInstalled(Engine):
    name = implementation = "missing"

    def prepare(self, step, q, k_pages, v_pages):
        raise EngineUnavailable("missinglib not installed: No module named 'missinglib'")


def test_isolated_batch_times_and_checks_every_engine():
    engines = {
        "persistentkv": ReferenceEngine(SHAPE, policy=pinned("bucket_exact", bucket_num_splits=6)),
        "sdpa": SdpaEngine(SHAPE, "cpu"),
        "missing": NotInstalled(),
    }
    results = isolated_batch([1000], SHAPE, engines, dtype="float32", device="cpu", seed=3, reps=3,
                             read_gbps=10.0)
    assert results["missing"] == {"skipped": "missinglib not installed: No module named 'missinglib'"}
    kv_bytes = kv_bytes_read([1000], SHAPE, 4)
    assert kv_bytes == 2 * 1000 * 2 * 32 * 4
    for name in ("persistentkv", "sdpa"):
        r = results[name]
        assert r["n"] == 3 and r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["kv_bytes"] == kv_bytes
        assert r["floor_us"] == pytest.approx(kv_bytes / 10e9 * 1e6)
        assert r["fraction_of_floor"] == pytest.approx(r["floor_us"] / r["median_us"])
        assert r["achieved_gbps"] == pytest.approx(kv_bytes / (r["median_us"] * 1e3))
        assert r["rel_err"] < 1e-5 and r["max_abs_err"] < 1e-4
    assert results["persistentkv"]["implementation"] == "reference:bucket_exact"


def test_isolated_batch_without_bandwidth_has_no_floor():
    results = isolated_batch([40, 70], SHAPE, {"sdpa": SdpaEngine(SHAPE, "cpu")}, dtype="float64",
                             device="cpu", seed=0, reps=2, warmup=0)
    assert results["sdpa"]["floor_us"] is None and results["sdpa"]["fraction_of_floor"] is None
    with pytest.raises(ValueError, match="seq_lens"):
        isolated_batch([], SHAPE, {}, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="read_gbps"):
        isolated_batch([4], SHAPE, {}, dtype="float32", device="cpu", read_gbps=0)


def test_autotune_splits_picks_a_timed_candidate():
    def make(splits):
        return ReferenceEngine(SHAPE, policy=pinned("bucket_exact", bucket_num_splits=splits))

    best, results = autotune_splits([600], SHAPE, make, [1, 4], dtype="float32", device="cpu",
                                    reps=2, warmup=0)
    assert best in (1, 4)
    assert results[f"splits={best}"]["median_us"] == min(r["median_us"] for r in results.values())
