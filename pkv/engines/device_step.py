"""A decode step planned on the GPU, for a serving engine that plans once per step and replays
CUDA graphs (DESIGN.md, "Inside a serving engine").

``DeviceDecodeStep`` is the workspace: allocated once for (max batch, num_splits), it plans the
compact workqueue from ``seq_lens`` and the block table the caller already holds on the GPU
(csrc/device_plan.cu: no host synchronization, no copy, no upload) and runs the decode and merge
into a caller-owned ``out``. Its launch shapes depend on the batch size only, so
``GraphedDecodeStep`` captures one step per batch size and replays it for any lengths.

The split rule is the fixed one of the workqueue route (pkv.pipeline.schedule.SplitPolicy,
kind "fixed"); the split count comes from the caller's route (pkv.policy), one per captured graph.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv import ops

MAX_DEVICE_PLAN_ROWS = 1024  # kMaxDevicePlanRows in csrc/device_plan.h: one planner CTA, a thread per row
MAX_SPLITS = 1024  # kMaxMergeSlots in csrc/decode_constants.h


def check_lengths(host_lens, table_pages: int, page_size: int, where: str = "DeviceDecodeStep") -> None:
    """Refuse, before any launch, a length the block table cannot address: the error names the row,
    its length and the limit. The device planner would clamp such a row to the table, which
    computes attention over fewer tokens than the caller asked for."""
    lens = np.asarray(host_lens)
    limit = int(table_pages) * int(page_size)
    bad = np.flatnonzero((lens > limit) | (lens < 0))
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"{where}: row {row} has length {int(lens[row])}; the block table's {table_pages} pages "
                         f"of {page_size} tokens address 0..{limit} ({bad.size} row(s) out of range)")


class DeviceDecodeStep:
    """Workspace and launches of a device-planned decode step for up to ``max_batch`` rows."""

    def __init__(self, shape, *, max_batch: int, num_splits: int, device="cuda", stages: int = 2):
        if not 1 <= int(max_batch) <= MAX_DEVICE_PLAN_ROWS:
            raise ValueError(f"DeviceDecodeStep: max_batch must be in 1..{MAX_DEVICE_PLAN_ROWS}, got {max_batch!r}")
        if not 1 <= int(num_splits) <= MAX_SPLITS:
            raise ValueError(f"DeviceDecodeStep: num_splits must be in 1..{MAX_SPLITS}, got {num_splits!r}")
        self.shape = shape
        self.max_batch = int(max_batch)
        self.num_splits = int(num_splits)
        self.stages = int(stages)
        self.ops = ops.load()
        self.device = torch.empty(0, device=device).device  # "cuda" resolved to its index, as tensors report it
        capacity = self.max_batch * shape.num_kv_heads * self.num_splits
        g, d = shape.group_size, shape.head_dim
        int32 = dict(dtype=torch.int32, device=self.device)
        self.tasks = torch.empty(capacity, 5, **int32)
        self.split_offsets = torch.empty(self.max_batch * shape.num_kv_heads + 1, **int32)
        self.counts = torch.zeros(2, **int32)  # (live tasks, most splits of a row) of the last plan
        # One slot per possible task: a plan never has more slots than tasks.
        self.part_m = torch.empty(capacity, g, dtype=torch.float32, device=self.device)
        self.part_l = torch.empty(capacity, g, dtype=torch.float32, device=self.device)
        self.part_acc = torch.empty(capacity, g, d, dtype=torch.float32, device=self.device)

    def _check(self, q, block_table, seq_lens, out) -> int:
        batch = q.shape[0]
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"DeviceDecodeStep: q has {batch} rows; this workspace serves 1..{self.max_batch}")
        if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype != torch.int32 or seq_lens.device != self.device:
            raise ValueError(f"DeviceDecodeStep: seq_lens must be int32 [{batch}] on {self.device}, got "
                             f"{seq_lens.dtype} {tuple(seq_lens.shape)} on {seq_lens.device}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
            raise ValueError(f"DeviceDecodeStep: block_table must be int32 [{batch}, max_pages], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"DeviceDecodeStep: out must be {q.dtype} {tuple(q.shape)} like q, got "
                             f"{out.dtype} {tuple(out.shape)}")
        return batch

    def plan(self, block_table, seq_lens, page_size: int) -> None:
        """Plan the step's workqueue on the GPU from the lengths and the block table's width. A
        model step plans once and decodes every layer with it (the lengths are the same in every
        layer); lengths past what the block table addresses (max_pages x page size) are clamped
        to it, never read beyond it."""
        batch = int(seq_lens.shape[0])
        if not 1 <= batch <= self.max_batch or seq_lens.dtype != torch.int32 or seq_lens.device != self.device:
            raise ValueError(f"DeviceDecodeStep.plan: seq_lens must be int32 [1..{self.max_batch}] on {self.device}, "
                             f"got {seq_lens.dtype} {tuple(seq_lens.shape)} on {seq_lens.device}")
        self._launch_plan(batch, block_table, seq_lens, page_size)

    def decode(self, q, k_pages, v_pages, block_table, seq_lens, out) -> torch.Tensor:
        """Decode into ``out`` with the last ``plan`` (of this batch size); returns ``out``."""
        return self._launch_decode(self._check(q, block_table, seq_lens, out), q, k_pages, v_pages, block_table,
                                   seq_lens, out)

    def run(self, q, k_pages, v_pages, block_table, seq_lens, out, host_lens=None) -> torch.Tensor:
        """Plan on the GPU and decode into ``out``; returns ``out``.

        Eager calls check every length against the block table before launching: from
        ``host_lens`` where the caller has them (a serving scheduler does), else from a copy of
        ``seq_lens`` (one synchronization). Under CUDA-graph capture and torch.compile there is no host check;
        ``GraphedDecodeStep(debug_checks=True)`` checks on the device instead."""
        batch = self._check(q, block_table, seq_lens, out)
        # No host check while a graph is captured or torch.compile traces: both need the step
        # free of host synchronization (the debug check of GraphedDecodeStep runs on the device).
        if not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
            check_lengths(seq_lens.cpu().numpy() if host_lens is None else host_lens, block_table.shape[1],
                          k_pages.shape[2])
        self._launch_plan(batch, block_table, seq_lens, k_pages.shape[2])
        return self._launch_decode(batch, q, k_pages, v_pages, block_table, seq_lens, out)

    # The launches, after the checks of the public calls (each input checked once per call).
    def _launch_plan(self, batch: int, block_table, seq_lens, page_size: int) -> None:
        hkv, splits = self.shape.num_kv_heads, self.num_splits
        max_tokens = min(block_table.shape[1] * int(page_size), 2**31 - 1)
        self.ops.plan_workqueue_on_device(seq_lens, hkv, splits, max_tokens, self.tasks[:batch * hkv * splits],
                                          self.split_offsets[:batch * hkv + 1], self.counts)

    def _launch_decode(self, batch: int, q, k_pages, v_pages, block_table, seq_lens, out) -> torch.Tensor:
        hkv = self.shape.num_kv_heads
        capacity = batch * hkv * self.num_splits
        self.ops.run_workqueue_planned_on_device(q, k_pages, v_pages, block_table, seq_lens, self.tasks[:capacity],
                                                 self.split_offsets[:batch * hkv + 1], self.counts,
                                                 self.shape.sm_scale, self.stages, out, self.part_m[:capacity],
                                                 self.part_l[:capacity], self.part_acc[:capacity])
        return out


class GraphedDecodeStep:
    """CUDA graphs over a DeviceDecodeStep, replayed whatever the lengths.

    ``run`` copies the step's inputs into static buffers of its own (one graph per batch size);
    ``replay_static`` replays a graph captured over buffers the caller owns and writes in place
    (one graph per set of buffers), as a serving engine's persistent input buffers are used."""

    def __init__(self, step: DeviceDecodeStep, k_pages, v_pages, max_pages: int, *, debug_checks: bool = False):
        self.step = step
        self.k_pages, self.v_pages = k_pages, v_pages
        self.max_pages = int(max_pages)
        # debug_checks: each graph also records, on the device, the first row whose length the
        # table cannot address; a replay reads it afterwards (one synchronization) and raises.
        self.debug_checks = bool(debug_checks)
        self._graphs: dict[object, tuple] = {}  # key -> (graph, q, table, lens, out, debug record)

    def _capture(self, key, static) -> tuple:
        static_q, static_table, static_lens, static_out = static
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # first launches outside capture: the shared-memory opt-in
            self.step.run(static_q, self.k_pages, self.v_pages, static_table, static_lens, static_out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        debug = None
        with torch.cuda.graph(graph):
            if self.debug_checks:
                debug = _first_out_of_range(static_lens, static_table.shape[1] * self.k_pages.shape[2])
            self.step.run(static_q, self.k_pages, self.v_pages, static_table, static_lens, static_out)
        self._graphs[key] = (graph, *static, debug)
        return self._graphs[key]

    def _replay(self, entry) -> torch.Tensor:
        graph, _, static_table, _, static_out, debug = entry
        graph.replay()
        if debug is not None:
            found, row, length = debug.tolist()
            if found:
                limit = static_table.shape[1] * self.k_pages.shape[2]
                raise ValueError(f"GraphedDecodeStep (debug check on the device): row {row} has length {length}; "
                                 f"the graph's block table addresses 0..{limit} tokens")
        return static_out

    def run(self, q, block_table, seq_lens) -> torch.Tensor:
        """The output of one replayed step: the graph's static output, valid until the next replay
        of this batch size."""
        batch = q.shape[0]
        if block_table.shape[1] > self.max_pages:
            raise ValueError(f"GraphedDecodeStep: block_table has {block_table.shape[1]} pages a row; the "
                             f"graphs were sized for {self.max_pages}")
        entry = self._graphs.get(batch)
        if entry is None:
            static = (torch.zeros_like(q), torch.zeros(batch, self.max_pages, dtype=torch.int32, device=q.device),
                      torch.ones(batch, dtype=torch.int32, device=q.device), torch.empty_like(q))
            static[2].copy_(seq_lens)  # the first (untimed) launch plans these lengths
            entry = self._capture(batch, static)
        _, static_q, static_table, static_lens, _, _ = entry
        static_q.copy_(q)
        static_table[:, :block_table.shape[1]].copy_(block_table)
        static_lens.copy_(seq_lens)
        return self._replay(entry)

    def replay_static(self, buffers) -> torch.Tensor:
        """Replay the graph of these caller-owned (q, block_table, seq_lens, out) buffers, capturing
        it on first use; the caller has written the step into them. Returns ``out``."""
        key = ("static", buffers[0].data_ptr(), buffers[0].shape[0])
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, tuple(buffers))
        return self._replay(entry)


def _first_out_of_range(lens: torch.Tensor, limit: int) -> torch.Tensor:
    """[any, first row, its length] of the rows outside 0..limit, computed by device ops that a
    graph captures (no host synchronization inside the graph)."""
    bad = (lens > limit) | (lens < 0)
    row = torch.argmax(bad.to(torch.int32))
    return torch.stack((bad.any().to(torch.int64), row.to(torch.int64), lens[row].to(torch.int64)))
