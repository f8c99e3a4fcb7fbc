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


# Tests marked ``sampled`` (the random-body suites, parametrized by ``seed``, and the largest
# option-by-transformation matrices) run every case by default. For CI time, JAXMEM_SAMPLE_EVERY=k
# keeps one case in k (those of index 0 mod k: make test-compat, the oldest jax) and
# JAXMEM_SAMPLE_OTHERS=k the rest (.ci/run's make test, the newest jax), so that one CI run runs
# each case once, on one of the two versions. A seeded draw's index is its seed; another
# matrix's, its position in collection order (tests/scan/test_primitive.py orders its matrix so
# that every transformation runs on both). Named seeds (the known gaps, the fixed ones) are not
# marked and always run.
_SAMPLE_EVERY = int(os.environ.get("JAXMEM_SAMPLE_EVERY", "1"))
_SAMPLE_OTHERS = int(os.environ.get("JAXMEM_SAMPLE_OTHERS", "1"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "sampled: a random draw or a large matrix that JAXMEM_SAMPLE_EVERY=k thins to 1 case in k"
        " (JAXMEM_SAMPLE_OTHERS=k: to the others)",
    )


def pytest_collection_modifyitems(config, items):
    if _SAMPLE_EVERY <= 1 and _SAMPLE_OTHERS <= 1:
        return
    kept, dropped, position = [], [], {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not item.get_closest_marker("sampled"):
            kept.append(item)
            continue
        seed = callspec.params.get("seed")
        if isinstance(seed, int):
            index = seed
        else:
            name = item.nodeid.split("[")[0]
            index = position[name] = position.get(name, -1) + 1
        keep = index % _SAMPLE_EVERY == 0 and (_SAMPLE_OTHERS <= 1 or index % _SAMPLE_OTHERS != 0)
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
