"""Flax integration: :mod:`jaxmem.flax.linen` and :mod:`jaxmem.flax.nnx`.

Drop-ins for ``nn.scan`` and ``nnx.scan`` whose loop is :func:`jaxmem.scan` (``scan``), layer
stacks built on them (``scan_layers``), reversible (RevNet) stacks on
:func:`jaxmem.reversible_scan` (``reversible_layers``) and remat with jaxmem policies
(``remat``), for linen and NNX modules. Flax is an optional dependency of jaxmem:
``pip install jaxmem[flax]``.

Examples:
  >>> from jaxmem.flax import linen, nnx
  >>> sorted(linen.__all__)
  ['remat', 'reversible_layers', 'scan', 'scan_layers']
  >>> sorted(nnx.__all__)
  ['ReversibleLayers', 'ScanLayers', 'remat', 'reversible_layers', 'scan', 'scan_layers']
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
