"""vLLM's attention kernels for the baseline rows, fetched from pinned sdists and built here.

Two vLLM releases are pinned, each by version, sdist URL and sha256:

* vLLM 0.22.1, the last release whose sources ship the CUDA PagedAttention decode kernels
  (csrc/attention/paged_attention_v1.cu / v2.cu; 0.23.0 and later keep only a ROCm one). Only
  the include closure of those two files is extracted; the project's own binding
  (csrc/vllm_binding/paged_attention.cpp) is compiled with them against the installed torch.
* vLLM 0.34.0, the newest release, for its Triton unified attention
  (vllm/v1/attention/ops/triton_unified_attention.py and the helpers it imports). Its other
  imports (vllm.envs, vllm.logger, vllm.platforms, vllm.triton_utils, vllm.v1.kv_cache_interface)
  pull in most of vLLM, yet the kernel uses one flag, a logger, the fp8 dtype, a ROCm test and a
  capability test from them, and the KVQuantMode enum: a shim package written beside the real
  files provides those (KVQuantMode's class is copied verbatim from the release's own file).

    python -m pkv.engines.vllm_sources fetch [--dest third_party/vllm] [--sdist FILE ...]

Building and loading the kernels from the fetched files is pkv.engines.vllm_build's.

The sources land in a git-ignored folder with manifest.json (versions, hashes, file list); they
are read from there at build time, never committed. A failed download, a changed upload (a hash
other than the pinned one) or a failed compile check refuses with one line (pkv.refusal).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pkv.atomic_io import read_json, write_json_atomic, write_text_atomic
from pkv.engines.base import EngineUnavailable
from pkv.refusal import exit_on_refusal

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO_ROOT / "third_party" / "vllm"
BINDING_DIR = REPO_ROOT / "csrc" / "vllm_binding"
BINDING_SOURCE = BINDING_DIR / "paged_attention.cpp"
# Found before torch's headers, for vLLM's .cu files only (the header says why).
SHIM_INCLUDE = BINDING_DIR / "shim"
LIBRARY_NAME = "pkv_vllm_paged_attention"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "pkv.vllm_sources/1"
FETCH_COMMAND = "python -m pkv.engines.vllm_sources fetch"


class VllmSourcesError(OSError):
    """The sources cannot be fetched or used (download, hash, manifest, compile check).

    An OSError, so every command refuses it through pkv.refusal with its one line."""


@dataclass(frozen=True)
class Sdist:
    """One pinned vLLM source distribution and the files taken from it."""

    role: str
    version: str
    url: str
    sha256: str
    # Paths inside the sdist below its top folder (vllm-<version>/), extracted as they are.
    files: tuple[str, ...]

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def root(self) -> str:
        return f"vllm-{self.version}"


# How the two kernels name themselves in errors and "not available" reasons.
PAGED_NAME = "vLLM PagedAttention v2"
TRITON_NAME = "vLLM Triton unified attention"

# The include closure of paged_attention_v1.cu / v2.cu on CUDA (the USE_ROCM branches, which
# include the amd quant_utils.cuh and hip headers, are left out). tests/test_vllm_engines.py
# checks that every quoted include of these files resolves to one of them.
PAGED_ATTENTION = Sdist(
    role="paged_attention",
    version="0.22.1",
    url="https://files.pythonhosted.org/packages/84/7c/6c745e218eaffc0fe77480d0fcbbf6835ba655da3691606eba3b8b48cc81/"
        "vllm-0.22.1.tar.gz",
    sha256="cd34902729f3767e3dfbb391956b2986bc638a54be9893e78bda9cc55669f15c",
    files=(
        "LICENSE",
        "csrc/attention/paged_attention_v1.cu",
        "csrc/attention/paged_attention_v2.cu",
        "csrc/attention/attention_kernels.cuh",
        "csrc/attention/attention_dtypes.h",
        "csrc/attention/attention_generic.cuh",
        "csrc/attention/attention_utils.cuh",
        "csrc/attention/dtype_bfloat16.cuh",
        "csrc/attention/dtype_float16.cuh",
        "csrc/attention/dtype_float32.cuh",
        "csrc/attention/dtype_fp8.cuh",
        "csrc/cuda_compat.h",
        "csrc/torch_utils.h",
        "csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh",
    ),
)
PAGED_KERNEL_SOURCES = ("csrc/attention/paged_attention_v1.cu", "csrc/attention/paged_attention_v2.cu")

TRITON_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
TRITON_ATTENTION = Sdist(
    role="triton_unified_attention",
    version="0.34.0",
    url="https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
        "vllm-0.34.0.tar.gz",
    sha256="fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    files=(
        "LICENSE",
        "vllm/v1/attention/ops/triton_unified_attention.py",
        "vllm/v1/attention/ops/triton_attention_helpers.py",
    ),
)
# Read from the sdist, not extracted: the shim's kv_cache_interface copies one class of it.
KV_CACHE_INTERFACE = "vllm/v1/kv_cache_interface.py"
SDISTS = (PAGED_ATTENTION, TRITON_ATTENTION)

_SHIM_NOTE = ("# A stand-in written by pkv.engines.vllm_sources, not vLLM's module: it provides only what\n"
              "# vllm/v1/attention/ops/triton_unified_attention.py and its helpers use from it.\n")
# The shim package for the Triton kernel, path (below vllm-<version>/) -> text. Every name here
# mirrors what vLLM's own module gives on a CUDA GPU.
SHIM_FILES = {
    "vllm/__init__.py": _SHIM_NOTE + f'__version__ = "{TRITON_ATTENTION.version}"\n',
    "vllm/envs.py": _SHIM_NOTE + (
        "import os\n\n"
        "# vLLM's default: off unless VLLM_BATCH_INVARIANT is a non-zero integer.\n"
        'VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))\n'),
    "vllm/logger.py": _SHIM_NOTE + (
        "import logging\n\n\n"
        "class _Logger(logging.LoggerAdapter):\n"
        "    def __init__(self, logger):\n"
        "        super().__init__(logger, {})\n"
        "        self._seen = set()\n\n"
        "    def _once(self, level, msg, *args):\n"
        "        if (level, msg, args) not in self._seen:\n"
        "            self._seen.add((level, msg, args))\n"
        "            self.log(level, msg, *args)\n\n"
        "    def debug_once(self, msg, *args, **_):\n"
        "        self._once(logging.DEBUG, msg, *args)\n\n"
        "    def info_once(self, msg, *args, **_):\n"
        "        self._once(logging.INFO, msg, *args)\n\n"
        "    def warning_once(self, msg, *args, **_):\n"
        "        self._once(logging.WARNING, msg, *args)\n\n\n"
        "def init_logger(name):\n"
        "    return _Logger(logging.getLogger(name))\n"),
    "vllm/platforms/__init__.py": _SHIM_NOTE + (
        "import torch\n\n\n"
        "class _CudaPlatform:\n"
        "    @staticmethod\n"
        "    def is_rocm():\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def is_cuda():\n"
        "        return True\n\n"
        "    @staticmethod\n"
        "    def fp8_dtype():\n"
        "        return torch.float8_e4m3fn\n\n"
        "    @staticmethod\n"
        "    def is_device_capability_family(capability, device_id=0):\n"
        "        # vLLM: the same major version (10.x for 100), as CUDA 13's family architectures.\n"
        "        major, minor = torch.cuda.get_device_capability(device_id)\n"
        "        return (major * 10 + minor) // 10 == capability // 10\n\n\n"
        "current_platform = _CudaPlatform()\n"),
    "vllm/triton_utils/__init__.py": _SHIM_NOTE + "import triton\nimport triton.language as tl\n",
    "vllm/v1/__init__.py": _SHIM_NOTE,
    "vllm/v1/attention/__init__.py": _SHIM_NOTE,
    "vllm/v1/attention/ops/__init__.py": _SHIM_NOTE,
    # "vllm/v1/kv_cache_interface.py" is generated from the release's file (kv_quant_mode_shim).
}


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def kv_quant_mode_shim(source: str, where: str) -> str:
    """The shim's vllm/v1/kv_cache_interface.py: the release's KVQuantMode class, verbatim."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "KVQuantMode":
            segment = ast.get_source_segment(source, node)
            return _SHIM_NOTE + "from enum import IntEnum\n\n\n" + segment + "\n"
    raise VllmSourcesError(f"{where}: field 'KVQuantMode' = missing: the release no longer defines the class "
                           "the Triton kernel imports; pin another version in pkv/engines/vllm_sources.py")


