"""JAX's own scan tests with :func:`jaxmem.scan` as the scan implementation.

JAX's ``tests/lax_control_flow_test.py`` parameterizes its scan tests over ``SCAN_IMPLS_WITH_FOR``
(``lax.scan`` with several unrolls and under ``jax.checkpoint``). This script copies that file,
replaces the list by ``jaxmem.scan`` plain and with ``unroll=2``, runs those tests with pytest
and prints the count, each failure with the last line of its error. Forward mode (every JVP and
Linearize test) is included.

The test file is not on PyPI (JAX's sdist ships no tests): pass a checkout of JAX's repository
or the file itself. The result was recorded against JAX's main branch at the commit below.

Usage::

    python -m tools.jax_scan_tests PATH/TO/jax [--commit cec06d11...] [-n 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# JAX's main branch of 2026-08-08, where the figures in the docs were measured.
PINNED_COMMIT = "cec06d116c05f0d52adfceee3d3b730fdbcb0ce5"
TEST_PATH = "tests/lax_control_flow_test.py"

IMPLS = """import jaxmem as _jaxmem

SCAN_IMPLS_WITH_FOR = [
    (_jaxmem.scan, "jaxmemscan"),
    (partial(_jaxmem.scan, unroll=2), "jaxmemscan_unroll2"),
]
"""


def read_test_file(source: Path, commit: str | None) -> str:
    """The test file's text: ``source`` itself, or ``TEST_PATH`` in the checkout ``source`` (at
    ``commit`` when given, read with git)."""
    if source.is_file():
        return source.read_text()
    if commit:
        return subprocess.run(
            ["git", "-C", str(source), "show", f"{commit}:{TEST_PATH}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return (source / TEST_PATH).read_text()


def patch(text: str) -> str:
    """``text`` with its ``SCAN_IMPLS_WITH_FOR`` list replaced by jaxmem's implementations."""
    pattern = re.compile(r"^SCAN_IMPLS_WITH_FOR = \[\n(?:.*\n)*?\]\n", re.MULTILINE)
    if not pattern.search(text):
        raise ValueError("no SCAN_IMPLS_WITH_FOR list in the test file: has it moved?")
    return pattern.sub(IMPLS, text, count=1)


def parse(output: str) -> tuple[int, int, list[str]]:
    """(passed, failed, failed test ids) from pytest's ``-rf`` output."""
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", output)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", output)) else 0
    failures = re.findall(r"^FAILED (\S+)(?: - (.*))?$", output, re.MULTILINE)
    return passed, failed, [f"{name} - {why}" for name, why in failures]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a JAX checkout, or lax_control_flow_test.py")
    parser.add_argument("--commit", default=PINNED_COMMIT, help="git commit of the checkout")
    parser.add_argument("-n", default="2", help="pytest-xdist workers")
    args = parser.parse_args(argv)
    commit = None if args.source.is_file() else args.commit
    text = patch(read_test_file(args.source, commit))
    with tempfile.TemporaryDirectory() as tmp:
        # The copy's path must not contain "jaxmemscan": -k also matches the module's path.
        path = Path(tmp) / "lax_control_flow_test.py"
        path.write_text(text)
        cmd = [
            sys.executable, "-m", "pytest", str(path), "-q", "-rf", "-p", "no:cacheprovider",
            "-k", "jaxmemscan", "-n", args.n, "--rootdir", tmp,
            "-W", "ignore::DeprecationWarning",
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    import jax

    passed, failed, failures = parse(run.stdout + run.stderr)
    total = passed + failed
    print(f"jax {jax.__version__}, test file at {commit or args.source}")
    print(f"{passed}/{total} passed ({100 * passed / max(total, 1):.1f}%)")
    for line in failures:
        print("  FAILED", line)
    if total == 0:
        print(run.stdout[-3000:], run.stderr[-3000:])
        return 1
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
