"""The one atomic writer, and JSON through it: a reader (a table renderer, a later rule, a user's notebook) sees either
the old file or the whole new one, never half a file; the files of one run are replaced as a set.

The text goes to a temporary file in the destination folder, is fsynced and renamed over the
destination (os.replace is atomic within one filesystem), and the rename is fsynced with its
folder. The file gets the mode a plain ``open`` would give it (0666 less the umask, so 0644 under
the usual 0022): ``mkstemp`` creates 0600, which would hide shared results from the rest of a group.

``OutputLock`` keeps a second run out of an output while one writes it: a lock file beside the
output (``.<name>.lock``) held with ``flock``, which the kernel lets go when its process dies, so a
lock left by a killed run is taken over and a live one is refused naming its holder.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """A JSON file that cannot be written (non-finite or unserializable values) or read."""


def _umask() -> int:
    # Linux reports it without changing it; elsewhere os.umask can only be read by setting it, which
    # for an instant gives any file another thread creates mode 0666, so it is set back at once.
    try:
        with open("/proc/self/status", "rb") as status:  # bytes: the Name line may be any encoding
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Persist renames in ``folder``; not every filesystem allows opening a directory."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _unlink_quiet(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _stage(path: Path, text: str) -> str:
    """Write ``text`` to a fsynced temporary beside ``path``; returns its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _unlink_quiet(tmp_name)
        raise
    return tmp_name


def _keep_old(path: Path) -> str | None:
    """A second name for the file at ``path`` (a hard link, else a copy), so it can be put back."""
    if not path.is_file():
        return None
    backup = str(path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.old")
    try:
        os.link(path, backup)
    except OSError:
        shutil.copy2(path, backup)  # a filesystem without hard links
    return backup


def write_files_atomic(texts: Mapping[str | os.PathLike, str]) -> list[Path]:
    """Replace every file of ``texts`` (path -> UTF-8 text) as one set: all of them or none.

    Every text is first written to a temporary file beside its destination; only when all are on
    disk are they renamed over the destinations. If a write or a rename fails, the files already
    renamed get their old content back (or are removed when they had none) and the temporaries go,
    so the folder keeps the complete old set. Creates parent folders. Only a kill between two
    renames (microseconds apart) can leave a mix; Snakemake reruns such a job (rerun-incomplete).
    """
    items = [(Path(path), text) for path, text in texts.items()]
    if len({os.path.abspath(path) for path, _ in items}) != len(items):
        raise ValueError(f"write_files_atomic: a path appears twice in {[str(p) for p, _ in items]}")
    staged: list[tuple[Path, str]] = []
    try:
        for path, text in items:
            staged.append((path, _stage(path, text)))
    except BaseException:
        for _, tmp in staged:
            _unlink_quiet(tmp)
        raise
    # One file is replaced atomically by its rename alone; a set keeps each old file until all are in.
    keep = len(staged) > 1
    backups: dict[Path, str | None] = {}
    replaced: list[Path] = []
    try:
        for path, tmp in staged:
            backups[path] = _keep_old(path) if keep else None
            os.replace(tmp, path)
            replaced.append(path)
    except BaseException:
        for path in reversed(replaced):
            if backups[path] is not None:
                os.replace(backups.pop(path), path)
            else:
                _unlink_quiet(path)
        for path, tmp in staged:
            _unlink_quiet(tmp)
        for backup in backups.values():
            if backup is not None:
                _unlink_quiet(backup)
        raise
    for backup in backups.values():
        if backup is not None:
            _unlink_quiet(backup)
    for folder in {path.parent for path, _ in staged}:
        _fsync_dir(folder)
    return [path for path, _ in staged]


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``path`` atomically; creates parent folders."""
    return write_files_atomic({path: text})[0]


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


def json_text(path: str | os.PathLike, obj: Any, *, allow_nan: bool = False) -> str:
    """obj as the JSON text write_json_atomic writes; errors name ``path`` (and the field)."""
    if not allow_nan:
        bad = _first_non_finite(obj)
        if bad:
            raise JsonFileError(f"{path}: refusing to write a non-finite value: {bad}")
    try:
        text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=allow_nan, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise JsonFileError(f"{path}: cannot serialize to JSON: {exc}") from exc
    return text + "\n"


def write_json_atomic(path: str | os.PathLike, obj: Any, *, allow_nan: bool = False) -> Path:
    """Write obj as JSON to path atomically; creates parent folders.

    NaN and inf are refused unless allow_nan: they are not JSON, and a NaN time or error in a
    result almost always means a failed measurement that should not reach a table.
    """
    # Serialize before touching the filesystem, so a bad object leaves nothing behind.
    return write_text_atomic(path, json_text(path, obj, allow_nan=allow_nan))


def write_json_files_atomic(objs: Mapping[str | os.PathLike, Any]) -> list[Path]:
    """Write several JSON files as one set (write_files_atomic): every object is serialized and
    checked first, so an unwritable one leaves the old set untouched."""
    return write_files_atomic({path: json_text(path, obj) for path, obj in objs.items()})


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


# ---------------------------------------------------------------------------------------------
# one writer per output


class OutputLocked(RuntimeError):
    """Another live process holds the output's lock; the message names it (pid, host, start)."""

    def __init__(self, out: Path, lock_path: Path, holder: Mapping[str, Any] | None):
        self.out, self.lock_path, self.holder = out, lock_path, dict(holder or {})
        h = self.holder
        who = (f"pid {h.get('pid', '?')} on {h.get('host', '?')}, started {h.get('started', '?')}" if h
               else "a process that is taking the lock now")
        super().__init__(f"{out}: field 'out' = {str(out)!r}: another run writes there ({who}; lock file "
                         f"{lock_path}): wait for it to finish or choose another out=")


def lock_path_for(out: str | os.PathLike) -> Path:
    """The lock file of an output (file or folder): ``.<name>.lock`` beside it, so the outputs of
    parallel jobs that share a folder (isolated/ctx<N>.json) each have their own."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.lock"


def read_lock_holder(fd: int) -> dict | None:
    """The JSON holder record written into a lock file, or None where there is none or it is unreadable."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid < 1:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """``with OutputLock(out):`` holds ``out``'s lock for the block, or raises OutputLocked at once.

    ``stale`` is the record of a holder that died with the lock (taken over), else None.
    """

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.path = lock_path_for(out)
        self.stale: dict | None = None
        self._fd: int | None = None

    def _open_locked(self) -> int:
        """An fd of the current lock file, flock-ed by us; OutputLocked if another process holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_lock_holder(fd)
                os.close(fd)
                raise OutputLocked(self.out, self.path, holder) from None
            except OSError:
                # No flock here (some network filesystems): fall back on the recorded pid.
                holder = read_lock_holder(fd)
                if holder and (holder.get("host") != socket.gethostname() or _pid_alive(holder.get("pid"))):
                    os.close(fd)
                    raise OutputLocked(self.out, self.path, holder) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder may have released (unlinked) the file between our open and our flock; then
            # we hold a lock on a file nobody else will look at, so start again on the current one.
            try:
                st, current = os.fstat(fd), os.stat(self.path)
                if (st.st_dev, st.st_ino) == (current.st_dev, current.st_ino):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def acquire(self) -> "OutputLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this OutputLock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open_locked()
        try:
            # A record in a file we could lock is a holder that died without releasing it.
            self.stale = read_lock_holder(fd)
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "out": str(self.out)}
            data = json.dumps(record).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            # Unlink while still holding it: a waiter that opened this file sees it gone and retries.
            _unlink_quiet(self.path)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
