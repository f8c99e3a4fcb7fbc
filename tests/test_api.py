"""The public face: every exported name is documented, with a runnable example."""

import ast
import importlib
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import jaxmem

PUBLIC_MODULES = ["jaxmem"] + [
    f"jaxmem.{m}"
    for m in ("policies", "offload", "losses", "flax.linen", "flax.nnx")
    if importlib.util.find_spec(f"jaxmem.{m}")
]


def _public(module_name):
    module = importlib.import_module(module_name)
    for name in module.__all__:
        yield module_name, name, getattr(module, name)


ALL = [item for m in PUBLIC_MODULES for item in _public(m)]


def test_all_is_sorted_and_complete():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        assert list(module.__all__) == sorted(module.__all__), module_name
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.{name} is in __all__ but missing"


@pytest.mark.parametrize("module_name,name,obj", ALL, ids=[f"{m}.{n}" for m, n, _ in ALL])
def test_every_public_name_is_documented(module_name, name, obj):
    if not (inspect.ismodule(obj) or callable(obj)):
        # A constant: documented where its public neighbours' docstrings describe it.
        module = importlib.import_module(module_name)
        docs = [inspect.getdoc(getattr(module, n)) or "" for n in module.__all__ if n != name]
        assert any(name in d for d in docs), f"{module_name}.{name} is documented nowhere"
        return
    if inspect.ismodule(obj):
        doc = obj.__doc__
    else:
        doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"{module_name}.{name} has no docstring"
    if (inspect.isfunction(obj) or inspect.isclass(obj)) and not issubclass_exception(obj):
        assert ">>>" in doc, f"{module_name}.{name} has no doctested example"


def issubclass_exception(obj):
    return inspect.isclass(obj) and issubclass(obj, BaseException)


@pytest.mark.parametrize("old, new", [("Plan", "RematPlan"), ("ScanPlan", "ScanResiduals")])
def test_renamed_names_resolve_with_a_deprecation_warning(old, new):
    with pytest.warns(DeprecationWarning, match=f"jaxmem.{old} is deprecated; use jaxmem.{new}"):
        obj = getattr(jaxmem, old)
    assert obj is getattr(jaxmem, new)
    assert old not in jaxmem.__all__ and old not in dir(jaxmem)
    with pytest.raises(AttributeError, match="no attribute 'Plans'"):
        jaxmem.Plans  # noqa: B018


def test_version():
    assert isinstance(jaxmem.__version__, str)


def _run_python(code):
    """Runs ``code`` in a fresh interpreter (this one, same environment); fails with its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_import_does_not_import_flax():
    _run_python(
        "import jaxmem, sys; assert 'flax' not in sys.modules, 'import jaxmem imported flax'"
    )


def test_works_without_flax():
    # sys.modules["flax"] = None makes `import flax` raise ImportError, as when it is not installed.
    _run_python(
        """
import sys
sys.modules["flax"] = None
import jax.numpy as jnp
import jaxmem

carry, ys = jaxmem.scan(lambda c, x: (c + x, c), 0.0, jnp.arange(3.0))
assert float(carry) == 3.0 and ys.tolist() == [0.0, 0.0, 1.0], (carry, ys)
try:
    jaxmem.flax
except ImportError as e:
    assert "pip install 'jaxmem[flax]'" in str(e), str(e)
else:
    raise AssertionError("jaxmem.flax without flax raised no ImportError")
"""
    )


ROOT = Path(__file__).resolve().parents[1]
# The one module that may reach into JAX's private internals (jax._src); all else goes through it.
JAX_COMPAT = ROOT / "src" / "jaxmem" / "_src" / "jax_compat.py"


def _imports_jax_src(node):
    def private(module):
        return module == "jax._src" or module.startswith("jax._src.")

    if isinstance(node, ast.Import):
        return any(private(alias.name) for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return private(node.module) or (
            node.module == "jax" and any(private(f"jax.{alias.name}") for alias in node.names)
        )
    return False


def test_only_jax_compat_imports_jax_src():
    offenders = []
    for folder in ("src", "tests", "benchmarks"):
        assert (ROOT / folder).is_dir(), folder
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == JAX_COMPAT:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for node in ast.walk(tree)
                if _imports_jax_src(node)
            ]
    assert not offenders, f"import jax._src outside {JAX_COMPAT.relative_to(ROOT)}: {offenders}"


def test_a_clone_named_jaxmem_beside_a_script_does_not_shadow_the_package(tmp_path):
    # The usual place for a clone is ./jaxmem/ next to one's scripts. Python puts the script's
    # folder first on sys.path; with the package at the repository root, `import jaxmem` found the
    # clone as an empty namespace package there. Under src/ it finds the installed package.
    (tmp_path / "jaxmem").symlink_to(ROOT, target_is_directory=True)
    script = tmp_path / "train.py"
    script.write_text("import jaxmem\nprint(jaxmem.__file__)\nprint(jaxmem.scan.__name__)\n")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    path, name = result.stdout.split()
    installed = "site-packages" in path
    assert installed or Path(path).resolve() == ROOT / "src" / "jaxmem" / "__init__.py", path
    assert name == "scan"


def test_warn_once_warns_once_from_many_threads():
    # The planner compiles candidates in threads: a warning given "once per process" must not be
    # given by two threads that race past the check.
    import concurrent.futures  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from jaxmem._src import checks  # noqa: PLC0415

    key = f"test-key-{threading.get_ident()}"
    barrier = threading.Barrier(8)

    def call(_):
        barrier.wait()
        return checks.warn_once(key, lambda: "once", UserWarning, 1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            warned = list(pool.map(call, range(8)))
    assert sum(warned) == 1
    assert [str(w.message) for w in caught] == ["once"]
