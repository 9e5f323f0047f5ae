"""Request-trace files: read the supported formats into :class:`pkv.pipeline.traces.Request` lists.

Formats, chosen by the file extension and then by the header or the first record:

- ``.csv`` with columns ``prompt_len, decode_len`` and optionally ``arrival_step`` (default 0)
  and ``request_id`` (default: the 0-based record index). Arrival steps need not be sorted: the
  harness admits by ``(arrival_step, request_id)``.
- ``.csv`` in the Azure LLM inference trace form: ``TIMESTAMP, ContextTokens, GeneratedTokens``,
  timestamps like ``2023-11-16 18:17:03.9799600`` (up to 9 fractional digits).
- ``.json``: a list of objects with the plain CSV keys, or ``{"requests": [...]}``.
- ``.jsonl`` / ``.ndjson`` (or a ``.json`` file holding one object per line): JSON lines, either
  with the plain keys or in the timestamped form
  ``{"timestamp": ms, "input_length": n, "output_length": m, ...}`` whose extra keys (for example
  ``hash_ids``) are ignored.

Timestamp rule: timestamped forms map wall-clock time onto decode steps as
``arrival_step = floor((t - t_first) / step_ms)`` with ``t`` in milliseconds and ``t_first`` the
first record's time, computed in integer nanoseconds so that equal inputs give equal steps on
every machine. Timestamps must be non-decreasing; an unsorted trace is refused rather than
silently reordered, since a shuffled log usually means a broken export.

Order of length transforms: ``length_scale`` multiplies prompt lengths first (nearest token, at
least one), then ``max_context`` applies to the scaled request. A request with
``prompt_len + decode_len > max_context`` is handled by ``overlong``:

- ``"truncate"``: ``decode_len`` is capped at ``max_context - 1``, then only the last
  ``max_context - decode_len`` prompt tokens are replayed (the most recent context is what a
  sliding-window server would keep);
- ``"drop"``: the request is skipped (its record index is not reused as an id);
- ``"error"``: the file is refused.

Every problem in a file raises :class:`TraceError`, whose message names the file, the 1-based line
(the header or the first line is line 1) and the field.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
import re
from dataclasses import dataclass
from datetime import date
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from pkv.atomic_io import write_text_atomic
from pkv.pipeline.traces import Request

OVERLONG_POLICIES = ("truncate", "drop", "error")

PLAIN_REQUIRED = ("prompt_len", "decode_len")
PLAIN_OPTIONAL = ("arrival_step", "request_id")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TIMESTAMPED_KEYS = ("timestamp", "input_length", "output_length")

CSV_SUFFIXES = (".csv",)
JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names file, line and field."""

    def __init__(self, path, line: int | None, field: str | None, problem: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.problem = problem
        where = self.path if line is None else f"{self.path}, line {line}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class _Fields:
    """The names a format uses, so errors quote the file's own vocabulary."""

    prompt: str
    decode: str
    time: str | None = None  # None: the format carries arrival steps, not timestamps
    arrival: str = "arrival_step"
    request_id: str = "request_id"


_PLAIN = _Fields("prompt_len", "decode_len")
_AZURE = _Fields("ContextTokens", "GeneratedTokens", time="TIMESTAMP")
_TIMESTAMPED = _Fields("input_length", "output_length", time="timestamp")


@dataclass
class _Row:
    line: int
    index: int  # 0-based record index, the default request id
    prompt: int
    decode: int
    arrival: int | None = None
    time_ns: int | None = None
    request_id: int | None = None


# ---------------------------------------------------------------- value parsing


def _csv_int(path, line: int, field: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, field, f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise TraceError(path, line, field, f"must be >= 0, got {value}")
    return value


def _json_int(path, line: int, field: str, value) -> int:
    # JSON writers such as pandas emit 128.0 for integer columns; accept integral floats only.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, field, f"expected a non-negative integer, got {value!r}")
    if value < 0:
        raise TraceError(path, line, field, f"must be >= 0, got {value}")
    return value


@lru_cache(maxsize=4096)
def _day_ordinal(text: str) -> int:
    return date.fromisoformat(text).toordinal()


_NS_PER_DAY = 86_400 * 10**9


def _azure_time_ns(path, line: int, text: str) -> int:
    """'2023-11-16 18:17:03.9799600' -> integer nanoseconds, without datetime's 6-digit limit."""
    s = text.strip()
    day, sep, clock = s.partition(" ")
    if not sep:
        day, sep, clock = s.partition("T")
    try:
        hh, mm, ss = clock.split(":")
        sec, _, frac = ss.partition(".")
        h, m, sc = int(hh), int(mm), int(sec)
        if not (frac == "" or (frac.isdigit() and len(frac) <= 9)) or not (0 <= h < 24 and 0 <= m < 60 and 0 <= sc <= 60):
            raise ValueError
        frac_ns = int(frac.ljust(9, "0")) if frac else 0
        return _day_ordinal(day) * _NS_PER_DAY + ((h * 60 + m) * 60 + sc) * 10**9 + frac_ns
    except ValueError:
        raise TraceError(
            path, line, "TIMESTAMP", f"expected a time like '2023-11-16 18:17:03.9799600', got {text!r}"
        ) from None


def _ms_time_ns(path, line: int, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(path, line, "timestamp", f"expected a number of milliseconds, got {value!r}")
    if isinstance(value, int):
        return value * 1_000_000
    return round(value * 1_000_000)


# ---------------------------------------------------------------- CSV


def _read_csv(path, text: str) -> tuple[_Fields, list[_Row]]:
    reader = csv.reader(io.StringIO(text))
    header = None
    for raw in reader:
        if raw and any(c.strip() for c in raw):
            header = [c.strip() for c in raw]
            break
    if header is None:
        raise TraceError(path, 1, "header", "file is empty")
    header_line = reader.line_num
    for i, name in enumerate(header):
        if name in header[:i]:
            raise TraceError(path, header_line, name, "column appears twice in the header")

    if any(name in AZURE_COLUMNS for name in header):
        fields, required, optional = _AZURE, AZURE_COLUMNS, ()
    else:
        fields, required, optional = _PLAIN, PLAIN_REQUIRED, PLAIN_OPTIONAL
    for name in required:
        if name not in header:
            raise TraceError(path, header_line, name, f"missing column (header is {','.join(header)})")
    for name in header:
        if name not in required and name not in optional:
            expected = ", ".join(required + optional)
            raise TraceError(path, header_line, name, f"unknown column (expected {expected})")

    col = {name: header.index(name) for name in header}
    width = len(header)
    rows: list[_Row] = []
    for raw in reader:
        if not raw or not any(c.strip() for c in raw):
            continue
        line = reader.line_num
        if len(raw) != width:
            missing = header[len(raw)] if len(raw) < width else None
            if missing is not None:
                raise TraceError(path, line, missing, f"missing value: row has {len(raw)} of {width} fields")
            raise TraceError(path, line, header[-1], f"row has {len(raw)} fields, the header has {width}")
        row = _Row(
            line=line,
            index=len(rows),
            prompt=_csv_int(path, line, fields.prompt, raw[col[fields.prompt]]),
            decode=_csv_int(path, line, fields.decode, raw[col[fields.decode]]),
        )
        if fields is _AZURE:
            row.time_ns = _azure_time_ns(path, line, raw[col["TIMESTAMP"]])
        else:
            if "arrival_step" in col:
                row.arrival = _csv_int(path, line, "arrival_step", raw[col["arrival_step"]])
            if "request_id" in col:
                row.request_id = _csv_int(path, line, "request_id", raw[col["request_id"]])
        rows.append(row)
    return fields, rows


# ---------------------------------------------------------------- JSON and JSON lines


def _record_form(path, line: int, record) -> _Fields:
    if not isinstance(record, dict):
        raise TraceError(path, line, "request", f"expected a JSON object, got {type(record).__name__}")
    if any(key in record for key in TIMESTAMPED_KEYS):
        return _TIMESTAMPED
    return _PLAIN


def _json_row(path, line: int, index: int, record, fields: _Fields) -> _Row:
    if not isinstance(record, dict):
        raise TraceError(path, line, "request", f"expected a JSON object, got {type(record).__name__}")
    required = TIMESTAMPED_KEYS if fields is _TIMESTAMPED else PLAIN_REQUIRED
    for key in required:
        if key not in record:
            raise TraceError(path, line, key, f"missing field (record has {', '.join(map(str, record)) or 'no keys'})")
    if fields is _PLAIN:
        # The plain form is this project's own: a typo such as "promt_len" is refused, not ignored.
        for key in record:
            if key not in PLAIN_REQUIRED and key not in PLAIN_OPTIONAL:
                raise TraceError(path, line, key, f"unknown field (expected {', '.join(PLAIN_REQUIRED + PLAIN_OPTIONAL)})")
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
            row.arrival = _json_int(path, line, "arrival_step", record["arrival_step"])
        if "request_id" in record:
            row.request_id = _json_int(path, line, "request_id", record["request_id"])
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


def _read_json(path, text: str) -> tuple[_Fields, list[_Row]]:
    try:
        doc = json.loads(text)
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
            records.append((line, json.loads(raw)))
        except json.JSONDecodeError as exc:
            raise TraceError(path, line, "json", f"malformed JSON line: {exc.msg} at column {exc.colno}") from None
    return _rows_from_records(path, records)


# ---------------------------------------------------------------- shared finishing


def _check_options(max_context, overlong, step_ms, length_scale) -> None:
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2):
        raise ValueError(f"max_context must be an integer >= 2 or None, got {max_context!r}")
    if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)) or not math.isfinite(step_ms) or step_ms <= 0:
        raise ValueError(f"step_ms must be a finite number > 0, got {step_ms!r}")
    if isinstance(length_scale, bool) or not isinstance(length_scale, (int, float)) or not math.isfinite(length_scale) or length_scale <= 0:
        raise ValueError(f"length_scale must be a finite number > 0, got {length_scale!r}")


