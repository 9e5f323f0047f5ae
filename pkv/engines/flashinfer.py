"""FlashInfer's paged decode over the shared pages (HND layout): each of its Hopper-capable decode
paths, and the best of them per batch class.

Paths (``PATHS``): "cc" and "tc" are ``BatchDecodeWithPagedKVCacheWrapper`` on CUDA cores and on
tensor cores (fa2), "holistic" is the persistent ``BatchAttention``. ``MEASURED_ONLY_PATHS`` holds
"fa3" (the decode wrapper's ``backend="fa3"``): on Hopper decode it is several times slower than
the others (README of the GPU notes), so it is timed and reported by the kernel benchmark, never
picked as the baseline.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pkv.engines.base import Engine, EnginePlan, EngineUnavailable
from pkv.gpu_state import CudaQueue, L2Flusher, QueuedReps

WORKSPACE_BYTES = 128 * 1024 * 1024
# BatchAttention allocates its own 384 MiB float workspace. Its plan reserves partial outputs for a
# fixed number of KV splits per KV head whatever the lengths (FlashInfer 0.7.2, scheduler.cuh:
# 4 x 2 x SMs x 144 splits x head_dim x 2 bytes per KV head), which needs 1.2 GB for 32 KV heads at
# d = 128 on the H200 (the calibration's G = 1 probe) and overflows. Its plan is retried with the
# workspace doubled, up to this much; past it the plan's own error stands.
HOLISTIC_WORKSPACE_LIMIT = 16 * 1024 ** 3
_WORKSPACE_OVERFLOW = "Buffer overflow when allocating"
# Choosing the best path for a batch class: after one untimed round over every path, PROBE_ROUNDS
# rounds, each timing PROBE_REPS runs of one path, the paths in alternating order from round to
# round; a path's decode time is the median of its rounds. Each run is timed as the tables time a
# step: after an L2 eviction, queued ahead of the device behind a GPU-side hold (pkv.gpu_state). Timed back to back, one
# path after the other, the probe measured something else: the first path in the order (fa2 on
# CUDA cores) slow while the clock rose, the last (the holistic kernel) fast on KV left in L2 by the
# runs before it. On an H100 it picked the holistic kernel for every B1 class of Table 2's bucketed
# trace (16K: 42.6 us against fa2's 72.7 in the probe), where the kernel benchmark times it slower
# than fa2 after an eviction (45.7 against 34.6 us), and the same B4 class's holistic kernel read
# 78.2 us in one calibration and 66.8 us in its repeat. Timed plan() calls: their median is the
# path's plan time (one call's host time moves by tens of percent).
PROBE_ROUNDS = 5
PROBE_REPS = 3
PROBE_PLANS = 3
# Paths whose probed decode times lie within this fraction of the fastest count as tied; the tie
# goes to the cheaper plan(), since the wall step pays plan() every call and a probe of a few
# rounds cannot tell apart kernels closer than this.
TIE_FRACTION = 0.02
# Tied paths whose plan times lie within this fraction of the cheapest are tied on the plan too;
# those go to the faster decode. The fa2 paths plan alike (their single timed plans differed by up
# to 25% either way on the H100), so a tie between them decided by the cheaper plan was decided by
# host noise, and the baseline's device time moved with it by up to TIE_FRACTION between runs.
PLAN_TIE_FRACTION = 0.10

PATHS = ("cc", "tc", "holistic")
# The paths FlashInfer's CUDA-graph decode wrapper runs (FlashInferGraphDecode: fa2's decode wrapper).
GRAPH_PATHS = ("cc", "tc")
MEASURED_ONLY_PATHS = ("fa3",)
PATH_LABELS = {
    "cc": "fa2 decode, CUDA cores",
    "tc": "fa2 decode, tensor cores",
    "holistic": "holistic BatchAttention",
    "fa3": "fa3 decode wrapper",
}
# Role name -> the paths that role runs: "flashinfer" is the best of PATHS, flashinfer_<path> one.
ROLE_PATHS = {"flashinfer": PATHS, **{f"flashinfer_{p}": (p,) for p in PATHS + MEASURED_ONLY_PATHS}}
# The pinned roles of the best-of set, for benchmarks that time each path on its own.
BEST_OF_ROLES = tuple(f"flashinfer_{p}" for p in PATHS)

# Per probed class: the path every best-of engine of the process runs, and what each path measured.
# Shared by the baseline and the adaptive engine's fallback, keyed by FlashInferEngine._pick_key:
# engines that probed on their own picked differently where paths tie, so the same steps ran
# different kernels with different plan() costs under the two engines. The pick belongs to the
# GPU, the shape and the batch class.
_PATH_PICKS: dict[tuple, str] = {}
_PATH_PROBES: dict[tuple, dict[str, dict[str, float]]] = {}
# The probe's L2 eviction buffer (twice the L2), one per device, made at the first probe.
_PROBE_FLUSHERS: dict[str, L2Flusher] = {}


def _probe_queue(device) -> CudaQueue:
    return CudaQueue(device)


def _probe_flusher(device) -> L2Flusher:
    flusher = _PROBE_FLUSHERS.get(str(device))
    if flusher is None:
        flusher = _PROBE_FLUSHERS[str(device)] = L2Flusher(device)
    return flusher


def _import_flashinfer():
    # An optional dependency: imported where FlashInfer runs, so its absence is a reason, not a crash.
    try:
        import flashinfer
    except ImportError as exc:  # also covers a broken install that fails to load its ops
        raise EngineUnavailable(f"flashinfer not installed: {exc}") from exc
    return flashinfer


def _allocate_workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)


def probe_key(step) -> tuple[int, int]:
    """Batch-shape class for the best-path choice: rows and the longest row's length rounded up
    to a power of two (FlashInfer's split heuristics change with both)."""
    longest = int(np.max(step.seq_lens))
    return int(len(step.seq_lens)), 1 << max(0, (longest - 1).bit_length())


def pick_path(measured: dict[str, dict]) -> str:
    """The fastest path by decode time; of the paths within TIE_FRACTION of it, those whose plan
    is within PLAN_TIE_FRACTION of the cheapest, and of these the fastest decode. So a tie goes to
    a clearly cheaper plan, and otherwise the same way every time: to the faster kernel.
    A path whose probe failed (an "error" entry instead of times) is never picked."""
    timed = {p: m for p, m in measured.items() if "error" not in m}
    if not timed:
        raise RuntimeError("FlashInfer: no path ran this batch: "
                           + "; ".join(f"{p}: {m['error']}" for p, m in measured.items()))
    fastest = min(m["device_us"] for m in timed.values())
    tied = [p for p, m in timed.items() if m["device_us"] <= fastest * (1 + TIE_FRACTION)]
    cheapest = min(timed[p]["plan_us"] for p in tied)
    affordable = [p for p in tied if timed[p]["plan_us"] <= cheapest * (1 + PLAN_TIE_FRACTION)]
    return min(affordable, key=lambda p: (timed[p]["device_us"], timed[p]["plan_us"]))


def _plan_decode_wrapper(wrapper, indptr, indices, last_page_len, shape, page_size: int, q_dtype, kv_dtype) -> None:
    # Host tensors, as FlashInfer's plan() expects: it plans from host copies and uploads them
    # itself without blocking. Device tensors would cost it two device-to-host syncs.
    wrapper.plan(indptr, indices, last_page_len, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, page_size,
                 pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=shape.sm_scale)


class _DecodeWrapperPath:
    """BatchDecodeWithPagedKVCacheWrapper: fa2 on CUDA or tensor cores, or the fa3 backend."""

    def __init__(self, flashinfer, device, tensor_cores: bool, backend: str | None) -> None:
        kwargs = {} if backend is None else {"backend": backend}
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _allocate_workspace(device), kv_layout="HND", use_tensor_cores=tensor_cores, **kwargs)

    def plan(self, tensors: dict, shape, page_size: int, q_dtype, kv_dtype) -> None:
        _plan_decode_wrapper(self.wrapper, tensors["indptr"], tensors["indices"], tensors["last_page_len"], shape,
                             page_size, q_dtype, kv_dtype)

    def run(self, q, k_pages, v_pages):
        return self.wrapper.run(q, (k_pages, v_pages))


