"""What the top level shows: its listing is its public names (``zj.__all__``), and the two
modules of compiler settings (``zj.compile_cache``, ``zj.xla_flags``) load on first use.

Implementation modules (``zerojax.state``, ``zerojax.step``, ``zerojax.sharding``, ...) keep
their import paths for scripts that reach into them, but are not part of the listing."""

from __future__ import annotations

import importlib
from typing import Any

# Modules of compiler settings, not listed at the top level but reachable as ``zj.<name>``
# (imported on first use, as ``import zerojax.<name>`` would).
SUBMODULES = ("compile_cache", "xla_flags")


def module_getattr(name: str) -> Any:
    """The package's ``__getattr__``: a settings module; otherwise AttributeError."""
    if name in SUBMODULES:
        return importlib.import_module(f"zerojax.{name}")
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")


def module_dir(public: list[str]) -> list[str]:
    """The package's ``__dir__``: its public names and its dunders."""
    return sorted(
        set(public) | {"__all__", "__doc__", "__file__", "__name__", "__package__", "__path__", "__version__"}
    )
