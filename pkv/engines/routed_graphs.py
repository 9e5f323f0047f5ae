"""A decode step's route under CUDA graphs, for a serving engine that replays graphs
(DESIGN.md, "Inside a serving engine").

The host's whole share of a step is to ask the calibrated route policy with the lengths its
scheduler already holds (``RoutePolicy.choose`` reads nothing else of a step) and to replay the
graph captured for that route and the step's batch-size bucket:

- a PersistentKV route replays a ``DeviceDecodeStep`` graph of the route's device-step config
  (``device_step_config``: its split count, its merge, a cluster merge running as a merge launch,
  its planner: the in-decode grid for a bucket route, the plan kernel's workqueue for the
  others, and a workqueue route's split rule, fixed or balanced): the split ranges are found on
  the GPU inside the graph, so one graph serves any lengths;
- a FlashInfer step replays FlashInfer's CUDA-graph decode wrapper. FlashInfer plans on the host
  (on Hopper it has no device-side plan), so its plan() runs every such step, outside the graph,
  from the host lengths and page table, as serving engines that use it do.

The caller owns nothing per step but the contents of ``buffers(batch)``: it writes the step's
queries, page table and lengths there (rows past the batch are set to length 0 here, so they get
no task) and reads the output from the same place. The page table is a block table, or with
``page_lists=True`` FlashInfer-style page lists (pkv.page_table.PageLists) in a flat list of
``bucket x max_pages`` entries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pkv.cuda_graphs import capture_graph
from pkv.engines.device_step import (PLANNERS, DeviceDecodeStep, DeviceStepConfig, GraphedDecodeStep, check_lengths,
                                     device_step_config)
from pkv.engines.flashinfer import FlashInferGraphDecode
from pkv.page_table import PageLists, host_row_entries, list_lengths
from pkv.policy.route import ROUTE_FLASHINFER

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepBuffers(NamedTuple):
    """The static tensors one batch-size bucket's graphs read and write (block-table form)."""

    q: torch.Tensor  # [bucket, Hq, d]
    block_table: torch.Tensor  # int32 [bucket, max_pages]
    seq_lens: torch.Tensor  # int32 [bucket]
    out: torch.Tensor  # [bucket, Hq, d]


class ListStepBuffers(NamedTuple):
    """The same, with the page table as page lists: the caller writes indptr[:batch + 1] and the
    lists into indices; rows past the batch get empty lists here."""

    q: torch.Tensor  # [bucket, Hq, d]
    page_lists: PageLists  # indptr int32 [bucket + 1], indices int32 [bucket * max_pages]
    seq_lens: torch.Tensor  # int32 [bucket]
    out: torch.Tensor  # [bucket, Hq, d]


class _HostLengths:
    """What the route policy reads of a step: its lengths, as the scheduler holds them."""

    __slots__ = ("seq_lens",)

    def __init__(self, seq_lens) -> None:
        self.seq_lens = seq_lens


