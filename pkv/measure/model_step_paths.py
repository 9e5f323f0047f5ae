"""How each engine runs inside a model step, eager and replayed from a CUDA graph (Table 9).

A path serves one (engine, mode). ``prepare(step)`` does the untimed one-off work (FlashInfer's
path probe, graph capture for a new batch size); ``plan(step, x)`` is the step's host work (the
engine's plan, uploads, copies into a graph's static buffers), timed as part of the wall step;
``issue()`` queues the step's kernels and returns its output, and may be called again to time the
same planned step on the device.

Eager paths plan once per step and run the engine per layer: planning depends only on the lengths,
which every layer shares. Graph paths capture the whole step once per batch size:

* FlashInfer: ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)`` on the kernel family its
  best-path probe picked (the holistic path has no graph wrapper: tensor cores stand in, recorded),
  planned on the host outside the graph every step, as serving engines run it;
* XQA: no plan; the graph reads a static block table and lengths buffer;
* adaptive: the policy's route per step; PersistentKV routes through ``DeviceDecodeStep`` (the
  workqueue planned by a kernel once per step inside the graph, then decoded per layer), steps the
  policy sends to FlashInfer through FlashInfer's graph path.
"""

from __future__ import annotations

import torch

from pkv.cuda_graphs import capture_graph
from pkv.engines.base import EngineUnavailable, upload_block_table
from pkv.engines.device_step import PLANNER_LABELS, DeviceDecodeStep, device_planner, device_step_config
from pkv.engines.flashinfer import GRAPH_PATHS, FlashInferGraphDecode
from pkv.measure.model_step import ModelStep, skip_attend
from pkv.policy.route import ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE

MODES = ("eager", "graph")


class EagerPath:
    """An engine's plan once per step, its run per layer; ``engine=None`` leaves attention out."""

    mode = "eager"

    def __init__(self, label: str, engine, model: ModelStep) -> None:
        self.label, self.engine, self.model = label, engine, model
        self.implementation = engine.implementation if engine is not None else "no attention"
        self._inputs = None
        self.route = self.split_rule = self.num_splits = None  # of the step last planned

    @property
    def under_study(self) -> bool:
        """Whether a wrong output of this path stops the run: its engine's Engine.under_study."""
        return self.engine is not None and self.engine.under_study

    def route_of(self, plan) -> str | None:
        return getattr(plan, "route", None)

    def prepare(self, step, x) -> None:
        if self.engine is not None:
            q = torch.zeros(step.batch_size, self.model.shape.num_qo_heads, self.model.shape.head_dim,
                            dtype=self.model.dtype, device=self.model.device)
            self.engine.prepare(step, q, self.model.k_pages[0], self.model.v_pages[0])

    def plan(self, step, x) -> None:
        device = self.model.device
        plan = self.engine.plan(step) if self.engine is not None else None
        tables, _ = upload_block_table(step, device)
        self._inputs = (x, tables["block_table"], tables["seq_lens"], plan)
        self.route = self.route_of(plan)
        self.split_rule = getattr(plan, "split_rule", None)
        self.num_splits = getattr(plan, "num_splits", None)

    def issue(self) -> torch.Tensor:
        x, table, lens, plan = self._inputs
        if self.engine is None:
            return self.model.forward(x, table, lens, skip_attend)
        k, v, run = self.model.k_pages, self.model.v_pages, self.engine.run
        return self.model.forward(x, table, lens, lambda layer, q: run(q, k[layer], v[layer], plan))


class _Static:
    """One batch size's static inputs and captured graph."""

    def __init__(self, model: ModelStep, batch: int, max_pages: int) -> None:
        self.x = torch.zeros(batch, model.shape.hidden, dtype=model.dtype, device=model.device)
        self.table = torch.zeros(batch, max_pages, dtype=torch.int32, device=model.device)
        self.lens = torch.ones(batch, dtype=torch.int32, device=model.device)
        self.graph = None
        self.out = None

    def load(self, step, x) -> None:
        self.x.copy_(x)
        # Columns past a row's pages keep stale ids: no engine reads past ceil(seq_len / P).
        tables, _ = upload_block_table(step, self.table.device)
        self.table[:, :step.block_table.shape[1]].copy_(tables["block_table"])
        self.lens.copy_(tables["seq_lens"])


