"""Automatic chunking: row-wise tails of a loss found in its jaxpr and run in chunks (by rows,
and by the columns of a shared weight) with a recomputing backward."""
