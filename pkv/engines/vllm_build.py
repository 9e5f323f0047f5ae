"""vLLM's kernels built and loaded from the sources pkv.engines.vllm_sources fetched: the
PagedAttention decode kernels compiled with the project's own binding against the installed
torch, and the Triton unified attention imported from the fetched tree.

    python -m pkv.engines.vllm_build check-compile [--dest third_party/vllm]   # nvcc, no GPU
    python -m pkv.engines.vllm_build record --record artifacts/<gpu>/build/vllm.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from pkv.atomic_io import write_json_atomic
from pkv.build import (
    LINK_FLAGS_VERSION,
    NVCC_FLAGS,
    cache_root,
    compile_library,
    gencode_for,
    load_cached,
    nvcc_path,
    torch_compile_flags,
)
from pkv.engines.base import EngineUnavailable
from pkv.engines.vllm_sources import (
    BINDING_SOURCE,
    DEFAULT_DEST,
    LIBRARY_NAME,
    MANIFEST,
    PAGED_ATTENTION,
    PAGED_KERNEL_SOURCES,
    PAGED_NAME,
    REPO_ROOT,
    SHIM_INCLUDE,
    TRITON_ATTENTION,
    TRITON_MODULE,
    TRITON_NAME,
    VllmSourcesError,
    fetch,
    fetched_root,
)
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal

# ---------------------------------------------------------------------------------------------
# the PagedAttention build


# How vLLM's CMake compiles its CUDA sources (cmake/utils.cmake, get_torch_gpu_compiler_flags, and
# CMAKE_CUDA_STANDARD 20 in CMakeLists.txt): torch's COMMON_NVCC_FLAGS, which
# torch.utils.cpp_extension adds on its own, less their four half / bfloat16 operator and
# conversion bans (vLLM drops them for CUDA >= 12), plus ENABLE_FP8 (CUDA >= 11.8), which the fp8
# branches of quant_utils.cuh and dtype_fp8.cuh are compiled under. nvcc applies -D and -U in
# order, and these come after torch's.
VLLM_NVCC_FLAGS = (
    "-std=c++20",
    "-DENABLE_FP8",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
)


# The head sizes and block sizes the build instantiates. vLLM's launchers instantiate every
# kernel for 9 head sizes x 3 block sizes (x dtypes x cache dtypes x block sparsity), which took
# 309 s of nvcc on the H200 machine, on the critical path of every fresh run; the project's shape
# (d = 128, pages of 16 tokens) needs one of each. The build compiles copies of the two launcher
# files whose head-size and block-size switches keep only these cases (vLLM trims them the same
# way, "to reduce the compilation time"); the kernels and the rest of the launchers are vLLM's as
# fetched. Add a size here to run vLLM's rows on another shape.
BUILT_HEAD_SIZES = (128,)
BUILT_BLOCK_SIZES = (16,)
_SWITCH = re.compile(r"switch\s*\(\s*(head_size|block_size)\s*\)")
_CASE = re.compile(r"^\s*case\s+(\d+)\s*:\s*\\?\s*$")
_BREAK = re.compile(r"^\s*break;\s*\\?\s*$")


def trim_launcher(text: str, name: str, head_sizes=BUILT_HEAD_SIZES, block_sizes=BUILT_BLOCK_SIZES) -> str:
    """vLLM's launcher source with the cases of its head_size and block_size switches that are not
    in the kept sizes removed (each case through its ``break;``). Refused, naming the file, when a
    kept size has no case there or a case does not end in a break: the fetched file is not the
    launcher this reads."""
    kept = {"head_size": {int(h) for h in head_sizes}, "block_size": {int(b) for b in block_sizes}}
    lines, out, switch, found = text.split("\n"), [], None, {"head_size": set(), "block_size": set()}
    i = 0
    while i < len(lines):
        line = lines[i]
        opened = _SWITCH.search(line)
        if opened:
            switch = opened.group(1)
        case = _CASE.match(line) if switch else None
        if case:
            end = next((j for j in range(i + 1, min(i + 6, len(lines))) if _BREAK.match(lines[j])), None)
            if end is None:
                raise VllmSourcesError(f"{name}: field 'case {case.group(1)}' = no break within 5 lines: "
                                       "not the vLLM launcher this build trims")
            size = int(case.group(1))
            if size in kept[switch]:
                found[switch].add(size)
                out.extend(lines[i:end + 1])
            i = end + 1
            continue
        out.append(line)
        i += 1
    for switch, sizes in kept.items():
        if sizes - found[switch]:
            raise VllmSourcesError(f"{name}: field '{switch}' = no case for {sorted(sizes - found[switch])}: "
                                   f"this vLLM launcher does not instantiate them")
    return "\n".join(out)


def write_trimmed_launchers(root: Path, into: Path) -> list[Path]:
    """The two launcher files trimmed to the built sizes, written under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    written = []
    for rel in PAGED_KERNEL_SOURCES:
        source = root / rel
        target = into / source.name
        target.write_text(trim_launcher(source.read_text(), str(source)))
        written.append(target)
    return written


