"""The memory viewer on a GPT-style stack, for the docs: docs/_static/viewer.png.

Profiles the gradient of the GPT-style layer stack of :mod:`benchmarks.optimize` (``make_loss``:
4 layers, d_model 256, 4 heads, batch 8 x 128 tokens, scanned with ``jax.lax.scan``) through
``jaxmem.optimize``, from shapes alone, writes :meth:`jaxmem.MemoryReport.to_html` and has
headless Chromium take a 1400x900 screenshot of it with a buffer's details open
(``#buffer=NAME``; by default the largest loop-state buffer live at the peak: one of the stacks
the scan keeps for the backward pass). The page names the model's lines and arguments as any
user's page does; the full paths it shows are made relative to the repository (and to
``site-packages``), so they name no local folder.

Usage: ``python -m tools.viewer_screenshot [--out DIR] [--buffer NAME] [--chromium PATH]``
(default ``--out docs/_static``). Fails, with a message, when Chromium is missing or the page
logs anything on the browser's console.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import jax

import jaxmem
from benchmarks.optimize import Sizes, make_args, make_loss

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = Sizes(layers=4, batch=8, seq=128, d=256, heads=4)
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


def profile_gpt() -> jaxmem.MemoryReport:
    """The memory report of the GPT-style stack's gradient through ``jaxmem.optimize``."""
    loss = jaxmem.optimize(make_loss(SIZES, jax.lax.scan))
    params, x = jax.eval_shape(lambda: make_args(SIZES))
    return jaxmem.profile(jax.grad(loss), params, x)


def relative_paths(page: str) -> str:
    """The page's text with each full path made relative: ``/any/where/site-packages/flax/x.py``
    -> ``flax/x.py``, a file of this repository relative to its root. Labels, already short
    (``x.py:3 (f)``), are left as they are."""
    page = page.replace(f"{ROOT}{os.sep}", "")
    return re.sub(r"""[^"'\s:]*[/\\]site-packages[/\\]""", "", page)


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
    report = profile_gpt()
    name = args.buffer or featured_buffer(report)
    png = out / "viewer.png"
    with tempfile.TemporaryDirectory(prefix="jaxmem-viewer-") as tmp:
        page = report.to_html(pathlib.Path(tmp) / "viewer_gpt.html")
        page.write_text(relative_paths(page.read_text(encoding="utf-8")), encoding="utf-8")
        screenshot(chromium, page, "#" + urllib.parse.urlencode({"buffer": name}), png)
    print(f"{report.peak_summary()}\nopened buffer {name}")
    print(f"wrote {png} ({png.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
