"""jaxmem for Flax NNX: :func:`scan` (``nnx.scan`` run by :func:`jaxmem.scan`), :func:`scan_layers`
(layer stacks) and :func:`remat`.

Examples:
  >>> from jaxmem.flax import nnx as jn
  >>> jn.__all__
  ['ScanLayers', 'remat', 'scan', 'scan_layers']
"""

from jaxmem._src.flax_nnx import ScanLayers as ScanLayers
from jaxmem._src.flax_nnx import remat as remat
from jaxmem._src.flax_nnx import scan as scan
from jaxmem._src.flax_nnx import scan_layers as scan_layers

__all__ = [
    "ScanLayers",
    "remat",
    "scan",
    "scan_layers",
]
