"""The model-shaped decode step (Table 9): its output against float64, each layer on its own pages,
the KV append's page slot, the table from a small fixture, the config's refusals, and (GPU) graph
replay against eager for lengths other than the captured ones."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch

from pkv.config import ConfigError, compose
from pkv.engines import build_engine
from pkv.measure.model_step import ModelStep, StepShape, append_kv, append_slots, dense_attend, rms_norm, skip_attend
from pkv.pipeline.step import build_step
from pkv.report import tables
from pkv.report.results import result_envelope, write_json_atomic
from pkv.report.table_data.model_step import table9

SHAPE = StepShape(hidden=64, intermediate=96, num_qo_heads=8, num_kv_heads=2, head_dim=16, num_layers=2)
PAGE = 4


def _step(lengths, num_pages=64, seed=0):
    rng = np.random.default_rng(seed)
    pages = [-(-n // PAGE) for n in lengths]
    chosen = rng.permutation(num_pages)[:sum(pages)].astype(np.int32)
    rows = np.split(chosen, np.cumsum(pages)[:-1])
    return build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, PAGE)


def _model(dtype=torch.float32, device="cpu", layers=2):
    return ModelStep(SHAPE, layers=layers, num_pages=64, page_size=PAGE, dtype=dtype, device=device, seed=7)


def _tensors(step, device="cpu"):
    return (torch.from_numpy(step.block_table.astype(np.int32)).to(device),
            torch.from_numpy(step.seq_lens.astype(np.int32)).to(device))


def _reference_engine_attend(model, step):
    engine = build_engine("reference", shape=SHAPE.attention, device="cpu")
    plan = engine.plan(step)
    return lambda layer, q: engine.run(q, model.k_pages[layer], model.v_pages[layer], plan)


def test_step_with_the_reference_engine_matches_float64():
    step = _step([5, 17, 8])  # 17 starts a fifth page; 8 ends a page exactly
    model = _model()
    truth = model.float64_copy()
    x = model.hidden_input(step.batch_size, 3)
    table, lens = _tensors(step)
    out = model.forward(x, table, lens, _reference_engine_attend(model, step))
    ref = truth.forward(x.double(), table, lens, dense_attend(truth, table, lens))
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel
    # The attention really matters to the output: leaving it out changes the step.
    assert not torch.allclose(out, _model().forward(x, table, lens, lambda layer, q: q), atol=1e-3)


def _recording(model, table, lens):
    """Dense attention over the model's own pools, and the list of (layer, output) it fills."""
    seen = []

    def attend(layer, q):
        out = dense_attend(model, table, lens)(layer, q)
        seen.append((layer, out.clone()))
        return out

    return attend, seen


def test_each_layer_reads_only_its_own_pages():
    step = _step([9, 14])
    table, lens = _tensors(step)
    model = _model()
    x = model.hidden_input(step.batch_size, 1)
    attend, seen = _recording(model, table, lens)
    clean = model.forward(x, table, lens, attend)
    # Poison layer 1's pool: layer 0's attention does not change, the step's output does (layer 1 reads it).
    poisoned = _model()
    poisoned.k_pages[1].fill_(float("nan"))
    poisoned.v_pages[1].fill_(float("nan"))
    attend_poisoned, seen_poisoned = _recording(poisoned, table, lens)
    out = poisoned.forward(x, table, lens, attend_poisoned)
    assert torch.equal(seen[0][1], seen_poisoned[0][1])
    assert torch.isfinite(clean).all() and torch.isnan(out).all()
    # And layer 1's own pool, not layer 0's: poisoning layer 0 leaves nothing finite either.
    other = _model()
    other.k_pages[0].fill_(float("nan"))
    assert torch.isnan(other.forward(x, table, lens, dense_attend(other, table, lens))).all()


