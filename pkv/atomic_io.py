"""The one atomic writer: a reader (a table renderer, a later rule, a user's notebook) sees either
the old file or the whole new one, never half a file.

The text goes to a temporary file in the destination folder, is fsynced and renamed over the
destination (os.replace is atomic within one filesystem), and the rename is fsynced with its
folder. The file gets the mode a plain ``open`` would give it (0666 less the umask, so 0644 under
the usual 0022): ``mkstemp`` creates 0600, which would hide shared results from the rest of a group.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
