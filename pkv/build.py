"""Build the CUDA extension for the detected GPU, cached by source hash.

The cache key covers every file in csrc/, the target arch, and the torch and CUDA versions, so a
changed kernel or a new GPU never loads a stale library. A file lock keeps two processes from
building the same key at once (FlashInfer's JIT cache works the same way).

    python -m pkv.build --record artifacts/h200/build/extension.json   # build (or skip: no GPU)
    python -m pkv.build --check-compile     # nvcc every .cu and parse the binding, no GPU needed
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pkv.atomic_io import write_json_atomic
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal

REPO_ROOT = Path(__file__).resolve().parent.parent
CSRC = REPO_ROOT / "csrc"
KERNEL_SOURCES = ("launch.cu", "launch_fp16_g1to4.cu", "launch_fp16_g5to8.cu", "launch_bf16_g1to4.cu",
                  "launch_bf16_g5to8.cu", "step_executor.cu", "device_plan.cu")
BINDING_SOURCE = "pkv_ops.cpp"
LIBRARY_NAME = "pkv_ext"
# The step planner and the route policy's C++ form: part of the CUDA extension, and on their own a
# CPU-only library where there is no GPU (the same torch.ops.pkv ops either way; never load both in
# one process).
HOST_SOURCES = ("host_ops.cpp", "step_plan.cpp", "route_policy.cpp")
HOST_HEADERS = ("host_ops.h", "step_plan.h", "route_policy.h", "decode_constants.h", "split_rule.h")
HOST_LIBRARY_NAME = "pkv_host"


def csrc_files() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in {".cu", ".cuh", ".h", ".cpp"})


def source_hash(files: list[Path] | None = None) -> str:
    digest = hashlib.sha256()
    for path in csrc_files() if files is None else files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def gencode_for(capability: tuple[int, int]) -> str:
    """nvcc target for a compute capability; Hopper gets the arch-specific sm_90a."""
    major, minor = capability
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"


def cache_root() -> Path:
    return Path(os.environ.get("PKV_CACHE_DIR", Path.home() / ".cache" / "persistentkv"))


def build_key(capability: tuple[int, int]) -> str:
    parts = [source_hash(), f"sm{capability[0]}{capability[1]}", torch.__version__, str(torch.version.cuda),
             " ".join(LINK_FLAGS_VERSION)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    return found


NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr")


def ensure_built(verbose: bool = False) -> Path:
    """Load the extension into torch.ops.pkv, building it first if this key is not cached."""
    if not torch.cuda.is_available():
        raise RuntimeError("the PersistentKV CUDA extension needs a CUDA GPU; none is visible to torch")
    capability = torch.cuda.get_device_capability()
    return load_cached(cache_root() / build_key(capability), LIBRARY_NAME,
                        lambda target: _compile(target, capability, verbose))


def load_cached(target: Path, name: str, compile_into) -> Path:
    """Load target/<name>.so into torch.ops, compiling it first (under a file lock, so two
    processes never build the same key at once) when it is not cached."""
    library = target / f"{name}.so"
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            compile_into(target)
    torch.ops.load_library(str(library))
    return library


def _compile(target: Path, capability: tuple[int, int], verbose: bool) -> None:
    compile_library(target, LIBRARY_NAME, [BINDING_SOURCE, *HOST_SOURCES, *KERNEL_SOURCES], verbose,
                     extra_cuda_cflags=[*NVCC_FLAGS, gencode_for(capability)])


# Bumped when the link flags change, so a library linked the old way is not reused from the cache.
LINK_FLAGS_VERSION = ("libstdc++-of-the-process",)


def _loaded_libstdcxx() -> str | None:
    """The libstdc++ this process has loaded (torch's), or None where /proc cannot say.

    The extension must throw its errors (TORCH_CHECK) with the C++ runtime that catches them. A
    compiler driver that links libstdc++ statically into shared objects (one on the GPU machine
    does: its library folder holds only libstdc++.a) gives the extension a second runtime, and
    every error raised in an op then crashes the process instead of reaching Python. Linking the
    loaded libstdc++.so by path makes the extension use the process's own.
    """
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libstdc++.so" in path:
                    return path
    except OSError:
        pass
    return None


def compile_library(target: Path, name: str, sources: list[str], verbose: bool, **options) -> None:
    # Imported here: torch.utils.cpp_extension looks for a CUDA toolkit on import, and with a CUDA
    # build of torch on a machine without a GPU it prints a line on every command that loads pkv.build.
    from torch.utils.cpp_extension import load

    libstdcxx = _loaded_libstdcxx()

    work = Path(tempfile.mkdtemp(prefix="build-", dir=target))
    load(
        name=name,
        sources=[str(CSRC / s) for s in sources],
        extra_cflags=["-O3"],
        extra_ldflags=[libstdcxx] if libstdcxx else [],
        build_directory=str(work),
        is_python_module=False,
        verbose=verbose,
        **options,
    )
    built = work / f"{name}.so"
    os.replace(built, target / f"{name}.so")  # atomic: a crash leaves no half library
    shutil.rmtree(work, ignore_errors=True)


def ensure_host_built(verbose: bool = False) -> Path:
    """Load the CPU-only step planner into torch.ops.pkv (machines without a GPU), building it
    first if this key is not cached. On a GPU machine use ensure_built: it holds the planner."""
    files = [CSRC / f for f in (*HOST_SOURCES, *HOST_HEADERS)]
    parts = [source_hash(files), "cpu", torch.__version__, *LINK_FLAGS_VERSION]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return load_cached(cache_root() / f"host-{key}", HOST_LIBRARY_NAME,
                        lambda target: compile_library(target, HOST_LIBRARY_NAME, list(HOST_SOURCES), verbose,
                                                        with_cuda=False))


# The compile check's targets: Hopper and Ampere datacenter parts, and sm_86 (the paper's RTX 3060).
CHECK_ARCHES = ("90a", "80", "86")


def check_compile(arches: tuple[str, ...] = CHECK_ARCHES) -> list[str]:
    """Compile every kernel source with nvcc (no GPU, no torch) so a broken kernel fails CI, then
    link the first arch's objects into one library and refuse any project symbol left undefined
    (a launcher declared in one file and instantiated in none would otherwise fail only when the
    GPU machine loads the extension)."""
    nvcc = nvcc_path()
    # The build compiles KERNEL_SOURCES: a .cu file outside that list would pass this check and be
    # missing from the library the GPU machine loads.
    on_disk = {p.name for p in CSRC.glob("*.cu")}
    if on_disk != set(KERNEL_SOURCES):
        raise RuntimeError(f"pkv/build.py: field 'KERNEL_SOURCES' = {sorted(KERNEL_SOURCES)}; csrc/ holds "
                           f"{sorted(on_disk)}")
    done, spilling = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted(CSRC.glob("*.cu")):
            for arch in arches:
                cmd = [nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xcompiler", "-fPIC",
                       "-Xptxas", "-v", "-c", str(source), "-o", str(Path(tmp) / f"{source.stem}.{arch}.o")]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"nvcc failed on {source.name} for sm_{arch}:\n{result.stderr}")
                spilling += [f"{source.name}:sm_{arch}: {kernel} ({stores} bytes stored, {loads} loaded)"
                             for kernel, stores, loads in kernel_spills(result.stderr)]
                done.append(f"{source.name}:sm_{arch}")
        if spilling:
            raise RuntimeError("kernels spill registers to local memory (the decode loop is at its register cap "
                               "at stages = 2; see docs/performance.md, \"Register spills at stages = 2\"):\n"
                               + "\n".join(spilling))
        done.append("no register spills")
        library = Path(tmp) / "kernels.so"
        objects = sorted(str(o) for o in Path(tmp).glob(f"*.{arches[0]}.o"))
        result = subprocess.run([nvcc, "-shared", "-o", str(library), *objects], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the kernel objects do not link:\n{result.stderr}")
        symbols = subprocess.run(["nm", "-C", "-u", str(library)], capture_output=True, text=True, check=True)
        undefined = [line.split(None, 1)[-1] for line in symbols.stdout.splitlines() if "pkv::" in line]
        if undefined:
            raise RuntimeError("the kernel objects leave project symbols undefined:\n" + "\n".join(undefined))
        done.append(f"kernels linked:sm_{arches[0]}")
    return done


_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def kernel_spills(ptxas_log: str) -> list[tuple[str, int, int]]:
    """(function, spill store bytes, spill load bytes) of every function that spills, from the
    output of ``nvcc -Xptxas -v``."""
    found, function = [], None
    for line in ptxas_log.splitlines():
        named = _PTXAS_FUNCTION.search(line)
        if named:
            function = named.group(1)
            continue
        spills = _PTXAS_SPILLS.search(line)
        if spills and function is not None and (int(spills.group(1)) or int(spills.group(2))):
            found.append((function, int(spills.group(1)), int(spills.group(2))))
    return found


def torch_compile_flags() -> list[str]:
    """What a compiler line needs to read torch's headers outside torch.utils.cpp_extension (the
    compile checks, which build nothing): torch's C++ ABI, its include folders, and on a CPU-only
    torch the switch that leaves out the c10/cuda header only torch's CUDA build writes (it only
    marks c10_cuda a shared library, which matters for Windows exports)."""
    from torch.utils.cpp_extension import include_paths

    folders = include_paths()
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in folders):
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return flags + [a for p in folders for a in ("-isystem", p)]


def nvcc_include_folders() -> list[str]:
    """The CUDA include folders nvcc passes its host compiler (it may be a wrapper script outside
    the toolkit, so they are read from its dry run rather than guessed)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cu"
        probe.touch()
        dryrun = subprocess.run([nvcc_path(), "--dryrun", "-c", str(probe), "-o", str(probe.with_suffix(".o"))],
                                capture_output=True, text=True)
    return list(dict.fromkeys(re.findall(r"-I(\S+?)\"?\s", dryrun.stdout + dryrun.stderr)))


