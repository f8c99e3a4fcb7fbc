"""jaxmem for Flax NNX: :func:`scan` (``nnx.scan`` run by :func:`jaxmem.scan`), :func:`scan_layers`
(layer stacks), :func:`reversible_layers` (RevNet stacks on :func:`jaxmem.reversible_scan`) and
:func:`remat`.

Examples:
  >>> from jaxmem.flax import nnx as jn
  >>> jn.__all__
  ['ReversibleLayers', 'ScanLayers', 'remat', 'reversible_layers', 'scan', 'scan_layers']
"""

from jaxmem._src.flax.nnx import ScanLayers as ScanLayers
from jaxmem._src.flax.nnx import remat as remat
from jaxmem._src.flax.nnx import scan as scan
from jaxmem._src.flax.nnx import scan_layers as scan_layers
from jaxmem._src.flax.nnx_reversible import ReversibleLayers as ReversibleLayers
from jaxmem._src.flax.nnx_reversible import reversible_layers as reversible_layers

__all__ = [
    "ReversibleLayers",
    "ScanLayers",
    "remat",
    "reversible_layers",
    "scan",
    "scan_layers",
]