def _assign_arrivals(path, fields: _Fields, rows: list[_Row], step_ms: float) -> None:
    if fields.time is None:
        return
    # str() first: Fraction(0.1) would be the binary float, not the step the user typed.
    step_ns = Fraction(str(step_ms)) * 1_000_000
    t_first = rows[0].time_ns
    prev = rows[0]
    for row in rows:
        if row.time_ns < prev.time_ns:
            raise TraceError(
                path, row.line, fields.time,
                f"timestamps must be sorted: this record is {(prev.time_ns - row.time_ns) / 1e6:g} ms "
                f"earlier than the one on line {prev.line}",
            )
        prev = row
        row.arrival = (row.time_ns - t_first) * step_ns.denominator // step_ns.numerator


def _finish(path, fields: _Fields, rows: list[_Row], max_context, overlong, step_ms, length_scale) -> list[Request]:
    if not rows:
        raise TraceError(path, 1, fields.prompt, "trace holds no requests")
    _assign_arrivals(path, fields, rows, step_ms)
    seen: dict[int, int] = {}
    requests = []
    for row in rows:
        if row.decode == 0:
            raise TraceError(path, row.line, fields.decode, "decode length must be >= 1, got 0")
        rid = row.index if row.request_id is None else row.request_id
        if rid in seen:
            raise TraceError(path, row.line, fields.request_id, f"request id {rid} already used on line {seen[rid]}")
        seen[rid] = row.line
        prompt, decode = row.prompt, row.decode
        if length_scale != 1.0:
            prompt = max(1, round(prompt * length_scale))
        if max_context is not None and prompt + decode > max_context:
            if overlong == "error":
                raise TraceError(
                    path, row.line, f"{fields.prompt}+{fields.decode}",
                    f"request needs {prompt + decode} tokens ({prompt} prompt + {decode} decode), more than "
                    f"max_context={max_context}; pass overlong='truncate' or 'drop' to replay it",
                )
            if overlong == "drop":
                continue
            decode = min(decode, max_context - 1)
            prompt = min(prompt, max_context - decode)
        requests.append(Request(request_id=rid, arrival_step=int(row.arrival or 0), prompt_len=prompt, decode_len=decode))
    if not requests:
        raise TraceError(path, None, f"{fields.prompt}+{fields.decode}", f"every request is longer than max_context={max_context}")
    return requests


