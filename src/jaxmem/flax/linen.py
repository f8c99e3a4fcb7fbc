"""jaxmem for Flax linen: :func:`scan` (``nn.scan`` on :func:`jaxmem.scan`), :func:`scan_layers`
(its layer-stack form), :func:`reversible_layers` (a RevNet stack on
:func:`jaxmem.reversible_scan`) and :func:`remat`.

Examples:
  >>> from jaxmem.flax import linen as jl
  >>> jl.__all__
  ['remat', 'reversible_layers', 'scan', 'scan_layers']
"""

from jaxmem._src.flax.linen import remat as remat
from jaxmem._src.flax.linen import scan as scan
from jaxmem._src.flax.linen import scan_layers as scan_layers
from jaxmem._src.flax.linen_reversible import reversible_layers as reversible_layers

__all__ = [
    "remat",
    "reversible_layers",
    "scan",
    "scan_layers",
]
