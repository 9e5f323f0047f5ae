import dataclasses
import json
import subprocess

import pytest

from pkv import provenance
from pkv.provenance import collect_provenance

KEYS = {"git_commit", "git_dirty", "source_digest", "host", "gpu_name", "driver_version", "cuda_version", "torch", "flashinfer",
        "python", "platform", "timestamp_utc", "config", "seed"}


@pytest.fixture(autouse=True)
def _fresh_caches():
    caches = (provenance._git_state, provenance.nvidia_smi_devices, provenance.source_digest)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def _no_gpu(monkeypatch):
    real_which = provenance.shutil.which
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None if name == "nvidia-smi" else real_which(name))
    monkeypatch.setattr(provenance, "_torch_info", lambda: ("2.5.0", None, None))


def test_keys_present_without_gpu(monkeypatch):
    _no_gpu(monkeypatch)
    prov = collect_provenance({"trace": {"family": "bimodal"}}, seed=20260623)
    assert KEYS <= set(prov)
    assert prov["gpu_name"] is None and prov["driver_version"] is None and prov["cuda_version"] is None
    assert prov["seed"] == 20260623
    assert prov["config"] == {"trace": {"family": "bimodal"}}
    assert prov["timestamp_utc"].endswith("+00:00")
    json.dumps(prov)  # must be storable as-is


def test_real_machine_provenance_is_json():
    prov = collect_provenance()
    assert KEYS <= set(prov)
    assert prov["config"] == {} and prov["seed"] is None
    assert isinstance(prov["torch"], str) and prov["flashinfer"]
    json.dumps(prov)


def test_without_git_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "_SOURCE_DIR", tmp_path)  # not inside any repository
    prov = collect_provenance()
    assert prov["git_commit"] == "unknown"
    assert prov["git_dirty"] is None


def _checkout(root, text="x = 1\n"):
    (root / "pkv").mkdir(parents=True)
    (root / "pkv" / "core.py").write_text(text)


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
                        "GIT_COMMITTER_EMAIL": "a@b", "PATH": "/usr/bin:/bin"})


def _clean_repo(root):
    _checkout(root)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "c")
    return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_source_stamp_names_the_commit_of_a_copied_tree(monkeypatch, tmp_path):
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    head = _clean_repo(repo)
    monkeypatch.setattr(provenance, "_SOURCE_DIR", repo)
    stamp_path = tmp_path / "stamp.json"
    assert provenance.main(["--stamp", str(stamp_path)]) == 0
    stamp = json.loads(stamp_path.read_text())
    assert stamp == {"git_commit": head, "source_digest": provenance.source_digest()}

    _checkout(copy)  # same sources, no repository
    monkeypatch.setattr(provenance, "_SOURCE_DIR", copy)
    provenance.source_digest.cache_clear()
    monkeypatch.setenv(provenance.SOURCE_STAMP_ENV, str(stamp_path))
    prov = collect_provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == (head, False)


def test_a_tree_exported_inside_another_checkout_names_no_commit(monkeypatch, tmp_path):
    repo = tmp_path / "repo"
    head = _clean_repo(repo)
    nested = repo / ".device" / "baseline"  # an older commit exported for an A/B, not a checkout
    _checkout(nested, "x = 2\n")
    monkeypatch.setattr(provenance, "_SOURCE_DIR", nested)
    prov = collect_provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == ("unknown", None)
    monkeypatch.setattr(provenance, "_SOURCE_DIR", repo)
    provenance._git_state.cache_clear()
    assert collect_provenance()["git_commit"] == head


@pytest.mark.parametrize("stamp_text", [None, "not json", '{"git_commit": "abc"}'])
def test_a_stamp_for_other_sources_or_unreadable_is_ignored(monkeypatch, tmp_path, stamp_text):
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    _clean_repo(repo)
    monkeypatch.setattr(provenance, "_SOURCE_DIR", repo)
    stamp_path = tmp_path / "stamp.json"
    provenance.write_source_stamp(stamp_path)
    if stamp_text is not None:
        stamp_path.write_text(stamp_text)
    _checkout(copy, "x = 2\n")  # the sources differ from the stamped commit's
    monkeypatch.setattr(provenance, "_SOURCE_DIR", copy)
    provenance.source_digest.cache_clear()
    monkeypatch.setenv(provenance.SOURCE_STAMP_ENV, str(stamp_path))
    prov = collect_provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == ("unknown", None)


def test_stamping_a_dirty_checkout_is_refused(monkeypatch, tmp_path):
    repo = tmp_path / "repo"
    _clean_repo(repo)
    (repo / "pkv" / "core.py").write_text("x = 3\n")
    monkeypatch.setattr(provenance, "_SOURCE_DIR", repo)
    with pytest.raises(ValueError, match="uncommitted changes"):
        provenance.write_source_stamp(tmp_path / "stamp.json")
    assert not (tmp_path / "stamp.json").exists()


def test_without_git_binary(monkeypatch):
    real_which = provenance.shutil.which
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None if name == "git" else real_which(name))
    assert collect_provenance()["git_commit"] == "unknown"


def test_nvidia_smi_called_once_with_timeout(monkeypatch):
    calls = []
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if cmd[0] == "nvidia-smi":
            calls.append(kwargs.get("timeout"))
            return subprocess.CompletedProcess(cmd, 0, stdout="NVIDIA H200, 570.1\nNVIDIA H200, 570.1\n", stderr="")
        return real_run(cmd, **kwargs)

    real_which = provenance.shutil.which
    monkeypatch.setattr(provenance.shutil, "which",
                        lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else real_which(name))
    monkeypatch.setattr(provenance.subprocess, "run", fake_run)
    monkeypatch.setattr(provenance, "_torch_info", lambda: ("2.5.0", "12.4", None))
    first = collect_provenance()
    second = collect_provenance()
    assert len(calls) == 1 and calls[0] is not None
    assert first["gpu_name"] == second["gpu_name"] == "NVIDIA H200"
    assert first["driver_version"] == "570.1"
    assert first["cuda_version"] == "12.4"


def test_hung_nvidia_smi_degrades(monkeypatch):
    def hung(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout", 0))

    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(provenance.subprocess, "run", hung)
    monkeypatch.setattr(provenance, "_torch_info", lambda: ("2.5.0", None, None))
    prov = collect_provenance()
    assert prov["gpu_name"] is None and prov["git_commit"] == "unknown"


def test_config_forms_become_plain_dicts(monkeypatch):
    _no_gpu(monkeypatch)
    from omegaconf import OmegaConf

    @dataclasses.dataclass
    class Shape:
        num_qo_heads: int = 32
        splits: tuple = (16, 20)

    assert collect_provenance(Shape())["config"] == {"num_qo_heads": 32, "splits": [16, 20]}
    cfg = OmegaConf.create({"a": 2, "b": "${a}"})
    assert collect_provenance(cfg)["config"] == {"a": 2, "b": 2}


@pytest.mark.parametrize("seed", [1.5, "7", True])
def test_bad_seed_is_rejected(seed):
    with pytest.raises(ValueError, match="seed"):
        collect_provenance(seed=seed)


def test_non_finite_config_value_names_field():
    with pytest.raises(ValueError, match=r"config\.gpu\.beta"):
        collect_provenance({"gpu": {"beta": float("nan")}})


def test_unstorable_config_value_names_field():
    with pytest.raises(ValueError, match=r"config\.handle"):
        collect_provenance({"handle": object()})
