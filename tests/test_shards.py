"""CI's split of the suite (conftest.py): the shards of JAXMEM_SHARD hold every collected test
once (a test marked ``both`` in each), a module whole in one unless its cases are ``sampled``,
``newest`` tests in shard 0; JAXMEM_DRAWS thins the seeded draws only. Checked on the collection
of modules that have each kind, in a fresh pytest per setting."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
# Sampled seeded draws, both, newest (the seeds found on jax 0.12), a sampled matrix, plain
# modules, and a script's test (newest).
MODULES = (
    "tests/scan/test_scan_memory.py",
    "tests/scan/test_primitive.py",
    "tests/test_byte_sizes.py",
    "tests/test_layout.py",
    "tests/benchmarks/test_losses_benchmark.py",
)


def _collect(**env) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAXMEM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", *MODULES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def collections():
    return {
        "all": _collect(),
        "0": _collect(JAXMEM_SHARD="0/2"),
        "1": _collect(JAXMEM_SHARD="1/2"),
        "draws": _collect(JAXMEM_DRAWS="4"),
    }


def test_the_shards_hold_every_test_once(collections):
    every, first, second = (collections[k] for k in ("all", "0", "1"))
    assert len(set(every)) == len(every)
    assert set(first) | set(second) == set(every)
    both = set(first) & set(second)
    # The seeds found above on jax 0.10.2 too, marked both, and nothing else.
    assert both and all("test_random_body_once_above_stock_is_not[" in t for t in both)
    assert len(first) + len(second) == len(every) + len(both)


def test_modules_go_whole_and_sampled_cases_alternate(collections):
    first, second = set(collections["0"]), set(collections["1"])
    for module in ("tests/test_byte_sizes.py", "tests/test_layout.py"):
        ids = [t for t in collections["all"] if t.startswith(module)]
        assert ids and (set(ids) <= first or set(ids) <= second), module
    for test in (
        "tests/scan/test_scan_memory.py::test_random_body_is_not_above_stock",
        "tests/scan/test_primitive.py::test_transformation_matches_lax_scan",
    ):
        ids = [t for t in collections["all"] if t.startswith(test + "[")]
        on_first = [t in first for t in ids]
        assert on_first.count(True) in (len(ids) // 2, (len(ids) + 1) // 2), test
    # Newest: the script's test and the seeds found on jax 0.12 only are in shard 0.
    newest = [t for t in collections["all"] if "test_losses_benchmark" in t]
    assert newest and set(newest) <= first and not set(newest) & second


def test_draws_thin_the_seeded_draws_only(collections):
    every, thinned = collections["all"], collections["draws"]
    draw = "tests/scan/test_scan_memory.py::test_random_body_is_not_above_stock["
    seeds = [int(t[len(draw) : -1]) for t in thinned if t.startswith(draw)]
    assert seeds and all(s % 4 == 0 for s in seeds)
    assert len(seeds) == len([t for t in every if t.startswith(draw)]) // 4
    others = [t for t in every if not t.startswith(draw)]
    assert set(others) <= set(thinned)