# ---------------------------------------------------------------- public API


def read_trace(
    path,
    *,
    max_context: int | None = None,
    overlong: str = "truncate",
    step_ms: float = 50.0,
    length_scale: float = 1.0,
) -> list[Request]:
    """Read a trace file into requests, in file order (see the module docstring for the rules)."""
    _check_options(max_context, overlong, step_ms, length_scale)
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig")  # Excel exports start with a BOM
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        reader = _read_csv
    elif suffix in JSON_SUFFIXES:
        reader = _read_json
    elif suffix in JSONL_SUFFIXES:
        reader = _read_jsonl
    else:
        supported = ", ".join(CSV_SUFFIXES + JSON_SUFFIXES + JSONL_SUFFIXES)
        raise TraceError(path, None, None, f"unsupported trace extension {suffix or '(none)'!r} (expected {supported})")
    if not text.strip():
        raise TraceError(path, 1, "header" if reader is _read_csv else "requests", "file is empty")
    fields, rows = reader(path, text)
    return _finish(path, fields, rows, max_context, overlong, step_ms, length_scale)


TRACE_CSV_COLUMNS = ("request_id", "arrival_step", "prompt_len", "decode_len")


def write_trace_csv(path, requests: Iterable[Request]) -> Path:
    """Write requests in the plain CSV form, atomically (pkv.atomic_io)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(TRACE_CSV_COLUMNS)
    for r in requests:
        writer.writerow((r.request_id, r.arrival_step, r.prompt_len, r.decode_len))
    return write_text_atomic(path, buffer.getvalue())
