"""Models the benchmarks and tests run, kept apart from the measurement scripts.

- :mod:`benchmarks.models.gemma_block`: Flax's Gemma decoder block (vendored from Flax 0.12.12's
  ``examples/gemma``; Apache License 2.0, ``LICENSE-flax``).
- :mod:`benchmarks.models.lm1b_model`: Flax's lm1b decoder layer (vendored from Flax 0.12.12's
  ``examples/lm1b``; Apache License 2.0, ``LICENSE-flax``).
- :mod:`benchmarks.models.heldout_gpt`: an NNX GPT written apart from the planner (RMSNorm,
  separate q/k/v, RoPE, SwiGLU), the planner's held-out model.

The jaxmem library never imports them.
"""
