"""Sharded, resharding checkpoints on orbax-checkpoint, weight export, and loading weights.

The package has two layers. Below ``zerojax.state`` (which builds a state from weights
through :mod:`~zerojax.checkpoint.born`): the safetensors files
(:mod:`~zerojax.checkpoint.safetensors_files`), boxes, tensor names, the checked cast, maps
(:mod:`~zerojax.checkpoint.tensor_map`), reading (:mod:`~zerojax.checkpoint.weights`,
:mod:`~zerojax.checkpoint.load`) and the processes' agreement. Above it, taking states:
orbax checkpoints (:mod:`~zerojax.checkpoint.io`, :mod:`~zerojax.checkpoint.canonical`) and
the export pipeline (:mod:`~zerojax.checkpoint.export`: sources, map, sinks). This package
imports neither layer itself: its public names load their module on first use, so that
importing one module of the lower layer never imports the state it sits below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "CheckpointMismatchError": "io",
    "Retention": "io",
    "checkpoint_extra": "io",
    "checkpoint_steps": "io",
    "restore_checkpoint": "io",
    "save_checkpoint": "io",
    "wait": "io",
    "export_weights": "export",
    "load_weights": "load",
}

__all__ = [
    "CheckpointMismatchError",
    "Retention",
    "export_weights",
    "checkpoint_extra",
    "checkpoint_steps",
    "load_weights",
    "restore_checkpoint",
    "save_checkpoint",
    "wait",
]

if TYPE_CHECKING:  # pragma: no cover
    from zerojax.checkpoint.export import export_weights
    from zerojax.checkpoint.io import (
        CheckpointMismatchError,
        Retention,
        checkpoint_extra,
        checkpoint_steps,
        restore_checkpoint,
        save_checkpoint,
        wait,
    )
    from zerojax.checkpoint.load import load_weights


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"zerojax.checkpoint.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerojax.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
