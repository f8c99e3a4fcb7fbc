"""Strict test environment for the whole suite (tests/, doctests in jaxmem/ and README.md).

Set before jax is imported anywhere: several fake CPU devices, so sharding-aware code is
exercised, and rank promotion raises, so broadcasting bugs surface.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