@pytest.mark.parametrize("length", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 1])
def test_kv_append_writes_the_new_tokens_page_slot(length):
    step = _step([length, 2 * PAGE])
    table, lens = _tensors(step)
    model = _model(layers=1)
    before_k = model.k_pages[0].clone()
    x = model.hidden_input(step.batch_size, 5)
    model.forward(x, table, lens, lambda layer, q: q)
    w = model.weights[0]
    qd, kvd = SHAPE.num_qo_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim
    k_new = torch.nn.functional.linear(rms_norm(x, w.norm1), w.qkv)[:, qd:qd + kvd].reshape(2, SHAPE.num_kv_heads, -1)
    page, slot = append_slots(table, lens, PAGE)
    for row, n in enumerate(step.seq_lens):
        want_page, want_slot = int(step.block_table[row, (n - 1) // PAGE]), (int(n) - 1) % PAGE
        assert (int(page[row]), int(slot[row])) == (want_page, want_slot)
        assert torch.equal(model.k_pages[0][want_page, :, want_slot], k_new[row])
    if length == PAGE + 1:
        assert int(slot[0]) == 0 and int(page[0]) == int(step.block_table[0, 1])  # a new page starts
    changed = (model.k_pages[0] != before_k).any(dim=(1, 3))  # [pages, slots]
    assert int(changed.sum()) == 2  # nothing else in the pool was written


def test_append_kv_keeps_the_pool_dtype():
    pool = torch.zeros(3, 2, PAGE, 4, dtype=torch.float16)
    append_kv(pool, pool.clone(), torch.ones(1, 2, 4), torch.ones(1, 2, 4), torch.tensor([2]), torch.tensor([1]))
    assert pool.dtype == torch.float16 and pool[2, :, 1].eq(1).all() and pool.sum() == 8


# ----------------------------------------------------------------------- config


def test_mismatched_attention_shape_names_the_field(tmp_path):
    from pkv.experiments.model_step import model_step_shape

    with pytest.raises(ConfigError) as err:
        model_step_shape(compose(["experiment=model_step", f"out={tmp_path}/o", "model.num_kv_heads=4"]))
    assert "field 'model.num_kv_heads' = 4" in str(err.value) and "llama3_8b" in str(err.value)
    cfg = compose(["experiment=model_step", f"out={tmp_path}/o", "experiment.model=llama3_70b_tp4"])
    shape, layers, _ = model_step_shape(cfg)
    assert (shape.num_qo_heads, shape.num_kv_heads, layers) == (16, 2, 80) and cfg.model.num_kv_heads == 2


@pytest.mark.parametrize("override, field", [
    ("experiment.num_layers=0", "experiment.num_layers"),
    ("experiment.models.llama3_8b.num_layers=0", "experiment.models.llama3_8b.num_layers"),
    ("experiment.num_layers=33", "experiment.num_layers"),
    ("experiment.modes=[eager,replay]", "experiment.modes"),
    ("experiment.dtype=int8", "experiment.dtype"),
])
def test_bad_model_step_config_names_the_field(tmp_path, override, field):
    from pkv.experiments.model_step import model_step_shape

    with pytest.raises(ConfigError) as err:
        model_step_shape(compose(["experiment=model_step", f"out={tmp_path}/o", override]))
    assert f"field '{field}' = " in str(err.value)


def test_a_kernel_profiler_that_is_not_one_is_refused_naming_the_field():
    with pytest.raises(ConfigError,
                       match=r"experiment.kernel_profiler' = 'nsys'.*must be one of \['torch', 'external'\]"):
        compose(["experiment=model_step", "experiment.kernel_profiler=nsys", "out=x"])


@pytest.mark.parametrize("override, field", [
    ("experiment.clock_probe_cycles=20000", "field 'experiment.clock_probe_cycles' = 20000"),
    ("engine.discard_merged_states=true", "field 'engine.discard_merged_states' = True"),
    ("engine.one_op_step=true", "field 'engine.one_op_step' = True"),
])
def test_a_cuda_only_option_off_cuda_is_refused_and_writes_nothing(tmp_path, override, field):
    """The clock probe, the discard of merged states and the one-op step need a CUDA device."""
    from pkv.experiments.model_step import run

    with pytest.raises(ConfigError) as err:
        run(compose(["experiment=model_step", "profile=cpu", "device=cpu", f"out={tmp_path}/o", override]))
    assert field in str(err.value) and "CUDA" in str(err.value)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cycles", [-1, True, 2.5])
def test_model_step_refuses_a_clock_probe_that_is_not_a_count(cycles):
    with pytest.raises(ValueError, match="clock_probe_cycles"):
        ModelStep(SHAPE, layers=1, num_pages=4, page_size=PAGE, dtype="float32", device="cpu", seed=1,
                  clock_probe_cycles=cycles)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a spin of GPU clock cycles needs CUDA")
def test_clock_probe_spins_without_changing_the_step():
    kwargs = dict(layers=2, num_pages=64, page_size=PAGE, dtype="float32", device="cuda", seed=3)
    plain, probed = ModelStep(SHAPE, **kwargs), ModelStep(SHAPE, **kwargs, clock_probe_cycles=1000)
    table, lens = _tensors(_step([5, 9]), "cuda")
    x = plain.hidden_input(2, 7)
    assert torch.equal(plain.forward(x, table, lens, skip_attend), probed.forward(x, table, lens, skip_attend))


def test_cpu_profile_keeps_the_attention_and_shrinks_the_rest(tmp_path):
    from pkv.experiments.model_step import model_step_shape

    shape, layers, dtype = model_step_shape(compose(["experiment=model_step", "profile=cpu", f"out={tmp_path}/o"]))
    assert (shape.hidden, shape.intermediate, shape.num_layers, layers, dtype) == (256, 512, 2, 32, "float32")
    assert shape.attention.group_size == 4


# ----------------------------------------------------------------------- Table 9


def _write_run(root, trace, seed, ratio_adaptive, skipped_reason="not available: CUDA graphs need a CUDA device",
               adaptive_routes=None, rest_ms=7.0, host_ms=0.4, wrong=()):
    """One run's model-step files: FlashInfer's eager step takes 10 ms, the adaptive one 10 /
    ratio_adaptive; the rest of the model ``rest_ms`` and attention's read floor 2 ms. The paths in
    ``wrong`` were wrong against float64 on 3 of their 64 measured steps."""
    run_id = uuid.uuid4().hex
    prov = {"git_commit": "a" * 40, "gpu_name": "FAKE-GPU"}
    model = {"name": "llama3_8b", "layers_run": 32, "layers_model": 32, "dtype": "float16"}
    for label, step_ms in (("flashinfer_eager", 10.0), ("adaptive_eager", 10.0 / ratio_adaptive)):
        metrics = {"cuda_ms_per_step": step_ms, "wall_ms_per_step": step_ms + 0.5, "cuda_tok_s": 8e3 / step_ms,
                   "host_ms_per_step": host_ms, "attention_share": (step_ms - rest_ms) / step_ms,
                   "attention_cuda_ms_per_step": step_ms - rest_ms, "floor_attention_ms_per_step": 2.0,
                   "floor_step_ms_per_step": rest_ms + 2.0, "layers_run": 32, "layers_model": 32, "model": model}
        if label == "adaptive_eager" and adaptive_routes:
            metrics["routes"] = adaptive_routes
            metrics["selected_route"] = max(adaptive_routes, key=adaptive_routes.get)  # as _Record writes it
        if label in wrong:
            metrics.update(steps=64, wrong_steps=3, wrong_warmup_steps=0, wrong_max_rel_err=0.82, first_wrong_step=(
                "decode step 9 (B=8, seq_lens=[65540]): relative error 8.200e-01 against the float64 reference "
                "(limit 4e-02)"))
        rec = result_envelope("model_step", {"name": trace}, label, baseline_engine="flashinfer_eager", run_id=run_id,
                              performance_result=True, metrics=metrics, provenance=prov)
        write_json_atomic(root / "model_step" / trace / f"seed{seed}" / f"{label}.json", rec)
    rec = result_envelope("model_step", {"name": trace}, "adaptive_graph", baseline_engine="flashinfer_graph",
                          run_id=run_id, performance_result=True, skipped=skipped_reason, provenance=prov)
    write_json_atomic(root / "model_step" / trace / f"seed{seed}" / "adaptive_graph.json", rec)


def test_table9_renders_ratios_ceiling_and_captured_fraction(tmp_path):
    root = tmp_path / "artifacts"
    _write_run(root, "bimodal_b8", 20260623, 1.05)
    _write_run(root, "bimodal_b8", 20260624, 1.07)
    _write_run(root, "bimodal_b8", 20260622, 3.0)  # the calibration seed: never evidence
    ctx = table9(root)
    (block,) = ctx["blocks"]
    rows = {r["label"]: r for r in block["rows"]}
    adaptive = rows["adaptive_eager"]
    assert adaptive["cuda"].mean == pytest.approx(1.06) and adaptive["cuda"].n == 2
    assert adaptive["ceiling"].mean == pytest.approx(10.0 / 9.0)
    assert adaptive["captured"].mean == pytest.approx((0.06) / (1 / 9), rel=1e-2)
    assert rows["flashinfer_eager"]["captured"] is None and adaptive["layers"] == "32/32"
    assert "CUDA graphs need a CUDA device" in rows["adaptive_graph"]["cuda"].reason
    md = tables.render_table(9, root, "md")
    assert "| Bimodal B8 | Adaptive route | eager | – | 32/32 | 2 |" in md and "1.060 ± 0.014×" in md
    assert "model_step/bucketed_b1" in md  # Table 2's traces not run are named
    tex = tables.render_table(9, root, "tex")
    assert r"\begin{table}" in tex and r"$1.060{\pm}0.014\times$" in tex
    json.dumps(table9(root)["blocks"], default=str)


def test_table9_names_the_fa2_path_flashinfers_graph_ran_at_each_batch_size(tmp_path):
    root = tmp_path / "artifacts"
    for seed, path in ((20260623, "tc (picked holistic, no graph wrapper)"), (20260624, "cc"), (20260625, "cc")):
        _write_run(root, "bimodal_b8", seed, 1.05)
        where = root / "model_step" / "bimodal_b8" / f"seed{seed}" / "flashinfer_eager.json"
        rec = json.loads(where.read_text())
        rec["metrics"]["flashinfer_graph_paths"] = {"8": path, "4": "tc"}
        write_json_atomic(where, rec)
    ctx = table9(root)
    rows = {r["label"]: r for r in ctx["blocks"][0]["rows"]}
    (mark,) = rows["flashinfer_eager"]["marks"]
    assert dict(ctx["notes"])[mark] == ("FlashInfer's CUDA-graph decode ran, by batch size: B4: tc (3 seeds); "
                                        "B8: cc (2 seeds), tc (picked holistic, no graph wrapper) (1 seed)")
    assert rows["adaptive_eager"]["marks"] == []  # only FlashInfer's own rows


def test_table9_leaves_out_the_share_and_ceiling_of_a_step_bound_by_its_host(tmp_path):
    """An eager step whose device waits on the host: the step less the same step without attention
    (here 10 - 9.5 ms) is below attention's read floor (2 ms), so no share or ceiling is shown; the
    ratios stay."""
    from pkv.report.table_data.model_step import HOST_BOUND

    root = tmp_path / "artifacts"
    _write_run(root, "bimodal_b8", 20260623, 1.02, rest_ms=9.5)
    _write_run(root, "bimodal_b8", 20260624, 1.04, rest_ms=7.0)  # one seed separable: still left out
    ctx = table9(root)
    rows = {r["label"]: r for r in ctx["blocks"][0]["rows"]}
    adaptive = rows["adaptive_eager"]
    assert adaptive["cuda"].mean == pytest.approx(1.03)
    for key in ("attention_share", "ceiling", "captured"):
        assert adaptive[key].reason == HOST_BOUND
    assert rows["flashinfer_eager"]["ceiling"].reason == HOST_BOUND
    assert "bound by its host" in tables.render_table(9, root, "md")
    # Attention above its floor, but the host takes longer to issue the step than the device runs it.
    root = tmp_path / "slow_host"
    _write_run(root, "bimodal_b8", 20260623, 1.02, host_ms=12.0)
    adaptive = {r["label"]: r for r in table9(root)["blocks"][0]["rows"]}["adaptive_eager"]
    assert adaptive["ceiling"].reason == HOST_BOUND and adaptive["cuda"].mean == pytest.approx(1.02)


def test_table9_names_rows_that_ran_flashinfer_and_one_reason_once(tmp_path):
    root = tmp_path / "artifacts"
    for trace, routes in (("bimodal_b8", {"persistentkv_workqueue": 5, "flashinfer": 1}),
                          ("bucketed_b1", {"flashinfer": 6})):
        for seed in (20260623, 20260624):
            _write_run(root, trace, seed, 1.02, adaptive_routes=routes)
    ctx = table9(root)
    rows = {(b["trace"], r["label"]): r for b in ctx["blocks"] for r in b["rows"]}
    # Every step on FlashInfer's route: no gain to capture, and the row says why.
    gated = rows[("bucketed_b1", "adaptive_eager")]
    assert gated["captured"] is None and gated["cuda"].mean == pytest.approx(1.02)
    (mark,) = gated["marks"]
    assert "every step took FlashInfer's route" in dict(ctx["notes"])[mark]
    assert rows[("bimodal_b8", "adaptive_eager")]["captured"] is not None
    assert not rows[("bimodal_b8", "adaptive_eager")]["marks"]
    # Each row names its route as Table 2 does, and the steps another route took.
    assert rows[("bimodal_b8", "adaptive_eager")]["route"] == "PersistentKV workqueue; FlashInfer on 2 of 12 steps"
    assert gated["route"] == "FlashInfer" and rows[("bimodal_b8", "flashinfer_eager")]["route"] == "–"
    assert "| Bimodal B8 | Adaptive route | eager | PersistentKV workqueue; FlashInfer on 2 of 12 steps |" in (
        tables.render_table(9, root, "md"))
    # One seed of two on FlashInfer's route: the captured fraction is the other seed's, and said so.
    _write_run(root, "zipf_b8", 20260623, 1.02, adaptive_routes={"flashinfer": 6})
    _write_run(root, "zipf_b8", 20260624, 1.04, adaptive_routes={"persistentkv_workqueue": 6})
    ctx = table9(root)
    zipf = next(r for b in ctx["blocks"] if b["trace"] == "zipf_b8" for r in b["rows"] if r["label"] == "adaptive_eager")
    assert zipf["captured"].n == 1 and zipf["cuda"].n == 2
    assert "on 1 of 2 seeds, left out of the captured fraction" in dict(ctx["notes"])[zipf["marks"][0]]
    # The same skip reason on every trace and seed is one footnote, said once.
    graph_notes = {rows[(t, "adaptive_graph")]["cuda"].note for t in ("bimodal_b8", "bucketed_b1")}
    assert len(graph_notes) == 1
    assert dict(ctx["notes"])[graph_notes.pop()] == "not available: CUDA graphs need a CUDA device"


# ----------------------------------------------------------------------- GPU: graphs against eager


@pytest.mark.gpu
@pytest.mark.parametrize("role, pinned_merge", [("flashinfer", None), ("xqa", None), ("adaptive", None),
                                                ("adaptive", "launch"), ("adaptive", "fused")])
def test_graph_replay_matches_eager_for_other_lengths(role, pinned_merge):
    """Each engine's graph, captured at one set of lengths, against its eager step for others.
    The adaptive engine runs its calibrated policy (which may send these batches to FlashInfer)
    and, with ``pinned_merge``, a pinned workqueue route, so its device-planned step is captured
    and replayed with each merge."""
    from pkv.engines import EngineUnavailable, role_policy
    from pkv.experiments.common import run_calibration
    from pkv.experiments.model_step import _graph_path
    from pkv.measure.model_step_paths import EagerPath
    from pkv.policy.choose import PinnedRoutePolicy
    from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute

    shape = StepShape(hidden=1024, intermediate=2048, num_qo_heads=32, num_kv_heads=8, head_dim=128, num_layers=2)
    cfg = compose(["experiment=model_step", "out=/tmp/pkv-model-step-test"])
    calib = run_calibration(cfg)
    try:
        if pinned_merge is None:
            engine = build_engine(role, shape=shape.attention, device="cuda",
                                  policy=role_policy(role, {}, shape.attention, calib))
        else:  # the adaptive engine over a pinned route (build_engine takes only a calibrated policy)
            from pkv.engines.adaptive import AdaptiveEngine

            pinned = PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 16, merge=pinned_merge))
            engine = AdaptiveEngine(pinned, build_engine("persistentkv", shape=shape.attention, device="cuda",
                                                         policy=pinned),
                                    build_engine("flashinfer", shape=shape.attention, device="cuda"))
    except EngineUnavailable as exc:
        pytest.skip(exc.reason)
    page, max_pages, pool = 16, 256, 4096
    model = ModelStep(shape, layers=2, num_pages=pool, page_size=page, dtype="float16", device="cuda", seed=3)
    rng = np.random.default_rng(0)

    def step_of(lengths):
        pages = [-(-n // page) for n in lengths]
        rows = np.split(rng.permutation(pool)[:sum(pages)].astype(np.int32), np.cumsum(pages)[:-1])
        return build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, page)

    graph = _graph_path(f"{role}_graph", engine, model, max_pages, 8, role)
    eager = EagerPath(f"{role}_eager", engine, model)
    captured = step_of([4000, 33, 17, 1000])
    x = model.hidden_input(4, 1)
    graph.prepare(captured, x)
    for lengths in ([4000, 33, 17, 1000], [16, 4096, 65, 2000], [1, 1, 3000, 4095]):
        step = step_of(lengths)
        x = model.hidden_input(4, sum(lengths))
        eager.prepare(step, x)
        graph.prepare(step, x)
        eager.plan(step, x)
        want = eager.issue().float().clone()
        graph.plan(step, x)
        got = graph.issue().float()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2, (role, lengths, rel)
        if pinned_merge is not None:
            assert graph.route == ROUTE_WORKQUEUE, graph.route  # the device step ran, not FlashInfer


def test_a_model_step_record_counts_workqueue_steps_by_split_rule():
    """Like Table 2's files, Table 9's count the steps each split rule ran (the skew rule's balanced
    steps beside the fixed ones), per step and per run, and name the split count most of them ran;
    steps off the workqueue have neither."""
    import types

    from pkv.measure.model_step_run import _Record

    record = _Record()
    us = dict(wall_us=1.0, cuda_us=1.0, plan_us=0.0, issue_us=0.0, rest_us=0.5, floor_us=0.1)
    for rule, route, splits in (("fixed", "persistentkv_workqueue", 24),
                                ("balanced (396 CTAs)", "persistentkv_workqueue", 20),
                                ("balanced (396 CTAs)", "persistentkv_workqueue", 20), (None, "flashinfer", None)):
        record.add(types.SimpleNamespace(step=1, batch_size=2, seq_lens=[3, 4]), route, 0, rule, splits, **us)
    metrics = record.metrics(2, 2, "graph", "test")
    assert metrics["split_rules"] == {"balanced (396 CTAs)": 2, "fixed": 1}
    assert metrics["num_splits"] == 20 and metrics["selected_route"] == "persistentkv_workqueue"
    assert [s["split_rule"] for s in metrics["per_step"]] == ["fixed", "balanced (396 CTAs)", "balanced (396 CTAs)",
                                                              None]


def test_table9_takes_no_ratio_against_a_wrong_baseline(tmp_path):
    """The rule of comparisons.compare_in_run in Table 9: a seed whose baseline path was wrong
    against float64 on measured steps is left out of the ratios, the ceiling and the captured
    fraction with a footnote; a ratio no seed fills says the baseline was wrong."""
    from pkv.report.table_data import BaselineWrong, MeanStd, Missing

    root = tmp_path / "artifacts"
    for seed in (20260623, 20260624):
        _write_run(root, "bimodal_b8", seed, 1.05, wrong=("flashinfer_eager",))
    ctx = table9(root)
    rows = {r["label"]: r for r in ctx["blocks"][0]["rows"]}
    notes = dict(ctx["notes"])
    for label in ("adaptive_eager", "flashinfer_eager"):
        row = rows[label]
        assert isinstance(row["cuda"], BaselineWrong) and isinstance(row["wall"], BaselineWrong), label
        assert (row["cuda"].steps, row["cuda"].of, row["cuda"].rel_err) == (6, 128, pytest.approx(0.82))
        assert isinstance(row["ceiling"], Missing) and row["ceiling"].note == row["cuda"].note, label
        assert isinstance(row["captured"], Missing) and row["captured"].note == row["cuda"].note, label
        # The row's own timings stay: they are its own path's.
        assert isinstance(row["tok_s"], MeanStd) and row["tok_s"].n == 2 and row["seeds"] == 2, label
        note = notes[row["cuda"].note]
        assert "baseline flashinfer_eager wrong against the float64 reference on 3 of 64 measured steps" in note
        assert "first: decode step 9 (B=8, seq_lens=[65540])" in note and "no ratio taken" in note
        assert not row["marks"], label  # the ratio cells' footnote says it, once
    md = tables.render_table(9, root, "md")
    assert f"baseline wrong on 6/128 steps (rel. err 8.2e-01 vs float64)[{rows['adaptive_eager']['cuda'].note}]" in md
    assert "1.050" not in md and "no ratio, ceiling or captured fraction is taken" in md.lower()
    tex = tables.render_table(9, root, "tex")
    assert r"baseline wrong on 6/128 steps (rel.~err $8.2{\cdot}10^{-1}$ vs float64)\textsuperscript{" in tex


def test_table9_leaves_out_a_seed_whose_baseline_or_row_was_wrong(tmp_path):
    from pkv.report.figure_data import model_step_ratio

    root = tmp_path / "artifacts"
    _write_run(root, "bimodal_b8", 20260623, 1.05, wrong=("flashinfer_eager",))
    _write_run(root, "bimodal_b8", 20260624, 1.07)
    ctx = table9(root)
    adaptive = {r["label"]: r for r in ctx["blocks"][0]["rows"]}["adaptive_eager"]
    assert adaptive["cuda"].n == 1 and adaptive["cuda"].mean == pytest.approx(1.07)
    assert adaptive["ceiling"].n == 1 and adaptive["captured"].n == 1 and adaptive["tok_s"].n == 2
    marks = [dict(ctx["notes"])[m] for m in adaptive["marks"]]
    assert any("seed 20260623: baseline flashinfer_eager wrong" in m for m in marks), marks
    # The figure reads the same row values: only the right seed's ratio.
    (row,) = model_step_ratio(root).series["rows"]
    assert row["series"]["device, eager"] == [pytest.approx(1.07)]
    # A row whose own output was wrong (a baseline's path beside the run's baseline) has no ratio
    # for that seed either; the other rows keep theirs.
    root = tmp_path / "own"
    _write_run(root, "bimodal_b8", 20260623, 1.05, wrong=("adaptive_eager",))
    _write_run(root, "bimodal_b8", 20260624, 1.07)
    rows = {r["label"]: r for r in table9(root)["blocks"][0]["rows"]}
    assert rows["adaptive_eager"]["cuda"].n == 1 and rows["flashinfer_eager"]["cuda"].n == 2


def test_flashinfer_graphs_are_kept_per_batch_size_and_fa2_path_each_step_runs():
    """FlashInfer's graphed step replays, for each step, the graph of its batch size and of the fa2
    path its batch class runs by FlashInfer's probe (the pick, or the faster fa2 path where the
    pick has no graph wrapper), and records which paths each batch size's steps ran."""
    from types import SimpleNamespace

    from pkv.measure.model_step_paths import FlashInferGraphPath

    class Picks:  # FlashInferEngine's path_for and path_among, by the step's longest row
        picks = {1024: ("cc", "cc"), 65536: ("holistic", "tc")}

        def path_for(self, step):
            return self.picks[max(step.seq_lens)][0]

        def path_among(self, step, paths):
            return self.picks[max(step.seq_lens)][1]

    path = FlashInferGraphPath.__new__(FlashInferGraphPath)  # its captures need a GPU; its bookkeeping does not
    path.engine, path.paths = Picks(), {}
    short, long = (SimpleNamespace(batch_size=4, seq_lens=[n, 10, 10, 10]) for n in (1024, 65536))
    assert path.key(short) == (4, "cc") and path.key(long) == (4, "tc")
    assert path.path_labels() == {"4": "cc, tc (picked holistic, no graph wrapper)"}
