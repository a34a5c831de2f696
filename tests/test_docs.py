"""The README and docs/ link to files and sections that exist (GitHub's heading anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


def _broken(path: Path) -> list[str]:
    """The links of ``path`` whose file or heading does not exist."""
    bad = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    assert _broken(path) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# Top `part`\n[ok](#top-part) [gone](missing.md) [nowhere](#no-such) [x](a.md)\n")
    assert [b.split(":")[0] for b in _broken(tmp_path / "a.md")] == ["missing.md", "#no-such"]
