"""Names that moved from the top level to the subpackage that owns them: they keep working
for one release, with a ``DeprecationWarning`` naming the new place."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# old top-level name -> (module that owns it, the name to write)
MOVED = {
    "StepMemory": ("zerojax.report", "zj.report.StepMemory"),
    "communication_report": ("zerojax.report", "zj.report.communication_report"),
    "compiled_bytes": ("zerojax.report", "zj.report.compiled_bytes"),
    "state_bytes_per_device": ("zerojax.report", "zj.report.state_bytes_per_device"),
    "step_memory": ("zerojax.report", "zj.report.step_memory"),
    "zero_formula_bytes": ("zerojax.report", "zj.report.zero_formula_bytes"),
    "WeightMap": ("zerojax.maps", "zj.maps.WeightMap"),
}


# Modules of compiler settings, not listed at the top level but reachable as ``zj.<name>``
# (imported on first use, as ``import zerojax.<name>`` would).
SUBMODULES = ("compile_cache", "xla_flags")


def module_getattr(name: str) -> Any:
    """The package's ``__getattr__``: a moved name, with a warning; a settings module;
    otherwise AttributeError."""
    if name in SUBMODULES:
        return importlib.import_module(f"zerojax.{name}")
    if name in MOVED:
        module, new = MOVED[name]
        warnings.warn(
            f"zj.{name} moved to {new}; the top-level name will be removed in zerojax 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
