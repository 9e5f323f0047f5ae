"""Every GPU benchmark and experiment entry point, run on the CPU through the code its GPU run takes.

The benchmarks (pkv.measure.device_step_bench, kernel_bench, host_bench) build their cases, engines
and configurations on device cpu with the stand-ins: the torch reference engine for PersistentKV,
repack + SDPA for FlashInfer, and for the device-planned step and its CUDA graphs the torch ops and
recorded graphs of tests/device_ops_reference.py. Their cases keep their batches, split counts and
routes, with lengths scaled as the CPU profile scales every trace, on a small attention shape. The
experiment drivers run as the CLI dispatches them (pkv.cli.run_experiment) on the CPU profile,
shrunk further by overrides.

Covered elsewhere: experiment=evaluate and experiment=calibrate end to end through the CLI, and
experiment=profile's outer run on the CPU (tests/test_cli.py); pkv.measure.harness and
pkv.measure.isolated, the libraries the drivers time with (tests/test_harness.py,
tests/test_isolated.py).
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from pkv.atomic_io import json_text
from pkv.config import CONF_DIR, compose
from pkv.measure import device_step_bench, host_bench, kernel_bench
from pkv.measure.harness import REF_REL_LIMIT, default_num_sms
from pkv.measure.timing import L2Flusher
from pkv.shape import ModelShape

# G = 4 as in the model, one KV head and narrow heads: the device step's torch ops loop in Python
# over (row, KV head, split) tasks, so fewer heads keep every case within a second or so.
SHAPE = ModelShape(num_qo_heads=4, num_kv_heads=1, head_dim=16)
# conf/config.yaml cpu_profile.length_scale: a 64K-token row becomes 1K.
CPU_LENGTH_DIVISOR = 64


def _scaled(lengths) -> list[int]:
    return [max(1, n // CPU_LENGTH_DIVISOR) for n in lengths]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny torch ops on a shared two-core machine spend more on handing work between threads than
    on the work (the CLI tests run their subprocesses with OMP_NUM_THREADS=1 for the same reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device_step_ops(monkeypatch):
    """The device step's ops in torch, and CUDA graphs whose capture keeps those ops' calls and whose
    replay makes them again (tests/device_ops_reference.py), so DeviceDecodeStep, GraphedDecodeStep,
    RoutedGraphStep and capture_graph run on the CPU."""
    from device_ops_reference import install_recorded_graphs

    install_recorded_graphs(monkeypatch)


def _quiet(msg) -> None:
    pass


# ---- the benchmarks without a GPU -------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmarks run in full")
@pytest.mark.parametrize("module, extra", [(device_step_bench, []), (kernel_bench, []),
                                           (host_bench, ["--calibration", str(CONF_DIR / "gpu" / "h200.yaml")])],
                         ids=["device_step_bench", "kernel_bench", "host_bench"])
def test_each_benchmark_records_why_it_did_not_run_without_a_gpu(tmp_path, module, extra):
    out = tmp_path / "bench.json"
    case = next(iter(module.CASES))
    assert module.main(["--out", str(out), "--cases", case, "--reps", "2", *extra]) == 0
    record = json.loads(out.read_text())
    assert record["skipped"] == "no GPU" and record["schema"].startswith(module.__name__)


# ---- pkv.measure.device_step_bench --------------------------------------------------------------

# Rows with no CPU stand-in: FlashInfer's CUDA-graph wrapper, the CUDA engine's graph of a host plan.
DEVICE_STEP_CPU_ROWS = tuple(row for row in device_step_bench.ROWS
                             if row not in device_step_bench.FLASHINFER_GRAPH_ROWS
                             and row not in device_step_bench.CUDA_ONLY_ROWS)


def _check_device_step_case(record, case) -> None:
    lengths, splits, route = case
    rows = record["engines"]
    assert (record["seq_lens"], record["num_splits"], record["routed_route"]) == (_scaled(lengths), splits, route)
    assert set(rows) == set(DEVICE_STEP_CPU_ROWS)
    wave = device_step_bench.WAVE_CTAS_PER_SM * default_num_sms("cpu")
    for name in ("host_planned_balanced", "device_planned_balanced", "device_planned_balanced_graph",
                 "device_planned_balanced_decode_graph"):
        assert rows[name]["target_ctas"] == wave, name
    # Every form of the step that writes an output wrote the host-planned step's.
    compared = [name for name, row in rows.items() if "max_abs_diff_vs_host" in row]
    assert {"routed_graph", "device_planned", "device_planned_lists", "in_decode", "in_decode_lists",
            "device_planned_balanced", "host_planned_balanced", "device_planned_decode_graph",
            "device_planned_balanced_decode_graph"} <= set(compared)
    for name in compared:
        assert rows[name]["max_abs_diff_vs_host"] < 1e-5, name
    assert rows["flashinfer"]["path"] == "flashinfer"  # the CPU's FlashInfer role: repack + SDPA


@pytest.mark.parametrize("name", ["b1_32k", "b4_bimodal"])
def test_device_step_bench_times_every_row_of_a_case_on_the_cpu(device_step_ops, name):
    """run_cases as main calls it, timing included, for a case of each routed-graph route (the
    bucket route at B1, the workqueue past it): the routed graph takes the case's route, whatever
    the host-planned rows before it pinned."""
    case = device_step_bench.CASES[name]
    lines = []
    records = device_step_bench.run_cases({name: (_scaled(case[0]), *case[1:])}, SHAPE, 1, 7, lines.append,
                                          device="cpu", dtype="float32")
    _check_device_step_case(records[name], case)
    for row in records[name]["engines"].values():
        assert row["device_us"] > 0 and row["wall_us"] > 0 and row["host_us"] > 0
    graph_rows = [row for label, row in records[name]["engines"].items() if label.endswith("graph")]
    assert graph_rows and all("replay_host_us" in row for row in graph_rows)
    assert set(records[name]["engines"]["device_planned"]["launch_host_us_by_op"]) == {
        "plan_workqueue_on_device", "run_workqueue_planned_on_device"}
    assert lines[-1].startswith(name)  # each case's line is headed by its own name
    json_text("device_step.json", {"cases": records})  # what main writes


def test_device_step_bench_builds_and_replays_every_case_on_the_cpu(device_step_ops, monkeypatch):
    """Every case of CASES through run_case, each row's step run once in place of its timing."""
    def run_once(fn, flusher, reps, *, out=None, reference=None, **timing_only):
        fn()
        row = {"device_us": 0.0, "wall_us": 0.0, "host_us": 0.0}
        if out is not None:
            row["max_abs_diff_vs_host"] = float((out.float() - reference.float()).abs().max())
        return row

    monkeypatch.setattr(device_step_bench, "_timed_row", run_once)
    cases = {name: (_scaled(lengths), *rest) for name, (lengths, *rest) in device_step_bench.CASES.items()}
    records = device_step_bench.run_cases(cases, SHAPE, 1, 7, _quiet, device="cpu", dtype="float32")
    assert list(records) == list(device_step_bench.CASES)
    for name, case in device_step_bench.CASES.items():
        _check_device_step_case(records[name], case)


