"""The ZeRO stages' gradient programs: one object per stage (:mod:`~zerojax.stages.per_stage`)
and the per-device loss and gradients they run (:mod:`~zerojax.stages.gradients`).

This package sits above :mod:`zerojax.sharding` (meshes, layouts, collectives, the per-use
gathers) and :mod:`zerojax.context` (the sequence layout over a context axis), which both
feed it, and below :mod:`zerojax.state` and the steps, which use it."""

from zerojax.stages.per_stage import Stage, stage_of

__all__ = ["Stage", "stage_of"]
