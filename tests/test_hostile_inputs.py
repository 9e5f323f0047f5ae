"""Hostile input and crowded runs: every refusal is one line naming file, field and value (exit
status 2), and no result is written, lost or mixed.

Classes: trace files in any encoding or none, values past their bounds, keys smuggled in with
Hydra's `+`, errors raised after validation, two runs into one output folder, writes that fail
midway, and DAG axes that name what does not exist.
"""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pkv.atomic_io import JsonFileError, read_json
from pkv.pipeline.trace_readers import TraceError, read_trace

REPO = Path(__file__).resolve().parent.parent
PLAIN = "prompt_len,decode_len\n100,10\n200,20\n"
# A tiny CPU run: two engines, a handful of steps, a few seconds with the interpreter's start.
TINY = ["experiment=evaluate", "trace=bimodal", "trace.num_requests=4", "profile=cpu", "experiment.measured_steps=2"]


def _cli(*args, cwd, wait=True):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pkv.cli", *args]
    if not wait:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _refusal(proc) -> str:
    """The one line a refused run prints, after checking its exit status and that it is alone."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pkv: "), proc.stderr[-3000:]
    return lines[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- encodings and contents


GZIP = gzip.compress(PLAIN.encode())
ENCODED = [
    ("utf16.csv", PLAIN.encode("utf-16"), 1, "UTF-16 text (byte-order mark ff fe)"),
    ("utf16be.csv", PLAIN.encode("utf-16-be"), 1, "NUL byte"),
    ("utf32.jsonl", '{"prompt_len": 1, "decode_len": 1}\n'.encode("utf-32"), 1, "UTF-32"),
    ("latin1.csv", "prompt_len,decode_len,request_id\n100,10,1\n200,2\xe9,2\n".encode("latin-1"), 3,
     r"byte 0xE9 at column 6 (found b'200,2\xe9,2\n')"),
    ("binary.json", bytes(range(256)) * 8, 1, "NUL byte at column 1"),
    ("archive.csv", GZIP, 1, "gzip archive"),
    ("latin1.jsonl", '{"prompt_len": 1, "decode_len": 1, "request_id": 1}\n{"x\xff": 1}\n'.encode("latin-1"), 2,
     "byte 0xFF"),
]


@pytest.mark.parametrize("name, data, line, found", ENCODED, ids=[c[0] for c in ENCODED])
def test_a_trace_that_is_not_utf8_text_names_file_line_and_what_was_found(tmp_path, name, data, line, found):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}, line {line}") and found in str(err.value)


CONTENTS = [
    ("long_number.csv", "prompt_len,decode_len\n" + "9" * 5000 + ",1\n", "line 2, field 'prompt_len'"),
    ("int64_length.csv", f"prompt_len,decode_len\n{2**40},1\n", "must be <= 2147483647, got 1099511627776"),
    ("id_past_64_bits.csv", f"prompt_len,decode_len,request_id\n1,1,{2**64}\n", "line 2, field 'request_id'"),
    ("huge_field.csv", 'prompt_len,decode_len\n"' + "x" * 200_000 + '",1\n', "line 2: malformed CSV"),
    ("deep.json", "[" * 50_000 + "]" * 50_000, "line 1, field 'json': unreadable JSON"),
    ("big_int.json", '[{"prompt_len": ' + "9" * 5000 + ', "decode_len": 1}]', "line 1, field 'json'"),
    ("far_future.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
                         '{"timestamp": 1e300, "input_length": 1, "output_length": 1}\n', "line 2, field 'timestamp'"),
]


@pytest.mark.parametrize("name, text, expected", CONTENTS, ids=[c[0] for c in CONTENTS])
def test_values_past_what_a_trace_can_hold_name_the_line(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(path) in str(err.value) and expected in str(err.value)
    assert len(str(err.value)) < 400  # quotes what it found, not the whole value


def test_a_folder_is_not_read_as_a_trace(tmp_path):
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    with pytest.raises(TraceError, match="is a folder"):
        read_trace(folder)


def test_a_result_file_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "result.json"
    path.write_bytes('{\n  "engine": "caf\xe9"\n}\n'.encode("latin-1"))
    with pytest.raises(JsonFileError, match=r"result.json: not UTF-8 text: byte b'\\xe9' at line 2"):
        read_json(path)


def test_a_byte_order_mark_of_utf8_is_accepted(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + PLAIN.encode())
    assert [r.prompt_len for r in read_trace(path)] == [100, 200]
