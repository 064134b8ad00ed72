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
