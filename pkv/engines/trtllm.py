"""TensorRT-LLM adapter: reports why it cannot run rather than producing a number."""

from __future__ import annotations

from pkv.engines.base import Engine, EngineUnavailable


class TrtllmEngine(Engine):
    """TensorRT-LLM's masked multi-head attention (MMHA) decode.

    TensorRT-LLM ships MMHA inside its engine plugins and its PyTorch backend's fused
    attention op, neither of which accepts a bare FlashInfer-layout page pool plus block
    table. Until an adapter for a specific release's op signature is written, construction
    raises EngineUnavailable: with the ImportError when the package is absent, and with the
    installed version otherwise, so tables show the reason instead of a time.
    """

    def __init__(self, shape, device="cuda") -> None:
        self.shape = shape
        self.name = "trtllm"
        try:
            import tensorrt_llm
        except ImportError as exc:
            raise EngineUnavailable(f"tensorrt_llm not installed: {exc}") from exc
        version = getattr(tensorrt_llm, "__version__", "unknown")
        self.implementation = f"tensorrt_llm-{version}"
        raise EngineUnavailable(
            f"tensorrt_llm {version} is installed, but this adapter has no binding for its "
            "paged MMHA decode op"
        )
