"""Remat policies for ``jax.checkpoint(f, policy=...)`` and ``jaxmem.scan(..., policy=...)``.

Frozen dataclasses (hashable, equal by value, printable, static-argument safe): the presets
:data:`nothing`, :data:`everything`, :data:`dots`, :data:`dots_no_batch`; name-based
:func:`save`, :func:`offload`, :func:`custom` (MaxText's per-name map) and :func:`selective`
(Korthikanti et al. 2022); the combinator :func:`either` (``a | b``); and :func:`by_name` for
config files. Names come from the checkpoint-name vocabulary (``jaxmem.NAMES``, ``jaxmem.name``).

Examples:
  >>> import jaxmem.policies as policies
  >>> policies.selective() | policies.offload("decoder_layer_input")
  either(selective(), offload('decoder_layer_input'))
"""

from jaxmem._src.remat.custom import Custom as Custom
from jaxmem._src.remat.custom import custom as custom
from jaxmem._src.remat.planner import PRESETS as PRESETS
from jaxmem._src.remat.policies import ACTIONS as ACTIONS
from jaxmem._src.remat.policies import Dots as Dots
from jaxmem._src.remat.policies import Either as Either
from jaxmem._src.remat.policies import Everything as Everything
from jaxmem._src.remat.policies import Nothing as Nothing
from jaxmem._src.remat.policies import Offload as Offload
from jaxmem._src.remat.policies import OffloadFallbackWarning as OffloadFallbackWarning
from jaxmem._src.remat.policies import Policy as Policy
from jaxmem._src.remat.policies import Save as Save
from jaxmem._src.remat.policies import Selective as Selective
from jaxmem._src.remat.policies import dots as dots
from jaxmem._src.remat.policies import dots_no_batch as dots_no_batch
from jaxmem._src.remat.policies import either as either
from jaxmem._src.remat.policies import everything as everything
from jaxmem._src.remat.policies import nothing as nothing
from jaxmem._src.remat.policies import offload as offload
from jaxmem._src.remat.policies import save as save
from jaxmem._src.remat.policies import selective as selective
from jaxmem._src.remat.presets import by_name as by_name

__all__ = [
    "ACTIONS",
    "Custom",
    "Dots",
    "Either",
    "Everything",
    "Nothing",
    "Offload",
    "OffloadFallbackWarning",
    "PRESETS",
    "Policy",
    "Save",
    "Selective",
    "by_name",
    "custom",
    "dots",
    "dots_no_batch",
    "either",
    "everything",
    "nothing",
    "offload",
    "save",
    "selective",
]
