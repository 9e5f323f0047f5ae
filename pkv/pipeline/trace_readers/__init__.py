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
(the header or the first line is line 1) and the field. Any file can be handed in: one that is
not UTF-8 text (UTF-16 or UTF-32, Latin-1, an archive, binary data), larger than
``MAX_TRACE_BYTES`` or not a regular file is refused naming the line and what was found there;
lengths above ``2**31 - 1`` and arrival steps or ids above ``2**63 - 1`` are refused where they stand.

Modules: ``common`` (TraceError, the finishing rules, the CSV writer), ``csv_traces`` (plain and
Azure CSV), ``json_traces`` (JSON and JSON lines); this package picks the reader by extension.
"""

from __future__ import annotations

from pathlib import Path

from pkv.pipeline.trace_readers.common import (
    MAX_TRACE_BYTES, OVERLONG_POLICIES, PLAIN_OPTIONAL, PLAIN_REQUIRED, TRACE_CSV_COLUMNS, TraceError, _check_options,
    _finish, read_trace_text, write_trace_csv,
)
from pkv.pipeline.trace_readers.csv_traces import AZURE_COLUMNS, CSV_SUFFIXES, _read_csv
from pkv.pipeline.trace_readers.json_traces import JSON_SUFFIXES, JSONL_SUFFIXES, TIMESTAMPED_KEYS, _read_json, _read_jsonl
from pkv.pipeline.traces import Request

__all__ = ["AZURE_COLUMNS", "CSV_SUFFIXES", "JSONL_SUFFIXES", "JSON_SUFFIXES", "MAX_TRACE_BYTES", "OVERLONG_POLICIES",
           "PLAIN_OPTIONAL", "PLAIN_REQUIRED", "TIMESTAMPED_KEYS", "TRACE_CSV_COLUMNS", "TraceError", "read_trace",
           "read_trace_text", "write_trace_csv"]


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
    text = read_trace_text(path)
    if not text.strip():
        raise TraceError(path, 1, "header" if reader is _read_csv else "requests", "file is empty")
    fields, rows = reader(path, text)
    return _finish(path, fields, rows, max_context, overlong, step_ms, length_scale)
