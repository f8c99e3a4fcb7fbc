"""Host offload: keep arrays in host memory (``pinned_host``) and bring them to the device on use.

Accelerators with a host-memory space (GPU, TPU) can hold an array in page-locked host RAM
(memory kind ``"pinned_host"``) instead of device memory, and copy it back over PCIe/ICI when it
is needed. That trades transfer time for device memory, and pays where the copy overlaps with
compute: residuals kept between the forward and the backward pass, the parameters of a scanned
layer stack (only one layer's slice on the device at a time), optimizer state between steps.

This module gives the building blocks:

* :func:`supported`: whether a device has a ``pinned_host`` memory.
* :func:`to_host` / :func:`to_device`: move every array of a pytree, keeping each one's sharding
  (``NamedSharding(mesh, spec).with_memory_kind(...)``); eagerly and inside ``jit``.
* :func:`fetch_params`: wrap a scan step so the per-layer slice of host-resident stacked
  parameters is brought to the device inside the step (and fetched again in the backward step,
  never stacked on the device).
* :func:`offload_opt_state`: an optax optimizer whose state lives in host memory between steps.

:func:`jaxmem.scan` offloads its own stacked residuals with ``offload="residuals"``,
``"carries"``, ``"all"`` or a tuple of checkpoint names.

**On CPU this is the identity.** XLA:CPU reports the memory kinds ``device``, ``pinned_host`` and
``unpinned_host`` but they are all the same RAM: results are bit-identical with and without
offload, and no saving shows in ``memory_analysis()``. For GPU/TPU, verify offload structurally,
without the hardware: lower for the target platform with :func:`jax.export.export` and look for
``annotate_device_placement`` custom calls with ``_xla_buffer_placement = "pinned_host"`` where a
value goes to the host and ``"device"`` where it comes back.

**The trap** (jax#23869, openxla/xla#17541): offloading the *output* of a block of a layer stack
does nothing, because that output is the next block's input and stays live on the device anyway.
Offload what the backward pass keeps: name the block's *input* (``checkpoint_name``) and offload
that name, or offload the carry sequence, as ``jaxmem.scan(..., offload="carries")`` does.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem import offload
    >>> def f(x):
    ...     return offload.to_device(offload.to_host(x * 2)) + 1
    >>> f(jnp.ones(3))  # the identity on CPU
    Array([3., 3., 3.], dtype=float32)
    >>> x = jax.ShapeDtypeStruct((4,), jnp.float32)
    >>> text = jax.export.export(jax.jit(f), platforms=["cuda"])(x).mlir_module()
    >>> placement = "_xla_buffer_placement = {}"
    >>> text.count(placement.format('"pinned_host"')), text.count(placement.format('"device"'))
    (1, 1)
"""

from jaxmem._src.offload import fetch_params as fetch_params
from jaxmem._src.offload import offload_opt_state as offload_opt_state
from jaxmem._src.offload import supported as supported
from jaxmem._src.offload import to_device as to_device
from jaxmem._src.offload import to_host as to_host

__all__ = [
    "fetch_params",
    "offload_opt_state",
    "supported",
    "to_device",
    "to_host",
]