class GraphPath:
    """The whole step captured once per (batch size, what the attention runs) and replayed."""

    mode = "graph"

    def __init__(self, label: str, model: ModelStep, max_pages: int) -> None:
        if model.device.type != "cuda":
            raise EngineUnavailable(f"CUDA graphs need a CUDA device, got {model.device}")
        self.label, self.model, self.max_pages = label, model, int(max_pages)
        self._static: dict = {}
        self._current = None
        # Of the step last planned: StepRoute.name, .split_rule and .num_splits where a route has them.
        self.route = self.split_rule = self.num_splits = None

    @property
    def under_study(self) -> bool:
        """Whether a wrong output of this path stops the run: the Engine.under_study of the engine
        whose attention it captures (``engine``, set by the subclasses that capture one)."""
        engine = getattr(self, "engine", None)
        return engine is not None and engine.under_study

    # Subclasses: the key of the graph a step replays, its host plan, and the attention it captures.
    def key(self, step):
        return step.batch_size

    def host_plan(self, step, static) -> None:
        pass

    def attend_for(self, key, static):
        return skip_attend

    def prologue(self, key, static) -> None:
        """Work captured once per step before the layers (the device plan)."""

    def _capture(self, key, step, x) -> None:
        static = _Static(self.model, step.batch_size, self.max_pages)
        static.load(step, x)
        self.host_plan(step, static)
        attend = self.attend_for(key, static)

        def body():
            self.prologue(key, static)
            return self.model.forward(static.x, static.table, static.lens, attend)

        def captured():
            static.out = body()  # the graph's output buffer: the captured run's is the one replays write
        static.graph = capture_graph(captured)
        self._static[key] = static

    def prepare(self, step, x) -> None:
        self._prepare_key(self.key(step), step, x)

    def _prepare_key(self, key, step, x) -> None:
        if key not in self._static:
            self._capture(key, step, x)

    def plan(self, step, x) -> None:
        self._plan_key(self.key(step), step, x)

    def _plan_key(self, key, step, x) -> None:
        static = self._static[key]
        static.load(step, x)
        self.host_plan(step, static)
        self._current = static

    def issue(self) -> torch.Tensor:
        self._current.graph.replay()
        return self._current.out


class SkipGraphPath(GraphPath):
    """The step without attention, replayed: the rest of the step in graph mode."""

    implementation = "no attention"


class FlashInferGraphPath(GraphPath):
    """FlashInfer's CUDA-graph decode wrapper, planned outside the graph: one graph per batch size
    and fa2 path, the path each step's batch class runs by FlashInfer's probe (its pick, or where
    the pick has no graph wrapper, the faster fa2 path), as a server would keep a wrapper of each."""

    def __init__(self, label: str, model: ModelStep, max_pages: int, engine) -> None:
        super().__init__(label, model, max_pages)
        version = getattr(engine, "version", None)  # FlashInferEngine's; its stand-ins have none
        if version is None:
            raise EngineUnavailable(f"FlashInfer's CUDA-graph decode needs FlashInfer, got {engine.implementation}")
        self.engine = engine  # the FlashInfer engine whose probe picks the kernel family
        self.implementation = f"flashinfer-{version}-cuda_graph"
        self.route = ROUTE_FLASHINFER
        self.paths: dict[int, set[str]] = {}  # batch size -> the paths its steps' graphs ran, as labelled

    def key(self, step):
        """(batch size, the fa2 path of the step's batch class), asked of the probe once a step (every
        plan and prepare asks for the key), and the path recorded under the batch size as it ran."""
        picked = self.engine.path_for(step)
        graphed = picked if picked in GRAPH_PATHS else self.engine.path_among(step, GRAPH_PATHS) or "tc"
        self.paths.setdefault(step.batch_size, set()).add(
            graphed if graphed == picked else f"{graphed} (picked {picked}, no graph wrapper)")
        return step.batch_size, graphed

    def prepare(self, step, x) -> None:
        q = torch.zeros(step.batch_size, self.model.shape.num_qo_heads, self.model.shape.head_dim,
                        dtype=self.model.dtype, device=self.model.device)
        self.engine.prepare(step, q, self.model.k_pages[0], self.model.v_pages[0])
        super().prepare(step, x)

    def attend_for(self, key, static):
        _, path = key
        static.decode = FlashInferGraphDecode(self.model.shape.attention, static.x.shape[0], self.max_pages,
                                              self.model.page_size, self.model.device, path != "cc")
        self._plan(static)
        k, v = self.model.k_pages, self.model.v_pages
        return lambda layer, q: static.decode.run(q, k[layer], v[layer])

    def host_plan(self, step, static) -> None:
        static.step = step
        if hasattr(static, "decode"):
            self._plan(static)

    def _plan(self, static) -> None:
        step, dtype = static.step, self.model.dtype
        static.decode.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, dtype, dtype)

    def path_labels(self) -> dict[str, str]:
        """{batch size: the paths its steps' graphs ran}, as results record them."""
        return {str(batch): ", ".join(sorted(labels)) for batch, labels in sorted(self.paths.items())}


