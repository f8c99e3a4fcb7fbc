"""The public face: every exported name is documented, with a runnable example."""

import importlib
import inspect

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


def test_version():
    assert isinstance(jaxmem.__version__, str)