# ---- pkv.measure.kernel_bench -------------------------------------------------------------------

@pytest.mark.parametrize("name, kv_layout", [("b1_8k", "hnd"), ("b4_bimodal", "nhd")])
def test_kernel_bench_runs_its_sweeps_and_summary_on_the_cpu(device_step_ops, capsys, name, kv_layout):
    """run_case as main calls it: the host-planned and device-planned sweeps, each configuration
    checked against float64 before it is timed, the baselines (every GPU-only one recorded with its
    reason), the confirmation rounds; then main's summary table of the record."""
    lengths = _scaled(kernel_bench.CASES[name])
    flusher = L2Flusher("cpu")
    record = kernel_bench.run_case(name, lengths, SHAPE, flusher, 10.0, 1, 7, _quiet, kv_layout, dtype="float32")
    num_sms = default_num_sms("cpu")
    stages = kernel_bench.RING_STAGES[:1]
    assert set(record["sweep_us"]) == {label for label, *_ in kernel_bench.persistentkv_configs(
        lengths, num_sms, False, stages)}
    assert set(record["device_planned_sweep_us"]) == {label for label, *_ in kernel_bench.device_step_configs(
        lengths, num_sms, stages)}
    engines = record["engines"]
    for role in kernel_bench.BASELINE_ROLES:
        why = "not timed: opt-in" if role in kernel_bench.OPT_IN_ROLES else "needs a CUDA device"
        assert why in engines[role]["skipped"], role
    assert record["flashinfer_best"] == "flashinfer" and record["xqa_us"] is None
    for role in ("persistentkv", "persistentkv_device_planned", "flashinfer"):
        assert engines[role]["rel_err"] < REF_REL_LIMIT[torch.float32], role
    assert record["confirmed"]["persistentkv"] == engines["persistentkv"]["config"]
    assert len(record["confirmed"]["rounds_us"]["persistentkv"]) == kernel_bench.CONFIRM_ROUNDS
    assert "b1_breakdown" not in record  # it times the CUDA kernels' launches alone
    assert record["kv_bytes"] == sum(lengths) * SHAPE.num_kv_heads * SHAPE.head_dim * 2 * 4
    kernel_bench.print_summary({name: record})
    table = capsys.readouterr().out
    assert table.splitlines()[1].startswith(name) and "xqa: not available: XQA needs a CUDA device" in table
    json_text("decode.json", {"cases": {name: record}})  # what main writes