# ---------------------------------------------------------------------------------------------
# fetch


def _download(sdist: Sdist, folder: Path) -> Path:
    """The sdist downloaded into ``folder``.

    A plain HTTPS GET of the pinned file URL (the one pip resolves ``vllm==<version>`` to), not
    ``pip download``: pip prepares metadata for every sdist it downloads, which runs vLLM's
    setup.py and so needs vLLM's build requirements (setuptools-scm, setuptools-rust, a CUDA
    torch) and rejects the local version suffix (+cpu, +empty) it derives on this machine.
    """
    target = folder / sdist.filename
    try:
        with urllib.request.urlopen(sdist.url, timeout=120) as response, open(target, "wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise VllmSourcesError(
            f"{sdist.filename}: field 'url' = {sdist.url}: cannot download ({reason}); fetch where PyPI is "
            f"reachable ({FETCH_COMMAND}, or scripts/vllm_carry.sh) and carry the folder, or pass --sdist FILE"
        ) from None
    return target


def verify_sdist(sdist: Sdist, path: Path) -> None:
    """Refuse a tarball whose sha256 is not the pinned one (a changed upload, a wrong file)."""
    actual = _sha256_file(path)
    if actual != sdist.sha256:
        raise VllmSourcesError(
            f"{path}: field 'sha256' = {actual}: expected {sdist.sha256}, pinned for vllm {sdist.version} "
            f"({sdist.filename}) in pkv/engines/vllm_sources.py; refusing a file other than the pinned upload")


