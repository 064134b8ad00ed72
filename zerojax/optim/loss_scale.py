"""DeepSpeed's dynamic loss scaling for fp16, as a pure function of a small state.

Semantics (DeepSpeed ``DynamicLossScaler.update_scale``, defaults: initial scale 2**16,
window 1000, hysteresis 2, consecutive_hysteresis False, min scale 1):

* overflow: if the hysteresis counter is 1, the scale halves (not below the minimum);
  otherwise the counter drops by one. The overflow step is remembered.
* no overflow: with consecutive hysteresis the counter is refilled. When the number of
  steps since the last overflow, minus one, is a positive multiple of the window, the
  scale doubles (and the counter is refilled when not consecutive).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from zerojax.config import ZeroConfig


class LossScaleState(NamedTuple):
    scale: jax.Array  # f32[]: the scale the next step multiplies the loss by
    iteration: jax.Array  # i32[]: steps seen (DeepSpeed's cur_iter)
    last_overflow: jax.Array  # i32[]: iteration of the last overflow, -1 if none
    hysteresis: jax.Array  # i32[]: overflows still tolerated before the scale halves


def init(config: ZeroConfig) -> LossScaleState | None:
    """The scaler's state for ``config``; ``None`` when the loss is not scaled."""
    if not config.scaling:
        return None
    scale = 2.0**config.loss_scaling.initial_scale_power if config.dynamic_scaling else config.resolved_loss_scale
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        iteration=jnp.asarray(0, jnp.int32),
        last_overflow=jnp.asarray(-1, jnp.int32),
        hysteresis=jnp.asarray(config.loss_scaling.hysteresis, jnp.int32),
    )


def update(state: LossScaleState, overflow: jax.Array, config: ZeroConfig) -> tuple[LossScaleState, jax.Array]:
    """Next scaler state after a step; also whether an overflow hit the minimum scale."""
    if not config.dynamic_scaling:  # static scale: never changes
        return state._replace(iteration=state.iteration + 1), jnp.asarray(False)
    full = jnp.asarray(config.loss_scaling.hysteresis, jnp.int32)
    halve = overflow & (state.hysteresis <= 1)
    at_min = halve & (state.scale <= config.loss_scaling.min_loss_scale)
    scale_o = jnp.where(halve, jnp.maximum(state.scale / 2.0, config.loss_scaling.min_loss_scale), state.scale)
    hyst_o = jnp.where(halve, state.hysteresis, state.hysteresis - 1)

    hyst_c = full if config.loss_scaling.consecutive_hysteresis else state.hysteresis
    stable = state.iteration - state.last_overflow - 1
    grow = (stable > 0) & (stable % config.loss_scaling.loss_scale_window == 0)
    scale_c = jnp.where(grow, state.scale * 2.0, state.scale)
    hyst_c = jnp.where(grow, full, hyst_c)

    new = LossScaleState(
        scale=jnp.where(overflow, scale_o, scale_c),
        iteration=state.iteration + 1,
        last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
        hysteresis=jnp.where(overflow, hyst_o, hyst_c).astype(jnp.int32),
    )
    return new, at_min
