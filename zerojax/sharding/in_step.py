"""Which step's loss is being traced: read by functions a loss calls that must know how
the step splits the batch (:func:`zerojax.nn.global_weights`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_PLAN: contextvars.ContextVar[Any] = contextvars.ContextVar("zerojax_step_plan", default=None)


@contextlib.contextmanager
def tracing(plan: Any, micro_batches: int) -> Iterator[None]:
    """Marks the function called inside as the loss (or eval function) of a step built on
    ``plan`` (a ZeroPlan), running ``micro_batches`` micro-batches per step."""
    token = _PLAN.set((plan, micro_batches))
    try:
        yield
    finally:
        _PLAN.reset(token)


def current() -> tuple[Any, int] | None:
    """``(plan, micro_batches)`` of the step whose function is being traced, or None
    outside a step."""
    return _PLAN.get()
