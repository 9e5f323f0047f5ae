"""One decode step of a Llama-shaped model (Table 9): the gain of decode attention inside the step.

Each layer: RMSNorm, the fused QKV projection, the new token's K and V appended to the layer's own
page pool, paged decode attention over that pool (the engine's call), the output projection and a
residual add, RMSNorm, the gated MLP (SiLU(gate) * up, then down) and a residual add. Weights are
random (seeded, 1/sqrt(fan_in)): the step stands for the dense work a real layer streams, its values
do not matter. RoPE is left out: it is one element-wise kernel on q and k and changes no byte the
attention reads.

Every layer has its own K and V pool with the same block tables (a real model's layers share the
page table, never the cache), so no layer reads another's pages. The step's ``seq_lens`` include the
new token: its K and V go to position ``seq_len - 1`` (page ``block_table[row, (seq_len - 1) // P]``,
slot ``(seq_len - 1) % P``) before the layer's attention reads ``seq_len`` tokens. The append's page
and slot are computed on the device from the block table and lengths the step already holds there,
so a CUDA graph of the step replays them for any lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pkv.engines.dense import dense_decode
from pkv.measure.kv_data import make_kv_pages, resolve_dtype
from pkv.shape import ModelShape

RMS_EPS = 1e-5


@dataclass(frozen=True)
class StepShape:
    """A decoder stack: widths, attention heads and layers (one of conf/experiment/model_step.yaml's models)."""

    hidden: int
    intermediate: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_qo_heads", "num_kv_heads", "head_dim", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepShape.{name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"StepShape.num_qo_heads={self.num_qo_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def attention(self) -> ModelShape:
        return ModelShape(self.num_qo_heads, self.num_kv_heads, self.head_dim)

    @property
    def qkv_width(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim

    def weight_elements_per_layer(self) -> int:
        h, i = self.hidden, self.intermediate
        return self.qkv_width * h + h * self.num_qo_heads * self.head_dim + 3 * i * h + 2 * h

    def kv_elements_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim


def _uniform_seed(seed: int, *parts: int) -> int:
    # One reproducible stream per (run seed, layer, tensor), independent of the device.
    return int(np.random.SeedSequence([int(seed), *map(int, parts)]).generate_state(1)[0])


class LayerWeights:
    """Weights of one layer: qkv [(Hq + 2 Hkv) d, hidden], o [hidden, Hq d], gate_up [2 I, hidden],
    down [hidden, I], and the two RMSNorm scales."""

    def __init__(self, shape: StepShape, layer: int, dtype, device, seed: int) -> None:
        dtype = resolve_dtype(dtype)
        h, i, qd = shape.hidden, shape.intermediate, shape.num_qo_heads * shape.head_dim

        def weight(tag: int, rows: int, cols: int) -> torch.Tensor:
            gen = torch.Generator(device=torch.device(device))
            gen.manual_seed(_uniform_seed(seed, layer, tag))
            # Drawn in float32 and cast, so a float64 copy of the model holds the same values.
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (w / math.sqrt(cols)).to(dtype)

        self.qkv = weight(0, shape.qkv_width, h)
        self.o = weight(1, h, qd)
        self.gate_up = weight(2, 2 * i, h)  # gate and up fused in one matmul, as serving engines load them
        self.down = weight(3, h, i)
        self.norm1 = torch.ones(h, dtype=dtype, device=device)
        self.norm2 = torch.ones(h, dtype=dtype, device=device)

    def to(self, dtype) -> "LayerWeights":
        out = object.__new__(LayerWeights)
        for name in ("qkv", "o", "gate_up", "down", "norm1", "norm2"):
            setattr(out, name, getattr(self, name).to(dtype))
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Written out rather than F.rms_norm, which torch 2.5 has but with a different eps default.
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def append_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(physical page, slot in the page) of each row's new token, position seq_len - 1, on the device."""
    pos = seq_lens.long() - 1
    logical = torch.div(pos, page_size, rounding_mode="floor")
    page = block_table.gather(1, logical[:, None]).squeeze(1).long()
    return page, pos - logical * page_size


def append_kv(k_pages, v_pages, k_new, v_new, page, slot) -> None:
    """Write row i's new K and V ([B, Hkv, d]) at k_pages[page[i], :, slot[i], :] (HND pages)."""
    k_pages[page, :, slot] = k_new.to(k_pages.dtype)
    v_pages[page, :, slot] = v_new.to(v_pages.dtype)


class ModelStep:
    """The weights and per-layer K/V pools of ``layers`` layers of ``shape``, and the step's forward.

    ``forward(x, block_table, seq_lens, attend)`` runs every layer; ``attend(layer, q)`` returns the
    layer's attention output [B, Hq, d] over ``self.k_pages[layer]``, ``self.v_pages[layer]``. The
    forward issues the same launches for every batch of one size, so a CUDA graph of it replays for
    any lengths.
    """

    def __init__(self, shape: StepShape, *, layers: int, num_pages: int, page_size: int, dtype, device,
                 seed: int, weights: list | None = None, clock_probe_cycles: int = 0) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= shape.num_layers:
            raise ValueError(f"ModelStep layers must be in 1..{shape.num_layers}, got {layers!r}")
        if isinstance(clock_probe_cycles, bool) or not isinstance(clock_probe_cycles, int) or clock_probe_cycles < 0:
            raise ValueError(f"ModelStep clock_probe_cycles must be an integer >= 0, got {clock_probe_cycles!r}")
        if clock_probe_cycles and torch.device(device).type != "cuda":
            raise ValueError(f"ModelStep clock_probe_cycles={clock_probe_cycles} needs a CUDA device "
                             f"(a spin of GPU clock cycles), got {device!r}")
        self.clock_probe_cycles = clock_probe_cycles
        self.shape = shape
        self.layers = layers
        self.page_size = int(page_size)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.weights = weights if weights is not None else [
            LayerWeights(shape, layer, self.dtype, self.device, seed) for layer in range(layers)]
        self.k_pages, self.v_pages = [], []
        for layer in range(layers):
            # Each layer's prompt K and V: peaked pages (pkv.measure.kv_data), a seed of its own.
            k, v = make_kv_pages(num_pages, shape.attention, self.page_size, self.dtype, self.device,
                                 _uniform_seed(seed, layer, 99) % (2**62))
            self.k_pages.append(k)
            self.v_pages.append(v)

    def hidden_input(self, batch: int, step_seed: int) -> torch.Tensor:
        """The step's input hidden states [B, hidden]: fresh and reproducible per step."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(step_seed))
        return torch.randn(batch, self.shape.hidden, generator=gen).to(self.dtype).to(self.device)

    def forward(self, x, block_table, seq_lens, attend) -> torch.Tensor:
        s = self.shape
        batch, qd, kvd = x.shape[0], s.num_qo_heads * s.head_dim, s.num_kv_heads * s.head_dim
        page, slot = append_slots(block_table, seq_lens, self.page_size)
        # A spin of a fixed count of SM cycles takes cycles / clock on the device: traced next to
        # the same spin in the step without attention, it says whether the clock right after
        # attention (or the MLP's first GEMM) is lower, which a kernel's own time cannot tell from
        # a slower memory system. Read once: an eager step's host time pays no call per layer.
        probe_cycles = self.clock_probe_cycles
        for layer, w in enumerate(self.weights):
            qkv = F.linear(rms_norm(x, w.norm1), w.qkv)
            q = qkv[:, :qd].reshape(batch, s.num_qo_heads, s.head_dim).contiguous()
            k_new = qkv[:, qd:qd + kvd].reshape(batch, s.num_kv_heads, s.head_dim)
            v_new = qkv[:, qd + kvd:].reshape(batch, s.num_kv_heads, s.head_dim)
            append_kv(self.k_pages[layer], self.v_pages[layer], k_new, v_new, page, slot)
            attn = attend(layer, q)
            if probe_cycles:
                torch.cuda._sleep(probe_cycles)
            x = x + F.linear(attn.reshape(batch, qd).to(x.dtype), w.o)
            gate, up = F.linear(rms_norm(x, w.norm2), w.gate_up).chunk(2, dim=-1)
            if probe_cycles:
                torch.cuda._sleep(probe_cycles)
            x = x + F.linear(F.silu(gate) * up, w.down)
        return x

    def float64_copy(self) -> "ModelStep":
        """The same model (weights and current pools) in float64: the ground truth of a step."""
        out = object.__new__(ModelStep)
        out.__dict__.update(self.__dict__)
        out.dtype = torch.float64
        out.weights = [w.to(torch.float64) for w in self.weights]
        out.k_pages = [k.to(torch.float64) for k in self.k_pages]
        out.v_pages = [v.to(torch.float64) for v in self.v_pages]
        return out

    def kv_bytes_read(self, seq_lens) -> int:
        """K and V bytes one step's attention reads over all layers (every row's seq_len tokens)."""
        tokens = int(sum(int(n) for n in seq_lens))
        return tokens * self.shape.kv_elements_per_token() * self.k_pages[0].element_size() * self.layers


def dense_attend(model: ModelStep, block_table, seq_lens):
    """attend(layer, q) by the float64 dense reference over the layer's own pool."""
    def attend(layer, q):
        out = dense_decode(q, model.k_pages[layer], model.v_pages[layer], seq_lens, block_table,
                           sm_scale=model.shape.attention.sm_scale)
        return out.to(q.dtype)

    return attend


def skip_attend(layer, q):
    """attend(layer, q) that does no attention: the rest of the step, for attention's share of it."""
    return q
