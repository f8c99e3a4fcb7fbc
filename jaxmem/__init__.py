"""jaxmem: make JAX training fit in less accelerator memory at (nearly) the same speed.

The public face of the package. Implementation lives in :mod:`jaxmem._src`.
"""

from jaxmem._src.profile import Comparison as Comparison
from jaxmem._src.profile import MemoryReport as MemoryReport
from jaxmem._src.profile import Residual as Residual
from jaxmem._src.profile import compare as compare
from jaxmem._src.profile import profile as profile

__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "MemoryReport",
    "Residual",
    "compare",
    "profile",
]
