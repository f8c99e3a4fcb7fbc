"""Demo and reference code built on jaxmem: not library API.

Nothing here is part of jaxmem's public interface, and the library (``jaxmem``, ``jaxmem._src``)
never imports this package. It holds what the demo, the benchmarks, the notebooks and the README
measure jaxmem on:

- :mod:`jaxmem.demo.models`: a small GPT-style Flax linen model whose layer stack runs through a
  pluggable scan (the reference model and its block, tagged with jaxmem's name vocabulary);
- :mod:`jaxmem.demo.korthikanti`: residual bytes per layer of that block under remat policies,
  against the formulas of Korthikanti et al. (2022);
- :mod:`jaxmem.demo.cli`: the memory demo, ``python -m jaxmem demo`` (or
  ``python -m jaxmem.demo``).

Copy from it freely; it may change without notice.
"""
