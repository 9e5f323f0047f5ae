"""Float64 ground truth: exact softmax attention per row over its gathered pages."""

from __future__ import annotations

import math

import numpy as np
import torch


def _as_host_ints(values, label: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{label} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def dense_decode(q, k_pages, v_pages, seq_lens, block_table, sm_scale=None) -> torch.Tensor:
    """Exact decode attention in float64 on the tensors' device.

    Deliberately simple (a loop over rows, a plain page gather, a full softmax) so that it
    shares no scheduling logic with the engines it checks.
    q: [B, Hq, d]; k_pages, v_pages: [num_pages, Hkv, P, d]; seq_lens: [B];
    block_table: [B, max_pages]. Returns float64 [B, Hq, d].
    """
    lens = _as_host_ints(seq_lens, "seq_lens")
    table = _as_host_ints(block_table, "block_table")
    batch, num_qo_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    if lens.shape != (batch,):
        raise ValueError(f"seq_lens has shape {lens.shape}, expected ({batch},) to match q")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table has shape {table.shape}, expected ({batch}, max_pages)")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"Hq={num_qo_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_qo_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)

    out = torch.empty(batch, num_qo_heads, head_dim, dtype=torch.float64, device=q.device)
    for row in range(batch):
        n = int(lens[row])
        if n < 1:
            raise ValueError(f"seq_lens[{row}] = {n}; every row needs at least one token")
        pages_needed = -(-n // page_size)
        if pages_needed > table.shape[1]:
            raise ValueError(
                f"row {row}: seq_len {n} needs {pages_needed} pages, block_table has {table.shape[1]}"
            )
        pages = table[row, :pages_needed]
        if pages.min() < 0 or pages.max() >= num_pages:
            raise ValueError(f"row {row}: block_table page ids outside [0, {num_pages})")
        index = torch.as_tensor(pages, device=k_pages.device)
        # [pages, Hkv, P, d] -> [Hkv, pages * P, d], then drop the last page's unused tail.
        keys = k_pages.index_select(0, index).to(torch.float64)
        values = v_pages.index_select(0, index).to(torch.float64)
        keys = keys.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n]
        values = values.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n]
        query = q[row].to(torch.float64).reshape(num_kv_heads, group, head_dim)
        scores = torch.matmul(query, keys.transpose(1, 2)) * scale  # [Hkv, G, n]
        weights = torch.softmax(scores, dim=-1)
        out[row] = torch.matmul(weights, values).reshape(num_qo_heads, head_dim)
    return out