def _extract(sdist: Sdist, tarball: Path, dest: Path) -> dict:
    """Write the pinned files of one sdist (and, for the Triton sdist, the shim) under
    dest/vllm-<version>/; returns the manifest entry."""
    texts: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as archive:
        def read(rel: str) -> str:
            name = f"{sdist.root}/{rel}"
            try:
                member = archive.getmember(name)
            except KeyError:
                raise VllmSourcesError(f"{tarball}: field 'files' = {name}: not in the sdist; the pinned file "
                                       "list in pkv/engines/vllm_sources.py does not match this release") from None
            handle = archive.extractfile(member)
            if handle is None:
                raise VllmSourcesError(f"{tarball}: field 'files' = {name}: not a regular file")
            return handle.read().decode("utf-8")

        for rel in sdist.files:
            texts[rel] = read(rel)
        shim = {}
        if sdist.role == TRITON_ATTENTION.role:
            shim = dict(SHIM_FILES)
            shim["vllm/v1/kv_cache_interface.py"] = kv_quant_mode_shim(read(KV_CACHE_INTERFACE),
                                                                        f"{tarball}:{sdist.root}/{KV_CACHE_INTERFACE}")
    root = dest / sdist.root
    for rel, text in {**texts, **shim}.items():
        # Through the one atomic writer: 0644, and a killed fetch leaves no half file.
        write_text_atomic(root / rel, text)
    return {
        "version": sdist.version,
        "sdist": sdist.filename,
        "url": sdist.url,
        "sha256": sdist.sha256,
        "root": sdist.root,
        "files": {rel: _sha256_bytes(text.encode("utf-8")) for rel, text in texts.items()},
        "shim": {rel: _sha256_bytes(text.encode("utf-8")) for rel, text in shim.items()},
    }


def _entry_current(entry, sdist: Sdist, dest: Path) -> bool:
    """True when a manifest entry is this pin's and every file it lists is on disk unchanged."""
    if not isinstance(entry, dict) or entry.get("sha256") != sdist.sha256 or entry.get("version") != sdist.version:
        return False
    listed = {**entry.get("files", {}), **entry.get("shim", {})}
    if set(entry.get("files", {})) != set(sdist.files):
        return False
    for rel, digest in listed.items():
        path = dest / sdist.root / rel
        if not path.is_file() or _sha256_file(path) != digest:
            return False
    return True


def read_manifest(dest: Path) -> dict | None:
    path = Path(dest) / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise VllmSourcesError(f"{path}: field 'schema' = {manifest.get('schema') if isinstance(manifest, dict) else manifest!r}: "
                               f"expected {MANIFEST_SCHEMA!r}; delete the folder and run {FETCH_COMMAND}")
    return manifest


def fetch(dest: str | os.PathLike = DEFAULT_DEST, sdists: tuple[Sdist, ...] | None = None,
          local: dict[str, Path] | None = None) -> dict:
    """Fetch, verify and extract every pinned sdist into ``dest``; writes dest/manifest.json.

    ``local`` maps sdist file names to tarballs already on disk (no download for those). A pin
    whose files are already there, unchanged, is skipped, so a fetched folder needs no network.
    """
    dest = Path(dest)
    sdists = SDISTS if sdists is None else sdists
    local = {Path(p).name: Path(p) for p in (local or {}).values()}
    old = read_manifest(dest) or {}
    entries = dict(old.get("sources", {}))
    for sdist in sdists:
        if _entry_current(entries.get(sdist.role), sdist, dest):
            continue
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as tmp:
            tarball = local.get(sdist.filename) or _download(sdist, Path(tmp))
            verify_sdist(sdist, tarball)
            entries[sdist.role] = _extract(sdist, tarball, dest)
    manifest = {"schema": MANIFEST_SCHEMA, "sources": {s.role: entries[s.role] for s in sdists}}
    if manifest != old:
        write_json_atomic(dest / MANIFEST, manifest)
    return manifest


def fetched_root(sdist: Sdist, dest: str | os.PathLike = DEFAULT_DEST) -> Path:
    """dest/vllm-<version>/ of a pinned sdist, or EngineUnavailable naming the fetch command."""
    dest = Path(dest)
    try:
        manifest = read_manifest(dest)
    except (VllmSourcesError, ValueError) as exc:
        raise EngineUnavailable(str(exc)) from None
    entry = (manifest or {}).get("sources", {}).get(sdist.role)
    if entry is None or entry.get("sha256") != sdist.sha256:
        found = "none" if entry is None else f"vllm {entry.get('version')}"
        raise EngineUnavailable(
            f"vLLM {sdist.version} sources not fetched into {dest} (found {found}): run "
            f"`{FETCH_COMMAND} --dest {dest}` where PyPI is reachable, or scripts/vllm_carry.sh")
    return dest / sdist.root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("fetch",))
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the git-ignored sources folder")
    parser.add_argument("--sdist", type=Path, action="append", default=[],
                        help="a pinned sdist already on disk (verified like a download); repeatable")
    args = parser.parse_args(argv)
    manifest = fetch(args.dest, local={p.name: p for p in args.sdist})
    for role, entry in manifest["sources"].items():
        print(f"{role}: vllm {entry['version']} ({entry['sha256'][:12]}), {len(entry['files'])} files "
              f"in {args.dest / entry['root']}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