class XqaGraphPath(GraphPath):
    """XQA replayed: no plan, the graph reads the static block table and lengths."""

    def __init__(self, label: str, model: ModelStep, max_pages: int, engine) -> None:
        super().__init__(label, model, max_pages)
        self.engine = engine
        self.implementation = engine.implementation + "+cuda_graph"
        self.route = "xqa"

    def attend_for(self, key, static):
        k, v, decode = self.model.k_pages, self.model.v_pages, self.engine.decode
        lens = static.lens.view(torch.uint32)  # XQA reads uint32 lengths; the values fit int32
        # The longest length the table addresses, fixed at capture as a serving engine fixes max_model_len.
        max_len = self.max_pages * self.model.page_size
        return lambda layer, q: decode(q, k[layer], v[layer], static.table, lens, max_len)


class AdaptiveGraphPath(GraphPath):
    """The policy's route per step: PersistentKV through DeviceDecodeStep, FlashInfer through its graph path."""

    def __init__(self, label: str, model: ModelStep, max_pages: int, engine, flashinfer_path,
                 max_batch: int) -> None:
        super().__init__(label, model, max_pages)
        self.max_batch = int(max_batch)
        self.engine = engine  # the adaptive engine: its policy routes each step
        self.policy = engine.policy
        self.flashinfer_path = flashinfer_path
        self._device_step = DeviceDecodeStep
        self._workspaces: dict[tuple, object] = {}
        planners = ", ".join(f"{r}: {PLANNER_LABELS[device_planner(r)]}" for r in (ROUTE_BUCKET, ROUTE_WORKQUEUE))
        self.implementation = f"device step ({planners})+cuda_graph | {flashinfer_path.implementation}"

    def _route(self, step):
        return self.policy.choose(step).route

    def key(self, step):
        # What GraphPath's key() answers, for any caller; prepare() and plan() below ask the policy
        # once and key the step by the route they got instead.
        return self._key(step, self._route(step))

    @staticmethod
    def _key(step, route):
        # Only PersistentKV routes have one: prepare() and plan() hand FlashInfer's steps to its own path.
        return (step.batch_size, device_step_config(route))

    def prepare(self, step, x) -> None:
        route = self._route(step)
        if route.name == ROUTE_FLASHINFER:
            self.flashinfer_path.prepare(step, x)
        else:
            self._prepare_key(self._key(step, route), step, x)

    def attend_for(self, key, static):
        batch, config = key
        ws = self._workspaces.get(config)
        if ws is None:  # one workspace per device-step config, shared by the graphs of every batch size
            ws = self._workspaces[config] = self._device_step(
                self.model.shape.attention, max_batch=self.max_batch, device=self.model.device, **config._asdict())
        static.device_step = ws
        static.outs = [torch.empty(batch, self.model.shape.num_qo_heads, self.model.shape.head_dim,
                                   dtype=self.model.dtype, device=self.model.device)
                       for _ in range(self.model.layers)]
        k, v = self.model.k_pages, self.model.v_pages
        return lambda layer, q: ws.decode(q, k[layer], v[layer], static.table, static.lens, static.outs[layer])

    def prologue(self, key, static) -> None:
        # One plan per step, inside the graph: the lengths are the same in every layer.
        static.device_step.plan(static.table, static.lens, self.model.page_size)

    def plan(self, step, x) -> None:
        route = self._route(step)
        self.route, self.split_rule = route.name, route.split_rule
        self.num_splits = None if route.name == ROUTE_FLASHINFER else int(route.num_splits)
        if route.name == ROUTE_FLASHINFER:
            self.flashinfer_path.plan(step, x)
            self._current = None
        else:
            self._plan_key(self._key(step, route), step, x)

    def issue(self) -> torch.Tensor:
        if self._current is None:
            return self.flashinfer_path.issue()
        return super().issue()
