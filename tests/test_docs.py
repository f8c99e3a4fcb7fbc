"""The README and docs/ cite only files and sections that exist; the API reference documents
every public name; the README stays a front door."""

import importlib
import inspect
import json
import os
import pkgutil
import re
import zlib
from pathlib import Path

import pytest

import jaxmem

ROOT = Path(__file__).resolve().parents[1]
# docs/_build/ (the site) and docs/notebooks/ (copies of notebooks/ made by docs/conf.py) are
# generated.
DOCS = [
    ROOT / "README.md",
    *sorted(
        p
        for p in (ROOT / "docs").rglob("*.md")
        if not {"_build", "notebooks"} & set(p.relative_to(ROOT / "docs").parts)
    ),
]
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
    # A file named in the prose (a link's target is checked above, relative to the page).
    prose = LINK.sub(lambda m: m.group(0)[: m.start(1) - m.start(0)] + ")", text)
    missing += [n for n in MD_FILE.findall(prose) if not _resolve(n, doc).is_file()]
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


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"
    text = "\n".join(lines)
    assert text.index("make demo") < text.index("make test"), "make demo comes first"


WORKING_NOTES = re.compile(r"\bsessions?\b|\bthe issue\b|\bissue #|measured earlier", re.I)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_working_notes(doc):
    found = WORKING_NOTES.findall(doc.read_text(encoding="utf-8"))
    assert not found, f"{doc.relative_to(ROOT)} reads like a team note: {found}"


# The API reference: docs/api/*.md, autodoc directives (``.. autofunction:: jaxmem.scan``) and
# hand-written entries (``.. py:data::`` / ``{py:data}``) naming each object in full.
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
API_ENTRY = re.compile(r"(?:\.\. (?:auto\w+|py:\w+)::|```\{(?:auto\w+|py:\w+)\})\s+([\w.]+)")


def _public_modules(package=jaxmem):
    """jaxmem and its public submodules that declare ``__all__``: not ``_src``, not the demo
    package (demo code, not API), not ``jaxmem.flax`` without Flax."""
    found = [package] if hasattr(package, "__all__") else []
    for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
        last = info.name.rsplit(".", 1)[-1]
        if last.startswith("_") or info.name == "jaxmem.demo":
            continue
        if info.name == "jaxmem.flax" and importlib.util.find_spec("flax") is None:
            continue
        module = importlib.import_module(info.name)
        if info.ispkg:
            found += _public_modules(module)
        elif hasattr(module, "__all__"):
            found.append(module)
    return found


def _public_names():
    """The full name of every object in a public ``__all__``, as the API pages must name it."""
    out = set()
    for module in _public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            out.add(obj.__name__ if inspect.ismodule(obj) else f"{module.__name__}.{name}")
    return out


def _documented():
    return {m for p in API_PAGES for m in API_ENTRY.findall(p.read_text(encoding="utf-8"))}


def test_the_api_reference_documents_every_public_name():
    modules = {m.__name__ for m in _public_modules()}
    assert {"jaxmem", "jaxmem.policies", "jaxmem.losses", "jaxmem.offload"} <= modules
    missing = sorted(_public_names() - _documented())
    assert not missing, f"public names without an entry in docs/api/*.md: {missing}"
    assert API_ENTRY.findall(".. autofunction:: jaxmem.scan\n```{py:data} jaxmem.NAMES") == [
        "jaxmem.scan",
        "jaxmem.NAMES",
    ]


def test_the_api_reference_lists_every_checkpoint_name():
    page = (ROOT / "docs" / "api" / "jaxmem.md").read_text(encoding="utf-8")
    missing = [n for n in jaxmem.NAMES if f"| `{n}` |" not in page]
    assert not missing, f"docs/api/jaxmem.md's table of jaxmem.NAMES lacks {missing}"


def _inventory(path):
    """The object names in a Sphinx ``objects.inv`` (four header lines, then zlib)."""
    data = path.read_bytes()
    for _ in range(4):
        data = data[data.index(b"\n") + 1 :]
    lines = zlib.decompress(data).decode("utf-8").splitlines()
    return {line.split(" ", 1)[0] for line in lines if " py:" in line}


SITE = ROOT / "docs" / "_build" / "html"


def _require_site(newer_than=()):
    """Skips without a built site (or one older than ``newer_than``), except under CI, where
    .ci/run builds the site before the tests: there a missing site fails."""
    inv = SITE / "objects.inv"
    if not inv.is_file():
        if os.environ.get("CI"):
            pytest.fail("no docs/_build/html under CI: .ci/run runs make docs first")
        pytest.skip("no docs/_build/html: run make docs")
    if newer_than and inv.stat().st_mtime < max(p.stat().st_mtime for p in newer_than):
        pytest.skip("docs/_build/html is older than its sources: run make docs")


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_built_site_shows_every_notebook_with_its_outputs(nb):
    _require_site(newer_than=[nb])
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    page = (SITE / "notebooks" / f"{nb.stem}.html").read_text(encoding="utf-8")
    assert page.count('class="cell_output') == sum(bool(c.get("outputs")) for c in code) > 0
    assert page.count("<img") >= images > 0, f"{nb.name}'s figures are not on its page"


def test_the_built_site_documents_every_public_name():
    inv = SITE / "objects.inv"
    _require_site()
    sources = [*API_PAGES, *(ROOT / "src" / "jaxmem").glob("**/__init__.py")]
    sources += [ROOT / "src" / "jaxmem" / f for f in ("policies.py", "offload.py", "losses.py")]
    _require_site(newer_than=[p for p in sources if p.is_file()])
    missing = sorted(_public_names() - _inventory(inv))
    assert not missing, f"public names not in the built site's objects.inv: {missing}"
