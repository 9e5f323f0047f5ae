"""Random K,V pages and queries whose attention is peaked.

With plain N(0, 1) keys and queries, softmax over thousands of tokens is nearly uniform and
every output is an average close to zero, so any kernel (even one that drops tiles) passes an
absolute error bound. Here each KV head has a hidden unit direction ``u``; a sparse set of
"needle" keys carries ``strength * u`` on top of the noise, with exponentially distributed
strengths, and queries point along ``u``. Exponential strengths keep the gap between a row's
largest and second-largest needle at O(NEEDLE_SCALE) whatever the row length (uniform
strengths would crowd together as rows grow), so a few specific tokens dominate each softmax,
the output is close to their value vectors, and a missing or misplaced tile changes it by O(1).
"""

from __future__ import annotations

import math

import torch

# One key in this many is a needle (per KV head, independently).
NEEDLE_EVERY = 64
# Mean extra score of a needle (natural-log units); noise scores have std about 1.1.
NEEDLE_SCALE = 2.5
# Value vectors are scaled so fp16 outputs keep rounding well below the paper's 2e-3 bound.
VALUE_STD = 0.5
# Pages are drawn in chunks of about this many elements a tensor, so the float32 temporaries of a
# pool of gigabytes stay a few hundred MB: a model step holds one pool per layer and sizes its
# layers to the free memory, and a whole-pool draw needed three more pools' worth at its peak.
# A pool within one chunk draws the same bits as one draw of all its pages.
GENERATION_CHUNK_ELEMENTS = 1 << 24

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def resolve_dtype(dtype) -> torch.dtype:
    """Accept a torch dtype or its name ("float16", ...); reject anything else by name."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one of {sorted(_DTYPES)}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _generator(seed: int, device="cpu") -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def attention_directions(shape, direction_seed: int = 0) -> torch.Tensor:
    """Unit vector per KV head, [Hkv, d] float32: where needles and queries point."""
    gen = _generator(direction_seed)
    u = torch.randn(shape.num_kv_heads, shape.head_dim, generator=gen)
    return u / u.norm(dim=-1, keepdim=True)


def make_kv_pages(num_pages, shape, page_size, dtype, device, seed, peaked=True, *,
                  direction_seed: int = 0):
    """(k_pages, v_pages), each [num_pages, Hkv, page_size, d] in ``dtype`` on ``device``.

    Generated on ``device`` itself from ``seed``: the bits are reproducible per device type,
    and a serving trace's gigabytes of pages are made in milliseconds instead of on the host.
    """
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    gen = _generator(seed, device)
    dims = (num_pages, shape.num_kv_heads, page_size, shape.head_dim)
    k_pages = torch.empty(dims, dtype=dtype, device=device)
    v_pages = torch.empty(dims, dtype=dtype, device=device)
    u = attention_directions(shape, direction_seed).to(device) if peaked else None
    chunk = max(1, GENERATION_CHUNK_ELEMENTS // math.prod(dims[1:]))
    for start in range(0, num_pages, chunk):
        part = (min(chunk, num_pages - start), *dims[1:])
        keys = torch.randn(part, generator=gen, device=device)
        values = torch.randn(part, generator=gen, device=device) * VALUE_STD
        if peaked:
            needle = torch.rand(part[:3], generator=gen, device=device) < 1.0 / NEEDLE_EVERY
            strength = torch.empty(part[:3], device=device).exponential_(generator=gen) * NEEDLE_SCALE
            # Queries have norm sqrt(d) along u and scores carry 1/sqrt(d), so a needle of
            # strength s adds about s to its score.
            boost = torch.where(needle, strength, torch.zeros_like(strength))
            keys = keys + boost[..., None] * u[None, :, None, :]
        k_pages[start:start + part[0]] = keys
        v_pages[start:start + part[0]] = values
    return k_pages, v_pages


def make_queries(batch, shape, dtype, device, seed, peaked=True, *, direction_seed: int = 0):
    """q [batch, Hq, d]: along each KV head's direction (peaked) or plain N(0, 1)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    dtype = resolve_dtype(dtype)
    gen = _generator(seed)
    noise = torch.randn(batch, shape.num_qo_heads, shape.head_dim, generator=gen)
    if not peaked:
        return noise.to(dtype).to(device)
    u = attention_directions(shape, direction_seed)
    # Query head h reads KV head h // G; each head gets its own noise so heads differ.
    u_per_head = u.repeat_interleave(shape.group_size, dim=0)
    q = math.sqrt(shape.head_dim) * u_per_head[None] + 0.5 * noise
    return q.to(dtype).to(device)


def stored_nhd(pages: torch.Tensor) -> torch.Tensor:
    """HND pages ([num_pages, Hkv, P, d]) copied into NHD storage ([num_pages, P, Hkv, d], vLLM's
    and FlashAttention's cache layout) and viewed as [num_pages, Hkv, P, d] again: the same values
    with another token stride, as the CUDA kernels read vLLM's cache in place."""
    return pages.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
