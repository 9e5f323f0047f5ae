"""CSV traces: the plain form (``prompt_len, decode_len[, arrival_step, request_id]``) and the
Azure LLM inference trace form (``TIMESTAMP, ContextTokens, GeneratedTokens``).
"""

from __future__ import annotations

import csv
import io
from datetime import date
from functools import lru_cache

from pkv.pipeline.trace_readers.common import (
    _PLAIN, MAX_LENGTH, MAX_STEP_OR_ID, PLAIN_OPTIONAL, PLAIN_REQUIRED, TraceError, _Fields, _Row, quote,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

CSV_SUFFIXES = (".csv",)

_AZURE = _Fields("ContextTokens", "GeneratedTokens", time="TIMESTAMP")


# ---------------------------------------------------------------- value parsing


def _csv_int(path, line: int, field: str, text: str, maximum: int = MAX_LENGTH) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, field, f"expected a non-negative integer, got {quote(text)}") from None
    if value < 0:
        raise TraceError(path, line, field, f"must be >= 0, got {value}")
    if value > maximum:
        raise TraceError(path, line, field, f"must be <= {maximum}, got {quote(value)}")
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
            path, line, "TIMESTAMP", f"expected a time like '2023-11-16 18:17:03.9799600', got {quote(text)}"
        ) from None


# ---------------------------------------------------------------- CSV


def _read_csv(path, text: str) -> tuple[_Fields, list[_Row]]:
    reader = csv.reader(io.StringIO(text))
    try:
        return _parse_csv(path, reader)
    except csv.Error as exc:  # a field past csv's size limit, a stray quote in strict mode
        raise TraceError(path, reader.line_num, None, f"malformed CSV: {exc}") from None


def _parse_csv(path, reader) -> tuple[_Fields, list[_Row]]:
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
                row.arrival = _csv_int(path, line, "arrival_step", raw[col["arrival_step"]], MAX_STEP_OR_ID)
            if "request_id" in col:
                row.request_id = _csv_int(path, line, "request_id", raw[col["request_id"]], MAX_STEP_OR_ID)
        rows.append(row)
    return fields, rows
