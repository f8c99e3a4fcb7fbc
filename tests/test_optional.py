"""Optional dependencies: without matplotlib, jaxmem imports and works; each plot says which
extra to install (in a fresh interpreter where matplotlib cannot be imported)."""

import subprocess
import sys

import pytest

from jaxmem._src import optional

WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib... raises ImportError, as if not installed
import jax.numpy as jnp
import jaxmem
from jaxmem._src.remat.frontier import Frontier, FrontierPoint

def loss(w):
    return jnp.sum(jnp.tanh(w) ** 2)

report = jaxmem.profile(loss, jnp.ones(8))
comparison = jaxmem.compare({"a": loss, "b": loss}, jnp.ones(8))
frontier = Frontier((FrontierPoint("no remat", "no remat", 8, 0.0),), (), None, 1.0, 1, 0.0)
assert report.temp_bytes >= 0  # the rest of jaxmem works
calls = {
    "MemoryReport.plot": lambda: report.plot("unused.png"),
    "Comparison.plot": lambda: comparison.plot("unused.png"),
    "Frontier.plot": lambda: frontier.plot(),
}
for feature, call in calls.items():
    try:
        call()
    except ImportError as e:
        print(feature, "|", e)
    else:
        print(feature, "| no error")
"""


def test_plots_without_matplotlib_name_the_extra():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" | ", 1) for line in result.stdout.strip().splitlines())
    assert set(lines) == {"MemoryReport.plot", "Comparison.plot", "Frontier.plot"}
    for feature, message in lines.items():
        assert message.startswith(f"{feature} needs matplotlib"), message
        assert "pip install 'jaxmem[plot]'" in message


def test_require_imports_or_names_the_extra():
    assert optional.require("json", "test", "x").__name__ == "json"
    with pytest.raises(ImportError, match=r"f needs no_such_module_xyz.*jaxmem\[extra\]"):
        optional.require("no_such_module_xyz.sub", "extra", "f")
