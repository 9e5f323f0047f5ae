"""The vLLM rows: the pinned-source fetch (hash, manifest, include closure, refusals), the engines'
reasons where they cannot run, and, on a GPU, both engines against float64.

No test downloads: the fetch is tried on local fake sdists (file:// URLs). The closure checks read
a fetched third_party/vllm and are skipped without one; the GPU tests are skipped without CUDA.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import re
import stat
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pkv.engines import vllm_build as vb
from pkv.engines import vllm_sources as vs
from pkv.engines.base import EngineUnavailable
from pkv.refusal import exit_on_refusal
from pkv.shape import ModelShape

SHAPE = ModelShape(num_qo_heads=32, num_kv_heads=8, head_dim=128)


def _fake_sdist(tmp_path, version="9.9.9", files=None, role="paged_attention"):
    """A local vllm-<version>.tar.gz and its Sdist pin (the right sha256)."""
    files = files or {"LICENSE": "Apache-2.0\n", "csrc/cuda_compat.h": "#pragma once\n"}
    tarball = tmp_path / f"vllm-{version}.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    return vs.Sdist(role=role, version=version, url=tarball.as_uri(), sha256=digest, files=tuple(files)), tarball


def _refusal(capsys, argv):
    with pytest.raises(SystemExit) as info:
        exit_on_refusal(lambda: vs.main(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("pkv: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------------------------------------
# reasons


@pytest.mark.parametrize("name", ["vllm", "vllm_triton"])
def test_engines_on_a_cpu_device_are_unavailable_with_a_reason(name):
    from pkv.engines import build_engine

    with pytest.raises(EngineUnavailable) as info:
        build_engine(name, shape=SHAPE, device="cpu")
    assert "needs a CUDA device, got cpu" in info.value.reason


@pytest.mark.parametrize("loader", [vb.load_vllm_paged_attention, vb.load_vllm_triton_unified_attention])
def test_loaders_without_a_gpu_say_so(loader, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailable, match="needs a CUDA GPU"):
        loader(tmp_path)


def test_loader_without_sources_names_the_fetch_command(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(EngineUnavailable) as info:
        vb.load_vllm_paged_attention(tmp_path / "none")
    reason = info.value.reason
    assert f"vLLM {vs.PAGED_ATTENTION.version} sources not fetched" in reason
    assert f"python -m pkv.engines.vllm_sources fetch --dest {tmp_path / 'none'}" in reason


def test_engine_unavailable_reason_prints_as_a_table_note(monkeypatch, tmp_path):
    # The isolated benchmark records the reason; tables print "not available: <reason>".
    from pkv.engines.vllm import VllmTritonEngine

    with pytest.raises(EngineUnavailable) as info:
        VllmTritonEngine(SHAPE, device="cpu")
    assert f"not available: {info.value.reason}" == "not available: vLLM Triton unified attention needs a " \
                                                    "CUDA device, got cpu"


# ---------------------------------------------------------------------------------------------
# fetch


def test_fetch_extracts_pinned_files_with_an_atomic_0644_manifest(monkeypatch, tmp_path):
    sdist, tarball = _fake_sdist(tmp_path)
    written = []
    real = vs.write_json_atomic
    monkeypatch.setattr(vs, "write_json_atomic", lambda path, obj: written.append(path) or real(path, obj))
    dest = tmp_path / "dest"
    manifest = vs.fetch(dest, sdists=(sdist,))
    assert written == [dest / "manifest.json"]
    for path in (dest / "manifest.json", dest / "vllm-9.9.9" / "csrc" / "cuda_compat.h"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~_umask(), path
    entry = manifest["sources"]["paged_attention"]
    assert (entry["version"], entry["sha256"], sorted(entry["files"])) == (
        "9.9.9", sdist.sha256, ["LICENSE", "csrc/cuda_compat.h"])
    assert vs.read_manifest(dest) == manifest
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]  # no download left behind
    # Fetched and unchanged: no second download (the tarball is gone), no second write.
    tarball.unlink()
    assert vs.fetch(dest, sdists=(sdist,)) == manifest and written == [dest / "manifest.json"]
    assert vs.fetched_root(sdist, dest) == dest / "vllm-9.9.9"


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_fetch_refuses_a_changed_upload_naming_the_file_and_both_hashes(monkeypatch, tmp_path, capsys):
    sdist, tarball = _fake_sdist(tmp_path)
    pinned = "0" * 64
    changed = vs.Sdist(sdist.role, sdist.version, sdist.url, pinned, sdist.files)
    with pytest.raises(vs.VllmSourcesError) as info:
        vs.fetch(tmp_path / "dest", sdists=(changed,))
    message = str(info.value)
    assert "vllm-9.9.9.tar.gz" in message and sdist.sha256 in message and pinned in message
    assert not (tmp_path / "dest" / "manifest.json").exists()
    assert not (tmp_path / "dest" / "vllm-9.9.9").exists()
    # The command refuses it with the one line of pkv.refusal, as for a local --sdist.
    monkeypatch.setattr(vs, "SDISTS", (changed,))
    err = _refusal(capsys, ["fetch", "--dest", str(tmp_path / "dest"), "--sdist", str(tarball)])
    assert f"field 'sha256' = {sdist.sha256}: expected {pinned}" in err


def test_fetch_without_network_says_why_in_one_line(monkeypatch, tmp_path, capsys):
    missing = vs.Sdist("paged_attention", "9.9.9", (tmp_path / "gone" / "vllm-9.9.9.tar.gz").as_uri(), "0" * 64,
                       ("LICENSE",))
    monkeypatch.setattr(vs, "SDISTS", (missing,))
    err = _refusal(capsys, ["fetch", "--dest", str(tmp_path / "dest")])
    assert "vllm-9.9.9.tar.gz: field 'url'" in err and "cannot download" in err


def test_fetch_refuses_a_pinned_file_the_sdist_lacks(tmp_path):
    sdist, _ = _fake_sdist(tmp_path)
    wrong = vs.Sdist(sdist.role, sdist.version, sdist.url, sdist.sha256, (*sdist.files, "csrc/nope.h"))
    with pytest.raises(vs.VllmSourcesError, match="field 'files' = vllm-9.9.9/csrc/nope.h: not in the sdist"):
        vs.fetch(tmp_path / "dest", sdists=(wrong,))


def test_record_without_network_records_the_reason(monkeypatch, tmp_path):
    missing = vs.Sdist("paged_attention", "9.9.9", (tmp_path / "vllm-9.9.9.tar.gz").as_uri(), "0" * 64, ("LICENSE",))
    monkeypatch.setattr(vs, "SDISTS", (missing,))
    record = vb.write_record(tmp_path / "build" / "vllm.json", tmp_path / "dest")
    assert record["fetched"] is None and record["reason"].startswith("not fetched: ")
    assert stat.S_IMODE((tmp_path / "build" / "vllm.json").stat().st_mode) == 0o644 & ~_umask()


def test_triton_sdist_gets_the_shim_with_vllms_own_kv_quant_mode(tmp_path):
    files = {"LICENSE": "x\n", "vllm/v1/attention/ops/triton_unified_attention.py": "X = 1\n",
             "vllm/v1/attention/ops/triton_attention_helpers.py": "Y = 2\n"}
    kv = "from enum import IntEnum\nimport torch\n\nclass KVQuantMode(IntEnum):\n    NONE = 0\n    FP8 = 1\n"
    sdist, _ = _fake_sdist(tmp_path, "8.8.8", {**files, vs.KV_CACHE_INTERFACE: kv}, role="triton_unified_attention")
    sdist = vs.Sdist(sdist.role, sdist.version, sdist.url, sdist.sha256, tuple(files))
    manifest = vs.fetch(tmp_path / "dest", sdists=(sdist,))
    root = tmp_path / "dest" / "vllm-8.8.8"
    assert set(manifest["sources"]["triton_unified_attention"]["shim"]) == {*vs.SHIM_FILES,
                                                                              "vllm/v1/kv_cache_interface.py"}
    shim = (root / "vllm/v1/kv_cache_interface.py").read_text()
    assert "class KVQuantMode(IntEnum):\n    NONE = 0\n    FP8 = 1" in shim and "import torch" not in shim
    with pytest.raises(vs.VllmSourcesError, match="field 'KVQuantMode' = missing"):
        vs.kv_quant_mode_shim("X = 1\n", "somewhere.py")


# ---------------------------------------------------------------------------------------------
# the fetched sources (skipped where third_party/vllm is not fetched)


def _fetched(sdist):
    try:
        return vs.fetched_root(sdist)
    except EngineUnavailable as exc:
        pytest.skip(exc.reason)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def _cuda_includes(path: Path) -> list[str]:
    """Quoted includes of a file outside its USE_ROCM branches (the CUDA build's)."""
    found, stack = [], []  # stack: is this branch ROCm-only?
    for line in path.read_text().splitlines():
        directive = line.strip().replace("# ", "#")
        if directive.startswith(("#ifdef USE_ROCM", "#if defined(USE_ROCM)")):
            stack.append(True)
        elif directive.startswith(("#ifndef USE_ROCM", "#if !defined(USE_ROCM)")):
            stack.append(False)
        elif directive.startswith("#if"):
            stack.append(None)
        elif directive.startswith("#else") and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
        elif directive.startswith("#endif") and stack:
            stack.pop()
        elif (m := _INCLUDE.match(line)) and not any(stack):
            found.append(m.group(1))
    return found


def test_paged_attention_files_are_the_include_closure():
    root = _fetched(vs.PAGED_ATTENTION)
    csrc = root / "csrc"
    reached, todo = set(), [root / rel for rel in vs.PAGED_KERNEL_SOURCES]
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for name in _cuda_includes(path):
            # As nvcc resolves it: beside the includer, then the -I csrc folder.
            candidates = [path.parent / name, csrc / name]
            hit = next((c.resolve() for c in candidates if c.is_file()), None)
            assert hit is not None, f"{path.relative_to(root)} includes {name!r}, which was not extracted"
            todo.append(hit)
    extracted = {(root / rel).resolve() for rel in vs.PAGED_ATTENTION.files if rel != "LICENSE"}
    assert {p.resolve() for p in reached} == extracted  # closed, and nothing extracted that is not needed


def test_the_build_trims_vllms_launchers_to_the_built_sizes_and_nothing_else():
    import difflib

    root = _fetched(vs.PAGED_ATTENTION)
    for rel in vs.PAGED_KERNEL_SOURCES:
        text = (root / rel).read_text()
        trimmed = vb.trim_launcher(text, rel, head_sizes=(128,), block_sizes=(16,))
        cases = [line.split()[1].rstrip(":") for line in trimmed.splitlines() if line.strip().startswith("case ")]
        assert cases == ["128", "16"], rel
        # Every removed line is a case of another size, its launch and its break; nothing is added.
        diff = [d for d in difflib.ndiff(text.splitlines(), trimmed.splitlines()) if d[:2] in ("- ", "+ ")]
        assert all(d.startswith("- ") for d in diff)
        removed = [d[2:].strip().rstrip("\\").strip() for d in diff]
        assert all(r.startswith(("case ", "LAUNCH_PAGED_ATTENTION", "CALL_V", "break;")) for r in removed), rel
        assert len(removed) == 3 * (8 + 2)  # 8 head sizes and 2 block sizes dropped, 3 lines each
        # Two sizes of each kind, as a user who adds one to BUILT_* would have them.
        both = vb.trim_launcher(text, rel, head_sizes=(64, 128), block_sizes=(16, 32))
        assert [line.split()[1].rstrip(":") for line in both.splitlines()
                if line.strip().startswith("case ")] == ["64", "128", "16", "32"]


def test_trimming_refuses_a_size_the_launcher_lacks_or_a_case_it_cannot_read():
    launcher = "\n".join(["  switch (head_size) {", "    case 128:", "      LAUNCH(128);", "      break;",
                           "    default:", "      break;", "  }"])
    with pytest.raises(vs.VllmSourcesError, match=r"v9.cu: field 'head_size' = no case for \[96\]"):
        vb.trim_launcher(launcher, "v9.cu", head_sizes=(96,), block_sizes=())
    unended = launcher.replace("      break;\n    default", "      LAUNCH(1);\n      LAUNCH(2);\n      LAUNCH(3);\n"
                               "      LAUNCH(4);\n      LAUNCH(5);\n    default")
    with pytest.raises(vs.VllmSourcesError, match=r"v9.cu: field 'case 128' = no break within 5 lines"):
        vb.trim_launcher(unended, "v9.cu", head_sizes=(128,), block_sizes=())


def test_triton_kernel_imports_resolve_inside_the_fetched_tree():
    root = _fetched(vs.TRITON_ATTENTION)
    for rel in vs.TRITON_ATTENTION.files[1:]:
        tree = ast.parse((root / rel).read_text())
        for node in tree.body:  # module-level imports: what importing the file runs
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                if name.split(".")[0] != "vllm":
                    continue
                path = root / name.replace(".", "/")
                assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (rel, name)


# ---------------------------------------------------------------------------------------------
# the pages each engine hands vLLM's kernels (CPU)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_paged_layout_is_the_one_vllms_cache_writer_fills(dtype):
    from pkv.engines.vllm import _paged_layout

    k_pages, v_pages = torch.randn(2, 5, 3, 16, 64).to(dtype)
    key_cache, value_cache = _paged_layout(k_pages, v_pages)
    # vLLM 0.22.1's reshape_and_cache_kernel (csrc/cache_kernels.cu): the key of head h, token slot
    # s, element d at key_cache[block, h, d // x, s, d % x] with x = 16 bytes of elements, the value
    # at value_cache[block, h, d, s]; both packed, one block stride for both (the kernels take K's).
    x = 16 // k_pages.element_size()
    assert key_cache.shape == (5, 3, 64 // x, 16, x) and key_cache.is_contiguous()
    assert value_cache.shape == (5, 3, 64, 16) and value_cache.is_contiguous()
    assert key_cache.stride()[:2] == value_cache.stride()[:2]
    for d in range(64):
        assert torch.equal(key_cache[:, :, d // x, :, d % x], k_pages[..., d])
        assert torch.equal(value_cache[:, :, d, :], v_pages[..., d])


def test_triton_layout_is_the_view_vllms_triton_backend_hands_the_kernel():
    from pkv.engines.vllm import _triton_layout

    blocks, heads, page, dim = 6, 4, 16, 32
    k_pages, v_pages = torch.randn(2, blocks, heads, page, dim, dtype=torch.float16)
    # vLLM 0.34.0: one layer's cache, logically [blocks, Hkv, P, 2d] (K then V per token-head),
    # in the default layout LBNHC (memory [blocks, P, Hkv, 2d]); TritonAttentionImpl.forward splits
    # kv_cache.transpose(1, 2) into K and V at d.
    kv_cache = torch.empty(blocks, page, heads, 2 * dim, dtype=torch.float16).permute(0, 2, 1, 3)
    kv_cache[..., :dim] = k_pages
    kv_cache[..., dim:] = v_pages
    want = kv_cache.transpose(1, 2).split(dim, dim=-1)
    got = _triton_layout(k_pages, v_pages)
    for mine, theirs in zip(got, want):
        assert mine.shape == theirs.shape == (blocks, page, heads, dim)
        assert mine.stride() == theirs.stride()
        assert torch.equal(mine, theirs)
    assert got[1].data_ptr() - got[0].data_ptr() == dim * k_pages.element_size()  # V right after K


# ---------------------------------------------------------------------------------------------
# GPU: each engine against float64


def _gpu_case(seq_lens, shape, dtype, seed, page):
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.pages import assign_pages
    from pkv.pipeline.step import build_step

    assignment = assign_pages(seq_lens, page, 0.5, seed)
    step = build_step(0, np.arange(len(seq_lens)), np.asarray(seq_lens, dtype=np.int32), assignment.pages, page)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, page, dtype, "cuda", seed, peaked=True)
    q = make_queries(len(seq_lens), shape, dtype, "cuda", seed + 1, peaked=True)
    return step, q, k, v


def _engine(name, shape):
    from pkv.engines.vllm import VllmEngine, VllmTritonEngine

    _fetched(vs.PAGED_ATTENTION if name == "vllm" else vs.TRITON_ATTENTION)
    try:
        return (VllmEngine if name == "vllm" else VllmTritonEngine)(shape, device="cuda")
    except EngineUnavailable as exc:
        pytest.skip(exc.reason)


def _run_poisoned(engine, step, q, k, v):
    engine.prepare(step, q, k, v)
    plan = engine.plan(step)
    # The engines allocate their own outputs: fill the allocator's free block of that size with
    # NaN first, so an element the kernel never writes shows up.
    poison = torch.full_like(q, float("nan"))
    del poison
    out = engine.run(q, k, v, plan)
    torch.cuda.synchronize()
    return out


def _lengths(page):
    return [1, page - 1, page, page + 1, 2 * page + 1, 511, 512, 513, 1000, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize("name", ["vllm", "vllm_triton"])
def test_engines_match_float64(name, page, group, dtype):
    from test_kernels_gpu import _check, _dense

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    engine = _engine(name, shape)
    rng = np.random.default_rng(page * 10 + group + (dtype == torch.bfloat16))
    batches = [_lengths(page), [int(x) for x in rng.choice(_lengths(page), size=5)],
               [9000],  # one long row: vLLM's partitioned v2 kernel / Triton's split-KV kernel
               # many rows: v1 where rows x query heads > 512 / Triton's 2D kernel
               [int(x) for x in rng.integers(1, 3000, size=40)]]
    if name == "vllm" and page not in vb.BUILT_BLOCK_SIZES:
        # The build instantiates vLLM's launchers for these block sizes only.
        step, *_ = _gpu_case(batches[0], shape, dtype, seed=0, page=page)
        with pytest.raises(EngineUnavailable, match=r"instantiates block sizes \(16,\)"):
            engine.plan(step)
        return
    if name == "vllm_triton" and page % 16:
        # vLLM's Triton backend takes only block sizes that are multiples of 16.
        step, *_ = _gpu_case(batches[0], shape, dtype, seed=0, page=page)
        with pytest.raises(EngineUnavailable, match="multiples of 16"):
            engine.plan(step)
        return
    for trial, lengths in enumerate(batches):
        step, q, k, v = _gpu_case(lengths, shape, dtype, seed=1000 * group + 10 * page + trial, page=page)
        out = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), dtype)


@pytest.mark.gpu
def test_paged_engine_runs_both_of_vllms_kernels():
    # vLLM's rule: v1 for one partition (<= 512 tokens), v2 for a long row in a small batch.
    shape = ModelShape(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    engine = _engine("vllm", shape)
    called = []
    engine._ops = _Recording(engine._ops, called)
    for lengths in ([100, 200], [4097]):
        step, q, k, v = _gpu_case(lengths, shape, torch.float16, seed=5, page=16)
        _run_poisoned(engine, step, q, k, v)
    assert called == ["paged_attention_v1", "paged_attention_v2"]


class _Recording:
    """The ops namespace, recording which op is called."""

    def __init__(self, ops, called):
        self._ops, self._called = ops, called

    def __getattr__(self, name):
        self._called.append(name)
        return getattr(self._ops, name)


def test_trimming_keeps_the_built_cases_of_both_switches_in_vllms_two_styles():
    # vLLM's shapes: a head_size switch in the launcher's body and a block_size switch inside a
    # macro, its lines ending in backslashes.
    launcher = "\n".join([
        "  switch (head_size) {", "    case 64:", "      LAUNCH(64);", "      break;", "    case 128:",
        "      LAUNCH(128);", "      break;", "    default:", "      TORCH_CHECK(false);", "      break;", "  }",
        "#define BY_BLOCK(T)      \\", "  switch (block_size) { \\", "    case 8:          \\", "      CALL(T, 8); \\",
        "      break;           \\", "    case 16:         \\", "      CALL(T, 16); \\", "      break;           \\",
        "    default:          \\", "      break;           \\", "  }"])
    trimmed = vb.trim_launcher(launcher, "v9.cu", head_sizes=(128,), block_sizes=(16,))
    assert "LAUNCH(64)" not in trimmed and "CALL(T, 8)" not in trimmed
    assert "LAUNCH(128)" in trimmed and "CALL(T, 16)" in trimmed and trimmed.count("default:") == 2
    assert len(launcher.splitlines()) - len(trimmed.splitlines()) == 6
