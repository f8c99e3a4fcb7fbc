"""The memory viewer on the demo GPT, for the docs: docs/_static/viewer.png.

Profiles the training-step gradient of the demo's GPT (:mod:`jaxmem.demo.models`: its default
sizes, batch 8, ``jax.grad`` of next-token cross-entropy with the layer stack run by
``jaxmem.scan``), from shapes alone and compiled as ``python -m jaxmem demo`` compiles it, writes
:meth:`jaxmem.MemoryReport.to_html` and has headless Chromium take a 1400x900 screenshot of it
with a buffer's details open (``#buffer=NAME``; by default the largest loop-state buffer live at
the peak: ``jaxmem.scan``'s stack of residuals). Source paths are shown relative to the
repository (and to ``site-packages``), so the files name no local folder.

Usage: ``python -m tools.viewer_screenshot [--out DIR] [--buffer NAME] [--chromium PATH]``
(default ``--out docs/_static``). Fails, with a message, when Chromium is missing or the page
logs anything on the browser's console.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.demo import cli as demo
from jaxmem.demo import models

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 8
SIZE = (1400, 900)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
)
CONSOLE = re.compile(r":CONSOLE[:(]")


def profile_demo_gpt() -> jaxmem.MemoryReport:
    """The memory report of the demo GPT's gradient with its layers run by ``jaxmem.scan``."""
    config = models.GPTConfig()
    params = models.abstract_params(config, BATCH)
    tokens = jax.ShapeDtypeStruct((BATCH, config.seq_len), jnp.int32)
    loss = models.next_token_loss(models.GPT(config, jaxmem.scan))
    step = jax.jit(jax.grad(loss), compiler_options=demo.FAST_COMPILE)
    return jaxmem.profile(step, params, tokens)


def _relative(source: str) -> str:
    """``/any/where/site-packages/flax/x.py:3 (f)`` -> ``flax/x.py:3 (f)``; a file of this
    repository relative to its root."""
    source = source.replace(f"{ROOT}{os.sep}", "")
    return re.sub(r"^.*[/\\]site-packages[/\\]", "", source)


def with_relative_sources(report: jaxmem.MemoryReport) -> jaxmem.MemoryReport:
    """``report`` with every buffer's source path made relative (see :func:`_relative`)."""
    b = report.buffers
    moved = {id(x): dataclasses.replace(x, source=_relative(x.source)) for x in b.buffers}
    buffers = dataclasses.replace(
        b,
        buffers=tuple(moved[id(x)] for x in b.buffers),
        peak_buffers=tuple(moved.get(id(x), x) for x in b.peak_buffers),
    )
    return dataclasses.replace(report, buffers=buffers)


def featured_buffer(report: jaxmem.MemoryReport) -> str:
    """The largest loop-state buffer live at the peak, else the largest one."""
    loop = [b for b in report.peak_buffers if b.loop_state]
    return (loop or list(report.peak_buffers))[0].name


def screenshot(chromium: str, page: pathlib.Path, fragment: str, png: pathlib.Path) -> None:
    """Has Chromium draw ``page#fragment`` into ``png``; raises if the page logs anything."""
    with tempfile.TemporaryDirectory(prefix="jaxmem-chromium-") as profile:
        proc = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
             f"--window-size={SIZE[0]},{SIZE[1]}", page.resolve().as_uri() + fragment],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    console = [line for line in proc.stderr.splitlines() if CONSOLE.search(line)]
    if proc.returncode or console or not png.is_file():
        raise RuntimeError(
            f"Chromium failed on {page} (exit {proc.returncode}): "
            + ("\n".join(console) or proc.stderr[-2000:])
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.viewer_screenshot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "_static"), metavar="DIR")
    parser.add_argument("--buffer", metavar="NAME", help="the buffer to open (default: see above)")
    parser.add_argument("--chromium", metavar="PATH", help="the browser (default: on PATH)")
    args = parser.parse_args(argv)
    chromium = args.chromium or next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        print(
            f"no Chromium on PATH ({', '.join(BROWSERS)}): apt-get install chromium",
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = with_relative_sources(profile_demo_gpt())
    name = args.buffer or featured_buffer(report)
    png = out / "viewer.png"
    with tempfile.TemporaryDirectory(prefix="jaxmem-viewer-") as tmp:
        page = report.to_html(pathlib.Path(tmp) / "viewer_demo.html")
        screenshot(chromium, page, "#" + urllib.parse.urlencode({"buffer": name}), png)
    print(f"{report.peak_summary()}\nopened buffer {name}")
    print(f"wrote {png} ({png.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
