"""Optional dependencies: imported where they are used, with an error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports ``module``, or raises an ImportError that says which jaxmem extra brings it.

    Args:
      module: the module to import, e.g. ``"matplotlib.figure"``.
      extra: the ``pip install 'jaxmem[extra]'`` that installs it.
      feature: what needs it, for the message (``"MemoryReport.plot"``).

    Returns:
      The module.

    Raises:
      ImportError: ``module`` cannot be imported.

    Examples:
      >>> require("numpy", "test", "this example").__name__
      'numpy'
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(
            f"{feature} needs {top}, which is not installed here: pip install 'jaxmem[{extra}]' "
            f"(or pip install {top})."
        ) from e
