"""Benchmarks of jaxmem against stock JAX: ``python -m benchmarks.run --help``."""
