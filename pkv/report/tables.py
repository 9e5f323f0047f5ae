"""Render the paper's tables and the claims check from a results root through the Jinja templates
in paper_tables/.

    python -m pkv.report.tables --root artifacts/<gpu> --out artifacts/<gpu>/tables

Numbers come from pkv.report.table_data (pkv.report.evidence for Table 6, pkv.report.claims for the
claims check); the templates hold the layout; this module only turns typed cells into Markdown or
LaTeX text. Each Markdown table is also written as an HTML page (pkv.report.html_page) for
`snakemake --report`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jinja2

from pkv.atomic_io import write_files_atomic
from pkv.refusal import exit_on_refusal
from pkv.report import claims, evidence, table_data
from pkv.report.html_page import markdown_to_html
from pkv.report.table_data import BaselineWrong, MeanStd, Missing, NotApplicable, Num, Sci, Text
from pkv.report.table_data.labels import seeds_phrase
from pkv.report.table_data.model_step import table9

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "paper_tables"
FORMATS = ("md", "tex")

TABLE_BUILDERS: dict[int, Callable[[Path], dict[str, Any]]] = {
    1: table_data.table1,
    2: table_data.table2,
    3: table_data.table3,
    4: table_data.table4,
    5: table_data.table5,
    6: evidence.evidence_map,
    7: table_data.table7,
    8: table_data.table8,
    9: table9,
}

# Rendered beside the paper's tables, from templates of the same names.
NAMED_BUILDERS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "claims": claims.claims_check,
}

DASH = {"md": "–", "tex": "--"}


def _mantissa_exponent(value: float, digits: int) -> tuple[str, int]:
    exponent = math.floor(math.log10(abs(value)))
    mantissa = value / 10**exponent
    # Rounding can carry the mantissa to 10.000; renormalize so it reads 1.000e(k+1).
    if round(abs(mantissa), digits) >= 10:
        exponent += 1
        mantissa = value / 10**exponent
    return f"{mantissa:.{digits}f}", exponent


_TEX_SPECIALS = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "×": r"$\times$", "±": r"$\pm$", "–": "--", "|": r"\textbar{}", "<": r"\textless{}", ">": r"\textgreater{}",
}


def escape_tex(text: Any) -> str:
    return "".join(_TEX_SPECIALS.get(ch, ch) for ch in str(text))


def escape_md(text: Any) -> str:
    # Only what breaks a pipe table; everything else reads as plain text.
    return str(text).replace("|", r"\|").replace("\n", " ")


def format_cell(value: Any, fmt: str) -> str:
    """One typed cell as Markdown (fmt="md") or LaTeX (fmt="tex") text."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    tex = fmt == "tex"
    if isinstance(value, Missing):
        return rf"--\textsuperscript{{{value.note}}}" if tex else f"–[{value.note}]"
    if isinstance(value, BaselineWrong):
        # No ratio: the baseline's output was wrong against float64 on some of the measured steps.
        # (A non-finite output has an infinite relative error.)
        if math.isfinite(value.rel_err) and value.rel_err > 0:
            rel = format_cell(Sci(value.rel_err, 1), fmt)
        else:
            rel = r"$\infty$" if tex else "inf"
        text = f"baseline wrong on {value.steps}/{value.of} steps (rel.{'~' if tex else ' '}err {rel} vs float64)"
        return text + (rf"\textsuperscript{{{value.note}}}" if tex else f"[{value.note}]")
    if isinstance(value, NotApplicable) or value is None:
        return DASH[fmt]
    if isinstance(value, Num):
        text = f"{value.value:.{value.decimals}f}"
        return text + (escape_tex(value.suffix) if tex else value.suffix)
    if isinstance(value, MeanStd):
        mean = f"{value.mean:.{value.decimals}f}"
        suffix = (r"\times" if value.suffix == "×" else escape_tex(value.suffix)) if tex else value.suffix
        if value.std is None:
            return f"${mean}{suffix}$" if tex else f"{mean}{suffix}"
        std = f"{value.std:.{value.decimals}f}"
        return f"${mean}{{\\pm}}{std}{suffix}$" if tex else f"{mean} ± {std}{suffix}"
    if isinstance(value, Sci):
        if value.value == 0:
            return "0"
        mantissa, exponent = _mantissa_exponent(value.value, value.digits)
        return f"${mantissa}{{\\cdot}}10^{{{exponent}}}$" if tex else f"{mantissa}e{exponent:+03d}"
    if isinstance(value, Text):
        return escape_tex(value.text) if tex else escape_md(value.text)
    if isinstance(value, (int, float, str)):
        return escape_tex(value) if tex else escape_md(value)
    raise TypeError(f"cannot format a table cell of type {type(value).__name__}")


