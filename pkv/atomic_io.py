"""The one atomic writer, and JSON through it: a reader (a table renderer, a later rule, a user's notebook) sees either
the old file or the whole new one, never half a file.

The text goes to a temporary file in the destination folder, is fsynced and renamed over the
destination (os.replace is atomic within one filesystem), and the rename is fsynced with its
folder. The file gets the mode a plain ``open`` would give it (0666 less the umask, so 0644 under
the usual 0022): ``mkstemp`` creates 0600, which would hide shared results from the rest of a group.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """A JSON file that cannot be written (non-finite or unserializable values) or read."""


def _umask() -> int:
    # os.umask can only be read by setting it; set it back at once.
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``path`` atomically; creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    # Persist the rename itself; not every filesystem allows opening a directory.
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return path


def _json_default(value: Any) -> Any:
    # numpy / torch scalars and arrays come straight out of the timing code.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"object of type {type(value).__name__} is not JSON serializable")


def _first_non_finite(obj: Any, where: str = "$") -> str | None:
    """JSON path of the first NaN/inf in obj, so the error can say which field is wrong."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else f"{where} = {obj!r}"
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            found = _first_non_finite(value, f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = _first_non_finite(value, f"{where}[{i}]")
            if found:
                return found
        return None
    tolist = getattr(obj, "tolist", None)
    if callable(tolist) and not isinstance(obj, (str, bytes)):
        return _first_non_finite(tolist(), where)
    return None


def write_json_atomic(path: str | os.PathLike, obj: Any, *, allow_nan: bool = False) -> Path:
    """Write obj as JSON to path atomically; creates parent folders.

    NaN and inf are refused unless allow_nan: they are not JSON, and a NaN time or error in a
    result almost always means a failed measurement that should not reach a table.
    """
    path = Path(path)
    if not allow_nan:
        bad = _first_non_finite(obj)
        if bad:
            raise JsonFileError(f"{path}: refusing to write a non-finite value: {bad}")
    try:
        text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=allow_nan, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise JsonFileError(f"{path}: cannot serialize to JSON: {exc}") from exc
    # Serialize before touching the filesystem, so a bad object leaves nothing behind.
    return write_text_atomic(path, text + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; errors name the file (and the line of a decoding or syntax error)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise JsonFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise JsonFileError(f"{path}: not UTF-8 text: byte {data[exc.start:exc.start + 1]!r} at line {line} "
                            f"(offset {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonFileError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
