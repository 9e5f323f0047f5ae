"""What every trace format shares: the error type, the parsed record, the finishing rules (options,
arrival steps, request ids, length scaling, the overlong policy) and the plain CSV writer.
"""

from __future__ import annotations

import csv
import io
import math
import os
import stat
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterable

from pkv.atomic_io import write_text_atomic
from pkv.pipeline.traces import Request

OVERLONG_POLICIES = ("truncate", "drop", "error")

# A trace file is read whole: 1 GiB of CSV is some 30 million requests, far past what a run replays
# (pkv.config.schema bounds num_requests), and its parse would take tens of GiB of memory.
MAX_TRACE_BYTES = 1 << 30
# Lengths are int32 in the plans (seq_lens); arrival steps and request ids int64 in the serving loop.
MAX_LENGTH = 2**31 - 1
MAX_STEP_OR_ID = 2**63 - 1
# How much of a bad value or line an error quotes.
QUOTE_CHARS = 40

# Leading bytes of files that are not text at all, and what they are.
_MAGIC = ((b"\x1f\x8b", "a gzip archive"), (b"PK\x03\x04", "a zip archive"), (b"BZh", "a bzip2 archive"),
          (b"\xfd7zXZ\x00", "an xz archive"), (b"\x28\xb5\x2f\xfd", "a zstd archive"), (b"PAR1", "a Parquet file"))
# Byte-order marks of the text encodings that are not UTF-8 (UTF-32 first: its LE mark starts with UTF-16's).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))

PLAIN_REQUIRED = ("prompt_len", "decode_len")
PLAIN_OPTIONAL = ("arrival_step", "request_id")


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


@dataclass
class _Row:
    line: int
    index: int  # 0-based record index, the default request id
    prompt: int
    decode: int
    arrival: int | None = None
    time_ns: int | None = None
    request_id: int | None = None


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """repr(value), cut to `limit` characters: an error quotes what it found, not a whole file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- reading the file


def read_trace_text(path: Path) -> str:
    """The file as text, or TraceError naming the file, the line and what was found there: a file
    that is missing, not a regular file, too large, an archive, UTF-16/32 or binary, or not UTF-8."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise TraceError(path, None, None, "not a regular file")
            if info.st_size > MAX_TRACE_BYTES:
                raise TraceError(path, None, None, f"file is {info.st_size} bytes, more than the {MAX_TRACE_BYTES} "
                                 "a trace may have")
            data = handle.read(MAX_TRACE_BYTES + 1)
    except FileNotFoundError:
        raise TraceError(path, None, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, None, "is a folder, not a trace file") from None
    except OSError as exc:
        raise TraceError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    return decode_trace_bytes(path, data)


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def decode_trace_bytes(path, data: bytes) -> str:
    """UTF-8 text (a leading BOM dropped, as Excel writes it), else TraceError saying what it is."""
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise TraceError(path, 1, None, f"found {what} (bytes {data[:len(magic)].hex(' ')}), not a text trace; "
                             "extract it first")
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise TraceError(path, 1, None, f"found {encoding} text (byte-order mark {bom.hex(' ')}), not UTF-8; "
                             "save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        line, column = _line_and_column(data, nul)
        raise TraceError(path, line, None, f"found a NUL byte at column {column}: binary data or UTF-16/32 text "
                         "without a byte-order mark, not UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_and_column(data, exc.start)
        start = data.rfind(b"\n", 0, exc.start) + 1
        raise TraceError(path, line, None, f"not UTF-8 text: byte 0x{data[exc.start]:02X} at column {column} "
                         f"(found {quote(data[start:exc.start + 8])}); save the file as UTF-8 (it may be "
                         "Latin-1 or Windows-1252)") from None
    return text.removeprefix("\ufeff")


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
        if row.arrival > MAX_STEP_OR_ID:
            raise TraceError(path, row.line, fields.time, f"lies {quote(row.arrival)} decode steps after the first "
                             f"record, more than {MAX_STEP_OR_ID}")


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


# ---------------------------------------------------------------- CSV writer


TRACE_CSV_COLUMNS = ("request_id", "arrival_step", "prompt_len", "decode_len")


def write_trace_csv(path, requests: Iterable[Request]) -> Path:
    """Write requests in the plain CSV form, atomically (pkv.atomic_io)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(TRACE_CSV_COLUMNS)
    for r in requests:
        writer.writerow((r.request_id, r.arrival_step, r.prompt_len, r.decode_len))
    return write_text_atomic(path, buffer.getvalue())
