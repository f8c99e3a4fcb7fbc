"""Reversible layer stacks: couplings whose inputs are recomputed from their outputs in the
backward pass, so that no layer's activations are saved."""