def test_kernel_bench_sweeps_a_short_rows_split_counts_as_the_planner_runs_them():
    """A B1 count past the row's tiles plans one split a tile, so it is timed once, as the row's
    tile count; a short row adds the counts below it, with several tiles a split."""
    def counts(lengths, prefix):
        return sorted({int(label.split(":S=")[1].split(":")[0]) for label, *_ in
                       kernel_bench.persistentkv_configs(lengths, 132, True, (2,))
                       if label.startswith(prefix + ":")})

    assert kernel_bench.CASES["b1_384"] == [384] and kernel_bench.case_label("b1_384", [384]) == "B1 384"
    assert counts([384], "bucket") == [1, 2, 4, 8, 12] == counts([384], "bucket+fused")
    assert counts([384], "bucket+cluster") == [8, 12]
    assert counts([384], "workqueue") == [1, 2, 4, 8, 12]
    assert counts([2048], "bucket") == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert counts([8192], "bucket") == list(kernel_bench.B1_SPLITS)  # a long row's sweep is as it was
    assert counts([8192], "workqueue") == [32, 64]
    # The in-decode grid is (B, Hkv, S) whatever the row's length: every B1 count is a grid of its own.
    device = {int(label.split(":S=")[1].split(":")[0]) for label, *_ in
              kernel_bench.device_step_configs([384], 132, (2,))}
    assert device == {1, 2, 4, 8, 12, *kernel_bench.B1_SPLITS}
    assert {int(label.split(":S=")[1].split(":")[0]) for label, *_ in
            kernel_bench.device_step_configs([8192], 132, (2,))} == set(kernel_bench.B1_SPLITS)


def test_kernel_bench_times_an_opt_in_baseline_only_when_asked():
    """FlashInfer's fa3 row (--fa3): left out with the reason unless named, then run as every other
    baseline is (here, recorded as needing a CUDA device)."""
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.pages import assign_pages
    from pkv.pipeline.step import build_step

    lengths = [40, 9]
    assignment = assign_pages(lengths, 16, 0.5, 3)
    step = build_step(0, np.arange(2), np.asarray(lengths, dtype=np.int32), assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, SHAPE, 16, "float32", "cpu", 3)
    q = make_queries(2, SHAPE, "float32", "cpu", 4)
    errors = lambda out: {"rel_err": 0.0}  # noqa: E731 - no row here is judged
    flusher = L2Flusher("cpu")
    (role,) = kernel_bench.OPT_IN_ROLES
    left_out, _ = kernel_bench.time_baselines(step, q, k, v, SHAPE, flusher, 1, errors)
    asked, _ = kernel_bench.time_baselines(step, q, k, v, SHAPE, flusher, 1, errors, opt_in=(role,))
    assert left_out[role]["skipped"].startswith("not timed: opt-in (pkv.measure.kernel_bench --fa3")
    assert "needs a CUDA device" in asked[role]["skipped"]
    assert set(left_out) == set(asked)
    assert all(left_out[r].get("skipped") == asked[r].get("skipped") for r in left_out if r != role)


