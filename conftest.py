"""Strict test environment for the whole suite (tests/; doctests in src/jaxmem/, README.md,
docs/).

Set before jax is imported anywhere: several fake CPU devices, so sharding-aware code is
exercised, and rank promotion raises, so broadcasting bugs surface. Under CI (``CI`` set) LLVM
does not optimize the compiled code (XLA's own passes and buffer assignment still run, so
values and memory figures are those of a default compile): the suite is dominated by compile
time, about a fifth of which this saves. Subprocesses and notebook kernels inherit the flags.
"""

import os

_FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("CI"):
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