class FlashInferGraphDecode:
    """FlashInfer's fa2 decode wrapper in CUDA-graph mode for a fixed batch size (FlashInfer fixes it
    per wrapper): ``plan`` runs on the host every step, outside the graph, and refills the wrapper's
    own index buffers; ``run`` is what a graph captures. Serving engines use FlashInfer this way."""

    def __init__(self, shape, batch: int, max_pages: int, page_size: int, device, use_tensor_cores: bool) -> None:
        flashinfer = _import_flashinfer()
        int32 = dict(dtype=torch.int32, device=device)
        self.shape, self.page_size = shape, int(page_size)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _allocate_workspace(device), kv_layout="HND", use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, **int32),
            paged_kv_indices_buffer=torch.zeros(batch * max_pages, **int32),
            paged_kv_last_page_len_buffer=torch.zeros(batch, **int32))

    def plan(self, indptr, indices, last_page_len, q_dtype, kv_dtype) -> None:
        """Plan from host int32 arrays (numpy or tensors) of the page table in CSR form."""
        tensors = [torch.as_tensor(np.ascontiguousarray(a, dtype=np.int32)) for a in (indptr, indices, last_page_len)]
        _plan_decode_wrapper(self.wrapper, *tensors, self.shape, self.page_size, q_dtype, kv_dtype)

    def run(self, q, k_pages, v_pages, out=None):
        return self.wrapper.run(q, (k_pages, v_pages), out=out)


