"""Remat policies: frozen dataclasses for ``jax.checkpoint(f, policy=...)``, and combinators.

A policy is called by JAX's partial evaluator once per primitive application of the function
under :func:`jax.checkpoint`, as ``policy(prim, *avals, **params)``, and answers what to do with
the primitive's outputs on the forward pass: keep them on the device for the backward pass
(``True`` / :data:`jax.ad_checkpoint.Saveable`), recompute them (``False`` /
:data:`jax.ad_checkpoint.Recompute`), or copy them to host memory
(``jax.ad_checkpoint.Offloadable(src="device", dst="pinned_host")``) and back when needed.

Every policy here is a frozen dataclass: hashable, equal by value, printable (its repr is the
call that builds it) and safe as a static argument of :func:`jax.jit`. Parameterless policies are
instances (:data:`nothing`, :data:`everything`, :data:`dots`, :data:`dots_no_batch`); policies
with parameters are built by functions (:func:`save`, :func:`offload`, :func:`custom`,
:func:`selective`); :func:`either` (or ``a | b``) combines them and :func:`by_name` picks one by
its string name, for config files. Name-based policies select values tagged with
:func:`jaxmem._src.remat.names.name` and check the names against the vocabulary
(:data:`jaxmem._src.remat.names.NAMES`).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem._src.remat import policies
  >>> from jaxmem._src.remat.names import name
  >>> def layer(x, w):
  ...     return jnp.tanh(name(x @ w, "mlp_in")).sum()
  >>> policy = policies.save("mlp_in")
  >>> policy
  save('mlp_in')
  >>> g = jax.grad(jax.checkpoint(layer, policy=policy))(jnp.ones((2, 3)), jnp.ones((3, 4)))
  >>> g.shape
  (2, 3)

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
  https://arxiv.org/abs/2205.05198.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat.names import ATTENTION_CORE, check_names

ACTIONS = ("device", "offload", "remat")
"""What :func:`custom` can do with a value: keep it on device, offload it to host, recompute it."""

_OFFLOAD = Offloadable(src="device", dst="pinned_host")


# ------------------------------------------------------------------------------------------
# Host-offload support: checked when a policy first asks to offload, warned about once.


OFFLOAD_FALLBACK = "offload fallback"  # the key of its warning (checks.warn_once)


class OffloadFallbackWarning(UserWarning):
    """Warned (once per process) when a policy asks to offload but the device cannot.

    The policy then saves the value on the device instead: results are unchanged, memory is not
    saved.

    Examples:
      >>> import warnings
      >>> warnings.filterwarnings("ignore", category=OffloadFallbackWarning)  # to silence it
      >>> issubclass(OffloadFallbackWarning, UserWarning)
      True
    """


def _offload_supported() -> bool:
    """Whether the default device has a ``pinned_host`` memory to offload residuals to."""
    from jaxmem._src import offload as _offload_mod  # lazy: keeps the import graph acyclic

    return bool(_offload_mod.supported())


def _offload_or_fallback() -> Offloadable | bool:
    """``Offloadable(device -> pinned_host)`` where supported; else warns once and saves."""
    if _offload_supported():
        return _OFFLOAD

    def message() -> str:
        device = jax.devices()[0]
        try:
            kinds = ", ".join(m.kind for m in device.addressable_memories())
        except Exception:  # noqa: BLE001 - only for the message
            kinds = "unknown"
        return (
            "jaxmem.policies: a policy asks to offload residuals to 'pinned_host', but the "
            f"default device {device} has no such memory (its memories: {kinds}). Those "
            "residuals are saved on the device instead: values are unchanged, no memory is "
            "saved. On this backend use save(...) or custom 'device' entries instead of "
            "offload(...) or 'offload' entries."
        )

    checks.warn_once(OFFLOAD_FALLBACK, message, OffloadFallbackWarning, stacklevel=2)
    return True


# ------------------------------------------------------------------------------------------
# The policies.


def _is_name(prim: Any) -> bool:
    return prim is _jc.name_p


class Policy:
    """Base of jaxmem's policies: ``a | b`` is :func:`either`, and each knows its named entries.

    Subclasses are frozen dataclasses implementing ``__call__(prim, *avals, **params)``.

    Examples:
      >>> isinstance(save("qkv_proj") | dots, Policy)
      True
    """

    __slots__ = ()

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool | Offloadable:
        raise NotImplementedError

    def __or__(self, other: Any) -> Policy:
        if not callable(other):
            return NotImplemented
        return either(self, other)

    def __ror__(self, other: Any) -> Policy:
        if not callable(other):
            return NotImplemented
        return either(other, self)

    def explicit_actions(self) -> dict[str, str]:
        """The names this policy acts on explicitly, name -> ``"device" | "offload" | "remat"``.

        :func:`either` refuses to combine policies that give one name two different actions.

        Examples:
          >>> (save("qkv_proj") | offload("decoder_layer_input")).explicit_actions()
          {'qkv_proj': 'device', 'decoder_layer_input': 'offload'}
        """
        return {}


@dataclasses.dataclass(frozen=True, repr=False)
class Nothing(Policy):
    """Saves nothing: only the inputs of the checkpointed function survive to the backward pass.

    Examples:
      >>> nothing
      nothing
    """

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return "nothing"


@dataclasses.dataclass(frozen=True, repr=False)
class Everything(Policy):
    """Saves everything JAX would save without :func:`jax.checkpoint`.

    Examples:
      >>> everything
      everything
    """

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return "everything"


@dataclasses.dataclass(frozen=True, repr=False)
class Dots(Policy):
    """Saves the outputs of matmuls and convolutions, as ``jax.checkpoint_policies``' dots policies.

    Attributes:
      no_batch_dims: save only ``dot_general`` without batch dimensions (the weight
        projections of a transformer, not the attention ``q k^T`` and ``probs v`` products).

    Examples:
      >>> dots, dots_no_batch
      (dots, dots_no_batch)
    """

    no_batch_dims: bool

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        cp = jax.checkpoint_policies
        jax_policy = cp.dots_with_no_batch_dims_saveable if self.no_batch_dims else cp.dots_saveable
        return bool(jax_policy(prim, *avals, **params))

    def __repr__(self) -> str:
        return "dots_no_batch" if self.no_batch_dims else "dots"


nothing = Nothing()
"""Recompute everything (:func:`jax.checkpoint` without a policy); keeps only the inputs.

