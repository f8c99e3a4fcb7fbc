"""The attributes optimize replaces while it traces: restored as they were, acting per thread."""

import threading

import pytest

from jaxmem._src.optimize import patching


class _Bound:
    def bind(self):
        return "class"


def test_an_instance_attribute_is_removed_again_and_a_module_one_restored():
    thing = _Bound()
    module = type(threading)("fake")
    module.f = original = lambda: "original"
    with patching.replaced(thing, "bind", lambda: "replaced", "state"):
        with patching.replaced(module, "f", lambda: "replaced", "state"):
            assert thing.bind() == module.f() == "replaced"
    assert "bind" not in vars(thing) and thing.bind() == "class"
    assert module.f is original


def test_states_nest_per_thread_and_passing_hides_them():
    thing, seen = _Bound(), {}
    with patching.replaced(thing, "bind", None, "outer"):
        with patching.replaced(thing, "bind", None, "inner"):
            assert patching.top(thing, "bind") == "inner"
            with patching.passing(thing, "bind"):
                assert patching.top(thing, "bind") is None
            other = threading.Thread(target=lambda: seen.update(top=patching.top(thing, "bind")))
            other.start()
            other.join()
        assert patching.top(thing, "bind") == "outer"
    assert seen == {"top": None}
    assert patching.top(thing, "bind") is None


def test_restored_after_an_exception():
    thing = _Bound()
    with pytest.raises(ValueError), patching.replaced(thing, "bind", lambda: 1, "state"):
        raise ValueError
    assert thing.bind() == "class"
