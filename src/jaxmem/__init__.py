"""jaxmem: make JAX training fit in less accelerator memory at (nearly) the same speed.

The public face of the package (the implementation is private). :mod:`jaxmem.flax`
is loaded on first use, so ``import jaxmem`` does not import Flax (an optional dependency:
``pip install jaxmem[flax]``).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from jaxmem import losses as losses
from jaxmem import offload as offload
from jaxmem import policies as policies
from jaxmem._src.attention.api import attention as attention
from jaxmem._src.chunking.autochunk import AutoChunked as AutoChunked
from jaxmem._src.chunking.autochunk import ChunkedTail as ChunkedTail
from jaxmem._src.chunking.autochunk import ChunkReport as ChunkReport
from jaxmem._src.chunking.autochunk import autochunk as autochunk
from jaxmem._src.chunking.chunked import chunked as chunked
from jaxmem._src.lint.api import lint as lint
from jaxmem._src.optimize.api import Explanation as Explanation
from jaxmem._src.optimize.api import Optimized as Optimized
from jaxmem._src.optimize.api import ScanReport as ScanReport
from jaxmem._src.optimize.api import optimize as optimize
from jaxmem._src.optimize.budget import BudgetPlan as BudgetPlan
from jaxmem._src.optimize.budget import BudgetTrial as BudgetTrial
from jaxmem._src.optimize.budget import clear_caches as clear_caches
from jaxmem._src.optimize.budget import peak_bytes as peak_bytes
from jaxmem._src.optimize.planning import plan as plan
from jaxmem._src.profile.buffers import Buffer as Buffer
from jaxmem._src.profile.buffers import BufferDumpError as BufferDumpError
from jaxmem._src.profile.buffers import BufferGroup as BufferGroup
from jaxmem._src.profile.buffers import BufferReport as BufferReport
from jaxmem._src.profile.compare import Comparison as Comparison
from jaxmem._src.profile.compare import compare as compare
from jaxmem._src.profile.diff import DiffRow as DiffRow
from jaxmem._src.profile.diff import PeakDiff as PeakDiff
from jaxmem._src.profile.report import MemoryReport as MemoryReport
from jaxmem._src.profile.report import ProfileError as ProfileError
from jaxmem._src.profile.report import Residual as Residual
from jaxmem._src.profile.report import profile as profile
from jaxmem._src.profile.report import residuals_of as residuals
from jaxmem._src.remat.frontier import Frontier as Frontier
from jaxmem._src.remat.frontier import frontier as frontier
from jaxmem._src.remat.names import NAMES as NAMES
from jaxmem._src.remat.names import name as name
from jaxmem._src.remat.remat_plan import RematPlan as RematPlan
from jaxmem._src.remat.remat_plan import use_plan as use_plan
from jaxmem._src.reversible.stack import Coupling as Coupling
from jaxmem._src.reversible.stack import reversible as reversible
from jaxmem._src.reversible.stack import reversible_scan as reversible_scan
from jaxmem._src.scan.api import ForwardModeError as ForwardModeError
from jaxmem._src.scan.api import scan as scan
from jaxmem._src.scan.api import scan_residuals as scan_residuals
from jaxmem._src.scan.api import scanned as scanned
from jaxmem._src.scan.findings import Finding as Finding
from jaxmem._src.scan.findings import LintWarning as LintWarning
from jaxmem._src.scan.hooks import StepCounter as StepCounter
from jaxmem._src.scan.hooks import step_counter as step_counter
from jaxmem._src.scan.schedule import CheckpointSchedule as CheckpointSchedule
from jaxmem._src.scan.summary import PlannedResidual as PlannedResidual
from jaxmem._src.scan.summary import ScanResiduals as ScanResiduals
from jaxmem._src.trainable import merge as merge
from jaxmem._src.trainable import trainable as trainable

if _TYPE_CHECKING:
    from jaxmem import flax as flax

__version__ = "0.1.0"

__all__ = [
    "AutoChunked",
    "BudgetPlan",
    "BudgetTrial",
    "Buffer",
    "BufferDumpError",
    "BufferGroup",
    "BufferReport",
    "CheckpointSchedule",
    "ChunkReport",
    "ChunkedTail",
    "Comparison",
    "Coupling",
    "DiffRow",
    "Explanation",
    "Finding",
    "ForwardModeError",
    "Frontier",
    "LintWarning",
    "MemoryReport",
    "NAMES",
    "Optimized",
    "PeakDiff",
    "PlannedResidual",
    "ProfileError",
    "RematPlan",
    "Residual",
    "ScanReport",
    "ScanResiduals",
    "StepCounter",
    "attention",
    "autochunk",
    "chunked",
    "clear_caches",
    "compare",
    "flax",
    "frontier",
    "lint",
    "losses",
    "merge",
    "name",
    "offload",
    "optimize",
    "peak_bytes",
    "plan",
    "policies",
    "profile",
    "residuals",
    "reversible",
    "reversible_scan",
    "scan",
    "scan_residuals",
    "scanned",
    "step_counter",
    "trainable",
    "use_plan",
]


# Public names renamed when the plans were named by what they plan: the old spelling still
# resolves, with a DeprecationWarning naming the new one.
_RENAMED = {"Plan": "RematPlan", "ScanPlan": "ScanResiduals"}


def __getattr__(name):
    # Runs only for attributes not found otherwise: `jaxmem.flax` before its first import (the
    # import then binds it here, as any submodule), and the renamed names.
    if name == "flax":
        import importlib

        return importlib.import_module("jaxmem.flax")
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(
            f"jaxmem.{name} is deprecated; use jaxmem.{new} (the same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"flax"})
