"""The README and docs/ cite only files and sections that exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted(p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")  # [text](target)
MD_FILE = re.compile(r"(?<![\w/.-])([\w/.-]+\.md)\b")  # a file name ending in .md
SECTION = re.compile(r"([\w/.-]+\.md)\s+§\s*(\d+)")  # docs/design.md §3 (across a line break)


def _resolve(name: str, cited_in: Path) -> Path:
    """A cited path: from the repository root when it names a folder, else beside the citer."""
    return ROOT / name if "/" in name else cited_in.parent / name


def _numbered_sections(path: Path) -> set[str]:
    return set(re.findall(r"^#+\s+(\d+)\.", path.read_text(encoding="utf-8"), re.M))


def test_the_docs_exist():
    assert (ROOT / "docs" / "design.md").is_file()
    assert _numbered_sections(ROOT / "docs" / "design.md") >= {"1", "2", "3", "4", "5"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_cited_file_resolves(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:|#", target):
            continue  # a URL or an anchor of the same page
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    missing += [n for n in MD_FILE.findall(text) if not _resolve(n, doc).is_file()]
    assert not missing, f"{doc.relative_to(ROOT)} cites what does not exist: {missing}"


@pytest.mark.parametrize("path", DOCS + CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_section_exists(path):
    bad = []
    for name, number in SECTION.findall(path.read_text(encoding="utf-8")):
        target = _resolve(name, path)
        if not target.is_file() or number not in _numbered_sections(target):
            bad.append(f"{name} §{number}")
    assert not bad, f"{path.relative_to(ROOT)} cites sections that do not exist: {bad}"


def test_the_checks_find_a_missing_section_and_file(tmp_path):
    doc = tmp_path / "a.md"
    cite = "a.md " + "§"  # (split so that this file cites nothing itself)
    doc.write_text(f"# 1. One\nsee {cite}1, {cite}2 and [b](b.md)\n")
    assert [m for m in SECTION.findall(doc.read_text()) if m[1] not in _numbered_sections(doc)] == [
        ("a.md", "2")
    ]
    assert LINK.findall(doc.read_text()) == ["b.md"]
    assert not (doc.parent / "b.md").exists()
