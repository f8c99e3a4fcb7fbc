"""Flax's own ``nn.scan`` tests, run with :func:`jaxmem.flax.linen.scan` in place of ``nn.scan``.

The cases are vendored verbatim from Flax 0.12.12 (Apache License 2.0; see the headers of
``tests/flax/flax_upstream/linen_*.py``): every test in ``tests/linen/linen_transforms_test.py``,
``linen_meta_test.py``, ``linen_recurrent_test.py`` and ``summary_test.py`` that uses ``nn.scan``
(directly, or through ``nn.RNN``/``nn.Bidirectional``, which call ``flax.linen.transforms.scan``),
plus the examples of ``nn.scan``'s own docstring (read from the installed Flax). A fixture replaces
``flax.linen.scan`` and ``flax.linen.transforms.scan`` by jaxmem's scan and each case checks that
jaxmem's scan was really used. Cases a custom VJP cannot run are listed in ``EXCLUDED`` with the
reason; :func:`test_pass_rate` prints the counts and asserts the goal (>= 95% of the selection).
"""

import doctest
import unittest

import flax.linen as nn
import flax.linen.transforms as linen_transforms
import jax
import pytest

from jaxmem.flax import linen as jl
from tests.flax.flax_upstream import (
    linen_meta_scan,
    linen_recurrent_scan,
    linen_summary_scan,
    linen_transforms_scan,
)

MODULES = (linen_transforms_scan, linen_meta_scan, linen_recurrent_scan, linen_summary_scan)
DOCSTRING = "flax.linen.scan docstring examples"
NN_SCAN_DOC = linen_transforms.scan.__doc__  # read before any patching

# Cases a custom VJP cannot run (forward-mode AD through the loop), with the reason. None of the
# selected cases differentiates through nn.scan in forward mode, so none is excluded.
EXCLUDED: dict[str, str] = {}


def _cases() -> dict[str, unittest.TestCase]:
    cases = {}

    def walk(suite):
        for t in suite:
            if isinstance(t, unittest.TestSuite):
                walk(t)
            else:
                mod = type(t).__module__.rsplit(".", 1)[-1]
                cases[f"{mod}::{type(t).__name__}.{t._testMethodName}"] = t

    loader = unittest.TestLoader()
    for mod in MODULES:
        walk(loader.loadTestsFromModule(mod))
    return cases


CASES = _cases()
SELECTED = [*CASES, DOCSTRING]


@pytest.fixture
def jaxmem_scan(monkeypatch):
    """Replaces nn.scan (and the scan nn.RNN calls) by jaxmem's; counts the calls."""
    calls = []

    def scan(*args, **kwargs):
        calls.append(1)
        return jl.scan(*args, **kwargs)

    monkeypatch.setattr(nn, "scan", scan)
    monkeypatch.setattr(linen_transforms, "scan", scan)
    # Flax's tests are written for JAX's default rank promotion, not jaxmem's strict setting.
    with jax.numpy_rank_promotion("allow"):
        yield calls


@pytest.mark.parametrize("name", SELECTED, ids=SELECTED)
def test_upstream(name, jaxmem_scan):
    if name in EXCLUDED:
        pytest.skip(EXCLUDED[name])
    if name == DOCSTRING:
        test = doctest.DocTestParser().get_doctest(NN_SCAN_DOC, {}, "nn.scan", None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test)
        assert result.attempted > 0 and result.failed == 0, result
    else:
        CASES[name].debug()
    assert jaxmem_scan, f"{name} never called nn.scan: it does not test jaxmem's scan"


def test_pass_rate():
    """The selection and the goal: every selected case but the excluded ones passes (above)."""
    selected, excluded = len(SELECTED), len(EXCLUDED)
    assert set(EXCLUDED) <= set(SELECTED)
    passing = selected - excluded
    print(
        f"\nflax linen upstream scan tests: selected {selected}, passing {passing}, "
        f"excluded {excluded}" + "".join(f"; {k} ({v})" for k, v in EXCLUDED.items())
    )
    assert passing / selected >= 0.95, "below the goal of 95% of the selection"
