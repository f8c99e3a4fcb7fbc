"""``python -m jaxmem profile TARGET``: the memory report of one's own function, from a shell.

TARGET names a zero-argument function, ``module.path:function`` (imported; the current
directory is put on ``sys.path`` first, as ``python -m`` does) or ``path/to/file.py:function``
(loaded from the file; its directory is put on ``sys.path``, as ``python file.py`` does). The
function returns ``(fn, args)`` or ``(fn, args, kwargs)``; ``fn(*args, **kwargs)`` is what
:func:`jaxmem.profile` compiles (nothing is run, so arguments may be ``jax.ShapeDtypeStruct``).
The command prints the report and the largest buffers live at the peak, and writes two plots
(and, with ``--html``, the interactive memory viewer: :meth:`jaxmem.MemoryReport.to_html`).

Whatever goes wrong with TARGET (no such module or file, no such function, a function that
needs arguments or raises, a return value of the wrong shape) or with profiling it is reported
in one line on stderr, with exit status 2 and no traceback (``--traceback`` shows it).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import textwrap
import traceback
import types
from collections.abc import Callable
from typing import Any

from jaxmem._src import checks
from jaxmem._src.format import format_bytes
from jaxmem._src.profile.buffers import Buffer
from jaxmem._src.profile.compare import Comparison
from jaxmem._src.profile.report import MemoryReport, ProfileError, profile
from jaxmem._src.profile.timeline import buffer_label

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "TargetError",
    "add_arguments",
    "add_parser",
    "call_target",
    "check_args",
    "load_target",
    "run",
]

PROG = "python -m jaxmem profile"

CONTRACT = "(fn, args) or (fn, args, kwargs)"

DESCRIPTION = (
    "Memory of your own function: where is the peak? TARGET names a function of no arguments "
    f"that returns {CONTRACT}: fn is the function to profile (e.g. jax.grad(loss) or a jitted "
    "training step), args a tuple of its positional arguments, kwargs a dict of keyword "
    "arguments. Arguments may be arrays or jax.ShapeDtypeStruct: fn is compiled, never run. "
    "Prints jaxmem.profile's report and the largest buffers live at the peak, and writes "
    "<function>_memory.png and <function>_timeline.png; with --html also <function>_memory.html, "
    "an interactive viewer of the buffers (one self-contained file: open it in a browser)."
)

EPILOG = """\
TARGET is module.path:function (imported with the current directory on sys.path,
as python -m does) or path/to/file.py:function. For example, with mymodel.py in
the current directory:

  # mymodel.py
  import jax, jax.numpy as jnp

  def loss(params, batch):
      ...

  def make_step():
      params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)}
      batch = jax.ShapeDtypeStruct((32, 4096), jnp.bfloat16)
      return jax.grad(loss), (params, batch)

  python -m jaxmem profile mymodel:make_step --out plots/ --html

