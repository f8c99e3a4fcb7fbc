"""Selective differentiation: split parameters into a trainable and a frozen part by path.

``jax.grad`` saves, for every differentiated parameter, what its gradient needs (a dense layer's
weight gradient needs the layer's input). When only some parameters are trained, differentiating
with respect to the trainable part alone lets JAX drop the residuals that only frozen parameters
need - e.g. fine-tuning the last layer of a deep network keeps only that layer's input, not the
inputs of all the frozen layers (Bhatia & Dangel, 2024).

When plain JAX already gets this for free: when gradient, optimizer update and the use of the
update all sit inside one :func:`jax.jit` and nothing reads the frozen gradients, XLA removes
their computation as dead code, and the residuals with them. That includes a mask made of
``optax.multi_transform`` / ``optax.masked`` with ``optax.set_to_zero()`` inside the same jit:
``set_to_zero`` ignores its input, so the frozen gradients are dead (measured with
``python -m benchmarks.losses``: same compiled temp as differentiating the trainable part only).
When it does not: whenever the full gradient tree leaves the jit (a jitted ``grad`` returning all
gradients, masked or applied in a second jit: they are computed and materialized), or something
reads every gradient before the mask - ``optax.chain(optax.clip_by_global_norm(...), mask)``,
a logged global gradient norm - so the frozen gradients and the activations they need are
computed first and then dropped. Differentiating only the trainable part makes the saving
explicit and independent of those details.

References:
  Bhatia & Dangel, 2024. "Lowering PyTorch's Memory Consumption for Selective Differentiation",
  arXiv:2404.12406.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

_CALLER = "trainable"

Filter = str | re.Pattern | Sequence[str | re.Pattern] | Callable[[str, Any], bool]
"""What :func:`trainable` accepts as a filter."""


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: Sequence[Any]) -> str:
    """The ``'/'``-joined form of a pytree key path, as the filters of :func:`trainable` see it.

    Args:
      path: A key path from :func:`jax.tree_util.tree_flatten_with_path`.

    Returns:
      Dict keys, sequence indices and attribute names joined by ``'/'``.

    Examples:
      >>> import jax
      >>> [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path({"a": [1, {"b": 2}]})]
      ['a/0', 'a/1/b']
    """
    return "/".join(_key_name(k) for k in path)


def _glob_to_regex(pattern: str) -> re.Pattern:
    """``*`` matches within one path component, ``**`` across components, ``?`` one char."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape("["))
                i += 1
            else:
                out.append(fnmatch.translate(pattern[i : j + 1])[4:-3])
                i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _make_predicate(filter: Any) -> Callable[[str, Any], bool]:
    if isinstance(filter, str):
        if not filter:
            raise ValueError(f"{_CALLER}: filter is an empty string; give a path pattern")
        rx = _glob_to_regex(filter)
        return lambda path, leaf: rx.fullmatch(path) is not None
    if isinstance(filter, re.Pattern):
        return lambda path, leaf: filter.fullmatch(path) is not None
    if callable(filter):
        return filter
    if isinstance(filter, Sequence) and not isinstance(filter, (str, bytes)):
        if not filter:
            raise ValueError(f"{_CALLER}: filter is an empty sequence; give at least one pattern")
        preds = []
        for i, f in enumerate(filter):
            if not isinstance(f, (str, re.Pattern)):
                raise TypeError(
                    f"{_CALLER}: filter[{i}] must be a glob string or a compiled regex, got "
                    f"{type(f).__name__} ({f!r})"
                )
            preds.append(_make_predicate(f))
        return lambda path, leaf: any(p(path, leaf) for p in preds)
    raise TypeError(
        f"{_CALLER}: filter must be a glob string (e.g. 'blocks/*/mlp/*'), a compiled regex, a "
        f"sequence of those, or a callable (path: str, leaf) -> bool; got "
        f"{type(filter).__name__} ({filter!r})"
    )


def trainable(params: Any, filter: Filter) -> tuple[Any, Any]:
    """Splits ``params`` into ``(trainable, frozen)`` pytrees by a path filter.

    Both results have the structure of ``params``; each leaf is in exactly one of them and is
    ``None`` in the other (``None`` is an empty pytree, so ``jax.grad``, ``optax`` and
    ``jax.tree.map`` skip it). :func:`merge` puts them back together. Differentiate with respect to
    the trainable part only - ``jax.grad(loss)(trainable, frozen, ...)`` - so that JAX neither
    computes the frozen gradients nor saves the residuals only they need.

    Paths are the leaves' key paths joined by ``'/'`` (dict keys, sequence indices, attribute
    names; see :func:`path_str`), e.g. ``'blocks/3/mlp/kernel'``. A filter is

    - a glob string, matched against the whole path: ``*`` matches within one component, ``**``
      across components, ``?`` one character, ``[...]`` a set, e.g. ``'blocks/*/mlp/*'``;
    - a compiled regex (``re.compile(...)``), which must match the whole path (``fullmatch``);
    - a sequence of those (a leaf is trainable if any matches);
    - a callable ``(path: str, leaf) -> bool``.

    A ``flax.nnx.State`` (e.g. from ``nnx.split``) is a pytree and is split the same way.

    When this saves memory: only where plain JAX would otherwise compute the frozen gradients -
    when the full gradients leave the jit, or when something reads all of them before a mask
    (``optax.chain(optax.clip_by_global_norm(...), optax.multi_transform(...))``). A
    ``set_to_zero`` mask inside the same jit as ``jax.grad`` is already free: XLA drops the frozen
    gradients as dead code (see the module docstring and ``python -m benchmarks.losses``).

    Args:
      params: A pytree of parameters.
      filter: Which leaves are trainable, as above.

    Returns:
      ``(trainable, frozen)``.

    Raises:
      TypeError: ``filter`` is of an unsupported type, or a callable returned a non-bool.
      ValueError: ``params`` has no leaves, the filter is empty, or it matched no leaf (the
        message shows some of the available paths).

    Examples:
      Fine-tune the last layer of a two-layer model with optax:

      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxmem._src import trainable as tr
      >>> params = {"layers": [{"w": jnp.ones((3, 3))}, {"w": jnp.ones((3, 2))}]}
      >>> train, frozen = tr.trainable(params, "layers/1/*")
      >>> jax.tree.map(jnp.shape, train)
      {'layers': [{'w': None}, {'w': (3, 2)}]}
      >>> def loss(train, frozen, x):
      ...     p = tr.merge(train, frozen)
      ...     h = jnp.tanh(x @ p["layers"][0]["w"])
      ...     return jnp.sum((h @ p["layers"][1]["w"]) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> state = opt.init(train)
      >>> @jax.jit
      ... def step(train, frozen, state, x):
      ...     grads = jax.grad(loss)(train, frozen, x)   # gradient of the trainable part only
      ...     updates, state = opt.update(grads, state, train)
      ...     return optax.apply_updates(train, updates), state
      >>> train, state = step(train, frozen, state, jnp.ones((4, 3)))
      >>> new = tr.merge(train, frozen)
      >>> bool((new["layers"][0]["w"] == 1).all()), bool((new["layers"][1]["w"] != 1).all())
      (True, True)

    References:
      Bhatia & Dangel, 2024. "Lowering PyTorch's Memory Consumption for Selective
      Differentiation", arXiv:2404.12406.
    """
    pred = _make_predicate(filter)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves:
        raise ValueError(f"{_CALLER}: params has no leaves (got {type(params).__name__})")
    flags = []
    for path, leaf in leaves:
        p = path_str(path)
        flag = pred(p, leaf)
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{_CALLER}: the filter callable must return a bool; for path {p!r} it "
                f"returned {type(flag).__name__} ({flag!r})"
            )
        flags.append(bool(flag))
    if not any(flags):
        paths = [path_str(p) for p, _ in leaves]
        shown = ", ".join(repr(p) for p in paths[:8]) + (", ..." if len(paths) > 8 else "")
        raise ValueError(
            f"{_CALLER}: filter {filter!r} matched none of the {len(paths)} leaves of params; "
            f"paths look like {shown}"
        )
    train = [leaf if f else None for (_, leaf), f in zip(leaves, flags, strict=True)]
    frozen = [None if f else leaf for (_, leaf), f in zip(leaves, flags, strict=True)]
    return treedef.unflatten(train), treedef.unflatten(frozen)


def _is_none(x: Any) -> bool:
    return x is None


def merge(trainable: Any, frozen: Any) -> Any:
    """Inverse of :func:`trainable`: takes each leaf from whichever part is not ``None``.

    Args:
      trainable: The trainable part (``None`` at frozen leaves), e.g. after an optimizer step.
      frozen: The frozen part (``None`` at trainable leaves).

    Returns:
      A pytree with the structure of the original parameters.

    Raises:
      ValueError: the two parts do not have the same structure.

    Examples:
      >>> from jaxmem._src import trainable as tr
      >>> t, f = tr.trainable({"a": 1.0, "b": 2.0}, "a")
      >>> t, f
      ({'a': 1.0, 'b': None}, {'a': None, 'b': 2.0})
      >>> tr.merge(t, f)
      {'a': 1.0, 'b': 2.0}
    """
    t_def = jax.tree_util.tree_structure(trainable, is_leaf=_is_none)
    f_def = jax.tree_util.tree_structure(frozen, is_leaf=_is_none)
    if t_def != f_def:
        raise ValueError(
            f"merge: trainable and frozen must have the same structure (as returned by "
            f"trainable()); got {t_def} and {f_def}"
        )
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=_is_none)
