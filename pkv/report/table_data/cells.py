"""Typed table cells and a table's numbered footnotes.

Cells are typed values (Num, MeanStd, Sci, Text, Missing, BaselineWrong, NotApplicable) so that one set of rows
renders to both Markdown and LaTeX; pkv.report.tables formats them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Num:
    value: float
    decimals: int
    suffix: str = ""


@dataclass(frozen=True)
class MeanStd:
    """Mean over n values and their sample standard deviation (None when n == 1)."""

    mean: float
    std: float | None
    n: int
    decimals: int
    suffix: str = ""


@dataclass(frozen=True)
class Sci:
    """A small magnitude such as an error, shown as mantissa x 10^exponent."""

    value: float
    digits: int = 3


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Missing:
    """A value that is not there; `note` numbers the footnote that says why."""

    reason: str
    note: int


@dataclass(frozen=True)
class BaselineWrong:
    """A ratio not taken because its baseline's output was wrong against the float64 reference on
    `steps` of `of` measured steps (relative error up to `rel_err`); `note` numbers the footnote
    that says which baseline, which seeds and where."""

    steps: int
    of: int
    rel_err: float
    note: int


@dataclass(frozen=True)
class NotApplicable:
    """A cell with no meaning in its row (the ms/step of a ratio row)."""


Cell = Union[Num, MeanStd, Sci, Text, Missing, BaselineWrong, NotApplicable]


class Notes:
    """Numbered footnotes of one table; the same reason gets the same number."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def missing(self, reason: str) -> Missing:
        return Missing(reason, self.number(reason))

    def number(self, reason: str) -> int:
        if reason not in self._numbers:
            self._numbers[reason] = len(self._numbers) + 1
        return self._numbers[reason]

    @property
    def items(self) -> list[tuple[int, str]]:
        return [(n, reason) for reason, n in self._numbers.items()]


def mean_std(values: Iterable[float], decimals: int, suffix: str = "") -> MeanStd:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_std needs at least one value")
    std = statistics.stdev(vals) if len(vals) > 1 else None
    return MeanStd(statistics.fmean(vals), std, len(vals), decimals, suffix)
