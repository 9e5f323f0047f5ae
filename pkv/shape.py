"""The attention shape every engine, plan and benchmark agrees on."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Decode attention shape: query heads, KV heads and head dim.

    Query head ``h`` reads KV head ``h // group_size`` (FlashInfer's grouping).
    """

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    def __post_init__(self) -> None:
        for field_name in ("num_qo_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field_name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelShape.num_qo_heads={self.num_qo_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """G: query heads that share one KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)