def test_every_kernel_bench_case_plans_every_configuration_of_its_sweeps(monkeypatch):
    """Each case at its own lengths and the model's shape, with an H100's SMs and cluster merge and
    every ring depth: the CUDA engine's planner (the C++ planner of the CPU build) plans every
    host-planned configuration, and every device-planned one builds its workspace."""
    from device_ops_reference import ReferenceOps

    from pkv import ops
    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.engines.persistentkv import RING_STAGES, PersistentKVEngine
    from pkv.pipeline.pages import assign_pages
    from pkv.pipeline.step import build_step
    from pkv.policy.choose import PinnedRoutePolicy

    shape, num_sms = ModelShape(), 132
    steps = {}
    for name, lengths in kernel_bench.CASES.items():
        assignment = assign_pages(lengths, 16, 0.5, 7)
        steps[name] = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), assignment.pages,
                                 16)
        host = list(kernel_bench.persistentkv_configs(lengths, num_sms, True, RING_STAGES))
        assert len({label for label, *_ in host}) == len(host), name
        for label, route, stages in host:
            engine = PersistentKVEngine(shape, policy=PinnedRoutePolicy(route), device="cpu", stages=stages)
            plan = engine.plan(steps[name])
            assert (plan.route, plan.merge) == (route.name, route.merge), (name, label)
    # The workspaces hold the device step's ops: their torch stand-ins, once the planner has planned.
    monkeypatch.setattr(ops, "load", ReferenceOps)
    for name, step in steps.items():
        device = list(kernel_bench.device_step_configs(step.seq_lens, num_sms, RING_STAGES))
        assert len({label for label, *_ in device}) == len(device), name
        for label, config, stages in device:
            DeviceDecodeStep(shape, max_batch=step.batch_size, device="cpu", stages=stages, **config._asdict())


# ---- pkv.measure.host_bench ---------------------------------------------------------------------

@pytest.mark.parametrize("calibration", ["cpu.yaml", "h200.yaml", "json"])
def test_host_bench_splits_the_step_of_every_engine_and_case_on_the_cpu(tmp_path, calibration):
    """run_cases as main calls it over every case, with each form of calibration --calibration
    takes (a conf/gpu file, the calibrate rule's JSON)."""
    from pkv.policy import save_calibration

    if calibration == "json":
        path = tmp_path / "calibration.json"
        save_calibration(path, host_bench.load_bench_calibration(CONF_DIR / "gpu" / "cpu.yaml"), {"seed": 7})
    else:
        path = CONF_DIR / "gpu" / calibration
    calib = host_bench.load_bench_calibration(path)
    cases = {name: _scaled(lengths) for name, lengths in host_bench.CASES.items()}
    if calibration != "cpu.yaml":  # one case is enough to read the other forms
        cases = dict(list(cases.items())[:1])
    records, op_issue_us = host_bench.run_cases(cases, SHAPE, calib, 1, 7, _quiet, device="cpu", dtype="float32")
    assert op_issue_us > 0 and list(records) == list(cases)
    for name, record in records.items():
        assert record["seq_lens"] == cases[name]
        assert set(record["engines"]) == set(host_bench.engine_specs("cpu"))
        assert set(host_bench.engine_specs("cuda")) - set(record["engines"]) == {"adaptive/native, one op"}
        for label, row in record["engines"].items():
            if "skipped" in row:  # only the pinned adaptive route, on a case the policy leaves to FlashInfer
                assert label == "persistentkv_adaptive_route/native" and row["route"] == "flashinfer", (name, label)
                continue
            for timing in ("tight", "after_flush_and_hold"):
                assert set(row[timing]) == set(host_bench.COLUMNS), (name, label)
            assert len(row["tight_plan_issue_us_by_round"]) == host_bench.ROUNDS
            assert row["device_us"] > 0
            want = {"flashinfer": "flashinfer", "persistentkv_bucket_exact": "persistentkv_bucket",
                    "persistentkv_workqueue": "persistentkv_workqueue"}.get(label.split("/")[0])
            assert want is None or row["route"] == want, (name, label)
    json_text("host.json", {"cases": records})  # what main writes


