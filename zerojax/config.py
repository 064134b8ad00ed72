"""Typed, validated configuration of a ZeRO train step."""

from __future__ import annotations

import dataclasses

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How a train step shards model state over the data axis of a mesh.

    Attributes:
      stage: 0 (plain data parallelism), 1 (optimizer state sharded), 2 (optimizer
        state and gradients sharded) or 3 (optimizer state, gradients and parameters
        sharded; parameters are gathered where each layer uses them).
      axis: name of the mesh axis that the batch and the state are split over.
      donate: let the train step reuse the buffers of the state it is given.

    Example:
      >>> import zerojax as zj
      >>> zj.ZeroConfig(stage=3).stage
      3
      >>> zj.ZeroConfig(stage=4)
      Traceback (most recent call last):
      ...
      ValueError: ZeroConfig.stage must be one of (0, 1, 2, 3), got 4. ...
    """

    stage: int = 3
    axis: str = "data"
    donate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(
                f"ZeroConfig.stage must be one of {STAGES}, got {self.stage!r}. "
                "Use 0 for plain data parallelism, 1 to shard optimizer state, 2 to also "
                "shard gradients, 3 to also shard parameters."
            )
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(
                f"ZeroConfig.axis must be a non-empty mesh axis name (str), got {self.axis!r}."
            )
        if not isinstance(self.donate, bool):
            raise TypeError(f"ZeroConfig.donate must be a bool, got {self.donate!r}.")
