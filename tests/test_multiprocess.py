"""More than one process: 2 processes x 4 CPU devices give the loss and gradients of 1 x 8.

Each run is tests/multiprocess_step.py in fresh Python processes (devices and
``jax.distributed.initialize`` must come before JAX's backend starts, so not in this one): the
same jitted training step (a scanned, FSDP + Megatron-sharded layer stack and a cross-entropy
head) on one global 8-device mesh, with :func:`jaxmem.scan` and with :func:`jax.lax.scan`.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("multiprocess_step.py")
TIMEOUT_S = 120
# Cross-device reductions run in another order across processes (gloo) than within one.
RTOL, ATOL_OF_MAX = 2e-5, 1e-5

pytestmark = pytest.mark.skipif(
    sys.platform == "win32",
    reason="CPU collectives across processes need gloo, which jaxlib builds for Linux and "
    "macOS only",
)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env():
    # Each process sets its own device count (jax_num_cpu_devices); the suite's XLA_FLAGS
    # (8 devices per process, from conftest.py) must not reach it; nor the suite's persistent
    # compilation cache, which processes running at once would write and read at once.
    dropped = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_workers(argvs, tmp_path):
    """Runs the worker once per argv, all at once; fails with every worker's output if any fails.

    The first failure ends the others (else they would wait for it until their own timeout).
    """
    logs = [tmp_path / f"worker{i}.log" for i in range(len(argvs))]
    procs = []
    for argv, log in zip(argvs, logs, strict=True):
        with open(log, "w") as out:  # a file, not a pipe: a full pipe would block the worker
            cmd = [sys.executable, str(WORKER), *argv]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env()))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if None not in codes or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.1)
    finally:
        killed = [proc.poll() is None for proc in procs]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        outputs = [
            f"--- {' '.join(argv)}: {'killed' if kill else f'exit {proc.returncode}'}\n"
            + log.read_text()
            for argv, proc, kill, log in zip(argvs, procs, killed, logs, strict=True)
        ]
        pytest.fail(f"a worker failed (timeout {TIMEOUT_S} s):\n" + "\n".join(outputs))


def _assert_close(actual, expected, what):
    for key in expected:
        np.testing.assert_allclose(
            actual[key],
            expected[key],
            rtol=RTOL,
            atol=ATOL_OF_MAX * np.abs(expected[key]).max(),
            err_msg=f"{what}: {key}",
        )


@pytest.mark.parametrize("mesh_type", ["auto", "explicit"])
def test_two_processes_match_one(tmp_path, mesh_type):
    port, one, two = _free_port(), tmp_path / "one.npz", tmp_path / "two.npz"
    common = ["--mesh-type", mesh_type]
    multi = ["--num-processes", "2", "--port", str(port), *common]
    _run_workers(
        [
            [*common, "--out", str(one)],
            [*multi, "--process-id", "0", "--out", str(two)],
            [*multi, "--process-id", "1"],
        ],
        tmp_path,
    )
    with np.load(one) as f_one, np.load(two) as f_two:
        one, two = dict(f_one), dict(f_two)

    keys = [f"{scan}.{key}" for scan in ("jaxmem", "lax") for key in ("loss", "w1", "w2", "w_out")]
    assert sorted(one) == sorted(two) == sorted(keys)
    assert np.isfinite(one["lax.loss"]) and one["lax.loss"] > 0
    _assert_close(two, one, "2 processes x 4 devices vs 1 x 8")
    for run, results in (("1 process", one), ("2 processes", two)):
        jaxmem = {key.removeprefix("jaxmem."): v for key, v in results.items() if "jaxmem." in key}
        lax = {key: results[f"lax.{key}"] for key in jaxmem}
        _assert_close(jaxmem, lax, f"{run}: jaxmem.scan vs jax.lax.scan")
