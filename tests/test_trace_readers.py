import json
import os
from decimal import Decimal
from pathlib import Path

import pytest

from pkv.pipeline.make_fixture import make_mixed_fixture
from pkv.pipeline.trace_readers import TraceError, read_trace, write_trace_csv
from pkv.pipeline.traces import Request

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PKV_SHARED_DIR", REPO.parent / "shared"))
AZURE = {name: SHARED / "traces" / f"AzureLLMInferenceTrace_{name}.csv" for name in ("code", "conv")}


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _raw_azure_rows(path):
    """An independent parse of the Azure CSV: (seconds since midnight as Decimal, context, generated)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        next(fh)
        for line in fh:
            if not line.strip():
                continue
            stamp, ctx, gen = line.strip().split(",")
            day, clock = stamp.split(" ")
            h, m, s = clock.split(":")
            rows.append((day, int(h) * 3600 + int(m) * 60 + Decimal(s), int(ctx), int(gen)))
    return rows


# ---------------------------------------------------------------- real Azure traces


@pytest.fixture(params=sorted(AZURE))
def azure_trace(request):
    """(path, independently parsed rows) of each real Azure trace; skipped where it is absent."""
    path = AZURE[request.param]
    if not path.exists():
        pytest.skip(f"{path} not present: the full Azure traces are not in the repository (traces/README.md "
                    f"says where to get them); set PKV_SHARED_DIR to the folder whose traces/ holds them")
    return path, _raw_azure_rows(path)


def test_reads_the_azure_traces(azure_trace):
    path, raw = azure_trace
    requests = read_trace(path)
    assert len(requests) == len(raw)
    assert [r.prompt_len for r in requests] == [row[2] for row in raw]
    assert [r.decode_len for r in requests] == [row[3] for row in raw]
    assert [r.request_id for r in requests] == list(range(len(raw)))
    # Timestamp rule, checked against Decimal arithmetic on the raw strings (one hour, one day).
    assert len({row[0] for row in raw}) == 1
    t0 = raw[0][1]
    expected = [int((row[1] - t0) * 1000 // 50) for row in raw]
    assert [r.arrival_step for r in requests] == expected
    per_second = read_trace(path, step_ms=1000.0)
    assert [r.arrival_step for r in per_second] == [int((row[1] - t0) // 1) for row in raw]


def test_azure_max_context_policies(azure_trace):
    path, raw = azure_trace
    limit = 4096
    overlong = sum(1 for row in raw if row[2] + row[3] > limit)
    assert overlong > 0
    truncated = read_trace(path, max_context=limit)
    assert len(truncated) == len(raw)
    assert max(r.total_len for r in truncated) <= limit
    for r, row in zip(truncated, raw):
        if row[2] + row[3] > limit:
            assert r.decode_len == min(row[3], limit - 1)
            assert r.prompt_len == limit - r.decode_len
        else:
            assert (r.prompt_len, r.decode_len) == (row[2], row[3])
    dropped = read_trace(path, max_context=limit, overlong="drop")
    assert len(dropped) == len(raw) - overlong
    assert len({r.request_id for r in dropped}) == len(dropped)
    with pytest.raises(TraceError, match="max_context=4096"):
        read_trace(path, max_context=limit, overlong="error")


# ---------------------------------------------------------------- formats


JSON_RECORDS = [{"prompt_len": 100, "decode_len": 5, "arrival_step": 2}, {"prompt_len": 64, "decode_len": 8.0}]
JSON_REQUESTS = [Request(0, 2, 100, 5), Request(1, 0, 64, 8)]
JSONL_LINES = [
    {"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]},
    {"timestamp": 1049, "input_length": 10, "output_length": 3, "hash_ids": []},
    {"timestamp": 1050, "input_length": 20, "output_length": 4},
    {"timestamp": 1120.5, "input_length": 30, "output_length": 5},
    {"timestamp": 2000, "input_length": 40, "output_length": 6},
]
JSONL_TEXT = "\n".join(json.dumps(x) for x in JSONL_LINES) + "\n\n"
# Timestamps in ms at 50 ms a step, from the first one; ids in file order.
JSONL_REQUESTS = [Request(i, step, x["input_length"], x["output_length"])
                  for i, (step, x) in enumerate(zip([0, 0, 1, 2, 20], JSONL_LINES))]

READABLE = [
    pytest.param("full.csv", "request_id,arrival_step,prompt_len,decode_len\n7,3,100,5\n2,0,50,1\n",
                 [Request(7, 3, 100, 5), Request(2, 0, 50, 1)], id="csv-all-columns"),
    pytest.param("bare.csv", "decode_len, prompt_len\r\n5,100\r\n\r\n1,50\r\n",
                 [Request(0, 0, 100, 5), Request(1, 0, 50, 1)], id="csv-required-columns-crlf"),
    pytest.param("list.json", json.dumps(JSON_RECORDS, indent=2), JSON_REQUESTS, id="json-list"),
    pytest.param("obj.json", json.dumps({"name": "x", "requests": JSON_RECORDS}), JSON_REQUESTS,
                 id="json-requests-object"),
    pytest.param("sample.jsonl", JSONL_TEXT, JSONL_REQUESTS, id="jsonl"),
    pytest.param("sample.json", JSONL_TEXT, JSONL_REQUESTS, id="json-one-object-per-line"),
]


@pytest.mark.parametrize("name, text, expected", READABLE)
def test_reads_well_formed_files(tmp_path, name, text, expected):
    assert read_trace(_write(tmp_path, name, text)) == expected


SCALED = "prompt_len,decode_len\n6400,10\n64,2\n0,3\n"


@pytest.mark.parametrize("text, options, expected", [
    pytest.param(SCALED, dict(length_scale=1 / 64), [(100, 10), (1, 2), (1, 3)], id="length_scale"),
    pytest.param(SCALED, dict(length_scale=1 / 64, max_context=50), [(40, 10), (1, 2), (1, 3)],
                 id="length_scale-before-max_context"),
    pytest.param("prompt_len,decode_len\n10,100\n0,100\n", dict(max_context=50), [(1, 49), (0, 49)],
                 id="truncate-caps-decode-first"),
])
def test_length_options(tmp_path, text, options, expected):
    requests = read_trace(_write(tmp_path, "t.csv", text), **options)
    assert [(r.prompt_len, r.decode_len) for r in requests] == expected


def test_write_trace_csv_round_trip(tmp_path):
    requests = [Request(4, 0, 10, 2), Request(9, 5, 0, 1)]
    out = write_trace_csv(tmp_path / "sub" / "t.csv", requests)
    assert read_trace(out) == requests
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.csv"]  # no temp file left behind


def test_shipped_fixture_is_the_seeded_generator_output():
    path = REPO / "traces" / "fixture_mixed.csv"
    requests = read_trace(path)
    assert requests == make_mixed_fixture()
    assert len(requests) == 32
    prompts = [r.prompt_len for r in requests]
    assert min(prompts) < 12 * 1024 and max(prompts) > 32 * 1024
    assert len({r.arrival_step for r in requests}) > 16


# ---------------------------------------------------------------- broken files

BROKEN = [
    ("missing.csv", "prompt_len,arrival_step\n10,0\n", 1, "decode_len", "missing column"),
    ("unknown.csv", "prompt_len,decode_len,promt\n10,2,3\n", 1, "promt", "unknown column"),
    ("dup.csv", "prompt_len,decode_len,prompt_len\n", 1, "prompt_len", "twice"),
    ("float.csv", "prompt_len,decode_len\n10,5\n12.5,3\n", 3, "prompt_len", "12.5"),
    ("negative.csv", "prompt_len,decode_len\n10,-3\n", 2, "decode_len", "-3"),
    ("zero.csv", "prompt_len,decode_len\n10,5\n10,0\n", 3, "decode_len", ">= 1"),
    ("short.csv", "prompt_len,decode_len\n10,5\n10\n", 3, "decode_len", "missing value"),
    ("empty.csv", "", 1, "header", "empty"),
    ("header_only.csv", "prompt_len,decode_len\n", 1, "prompt_len", "no requests"),
    ("ids.csv", "request_id,prompt_len,decode_len\n1,10,5\n1,10,5\n", 3, "request_id", "already used"),
    ("azure_missing.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n", 1, "GeneratedTokens", "missing"),
    (
        "azure_unsorted.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:03.9799599,10,2\n",
        3, "TIMESTAMP", "sorted",
    ),
    ("azure_stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n", 2, "TIMESTAMP", "yesterday"),
    ("azure_zero.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,0\n", 2, "GeneratedTokens", ">= 1"),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": \n', 2, "json", "malformed"),
    (
        "unsorted.jsonl",
        '{"timestamp": 5, "input_length": 5, "output_length": 1}\n\n{"timestamp": 4, "input_length": 5, "output_length": 1}\n',
        3, "timestamp", "sorted",
    ),
    ("nooutput.jsonl", '{"timestamp": 5, "input_length": 5}\n', 1, "output_length", "missing field"),
    ("stringlen.jsonl", '{"timestamp": 5, "input_length": "5", "output_length": 1}\n', 1, "input_length", "'5'"),
    ("empty.jsonl", "\n\n", 1, "requests", "empty"),
    ("bad.json", '[\n  {"prompt_len": 1, "decode_len": 1},\n  {"prompt_len": 1 "decode_len": 1}\n]\n', 3, "json", "malformed"),
    (
        "negative.json",
        '[\n  {"prompt_len": 1, "decode_len": 1},\n  {\n    "prompt_len": -4,\n    "decode_len": 1\n  }\n]\n',
        3, "prompt_len", "-4",
    ),
    ("typo.json", '{"requests": [{"prompt_len": 1, "decode_len": 1},\n {"promt_len": 1, "decode_len": 1}]}', 2, "prompt_len", "missing"),
    ("noreqs.json", '{"reqs": []}', 1, "requests", "missing field"),
    ("scalar.json", '[1, 2]', 1, "request", "object"),
]


@pytest.mark.parametrize("name, text, line, field, detail", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_files_name_file_line_and_field(tmp_path, name, text, line, field, detail):
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    err = info.value
    message = str(err)
    assert str(path) in message
    assert f"line {line}" in message and err.line == line
    assert repr(field) in message and err.field == field
    assert detail in message
    assert isinstance(err, ValueError)


def test_overlong_error_names_the_lengths(tmp_path):
    path = _write(tmp_path, "long.csv", "prompt_len,decode_len\n10,5\n100,20\n")
    with pytest.raises(TraceError) as info:
        read_trace(path, max_context=64, overlong="error")
    assert info.value.line == 3
    assert "120 tokens" in str(info.value) and "'prompt_len+decode_len'" in str(info.value)


def test_everything_dropped_is_an_error(tmp_path):
    path = _write(tmp_path, "long.csv", "prompt_len,decode_len\n100,20\n")
    with pytest.raises(TraceError, match="every request"):
        read_trace(path, max_context=64, overlong="drop")


def test_unsupported_extension(tmp_path):
    path = _write(tmp_path, "trace.txt", "prompt_len,decode_len\n1,1\n")
    with pytest.raises(TraceError, match="'.txt'"):
        read_trace(path)


BAD_OPTIONS = [("overlong", "clip"), ("max_context", 1), ("step_ms", 0), ("length_scale", -1)]


@pytest.mark.parametrize("option, value", BAD_OPTIONS, ids=[f"{o}={v}" for o, v in BAD_OPTIONS])
def test_bad_options_name_the_option(tmp_path, option, value):
    good = _write(tmp_path, "t.csv", "prompt_len,decode_len\n1,1\n")
    with pytest.raises(ValueError, match=option):
        read_trace(good, **{option: value})