class _HolisticPath:
    """BatchAttention, the persistent kernel that serves prefill and decode rows in one launch."""

    def __init__(self, flashinfer, device) -> None:
        if not hasattr(flashinfer, "BatchAttention"):
            raise EngineUnavailable(
                f"flashinfer {getattr(flashinfer, '__version__', '?')} has no BatchAttention (holistic path)")
        self.device = device
        self.wrapper = flashinfer.BatchAttention(kv_layout="HND", device=str(device))

    def plan(self, tensors: dict, shape, page_size: int, q_dtype, kv_dtype) -> None:
        batch = tensors["seq_lens"].numel()
        # Its plan() reads the indptrs and lengths on the host and keeps kv_indices for run(),
        # so those go up here: the upload is part of this path's plan cost.
        args = (torch.arange(batch + 1, dtype=torch.int32), tensors["indptr"],
                _upload(tensors["indices"], self.device), tensors["seq_lens"],
                shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim, page_size)
        kwargs = dict(causal=False, sm_scale=shape.sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        while True:
            try:
                return self.wrapper.plan(*args, **kwargs)
            except RuntimeError as exc:
                if not self._grow_workspace(exc):
                    raise

    def _grow_workspace(self, exc: RuntimeError) -> bool:
        """Double the wrapper's float workspace after its plan overflowed it; False when the error
        is another one or the workspace is at HOLISTIC_WORKSPACE_LIMIT already."""
        current = getattr(self.wrapper, "float_workspace_buffer", None)
        if _WORKSPACE_OVERFLOW not in str(exc) or current is None:
            return False
        size, device = 2 * current.numel(), current.device
        if size > HOLISTIC_WORKSPACE_LIMIT:
            return False
        del current
        self.wrapper.float_workspace_buffer = None  # the old buffer goes before the new one comes
        self.wrapper.float_workspace_buffer = torch.empty(size, dtype=torch.uint8, device=device)
        return True

    def run(self, q, k_pages, v_pages):
        out, _lse = self.wrapper.run(q, (k_pages, v_pages))
        return out


def _make_path(flashinfer, device, path: str):
    if path == "holistic":
        return _HolisticPath(flashinfer, device)
    return _DecodeWrapperPath(flashinfer, device, tensor_cores=path in ("tc", "fa3"),
                              backend="fa3" if path == "fa3" else None)


class FlashInferPlan(EnginePlan):
    @property
    def kernel_variant(self) -> str | None:
        """Which FlashInfer path runs the step (a PATHS name), once known; the harness records
        it per step."""
        return self.extra.get("path")


class FlashInferEngine(Engine):
    """FlashInfer's batch decode over the shared pages, planned every step.

    ``paths`` is one path (a pinned role such as "flashinfer_tc") or several ("flashinfer": the
    best of PATHS). With several, ``prepare`` (untimed, before a step is timed) times each path on
    the step's real inputs the first time any engine of the process sees a batch-shape class
    (``probe_key``), records each path's decode time and plan() host time, and every such engine
    runs the winner (``pick_path``) for that class. The baseline is therefore the strongest of
    FlashInfer's Hopper paths for every shape, the adaptive engine's fallback runs the same path
    on the same steps, and the probe never lands in a timed step. A path this FlashInfer lacks is
    left out of the set, with the reason in ``missing_paths``.

    plan() (host work plus uploads) runs in ``plan(step)`` and is part of the wall step, as in the
    paper. It needs the q/KV dtypes, which a StepBatch does not carry: they are taken from
    ``prepare`` (or, if prepare was skipped, the first ``run``, which then plans itself).
    """

    def __init__(self, shape, *, paths: tuple[str, ...] = PATHS, device="cuda", page_size: int = 16,
                 name: str = "flashinfer") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.page_size = page_size
        unknown = sorted(set(paths) - set(PATHS) - set(MEASURED_ONLY_PATHS))
        if unknown or not paths:
            raise ValueError(f"FlashInferEngine paths {list(paths)}: known paths are "
                             f"{list(PATHS + MEASURED_ONLY_PATHS)}")
        if self.device.type != "cuda":
            raise EngineUnavailable(f"FlashInfer needs a CUDA device, got {self.device}")
        flashinfer = _import_flashinfer()
        self.version = getattr(flashinfer, "__version__", "unknown")
        self._paths, self.missing_paths = {}, {}
        for path in paths:
            try:
                self._paths[path] = _make_path(flashinfer, self.device, path)
            except EngineUnavailable as exc:
                self.missing_paths[path] = exc.reason
        if not self._paths:
            raise EngineUnavailable("; ".join(self.missing_paths.values()))
        self._dtypes = None
        self._fixed_key = (str(self.device), shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, page_size,
                           tuple(sorted(self._paths)))
        # A wrapper holds only its latest plan; remember which EnginePlan that was.
        self._planned_for: dict[str, EnginePlan] = {}
        self.name = name
        flavour = "best_of_" + "_".join(self._paths) if len(self._paths) > 1 else next(iter(self._paths))
        self.implementation = f"flashinfer-{self.version}-{flavour}"

    def _pick_key(self, step) -> tuple:
        """What a path pick depends on: device, shape and path set, dtypes, batch class."""
        return self._fixed_key, self._dtypes, probe_key(step)

    def path_for(self, step) -> str | None:
        """The path this engine runs for the step's batch class (None until a probe has picked one)."""
        if len(self._paths) == 1:
            return next(iter(self._paths))
        if self._dtypes is None:  # not prepared yet: run() probes
            return None
        return _PATH_PICKS.get(self._pick_key(step))

    def path_among(self, step, paths: tuple[str, ...]) -> str | None:
        """The path to run for the step's batch class where only ``paths`` can run: the pick where
        it is one of them, else ``pick_path`` over their probed times (FlashInfer's CUDA-graph
        wrapper has the fa2 paths only, so a graph falls back from a holistic pick this way, to the
        faster fa2 path and not to a fixed one). None until a probe has picked."""
        picked = self.path_for(step)
        if picked is None or picked in paths:
            return picked
        probed = _PATH_PROBES.get(self._pick_key(step), {})
        timed = {p: probed[p] for p in paths if p in probed}
        return pick_path(timed) if timed else None

    def plan(self, step) -> EnginePlan:
        if step.page_size != self.page_size:
            raise ValueError(f"step.page_size={step.page_size}, engine was built for {self.page_size}")
        tensors = {
            "indptr": torch.from_numpy(np.ascontiguousarray(step.kv_indptr, dtype=np.int32)),
            "indices": torch.from_numpy(np.ascontiguousarray(step.kv_indices, dtype=np.int32)),
            "last_page_len": torch.from_numpy(np.ascontiguousarray(step.kv_last_page_len, dtype=np.int32)),
            "seq_lens": torch.from_numpy(np.ascontiguousarray(step.seq_lens, dtype=np.int32)),  # holistic reads them
        }
        plan = FlashInferPlan(route="flashinfer", step=step, tensors=tensors,
                              extra={"path": self.path_for(step), "planned": None})
        path = plan.extra["path"]
        if path is not None and self._dtypes is not None:
            self._plan_path(path, plan, *self._dtypes)
        return plan

    def _plan_path(self, path: str, plan: EnginePlan, q_dtype, kv_dtype) -> None:
        self._paths[path].plan(plan.tensors, self.shape, self.page_size, q_dtype, kv_dtype)
        plan.extra["planned"] = (path, q_dtype, kv_dtype)
        self._planned_for[path] = plan

    def prepare(self, step, q, k_pages, v_pages) -> None:
        self._dtypes = (q.dtype, k_pages.dtype)
        if self.path_for(step) is not None:
            return
        measured, plan_us = {}, {}
        for path, runner in self._paths.items():
            plan = self.plan(step)
            try:  # first plan may JIT-compile: untimed
                self._plan_path(path, plan, q.dtype, k_pages.dtype)
            except RuntimeError as exc:
                # One path that cannot plan this batch (a workspace or shape limit of its own) leaves
                # the pick to the others; the reason stands in the path record.
                measured[path] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            plan_times = []
            for _ in range(PROBE_PLANS):
                host_start = time.perf_counter()
                self._plan_path(path, plan, q.dtype, k_pages.dtype)
                plan_times.append((time.perf_counter() - host_start) * 1e6)
            plan_us[path] = statistics.median(plan_times)
            runner.run(q, k_pages, v_pages)  # first call may compile or load the kernel
        # Every path keeps its own plan (its own workspace), so their runs can alternate.
        flusher = _probe_flusher(self.device)
        for path in plan_us:  # an untimed round: the clock up, every path's kernels loaded
            self._paths[path].run(q, k_pages, v_pages)
        rounds_us = {path: [] for path in plan_us}
        for r in range(PROBE_ROUNDS):
            for path in (list(plan_us) if r % 2 == 0 else list(reversed(plan_us))):
                rounds_us[path].append(self._timed_runs(path, q, k_pages, v_pages, flusher))
        for path, times in rounds_us.items():
            measured[path] = {"device_us": statistics.median(times), "plan_us": plan_us[path],
                              "rounds_us": [round(t, 3) for t in times]}
        key = self._pick_key(step)
        _PATH_PROBES[key] = measured
        _PATH_PICKS[key] = pick_path(measured)

    def _timed_runs(self, path: str, q, k_pages, v_pages, flusher) -> float:
        """Device microseconds of one run of ``path`` as planned: the mean of PROBE_REPS runs, each
        after an L2 eviction, between its own events, queued ahead of the device (QueuedReps)."""
        runner = self._paths[path]
        samples = QueuedReps(_probe_queue(self.device)).time(lambda: runner.run(q, k_pages, v_pages), PROBE_REPS,
                                                             flusher)
        return statistics.fmean(samples)

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        path = plan.extra["path"]
        if path is None:
            # prepare() was not called for this shape class: probe now (inside the timing).
            self.prepare(plan.step, q, k_pages, v_pages)
            path = plan.extra["path"] = self.path_for(plan.step)
        if (self._planned_for.get(path) is not plan
                or plan.extra["planned"] != (path, q.dtype, k_pages.dtype)):
            self._dtypes = (q.dtype, k_pages.dtype)
            self._plan_path(path, plan, q.dtype, k_pages.dtype)
        return self._paths[path].run(q, k_pages, v_pages)

    def _own_classes(self, table: dict) -> dict:
        return {batch_class: value for (fixed, dtypes, batch_class), value in table.items()
                if fixed == self._fixed_key and dtypes == self._dtypes}

    @property
    def choices(self) -> dict:
        """The path run per probed batch class of this engine's shape and dtypes, including
        classes another engine of the process probed."""
        return self._own_classes(_PATH_PICKS)

    def path_record(self) -> dict:
        """What a result records of the path choice: the paths held, those this FlashInfer lacks,
        and per probed batch class the pick and each path's decode and plan() times."""
        probes = self._own_classes(_PATH_PROBES)
        picks = self.choices
        return {
            "paths": {p: PATH_LABELS[p] for p in self._paths},
            "missing_paths": dict(self.missing_paths),
            "probed": [{"batch": b, "longest_pow2": n, "picked": picks.get((b, n)), "measured": probes[(b, n)]}
                       for (b, n) in sorted(probes)],
        }
