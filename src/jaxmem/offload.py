"""Host offload: move arrays, scanned layer parameters and optimizer state to host memory.

See :mod:`jaxmem._src.offload` for what offload does, how to verify it for GPU/TPU without the
hardware (it is the identity on CPU), and the trap of offloading a block's output (jax#23869).
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
