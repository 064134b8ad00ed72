"""How a step calls the user's function: :class:`StepOptions`."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a train or eval step calls the user's function, and what it expects back.

    Fields:
      has_aux: the loss returns ``(loss, aux)``.
      aux_reduce: how each aux leaf combines over devices and micro-batches (``"mean"``,
        ``"sum"``, ``"concat"``, or a tree of those; see :mod:`zerojax.sharding.outputs`);
        needs ``has_aux``.
      with_rng: the function is called with ``rng=`` (a key per step, device and
        micro-batch).
      with_model_state: the function is called with ``model_state=`` and returns the new
        model state beside the loss.
      with_layout: the function is called with ``layout=`` (the step's
        :class:`zerojax.context.Layout`).

    ``zj.make_train_step`` and ``zj.make_eval_step`` take these as keywords and build one.

    Example:
      >>> import zerojax as zj
      >>> zj.config.StepOptions(has_aux=True, with_rng=True).keywords()
      {'rng': True, 'model_state': False, 'layout': False}
      >>> zj.config.StepOptions(aux_reduce="sum")
      Traceback (most recent call last):
      ...
      ValueError: aux_reduce says how the loss's aux combines; it needs has_aux=True.
    """

    has_aux: bool = False
    aux_reduce: Any = None
    with_rng: bool = False
    with_model_state: bool = False
    with_layout: bool = False

    def __post_init__(self) -> None:
        for name in ("has_aux", "with_rng", "with_model_state", "with_layout"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}.")
        if self.aux_reduce is not None and not self.has_aux:
            raise ValueError("aux_reduce says how the loss's aux combines; it needs has_aux=True.")

    def keywords(self) -> dict[str, bool]:
        """Which keywords the function is called with: ``{"rng": ..., "model_state": ...,
        "layout": ...}``."""
        return {"rng": self.with_rng, "model_state": self.with_model_state, "layout": self.with_layout}


PLAIN = StepOptions()  # the function called as fn(params, batch), returning the loss alone
