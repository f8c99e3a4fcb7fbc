"""Executes the notebooks in place at full size and saves them with their outputs.

    python notebooks/execute.py               every notebook (what ``make notebooks`` runs)
    python notebooks/execute.py 01 05         a subset: file names, stems or their number prefix

Each notebook runs top to bottom in a fresh kernel, with ``notebooks/`` as the working directory
and ``CI`` unset (so ``SMALL`` is false: the full-size configurations). It is saved with its
outputs, execution counts 1, 2, ... and ``metadata.jaxmem``: the SHA-256 of its code cells'
sources (``source_sha256``, what ``tests/test_notebooks.py`` compares with the current cells), the
jax version, backend and Python of the kernel, and whether it ran with ``SMALL`` set. Execution
timestamps and widget state are not saved, nor what differs between runs in printed source
locations (the repository's absolute path, the kernel's process id), so a re-run changes only
what the code printed or drew. A notebook that raises is left as it was, and the script exits 1
naming it.
"""

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 1800
# What would differ between two runs, or between machines, in printed source locations: the
# repository's absolute path (dropped: paths read from the repository root) and the kernel's
# process id in the directory of its cell files (/tmp/ipykernel_<pid>/<hash of the cell>.py).
VOLATILE = [
    (re.compile(re.escape(str(HERE.parent) + os.sep)), ""),
    (re.compile(r"ipykernel_\d+"), "ipykernel_<pid>"),
]

# Run in the kernel after the notebook's last cell (then removed): what the kernel ran with.
PROBE = """\
import json as _json, os as _os, platform as _platform
import jax as _jax
print(_json.dumps({
    "jax": _jax.__version__,
    "backend": _jax.default_backend(),
    "python": _platform.python_version(),
    "small": bool(globals().get("SMALL", False)),
    "ci": _os.environ.get("CI"),
}))
"""


def _source(cell) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def source_sha256(nb) -> str:
    """SHA-256 of the code cells' sources in order (a notebook as a dict, as json or nbformat
    loads it): any edit to the code changes it, edits to markdown cells do not."""
    sources = [_source(c) for c in nb["cells"] if c["cell_type"] == "code"]
    return hashlib.sha256(json.dumps(sources).encode("utf-8")).hexdigest()


def resolve(names: list[str]) -> list[Path]:
    """The notebooks named (all when none is): ``01``, ``01_scan_memory_profile``, or the file
    name or path of the notebook."""
    every = sorted(HERE.glob("[0-9]*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).name.removesuffix(".ipynb")
        found = [p for p in every if p.stem == stem] or [
            p for p in every if p.stem.startswith(stem)
        ]
        if len(found) != 1:
            options = ", ".join(p.name for p in every)
            raise SystemExit(f"error: {name!r} names no single notebook (one of: {options})")
        chosen += found
    return chosen


def _stable(text: str) -> str:
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def _merge_streams(outputs: list) -> list:
    """Consecutive prints to the same stream as one output (how a cell's prints are split
    depends on timing)."""
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (
            output.output_type == "stream"
            and previous is not None
            and previous.output_type == "stream"
            and previous.name == output.name
        ):
            previous.text += output.text
        else:
            merged.append(output)
    return merged


def execute(path: Path):
    """Runs ``path`` in a fresh kernel and returns it executed and cleaned (not yet saved)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute()
    probe = nb.cells.pop()
    info = json.loads("".join(o.text for o in probe.outputs if o.get("name") == "stdout"))
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _merge_streams(cell.outputs)
        for output in cell.get("outputs", []):
            if "text" in output:
                output.text = _stable(output.text)
            for mime, value in output.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    output.data[mime] = _stable(value)
    nb.metadata.pop("widgets", None)
    nb.metadata["jaxmem"] = {"source_sha256": source_sha256(nb), **info}
    return nb


def main(argv: list[str]) -> int:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    os.environ.pop("CI", None)  # the kernels inherit it: full-size configurations
    failed = []
    for path in resolve(argv):
        start = time.perf_counter()
        print(f"{path.name}: running", flush=True)
        try:
            nb = execute(path)
        except CellExecutionError as e:
            print(f"error: {path.name} raised; left unchanged\n{e}", file=sys.stderr, flush=True)
            failed.append(path.name)
            continue
        nbformat.write(nb, path)
        code = [c for c in nb.cells if c.cell_type == "code"]
        images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
        print(
            f"{path.name}: {time.perf_counter() - start:.0f} s, {len(code)} code cells, "
            f"{images} images, {path.stat().st_size / 1024:.0f} KiB",
            flush=True,
        )
    if failed:
        print(f"error: notebooks that raised: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
