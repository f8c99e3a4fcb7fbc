"""Flax integration: :mod:`jaxmem.flax.linen` and :mod:`jaxmem.flax.nnx`.

Layer stacks scanned by :func:`jaxmem.scan` (``scan_layers``) and remat with jaxmem policies
(``remat``), for linen and NNX modules.

Examples:
  >>> from jaxmem.flax import linen, nnx
  >>> sorted(linen.__all__), sorted(nnx.__all__)
  (['remat', 'scan_layers'], ['ScanLayers', 'remat', 'scan_layers'])
"""

from jaxmem.flax import linen as linen
from jaxmem.flax import nnx as nnx

__all__ = [
    "linen",
    "nnx",
]
