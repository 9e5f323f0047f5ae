"""Repack + PyTorch SDPA: the framework baseline (Table 1) and the CPU FlashInfer stand-in."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pkv.engines.base import Engine, EnginePlan, check_decode_inputs


class SdpaEngine(Engine):
    """Copies each row's pages into contiguous K,V, then calls scaled_dot_product_attention.

    The repack is inside ``run`` on purpose: it is the cost that native block-table engines
    avoid, and the paper's "Repack + PyTorch SDPA" row includes it. Rows are processed one at
    a time (no padding to the longest row), so ragged batches cost their true length.
    GQA is expressed by repeating KV heads (``enable_gqa`` is not needed, so torch 2.5 works).
    """

    def __init__(self, shape, device="cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.name = "sdpa"
        self.implementation = "sdpa"

    def plan(self, step) -> EnginePlan:
        seq_lens = np.asarray(step.seq_lens, dtype=np.int64)
        pages_per_row = -(-seq_lens // step.page_size)
        block_table = np.asarray(step.block_table, dtype=np.int64)
        # Per-row page lists on the device, so run() only gathers.
        row_pages = [
            torch.as_tensor(block_table[i, :pages_per_row[i]]).to(self.device)
            for i in range(seq_lens.shape[0])
        ]
        return EnginePlan(route="flashinfer", step=step, schedule=None, num_splits=None,
                          tensors={"row_pages": row_pages, "seq_lens": seq_lens.tolist()})

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        check_decode_inputs(q, k_pages, v_pages, self.shape, plan.step.page_size)
        shape = self.shape
        out = torch.empty_like(q)
        for row, (pages, n) in enumerate(zip(plan.tensors["row_pages"], plan.tensors["seq_lens"])):
            keys = _repack(k_pages, pages, n).repeat_interleave(shape.group_size, dim=0)
            values = _repack(v_pages, pages, n).repeat_interleave(shape.group_size, dim=0)
            query = q[row][:, None, :]  # [Hq, 1, d]
            out[row] = F.scaled_dot_product_attention(
                query[None], keys[None].to(q.dtype), values[None].to(q.dtype),
                scale=shape.sm_scale)[0, :, 0]
        return out


def _repack(pages_tensor: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """[num_pages, Hkv, P, d] pages of one row -> contiguous [Hkv, n, d]."""
    gathered = pages_tensor.index_select(0, pages)  # [np, Hkv, P, d]
    num_kv_heads, head_dim = gathered.shape[1], gathered.shape[3]
    return gathered.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n].contiguous()
