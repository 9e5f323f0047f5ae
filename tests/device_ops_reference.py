"""The device step's four ops (csrc/pkv_ops.cpp) written in torch, as their contracts say, so
pkv.engines.device_step runs end to end on the CPU: its checks, its per-batch views, both
planners, both merges and both page-table forms, against float64. The CUDA kernels are held to
the same outputs by tests/test_device_step_gpu.py.

Partial states keep m in the natural-log domain, as the kernels write them.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.pipeline.schedule import TILE_TOKENS, SplitPolicy, max_workqueue_tasks, plan_workqueue_device_order


def _row_pages(table, page_indptr, row: int) -> torch.Tensor:
    if page_indptr is None:
        return table[row]
    return table[int(page_indptr[row]):int(page_indptr[row + 1])]


def _row_length(seq_lens, table, page_indptr, page_size: int, row: int) -> int:
    """csrc/split_decode.cuh row_length: the length clamped to what the row's entries address."""
    entries = table.shape[1] if page_indptr is None else int(page_indptr[row + 1]) - int(page_indptr[row])
    return max(0, min(int(seq_lens[row]), max(0, entries) * page_size))


def _split_state(q, k_pages, v_pages, pages, kvh: int, group: int, begin: int, end: int, scale: float):
    """(m, l, acc) of the G query heads of (row, kvh) over tokens [begin, end)."""
    page_size = k_pages.shape[2]
    tokens = torch.arange(begin, end)
    physical = pages[tokens // page_size].long()
    k = k_pages[physical, kvh, tokens % page_size].double()  # [T, d]
    v = v_pages[physical, kvh, tokens % page_size].double()
    qg = q[kvh * group:(kvh + 1) * group].double()  # [G, d]
    scores = qg @ k.T * scale  # [G, T]
    m = scores.max(dim=1).values
    weights = torch.exp(scores - m[:, None])
    return m, weights.sum(dim=1), weights @ v


def _merge(part_m, part_l, part_acc, slots, out_rows, dtype):
    m = part_m[slots].double()  # [S, G]
    top = m.max(dim=0).values
    w = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - top))
    total = (w[..., None] * part_acc[slots].double()).sum(dim=0)
    out_rows.copy_((total / (w * part_l[slots].double()).sum(dim=0)[:, None]).to(dtype))


