"""Losses: the linear cross-entropy (chunked over the vocabulary and tokens; vocabulary-parallel
on a mesh)."""
