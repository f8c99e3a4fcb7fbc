"""jaxmem: make JAX training fit in less accelerator memory at (nearly) the same speed.

The public face of the package. Implementation lives in :mod:`jaxmem._src`.
"""

from jaxmem import flax as flax
from jaxmem import losses as losses
from jaxmem import offload as offload
from jaxmem import policies as policies
from jaxmem._src.names import NAMES as NAMES
from jaxmem._src.names import name as name
from jaxmem._src.profile import Comparison as Comparison
from jaxmem._src.profile import MemoryReport as MemoryReport
from jaxmem._src.profile import ProfileError as ProfileError
from jaxmem._src.profile import Residual as Residual
from jaxmem._src.profile import compare as compare
from jaxmem._src.profile import profile as profile
from jaxmem._src.residuals import PlannedResidual as PlannedResidual
from jaxmem._src.residuals import ScanPlan as ScanPlan
from jaxmem._src.scan import ForwardModeError as ForwardModeError
from jaxmem._src.scan import scan as scan
from jaxmem._src.scan import scan_residuals as scan_residuals
from jaxmem._src.scan import scanned as scanned
from jaxmem._src.trainable import merge as merge
from jaxmem._src.trainable import trainable as trainable

__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "ForwardModeError",
    "MemoryReport",
    "NAMES",
    "PlannedResidual",
    "ProfileError",
    "Residual",
    "ScanPlan",
    "compare",
    "flax",
    "losses",
    "merge",
    "name",
    "offload",
    "policies",
    "profile",
    "scan",
    "scan_residuals",
    "scanned",
    "trainable",
]
