"""Building a reference model's parameters: by one compiled program, or as shapes only."""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx


def abstract(model: type, cfg: Any):
    """``(graphdef, params)`` of ``model(cfg, rngs)`` with ``jax.ShapeDtypeStruct`` leaves:
    nothing is allocated, so models larger than the machine can be planned."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: model(cfg, nnx.Rngs(0))), nnx.Param)


def built(model: type, cfg: Any, seed: int):
    """``(graphdef, params)`` of a fresh ``model(cfg, nnx.Rngs(seed))``, its ``nnx.Param``
    leaves built by one compiled program per (model, config, seed) rather than op by op:
    the same random draws (the initialisers' arithmetic rounds within 1e-8), in half the
    time."""
    graphdef, build = _program(model, cfg, seed)
    return graphdef, build()


@functools.cache
def _program(model: type, cfg: Any, seed: int):
    def build():
        with nnx.use_eager_sharding(False):
            return nnx.split(model(cfg, nnx.Rngs(seed)), nnx.Param)[1]

    return abstract(model, cfg)[0], jax.jit(build)
