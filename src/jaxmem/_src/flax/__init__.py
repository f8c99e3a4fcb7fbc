"""Flax integration: linen and NNX layer stacks, remat, reversible stacks."""
