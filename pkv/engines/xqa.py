"""TensorRT-LLM's XQA decode kernel, as FlashInfer ships it (``xqa_batch_decode_with_kv_cache``).

XQA is TensorRT-LLM's generation-phase attention for GQA on Hopper, the kernel vLLM can also take
there. It needs no plan: the block table and lengths go up, and one launch reads them. TensorRT-LLM
itself is not installed anywhere this project runs (its wheels need their own CUDA stack); FlashInfer
vendors the kernel's sources and JIT-compiles them, so this row runs the same kernel.
"""

from __future__ import annotations

import torch

from pkv.engines.base import Engine, EnginePlan, EngineUnavailable, check_decode_inputs, upload_block_table

# XQA keeps its semaphores and split scratch here; it must start zeroed and stay with the engine.
WORKSPACE_BYTES = 128 * 1024 * 1024
# The FlashInfer release that first exposes XQA through flashinfer.decode, for the reason text.
FIRST_RELEASE_WITH_XQA = "0.7"


def _import_xqa():
    # An optional dependency: imported where XQA runs, so its absence is a reason, not a crash.
    try:
        import flashinfer
        import flashinfer.decode as decode
    except ImportError as exc:
        raise EngineUnavailable(f"flashinfer not installed (XQA ships in it): {exc}") from exc
    version = getattr(flashinfer, "__version__", "unknown")
    entry = getattr(decode, "xqa_batch_decode_with_kv_cache", None)
    if entry is None:
        raise EngineUnavailable(
            f"flashinfer {version} has no flashinfer.decode.xqa_batch_decode_with_kv_cache "
            f"(XQA needs flashinfer >= {FIRST_RELEASE_WITH_XQA})")
    return version, entry


class XqaEngine(Engine):
    """XQA over the shared HND pages and block tables: plan() uploads the table and the lengths."""

    def __init__(self, shape, device="cuda", page_size: int = 16) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.page_size = page_size
        if self.device.type != "cuda":
            raise EngineUnavailable(f"XQA needs a CUDA device, got {self.device}")
        version, self._decode = _import_xqa()
        self.name = "xqa"
        self.implementation = f"trtllm-xqa-via-flashinfer-{version}"
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    def plan(self, step) -> EnginePlan:
        if step.page_size != self.page_size:
            raise ValueError(f"step.page_size={step.page_size}, engine was built for {self.page_size}")
        tensors, max_seq_len = upload_block_table(step, self.device)
        # XQA reads the lengths as uint32; the values fit int32, so the bits are the same.
        tensors["seq_lens"] = tensors["seq_lens"].view(torch.uint32)
        return EnginePlan(route="xqa", step=step, tensors=tensors, extra={"max_seq_len": max_seq_len})

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        check_decode_inputs(q, k_pages, v_pages, self.shape, self.page_size)
        t = plan.tensors
        return self.decode(q, k_pages, v_pages, t["block_table"], t["seq_lens"], plan.extra["max_seq_len"])

    def decode(self, q, k_pages, v_pages, block_table, seq_lens_u32, max_seq_len: int):
        """One XQA launch over tables already on the device (``seq_lens_u32``: uint32 lengths).

        FlashInfer takes ``max_seq_len`` but does not hand it to the kernel: XQA takes the longest
        length from the table's width times the page size (it sets the split of each row across
        CTAs and the row stride of the table). A CUDA graph that captures this call therefore
        needs a static table as wide as the longest row it will ever replay."""
        # The kernel reads q and the block table from their data pointers alone (K and V are the
        # only tensors whose strides it takes), so a strided view would be read as packed rows.
        for label, tensor in (("q", q), ("block_table", block_table)):
            if not tensor.is_contiguous():
                raise ValueError(f"XQA needs a contiguous {label}, got strides {tuple(tensor.stride())}")
        return self._decode(q, (k_pages, v_pages), self._workspace, block_table, seq_lens_u32, int(max_seq_len),
                            bmm1_scale=self.shape.sm_scale, bmm2_scale=1.0, kv_layout="HND")
