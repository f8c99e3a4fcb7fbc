"""Command line of jaxmem: ``python -m jaxmem {demo,profile} [options]``.

Subcommands:
  demo     Memory of a small GPT's training-step gradient under remat and scan configurations:
           prints a comparison table and saves a bar chart (``python -m jaxmem demo --help``).
           The demo is :mod:`jaxmem.demo` (demo code, not library API; also
           ``python -m jaxmem.demo``).
  profile  Memory of your own function: ``python -m jaxmem profile mymodel:make_step``, where
           ``make_step()`` takes no arguments and returns ``(fn, args)`` or
           ``(fn, args, kwargs)``; prints :func:`jaxmem.profile`'s report and the largest
           buffers live at the peak, and writes ``make_step_memory.png`` and
           ``make_step_timeline.png`` (``python -m jaxmem profile --help``). TARGET may also be
           ``path/to/file.py:function``. A bad TARGET is one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser of ``python -m jaxmem``."""
    from jaxmem._src.profile import cli as cli_profile
    from jaxmem.demo import cli as demo  # demo code, imported only when the command line runs

    parser = argparse.ArgumentParser(
        prog="python -m jaxmem",
        description="jaxmem: make JAX training fit in less accelerator memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = sub.add_parser(
        "demo",
        help="memory of a small GPT's training-step gradient: no remat vs checkpoint policies "
        "vs jaxmem.scan; prints a table and saves a bar chart",
        description=demo.DESCRIPTION,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run, check=demo.check_args)
    cli_profile.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``python -m jaxmem`` with ``argv`` (default ``sys.argv[1:]``); returns the status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.check(args)
    except ValueError as e:
        parser.error(str(e))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
