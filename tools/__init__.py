"""Developer tools kept apart from the library and the benchmarks.

- :mod:`tools.jax_scan_tests`: runs JAX's own ``lax.scan`` tests against ``jaxmem.scan``.
- :mod:`tools.viewer_screenshot`: takes the memory viewer's screenshot for the docs.
"""