def format_marks(marks: Iterable[int], fmt: str) -> str:
    """Footnote marks for a row whose numbers leave some seeds out."""
    marks = sorted(set(marks))
    if not marks:
        return ""
    joined = ",".join(str(m) for m in marks)
    return rf"\textsuperscript{{{joined}}}" if fmt == "tex" else f"[{joined}]"


def make_environment(fmt: str, templates_dir: Path = TEMPLATES_DIR) -> jinja2.Environment:
    if not templates_dir.is_dir():
        raise FileNotFoundError(f"{templates_dir}: template folder not found")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,  # a renamed row field must fail the render, not print nothing
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["cell"] = lambda v: format_cell(v, fmt)
    env.filters["esc"] = escape_tex if fmt == "tex" else escape_md
    env.filters["marks"] = lambda m: format_marks(m, fmt)
    env.filters["seeds"] = seeds_phrase
    env.globals["dash"] = DASH[fmt]
    return env


def render_table(number: int, root: Path, fmt: str, templates_dir: Path = TEMPLATES_DIR) -> str:
    if number not in TABLE_BUILDERS:
        raise ValueError(f"no table {number}; tables are {sorted(TABLE_BUILDERS)}")
    context = TABLE_BUILDERS[number](Path(root))
    template = make_environment(fmt, templates_dir).get_template(f"table{number}.{fmt}.j2")
    return template.render(t=context, table_number=number)


def render_named(name: str, root: Path, fmt: str, templates_dir: Path = TEMPLATES_DIR) -> str:
    """One of NAMED_BUILDERS (the claims check) as Markdown or LaTeX text."""
    if name not in NAMED_BUILDERS:
        raise ValueError(f"no table {name!r}; named tables are {sorted(NAMED_BUILDERS)}")
    template = make_environment(fmt, templates_dir).get_template(f"{name}.{fmt}.j2")
    return template.render(t=NAMED_BUILDERS[name](Path(root)), table_number=None)


def output_names() -> list[str]:
    """The stems render_all writes: table1 ... table9, then the named tables."""
    return [f"table{k}" for k in sorted(TABLE_BUILDERS)] + list(NAMED_BUILDERS)


def render_all(root: Path, out_dir: Path, templates_dir: Path = TEMPLATES_DIR) -> list[Path]:
    """Render tables 1-9 and the claims check as <name>.md, <name>.tex and <name>.html under out_dir;
    returns the files written.

    Every table is rendered before any is written, and the files are replaced as one set: a
    results file that cannot be read leaves all the previous tables in place, not half of them.
    """
    root, out_dir = Path(root), Path(out_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: results root is not a directory")
    builders: dict[str, tuple[Callable[[Path], dict[str, Any]], int | None]] = {
        f"table{k}": (TABLE_BUILDERS[k], k) for k in sorted(TABLE_BUILDERS)}
    builders.update({name: (build, None) for name, build in NAMED_BUILDERS.items()})
    texts = {}
    for name, (build, number) in builders.items():
        context = build(root)
        for fmt in FORMATS:
            template = make_environment(fmt, templates_dir).get_template(f"{name}.{fmt}.j2")
            texts[out_dir / f"{name}.{fmt}"] = text = template.render(t=context, table_number=number)
            if fmt == "md":
                texts[out_dir / f"{name}.html"] = markdown_to_html(text, name)
    return write_files_atomic(texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkv.report.tables", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="results root, e.g. artifacts/<gpu>")
    parser.add_argument("--out", type=Path, required=True, help="folder for table<K>.md and table<K>.tex")
    parser.add_argument("--templates", type=Path, default=TEMPLATES_DIR, help="folder of table templates")
    args = parser.parse_args(argv)
    # A missing or malformed result refuses with one line and exit status 2 (pkv.refusal).
    paths = render_all(args.root, args.out, args.templates)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
