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
