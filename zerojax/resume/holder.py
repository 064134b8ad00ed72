"""A :class:`zerojax.resume.Run` takes a ZeRO state, or an object that holds one.

``zj.nnx.Optimizer`` holds its :class:`~zerojax.ZeroState` in ``.state`` beside the ``tx``,
``mesh`` and ``config`` it was built with; a run restores such a holder in place (its
``state`` replaced) and saves its state. The run's layer sits below ``zj.nnx``, so the
holder is recognised by those attributes, not by its class.
"""

from __future__ import annotations

from typing import Any

import jax

from zerojax.state import ZeroState


def is_holder(x: Any) -> bool:
    """Whether ``x`` holds a ZeRO state as ``zj.nnx.Optimizer`` does."""
    return (
        not isinstance(x, ZeroState)
        and isinstance(getattr(x, "state", None), ZeroState)
        and all(hasattr(x, a) for a in ("tx", "mesh", "config"))
    )


def state_of(x: Any, what: str) -> ZeroState:
    """``x`` itself, or the state it holds; a TypeError naming ``what`` for anything else."""
    if isinstance(x, ZeroState):
        return x
    if is_holder(x):
        return x.state
    raise TypeError(
        f"{what} takes the ZeroState the step returned, or the zj.nnx.Optimizer it updated; got {type(x).__name__}."
    )


def abstract_of(state: ZeroState) -> ZeroState:
    """``state``'s shapes, dtypes and shardings: a restore target of its own layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