class ReferenceOps:
    """torch.ops.pkv's device-step ops, run in torch on any device."""

    def plan_workqueue_on_device(self, seq_lens, num_kv_heads, num_splits, max_tokens, tasks, split_offsets,
                                 counts, page_indptr=None, page_size=0, balanced=False, max_splits=0, target_ctas=0,
                                 min_tiles_per_split=1):
        lens = seq_lens.cpu().numpy()
        row_tokens = None
        if page_indptr is not None:
            if not 1 <= page_size <= 2**31 - 1:
                raise RuntimeError(f"pkv: with page_indptr, page_size (tokens a page) must be given, got {page_size}")
            row_tokens = np.diff(page_indptr.cpu().numpy().astype(np.int64)) * int(page_size)
        if balanced and not (1 <= max_splits <= 1024 and 0 <= target_ctas <= 2**31 - 1
                             and 1 <= min_tiles_per_split <= 2**31 - 1):
            raise RuntimeError(f"pkv: the balanced rule needs max_splits in 1..1024, target_ctas in 0..2^31-1 and "
                               f"min_tiles_per_split in 1..2^31-1, got {max_splits}, {target_ctas} and "
                               f"{min_tiles_per_split}")
        policy = (SplitPolicy("balanced", num_splits, max_splits, target_ctas, min_tiles_per_split) if balanced
                  else SplitPolicy("fixed", num_splits))
        capacity = max_workqueue_tasks(seq_lens.shape[0], num_kv_heads, policy)
        if tasks.shape[0] < capacity:
            raise RuntimeError(f"pkv: tasks must be contiguous [>= {capacity} (the most tasks the split rule gives "
                               f"B={seq_lens.shape[0]} rows), 5], got {tuple(tasks.shape)}")
        plan = plan_workqueue_device_order(lens, num_kv_heads, 1, policy, max_tokens, row_tokens=row_tokens)
        tasks[:plan.tasks.shape[0]] = torch.from_numpy(plan.tasks)
        split_offsets.copy_(torch.from_numpy(plan.split_offsets))
        counts.copy_(torch.tensor([plan.tasks.shape[0], plan.max_splits], dtype=torch.int32))

    def run_workqueue_planned_on_device(self, q, k_pages, v_pages, table, seq_lens, tasks, split_offsets, counts,
                                        sm_scale, stages, out, part_m, part_l, part_acc, page_indptr=None,
                                        pair_counters=None):
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        group = q.shape[1] // hkv
        offsets = split_offsets.tolist()
        for row, kvh, split, tb, te in tasks[:int(counts[0])].tolist():
            length = _row_length(seq_lens, table, page_indptr, page, row)
            state = _split_state(q[row], k_pages, v_pages, _row_pages(table, page_indptr, row), kvh, group,
                                 tb * TILE_TOKENS, min(te * TILE_TOKENS, length), sm_scale)
            pair = row * hkv + kvh
            if offsets[pair + 1] - offsets[pair] == 1:  # one split: the output directly
                out[row, kvh * group:(kvh + 1) * group] = (state[2] / state[1][:, None]).to(out.dtype)
                continue
            slot = offsets[pair] + split
            part_m[slot], part_l[slot], part_acc[slot] = state
        for pair in range(len(offsets) - 1):  # the merge, fused or launched: the same combination
            if offsets[pair + 1] - offsets[pair] > 1:
                row, kvh = divmod(pair, hkv)
                _merge(part_m, part_l, part_acc, slice(offsets[pair], offsets[pair + 1]),
                       out[row, kvh * group:(kvh + 1) * group], out.dtype)

    def bucket_decode(self, q, k_pages, v_pages, table, seq_lens, row_indices, num_splits, sm_scale, out, part_m,
                      part_l, part_acc, pair_counters, stages=3, cluster_merge=False, page_indptr=None,
                      live_splits_only=False):
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        group = q.shape[1] // hkv
        fused = pair_counters is not None and num_splits > 1
        for r, row in enumerate(row_indices.tolist()):
            tiles = -(-_row_length(seq_lens, table, page_indptr, page, row) // TILE_TOKENS)
            per_split = -(-tiles // num_splits)
            live = -(-tiles // per_split) if per_split else 0
            merged = live if fused and live_splits_only else num_splits
            length = _row_length(seq_lens, table, page_indptr, page, row)
            for kvh in range(hkv):
                pair = r * hkv + kvh
                heads = slice(kvh * group, (kvh + 1) * group)
                for split in range(num_splits):
                    slot = pair * num_splits + split
                    begin, end = split * per_split, min((split + 1) * per_split, tiles)
                    if begin >= end:
                        if not (fused and live_splits_only):
                            part_m[slot], part_l[slot], part_acc[slot] = float("-inf"), 0.0, 0.0
                        continue
                    m, l, acc = _split_state(q[row], k_pages, v_pages, _row_pages(table, page_indptr, row), kvh,
                                             group, begin * TILE_TOKENS, min(end * TILE_TOKENS, length), sm_scale)
                    if merged == 1:
                        out[row, heads] = (acc / l[:, None]).to(out.dtype)
                    else:
                        part_m[slot], part_l[slot], part_acc[slot] = m, l, acc
                if fused and merged > 1:
                    _merge(part_m, part_l, part_acc, slice(pair * num_splits, pair * num_splits + merged),
                           out[row, heads], out.dtype)

    def merge_states(self, part_m, part_l, part_acc, row_indices, split_offsets, num_kv_heads, num_splits, out):
        group = out.shape[1] // num_kv_heads
        assert split_offsets is None, "the device step merges bucket grids in uniform mode only"
        for r, row in enumerate(row_indices.tolist()):
            for kvh in range(num_kv_heads):
                pair = r * num_kv_heads + kvh
                _merge(part_m, part_l, part_acc, slice(pair * num_splits, (pair + 1) * num_splits),
                       out[row, kvh * group:(kvh + 1) * group], out.dtype)


class RecordedGraph:
    """A CUDA graph stand-in for the CPU: what the ops do while it captures is kept and done again
    on each replay, over the same (static) tensors, as a CUDA graph replays its kernels."""

    capturing: list | None = None  # the calls of the graph being captured

    def __init__(self) -> None:
        self.calls: list = []

    def replay(self) -> None:
        for op, args, kwargs in self.calls:
            op(*args, **kwargs)


class RecordingOps(ReferenceOps):
    """ReferenceOps whose calls a RecordedGraph keeps while it captures."""

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if RecordedGraph.capturing is not None:
                RecordedGraph.capturing.append((attr, args, kwargs))
            return attr(*args, **kwargs)

        return call


def install_recorded_graphs(monkeypatch) -> None:
    """CUDA graphs on the CPU: the device step's ops in torch (RecordingOps), a capture that keeps
    their calls and a replay that makes them again (RecordedGraph), and streams that do nothing, so
    DeviceDecodeStep, GraphedDecodeStep, RoutedGraphStep and capture_graph run end to end here."""
    import contextlib

    import torch

    from pkv import ops

    @contextlib.contextmanager
    def graph(recorded, *args, **kwargs):
        RecordedGraph.capturing = recorded.calls
        try:
            yield
        finally:
            RecordedGraph.capturing = None

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(ops, "load", RecordingOps)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Stream())
