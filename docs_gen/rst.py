"""The small subset of reStructuredText the project's docstrings use, as Markdown: inline
literals and roles, simple tables (``===`` borders), borderless ``term  text`` tables,
definition lists and ``::`` literal blocks."""

from __future__ import annotations

import re
import textwrap

_BORDER = re.compile(r"^\s*=+(?:\s+=+)+\s*$")
_ROLE = re.compile(r":[a-z]+:`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
# A borderless table row: a literal term, two or more spaces (one, after such a row), its text.
_TERM_ROW = re.compile(r"^(``[^`]+``)(\s{2,}|\s)(\S.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def inline(text: str) -> str:
    text = _ROLE.sub(lambda m: f"``{m.group(1).lstrip('~')}``", text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def cell(text: str) -> str:
    return inline(text).replace("|", "\\|")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def parse_simple_table(lines: list[str], start: int) -> tuple[list[str], list[list[str]], int]:
    """The table whose top border is ``lines[start]``: header, rows, and the index after it."""
    border = lines[start]
    indent = len(border) - len(border.lstrip())
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
    starts = [s for s, _ in spans]

    def split(line: str) -> list[str]:
        cols = []
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(line)
            cols.append(line[s:end].strip() if len(line) > s else "")
        return cols

    sections: list[list[list[str]]] = [[]]
    i = start + 1
    borders = 1
    while i < len(lines) and borders < 3:
        line = lines[i]
        if _BORDER.match(line) and len(line) - len(line.lstrip()) == indent:
            borders += 1
            # A table without a header row ends at its second border.
            if borders == 2 and (i + 1 >= len(lines) or not lines[i + 1].strip()):
                return [], sections[0], i + 1
            if borders < 3:
                sections.append([])
        elif line.strip():
            cols = split(line)
            rows = sections[-1]
            if cols[0] or not rows:
                rows.append(cols)
            else:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cols, strict=True)]
        i += 1
    header = [" ".join(c for c in col if c) for col in zip(*sections[0], strict=True)]
    return header, sections[1] if len(sections) > 1 else [], i


def parameter_rows(doc: str) -> dict[str, str]:
    """Parameter name → meaning, from every simple table in ``doc`` whose first column is
    headed ``parameter``."""
    lines = textwrap.dedent(doc).splitlines()
    found: dict[str, str] = {}
    i = 0
    while i < len(lines):
        if _BORDER.match(lines[i]):
            header, rows, i = parse_simple_table(lines, i)
            if header and header[0] == "parameter":
                for row in rows:
                    found.setdefault(row[0], row[-1])
        else:
            i += 1
    return found


def to_markdown(doc: str, drop_parameter_tables: bool = False, header: tuple[str, ...] = ()) -> str:
    """``doc`` as Markdown; ``header`` names the columns of tables that have no header row."""
    lines = textwrap.dedent(doc).strip("\n").splitlines()
    # The first line of a docstring sits right after the quotes, unindented.
    if len(lines) > 1 and not lines[0].startswith(" "):
        lines = [lines[0], *textwrap.dedent("\n".join(lines[1:])).splitlines()]
    out: list[str] = []
    in_terms = False
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if _BORDER.match(line):
            names, rows, i = parse_simple_table(lines, i)
            if not names:
                names = list(header) or [""] * len(rows[0])
            if not (drop_parameter_tables and names[0] == "parameter"):
                out += ["", *markdown_table(names, rows), ""]
            continue
        if stripped.endswith("::"):
            out.append(inline(line.rstrip()[:-1]).strip())
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
                block.append(lines[i])
                i += 1
            out += ["", "```", *textwrap.dedent("\n".join(block)).strip("\n").splitlines(), "```", ""]
            continue
        term = _TERM_ROW.match(stripped)
        in_terms = bool(term) and (in_terms or len(term.group(2)) > 1)
        if in_terms:
            text = [term.group(3)]
            i += 1
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
                text.append(lines[i].strip())
                i += 1
            out.append(f"* {inline(term.group(1))}: {inline(' '.join(text))}")
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (
            stripped.startswith("``")
            and nxt.strip()
            and len(nxt) - len(nxt.lstrip()) > indent
            and not _BORDER.match(nxt)
            and not stripped.startswith(("* ", "- "))
        ):
            out += ["", f"**{inline(stripped)}**", ""]
            i += 1
            continue
        # An inline literal broken over lines is joined into one line first.
        while stripped.count("``") % 2 and i + 1 < len(lines) and lines[i + 1].strip():
            i += 1
            stripped += " " + lines[i].strip()
        out.append(inline(stripped))
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
