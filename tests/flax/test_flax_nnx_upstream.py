"""Flax's own NNX scan tests, run with :func:`jaxmem.flax.nnx.scan` in place of ``nnx.scan``.

``tests/flax/flax_upstream/nnx_transforms_scan.py`` vendors, verbatim, every test method of Flax's
``tests/nnx/transforms_test.py`` that uses ``nnx.scan`` (74 methods; the same in Flax 0.12.8 and
0.12.12). Here ``flax.nnx.scan`` is monkeypatched to jaxmem's scan for the run, so the vendored
code stays as Flax wrote it; a count of the calls that reached :func:`jaxmem.scan` shows the
substitution took effect. Exclusions would be tests that need forward-mode AD through the scan
(a custom VJP cannot do it): none of the selected tests does, so none is excluded.
"""

import ast
import collections
import inspect
import unittest

import jax
import pytest
from flax import nnx

import jaxmem._src.scan.api as scan_module
from jaxmem.flax import nnx as jn
from tests.flax.flax_upstream import nnx_transforms_scan as upstream

# (class, method) -> why it cannot run on a custom VJP. Empty: no selected test uses forward mode.
EXCLUDED: dict[tuple[str, str], str] = {}
CLASSES = (upstream.TestScan, upstream.TestRemat, upstream.TestBoundMethodTransforms)
N_METHODS = 74  # Flax's nnx.scan test methods (issue 11).


def _selected_methods() -> list[tuple[str, str]]:
    """(class, method) of every vendored test method that uses nnx.scan, read from the source
    (absl's parameterized classes hold the expanded cases, not the methods)."""
    source = inspect.getsource(upstream)
    return [
        (node.name, fn.name)
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef)
        for fn in node.body
        if isinstance(fn, ast.FunctionDef)
        and fn.name.startswith("test")
        and "nnx.scan" in ast.get_source_segment(source, fn)
    ]


def _method_of(test: unittest.TestCase, selected) -> str | None:
    """The selected method a test case runs (absl names parameterized cases ``method<i>``)."""
    cls_name, case = type(test).__name__, test._testMethodName
    found = [m for c, m in selected if c == cls_name and case.startswith(m)]
    return max(found, key=len, default=None)


_selected = _selected_methods()


@pytest.fixture
def jaxmem_as_nnx_scan(monkeypatch):
    """``nnx.scan`` is jaxmem's for the test; counts the loops :func:`jaxmem.scan` ran (every
    jaxmem loop runs through ``run_with``, the Flax layers' with their options whole)."""
    calls = collections.Counter()
    real_loop = scan_module.run_with

    def counting_loop(*args, **kwargs):
        calls["jaxmem.scan"] += 1
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(nnx, "scan", jn.scan)
    monkeypatch.setattr(scan_module, "run_with", counting_loop)
    return calls


def test_flax_nnx_scan_tests_pass_with_jaxmem_scan(jaxmem_as_nnx_scan):
    assert len(_selected) == N_METHODS, _selected
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for cls in CLASSES:
        for test in loader.loadTestsFromTestCase(cls):
            method = _method_of(test, _selected)
            if method is not None and (type(test).__name__, method) not in EXCLUDED:
                suite.addTest(test)
    result = unittest.TestResult()
    with jax.numpy_rank_promotion("allow"):  # Flax's tests run with JAX's default.
        suite.run(result)
    failed = [(str(t), tb) for t, tb in result.failures + result.errors]
    n_cases, n_pass = result.testsRun, result.testsRun - len(failed) - len(result.skipped)
    print(
        f"flax nnx.scan tests with jaxmem.flax.nnx.scan: {len(_selected)} methods selected, "
        f"{len(EXCLUDED)} excluded, {n_cases} cases run, {n_pass} passed, "
        f"{len(result.skipped)} skipped; jaxmem.scan ran {jaxmem_as_nnx_scan['jaxmem.scan']} loops"
    )
    assert jaxmem_as_nnx_scan["jaxmem.scan"] > 0, "nnx.scan was not replaced by jaxmem's scan"
    assert not failed, "\n\n".join(f"{name}\n{tb}" for name, tb in failed)
    assert n_pass >= 0.95 * n_cases