class _FlashInferGraphPath:
    """FlashInfer's CUDA-graph decode for one bucket: every step's rows padded to the bucket (its
    batch size is fixed per wrapper) and planned on the host."""

    def __init__(self, shape, bucket: int, max_pages: int, page_size: int, device, use_tensor_cores: bool) -> None:
        self.bucket, self.page_size = bucket, page_size
        self.decode = FlashInferGraphDecode(shape, bucket, max_pages, page_size, device, use_tensor_cores)

    def plan(self, host_lens, host_table, q_dtype, kv_dtype) -> None:
        lens = np.asarray(host_lens, dtype=np.int64)
        batch, page = len(lens), self.page_size
        table = host_table if isinstance(host_table, tuple) else np.asarray(host_table)
        # A length past the row's own pages attends over the pages it has, as the PersistentKV
        # routes' kernels clamp it (split_decode.cuh, row_length): never into another row's pages.
        row_pages = list_lengths(table[0], len(table[1]), "RoutedGraphStep host_table") if isinstance(
            table, tuple) else table.shape[1]
        lens = np.minimum(lens, np.asarray(row_pages, dtype=np.int64) * page)
        # The bucket's padding rows read one token of page 0: their output rows are never read.
        pages = np.ones(self.bucket, dtype=np.int64)
        pages[:batch] = np.maximum(-(-lens // page), 1)
        last = np.ones(self.bucket, dtype=np.int32)
        last[:batch] = np.where(lens > 0, lens - (pages[:batch] - 1) * page, 1)
        indices = np.concatenate([host_row_entries(table, row, int(pages[row])) for row in range(batch)]
                                 + [np.zeros(self.bucket - batch, dtype=np.int32)])
        self.decode.plan(np.concatenate(([0], np.cumsum(pages))), indices, last, q_dtype, kv_dtype)

    def run(self, buffers, k_pages, v_pages) -> None:
        self.decode.run(buffers.q, k_pages, v_pages, out=buffers.out)


class RoutedGraphStep:
    """Captured graphs per (batch-size bucket, route) over one KV pool, chosen per step on the host."""

    def __init__(self, policy, shape, k_pages, v_pages, *, max_pages: int,
                 batch_buckets=DEFAULT_BATCH_BUCKETS, stages: int = 2, use_tensor_cores: bool = True,
                 debug_checks: bool = False, planner: str | None = None, page_lists: bool = False) -> None:
        buckets = sorted({int(b) for b in batch_buckets})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"RoutedGraphStep: batch_buckets must be positive sizes, got {batch_buckets!r}")
        if planner is not None and planner not in PLANNERS:
            raise ValueError(f"RoutedGraphStep: planner must be None or one of {PLANNERS}, got {planner!r}")
        self.policy, self.shape = policy, shape
        self.k_pages, self.v_pages = k_pages, v_pages
        self.max_pages, self.page_size = int(max_pages), int(k_pages.shape[2])
        self.batch_buckets = tuple(buckets)
        self.stages, self.use_tensor_cores, self.debug_checks = int(stages), bool(use_tensor_cores), debug_checks
        # How the PersistentKV graphs plan their splits (DeviceDecodeStep's PLANNERS); None: each
        # route's own (device_planner).
        self.planner = planner
        self.page_lists = bool(page_lists)  # the page table's form in the buffers
        self.device = k_pages.device
        self._buffers: dict[int, StepBuffers | ListStepBuffers] = {}
        self._last_batch: dict[int, int] = {}
        self._persistent: dict[DeviceStepConfig, GraphedDecodeStep] = {}  # its graphs, one per bucket
        # What a step replays and returns, held per (bucket, route) and (bucket, batch): the host's
        # share of a step is the route check and the replay, with no lookups besides these two.
        self._replays: dict[tuple, object] = {}
        self._out_rows: dict[tuple, torch.Tensor] = {}
        self._flashinfer: dict[int, tuple[_FlashInferGraphPath, torch.cuda.CUDAGraph | None]] = {}
        self.last_route = None

    def bucket_of(self, batch: int) -> int:
        for bucket in self.batch_buckets:
            if batch <= bucket:
                return bucket
        raise ValueError(f"RoutedGraphStep: batch {batch} exceeds the largest bucket {self.batch_buckets[-1]}")

    def buffers(self, batch: int) -> StepBuffers | ListStepBuffers:
        """The first ``batch`` rows of the bucket's static tensors: where the caller writes a step
        (with page lists: indptr's first batch + 1 entries and the whole flat list)."""
        bucket = self.bucket_of(batch)
        if bucket not in self._buffers:
            q_like = dict(dtype=self.k_pages.dtype, device=self.device)
            int32 = dict(dtype=torch.int32, device=self.device)
            shape = self.shape
            q = torch.zeros(bucket, shape.num_qo_heads, shape.head_dim, **q_like)
            out = torch.zeros(bucket, shape.num_qo_heads, shape.head_dim, **q_like)
            if self.page_lists:
                lists = PageLists(torch.zeros(bucket + 1, **int32), torch.zeros(bucket * self.max_pages, **int32))
                self._buffers[bucket] = ListStepBuffers(q, lists, torch.zeros(bucket, **int32), out)
            else:
                self._buffers[bucket] = StepBuffers(q, torch.zeros(bucket, self.max_pages, **int32),
                                                    torch.zeros(bucket, **int32), out)
            self._last_batch[bucket] = bucket
        full = self._buffers[bucket]
        if self.page_lists:
            return ListStepBuffers(full.q[:batch], PageLists(full.page_lists.indptr[:batch + 1],
                                                             full.page_lists.indices),
                                   full.seq_lens[:batch], full.out[:batch])
        return StepBuffers(*(t[:batch] for t in full))

    def route(self, host_lens):
        """The route the policy takes for these lengths (a StepRoute)."""
        return self.policy.choose(_HostLengths(host_lens)).route

    def run(self, host_lens, host_table=None) -> torch.Tensor:
        """Replay the step the caller wrote into ``buffers(len(host_lens))``; returns its output
        rows. ``host_table`` is the page table as the scheduler holds it on the host: the block
        table, or with page lists the pair (indptr, indices). It is read on steps the policy sends
        to FlashInfer, whose plan needs it on the host, and with page lists by the debug check."""
        batch = len(host_lens)
        bucket = self.bucket_of(batch)
        full = self._buffers.get(bucket)
        if full is None:
            raise ValueError(f"RoutedGraphStep.run: write the step into buffers({batch}) first")
        if self.debug_checks:  # the host holds the lengths: no device check and no synchronization needed
            if self.page_lists and host_table is None:
                raise ValueError("RoutedGraphStep.run: debug_checks with page lists need host_table=(indptr, indices)")
            if self.page_lists and np.shape(host_table[0]) != (batch + 1,):
                raise ValueError(f"RoutedGraphStep.run: host_table's indptr must have {batch + 1} entries "
                                 f"(the batch's rows + 1), got {np.shape(host_table[0])}")
            row_pages = (list_lengths(host_table[0], len(host_table[1]), "RoutedGraphStep host_table")
                         if self.page_lists else self.max_pages)
            check_lengths(host_lens, row_pages, self.page_size, "RoutedGraphStep")
        if batch < self._last_batch[bucket]:
            full.seq_lens[batch:].zero_()  # padding rows: length 0, no task, output never read
        self._last_batch[bucket] = batch
        route = self.last_route = self.route(host_lens)
        if route.name == ROUTE_FLASHINFER:
            if host_table is None:
                raise ValueError("RoutedGraphStep.run: this step routes to FlashInfer, whose plan needs host_table")
            self._replay_flashinfer(bucket, full, host_lens, host_table)
        else:
            key = (bucket, route)  # every field of the route: its split rule and merge select the graph
            replay = self._replays.get(key)
            if replay is None:
                if self.page_lists and batch < bucket:
                    # Capture runs the step once eagerly, whose host check reads every row's list:
                    # the padding rows get empty ones. Replays need none (a row of length 0 reads
                    # no entry whatever its indptr), so later steps skip this copy.
                    indptr = full.page_lists.indptr
                    indptr[batch + 1:].copy_(indptr[batch].expand(bucket - batch))
                replay = self._replays[key] = self._graphed(device_step_config(route, self.planner)).static_replay(full)
            replay()
        rows = self._out_rows.get((bucket, batch))
        if rows is None:
            rows = self._out_rows[(bucket, batch)] = full.out[:batch]
        return rows

    def captured_graphs(self) -> list:
        """The CUDA graphs captured so far: every PersistentKV route's, then FlashInfer's."""
        return ([graph for graphed in self._persistent.values() for graph in graphed.captured_graphs()]
                + [graph for _, graph in self._flashinfer.values() if graph is not None])

    def _graphed(self, config: DeviceStepConfig) -> GraphedDecodeStep:
        if config not in self._persistent:
            workspace = DeviceDecodeStep(self.shape, max_batch=self.batch_buckets[-1], device=self.device,
                                         stages=self.stages, **config._asdict())
            self._persistent[config] = GraphedDecodeStep(workspace, self.k_pages, self.v_pages, self.max_pages)
        return self._persistent[config]

    def _replay_flashinfer(self, bucket: int, full, host_lens, host_table) -> None:
        path, graph = self._flashinfer.get(bucket, (None, None))
        if path is None:
            path = _FlashInferGraphPath(self.shape, bucket, self.max_pages, self.page_size, self.device,
                                        self.use_tensor_cores)
        path.plan(host_lens, host_table, full.q.dtype, self.k_pages.dtype)
        if graph is None:
            graph = capture_graph(lambda: path.run(full, self.k_pages, self.v_pages))
            self._flashinfer[bucket] = (path, graph)
        graph.replay()
