"""The notebooks are saved executed: with the outputs of a full-size run of their current code.

GitHub and the docs (myst-nb, execution off) show the saved outputs, so they must be those of the
code as it stands. ``make notebooks`` (notebooks/execute.py) runs them and records the SHA-256 of
the code cells in ``metadata.jaxmem.source_sha256``; these checks read the files only.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
RERUN = "run `make notebooks` (or `make notebooks NOTEBOOKS={}`) and commit the notebook"

_spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks/execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

# A cell that draws: it must show the figure among its outputs.
DRAWS = re.compile(r"\.(plot|plot_timeline|savefig)\(")
MAX_NOTEBOOK_BYTES = 1_000_000
MAX_TEXT_CHARS = 20_000  # of one output


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _code(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def stale(path: Path) -> str | None:
    """Why the saved outputs of ``path`` are not those of its current code, or None."""
    nb = _load(path)
    recorded = nb["metadata"].get("jaxmem", {}).get("source_sha256")
    rerun = RERUN.format(path.stem[:2])
    if recorded is None:
        return f"{path.name} was saved without running it: {rerun}"
    if recorded != execute.source_sha256(nb):
        return f"{path.name}: its code cells changed since its outputs were saved: {rerun}"
    return None


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_outputs_are_those_of_the_current_code(path):
    problem = stale(path)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_from_a_full_size_run_of_every_cell_in_order(path):
    nb = _load(path)
    meta = nb["metadata"].get("jaxmem", {})
    assert meta.get("small") is False and meta.get("ci") is None, (
        f"{path.name} was saved from a run with CI set (small configurations): "
        + RERUN.format(path.stem[:2])
    )
    assert isinstance(meta.get("jax"), str) and meta["jax"], "the jax version is recorded"
    counts = [c["execution_count"] for c in _code(nb)]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {counts} are not those of one run top to bottom: "
        + RERUN.format(path.stem[:2])
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_show_no_error_and_every_figure(path):
    nb = _load(path)
    assert any(c["outputs"] for c in _code(nb)), f"{path.name} has no outputs"
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        where = f"{path.name}, cell {index}"
        outputs = cell["outputs"]
        assert not [o for o in outputs if o["output_type"] == "error"], f"{where} raised"
        stderr = "".join(_text(o["text"]) for o in outputs if o.get("name") == "stderr")
        assert "Traceback" not in stderr, f"{where} printed a traceback:\n{stderr}"
        if DRAWS.search(_text(cell["source"])):
            assert any("image/png" in o.get("data", {}) for o in outputs), (
                f"{where} draws a figure but shows no image: display it (IPython.display.Image)"
            )
        for o in outputs:
            texts = [o.get("text", "")] + [v for k, v in o.get("data", {}).items() if "text" in k]
            for text in map(_text, texts):
                assert len(text) <= MAX_TEXT_CHARS, f"{where}: an output of {len(text):,} chars"
                assert not re.search(r"ipykernel_\d", text), f"{where}: a kernel's pid in {text}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_stay_small(path):
    size = path.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, f"{path.name} is {size:,} B: smaller figures (dpi)"


def _notebook(*sources: str) -> dict:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# A notebook"}]
    for n, source in enumerate(sources, 1):
        cells.append(
            {
                "cell_type": "code",
                "execution_count": n,
                "metadata": {},
                "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}],
                "source": source.splitlines(keepends=True),  # as nbformat writes it
            }
        )
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    nb["metadata"]["jaxmem"] = {"source_sha256": execute.source_sha256(nb)}
    return nb


def test_the_hash_check_finds_an_edited_notebook(tmp_path):
    path = tmp_path / "07_example.ipynb"
    nb = _notebook("x = 1\nprint(x)\n", "print(2)\n")
    path.write_text(json.dumps(nb))
    assert stale(path) is None

    nb["cells"][1]["source"][0] = "x = 2\n"  # the code edited, the outputs not re-run
    path.write_text(json.dumps(nb))
    assert "its code cells changed" in stale(path) and "make notebooks" in stale(path)

    nb["cells"][1]["source"][0] = "x = 1\n"
    nb["cells"][0]["source"] = "# Prose edited"  # markdown is not run: no re-run needed
    path.write_text(json.dumps(nb))
    assert stale(path) is None

    nb["cells"][1:3] = nb["cells"][2:0:-1]  # the same cells, reordered
    path.write_text(json.dumps(nb))
    assert stale(path) is not None

    del nb["metadata"]["jaxmem"]
    path.write_text(json.dumps(nb))
    assert "without running it" in stale(path)
