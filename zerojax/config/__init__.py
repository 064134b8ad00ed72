"""The configuration of a ZeRO train step: :class:`ZeroConfig` and its groups.

Why the groups are the ones they are: docs/design.md ("ZeroConfig's groups").
"""

from zerojax.config.groups import Axes, Collectives, ContextParallel, LossScaling, NVMe, Offload, Pipeline, StateDtypes
from zerojax.config.step_options import StepOptions
from zerojax.config.zero import COMPUTE_DTYPES, STAGES, ZeroConfig

__all__ = [
    "COMPUTE_DTYPES",
    "STAGES",
    "Axes",
    "Collectives",
    "ContextParallel",
    "Pipeline",
    "LossScaling",
    "NVMe",
    "Offload",
    "StateDtypes",
    "StepOptions",
    "ZeroConfig",
]
