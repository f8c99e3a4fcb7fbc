"""Host offload's implementation; :mod:`jaxmem.offload` (the public face) documents it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc

if TYPE_CHECKING:
    import optax

HOST = "pinned_host"
DEVICE = "device"

_SPACES = {HOST: jax.memory.Space.Host, DEVICE: jax.memory.Space.Device}


def supported(device: jax.Device | None = None) -> bool:
    """Whether ``device`` has a ``pinned_host`` memory that arrays can be offloaded to.

    Never raises: anything that is not a device with that memory kind gives False.

    Args:
        device: a :class:`jax.Device`; default ``jax.devices()[0]``.

    Returns:
        True when ``"pinned_host"`` is among the device's addressable memory kinds.

    Examples:
        >>> import jax
        >>> from jaxmem import offload
        >>> offload.supported()  # XLA:CPU has pinned_host memory (it is the same RAM)
        True
        >>> offload.supported("not a device")
        False
    """
    try:
        device = jax.devices()[0] if device is None else device
        return HOST in {m.kind for m in device.addressable_memories()}
    except Exception:  # A capability probe: any failure means "no".
        return False


def _memory_kinds(device) -> str:
    try:
        return ", ".join(m.kind for m in device.addressable_memories())
    except Exception:
        return "unknown"


def _check_supported(leaves, caller: str) -> None:
    """Raises unless every device the leaves live on (default device for traced ones) has host
    memory."""
    devices = set()
    for x in leaves:
        if isinstance(x, jax.Array) and not isinstance(x, _jc.Tracer):
            devices.update(x.devices())
        else:
            devices.add(None)
    for device in devices:
        device = jax.devices()[0] if device is None else device
        if not supported(device):
            raise RuntimeError(
                f"{caller}: the {device.platform} backend has no pinned_host memory to offload "
                f"to (device {device} has memory kinds: {_memory_kinds(device)}). Host offload "
                "needs a backend with pinned host memory (GPU, TPU, XLA:CPU); check "
                "jaxmem.offload.supported() and skip offloading where it is False."
            )


def _put(x, kind: str):
    """One leaf to memory ``kind``: its own sharding with that memory kind, or inside a trace
    the memory space (a placement annotation when lowered)."""
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if isinstance(x, _jc.Tracer) or not _jc.trace_state_clean():
        return jax.device_put(x, _SPACES[kind])
    if x.sharding.memory_kind == kind:
        return x
    try:
        target = x.sharding.with_memory_kind(kind)
    except (NotImplementedError, ValueError, TypeError):
        return jax.device_put(x, _SPACES[kind])
    return jax.device_put(x, target)


def _move(tree: Any, kind: str, argname: str, caller: str) -> Any:
    checks.check_traceable(tree, argname, caller, allow_structs=False)
    if kind == HOST:
        _check_supported(jax.tree.leaves(tree), caller)
    return jax.tree.map(lambda x: _put(x, kind), tree)


def to_host(tree: Any) -> Any:
    """Moves every array of ``tree`` to host memory (``pinned_host``), keeping its sharding.

    Eagerly, each array is put on ``x.sharding.with_memory_kind("pinned_host")``: a
    ``NamedSharding`` keeps its mesh and partition spec. Inside ``jit`` (or any transformation)
    the value is moved with ``jax.device_put(x, jax.memory.Space.Host)``, which lowers to an
    ``annotate_device_placement`` custom call with ``_xla_buffer_placement = "pinned_host"``; a
    ``jit`` output moved this way is returned in host memory. On CPU the values do not change
    (the same RAM).

    Use it to *store* arrays in host memory (parameters, optimizer state, a scan's inputs), not
    to compute on them: operations on host-memory values inside ``jit`` are rejected by JAX, and
    differentiating through ``to_host`` of a device value inside ``jit`` fails in JAX 0.10.2
    (``Expected cotangent type float32[...] but got float32<host>[...]``; it works eagerly).
    To keep the residuals of a gradient in host memory, use ``jaxmem.scan(..., offload=...)`` or
    an offloading remat policy (``jax.checkpoint_policies.save_and_offload_only_these_names``).

    Args:
        tree: a pytree of arrays (``jax.Array``, numpy arrays, Python scalars).

    Returns:
        The same tree with every leaf in ``pinned_host`` memory.

    Raises:
        TypeError: a leaf is not an array or scalar; the message names its pytree path.
        RuntimeError: the backend has no ``pinned_host`` memory (see :func:`supported`); the
            message names the backend.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from jaxmem import offload
        >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
        >>> x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
        >>> h = offload.to_host({"x": x})["x"]
        >>> h.sharding.memory_kind, h.sharding.mesh == mesh, h.sharding.spec == P("data")
        ('pinned_host', True, True)
        >>> offload.to_host({"w": "abc"})
        Traceback (most recent call last):
        ...
        TypeError: jaxmem.offload.to_host: argument tree['w'] is a str ('abc'); only arrays and
        scalars can be traced
    """
    return _move(tree, HOST, "tree", "jaxmem.offload.to_host")


def to_device(tree: Any) -> Any:
    """Moves every array of ``tree`` to device memory, keeping its sharding.

    The inverse of :func:`to_host`: eagerly ``x.sharding.with_memory_kind("device")``, inside
    ``jit`` ``jax.device_put(x, jax.memory.Space.Device)`` (an ``annotate_device_placement``
    custom call with ``_xla_buffer_placement = "device"`` when the value is in host memory;
    nothing for a value already on the device).

    Args:
        tree: a pytree of arrays (``jax.Array``, numpy arrays, Python scalars).

    Returns:
        The same tree with every leaf in ``device`` memory.

    Raises:
        TypeError: a leaf is not an array or scalar; the message names its pytree path.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxmem import offload
        >>> h = offload.to_host(jnp.arange(3.0))
        >>> d = offload.to_device(h)
        >>> h.sharding.memory_kind, d.sharding.memory_kind
        ('pinned_host', 'device')
        >>> d
        Array([0., 1., 2.], dtype=float32)
    """
    return _move(tree, DEVICE, "tree", "jaxmem.offload.to_device")


# Pure data movement: recomputing these in the backward step is free, and saving them would keep
# a per-layer device copy of (a cast, transpose, broadcast of) the fetched parameters.
_MOVES = frozenset(
    """
    broadcast_in_dim convert_element_type copy copy_p expand_dims reduce_precision reshape
    squeeze transpose
    """.split()
)


@dataclasses.dataclass(frozen=True)
class _RefetchToDevice:
    """Remat policy: save every value except copies into device memory and pure data movement
    (casts, transposes, reshapes, broadcasts), which the backward step makes again."""

    def __call__(self, prim, *_, **params) -> bool:
        if prim is _jc.device_put_p:
            return not any(d == jax.memory.Space.Device for d in params.get("devices", ()))
        return prim.name not in _MOVES


def fetch_params(step: Callable) -> Callable:
    """Wraps a scan step ``step(carry, x)`` so that ``x`` is brought to device memory first.

    For a layer stack scanned over stacked parameters kept in host memory (placed with
    :func:`to_host`): the scan slices one layer's parameters off the host stack, the wrapped step
    copies that slice to the device (:func:`to_device`) and calls ``step`` on it, so only one
    layer's parameters are on the device at a time. Leaves of ``x`` already on the device are
    not copied.

    The copy is made again in the backward step rather than kept: the wrapped step is
    ``jax.checkpoint`` of the fetch-then-step function with a policy that saves every value
    except copies into device memory and pure data movement (casts, transposes, reshapes,
    broadcasts, which are recomputed). Without it, the gradient would stack every layer's device
    copy (or its bf16 cast, or its transpose) as a residual: all the parameters back on the
    device. With it, the backward pass reads the layer's slice from the host stack, as an xs
    slice. Values computed from the parameters by arithmetic (``1 + scale``, ``w + a @ b``) are
    still saved per layer like any activation. Values and gradients are those of ``step``; on
    CPU they are bit-identical.

    Usable as a decorator, with :func:`jax.lax.scan` and :func:`jaxmem.scan`. (Known limit: the
    gradient of :func:`jaxmem.scan` with respect to host-resident xs fails in this version, its
    custom VJP returning the xs cotangents in device memory; :func:`jax.lax.scan` works.)

    Args:
        step: the step, ``step(carry, x) -> (carry, y)``, ``x`` being the per-layer slice of the
            scanned-over (stacked) parameters.

    Returns:
        The wrapped step, with the same signature.

    Raises:
        TypeError: ``step`` is not callable.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmem
        >>> from jaxmem import offload
        >>> def block(h, p):
        ...     return jnp.tanh(h @ p["w"] + p["b"]), None
        >>> layers = {"w": jnp.full((4, 3, 3), 0.1), "b": jnp.ones((4, 1, 3))}  # 4 layers
        >>> host_layers = offload.to_host(layers)
        >>> host_layers["w"].sharding.memory_kind
        'pinned_host'
        >>> h0 = jnp.ones((2, 3))
        >>> h, _ = jax.jit(lambda p, h: jaxmem.scan(offload.fetch_params(block), h, p))(
        ...     host_layers, h0)
        >>> h_ref, _ = jaxmem.scan(block, h0, layers)
        >>> bool((h == h_ref).all())
        True
    """
    checks.check_callable(step, "step", "jaxmem.offload.fetch_params")

    def fetched(carry, x):
        return step(carry, _move(x, DEVICE, "x", "jaxmem.offload.fetch_params step"))

    wrapped = jax.checkpoint(fetched, policy=_RefetchToDevice(), prevent_cse=False)
    return functools.wraps(step)(wrapped)


def offload_opt_state(
    optimizer: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """An optax optimizer that keeps its state in host memory between steps.

    ``init`` returns the inner optimizer's state moved to host memory (:func:`to_host`).
    ``update`` brings the state to the device (:func:`to_device`), runs the inner update and
    moves the new state back to host memory. Inside a jitted training step this is one
    host-to-device copy of the state before the update and one copy back after it; the state
    occupies device memory only during the update. Updates and state values are those of the
    inner optimizer (bit-identical on CPU).

    Args:
        optimizer: an :class:`optax.GradientTransformation` (extra arguments of ``update`` are
            passed on, as :func:`optax.with_extra_args_support` does).

    Returns:
        An :class:`optax.GradientTransformationExtraArgs` with the same ``init``/``update``
        signature.

    Raises:
        TypeError: ``optimizer`` has no callable ``init`` and ``update``; at ``init``/``update``,
            a state leaf that is not an array (named by its path).
        RuntimeError: at ``init``/``update``, the backend has no ``pinned_host`` memory.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxmem import offload
        >>> opt = offload.offload_opt_state(optax.adam(1e-2))
        >>> params = {"w": jnp.ones(3)}
        >>> state = opt.init(params)
        >>> state[0].mu["w"].sharding.memory_kind
        'pinned_host'
        >>> @jax.jit
        ... def train_step(params, state):
        ...     grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
        ...     updates, state = opt.update(grads, state, params)
        ...     return optax.apply_updates(params, updates), state
        >>> params, state = train_step(params, state)
        >>> state[0].mu["w"].sharding.memory_kind, params["w"].sharding.memory_kind
        ('pinned_host', 'device')
    """
    import optax  # Imported on use: optax is only needed by this helper.

    caller = "jaxmem.offload.offload_opt_state"
    if not all(callable(getattr(optimizer, a, None)) for a in ("init", "update")):
        raise TypeError(
            f"{caller}: optimizer must be an optax.GradientTransformation (with init and update), "
            f"got {checks.describe(optimizer)}."
        )
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        return _move(inner.init(params), HOST, "opt_state", f"{caller}(...).init")

    def update_fn(updates, state, params=None, **extra_args):
        state = _move(state, DEVICE, "state", f"{caller}(...).update")
        updates, state = inner.update(updates, state, params, **extra_args)
        return updates, _move(state, HOST, "new_state", f"{caller}(...).update")

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
