"""Decode-attention engines and ``build_engine``, which maps role names to implementations.

On a CPU device the roles have stand-ins (the paper's CPU profile): "persistentkv" is the
torch ReferenceEngine and "flashinfer" is repack + SDPA; ``engine.implementation`` records
which code ran.
"""

from __future__ import annotations

import torch

from pkv.engines.base import Engine, EnginePlan, EngineUnavailable

ENGINE_NAMES = ("persistentkv", "adaptive", "flashinfer", "flashinfer_tc", "flashinfer_cc",
                "reference", "sdpa", "vllm", "trtllm")
OPTION_NAMES = ("route", "num_splits", "split_kind", "bucket_num_splits", "fused_merge",
                "cuda_graph", "planner", "allow_b4", "use_tensor_cores", "page_size")
_PERSISTENT_OPTIONS = ("route", "num_splits", "split_kind", "bucket_num_splits", "fused_merge",
                       "cuda_graph", "planner")

__all__ = ["Engine", "EnginePlan", "EngineUnavailable", "ENGINE_NAMES", "OPTION_NAMES",
           "build_engine"]


def _persistent_kwargs(options: dict, calib) -> dict:
    from pkv.pipeline.schedule import SplitPolicy

    num_splits = options.get("num_splits",
                             getattr(calib, "workqueue_num_splits", None) if calib else None)
    split_kind = options.get("split_kind",
                             getattr(calib, "workqueue_split_kind", None) if calib else None)
    bucket_splits = options.get("bucket_num_splits",
                                getattr(calib, "bucket_num_splits", None) if calib else None)
    policy_kwargs = {}
    if num_splits is not None:
        policy_kwargs["num_splits"] = int(num_splits)
    if split_kind is not None:
        policy_kwargs["kind"] = str(split_kind)
    kwargs = {
        "route": options.get("route", "workqueue"),
        "split_policy": SplitPolicy(**policy_kwargs),
        "fused_merge": bool(options.get("fused_merge", False)),
    }
    if bucket_splits is not None:
        kwargs["bucket_num_splits"] = int(bucket_splits)
    return kwargs


def _calibration_with_split_options(calib, options: dict):
    """The calibration the adaptive engine's policy decides with: split options given to the
    engine replace the calibrated operating points. The policy hands its split count to the
    persistent engine with every decision, so an option that only reached the persistent engine
    would be ignored (the splits ablation fixes the count this way)."""
    import dataclasses

    overrides = {}
    if options.get("num_splits") is not None:
        splits = int(options["num_splits"])
        overrides.update(workqueue_num_splits=splits, bucket_num_splits=splits, boundary_num_splits=splits)
    if options.get("bucket_num_splits") is not None:
        overrides["bucket_num_splits"] = int(options["bucket_num_splits"])
    if options.get("split_kind") is not None:
        overrides["workqueue_split_kind"] = str(options["split_kind"])
    return dataclasses.replace(calib, **overrides) if overrides else calib


def build_engine(name: str, *, shape, device, calib=None, options: dict | None = None) -> Engine:
    """Construct the engine for a role name on ``device``.

    Options: route, num_splits, split_kind, bucket_num_splits, fused_merge (PersistentKV and
    reference); cuda_graph and planner ("native" C++ or "numpy", the CUDA PersistentKV engine
    only; the reference engine always plans with pkv.pipeline.schedule); allow_b4 (adaptive);
    use_tensor_cores, page_size (FlashInfer). Unset split
    options come from ``calib`` when given. Raises EngineUnavailable when the role cannot run
    here, ValueError for unknown names or options.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"build_engine({name!r}): unknown option(s) {unknown}; known: {OPTION_NAMES}")
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; known engines: {ENGINE_NAMES}")
    device = torch.device(device)
    on_cuda = device.type == "cuda"

    if name in ("reference", "persistentkv"):
        kwargs = _persistent_kwargs(options, calib)
        cuda_graph = bool(options.get("cuda_graph", False))
        if name == "persistentkv" and on_cuda:
            from pkv.engines.persistentkv import PersistentKVEngine

            if cuda_graph:
                kwargs["cuda_graph"] = True
            if "planner" in options:
                kwargs["planner"] = str(options["planner"])
            engine = PersistentKVEngine(shape, device=device, **kwargs)
        else:
            if cuda_graph:
                raise EngineUnavailable(
                    f"cuda_graph replay needs the CUDA PersistentKV engine; {name!r} on {device} "
                    "runs the torch reference engine")
            from pkv.engines.reference import ReferenceEngine

            engine = ReferenceEngine(shape, device=device, **kwargs)
        engine.name = name
        return engine

    if name in ("flashinfer", "flashinfer_tc", "flashinfer_cc"):
        if not on_cuda and name == "flashinfer":
            from pkv.engines.sdpa import SdpaEngine

            engine = SdpaEngine(shape, device=device)
            engine.name = name
            return engine
        from pkv.engines.flashinfer import FlashInferEngine

        tensor_cores = {"flashinfer": options.get("use_tensor_cores"), "flashinfer_tc": True,
                        "flashinfer_cc": False}[name]
        return FlashInferEngine(shape, use_tensor_cores=tensor_cores, device=device,
                                page_size=int(options.get("page_size", 16)))

    if name == "sdpa":
        from pkv.engines.sdpa import SdpaEngine

        return SdpaEngine(shape, device=device)

    if name == "vllm":
        from pkv.engines.vllm import VllmEngine

        return VllmEngine(shape, device=device)

    if name == "trtllm":
        from pkv.engines.trtllm import TrtllmEngine

        return TrtllmEngine(shape, device=device)

    # adaptive
    if calib is None:
        raise ValueError("build_engine('adaptive') needs calib (a pkv.cost_model.Calibration)")
    from pkv.engines.adaptive import AdaptiveEngine
    from pkv.route_policy import RoutePolicy

    calib = _calibration_with_split_options(calib, options)
    policy = RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                         head_dim=shape.head_dim, allow_b4=bool(options.get("allow_b4", False)))
    persistent_options = {k: v for k, v in options.items() if k in _PERSISTENT_OPTIONS}
    fallback_options = {k: v for k, v in options.items() if k in ("use_tensor_cores", "page_size")}
    persistent = build_engine("persistentkv", shape=shape, device=device, calib=calib,
                              options=persistent_options)
    fallback = build_engine("flashinfer", shape=shape, device=device, calib=calib,
                            options=fallback_options)
    return AdaptiveEngine(policy, persistent, fallback)