Examples:
  >>> import jax
  >>> nothing(jax.lax.sin_p)
  False
"""

everything = Everything()
"""Save everything (as no :func:`jax.checkpoint` at all).

Examples:
  >>> import jax
  >>> everything(jax.lax.sin_p)
  True
"""

dots = Dots(no_batch_dims=False)
"""Save every matmul and convolution output; recompute the rest (jax's ``dots_saveable``).

Examples:
  >>> import jax
  >>> dots(jax.lax.sin_p)
  False
"""

dots_no_batch = Dots(no_batch_dims=True)
"""Save matmuls without batch dimensions (jax's ``dots_with_no_batch_dims_saveable``).

Examples:
  >>> dots_no_batch == Dots(no_batch_dims=True)
  True
"""


def _names_repr(names: Iterable[str]) -> str:
    return ", ".join(map(repr, names))


@dataclasses.dataclass(frozen=True, repr=False)
class Save(Policy):
    """Saves on the device the values named one of ``names``; recomputes everything else.

    Attributes:
      names: the checkpoint names to save, sorted.

    Examples:
      >>> Save(("mlp_in", "qkv_proj"))
      save('mlp_in', 'qkv_proj')
    """

    names: tuple[str, ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return _is_name(prim) and params["name"] in self.names

    def __repr__(self) -> str:
        return f"save({_names_repr(self.names)})"

    def explicit_actions(self) -> dict[str, str]:
        return dict.fromkeys(self.names, "device")


@dataclasses.dataclass(frozen=True, repr=False)
class Offload(Policy):
    """Offloads to ``pinned_host`` the values named one of ``names``; recomputes the rest.

    Attributes:
      names: the checkpoint names to offload, sorted.

    Examples:
      >>> Offload(("decoder_layer_input",))
      offload('decoder_layer_input')
    """

    names: tuple[str, ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool | Offloadable:
        if _is_name(prim) and params["name"] in self.names:
            return _offload_or_fallback()
        return False

    def __repr__(self) -> str:
        return f"offload({_names_repr(self.names)})"

    def explicit_actions(self) -> dict[str, str]:
        return dict.fromkeys(self.names, "offload")


@dataclasses.dataclass(frozen=True, repr=False)
class Selective(Policy):
    """Korthikanti et al.'s selective recomputation, by names: keep named values but the core.

    Saves every named value except those named in ``recompute`` (by default the attention core,
    ``attention_scores`` and ``attention_probs``), and recomputes every unnamed value.

    Attributes:
      recompute: names recomputed although named, sorted.

    Examples:
      >>> Selective(("attention_probs", "attention_scores"))
      selective()
    """

    recompute: tuple[str, ...] = tuple(sorted(ATTENTION_CORE))

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return _is_name(prim) and params["name"] not in self.recompute

    def __repr__(self) -> str:
        extra = tuple(n for n in self.recompute if n not in ATTENTION_CORE)
        missing = [n for n in ATTENTION_CORE if n not in self.recompute]
        if missing:  # only reachable by building Selective(...) directly
            return f"Selective(recompute={self.recompute!r})"
        return f"selective(also_recompute={extra!r})" if extra else "selective()"


def _policy_repr(p: Any) -> str:
    if isinstance(p, Policy):
        return repr(p)
    name = getattr(p, "__qualname__", None)
    if name is not None:
        return f"{getattr(p, '__module__', '?')}.{name}"
    return repr(p)


def _case(result: Any, policy: Any) -> str:
    """Normalizes one policy answer to ``"device"``, ``"remat"`` or ``"offload"``."""
    if result is True or result is Saveable:
        return "device"
    if result is False or result is Recompute:
        return "remat"
    if isinstance(result, Offloadable):
        return "offload"
    raise TypeError(
        f"jaxmem.policies.either: policy {_policy_repr(policy)} returned {result!r}; a remat "
        "policy must return a bool, jax.ad_checkpoint.Saveable, Recompute or Offloadable(...)."
    )


@dataclasses.dataclass(frozen=True, repr=False)
class Either(Policy):
    """Keeps a value if any of ``policies`` keeps it; offloading takes precedence over saving.

    Attributes:
      policies: the combined policies (flattened, without duplicates), in order.

    Examples:
      >>> Either((dots, save("mlp_act")))
      either(dots, save('mlp_act'))
    """

    policies: tuple[Callable[..., Any], ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool | Offloadable:
        saved = False
        for p in self.policies:
            result = p(prim, *avals, **params)
            case = _case(result, p)
            if case == "offload":
                return result
            saved = saved or case == "device"
        return saved

    def __repr__(self) -> str:
        return f"either({', '.join(map(_policy_repr, self.policies))})"

    def explicit_actions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self.policies:
            if isinstance(p, Policy):
                out.update(p.explicit_actions())
        return out


# ------------------------------------------------------------------------------------------
# Constructors.


def save(*names: str, allow_unknown: bool = False) -> Save:
    """Saves the values named ``names`` on the device; recomputes everything else.

    The name-checked ``jax.checkpoint_policies.save_only_these_names``.

    Args:
      *names: checkpoint names (:data:`jaxmem._src.remat.names.NAMES`), e.g. ``"qkv_proj"``.
      allow_unknown: accept names outside the vocabulary.

    Returns:
      A :class:`Save` policy.

    Raises:
      TypeError: a name is not a str.
      ValueError: a name is not in the vocabulary (and ``allow_unknown`` is False).

    Examples:
      >>> import jax
      >>> from jaxmem._src.remat.names import name
      >>> def f(x):
      ...     return jax.numpy.sin(name(jax.numpy.sin(x), "mlp_act"))
      >>> jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=save("mlp_act")), 1.0)
      f32[] from the argument x
      f32[] named 'mlp_act' from ...
      >>> save("mlp_act", "qkv_proj") == save("qkv_proj", "mlp_act")
      True
      >>> save("mlpwi")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.policies.save: unknown checkpoint name 'mlpwi'; ...
    """
    return Save(
        check_names(names, allow_unknown=allow_unknown, what="names", caller="jaxmem.policies.save")
    )


def offload(*names: str, allow_unknown: bool = False) -> Offload:
    """Offloads the values named ``names`` to host memory (``pinned_host``); recomputes the rest.

    Each named value is copied to ``pinned_host`` on the forward pass and back to the device
    where the backward pass needs it (``Offloadable(src="device", dst="pinned_host")``). Where
    the default device has no ``pinned_host`` memory, the policy saves the values on the device
    instead and warns once per process (:class:`OffloadFallbackWarning`). On CPU offloading is
    the identity on values.

    In a scanned layer stack, offload the layer *input* (``"decoder_layer_input"``), not its
    output: the output is the next layer's input, already kept as the scan carry.

    Args:
      *names: checkpoint names (:data:`jaxmem._src.remat.names.NAMES`).
      allow_unknown: accept names outside the vocabulary.

    Returns:
      An :class:`Offload` policy.

    Raises:
      TypeError: a name is not a str.
      ValueError: a name is not in the vocabulary (and ``allow_unknown`` is False).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem._src.remat.names import name
      >>> def f(x):
      ...     return jnp.sin(name(jnp.sin(x), "mlp_act")).sum()
      >>> policy = offload("mlp_act")
      >>> policy
      offload('mlp_act')
      >>> float(jax.grad(jax.checkpoint(f, policy=policy))(0.0))
      1.0
    """
    return Offload(
        check_names(
            names, allow_unknown=allow_unknown, what="names", caller="jaxmem.policies.offload"
        )
    )


def selective(*, also_recompute: Iterable[str] = (), allow_unknown: bool = False) -> Selective:
    """Selective activation recomputation (Korthikanti et al. 2022): recompute attention's core.

    Keeps every *named* activation of a layer (:data:`jaxmem._src.remat.names.NAMES`) except the
    attention scores and probabilities (``attention_scores``, ``attention_probs``), and
    recomputes every unnamed value. The rule is by names, so it is sound on any model that tags
    its activations with the vocabulary: no ``[b, a, s, s]`` tensor (scores, masked scores,
    softmax intermediates, probabilities, dropout masks) is saved unless a model names one with
    another name. Unnamed cheap values (LayerNorm outputs, the residual sum) are recomputed from
    the saved named ones. A model without names keeps only its inputs (as :data:`nothing`).

    On a pre-LN block with a ``4 h`` MLP this keeps about ``28 s b h`` bytes per layer with
    16-bit activations: the paper's ``34 s b h`` less the dropout masks (our block has no
    dropout) and the LayerNorm outputs (recomputed), against ``s b h (34 + 5 a s / h)`` with no
    recomputation.

    Args:
      also_recompute: more names to recompute (e.g. ``["mlp_act"]``, cheap to recompute from
        ``mlp_in``).
      allow_unknown: accept names outside the vocabulary in ``also_recompute``.

    Returns:
      A :class:`Selective` policy.

    Raises:
      TypeError: a name is not a str.
      ValueError: a name is not in the vocabulary (and ``allow_unknown`` is False).

    Examples:
      >>> selective()
      selective()
      >>> selective(also_recompute=["mlp_act"])
      selective(also_recompute=('mlp_act',))

    References:
      Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
      2022, section 4.2 (activation memory per layer) and section 5 (selective recomputation),
      https://arxiv.org/abs/2205.05198.
    """
    extra = check_names(
        also_recompute,
        allow_unknown=allow_unknown,
        what="also_recompute",
        caller="jaxmem.policies.selective",
    )
    return Selective(tuple(sorted({*ATTENTION_CORE, *extra})))


def _check_policy(p: Any, i: int, caller: str) -> None:
    """Raises TypeError unless ``policies[i]`` is callable and hashable."""
    if not callable(p):
        raise TypeError(
            f"{caller}: policies[{i}] is {type(p).__name__} ({p!r}); expected a remat policy "
            "(jaxmem.policies or jax.checkpoint_policies)."
        )
    try:
        hash(p)
    except TypeError as e:
        raise TypeError(
            f"{caller}: policies[{i}] ({p!r}) is not hashable; policies must be hashable to "
            "be static arguments of jax.jit. Use a frozen dataclass."
        ) from e


def _check_one_action_per_name(policies: Iterable[Any], caller: str) -> None:
    """Raises ValueError if two of ``policies`` give one name different explicit actions."""
    words = {"device": "saved on the device", "offload": "offloaded", "remat": "recomputed"}
    seen: dict[str, tuple[str, Any]] = {}
    for p in policies:
        if not isinstance(p, Policy):
            continue
        for n, action in p.explicit_actions().items():
            if n in seen and seen[n][0] != action:
                a0, p0 = seen[n]
                raise ValueError(
                    f"{caller}: {n!r} is {words[a0]} by {p0!r} and {words[action]} by {p!r}; "
                    "give each name one action (remove it from one of them)."
                )
            seen.setdefault(n, (action, p))


def either(*policies: Callable[..., Any]) -> Policy:
    """Combines policies: a value is kept if any of them keeps it (also spelled ``a | b``).

    Precedence, per value: offload > save on device > recompute. A policy asking to offload a
    value wins over one that merely saves it (so ``selective() | offload("decoder_layer_input")``
    moves the layer input to host); naming one value with two different explicit actions
    (``save("qkv_proj") | offload("qkv_proj")``) is an error. Any remat policy can take part,
    e.g. ``jax.checkpoint_policies.dots_saveable``; it must be hashable.

    Args:
      *policies: one or more remat policies.

    Returns:
      An :class:`Either` policy (nested ones flattened, duplicates dropped), or the policy
      itself when only one remains.

    Raises:
      TypeError: no policies, or one that is not callable or not hashable.
      ValueError: a name given two different explicit actions by :func:`save`,
        :func:`offload` or :func:`custom`.

    Examples:
      >>> dots | save("mlp_act")
      either(dots, save('mlp_act'))
      >>> either(dots, dots)
      dots
      >>> save("qkv_proj") | offload("qkv_proj")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.policies.either: 'qkv_proj' is saved on the device by save('qkv_proj') ...
    """
    caller = "jaxmem.policies.either"
    if not policies:
        raise TypeError(f"{caller} needs at least one policy, e.g. either(dots, save('mlp_act')).")
    flat: list[Callable[..., Any]] = []
    for i, p in enumerate(policies):
        _check_policy(p, i, caller)
        for q in p.policies if isinstance(p, Either) else (p,):
            if q not in flat:
                flat.append(q)
    _check_one_action_per_name(flat, caller)
    if len(flat) == 1:
        return flat[0]  # type: ignore[return-value]
    return Either(tuple(flat))