def check_binding_syntax() -> str:
    """Parse the torch binding with the host C++ compiler against torch's and CUDA's headers, so a
    binding that would not build on the GPU machine fails CI."""
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-w", *torch_compile_flags(),
           *(f"-I{d}" for d in (*nvcc_include_folders(), CSRC)), str(CSRC / BINDING_SOURCE)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the binding {BINDING_SOURCE} does not compile:\n{result.stderr}")
    return f"{BINDING_SOURCE}:syntax"


def write_record(path: Path) -> dict:
    record: dict = {"schema": "pkv.build/1", "source_hash": source_hash()}
    if not torch.cuda.is_available():
        record["skipped"] = "no GPU: the CUDA extension is built only where torch sees a CUDA device"
    else:
        start = time.perf_counter()
        library = ensure_built()
        capability = torch.cuda.get_device_capability()
        record.update(
            library=str(library),
            key=build_key(capability),
            gencode=gencode_for(capability),
            seconds=round(time.perf_counter() - start, 2),
        )
    record["provenance"] = collect_provenance()
    write_json_atomic(path, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="build (or record why not) and write this JSON")
    parser.add_argument("--check-compile", action="store_true",
                        help="compile every csrc/*.cu with nvcc and parse the binding")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.check_compile:
        for item in (*check_compile(), check_binding_syntax()):
            print(f"compiled {item}")
    if args.record:
        record = write_record(args.record)
        print(json.dumps({k: v for k, v in record.items() if k != "provenance"}, indent=1))
    if not (args.check_compile or args.record):
        ensure_built(verbose=args.verbose)
        print("extension loaded")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
