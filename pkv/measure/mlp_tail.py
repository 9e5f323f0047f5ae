"""The synthetic Llama-style gated MLP tail of the model-level proxy (Table 3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pkv.measure.kv_data import resolve_dtype


class GatedMLPTail:
    """down(silu(gate(x)) * up(x)) applied to attention output flattened to [B, Hq * d].

    Weights are random (seeded) with 1/sqrt(fan_in) scale: the tail stands for the dense
    per-token work that follows attention, its values do not matter.
    """

    def __init__(self, hidden: int = 4096, intermediate: int = 11008, dtype="float16",
                 device="cuda", seed: int = 0) -> None:
        for label, value in (("hidden", hidden), ("intermediate", intermediate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GatedMLPTail {label} must be a positive int, got {value!r}")
        self.hidden = hidden
        self.intermediate = intermediate
        self.dtype = resolve_dtype(dtype)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
            return w.to(self.dtype).to(device)

        self.gate = weight(intermediate, hidden)
        self.up = weight(intermediate, hidden)
        self.down = weight(hidden, intermediate)

    def __call__(self, attn_out: torch.Tensor) -> torch.Tensor:
        x = attn_out.reshape(attn_out.shape[0], -1)
        if x.shape[1] != self.hidden:
            raise ValueError(
                f"GatedMLPTail(hidden={self.hidden}) got attention output {tuple(attn_out.shape)}: "
                f"Hq * d = {x.shape[1]}"
            )
        x = x.to(self.dtype)
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)
