"""The options of jaxmem's loops: one frozen :class:`ScanOptions` validated once with the API's
name, and the checks it is made of (also used where an entry point checks an option early)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat import presets as _presets
from jaxmem._src.scan import compress as _compress
from jaxmem._src.scan import schedule as _schedule


@dataclasses.dataclass(frozen=True)
class ScanOptions:
    """The options of a jaxmem loop (a scan, a Flax layer stack, a reversible stack), checked.

    Attributes:
      fname: the API's name, for error messages (``"jaxmem.flax.nnx.scan"``).
      policy: the remat policy: None, a policy (a preset name resolved to it), or ``"auto"``
        (resolved when the step is traced).
      offload: None, one of :data:`OFFLOAD_MODES`, or a frozenset of checkpoint names.
      recompute: one of :data:`RECOMPUTE_MODES`.
      unroll: a bool or a non-negative int.
      checkpoints: None (the lean VJP), a positive int (the most carries stored) or ``"sqrt"``,
        as given: resolved against the length (``"sqrt"``, a count above it clamped) when the
        loop runs (:func:`check_checkpoints`).
      compress: None or one of :data:`COMPRESS_FORMATS`: the format the kept float values are
        stored in between the forward and the backward pass (docs/compress.md).
      own_remat: the step runs under the policy's ``jax.checkpoint`` (set by :meth:`for_step`
        when a loop is traced: what its remat recomputes from loop invariants is then kept in
        the backward loop, as under ``prevent_cse=True``).
      site: the user's line that called the loop (a :class:`jaxmem._src.findings.Site`, set
        by :func:`~jaxmem._src.scan.api.run_with`), where its findings are reported; None:
        a loop of jaxmem's own, or one not to report (a plan made only to compare).

    The options travel whole from the entry point to the loop's rules; :meth:`for_step` is
    the one place the policy is applied, ``"auto"`` resolved against the active plan.

    Examples:
      >>> opts = ScanOptions.create("jaxmem.scan", offload=("mlp_in",), unroll=2)
      >>> opts.offload, opts.recompute, opts.unroll
      (frozenset({'mlp_in'}), 'auto', 2)
      >>> ScanOptions.create("jaxmem.scan", recompute="some")
      Traceback (most recent call last):
      ...
      ValueError: jaxmem.scan got recompute='some'; expected one of 'auto', 'cheap', 'none'.
      >>> ScanOptions.create("jaxmem.scan", compress="fp4")
      Traceback (most recent call last):
      ...
      ValueError: jaxmem.scan got compress='fp4'; expected None or one of 'bf16', 'fp8', 'int8'.
    """

    fname: str
    policy: Any = None
    offload: Any = None
    recompute: str = "auto"
    unroll: int | bool = 1
    checkpoints: int | str | None = None
    compress: str | None = None
    own_remat: bool = False
    site: Any = None

    @classmethod
    def create(
        cls,
        fname: str,
        *,
        policy: Any = None,
        offload: Any = None,
        recompute: str = "auto",
        unroll: int | bool = 1,
        checkpoints: int | str | None = None,
        compress: str | None = None,
    ) -> ScanOptions:
        """Checks every option (in this order: policy, offload, recompute, unroll, checkpoints
        with its offload, compress with its checkpoints), naming ``fname`` in the errors."""
        offload = check_offload(offload, fname)
        opts = cls(
            fname=fname,
            policy=_presets.resolve(policy, fname),
            offload=offload,
            recompute=check_recompute(recompute, fname),
            unroll=check_unroll(unroll, fname),
            checkpoints=checkpoints,
            compress=check_compress(compress, fname),
        )
        # A bad value fails the same way for every length; the count is resolved when it is known.
        check_checkpoints(checkpoints, offload, 1, fname)
        if compress is not None and checkpoints is not None:
            raise ValueError(
                f"{fname} got compress={compress!r} with checkpoints={checkpoints!r}: compress "
                "encodes the values the lean VJP stacks, and a checkpointed scan stacks only its "
                "checkpointed carries; use one or the other."
            )
        return opts

    def for_step(self, f) -> tuple[Any, ScanOptions]:
        """The step as the loop runs it, and the options it runs with.

        The step is put under ``jax.checkpoint(policy=...)`` where there is a policy
        (``"auto"``: the active :func:`jaxmem.use_plan`'s, resolved now, at trace time, with
        its ``checkpoints`` where these options give none).
        """
        checkpoints = _auto.resolve_checkpoints(self.policy, self.checkpoints)
        stepped = apply_policy(f, self.policy, self.fname)
        opts = dataclasses.replace(self, checkpoints=checkpoints, own_remat=stepped is not f)
        return stepped, opts

    def with_unroll(self, unroll) -> ScanOptions:
        """These options with ``unroll`` (checked), as a library's loop passes it on (Flax's
        scans do); themselves where it is the same (``True`` and ``1`` differ)."""
        if (unroll, type(unroll)) == (self.unroll, type(self.unroll)):
            return self
        return dataclasses.replace(self, unroll=check_unroll(unroll, self.fname))


RECOMPUTE_MODES = ("auto", "cheap", "none")


def check_leaves(tree, argname: str, fname: str, allow_structs: bool = False):
    """Flattens ``tree`` after checking that every leaf is an array (named by path if not)."""
    checks.check_traceable(tree, argname, fname, allow_structs=allow_structs)
    leaves_with_paths, treedef = tree_flatten_with_path(tree)
    return [p for p, _ in leaves_with_paths], [x for _, x in leaves_with_paths], treedef


def infer_length(xs_paths, xs_leaves, length, fname: str) -> int:
    sizes = []
    for path, x in zip(xs_paths, xs_leaves, strict=True):
        shape = np.shape(x)
        if not shape:
            raise ValueError(
                f"{fname} got a scalar xs leaf xs{keystr(path)} (shape ()); every xs leaf needs a "
                "leading axis to scan over."
            )
        sizes.append((path, shape[0]))
    if length is not None:
        try:
            length = int(_jc.concrete_or_error(None, length, f"{fname}: length must be concrete"))
        except TypeError as e:
            raise TypeError(f"{fname} got a non-integer length={length!r}.") from e
        if length < 0:
            raise ValueError(f"{fname} got a negative length={length}.")
        wrong = [(p, n) for p, n in sizes if n != length]
        if wrong:
            listed = ", ".join(f"xs{keystr(p)} has {n}" for p, n in wrong)
            raise ValueError(
                f"{fname} got length={length} but the xs leading-axis sizes disagree: {listed}."
            )
        return length
    if not sizes:
        raise ValueError(f"{fname} got no xs to scan over and no length: pass length=... .")
    distinct = {n for _, n in sizes}
    if len(distinct) > 1:
        listed = ", ".join(f"xs{keystr(p)} has {n}" for p, n in sizes)
        raise ValueError(f"{fname} got inconsistent leading-axis sizes: {listed}.")
    return sizes[0][1]


def check_split_transpose(split, fname: str) -> None:
    """``lax.scan``'s ``_split_transpose``: a bool; ``True`` warns (jaxmem's backward loop is its
    own, with nothing to split)."""
    if not isinstance(split, (bool, np.bool_)):
        raise TypeError(f"{fname} got _split_transpose={split!r}; expected a bool.")
    if split:
        warnings.warn(
            f"{fname}: _split_transpose=True has no effect: it splits the transpose of "
            "lax.scan's own VJP, and jaxmem.scan runs a lean backward loop of its own instead "
            "(the values are the same).",
            stacklevel=3,
        )


def check_unroll(unroll, fname: str):
    if isinstance(unroll, bool):
        return unroll
    if isinstance(unroll, (int, np.integer)) and unroll >= 0:
        return int(unroll)
    raise TypeError(f"{fname} got unroll={unroll!r}; expected a bool or a non-negative int.")


def check_recompute(recompute, fname: str) -> str:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"{fname} got recompute={recompute!r}; expected one of "
            f"{', '.join(map(repr, RECOMPUTE_MODES))}."
        )
    return recompute


COMPRESS_FORMATS = _compress.FORMATS


def check_compress(compress, fname: str) -> str | None:
    """``compress`` checked: None or one of :data:`COMPRESS_FORMATS`."""
    if compress is None or (isinstance(compress, str) and compress in COMPRESS_FORMATS):
        return compress
    raise ValueError(
        f"{fname} got compress={compress!r}; expected None or one of "
        f"{', '.join(map(repr, COMPRESS_FORMATS))}."
    )


OFFLOAD_MODES = ("residuals", "carries", "all")


def check_offload(offload, fname: str):
    """Normalises ``offload`` to None, one of OFFLOAD_MODES, or a frozenset of names."""
    if offload is None or offload in OFFLOAD_MODES:
        return offload
    if isinstance(offload, str):
        raise ValueError(
            f"{fname} got offload={offload!r}; expected None, one of "
            f"{', '.join(map(repr, OFFLOAD_MODES))}, or a tuple of checkpoint names "
            "(jaxmem.name / jax.ad_checkpoint.checkpoint_name)."
        )
    try:
        names = frozenset(offload)
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{fname} got offload={offload!r}; expected None, one of "
            f"{', '.join(map(repr, OFFLOAD_MODES))}, or a non-empty tuple of checkpoint names."
        )
    return names


def check_checkpoints(checkpoints, offload, length: int, fname: str) -> int | None:
    """The number of checkpoint slots, or None for the lean VJP (also for an empty scan)."""
    slots = _schedule.check_checkpoints(checkpoints, length, fname)
    if slots is not None and offload not in (None, "carries", "all"):
        raise ValueError(
            f"{fname} got offload={offload!r} with checkpoints={checkpoints!r}: a checkpointed "
            "scan stacks no activations (one step's are live at a time), only the checkpointed "
            "carries; offload them with offload='carries' (or 'all')."
        )
    return slots if length > 0 else None


def apply_policy(f, policy, fname: str):
    """The step under ``jax.checkpoint(policy=...)`` (as each step of a rematerialized scan).

    ``policy="auto"`` is resolved here, at trace time, by the active :func:`jaxmem.use_plan`.
    """
    policy = _auto.resolve(_presets.resolve(policy, fname), fname)
    if policy is None:
        return f
    checks.check_callable(f, "the body f(carry, x)", fname)
    return jax.checkpoint(f, policy=policy, prevent_cse=False)
