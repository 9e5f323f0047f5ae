"""One error path: a refusal is one line on stderr, ``pkv: <file>: field '<field>' = <value>: <why>``,
and exit status 2. The CLI and every command a DAG rule runs (the tables, the benchmarks, the
build) refuse through here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from pkv.atomic_io import JsonFileError, OutputLocked
from pkv.config import ConfigError
from pkv.pipeline.trace_readers import TraceError
from pkv.policy.regime import CalibrationError

# What a run refuses with one line and exit status 2: input named by file, field and value, a held
# output, and the files it cannot read or write. Anything else is a bug and keeps its traceback.
REFUSALS = (ConfigError, TraceError, CalibrationError, JsonFileError, OutputLocked, OSError)


def refusal_line(exc: BaseException) -> str:
    """The one line a refusal prints: ``pkv: <message>`` with the message's lines joined."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return f"pkv: {text}"


def refuse(exc: BaseException) -> NoReturn:
    print(refusal_line(exc), file=sys.stderr)
    sys.exit(2)


def exit_on_refusal(main: Callable[[], int | None]) -> int | None:
    """Run a command's main; a refusal becomes its one line and exit status 2."""
    try:
        return main()
    except REFUSALS as exc:
        refuse(exc)
