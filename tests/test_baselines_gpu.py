"""FlashInfer's decode paths and TensorRT-LLM's XQA against float64 on the shared pages.

A baseline that computes something else would make every ratio meaningless, so each path is held
to the same bounds as PersistentKV's kernels: peaked inputs, holes in the page tables, lengths at
the page edges, outputs poisoned where the engine takes an output buffer. A path the installed
FlashInfer lacks is skipped with the reason. Skipped where there is no GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_gpu import EDGE_LENGTHS, _case, _check, _dense

pytestmark = pytest.mark.gpu

ROLES = ["flashinfer_cc", "flashinfer_tc", "flashinfer_holistic", "flashinfer_fa3", "xqa"]


def _build(role, shape):
    from pkv.engines import EngineUnavailable, build_engine

    try:
        return build_engine(role, shape=shape, device="cuda")
    except EngineUnavailable as exc:
        pytest.skip(f"{role} not available: {exc.reason}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("role", ROLES)
def test_baseline_matches_float64_at_edge_lengths(role, dtype):
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = _build(role, shape)
    step, q, k, v = _case(EDGE_LENGTHS, shape, dtype, seed=31)
    engine.prepare(step, q, k, v)
    out = engine.run(q, k, v, engine.plan(step))
    torch.cuda.synchronize()
    _check(out, _dense(step, q, k, v), dtype)


@pytest.mark.parametrize("role", ROLES)
def test_baseline_matches_float64_on_fresh_ragged_batches(role):
    import numpy as np

    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = _build(role, shape)
    rng = np.random.default_rng(7)
    for trial in range(3):
        lengths = rng.integers(1, 9000, size=int(rng.integers(1, 9))).tolist()
        step, q, k, v = _case(lengths, shape, torch.float16, seed=100 + trial)
        engine.prepare(step, q, k, v)
        out = engine.run(q, k, v, engine.plan(step))
        torch.cuda.synchronize()
        _check(out, _dense(step, q, k, v), torch.float16)


def test_best_of_flashinfer_runs_a_probed_path_and_records_every_path():
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = _build("flashinfer", shape)
    step, q, k, v = _case([20000, 300, 17], shape, torch.float16, seed=5)
    engine.prepare(step, q, k, v)
    plan = engine.plan(step)
    out = engine.run(q, k, v, plan)
    torch.cuda.synchronize()
    _check(out, _dense(step, q, k, v), torch.float16)
    record = engine.path_record()
    (probe,) = record["probed"]
    assert plan.kernel_variant == probe["picked"] and set(probe["measured"]) == set(record["paths"])
    assert all(m["device_us"] > 0 and m["plan_us"] > 0 for m in probe["measured"].values())
