"""The device-planned decode step against the host-planned one and FlashInfer, on identical pages.

Per case: PersistentKV's workqueue planned on the host (C++ planner, one upload) and run eagerly,
with the case's fixed split count and with the balanced split rule on a budget of one wave of CTAs,
and the fixed count's plan replayed from a graph captured for the step (its grid the plan's live
tasks: the kernels a graph could replay if the host planned it, "host_planned_graph", on a GPU);
the same split count planned on the GPU (pkv.engines.device_step) run eagerly over the block table
and over page lists (pkv.page_table), replayed from a CUDA graph, and its decode alone replayed
after one plan (the capacity grid a graphed model step's layers replay,
"device_planned_decode_graph"); the same with no plan launch (planner "in_decode"), eager and
replayed; the balanced rule planned on the GPU, eager and replayed, and its decode alone replayed after
one plan ("device_planned_balanced_decode_graph"); replayed through the routed
graphs a serving engine would hold (pkv.engines.routed_graphs: the route asked of the policy with
the host's lengths, then the replay over static buffers the caller writes); FlashInfer's fastest
decode path for reference, and its CUDA-graph decode on tensor and on CUDA cores (planned on the
host, then replayed), the mode serving engines run it in.
Device time is CUDA events with an L2 flush before each call (median); wall time is a
synchronized step with the host work it needs (plan and run; for the graph, copying the step's
inputs and the replay); host time is how long the host takes to return from that work, with the
device idle before each call (what a serving engine's step pays on the CPU); for the graphs,
replay_host_us is the same for the bare ``graph.replay()``, and for the device-planned eager rows
launch_host_us for the step's op calls alone (dispatch and launch), so the rest of host_us is Python.

    python -m pkv.measure.device_step_bench --out device_step.json
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from pkv.atomic_io import write_json_atomic
from pkv.cuda_graphs import capture_graph
from pkv.engines import build_engine
from pkv.engines.device_step import PLANNERS, DeviceDecodeStep, GraphedDecodeStep
from pkv.engines.flashinfer import FlashInferGraphDecode
from pkv.engines.routed_graphs import RoutedGraphStep
from pkv.measure.bench_cli import bench_parser, flashinfer_roles, is_cuda, write_skipped_no_gpu
from pkv.measure.harness import default_num_sms
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.measure.timing import L2Flusher, synchronize, time_device_us, time_host_us, time_wall_us
from pkv.page_table import PageLists
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step
from pkv.policy.choose import PinnedRoutePolicy
from pkv.policy.route import ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal
from pkv.shape import ModelShape

K = 1024
# Row names of each planner's forms: <name>, <name>_lists (page lists), <name>_graph (replayed).
PLANNER_ROWS = {"plan_kernel": "device_planned", "in_decode": "in_decode"}
ROWS = ("host_planned", "host_planned_balanced", "host_planned_graph",
        *(f"{PLANNER_ROWS[p]}{suffix}" for p in PLANNERS for suffix in ("", "_lists", "_graph")),
        "device_planned_decode_graph", "device_planned_balanced", "device_planned_balanced_graph",
        "device_planned_balanced_decode_graph", "routed_graph",
        "flashinfer", "flashinfer_graph_tc", "flashinfer_graph_cc")
# Rows that need the CUDA engine's graph replay of a host plan (the CPU's reference engine has none).
CUDA_ONLY_ROWS = ("host_planned_graph",)
# FlashInfer's CUDA-graph rows: row name -> tensor cores.
FLASHINFER_GRAPH_ROWS = {"flashinfer_graph_tc": True, "flashinfer_graph_cc": False}
# The balanced rule's budget: one wave of the stages = 2 decode kernels, three CTAs an SM
# (docs/performance.md, "Register spills at stages = 2").
WAVE_CTAS_PER_SM = 3
# (lengths, split count, route of the routed graph): the calibrated operating points of the H200
# for B1 (the bucket route) and B8, and full batches.
CASES = {
    "b1_32k": ([32 * K], 32, ROUTE_BUCKET),
    "b1_128k": ([128 * K], 32, ROUTE_BUCKET),
    # One long row and three short ones, like Table 9's bimodal B4 steps (docs/performance.md, "Table 9:
    # the model-shaped step"), at the H200's calibrated B2-7 split count.
    "b4_bimodal": ([64 * K, 4 * K, 7 * K, 8704], 24, ROUTE_WORKQUEUE),
    "b8_bimodal": ([64 * K, 64 * K, 4 * K, 5632, 7 * K, 8704, 10 * K, 12 * K], 24, ROUTE_WORKQUEUE),
    # The same with a ninth, short row: the in-decode grid's CTAs of one row lie B apart in launch
    # order, which is a multiple of the GPU's 8 GPCs at B8 and not at B9 (docs/performance.md, "The
    # device-planned step on the H200": the in-decode grid's loss at B8 bimodal).
    "b9_bimodal": ([64 * K, 64 * K, 4 * K, 5632, 7 * K, 8704, 10 * K, 12 * K, 6 * K], 24, ROUTE_WORKQUEUE),
    "b64_4k": ([4 * K] * 64, 2, ROUTE_WORKQUEUE),
    "b256_2k": ([2 * K] * 256, 1, ROUTE_WORKQUEUE),
    # One long prompt among many short ones: the host planner's padded table grows with the longest row.
    "skewed_b64": ([128 * K] + [100] * 63, 24, ROUTE_WORKQUEUE),
}


def _timed_row(fn, flusher, reps, *, out=None, reference=None, device_fn=None, replay=None,
               launches=None) -> dict:
    """Device (of ``device_fn``, else ``fn``), wall and host time of one form of the step on the
    flusher's device, after a first untimed call; with ``out``, its largest difference from the
    host-planned output. What of host_us is the launch: with ``replay`` (a graph's bare replay) its
    host time, with ``launches`` (an eager step's op calls alone, _recorded_launches) theirs."""
    device = flusher.device
    fn()
    synchronize(device)
    row = {"device_us": time_device_us(device_fn or fn, flusher=flusher, reps=reps).median_us,
           "wall_us": time_wall_us(fn, reps=reps, device=device),
           "host_us": time_host_us(fn, reps=reps, device=device)}
    if replay is not None:
        row["replay_host_us"] = time_host_us(replay, reps=reps, device=device)
    if launches is not None:
        row["launch_host_us"] = time_host_us(launches, reps=reps, device=device)
        # Each op call alone: which launch's host cost grows with the batch (docs/performance.md,
        # "Where the eager device step's host time goes").
        row["launch_host_us_by_op"] = {name: time_host_us(call, reps=reps, device=device)
                                       for name, call in launches.by_op}
    if out is not None:
        row["max_abs_diff_vs_host"] = float((out.float() - reference.float()).abs().max())
    return row


class _OpRecorder:
    """Stands in for a DeviceDecodeStep's ops for one call, keeping each op call it passes on."""

    def __init__(self, ops) -> None:
        self._ops, self.calls = ops, []

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def record(*args, **kwargs):
            self.calls.append((name, functools.partial(op, *args, **kwargs)))
            return op(*args, **kwargs)
        return record


class _RecordedLaunches:
    """The op calls of one eager step, repeatable: called, it makes them all in order; ``by_op``
    holds (op name, call) of each, numbered where an op is called twice."""

    def __init__(self, calls) -> None:
        names = [name for name, _ in calls]
        self.by_op = [(f"{name}#{names[:i].count(name) + 1}" if names.count(name) > 1 else name, call)
                      for i, (name, call) in enumerate(calls)]

    def __call__(self) -> None:
        for _, call in self.by_op:
            call()


def _recorded_launches(workspace: DeviceDecodeStep, step_fn) -> _RecordedLaunches:
    """The op calls one eager ``step_fn`` made on ``workspace``, repeatable with the same tensors
    and none of the Python checks around them: the dispatch and launch share of the step's host
    time, in all and per op."""
    ops, recorder = workspace.ops, _OpRecorder(workspace.ops)
    workspace.ops = recorder
    try:
        step_fn()
    finally:
        workspace.ops = ops
    return _RecordedLaunches(recorder.calls)


def run_case(name, lengths, splits, route, shape, flusher, reps, seed, log, *, dtype="float16") -> dict:
    """Every row of one case on the flusher's device. On the CPU the stand-ins run it: the torch
    reference engine for the host-planned PersistentKV, repack + SDPA for FlashInfer (whose
    CUDA-graph rows have none and are left out); the device step and the graphs need the device
    step's ops and CUDA graphs, which tests stand in for in torch."""
    device = flusher.device
    assignment = assign_pages(lengths, 16, 0.5, seed)
    step = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, dtype, device, seed)
    q = make_queries(len(lengths), shape, dtype, device, seed + 1)
    table = torch.from_numpy(step.block_table).to(device)
    lens = torch.from_numpy(step.seq_lens).to(device)
    rows = {}

    # The host-planned step on the case's fixed split count, then on the balanced split rule with a
    # budget of one wave of CTAs: every task about the same number of tiles, so a long row among
    # short ones gets more splits than the fixed count (the skewed case, where the fixed count
    # leaves some SMs two of the long row's CTAs and others one). Device time of the kernels alone;
    # wall and host time with the host plan each step needs.
    wave = WAVE_CTAS_PER_SM * default_num_sms(device)
    reference = None
    # host_route, not route: the case's route names the routed graph's below.
    for label, host_route in (("host_planned", StepRoute(ROUTE_WORKQUEUE, splits)),
                              ("host_planned_balanced",
                               StepRoute(ROUTE_WORKQUEUE, splits, split_kind="balanced", target_ctas=wave))):
        host = build_engine("persistentkv", shape=shape, device=device, policy=PinnedRoutePolicy(host_route))
        host.prepare(step, q, k, v)
        plan = host.plan(step)
        out = host.run(q, k, v, plan)
        rows[label] = _timed_row(lambda host=host: host.run(q, k, v, host.plan(step)), flusher, reps,
                                 device_fn=lambda host=host, plan=plan: host.run(q, k, v, plan),
                                 out=None if reference is None else out, reference=reference)
        reference = out if reference is None else reference
    rows["host_planned_balanced"]["target_ctas"] = wave
    if is_cuda(device):
        # The host plan's own grid (its live tasks, no more) replayed from a graph captured for this
        # step: what a layer of a graphed model step would cost if the graph replayed the host-
        # planned kernels, against the device-planned decode's capacity grid below (device time of
        # the replay alone; wall and host time with the plan and its copy into the graph).
        host = build_engine("persistentkv", shape=shape, device=device,
                            policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, splits)), options={"cuda_graph": True})
        host.prepare(step, q, k, v)  # captures the step's graph
        out = host.run(q, k, v, host.plan(step))  # the graph's static output
        (graph,) = host.captured_graphs()
        rows["host_planned_graph"] = _timed_row(lambda host=host: host.run(q, k, v, host.plan(step)), flusher, reps,
                                                device_fn=graph.replay, replay=graph.replay, out=out,
                                                reference=reference)

    # The step planned on the GPU, by each planner, over the block table and over page lists
    # (FlashInfer's indptr / indices: one more dependent read a CTA), eager and replayed; then the
    # balanced rule planned on the GPU (the plan kernel) on the host-planned balanced row's budget.
    host_lens = step.seq_lens  # what a serving scheduler holds: the eager length check reads these
    lists = PageLists.from_step(step, device)
    device_steps = [(PLANNER_ROWS[p], dict(planner=p), (("", table), ("_lists", lists))) for p in PLANNERS]
    device_steps.append(("device_planned_balanced", dict(split_kind="balanced", target_ctas=wave), (("", table),)))
    # row_name, not name: the case's name heads its log line below.
    for row_name, options, forms in device_steps:
        workspace = DeviceDecodeStep(shape, max_batch=len(lengths), num_splits=splits, device=device, **options)
        for suffix, page_table in forms:
            out = torch.empty_like(q)

            def eager(page_table=page_table, out=out, workspace=workspace):
                return workspace.run(q, k, v, page_table, lens, out, host_lens=host_lens)
            rows[row_name + suffix] = _timed_row(eager, flusher, reps, out=out, reference=reference,
                                             launches=_recorded_launches(workspace, eager))
        graphed = GraphedDecodeStep(workspace, k, v, table.shape[1])
        graphed.run(q, table, lens)
        (graph,) = graphed.captured_graphs()
        rows[row_name + "_graph"] = _timed_row(lambda graphed=graphed: graphed.run(q, table, lens), flusher, reps,
                                           device_fn=graph.replay, replay=graph.replay)
        if "target_ctas" in options:
            for suffix in (*(suffix for suffix, _ in forms), "_graph"):
                rows[row_name + suffix]["target_ctas"] = options["target_ctas"]
        if workspace.planner == "plan_kernel":
            # A graphed model step plans once and replays the decode in every layer: the decode (and
            # merge) of one device plan replayed alone, its capacity grid included, the plan launch
            # not. Against host_planned_graph (and, for the balanced rule, host_planned_balanced),
            # what the capacity grid costs a layer.
            out = torch.empty_like(q)
            workspace.plan(table, lens, step.page_size)
            graph = capture_graph(lambda workspace=workspace, out=out: workspace.decode(q, k, v, table, lens, out))
            decode_row = f"{row_name}_decode_graph"
            rows[decode_row] = _timed_row(graph.replay, flusher, reps, out=out, reference=reference,
                                          replay=graph.replay)
            if "target_ctas" in options:
                rows[decode_row]["target_ctas"] = options["target_ctas"]

    # The serving form: the caller has written the step into the bucket's buffers; the host asks
    # the route and replays. The pinned policy keeps the case's route on this split count; the
    # route's own planner plans it (device_planner).
    routed = RoutedGraphStep(PinnedRoutePolicy(StepRoute(route, splits)), shape, k, v, max_pages=table.shape[1])
    buffers = routed.buffers(len(lengths))
    buffers.q.copy_(q)
    buffers.block_table.copy_(table)
    buffers.seq_lens.copy_(lens)
    routed.run(host_lens)  # captures the route's graph
    (graph,) = routed.captured_graphs()
    rows["routed_graph"] = _timed_row(lambda: routed.run(host_lens), flusher, reps, out=buffers.out,
                                      reference=reference, replay=graph.replay)

    best = None
    for label in flashinfer_roles(device):
        engine = build_engine(label, shape=shape, device=device)
        engine.prepare(step, q, k, v)
        fi_plan = engine.plan(step)
        device_us = time_device_us(lambda: engine.run(q, k, v, fi_plan), flusher=flusher, reps=reps).median_us
        if best is None or device_us < best[1]:
            planned_run = lambda engine=engine: engine.run(q, k, v, engine.plan(step))  # noqa: E731
            best = (label, device_us, time_wall_us(planned_run, reps=reps, device=device),
                    time_host_us(planned_run, reps=reps, device=device))
    rows["flashinfer"] = {"path": best[0], "device_us": best[1], "wall_us": best[2], "host_us": best[3]}

    # FlashInfer's CUDA-graph mode, as serving engines and Table 9's graph rows run it: its decode
    # wrapper on tensor and on CUDA cores, planned on the host every step outside the graph, the
    # graph replayed (the holistic path has no graph mode). Device time of the replay alone.
    for label, tensor_cores in (FLASHINFER_GRAPH_ROWS if is_cuda(device) else {}).items():
        decode = FlashInferGraphDecode(shape, len(lengths), table.shape[1], step.page_size, q.device, tensor_cores)
        fi_out = torch.empty_like(q)

        def plan_on_host(decode=decode):
            decode.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, q.dtype, k.dtype)
        plan_on_host()
        graph = capture_graph(lambda decode=decode, fi_out=fi_out: decode.run(q, k, v, out=fi_out))

        def planned_replay(graph=graph, plan_on_host=plan_on_host):
            plan_on_host()
            graph.replay()
        rows[label] = _timed_row(planned_replay, flusher, reps, device_fn=graph.replay, replay=graph.replay,
                                 out=fi_out, reference=reference)
    log(f"{name:<11} S={splits:<3}" + "".join(
        f"{label:>22} {r['device_us']:7.1f} / {r['wall_us']:7.1f} / {r['host_us']:6.1f}" for label, r in rows.items()))
    return {"seq_lens": list(map(int, lengths)), "num_splits": splits, "routed_route": route, "engines": rows}


def run_cases(cases: dict, shape, reps, seed, log, *, device="cuda", dtype="float16") -> dict:
    """{name: run_case's record} of each (lengths, split count, route) of ``cases``, on ``device``."""
    log("case        split" + "".join(f"{label:>22} {'device':>7} / {'wall':>7} / {'host':>6}" for label in ROWS))
    flusher = L2Flusher(device)
    return {name: run_case(name, *case, shape, flusher, reps, seed, log, dtype=dtype) for name, case in cases.items()}


def main(argv=None) -> int:
    args = bench_parser(__doc__, CASES, reps=30, seed=20260622).parse_args(argv)
    config = {"cases": args.cases, "reps": args.reps}
    if not torch.cuda.is_available():
        return write_skipped_no_gpu(args.out, "pkv.measure.device_step_bench/10", config, args.seed)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cases = run_cases({name: CASES[name] for name in args.cases}, ModelShape(), args.reps, args.seed, log)
    write_json_atomic(args.out, {"schema": "pkv.measure.device_step_bench/10", "cases": cases,
                                 "provenance": collect_provenance(config=config, seed=args.seed)})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