def test_host_bench_times_the_engines_in_turn_over_its_rounds():
    """Each round times every engine once, the first of them moving on by one each round; the
    repetitions are split over the rounds, at least one step a round."""
    order = []
    samples = host_bench.in_rounds({"a": 1, "b": 2, "c": 3},
                                   lambda label, engine, n: order.append((label, n)) or [(label, n)], 10, 4)
    assert [label for label, _ in order] == list("abc" "bca" "cab" "abc") and {n for _, n in order} == {2}
    assert samples == {label: [[(label, 2)]] * 4 for label in "abc"}
    assert {n for _, n in (host_bench.in_rounds({"a": 1}, lambda label, engine, n: (label, n), 3, 5)["a"])} == {1}


# ---- the experiment drivers ---------------------------------------------------------------------

# A few requests and steps: each run takes about a second on the CPU.
SMALL_TRACE = ["trace.num_requests=4", "experiment.warmup_steps=1", "experiment.measured_steps=2", "progress=false"]


def _run(overrides, out):
    from pkv.cli import run_experiment

    cfg = compose([*overrides, "profile=cpu", f"out={out}"])
    return cfg, run_experiment(cfg, overrides)


# Each ablation with a variant of its own key (conf/experiment/ablate_*.yaml, config/config.yaml's
# ablations), and the MLP-tail trace run.
TRACE_RUNS = {
    "mlp": [],
    "ablate_splits": ['variant="splits=20"'],
    "ablate_raggedness": ['variant="route=bucket_exact"'],
    "ablate_gqa": ['variant="G=4"'],
    "ablate_graph": ['variant="splits=28"', "trace.max_active=4"],
    "ablate_fused_merge": ['variant="splits=28"'],
    "ablate_b4": ['variant="splits=28"'],
    "ablate_short_rows": ['variant="tiles=3"'],
}


@pytest.mark.parametrize("experiment", list(TRACE_RUNS))
def test_each_trace_experiment_runs_as_the_cli_dispatches_it(tmp_path, monkeypatch, experiment):
    from pkv.measure.mlp_tail import GatedMLPTail

    tails = []
    call = GatedMLPTail.__call__
    monkeypatch.setattr(GatedMLPTail, "__call__", lambda self, x: tails.append(x.shape) or call(self, x))
    cfg, paths = _run([f"experiment={experiment}", *TRACE_RUNS[experiment], *SMALL_TRACE], tmp_path / "out")
    records = {path.stem: json.loads(path.read_text()) for path in paths}
    assert set(records) == set(cfg.experiment.engines)
    assert len({r["run_id"] for r in records.values()}) == 1
    assert bool(tails) == cfg.experiment.mlp_tail
    ran = {label: r for label, r in records.items() if "skipped" not in r}
    assert cfg.experiment.baseline in ran
    for label, record in records.items():
        assert record["experiment"] == experiment and record["variant"] == cfg.variant
        assert record["performance_result"] is False
        if label in ran:
            assert record["metrics"]["steps"] == 2, label
        else:  # only what has no CPU stand-in: PersistentKV replayed from a CUDA graph
            assert label == "persistentkv_workqueue_graph" and "cuda_graph" in record["skipped"]
    if experiment == "ablate_raggedness":
        assert set(ran["persistentkv"]["metrics"]["routes"]) == {"persistentkv_bucket"}
    if experiment in ("ablate_fused_merge", "ablate_b4", "ablate_graph"):
        assert ran["persistentkv_workqueue"]["metrics"]["num_splits"] == 28
    if experiment == "ablate_short_rows":
        assert ran["adaptive"]["provenance"]["config"]["engine"]["bucket_tiles_per_split"] == 3


