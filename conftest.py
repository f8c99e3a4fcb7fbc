"""Strict test environment for the whole suite (tests/; doctests in src/jaxmem/, README.md,
docs/).

Set before jax is imported anywhere: several fake CPU devices, so sharding-aware code is
exercised, and rank promotion raises, so broadcasting bugs surface. Under CI (``CI`` set) LLVM
does not optimize the compiled code (XLA's own passes and buffer assignment still run, so
memory figures are those of a default compile, and values too, but for the XLA:CPU of jax
0.10.2, which miscompiles some ``lax.scan`` gradients at this level: see ``CHAIN_COMPILE`` in
tests/scan/test_scan_random.py): the suite is dominated by compile time, about a fifth of which
this saves. Subprocesses and notebook kernels inherit the flags.
"""

import atexit
import os
import shutil
import tempfile
import zlib

_FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("CI"):
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
os.environ.setdefault("MPLBACKEND", "Agg")

# Under CI the suite compiles many programs more than once (a reference in several tests, the
# same step in several modes): JAX's persistent compilation cache, new for each run, serves the
# repeats (tests/scan/test_primitive.py 109 s -> 85 s; the whole suite 4.5% faster on jax 0.12,
# 9% on 0.10.2, on 2 cores). One directory per process of the run (each xdist
# worker; the subprocesses and notebook kernels a test starts inherit it), so that no two
# processes write and read an entry at once. Executables from the cache report the same
# memory_analysis; jaxmem's buffer reader compiles past it (it needs XLA's dump).
_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "main")
_CACHE = None
if os.environ.get("CI") and os.environ.get("_JAXMEM_TEST_CACHE_OF") != _PROCESS:
    _CACHE = tempfile.mkdtemp(prefix=f"jaxmem-tests-jax-cache-{_PROCESS}-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["_JAXMEM_TEST_CACHE_OF"] = _PROCESS
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if _CACHE is not None:  # also where a plugin imported jax before the variables were set
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# CI runs the suite on two set-ups, the newest jax and the oldest (.ci/run), and for CI time
# runs each test once, on one of them: JAXMEM_SHARD=i/n keeps the tests of shard i of n (unset:
# all). A test module goes whole to the shard its path hashes to, so that what its tests share
# (module fixtures, cached references) is built once. The cases of a test marked ``sampled`` (the
# random-body draws and the largest option-by-transformation matrices, whose cases share
# nothing) alternate between the shards instead, each by its position in collection order (a
# seeded draw by its seed), so that they run on both versions. Tests marked ``newest`` (the
# notebooks' and the demo and benchmark scripts', which make test-compat does not collect) go to
# shard 0, the newest set-up's; tests marked ``both`` (regressions found on one version, kept on
# each) to every shard.
#
# JAXMEM_DRAWS=k keeps one in k of the seeded draws of the tests marked ``sampled`` (index 0 mod
# k; unset: all), before the shards are drawn, and of the examples of the hypothesis searches
# (tests/helpers.draws). Named seeds (the known gaps, the fixed ones) are not marked.
def _fraction(name, default):
    text = os.environ.get(name, default)
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected i/n, e.g. 0/2") from None
    if not 0 <= i < n:
        raise ValueError(f"{name}={text!r}: i must be in [0, n)")
    return i, n


_SHARD, _SHARDS = _fraction("JAXMEM_SHARD", "0/1")
from tests.helpers import DRAWS as _DRAWS  # noqa: E402  (after jax's set-up above)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "sampled: cases that alternate between the shards of JAXMEM_SHARD (seeded draws:"
        " JAXMEM_DRAWS=k keeps 1 in k)",
    )
    config.addinivalue_line("markers", "both: runs in every shard of JAXMEM_SHARD")
    config.addinivalue_line(
        "markers",
        "newest: runs on the newest set-up only (make test-compat deselects it; shard 0 of"
        " JAXMEM_SHARD)",
    )


def _shard_of(item, index):
    if item.get_closest_marker("newest") or item.nodeid.endswith(".ipynb"):
        return 0
    if index is not None:
        name = item.nodeid.split("[")[0]
        return (zlib.crc32(name.encode()) + index) % _SHARDS
    return zlib.crc32(item.nodeid.split("::")[0].encode()) % _SHARDS


def pytest_collection_modifyitems(config, items):
    if _SHARDS <= 1 and _DRAWS <= 1:
        return
    kept, dropped, position = [], [], {}
    for item in items:
        index, draw = None, False
        if item.get_closest_marker("sampled") and hasattr(item, "callspec"):
            seed = item.callspec.params.get("seed")
            name = item.nodeid.split("[")[0]
            position[name] = position.get(name, -1) + 1
            draw = isinstance(seed, int)
            index = seed if draw else position[name]
        if draw:
            if index % _DRAWS:
                dropped.append(item)
                continue
            index //= _DRAWS
        both = item.get_closest_marker("both") is not None
        (kept if both or _shard_of(item, index) == _SHARD else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
