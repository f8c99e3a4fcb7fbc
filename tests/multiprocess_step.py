"""One sharded training step, run as one process of several (or alone): tests/test_multiprocess.py.

The same code runs as 1 process x 8 CPU devices and as 2 processes x 4 CPU devices on localhost
(``jax.distributed.initialize`` with a local coordinator, CPU collectives over gloo). Each run
builds one global 8-device mesh ('data' x 'model' = 4 x 2), creates the same deterministic global
inputs, and takes the loss and gradients of a 4-layer scanned MLP stack (weights stacked on a
leading axis, FSDP-sharded over 'data' and Megatron-sharded over 'model', batch over 'data')
followed by a vocabulary-parallel :func:`jaxmem.losses.linear_cross_entropy` (``w_out``
sharded over 'model' along V; ``--head dense``: optax's cross-entropy of the full logits), once
with :func:`jaxmem.scan` and once with :func:`jax.lax.scan`, on a mesh
of Auto axes (``--mesh-type auto``, the default) or Explicit ones (``explicit``). Process 0
writes the losses and gradients, gathered to the host, to ``--out`` (npz; keys ``jaxmem.loss``,
``jaxmem.w1``, ..., ``lax.loss``, ...).

JAX's SPMD partitioner is the distributed engine: jaxmem adds nothing to it.

Usage::

  python tests/multiprocess_step.py --out one.npz                      # 1 process x 8 devices
  python tests/multiprocess_step.py --num-processes 2 --process-id 0 --port 12345 --out two.npz
  python tests/multiprocess_step.py --num-processes 2 --process-id 1 --port 12345

Not a test module (not named test_*.py); importing it runs nothing.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem

GLOBAL_DEVICES = 8
MESH_SHAPE = (4, 2)  # ('data', 'model')
LAYERS, BATCH, SEQ, D_MODEL, D_HIDDEN, VOCAB = 4, 8, 4, 16, 32, 64
# Global shardings of the inputs: weights FSDP over 'data' and Megatron over 'model'.
SPECS = {
    "x": P("data", None, None),
    "labels": P("data", None),
    "w1": P(None, "data", "model"),  # [LAYERS, D_MODEL, D_HIDDEN]
    "w2": P(None, "model", "data"),  # [LAYERS, D_HIDDEN, D_MODEL]
    "w_out": P(None, "model"),  # [D_MODEL, VOCAB]: vocabulary-parallel
}
SCANS = {"jaxmem": jaxmem.scan, "lax": jax.lax.scan}


def configure(num_processes, process_id, port):
    """Sets up this process's CPU devices, and joins the others; before any device is used."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", GLOBAL_DEVICES // num_processes)
    if num_processes > 1:
        # Cross-process collectives on CPU (the default in jax 0.10 to 0.12; said here anyway).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=60,
        )
    assert jax.device_count() == GLOBAL_DEVICES, jax.devices()
    assert jax.process_count() == num_processes, jax.process_count()


def host_inputs():
    """The global inputs as numpy arrays: the same in every process (a fixed seed)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    return {
        "x": normal(BATCH, SEQ, D_MODEL),
        "labels": rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32),
        "w1": normal(LAYERS, D_MODEL, D_HIDDEN) / np.sqrt(D_MODEL),
        "w2": normal(LAYERS, D_HIDDEN, D_MODEL) / np.sqrt(D_HIDDEN),
        "w_out": normal(D_MODEL, VOCAB) / np.sqrt(D_MODEL),
    }


def global_arrays(mesh, values):
    """Global jax.Arrays sharded by SPECS; each process supplies only its own devices' shards."""
    return {
        key: jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, SPECS[key]), lambda index, value=value: value[index]
        )
        for key, value in values.items()
    }


def make_loss(scan, explicit, head):
    """The loss of a scanned stack of residual MLP blocks (RMS norm, gelu) and a linear head."""

    def gather(w, spec):
        # FSDP: all-gather a layer's weight over 'data' before use (Megatron 'model' stays).
        if explicit:
            return jax.sharding.reshard(w, spec)
        return jax.lax.with_sharding_constraint(w, spec)

    def contract(subscripts, a, b, out_spec):
        if explicit:  # contracting a sharded axis: the output sharding is not implied.
            return jnp.einsum(subscripts, a, b, out_sharding=out_spec)
        return jnp.einsum(subscripts, a, b)

    def block(h, w):
        w1, w2 = gather(w["w1"], P(None, "model")), gather(w["w2"], P("model", None))
        z = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        u = jax.nn.gelu(contract("btd,dh->bth", z, w1, P("data", None, "model")))
        return h + contract("bth,hd->btd", u, w2, P("data", None, None)), None

    def loss(params, x, labels):
        h, _ = scan(block, x, {"w1": params["w1"], "w2": params["w2"]})
        if head == "linear_cross_entropy":  # vocabulary-parallel: w_out is never gathered
            return jaxmem.losses.linear_cross_entropy(
                h, params["w_out"], labels, chunk_size=16, vocab_axis="model"
            )
        w_out = gather(params["w_out"], P(None, None))
        logits = contract("btd,dv->btv", h, w_out, P("data", None, None))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def train_step_results(mesh, explicit, head):
    """Loss and gradients of each scan, as numpy arrays keyed '<scan>.loss', '<scan>.<param>'."""
    arrays = global_arrays(mesh, host_inputs())
    params = {key: arrays[key] for key in ("w1", "w2", "w_out")}
    grad_fns = {
        name: jax.value_and_grad(make_loss(scan, explicit, head)) for name, scan in SCANS.items()
    }
    # One jit for both scans (one compilation); the gradients sharded as the parameters (FSDP +
    # Megatron), the losses replicated.
    shardings = (NamedSharding(mesh, P()), {key: w.sharding for key, w in params.items()})
    step = jax.jit(
        lambda *args: {name: fn(*args) for name, fn in grad_fns.items()},
        out_shardings={name: shardings for name in grad_fns},
    )
    outputs = step(params, arrays["x"], arrays["labels"])
    # Global arrays that span all processes: gathered to every host as numpy arrays.
    outputs = multihost_utils.process_allgather(outputs, tiled=True)
    results = {}
    for name, (loss, grads) in outputs.items():
        results[f"{name}.loss"] = np.asarray(loss)
        results.update({f"{name}.{key}": np.asarray(value) for key, value in grads.items()})
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="the coordinator's, on localhost")
    parser.add_argument("--mesh-type", choices=("auto", "explicit"), default="auto")
    parser.add_argument(
        "--head",
        choices=("linear_cross_entropy", "dense"),
        default="linear_cross_entropy",
        help="jaxmem.losses.linear_cross_entropy, or optax's cross-entropy of the dense logits",
    )
    parser.add_argument("--out", help="npz file that process 0 writes")
    args = parser.parse_args(argv)

    configure(args.num_processes, args.process_id, args.port)
    explicit = args.mesh_type == "explicit"
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        results = train_step_results(mesh, explicit, args.head)
    if args.process_id == 0 and args.out:
        np.savez(args.out, **results)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
