"""vLLM's PagedAttention decode kernels (paged_attention_v1 / v2) over the shared pages."""

from __future__ import annotations

import numpy as np
import torch

from pkv.engines.base import Engine, EnginePlan, EngineUnavailable, check_decode_inputs

# vLLM's v2 kernel partitions each sequence into chunks of this many tokens.
PARTITION_SIZE = 512


def _import_vllm_ops():
    # An optional dependency: imported where vLLM runs, so its absence is a reason, not a crash.
    try:
        import vllm
        from vllm import _custom_ops as ops
    except ImportError as exc:
        raise EngineUnavailable(f"vllm not installed: {exc}") from exc
    for op in ("paged_attention_v1", "paged_attention_v2"):
        if not hasattr(ops, op):
            raise EngineUnavailable(
                f"vllm {getattr(vllm, '__version__', '?')} has no vllm._custom_ops.{op}")
    return vllm, ops


class VllmEngine(Engine):
    """vLLM's paged decode, v1 or v2 chosen with vLLM's own rule for the step.

    vLLM stores K as [blocks, Hkv, d / x, P, x] (x = 16 bytes of elements) and V as
    [blocks, Hkv, d, P]; the adapter converts the shared HND pages into that layout once per
    KV tensor (in ``prepare``, untimed), keeping the same physical page ids, so vLLM reads
    the same pages through the same block tables as every other engine.
    """

    def __init__(self, shape, device="cuda") -> None:
        self.shape = shape
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise EngineUnavailable(f"vllm paged attention needs a CUDA device, got {self.device}")
        vllm, self._ops = _import_vllm_ops()
        self.name = "vllm"
        self.implementation = f"vllm-{getattr(vllm, '__version__', 'unknown')}"
        self._cache_key = None
        self._caches = None
        self._scale_as_tensor = None

    def _convert(self, k_pages, v_pages):
        key = (k_pages.data_ptr(), v_pages.data_ptr(), tuple(k_pages.shape), k_pages.dtype)
        if self._cache_key != key:
            blocks, heads, page, dim = k_pages.shape
            x = 16 // k_pages.element_size()
            key_cache = k_pages.reshape(blocks, heads, page, dim // x, x).permute(0, 1, 3, 2, 4)
            value_cache = v_pages.permute(0, 1, 3, 2)
            self._caches = (key_cache.contiguous(), value_cache.contiguous())
            self._cache_key = key
        return self._caches

    def plan(self, step) -> EnginePlan:
        seq_lens = np.asarray(step.seq_lens, dtype=np.int32)
        tensors = {
            "block_table": torch.as_tensor(np.asarray(step.block_table, dtype=np.int32)).to(self.device),
            "seq_lens": torch.as_tensor(seq_lens).to(self.device),
        }
        return EnginePlan(route="vllm", step=step, tensors=tensors,
                          extra={"max_seq_len": int(seq_lens.max())})

    def prepare(self, step, q, k_pages, v_pages) -> None:
        self._convert(k_pages, v_pages)
        if self._scale_as_tensor is None:
            # The kv-scale arguments changed from float to Tensor across vLLM releases: find
            # which this build takes with one real call, and report both errors otherwise.
            errors = []
            for as_tensor in (True, False):
                self._scale_as_tensor = as_tensor
                try:
                    self.run(q, k_pages, v_pages, self.plan(step))
                    torch.cuda.synchronize(self.device)
                    return
                except (RuntimeError, TypeError) as exc:
                    errors.append(f"{'tensor' if as_tensor else 'float'} scales: {exc}")
            self._scale_as_tensor = None
            raise EngineUnavailable(f"{self.implementation}: paged_attention call failed ({'; '.join(errors)})")

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        check_decode_inputs(q, k_pages, v_pages, self.shape, plan.step.page_size)
        if self._scale_as_tensor is None:
            self.prepare(plan.step, q, k_pages, v_pages)
        key_cache, value_cache = self._convert(k_pages, v_pages)
        shape = self.shape
        out = torch.empty_like(q)
        batch = q.shape[0]
        max_seq_len = plan.extra["max_seq_len"]
        one = torch.ones((), dtype=torch.float32, device=self.device)
        k_scale = v_scale = one if self._scale_as_tensor else 1.0
        partitions = -(-max_seq_len // PARTITION_SIZE)
        common = (shape.num_kv_heads, shape.sm_scale, plan.tensors["block_table"],
                  plan.tensors["seq_lens"], plan.step.page_size, max_seq_len, None, "auto",
                  k_scale, v_scale)
        # vLLM's own dispatch rule between the single-pass and the partitioned kernel.
        if max_seq_len <= 8192 and (partitions == 1 or batch * shape.num_qo_heads > 512):
            self._ops.paged_attention_v1(out, q, key_cache, value_cache, *common)
        else:
            exp_sums = torch.empty(batch, shape.num_qo_heads, partitions, dtype=torch.float32,
                                   device=self.device)
            max_logits = torch.empty_like(exp_sums)
            tmp_out = torch.empty(batch, shape.num_qo_heads, partitions, shape.head_dim,
                                  dtype=q.dtype, device=self.device)
            self._ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, q, key_cache,
                                         value_cache, *common)
        return out
