"""Every relative link in README.md and docs/ names a file that exists (and a heading there, when
it names one), so moving a page or renaming a section breaks a test rather than a reader's click."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# [text](target) and ![alt](target); a title after the target ("...") is allowed.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    targets = [m.group(1) for m in _LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def anchors(path: Path) -> set[str]:
    """The fragment ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered."""
    found: set[str] = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def test_every_relative_link_points_to_a_file() -> None:
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            name, _, fragment = target.partition("#")
            linked = (path.parent / name) if name else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken


def test_the_readme_links_its_docs() -> None:
    # The README is where a newcomer starts: every page under docs/ is reachable from it
    # directly or through docs/ itself.
    reachable: set[Path] = set()
    todo = [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reachable or page.suffix != ".md" or not page.exists():
            continue
        reachable.add(page)
        linked = [t.split("#", 1)[0] for t in relative_links(page)]
        todo += [(page.parent / name).resolve() for name in linked if name]
    orphans = [p.relative_to(ROOT).as_posix() for p in markdown_files() if p.resolve() not in reachable]
    assert not orphans
