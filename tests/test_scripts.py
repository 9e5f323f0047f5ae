"""The GPU-machine scripts parse: they only run on the device, so a syntax slip would otherwise
surface there, after the machine has started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


def test_there_are_scripts():
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_gpu_check_runs_every_file_of_gpu_tests():
    """scripts/device_check.sh names its test files (the project's kernels first, so a run stopped
    at its time limit has checked those): a new file of GPU tests must be named there too."""
    import re

    tests = Path(__file__).parent
    default = re.search(r"\$\{GPU_TESTS:-([^}]*)\}", (tests.parent / "scripts" / "device_check.sh").read_text())
    named = default.group(1).split()
    marked = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)", re.M)
    with_gpu_tests = sorted(f"tests/{p.name}" for p in tests.glob("test_*.py") if marked.search(p.read_text()))
    assert sorted(named) == with_gpu_tests
    assert named[:2] == ["tests/test_kernels_gpu.py", "tests/test_device_step_gpu.py"]


def test_promote_asks_for_the_readme_markers_of_a_cards_first_set_before_moving_anything(tmp_path):
    """scripts/reference_run.sh promote on a card whose set the README has no headline block for:
    it names the two markers to put there and exits before the set is promoted."""
    import tarfile

    repo = Path(__file__).resolve().parents[1]
    for part in ("part1", "part2"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "dag.log").write_text("x\n")
    (tmp_path / "run" / "artifacts" / "nocard").mkdir(parents=True)
    with tarfile.open(tmp_path / "part2" / "artifacts.tgz", "w:gz") as tar:
        tar.add(tmp_path / "run" / "artifacts", arcname="artifacts")
    proc = subprocess.run(["bash", str(repo / "scripts" / "reference_run.sh"), "promote", str(tmp_path / "part1"),
                           str(tmp_path / "part2")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "README.md has no headline block for artifacts/reference/nocard" in proc.stderr
    assert "<!-- headline artifacts/reference/nocard: python -m pkv.report.headline" in proc.stderr
    assert not (repo / "artifacts" / "reference" / "nocard").exists()
