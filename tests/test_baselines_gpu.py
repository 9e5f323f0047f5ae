"""FlashInfer's decode paths and TensorRT-LLM's XQA against float64 on the shared pages.

A baseline that computes something else would make every ratio meaningless, so each path is held
to the same bounds as PersistentKV's kernels: peaked inputs, holes in the page tables, lengths at
the page edges, outputs poisoned where the engine takes an output buffer. The CUDA-graph forms
(FlashInfer's graph decode wrapper, XQA over static tables) are replayed for lengths other than
the captured ones. A path the installed FlashInfer lacks is skipped with the reason. Skipped
where there is no GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_gpu import EDGE_LENGTHS, PAGE, _case, _check, _dense

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


@pytest.mark.parametrize("group_size", [1, 8])
@pytest.mark.parametrize("role", ROLES)
def test_baseline_matches_float64_at_other_group_sizes(role, group_size):
    """G = 1 has 32 KV heads, for which the holistic plan overflows BatchAttention's own workspace
    (the engine grows it); G = 8 packs the most query heads per KV head."""
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=32, num_kv_heads=32 // group_size)
    engine = _build(role, shape)
    step, q, k, v = _case([1, PAGE + 1, 3000], shape, torch.float16, seed=41)
    engine.prepare(step, q, k, v)
    out = engine.run(q, k, v, engine.plan(step))
    torch.cuda.synchronize()
    _check(out, _dense(step, q, k, v), torch.float16)


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


def test_best_of_flashinfer_runs_a_probed_path_and_records_every_path(monkeypatch):
    from pkv.engines import flashinfer
    from pkv.shape import ModelShape

    # The picks are shared by every engine of the process: start from none, whatever ran before.
    monkeypatch.setattr(flashinfer, "_PATH_PICKS", {})
    monkeypatch.setattr(flashinfer, "_PATH_PROBES", {})

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


# Batches of one size whose lengths differ from the captured first: short and long rows, lengths
# at the page edges, a batch of one-token rows.
GRAPH_BATCHES = [[33, 1, 4097, 16], [20000, 17, 300, 65], [1, 1, 1, 1], [9000, 9000, 15, 4096]]


def _graph_steps(shape, dtype, num_pages, seed):
    """(k, v) over one pool and, per GRAPH_BATCHES entry, a step on distinct random pages of it
    with its queries: a captured graph keeps the pool's addresses, so every step shares it."""
    import numpy as np

    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.step import build_step

    k, v = make_kv_pages(num_pages, shape, PAGE, dtype, "cuda", seed)
    rng = np.random.default_rng(seed)
    steps = []
    for trial, lengths in enumerate(GRAPH_BATCHES):
        pages = [-(-n // PAGE) for n in lengths]
        rows = np.split(rng.permutation(num_pages)[:sum(pages)].astype(np.int32), np.cumsum(pages)[:-1])
        step = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, PAGE)
        steps.append((step, make_queries(len(lengths), shape, dtype, "cuda", seed + 1 + trial)))
    return k, v, steps


@pytest.mark.parametrize("use_tensor_cores", [False, True], ids=["cc", "tc"])
def test_flashinfer_graph_decode_replays_new_plans_into_the_callers_output(use_tensor_cores):
    """FlashInferGraphDecode as the routed graphs and the model step run it: plan() on the host
    before each replay of a graph captured under the first plan, into a poisoned output buffer."""
    pytest.importorskip("flashinfer")
    from pkv.engines.flashinfer import FlashInferGraphDecode
    from pkv.shape import ModelShape

    shape, dtype = ModelShape(), torch.float16
    k, v, steps = _graph_steps(shape, dtype, 8000, seed=41)
    batch = len(GRAPH_BATCHES[0])
    max_pages = max(-(-n // PAGE) for lengths in GRAPH_BATCHES for n in lengths)
    decode = FlashInferGraphDecode(shape, batch, max_pages, PAGE, "cuda", use_tensor_cores)
    q = torch.empty(batch, shape.num_qo_heads, shape.head_dim, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    graph = None
    for step, queries in steps:
        q.copy_(queries)
        out.fill_(float("nan"))
        decode.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, dtype, dtype)
        if graph is None:
            decode.run(q, k, v, out=out)  # eager first: JIT and kernel loading stay out of the capture
            torch.cuda.synchronize()
            _check(out, _dense(step, q, k, v), dtype)
            out.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode.run(q, k, v, out=out)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _dense(step, q, k, v), dtype)


def test_xqa_graph_replays_new_tables_without_a_plan():
    """XQA as the model step captures it: static block table and uint32 lengths, rewritten in
    place before each replay; the table is as wide as the longest row of any step."""
    from pkv.shape import ModelShape

    shape, dtype = ModelShape(), torch.float16
    engine = _build("xqa", shape)
    k, v, steps = _graph_steps(shape, dtype, 8000, seed=43)
    batch = len(GRAPH_BATCHES[0])
    max_pages = max(-(-n // PAGE) for lengths in GRAPH_BATCHES for n in lengths)
    q = torch.empty(batch, shape.num_qo_heads, shape.head_dim, dtype=dtype, device="cuda")
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    graph = out = None
    for step, queries in steps:
        q.copy_(queries)
        table.zero_()
        table[:, :step.block_table.shape[1]].copy_(torch.from_numpy(step.block_table))
        lens.copy_(torch.from_numpy(step.seq_lens.astype("int32")))
        if graph is None:
            engine.decode(q, k, v, table, lens.view(torch.uint32), max_pages * PAGE)  # JIT outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = engine.decode(q, k, v, table, lens.view(torch.uint32), max_pages * PAGE)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _dense(step, q, k, v), dtype)
