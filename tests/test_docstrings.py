"""Docstring examples of the public API run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import zerojax

MODULES = sorted(m.name for m in pkgutil.walk_packages(zerojax.__path__, "zerojax."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_public_api():
    for name in zerojax.__all__:
        assert hasattr(zerojax, name), name
        assert getattr(zerojax, name).__doc__, f"zerojax.{name} has no docstring"


def test_moved_names_still_resolve_with_a_warning_naming_the_new_place():
    from zerojax._deprecated import MOVED

    for name, (module, new) in MOVED.items():
        with pytest.warns(DeprecationWarning, match=rf"zj\.{name} moved to {new.replace('.', '[.]')}"):
            value = getattr(zerojax, name)
        assert value is getattr(importlib.import_module(module), name)
        assert name not in zerojax.__all__
    assert zerojax.xla_flags.__name__ == "zerojax.xla_flags"  # settings modules: reachable, not listed
    assert "xla_flags" not in zerojax.__all__ and "compile_cache" not in zerojax.__all__
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        zerojax.not_a_name  # noqa: B018
