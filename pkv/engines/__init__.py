"""Decode-attention engines and ``build_engine``, which maps role names to implementations.

Engines execute routes; they never choose one. A PersistentKV engine is handed the policy whose
routes it runs (a RoutePolicy, or a PinnedRoutePolicy for one schedule), built from the run's
calibration by the caller (pkv.experiments.common.run_policies).

On a CPU device the roles have stand-ins (the paper's CPU profile): "persistentkv" is the
torch ReferenceEngine and "flashinfer" is repack + SDPA; ``engine.implementation`` records
which code ran.
"""

from __future__ import annotations

import torch

from pkv.engines.adaptive import AdaptiveEngine
from pkv.engines.base import Engine, EnginePlan, EngineUnavailable
from pkv.engines.flashinfer import ROLE_PATHS, FlashInferEngine
from pkv.engines.persistentkv import PersistentKVEngine
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.engines.vllm import VllmEngine, VllmTritonEngine
from pkv.engines.xqa import XqaEngine
from pkv.policy.choose import PinnedRoutePolicy, RoutePolicy, pinned_route
from pkv.policy.overrides import kernel_variants
from pkv.policy.route import MERGE_LAUNCH

ENGINE_NAMES = ("persistentkv", "adaptive", *ROLE_PATHS, "reference", "sdpa", "vllm", "vllm_triton", "xqa")
# Options of how an engine executes (not what it runs, which is the policy's).
OPTION_NAMES = ("cuda_graph", "planner", "use_tensor_cores", "page_size", "one_op_step")
_PERSISTENT_OPTIONS = ("cuda_graph", "planner")
_FLASHINFER_OPTIONS = ("use_tensor_cores", "page_size")

__all__ = ["Engine", "EnginePlan", "EngineUnavailable", "ENGINE_NAMES", "OPTION_NAMES", "build_engine",
           "role_policy"]


def role_policy(role: str, options, shape, calib):
    """The policy an engine role runs over ``calib``: the calibrated RoutePolicy for "adaptive",
    one pinned schedule (options "route", "merge") for a PersistentKV engine, none for the baselines."""
    variants = kernel_variants(options.get("route", "workqueue"), options.get("merge", MERGE_LAUNCH))
    if role == "adaptive":
        return RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                           head_dim=shape.head_dim, variants=variants)
    if role in ("persistentkv", "reference"):
        return PinnedRoutePolicy(pinned_route(options.get("route", "workqueue"), calib, variants))
    return None


def _persistent(name: str, shape, device: torch.device, policy, options: dict) -> Engine:
    if device.type == "cuda" and name == "persistentkv":
        engine = PersistentKVEngine(shape, policy=policy, device=device, **options)
    else:
        if options.get("cuda_graph"):
            raise EngineUnavailable(
                f"cuda_graph replay needs the CUDA PersistentKV engine; {name!r} on {device} "
                "runs the torch reference engine")
        engine = ReferenceEngine(shape, policy=policy, device=device)
    engine.name = name
    return engine


def _flashinfer(name: str, shape, device: torch.device, options: dict) -> Engine:
    if device.type != "cuda" and name == "flashinfer":
        engine = SdpaEngine(shape, device=device)
        engine.name = name
        return engine
    paths = ROLE_PATHS[name]
    if name == "flashinfer" and options.get("use_tensor_cores") is not None:
        # engine.use_tensor_cores pins the baseline to one fa2 path (null: the best of all paths).
        paths = ("tc",) if options["use_tensor_cores"] else ("cc",)
    return FlashInferEngine(shape, paths=paths, device=device, page_size=int(options.get("page_size", 16)),
                            name=name)


def build_engine(name: str, *, shape, device, policy=None, options: dict | None = None) -> Engine:
    """Construct the engine for a role name on ``device``.

    ``policy`` gives "persistentkv" and "reference" their routes (default: the workqueue at its
    default split count on every step) and is required for "adaptive" (a RoutePolicy). Options:
    cuda_graph and planner ("native" C++ or "numpy"; the CUDA PersistentKV engine only),
    use_tensor_cores and page_size (FlashInfer), one_op_step (the adaptive engine's eager step
    decided, planned and launched in one op call; other roles do not read it). Raises
    EngineUnavailable when the role cannot run here, ValueError for unknown names or options.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"build_engine({name!r}): unknown option(s) {unknown}; known: {OPTION_NAMES}")
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r}; known engines: {ENGINE_NAMES}")
    device = torch.device(device)
    persistent_options = {k: v for k, v in options.items() if k in _PERSISTENT_OPTIONS}
    fallback_options = {k: v for k, v in options.items() if k in _FLASHINFER_OPTIONS}

    if name in ("reference", "persistentkv"):
        return _persistent(name, shape, device, policy, persistent_options)
    if name in ROLE_PATHS:
        return _flashinfer(name, shape, device, fallback_options)
    if name == "sdpa":
        return SdpaEngine(shape, device=device)
    if name == "vllm":
        return VllmEngine(shape, device=device)
    if name == "vllm_triton":
        return VllmTritonEngine(shape, device=device)
    if name == "xqa":
        return XqaEngine(shape, device=device, page_size=int(options.get("page_size", 16)))
    if not isinstance(policy, RoutePolicy):
        raise ValueError(f"build_engine('adaptive') needs policy, a pkv.policy.RoutePolicy; got {policy!r}")
    persistent = _persistent("persistentkv", shape, device, policy, persistent_options)
    fallback = _flashinfer("flashinfer", shape, device, fallback_options)
    # AdaptiveEngine refuses a one-op step its persistent engine cannot take.
    return AdaptiveEngine(policy, persistent, fallback, one_op_step=bool(options.get("one_op_step")))
