"""jaxmem for Flax linen: :func:`scan_layers` (``nn.scan`` on :func:`jaxmem.scan`), :func:`remat`.

Examples:
  >>> from jaxmem.flax import linen as jl
  >>> jl.__all__
  ['remat', 'scan_layers']
"""

from jaxmem._src.flax_linen import remat as remat
from jaxmem._src.flax_linen import scan_layers as scan_layers

__all__ = [
    "remat",
    "scan_layers",
]
