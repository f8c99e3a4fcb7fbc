"""Flax integration: :mod:`jaxmem.flax.linen` and :mod:`jaxmem.flax.nnx`.

Layer stacks scanned by :func:`jaxmem.scan` (``scan_layers``) and remat with jaxmem policies
(``remat``), for linen and NNX modules. Flax is an optional dependency of jaxmem:
``pip install jaxmem[flax]``.

Examples:
  >>> from jaxmem.flax import linen, nnx
  >>> sorted(linen.__all__), sorted(nnx.__all__)
  (['remat', 'scan_layers'], ['ScanLayers', 'remat', 'scan_layers'])
"""

try:
    import flax as _flax  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"jaxmem.flax needs Flax, an optional dependency: pip install 'jaxmem[flax]' ({e})"
    ) from e

from jaxmem.flax import linen as linen
from jaxmem.flax import nnx as nnx

__all__ = [
    "linen",
    "nnx",
]
