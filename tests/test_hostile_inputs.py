"""Hostile input and crowded runs: every refusal is one line naming file, field and value (exit
status 2), and no result is written, lost or mixed.

Classes: trace files in any encoding or none, values past their bounds, keys smuggled in with
Hydra's `+`, errors raised after validation, two runs into one output folder, writes that fail
midway, and DAG axes that name what does not exist.
"""

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

import pkv.atomic_io as atomic_io
from pkv.atomic_io import JsonFileError, OutputLock, OutputLocked, lock_path_for, read_json, write_files_atomic
from pkv.config import DEFAULT_MAX_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS, ConfigError, PkvConfig, compose
from pkv.experiments.common import kv_pool_pages, load_requests, resolve_settings, write_all_or_nothing
from pkv.pipeline.trace_readers import TraceError, read_trace
from pkv.report import tables

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


# ---------------------------------------------------------------- bounds


def _numeric(hint) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, typing.Union) and args:
        return any(_numeric(a) for a in args)
    return hint in (int, float)


def _schema_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        item = (typing.get_args(hint) or [None])[0]
        if dataclasses.is_dataclass(hint):
            yield from _schema_fields(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(item):
            yield from _schema_fields(item, f"{prefix}{f.name}[].")
        else:
            yield f"{prefix}{f.name}", hint, f


def test_every_numeric_field_of_the_schema_has_a_bound():
    unbounded = [name for name, hint, f in _schema_fields(PkvConfig) if _numeric(hint) and "bound" not in f.metadata]
    assert unbounded == []


BOUNDS = [
    ("seed=18446744073709551616", "seed"),
    ("seed=-1", "seed"),
    ("experiment.calibration_seed=18446744073709551616", "experiment.calibration_seed"),
    ("trace.page_size=1099511627776", "trace.page_size"),
    ("trace.num_requests=10000000", "trace.num_requests"),
    ("trace.max_active=100000", "trace.max_active"),
    ("trace.length_scale=inf", "trace.length_scale"),
    ("trace.length_scale=nan", "trace.length_scale"),
    ("trace.length_scale=1e400", "trace.length_scale"),
    ("trace.arrival_rate=inf", "trace.arrival_rate"),
    ("trace.hole_fraction=0.999", "trace.hole_fraction"),
    ("trace.decode_len_range=[1,99999999]", "trace.decode_len_range"),
    ("trace.max_context=99999999", "trace.max_context"),
    ("engine.num_splits=4096", "engine.num_splits"),
    ("engine.bucket_tiles_per_split=0", "engine.bucket_tiles_per_split"),
    ("experiment.measured_steps=10000000", "experiment.measured_steps"),
    ("experiment.gate_tolerance=nan", "experiment.gate_tolerance"),
    ("experiment.probe_buffer_mib=1000000", "experiment.probe_buffer_mib"),
    ("model.head_dim=4096", "model.head_dim"),
    ("cpu_profile.length_scale=inf", "cpu_profile.length_scale"),
    ("gpu.num_sms=100000", "gpu.num_sms"),
    ("gpu.regimes.many_rows.num_splits=5000", "gpu.regimes.many_rows.num_splits"),
    ("gpu.regimes.single_row.min_context_tokens=99999999", "gpu.regimes.single_row.min_context_tokens"),
    ("gpu.regimes.single_row.bucket_tiles_per_split=2048", "gpu.regimes.single_row.bucket_tiles_per_split"),
]


@pytest.mark.parametrize("override, field", BOUNDS, ids=[b[0][:40] for b in BOUNDS])
def test_a_value_past_its_bound_names_file_field_and_value(override, field):
    with pytest.raises(ConfigError) as err:
        compose(["out=x", override])
    msg = str(err.value)
    assert f"field '{field}' = " in msg and msg.startswith("conf/")
    value = override.split("=", 1)[1].strip("[]").split(",")[-1]
    assert value.replace("1e400", "inf") in msg


def test_the_largest_64_bit_seed_is_accepted():
    assert compose(["out=x", f"seed={2**64 - 1}"]).seed == 2**64 - 1


def test_a_synthetic_trace_past_the_default_maximum_context_is_refused():
    cfg = compose(["out=x", "trace=bimodal", "trace.length_scale=16"])  # 64K-token prompts become 1M
    with pytest.raises(ConfigError, match=rf"'trace.length_scale' = 16.0: .* more than the maximum context "
                                          rf"{DEFAULT_MAX_CONTEXT_TOKENS}"):
        load_requests(cfg.trace, cfg.seed, resolve_settings(compose(["out=x", "profile=gpu", "device=cpu",
                                                                      "trace.length_scale=16"])))


def test_an_external_request_past_the_default_maximum_is_refused_unless_a_limit_is_set(tmp_path):
    path = tmp_path / "long.csv"
    path.write_text(f"prompt_len,decode_len\n100,10\n{DEFAULT_MAX_CONTEXT_TOKENS},10\n")
    base = ["out=x", "profile=gpu", "device=cpu", "trace=external", f"trace.path={path}"]
    cfg = compose(base)
    with pytest.raises(TraceError, match=rf"long.csv, line 3, .*more than max_context={DEFAULT_MAX_CONTEXT_TOKENS}"):
        load_requests(cfg.trace, cfg.seed, resolve_settings(cfg))
    cfg = compose([*base, f"trace.max_context={MAX_CONTEXT_TOKENS}"])
    assert [r.total_len for r in load_requests(cfg.trace, cfg.seed, resolve_settings(cfg))] == [
        110, DEFAULT_MAX_CONTEXT_TOKENS + 10]


def test_a_trace_path_that_is_a_device_is_refused_before_reading():
    with pytest.raises(ConfigError, match=r"field 'trace.path' = '/dev/zero': is not a file"):
        compose(["out=x", "trace=external", "trace.path=/dev/zero"])


def test_a_run_whose_pages_do_not_fit_one_h200_is_refused_before_allocating():
    # Up front, every request's pages at once: 4096 requests of 32K tokens take 512 GiB.
    cfg = compose(["out=x", "profile=gpu", "device=cpu", "trace=homogeneous", "trace.num_requests=4096",
                   "trace.page_layout=up_front"])
    with pytest.raises(ConfigError, match=r"field 'trace.num_requests' = 4096: .* GiB, more than the 96 GiB"):
        load_requests(cfg.trace, cfg.seed, resolve_settings(cfg))
    # On the recycled pool the same trace holds only what its active requests reserve.
    recycled = compose(["out=x", "profile=gpu", "device=cpu", "trace=homogeneous", "trace.num_requests=4096"])
    settings = resolve_settings(recycled)
    requests = load_requests(recycled.trace, recycled.seed, settings)
    pages = kv_pool_pages(recycled.trace, settings, requests)
    assert pages * recycled.trace.page_size * settings.kv_bytes_per_token < 96 << 30
    named = compose(["out=x", "profile=gpu", "device=cpu", "trace=homogeneous", f"trace.kv_pool_tokens={1 << 26}"])
    with pytest.raises(ConfigError, match=r"field 'trace.kv_pool_tokens' = 67108864: .* GiB, more than the 96 GiB"):
        load_requests(named.trace, named.seed, resolve_settings(named))


# ---------------------------------------------------------------- keys added with +


PLUS_KEYS = [
    ("+trace.num_requestz=3", "trace.num_requestz", "3"),
    ("++trace.foo=1", "trace.foo", "1"),
    ("+bogus=3", "bogus", "3"),
    ("+model.group=4", "model.group", "4"),
    ("+experiment.calibration_traces.0.speed=1", "experiment.calibration_traces.0.speed", "1"),
    ("trace.num_requestz=3", "trace.num_requestz", "3"),
]


@pytest.mark.parametrize("override, field, value", PLUS_KEYS, ids=[p[0] for p in PLUS_KEYS])
def test_a_key_the_schema_does_not_know_is_refused_plus_or_not(override, field, value):
    with pytest.raises(ConfigError, match=rf"command line: field '{field}' = {value}: not a field"):
        compose(["out=x", override])


# ---------------------------------------------------------------- one error path


def _calibration_cases(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema": "pkv.calibration/2", "calibration": ')
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe" + "{}".encode("utf-16-le"))
    utf16 = tmp_path / "utf16.csv"
    utf16.write_bytes(PLAIN.encode("utf-16"))
    return {
        "missing calibration": ([f"calibration={tmp_path / 'nope.json'}"], "field 'calibration' = ", "no such file"),
        "calibration folder": ([f"calibration={tmp_path}"], "field 'calibration' = ", "is not a file"),
        "corrupt calibration": ([f"calibration={corrupt}"], f"{corrupt}: field 'calibration' = ", "not valid JSON"),
        "binary calibration": ([f"calibration={binary}"], f"{binary}: field 'calibration' = ", "not UTF-8"),
        "UTF-16 trace": (["trace=external", f"trace.path={utf16}"], f"{utf16}, line 1", "UTF-16"),
        "no GPU": (["profile=gpu"], "field 'profile' = 'gpu'", "torch sees no CUDA GPU"),
        "unknown group option": (["trace=bimodl"], "field 'trace' = 'bimodl'", "no file conf/trace/bimodl.yaml"),
        "wrong type": (["trace.max_active=abc"], "field 'trace.max_active' = 'abc'", "could not be converted"),
        "seed past 64 bits": ([f"seed={2**64}"], f"field 'seed' = {2**64}", "64-bit"),
    }


def test_the_cli_refuses_a_plus_key_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    line = _refusal(_cli(*TINY, "+trace.num_requestz=3", f"out={out}", f"hydra.run.dir={out}/.run", cwd=tmp_path))
    assert "field 'trace.num_requestz' = 3" in line
    assert list(tmp_path.iterdir()) == []


CASES = ["missing calibration", "calibration folder", "corrupt calibration", "binary calibration", "UTF-16 trace",
         "no GPU", "unknown group option", "wrong type", "seed past 64 bits"]


@pytest.mark.parametrize("case", CASES)
def test_every_refusal_of_the_cli_is_one_line_with_exit_status_2(tmp_path, case):
    overrides, names, why = _calibration_cases(tmp_path)[case]
    out = tmp_path / "out"
    before = _files(tmp_path)
    line = _refusal(_cli(*TINY, *overrides, f"out={out}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path))
    assert names in line and why in line
    assert not out.exists() and not lock_path_for(out).exists()
    assert {k: v for k, v in _files(tmp_path).items() if not k.startswith("run/")} == before


# ---------------------------------------------------------------- one writer per output folder


def _run_record(out: Path) -> tuple[set, set, set]:
    """(engines, run ids, seeds) of the result files in out, and the seed its saved overrides name."""
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    overrides = (out / ".run" / ".hydra" / "overrides.yaml").read_text()
    seeds = {r["provenance"]["seed"] for r in records} | {int(o.split("=")[1]) for o in overrides.split()
                                                         if o.startswith("seed=")}
    return {p.stem for p in out.glob("*.json")}, {r["run_id"] for r in records}, seeds


def test_a_run_into_a_held_output_refuses_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "seed1"
    with OutputLock(out):
        line = _refusal(_cli(*TINY, "seed=1", f"out={out}", f"hydra.run.dir={out}/.run", cwd=tmp_path))
    assert f"pid {os.getpid()} on " in line and "started 20" in line and "another run writes there" in line
    assert not out.exists()


def test_two_runs_into_one_folder_one_refuses_and_the_other_completes(tmp_path):
    out = tmp_path / "evaluate" / "seed"
    run = [*TINY, f"out={out}", f"hydra.run.dir={out}/.run"]
    assert _cli(*run, "seed=3", cwd=tmp_path).returncode == 0  # an older complete run in the folder
    # A run of more steps holds the lock for a few seconds; the second starts once it holds it.
    first = _cli(*run, "seed=1", "experiment.measured_steps=40", "cpu_profile.measured_steps=40", cwd=tmp_path,
                 wait=False)
    lock = lock_path_for(out)
    deadline = time.monotonic() + 60
    while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()) and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = _cli(*run, "seed=2", cwd=tmp_path)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr[-3000:]
    assert f"pid {first.pid} on " in _refusal(second)
    engines, run_ids, seeds = _run_record(out)
    assert engines == {"adaptive", "flashinfer", "xqa"} and len(run_ids) == 1 and seeds == {1}
    assert not lock.exists() and not [p for p in out.rglob(".*") if p.suffix in (".tmp", ".old")]


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "seed"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pkv.atomic_io import OutputLock; "
                               f"OutputLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputLocked, match=f"pid {holder.pid} on "):
        OutputLock(out).acquire()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_path_for(out).exists()
    proc = _cli(*TINY, "seed=1", f"out={out}", f"hydra.run.dir={out}/.run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"took over the lock of pid {holder.pid}" in proc.stderr
    assert _run_record(out)[2] == {1} and not lock_path_for(out).exists()


# ---------------------------------------------------------------- writes that fail midway


def _old_set(folder: Path) -> dict[str, bytes]:
    write_all_or_nothing({folder / "adaptive.json": {"run": "old", "engine": "adaptive"},
                          folder / "flashinfer.json": {"run": "old", "engine": "flashinfer"}})
    return _files(folder)


def test_a_result_that_cannot_be_written_leaves_the_old_set(tmp_path):
    old = _old_set(tmp_path)
    with pytest.raises(JsonFileError, match=r"flashinfer.json: refusing to write a non-finite value"):
        write_all_or_nothing({tmp_path / "adaptive.json": {"run": "new"},
                              tmp_path / "flashinfer.json": {"run": "new", "time": float("nan")}})
    assert _files(tmp_path) == old


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_rename_that_fails_midway_puts_the_old_set_back(tmp_path, monkeypatch, fail_at):
    old = _old_set(tmp_path)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(atomic_io.os, "replace", failing_replace)
    new = {tmp_path / "adaptive.json": "new\n", tmp_path / "flashinfer.json": "new\n", tmp_path / "sdpa.json": "new\n"}
    with pytest.raises(OSError, match="No space left"):
        write_files_atomic(new)
    monkeypatch.undo()
    assert _files(tmp_path) == old  # the new file without an old one is gone too; no temporaries left


def test_tables_are_written_as_a_set_or_not_at_all(tmp_path):
    root, out = tmp_path / "root", tmp_path / "tables"
    root.mkdir()
    tables.render_all(root, out)
    old = _files(out)
    (root / "profile").mkdir()
    (root / "profile" / "ncu_counters.json").write_text('{"schema": ')  # read by a later table than the first
    with pytest.raises(JsonFileError, match="ncu_counters.json: invalid JSON"):
        tables.render_all(root, out)
    assert _files(out) == old and len(old) >= 16


# ---------------------------------------------------------------- the DAG's axes


DAG_AXES = [
    ("evaluate_traces=[bimodl_b8]", "field 'evaluate_traces' = 'bimodl_b8': no trace family 'bimodl'"),
    ("mlp_traces=[zipf_b0]", "field 'mlp_traces' = 'zipf_b0': max_active 0"),
    ("held_out_seeds=[18446744073709551616]", "held_out_seeds"),
    ("isolated_contexts=[99999999]", "isolated_contexts"),
]


@pytest.mark.parametrize("override, expected", DAG_AXES, ids=[a[0] for a in DAG_AXES])
def test_a_dag_config_naming_what_does_not_exist_fails_the_dry_run(tmp_path, override, expected):
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--config", "gpu=cpu", f"artifacts_root={tmp_path}",
                           override], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and expected in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_ablation_variant_fails_the_dry_run(tmp_path):
    axes = tmp_path / "axes.yaml"
    axes.write_text("ablations:\n  splits: {seeds: [20260623], variants: {bimodal_b8: [splitz=24]}}\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", str(axes), "--config", "gpu=cpu",
                           f"artifacts_root={tmp_path}/artifacts"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "field 'ablations.splits.variants.bimodal_b8' = 'splitz=24'" in proc.stdout + proc.stderr