def paged_nvcc_flags() -> list[str]:
    """The project's nvcc flags, vLLM's language standard in place of the project's, and vLLM's."""
    return [*(f for f in NVCC_FLAGS if not f.startswith("-std=")), *VLLM_NVCC_FLAGS]


def _paged_sources(root: Path, trimmed_into: Path) -> list[Path]:
    return [BINDING_SOURCE, *write_trimmed_launchers(root, trimmed_into)]


def _paged_includes(root: Path) -> list[str]:
    # The shim first, so it stands in for torch's ATen/cuda/CUDAContext.h; csrc/ because vLLM's
    # attention/dtype_fp8.cuh includes "torch_utils.h" from there; csrc/attention/ for the
    # trimmed launchers' includes, which vLLM writes relative to that folder.
    return [str(SHIM_INCLUDE), str(root / "csrc"), str(root / "csrc" / "attention")]


def paged_build_key(root: Path, capability: tuple[int, int]) -> str:
    digest = hashlib.sha256()
    ours = [(str(p.relative_to(REPO_ROOT)), p) for p in (BINDING_SOURCE, *sorted(SHIM_INCLUDE.rglob("*.h")))]
    trimmed = {str(Path(rel)) for rel in PAGED_KERNEL_SOURCES}
    for name, path in ours + [(rel, root / rel) for rel in PAGED_ATTENTION.files]:
        digest.update(name.encode())
        # The launchers as the build compiles them: trimmed to the built sizes by this module's code.
        digest.update(trim_launcher(path.read_text(), str(path)).encode() if str(Path(name)) in trimmed
                      else path.read_bytes())
    # The flags too, so a library compiled with other flags is not reused from the cache.
    parts = [digest.hexdigest(), f"sm{capability[0]}{capability[1]}", torch.__version__, str(torch.version.cuda),
             " ".join(LINK_FLAGS_VERSION), " ".join(paged_nvcc_flags())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_PAGED_LOCK = threading.Lock()
_PAGED_LOADED: dict[str, object] = {}


def load_vllm_paged_attention(dest: str | os.PathLike = DEFAULT_DEST, verbose: bool = False):
    """torch.ops.pkv_vllm (paged_attention_v1 / v2), built from the fetched vLLM sources for this
    GPU on first use and cached under PKV_CACHE_DIR by a hash of every source; EngineUnavailable
    with the reason where it cannot be (no CUDA device, sources not fetched, compile failed)."""
    if not torch.cuda.is_available():
        raise EngineUnavailable(f"{PAGED_NAME} needs a CUDA GPU; none is visible to torch")
    root = fetched_root(PAGED_ATTENTION, dest)
    capability = torch.cuda.get_device_capability()
    key = paged_build_key(root, capability)
    with _PAGED_LOCK:
        if key not in _PAGED_LOADED:
            # compile_library joins each source to csrc/, which keeps an absolute path as it is.
            try:
                load_cached(cache_root() / f"vllm-{key}", LIBRARY_NAME,
                             lambda target: compile_library(
                                 target, LIBRARY_NAME, [str(p) for p in _paged_sources(root, target / "sources")],
                                 verbose, extra_include_paths=_paged_includes(root),
                                 extra_cuda_cflags=[*paged_nvcc_flags(), gencode_for(capability)]))
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                errors = [line for line in lines if "error" in line.lower()] or lines
                raise EngineUnavailable(f"vLLM {PAGED_ATTENTION.version} paged attention failed to compile: "
                                        + " | ".join(errors[:3])) from exc
            _PAGED_LOADED[key] = torch.ops.pkv_vllm
    return _PAGED_LOADED[key]


def check_compile(dest: str | os.PathLike = DEFAULT_DEST, arch: str = "90a") -> list[str]:
    """nvcc-compile vLLM's paged_attention_v1/v2.cu and the binding against the fetched sources
    and torch's headers, as load_vllm_paged_attention builds them (no GPU, nothing linked)."""
    dest = Path(dest)
    try:
        root = fetched_root(PAGED_ATTENTION, dest)
    except EngineUnavailable as exc:
        raise VllmSourcesError(f"{dest / MANIFEST}: field 'sources.paged_attention' = missing: {exc}") from None
    # torch's CUDA include list needs CUDA_HOME, which a CPU-only torch cannot find: the CUDA
    # folders are left to nvcc, which knows its own toolkit.
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # here: see pkv.build.compile_library

    flags = [f"-I{p}" for p in _paged_includes(root)] + torch_compile_flags()
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in _paged_sources(root, Path(tmp) / "sources"):
            if source.suffix == ".cu":
                # torch.utils.cpp_extension's order: its COMMON_NVCC_FLAGS, then the extra flags.
                cmd = [nvcc_path(), *COMMON_NVCC_FLAGS, *paged_nvcc_flags(),
                       f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xcompiler", "-fPIC", *flags]
                label = f"{source.name}:sm_{arch}"
            else:
                cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-fPIC", *flags]
                label = source.name
            cmd += ["-c", str(source), "-o", str(Path(tmp) / f"{source.name}.o")]
            start = time.perf_counter()
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                first = [line for line in result.stderr.splitlines() if "error" in line.lower()][:3]
                raise VllmSourcesError(f"{source}: field 'compile' = {label}: failed: "
                                       + (" | ".join(first) or result.stderr.strip()[-500:]))
            done.append(f"{label} ({time.perf_counter() - start:.0f} s)")
    return done


# ---------------------------------------------------------------------------------------------
# the Triton unified attention


_TRITON_LOCK = threading.Lock()
_TRITON_LOADED: dict[str, object] = {}


def _import_isolated(root: Path, module: str):
    """Import ``module`` from the fetched tree (real kernel files, shim package) without leaving
    any vllm.* module behind: an installed vLLM, if any, is set aside for the import and put back,
    and the kernel keeps its own references to the shim through its globals."""
    own = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "vllm" or name.startswith("vllm.")}
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(own)


def load_vllm_triton_unified_attention(dest: str | os.PathLike = DEFAULT_DEST):
    """vLLM's unified_attention (Triton) from the fetched release; EngineUnavailable with the
    reason where it cannot run (no CUDA device, no triton, sources not fetched, import failed)."""
    if not torch.cuda.is_available():
        raise EngineUnavailable(f"{TRITON_NAME} needs a CUDA GPU; none is visible to torch")
    try:
        importlib.import_module("triton")  # an optional dependency: its absence is a reason
    except ImportError as exc:
        raise EngineUnavailable(f"{TRITON_NAME} needs triton: {exc}") from None
    root = fetched_root(TRITON_ATTENTION, dest)
    with _TRITON_LOCK:
        if str(root) not in _TRITON_LOADED:
            try:
                module = _import_isolated(root, TRITON_MODULE)
            except Exception as exc:  # an import error of a fetched file is a reason, not a crash
                raise EngineUnavailable(f"vLLM {TRITON_ATTENTION.version} {TRITON_MODULE} failed to import: "
                                        f"{type(exc).__name__}: {exc}") from exc
            _TRITON_LOADED[str(root)] = module.unified_attention
    return _TRITON_LOADED[str(root)]


# ---------------------------------------------------------------------------------------------
# the record a DAG rule writes


def write_record(path: Path, dest: Path, local: dict[str, Path] | None = None) -> dict:
    """Fetch (or find fetched) and, where a GPU is visible, build and load both kernels; write
    what happened to ``path``. A reason (no network, no GPU) is recorded, not raised, so the rule
    succeeds where the rows cannot run and the tables print ``not available: <reason>``."""
    record: dict = {"schema": "pkv.vllm_build/1", "dest": str(dest)}
    try:
        manifest = fetch(dest, local=local)
        record["fetched"] = {role: {"version": e["version"], "sha256": e["sha256"], "files": sorted(e["files"])}
                             for role, e in manifest["sources"].items()}
    except VllmSourcesError as exc:
        record["fetched"] = None
        record["reason"] = f"not fetched: {exc}"
    if record["fetched"] is not None:
        for role, loader in (("paged_attention", load_vllm_paged_attention),
                             ("triton_unified_attention", load_vllm_triton_unified_attention)):
            start = time.perf_counter()
            try:
                loader(dest)
                record[role] = {"built": True, "seconds": round(time.perf_counter() - start, 2)}
            except EngineUnavailable as exc:
                record[role] = {"built": False, "reason": f"not available: {exc.reason}"}
        # What the trimmed launchers instantiate.
        record["paged_attention"].update(head_sizes=list(BUILT_HEAD_SIZES), block_sizes=list(BUILT_BLOCK_SIZES))
    record["provenance"] = collect_provenance()
    write_json_atomic(path, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("check-compile", "record"))
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the git-ignored sources folder")
    parser.add_argument("--sdist", type=Path, action="append", default=[],
                        help="a pinned sdist already on disk (verified like a download); repeatable")
    parser.add_argument("--record", type=Path, help="record: the JSON to write")
    parser.add_argument("--arch", default="90a", help="check-compile: the sm_ target")
    args = parser.parse_args(argv)
    local = {p.name: p for p in args.sdist}
    if args.command == "check-compile":
        for item in check_compile(args.dest, args.arch):
            print(f"compiled {item}")
    else:
        if args.record is None:
            parser.error("record needs --record PATH")
        record = write_record(args.record, args.dest, local)
        print(json.dumps({k: v for k, v in record.items() if k != "provenance"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