prints the report and writes plots/make_step_memory.png,
plots/make_step_timeline.png and plots/make_step_memory.html (the viewer).
A bad TARGET (no such module or function, not callable, needs arguments,
raises, returns anything but (fn, args) or (fn, args, kwargs)) or a failed
compile is one line on stderr, exit status 2.
"""


class TargetError(Exception):
    """TARGET cannot be loaded, called or profiled; the message is one line for the user."""


# --------------------------------------------------------------------------------------------
# Loading TARGET


def split_target(spec: str) -> tuple[str, str]:
    """Splits ``module:function`` or ``file.py:function`` at its last colon.

    Raises:
      TargetError: no colon, or an empty side.

    Examples:
        >>> split_target("mymodel:make_step")
        ('mymodel', 'make_step')
        >>> split_target("C:\\\\models\\\\gpt.py:make")
        ('C:\\\\models\\\\gpt.py', 'make')
    """
    location, colon, attr = spec.rpartition(":")
    if not colon or not location or not attr:
        raise TargetError(
            f"TARGET {spec!r} must be MODULE:FUNCTION or FILE.py:FUNCTION, "
            "e.g. mymodel:make_step or path/to/mymodel.py:make_step"
        )
    return location, attr


def _is_file(location: str) -> bool:
    return location.endswith(".py") or os.sep in location or "/" in location


def _import_module(name: str) -> types.ModuleType:
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            raise TargetError(
                f"no module named {missing!r} (looked in the current directory {cwd} and on "
                "sys.path; for a file, write path/to/file.py:FUNCTION)"
            ) from e
        raise TargetError(f"importing module {name!r} failed: {_exception_line(e)}") from e
    except Exception as e:
        raise TargetError(f"importing module {name!r} failed: {_exception_line(e)}") from e


def _load_file(path: str) -> types.ModuleType:
    if not os.path.isfile(path):
        what = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise TargetError(f"{path}: {what} (TARGET is FILE.py:FUNCTION or MODULE:FUNCTION)")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem.isidentifier() and stem not in sys.modules else f"_jaxmem_target_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path}: cannot be loaded as a Python module (is it a .py file?)")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # sibling imports work, as with python path/to/file.py
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise TargetError(f"loading {path} failed: {_exception_line(e)}") from e
    return module


def _callables(module: types.ModuleType) -> list[str]:
    """Public callables of ``module``, those defined in it first."""
    own, other = [], []
    for key, value in vars(module).items():
        if key.startswith("_") or not callable(value) or isinstance(value, types.ModuleType):
            continue
        (own if getattr(value, "__module__", None) == module.__name__ else other).append(key)
    return sorted(own) + sorted(other)


def _no_attribute(module: types.ModuleType, where: str, attr: str) -> TargetError:
    names = _callables(module)
    close = difflib.get_close_matches(attr, names, n=3)
    shown = close + [n for n in names if n not in close]
    listed = ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "")
    there = f"; callables there: {listed}" if names else "; it defines no public callables"
    return TargetError(f"{where} has no attribute {attr!r}{there}")


def load_target(spec: str) -> tuple[Callable[..., Any], str]:
    """Imports TARGET's module (or file) and returns its function and the function's name.

    Args:
      spec: ``module.path:function`` or ``path/to/file.py:function``; ``function`` may be
        dotted (``Model.make_step``).

    Returns:
      The callable, and the last component of its name (for the plot files).

    Raises:
      TargetError: no colon, no such module or file, the module fails to import, no such
        attribute (the message lists callables that are there), or the attribute is not
        callable.
    """
    location, attr = split_target(spec)
    if _is_file(location):
        module, where = _load_file(location), location
    else:
        module, where = _import_module(location), f"module {location!r}"
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            if i == 0:
                raise _no_attribute(module, where, part)
            raise TargetError(f"{where}: {'.'.join(attr.split('.')[:i])} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(
            f"{spec} is a {_describe(obj)}, not a function; TARGET must name a function of no "
            f"arguments that returns {CONTRACT}"
        )
    return obj, attr.rpartition(".")[2]


# --------------------------------------------------------------------------------------------
# Calling TARGET


def _required_parameters(factory: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and (p.kind in kinds or p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]


def call_target(
    factory: Callable[..., Any], spec: str
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Calls TARGET with no arguments and checks that it returned ``(fn, args[, kwargs])``.

    Returns:
      ``fn``, ``args`` as a tuple and ``kwargs`` (``{}`` when not returned).

    Raises:
      TargetError: the call raised (a function with required parameters is told it must
        take none), or the return value is not ``(fn, args)`` or ``(fn, args, kwargs)`` with
        ``fn`` callable, ``args`` a tuple or list and ``kwargs`` a dict.
    """
    try:
        out = factory()
    except Exception as e:
        required = _required_parameters(factory)
        if isinstance(e, TypeError) and required:
            raise TargetError(
                f"{spec} must take no arguments (it has {', '.join(required)}); give them "
                f"defaults or wrap it; calling it raised {_exception_line(e)}"
            ) from e
        raise TargetError(f"calling {spec}() raised {_exception_line(e)}") from e
    expected = f"expected {CONTRACT}"
    if not isinstance(out, tuple | list) or len(out) not in (2, 3):
        if isinstance(out, tuple | list):
            got = f"a {type(out).__name__} of {len(out)}"
        elif callable(out):
            got = f"the function {checks.fn_name(out)} alone, without its arguments"
        else:
            got = _describe(out)
        raise TargetError(f"{spec}() returned {got}; {expected}")
    fn, args, kwargs = (*out, {}) if len(out) == 2 else out
    if not callable(fn):
        raise TargetError(f"{spec}() returned fn = {_describe(fn)}, not callable; {expected}")
    if not isinstance(args, tuple | list):
        raise TargetError(
            f"{spec}() returned args = {_describe(args)}, not a tuple or list; {expected} "
            "(one argument x: (fn, (x,)))"
        )
    if not isinstance(kwargs, dict):
        raise TargetError(f"{spec}() returned kwargs = {_describe(kwargs)}, not a dict; {expected}")
    return fn, tuple(args), kwargs


# --------------------------------------------------------------------------------------------
# The command


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``profile`` subcommand to the subparsers of ``python -m jaxmem``; returns it."""
    parser = subparsers.add_parser(
        "profile",
        help="memory of your own function: python -m jaxmem profile mymodel:make_step prints "
        "the report and the largest buffers live at the peak, and writes the plots",
        description=textwrap.fill(DESCRIPTION, 79),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(run=run, check=check_args)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the arguments of ``python -m jaxmem profile`` to ``parser``."""
    parser.add_argument(
        "target",
        metavar="TARGET",
        help=f"module.path:function or path/to/file.py:function; the function takes no "
        f"arguments and returns {CONTRACT}",
    )
    parser.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="directory for <function>_memory.png, <function>_timeline.png and, with --html, "
        "<function>_memory.html (created if missing; default: the current directory)",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="N",
        help="how many of the buffers live at the peak to list (default: %(default)s)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON (report.to_json()) to PATH"
    )
    parser.add_argument(
        "--html",
        action="store_true",
        help="also write <function>_memory.html in the --out directory: an interactive viewer "
        "of the timeline and the buffers, one file with no network access (report.to_html())",
    )
    parser.add_argument(
        "--against",
        metavar="TARGET_B",
        help="also profile TARGET_B (same contract) and print what is live at each peak, source "
        "by source (jaxmem.compare(...).diff(), the --top largest changes); with --html, write "
        "<function>_comparison.html, the viewer of both with the diff, instead of the plots",
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an error in TARGET's code or in profiling, show the traceback, not one line",
    )


