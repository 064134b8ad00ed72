"""Sharded, resharding checkpoints on orbax-checkpoint, weight export, and loading weights.

This package sits above :mod:`zerojax.state`, whose states it saves, restores and exports:
orbax checkpoints (:mod:`~zerojax.checkpoint.io`, :mod:`~zerojax.checkpoint.canonical`),
the export pipeline (:mod:`~zerojax.checkpoint.export`: sources, map, sinks) and
``load_weights`` (:mod:`~zerojax.checkpoint.load`). What the state itself needs to be born
from pretrained weights (the safetensors files, tensor names, the checked cast, maps and
reading into a plan's storage) is :mod:`zerojax.tensors`, below the state. Its public names
load their module on first use.
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