def test_isolated_experiment_runs_every_method_as_the_cli_dispatches_it(tmp_path):
    cfg, (path,) = _run(["experiment=isolated", "experiment.context_len=8192"], tmp_path / "ctx8192.json")
    record = json.loads(path.read_text())
    methods = record["metrics"]["methods"]
    assert list(methods) == list(cfg.experiment.methods)
    assert record["metrics"]["measured_context_len"] == 8192 // CPU_LENGTH_DIVISOR
    persistentkv = methods["persistentkv"]
    assert set(persistentkv["candidates_median_us"]) == {f"persistentkv_s{s}" for s in cfg.experiment.split_candidates}
    assert persistentkv["selected"] == f"persistentkv_s{persistentkv['num_splits']}"
    assert methods["flashinfer"]["selected"] == "flashinfer"  # the CPU's stand-in for its paths
    for method in ("xqa", "vllm", "vllm_triton"):
        assert "needs a CUDA device" in methods[method]["skipped"], method
    for method in ("persistentkv", "flashinfer", "sdpa"):
        assert methods[method]["rel_err"] < 1e-5, method


def test_model_step_experiment_runs_every_engine_and_mode_as_the_cli_dispatches_it(tmp_path, monkeypatch):
    from pkv.experiments import model_step
    orders = []
    layout = model_step.page_layout
    monkeypatch.setattr(model_step, "page_layout", lambda *a, **kw: orders.append(kw["page_order"]) or layout(*a, **kw))
    cfg, paths = _run(["experiment=model_step", "trace.page_order=in_order", *SMALL_TRACE], tmp_path / "out")
    records = {path.stem: json.loads(path.read_text()) for path in paths}
    assert orders == ["in_order"]
    assert {r["trace"]["page_order"] for r in records.values()} == {"in_order"}
    assert set(records) == {f"{role}_{mode}" for role in cfg.experiment.engines for mode in cfg.experiment.modes}
    for label, record in records.items():
        if label in ("adaptive_eager", "flashinfer_eager"):
            metrics = record["metrics"]
            assert metrics["steps"] == 2 and metrics["model"]["layers_run"] == cfg.experiment.cpu_layers, label
            assert metrics["max_rel_err_vs_baseline"] < 1e-4, label
        else:  # CUDA graphs and XQA have no CPU stand-in
            assert record["skipped"].startswith("not available: "), label


def test_an_eager_model_step_records_which_flashinfer_path_each_batch_class_ran(tmp_path, monkeypatch):
    """The eager FlashInfer step runs the path its probe picked per batch class (the holistic kernel
    among them, which no graph runs); its record says which, for the baseline and the adaptive
    engine's fallback alike. The CPU's stand-in runs no FlashInfer path, so it is given a record here."""
    from pkv.engines.sdpa import SdpaEngine

    picked = {"paths": {"tc": "fa2 decode, tensor cores"}, "missing_paths": {},
              "probed": [{"batch": 2, "longest_pow2": 256, "picked": "tc", "measured": {}}]}
    monkeypatch.setattr(SdpaEngine, "path_record", lambda self: picked)
    _, paths = _run(["experiment=model_step", *SMALL_TRACE], tmp_path / "out")
    records = {path.stem: json.loads(path.read_text()) for path in paths}
    for label in ("flashinfer_eager", "adaptive_eager"):
        assert records[label]["metrics"]["flashinfer_paths"] == picked, label


def test_profile_experiments_inner_run_puts_each_engine_in_the_range_ncu_filters_on(tmp_path, monkeypatch):
    """The run ncu starts (PKV_NCU_CHILD=1) times the trace with each engine's decode calls in the
    NVTX range that ncu_command includes."""
    from pkv.experiments import profile
    from pkv.measure import harness

    ranges = []

    @contextlib.contextmanager
    def recorded_range(name):
        ranges.append(name)
        yield

    monkeypatch.setattr(harness, "nvtx_range", recorded_range)
    monkeypatch.setenv(profile.CHILD_ENV, "1")
    cfg, paths = _run(["experiment=profile", "experiment.measured_steps=2", "progress=false"], tmp_path / "ncu.json")
    assert paths == [] and not (tmp_path / "ncu.json").exists()  # the outer run writes the counters
    command = profile.ncu_command("ncu", tmp_path / "profile", [], cfg.experiment.engines)
    included = {command[i + 1] for i, word in enumerate(command) if word == "--nvtx-include"}
    decode = {f"pkv@{name}/" for name in ranges if name.endswith("_decode")}
    assert decode == included == {f"pkv@{profile.range_name(label)}/" for label in cfg.experiment.engines}