def check_args(args: argparse.Namespace) -> None:
    """Checks the parsed options before TARGET is loaded.

    Raises:
      ValueError: ``--top`` below 0.
    """
    if args.top < 0:
        raise ValueError(f"--top must be 0 or more, got {args.top}")


def run(args: argparse.Namespace) -> int:
    """Runs ``python -m jaxmem profile`` for parsed options; returns the exit status.

    Returns:
      0 after printing the report and writing the plots; 2 after printing a one-line error
      on stderr (the traceback too with ``--traceback``).
    """
    try:
        name, report = _profile_target(args.target)
        other = None if args.against is None else _profile_target(args.against)
    except TargetError as e:
        if args.traceback and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        return _error(str(e))
    print(report)
    if report.buffers is not None and args.top:
        _print_peak_buffers(report.peak_buffers, args.top)
    print(f"\n{args.target}: {report.peak_summary()}")
    if other is not None:
        return _run_against(args, name, report, other[1])
    try:
        written = _write_outputs(report, name, args.out, args.json, args.html)
    except OSError as e:
        return _error(f"writing the outputs failed: {_exception_line(e)}")
    for path in written:
        print(f"wrote {path}")
    if report.buffers is None:
        print(f"no timeline plot: no buffer-level view ({_one_line(str(report.buffer_error))})")
    return 0


def _profile_target(target: str) -> tuple[str, MemoryReport]:
    """Loads ``target``, calls it and profiles what it returns: ``(its name, the report)``."""
    factory, name = load_target(target)
    fn, fn_args, fn_kwargs = call_target(factory, target)
    try:
        return name, profile(fn, *fn_args, **fn_kwargs)
    except ProfileError as e:  # its message names the stage, the function and the cause
        raise TargetError(f"{target}: {_exception_line(e, with_type=False)}") from e
    except TypeError as e:  # an argument JAX cannot trace, named by its pytree path
        raise TargetError(f"{target}: {_exception_line(e)}") from e


def _run_against(args: argparse.Namespace, name: str, a: MemoryReport, b: MemoryReport) -> int:
    """``--against``: B's peak, then the diff of the two peaks (and the comparison's viewer)."""
    print(f"{args.against}: {b.peak_summary()}\n")
    if a.buffers is None or b.buffers is None:
        why = a.buffer_error if a.buffers is None else b.buffer_error
        return _error(f"no diff: no buffer-level view ({why})")
    comparison = Comparison({args.target: a, args.against: b})
    print(comparison.diff().to_text(args.top or None))
    if args.html:
        try:
            os.makedirs(args.out, exist_ok=True)
            path = comparison.to_html(os.path.join(args.out, f"{name}_comparison.html"))
        except OSError as e:
            return _error(f"writing the outputs failed: {_exception_line(e)}")
        print(f"wrote {path}")
    return 0


def _print_peak_buffers(buffers: tuple[Buffer, ...], top: int) -> None:
    """The largest ``top`` buffers live at the peak, with their ``op_name``."""
    rows = [
        (
            format_bytes(b.bytes),
            "loop state" if b.loop_state else b.kind,
            f"{b.dtype}{list(b.shape)}",
            buffer_label(b),
            (b.op_name or "-") + (" (backward)" if b.backward else ""),
        )
        for b in buffers[:top]
    ]
    header = ("size", "kind", "shape", "source", "op_name")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print(f"Top {len(rows)} of {len(buffers)} buffers live at the peak:")
    for r in [header, *rows]:
        size, *middle, op_name = r
        padded = [c.ljust(w) for c, w in zip(middle, widths[1:], strict=True)]
        cells = [size.rjust(widths[0]), *padded]
        print("  " + "  ".join([*cells, op_name]))


def _write_outputs(
    report: MemoryReport, name: str, out: str, json_path: str | None, html: bool
) -> list[str]:
    os.makedirs(out, exist_ok=True)
    written = [str(report.plot(os.path.join(out, f"{name}_memory.png")))]
    if report.buffers is not None:
        written.append(str(report.plot_timeline(os.path.join(out, f"{name}_timeline.png"))))
    if html:
        written.append(str(report.to_html(os.path.join(out, f"{name}_memory.html"))))
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(report.to_json(indent=2))
        written.append(json_path)
    return written


# --------------------------------------------------------------------------------------------
# One-line messages


def _error(message: str) -> int:
    """Prints ``message`` as one line on stderr, argparse's way; returns the exit status 2."""
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _exception_line(e: BaseException, with_type: bool = True) -> str:
    """``TypeError: first line of the message`` (JAX's messages run over many lines)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if not with_type:
        return first or type(e).__name__
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    return _one_line(checks.describe(x))
