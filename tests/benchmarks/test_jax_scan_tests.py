"""tools.jax_scan_tests: the patch of JAX's test file and the reading of pytest's output.

Running JAX's tests needs JAX's repository (its test file is not on PyPI); the README gives the
count measured with it. Here: the list of scan implementations is replaced, whatever it holds,
and a file without it is refused (a JAX that moved it would otherwise run lax.scan's tests).
"""

from __future__ import annotations

import pytest

from tools import jax_scan_tests as harness

SAMPLE = """import x

SCAN_IMPLS_WITH_FOR = [
    (lax.scan, 'unroll1'),
    (partial(lax.scan, unroll=2), 'unroll2'),
]

def test(): pass
"""


def test_patch_replaces_the_scan_implementations():
    out = harness.patch(SAMPLE)
    assert "lax.scan, 'unroll1'" not in out
    assert '(_jaxmem.scan, "jaxmemscan")' in out
    assert '(partial(_jaxmem.scan, unroll=2), "jaxmemscan_unroll2")' in out
    assert out.startswith("import x\n") and out.endswith("def test(): pass\n")
    compile(out, "patched", "exec")


def test_patch_refuses_a_file_without_the_list():
    with pytest.raises(ValueError, match="SCAN_IMPLS_WITH_FOR"):
        harness.patch("SCAN_IMPLS = []\n")


def test_parse_counts_and_lists_failures():
    output = (
        "FAILED a.py::T::testScanJVP_impl=jaxmemscan - TypeError: can't apply\n"
        "FAILED a.py::T::testScanLinearize_impl=jaxmemscan\n"
        "2 failed, 128 passed in 3.2s\n"
    )
    passed, failed, failures = harness.parse(output)
    assert (passed, failed) == (128, 2)
    assert failures[0] == "a.py::T::testScanJVP_impl=jaxmemscan - TypeError: can't apply"
    assert failures[1].startswith("a.py::T::testScanLinearize_impl=jaxmemscan")
