"""Findings of :func:`jaxmem.lint`: memory settings that do nothing, where they were given.

A :class:`Finding` names the setting, what it fails to do and the user's source line
(:class:`Site`). The checks that can be decided while a program is traced run inside the entry
points that take the setting (``jaxmem.scan`` and what runs it: ``jaxmem.optimize``, the Flax
layers); they :func:`report` each finding, which warns with :class:`LintWarning` at the user's
line or, inside :func:`collecting` (what :func:`jaxmem.lint` does), collects it instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator

from jaxmem._src import jax_compat as _jc

KINDS = ("name_unmatched", "offload_noop", "stacked_params", "option_noop")
"""The kinds of finding: a checkpoint name that names nothing, an offload that moves nothing, a
scan returning its parameters as ys, and a jaxmem option that saves no memory."""


class LintWarning(UserWarning):
    """Warned where a jaxmem memory setting does nothing (a :class:`Finding` of
    :func:`jaxmem.lint` that can be decided while the program is traced).

    The warning's location is the user's line that gave the setting; its module, for filters,
    is ``jaxmem``. Silence it with ``warnings.simplefilter("ignore", jaxmem.LintWarning)``
    (or in a ``warnings.catch_warnings()`` block, for one call).

    Examples:
      >>> import warnings
      >>> issubclass(LintWarning, UserWarning)
      True
      >>> warnings.simplefilter("ignore", LintWarning)  # every jaxmem lint warning off
    """


@dataclasses.dataclass(frozen=True)
class Site:
    """A line of the user's source: ``file:line (function)``."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


@dataclasses.dataclass(frozen=True)
class Finding:
    """A memory setting that does nothing, found by :func:`jaxmem.lint`.

    Attributes:
      kind: one of ``"name_unmatched"``, ``"offload_noop"``, ``"stacked_params"``,
        ``"option_noop"``.
      message: one sentence, the subject first: what the setting fails to do, and what to do
        instead.
      where: the user's source line, ``file:line (function)``, of the call that gave the setting
        (a ``jaxmem.scan``, a ``jax.checkpoint``, a ``lax.scan``); ``"(unknown)"`` where no
        frame of the user's is known.
      subject: the setting or value it concerns (``"compress='int8'"``, ``"name 'mlp_in'"``,
        ``"ys[0]"``).

    Examples:
      >>> f = Finding("option_noop", "compress='int8' saves nothing", "loss.py:3 (loss)",
      ...             "compress='int8'")
      >>> print(f)
      loss.py:3 (loss): option_noop: compress='int8' saves nothing
    """

    kind: str
    message: str
    where: str
    subject: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: {self.message}"

    @property
    def key(self) -> tuple[str, str, str]:
        """What tells two findings apart: the same kind, line and subject are one finding."""
        return (self.kind, self.where, self.subject)


_OWN = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxmem/
# Libraries whose frames are never the user's line (where they are imported).
_LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "optax", "numpy")


def _excluded() -> tuple[str, ...]:
    dirs = [_OWN, sysconfig.get_paths()["stdlib"]]
    for name in _LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    return tuple(d + os.sep for d in dirs)


def _is_user_file(path: str, excluded: tuple[str, ...]) -> bool:
    return not os.path.abspath(path).startswith(excluded) if os.sep in path else True


def user_site() -> Site | None:
    """The innermost frame of the Python stack outside jaxmem, JAX, the libraries built on it
    (Flax, Equinox, Optax) and the standard library: the user's line that called in."""
    excluded = _excluded()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _is_user_file(code.co_filename, excluded):
            return Site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def eqn_site(eqn) -> Site | None:
    """The user's line that traced ``eqn`` (its source information), as :func:`user_site`."""
    excluded = _excluded()
    for frame in _jc.user_frames(eqn.source_info):
        if _is_user_file(frame.file_name, excluded):
            # JAX records a qualified name on Python 3.11+ ("f.<locals>.loss"): the last part,
            # as the Python stack gives it.
            return Site(frame.file_name, frame.start_line, frame.function_name.rsplit(".", 1)[-1])
    return None


# The lists of the collecting() blocks active in this context; empty: findings are warned.
_COLLECTORS: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "jaxmem_findings", default=()
)
# Python's "once per location" bookkeeping for the warnings (reset when the filters change).
_REGISTRY: dict = {}


@contextlib.contextmanager
def collecting() -> Iterator[list[Finding]]:
    """A block whose findings are collected into the list it yields instead of warned (by the
    innermost such block only)."""
    found: list[Finding] = []
    token = _COLLECTORS.set((*_COLLECTORS.get(), found))
    try:
        yield found
    finally:
        _COLLECTORS.reset(token)


def report(kind: str, subject: str, message: str, site: Site | str | None) -> None:
    """Reports a finding at ``site`` (a :class:`Site`, or one as text): collected where
    :func:`collecting` is active, else warned as a :class:`LintWarning` located at the user's
    line."""
    assert kind in KINDS, kind
    message = f"{subject} {message}" if subject else message  # one sentence, the subject first
    finding = Finding(kind, message, str(site) if site else "(unknown)", subject)
    collectors = _COLLECTORS.get()
    if collectors:
        collectors[-1].append(finding)
        return
    text = f"{kind}: {message}"
    text += " (silence with warnings.simplefilter('ignore', jaxmem.LintWarning))"
    filename, lineno = (site.file, site.line) if isinstance(site, Site) else ("jaxmem", 0)
    warnings.warn_explicit(
        text, LintWarning, filename, lineno, module="jaxmem.lint", registry=_REGISTRY
    )


def unique(findings) -> tuple[Finding, ...]:
    """``findings`` without repeats (the same :attr:`Finding.key`), in order."""
    out: dict = {}
    for f in findings:
        out.setdefault(f.key, f)
    return tuple(out.values())
