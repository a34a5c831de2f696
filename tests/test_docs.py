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


_RAW = re.compile(r"(?<![\w/:-])(?:\./)?(?:benchmarks/)?results/(?:\{[^{}\s`]*\}|[^\s`,;(){}<>])*")


def _braces(pattern: str) -> list[str]:
    """Shell brace expansion of ``pattern``: ``a.{json,log}`` -> ``a.json``, ``a.log``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _braces(pattern[: m.start()] + alt + pattern[m.end() :])]


def _missing_raw_files(results_md: Path) -> list[str]:
    """The raw files a RESULTS page quotes in backticks (``results/...`` relative to its folder, globs and braces
    allowed) that match no file."""
    bad = []
    for span in re.findall(r"`([^`]*)`", results_md.read_text()):
        span = re.sub(r"/[ \t]*\n\s*", "/", span)  # a path wrapped after a slash
        span = re.sub(r"\{[^{}`]*\}", lambda m: re.sub(r"\s+", "", m.group(0)), span)  # {a, b} -> {a,b}
        for quoted in _RAW.findall(span):
            quoted = re.sub(r":\d+(-\d+)?$", "", quoted.removeprefix("./").rstrip("."))  # a file:line reference
            base = ROOT if quoted.startswith("benchmarks/") else results_md.parent
            for pattern in _braces(quoted):
                if not list(base.glob(pattern)):
                    bad.append(pattern)
    return bad


def test_results_quotes_raw_files_that_exist():
    assert _missing_raw_files(ROOT / "benchmarks" / "RESULTS.md") == []


def test_the_raw_file_check_can_fail(tmp_path):
    (tmp_path / "results" / "a").mkdir(parents=True)
    (tmp_path / "results" / "a" / "x.json").write_text("{}")
    (tmp_path / "R.md").write_text(
        "`results/a/x.{json,log}` and `results/a/*.json`, `git show abc:benchmarks/results/old/y.txt`, "
        "`results/<benchmark>/`, `results/a/x.json:12` `results/a/\n  x.json`\n"
        "`./results/a/gone.json` `results/a/\n  gone2.json` `results/a/{x, gone3}.json`\n"
    )
    assert _missing_raw_files(tmp_path / "R.md") == [
        "results/a/x.log", "results/a/gone.json", "results/a/gone2.json", "results/a/gone3.json"
    ]
