"""A rendered Markdown table as a standalone HTML page, for `snakemake --report`.

The report shows HTML inline, while Markdown would only be offered as a download. The page is
made from the Markdown file itself, so it holds the same text and numbers: this converts the
subset the templates in paper_tables/ write (paragraphs, **bold**, `code`, pipe tables with
alignment, "- " lists), nothing more.
"""

from __future__ import annotations

import html
import re

_STYLE = """
body { font-family: sans-serif; font-size: 14px; margin: 1em; }
table { border-collapse: collapse; margin: 0.8em 0; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; vertical-align: top; }
th { background: #eee; }
td.r, th.r { text-align: right; }
code { background: #f4f4f4; }
"""


def _inline(text: str) -> str:
    out = html.escape(text.replace(r"\|", "|"), quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def _cells(line: str) -> list[str]:
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


def _table(lines: list[str]) -> str:
    head, rule, body = _cells(lines[0]), _cells(lines[1]), [_cells(line) for line in lines[2:]]
    right = [c.endswith(":") and not c.startswith(":") for c in rule]

    def row(cells: list[str], tag: str) -> str:
        attrs = [' class="r"' if i < len(right) and right[i] else "" for i in range(len(cells))]
        tds = "".join(f"<{tag}{a}>{_inline(c)}</{tag}>" for a, c in zip(attrs, cells))
        return f"<tr>{tds}</tr>"

    return ("<table><thead>" + row(head, "th") + "</thead><tbody>"
            + "".join(row(cells, "td") for cells in body) + "</tbody></table>")


def markdown_to_html(markdown: str, title: str) -> str:
    """The page of one rendered table."""
    blocks, current = [], []
    for line in markdown.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    parts = []
    for block in blocks:
        if all(line.lstrip().startswith("|") for line in block) and len(block) >= 2:
            parts.append(_table(block))
        elif all(line.startswith("- ") for line in block):
            parts.append("<ul>" + "".join(f"<li>{_inline(line[2:])}</li>" for line in block) + "</ul>")
        else:
            # A paragraph may end in table rows when a template puts no blank line before them.
            text = [line for line in block if not line.lstrip().startswith("|")]
            rows = block[len(text):]
            if text:
                parts.append("<p>" + "<br>\n".join(_inline(line) for line in text) + "</p>")
            if len(rows) >= 2:
                parts.append(_table(rows))
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
