"""JSON traces: a list of requests or ``{"requests": [...]}``, and JSON lines, either with the plain
keys or in the timestamped form ``{"timestamp": ms, "input_length": n, "output_length": m, ...}``.
"""

from __future__ import annotations

import bisect
import json
import math
import re

from pkv.pipeline.trace_readers.common import (
    _PLAIN, MAX_LENGTH, MAX_STEP_OR_ID, PLAIN_OPTIONAL, PLAIN_REQUIRED, TraceError, _Fields, _Row, quote,
)

TIMESTAMPED_KEYS = ("timestamp", "input_length", "output_length")

JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")

_TIMESTAMPED = _Fields("input_length", "output_length", time="timestamp")


# ---------------------------------------------------------------- value parsing


def _json_int(path, line: int, field: str, value, maximum: int = MAX_LENGTH) -> int:
    # JSON writers such as pandas emit 128.0 for integer columns; accept integral floats only.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, field, f"expected a non-negative integer, got {quote(value)}")
    if value < 0:
        raise TraceError(path, line, field, f"must be >= 0, got {value}")
    if value > maximum:
        raise TraceError(path, line, field, f"must be <= {maximum}, got {quote(value)}")
    return value


def _ms_time_ns(path, line: int, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(path, line, "timestamp", f"expected a number of milliseconds, got {quote(value)}")
    if isinstance(value, int):
        return value * 1_000_000
    return round(value * 1_000_000)


# ---------------------------------------------------------------- JSON and JSON lines


def _record_form(path, line: int, record) -> _Fields:
    if not isinstance(record, dict):
        raise TraceError(path, line, "request", f"expected a JSON object, got {quote(record)}")
    if any(key in record for key in TIMESTAMPED_KEYS):
        return _TIMESTAMPED
    return _PLAIN


def _json_row(path, line: int, index: int, record, fields: _Fields) -> _Row:
    if not isinstance(record, dict):
        raise TraceError(path, line, "request", f"expected a JSON object, got {quote(record)}")
    required = TIMESTAMPED_KEYS if fields is _TIMESTAMPED else PLAIN_REQUIRED
    for key in required:
        if key not in record:
            raise TraceError(path, line, key, f"missing field (record has {quote(', '.join(map(str, record)), 80) or 'no keys'})")
    if fields is _PLAIN:
        # The plain form is this project's own: a typo such as "promt_len" is refused, not ignored.
        for key in record:
            if key not in PLAIN_REQUIRED and key not in PLAIN_OPTIONAL:
                raise TraceError(path, line, quote(key), f"unknown field (expected {', '.join(PLAIN_REQUIRED + PLAIN_OPTIONAL)})")
    row = _Row(
        line=line,
        index=index,
        prompt=_json_int(path, line, fields.prompt, record[fields.prompt]),
        decode=_json_int(path, line, fields.decode, record[fields.decode]),
    )
    if fields is _TIMESTAMPED:
        row.time_ns = _ms_time_ns(path, line, record["timestamp"])
    else:
        if "arrival_step" in record:
            row.arrival = _json_int(path, line, "arrival_step", record["arrival_step"], MAX_STEP_OR_ID)
        if "request_id" in record:
            row.request_id = _json_int(path, line, "request_id", record["request_id"], MAX_STEP_OR_ID)
    return row


def _rows_from_records(path, records: list[tuple[int, object]]) -> tuple[_Fields, list[_Row]]:
    if not records:
        raise TraceError(path, 1, "requests", "trace holds no requests")
    first_line, first = records[0]
    fields = _record_form(path, first_line, first)
    return fields, [_json_row(path, line, i, rec, fields) for i, (line, rec) in enumerate(records)]


_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _key_value_offset(text: str, i: int, key: str) -> int:
    """Offset of ``key``'s value in the JSON object starting at ``i`` (last one wins, as in json)."""
    found = -1
    j = _skip_ws(text, i + 1)
    while text[j] != "}":
        name, j = _DECODER.raw_decode(text, j)
        j = _skip_ws(text, _skip_ws(text, j) + 1)  # past ':'
        if name == key:
            found = j
        _, j = _DECODER.raw_decode(text, j)
        j = _skip_ws(text, j)
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
    return found


def _element_offsets(text: str, i: int) -> list[int]:
    """Start offsets of the elements of the JSON array starting at ``i``."""
    offsets = []
    j = _skip_ws(text, i + 1)
    while text[j] != "]":
        offsets.append(j)
        _, j = _DECODER.raw_decode(text, j)
        j = _skip_ws(text, j)
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
    return offsets


def _loads(path, line: int, text: str):
    """json.loads, with what it raises besides JSONDecodeError (a number of over 4300 digits, nesting
    past the recursion limit) as a TraceError on ``line``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as exc:
        raise TraceError(path, line, "json", f"unreadable JSON: {quote(str(exc), 80)}") from None


def _read_json(path, text: str) -> tuple[_Fields, list[_Row]]:
    try:
        doc = _loads(path, 1, text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _read_jsonl(path, text)  # one object per line under a .json name
        raise TraceError(path, exc.lineno, "json", f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    start = _skip_ws(text, 0)
    if isinstance(doc, dict):
        if "requests" not in doc:
            raise TraceError(path, 1, "requests", 'missing field: a JSON trace is a list of requests or {"requests": [...]}')
        if not isinstance(doc["requests"], list):
            raise TraceError(path, 1, "requests", f"expected a list, got {type(doc['requests']).__name__}")
        items, start = doc["requests"], _key_value_offset(text, start, "requests")
    elif isinstance(doc, list):
        items = doc
    else:
        raise TraceError(path, 1, "requests", f'expected a list of requests or {{"requests": [...]}}, got {type(doc).__name__}')
    newlines = [m.start() for m in re.finditer("\n", text)]
    lines = [bisect.bisect_left(newlines, off) + 1 for off in _element_offsets(text, start)]
    return _rows_from_records(path, list(zip(lines, items)))


def _read_jsonl(path, text: str) -> tuple[_Fields, list[_Row]]:
    records = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            records.append((line, _loads(path, line, raw)))
        except json.JSONDecodeError as exc:
            raise TraceError(path, line, "json", f"malformed JSON line: {exc.msg} at column {exc.colno}") from None
    return _rows_from_records(path, records)
