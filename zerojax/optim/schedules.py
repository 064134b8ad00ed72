"""DeepSpeed's learning-rate schedulers as optax schedules.

Each function takes the parameters of the DeepSpeed scheduler of the same name (the
``scheduler.params`` of a DeepSpeed config, same names and defaults) and returns an optax
schedule: a function of the optimizer step count, the number of updates applied so far,
which is what optax passes to a ``learning_rate`` schedule. At every count it gives the
learning rate DeepSpeed's scheduler sets for that optimizer step.

The stepping order is DeepSpeed's (``deepspeed/runtime/lr_schedules.py``, and
``DeepSpeedEngine._take_model_step`` in ``deepspeed/runtime/engine.py``). The scheduler's
constructor sets the learning rate of iteration -1 without stepping (DeepSpeed 0.15.3 and
later); the engine calls ``lr_scheduler.step()`` after each applied optimizer step, which
moves to the next iteration. So the optimizer step with count 0 runs at the constructor's
rate, and the step with count ``k >= 1`` at the rate of iteration ``k - 1``. The
constructor's rate is ``warmup_min_lr`` for WarmupLR and WarmupDecayLR (the same as
iteration 0's), 0.0 for WarmupCosineLR, and the lower bound for OneCycle and LRRangeTest.
DeepSpeed does not step the scheduler after a step it skips for an fp16 overflow; zerojax
keeps the optimizer state (and its count) on a skipped step, so the schedule waits as well.

Example:
  >>> import optax
  >>> from zerojax.optim import schedules
  >>> lr = schedules.warmup_lr(warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear")
  >>> [round(float(lr(k)), 6) for k in range(7)]  # optimizer steps 0..6
  [0.0, 0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001]
  >>> tx = optax.adamw(learning_rate=lr, weight_decay=0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax

WARMUP_TYPES = ("log", "linear")


def _float(x: Any) -> Any:
    return jnp.asarray(x, dtype=jnp.result_type(float))


def _number(name: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value!r}.")
    return float(value)


def _whole(name: str, value: Any, *, minimum: int = 0) -> int:
    number = _number(name, value)
    if number != int(number) or number < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}.")
    return int(number)


def _by_optimizer_step(first: float, at_iteration: Callable[[Any], Any]) -> optax.Schedule:
    """The schedule of a DeepSpeed scheduler: ``first`` (the constructor's rate) at count 0,
    then the rate of iteration ``count - 1``."""

    def schedule(count: Any) -> Any:
        count = jnp.asarray(count)
        iteration = jnp.maximum(count - 1, 0)
        return jnp.where(count <= 0, _float(first), _float(at_iteration(iteration)))

    return schedule


def _warmup(warmup_num_steps: Any, warmup_type: str) -> tuple[int, Callable[[Any], Any]]:
    """DeepSpeed's warm-up length, ``max(2, warmup_num_steps)``, and its gamma: the
    fraction of the way from the start to the peak at an iteration inside the warm-up."""
    steps = _whole("warmup_num_steps", warmup_num_steps)
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}.")
    n = max(2, steps)
    if warmup_type == "log":
        inverse_log = 1.0 / math.log(n)
        return n, lambda it: jnp.log(_float(it) + 1.0) * inverse_log
    return n, lambda it: _float(it) / n


def warmup_lr(
    warmup_max_lr: float, warmup_min_lr: float = 0.0, warmup_num_steps: int = 1000, warmup_type: str = "log"
) -> optax.Schedule:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` up to ``warmup_max_lr`` over
    ``max(2, warmup_num_steps)`` iterations, logarithmically (``"log"``, DeepSpeed's
    default) or linearly, then constant.

    At iteration ``i < n``: ``min + (max - min) * log(i + 1) / log(n)`` (``"log"``) or
    ``min + (max - min) * i / n`` (``"linear"``); from ``n`` on, ``max``. Without
    ``warmup_max_lr`` DeepSpeed takes the optimizer's ``lr`` (0.001 before 0.17.2), so it
    is required here.

    Example:
      >>> from zerojax.optim.schedules import warmup_lr
      >>> lr = warmup_lr(warmup_max_lr=1.0, warmup_num_steps=100)
      >>> [round(float(lr(k)), 4) for k in (0, 1, 2, 3, 11, 101, 500)]
      [0.0, 0.0, 0.1505, 0.2386, 0.5207, 1.0, 1.0]
    """
    low = _number("warmup_min_lr", warmup_min_lr)
    high = _number("warmup_max_lr", warmup_max_lr)
    n, gamma = _warmup(warmup_num_steps, warmup_type)

    def at(it: Any) -> Any:
        return low + (high - low) * jnp.where(it < n, gamma(it), 1.0)

    return _by_optimizer_step(low, at)


def warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> optax.Schedule:
    """DeepSpeed's ``WarmupDecayLR``: :func:`warmup_lr`'s warm-up, then a linear decay
    to 0 at iteration ``total_num_steps``.

    After the warm-up (iteration ``i >= n``, ``n = max(2, warmup_num_steps)``):
    ``min + (max - min) * max(0, (total - i) / max(1, total - n))``. It reaches
    ``warmup_min_lr`` at ``total_num_steps`` and stays there.

    Example:
      >>> from zerojax.optim.schedules import warmup_decay_lr
      >>> lr = warmup_decay_lr(total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4,
      ...                      warmup_type="linear")
      >>> [round(float(lr(k)), 4) for k in range(13)]
      [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.8333, 0.6667, 0.5, 0.3333, 0.1667, 0.0, 0.0]
    """
    low = _number("warmup_min_lr", warmup_min_lr)
    high = _number("warmup_max_lr", warmup_max_lr)
    total = _number("total_num_steps", total_num_steps, minimum=0)
    n, gamma = _warmup(warmup_num_steps, warmup_type)
    decay_steps = max(1.0, total - n)

    def at(it: Any) -> Any:
        decay = jnp.maximum(0.0, (total - _float(it)) / decay_steps)
        return low + (high - low) * jnp.where(it < n, gamma(it), decay)

    return _by_optimizer_step(low, at)


def warmup_cosine_lr(
    total_num_steps: int,
    learning_rate: float,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> optax.Schedule:
    """DeepSpeed's ``WarmupCosineLR``: ``learning_rate`` (the optimizer's ``lr``) times a
    ratio that warms up from ``warmup_min_ratio`` to 1 over ``max(2, warmup_num_steps)``
    iterations, then follows a half cosine down to ``cos_min_ratio`` at
    ``total_num_steps``, and stays there.

    Warm-up ratio: ``warmup_min_ratio + gamma * (1 - warmup_min_ratio)`` with
    :func:`warmup_lr`'s gamma; then, with ``p = min(1, (i - n + 1) / max(1, total - n))``,
    ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2)``. The first
    optimizer step runs at 0.0: DeepSpeed's constructor sets the rate of iteration -1,
    which this scheduler defines as 0 (not ``warmup_min_ratio``).

    Example:
      >>> from zerojax.optim.schedules import warmup_cosine_lr
      >>> lr = warmup_cosine_lr(total_num_steps=8, learning_rate=1.0, warmup_min_ratio=0.5,
      ...                       warmup_num_steps=2, cos_min_ratio=0.0, warmup_type="linear")
      >>> [round(float(lr(k)), 4) for k in range(10)]
      [0.0, 0.5, 0.75, 0.933, 0.75, 0.5, 0.25, 0.067, 0.0, 0.0]
    """
    base = _number("learning_rate", learning_rate)
    total = _number("total_num_steps", total_num_steps, minimum=0)
    low = _number("warmup_min_ratio", warmup_min_ratio)
    floor = _number("cos_min_ratio", cos_min_ratio)
    n, gamma = _warmup(warmup_num_steps, warmup_type)
    decay_steps = max(1.0, total - n)

    def at(it: Any) -> Any:
        warm = low + gamma(it) * (1.0 - low)
        # (1 + cos(pi p)) / 2 = sin(pi (1 - p) / 2) ** 2, exact in float32 near the end too.
        left = jnp.clip((decay_steps - (_float(it) - n + 1.0)) / decay_steps, 0.0, 1.0)
        cosine = jnp.maximum(0.0, floor + (1.0 - floor) * jnp.sin(0.5 * math.pi * left) ** 2)
        return base * jnp.where(it < n, warm, cosine)

    return _by_optimizer_step(0.0, at)


def _cycle(
    cycle_first_step_size: Any, cycle_second_step_size: Any, cycle_first_stair_count: Any, cycle_second_stair_count: Any
) -> tuple[float, Callable[[Any], Any]]:
    """OneCycle's cycle length and its scale (0 at the bounds of the cycle, 1 at its peak)
    at an iteration inside the cycle, stairs included."""
    first = _number("cycle_first_step_size", cycle_first_step_size, minimum=0, strict=True)
    second = (
        first
        if cycle_second_step_size is None
        else _number("cycle_second_step_size", cycle_second_step_size, minimum=0)
    )
    up_stairs = _whole("cycle_first_stair_count", cycle_first_stair_count)
    down_stairs = (
        up_stairs if cycle_second_stair_count is None else _whole("cycle_second_stair_count", cycle_second_stair_count)
    )
    total = first + second
    down = second or 1.0  # the falling half is never used when it is empty

    def scale(it: Any) -> Any:
        position = jnp.mod(_float(it) + 1.0, total)  # DeepSpeed's batch_iteration % total_size
        rising = position <= first
        smooth = jnp.where(rising, position / first, (total - position) / down)
        if not (up_stairs or down_stairs):
            return smooth
        stairs = jnp.where(rising, float(up_stairs), float(down_stairs))
        step = jnp.where(rising, position * stairs / first, (total - position) * stairs / down)
        return jnp.where(stairs > 0, jnp.floor(step) / jnp.maximum(stairs, 1.0), smooth)

    return total, scale


def one_cycle(
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
) -> optax.Schedule:
    """DeepSpeed's ``OneCycle`` learning rate: up from ``cycle_min_lr`` to
    ``cycle_max_lr`` over ``cycle_first_step_size`` iterations, back down over
    ``cycle_second_step_size`` (default: the same), then, if ``decay_step_size`` and
    ``decay_lr_rate`` are both non-zero, ``cycle_min_lr / (1 + decay_lr_rate * d /
    decay_step_size)`` at ``d`` iterations past the cycle (else ``cycle_min_lr``).

    Inside the cycle, at iteration ``i`` with ``b = (i + 1) mod (first + second)``: the
    scale is ``b / first`` rising and ``(first + second - b) / second`` falling; a stair
    count ``s > 0`` for a half holds it at ``floor(scale * s) / s``. The momentum DeepSpeed
    cycles with it is :func:`one_cycle_momentum`.

    Example:
      >>> from zerojax.optim.schedules import one_cycle
      >>> lr = one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=3)
      >>> [round(float(lr(k)), 4) for k in range(9)]
      [0.1, 0.4, 0.7, 1.0, 0.7, 0.4, 0.1, 0.1, 0.1]
    """
    low = _number("cycle_min_lr", cycle_min_lr)
    high = _number("cycle_max_lr", cycle_max_lr)
    total, scale = _cycle(
        cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count
    )
    rate = _number("decay_lr_rate", decay_lr_rate)
    every = _number("decay_step_size", decay_step_size)
    decays = not (math.isclose(every, 0) or math.isclose(rate, 0))

    def at(it: Any) -> Any:
        cycle = low + (high - low) * scale(it)
        after = low / (1.0 + rate * (_float(it) - total + 1.0) / every) if decays else low
        return jnp.where(it < total, cycle, after)

    return _by_optimizer_step(low, at)


def one_cycle_momentum(
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
) -> optax.Schedule:
    """The first beta (momentum) DeepSpeed's ``OneCycle`` sets with ``cycle_momentum``
    (its default) on optimizers with ``betas`` (Adam, AdamW, Lamb, Lion): the mirror image
    of :func:`one_cycle`'s learning rate, from ``cycle_max_mom`` down to
    ``cycle_min_mom`` at the peak and back, then ``cycle_max_mom * (1 + decay_mom_rate *
    d / decay_step_size)`` past the cycle (``cycle_max_mom`` without decay). The first
    optimizer step runs at ``cycle_min_mom`` (DeepSpeed's constructor sets it). DeepSpeed
    sets the second beta to 0.99 at every step: pass ``b2=0.99``.

    Example:
      >>> import optax
      >>> from zerojax.optim.schedules import one_cycle, one_cycle_momentum
      >>> mom = one_cycle_momentum(cycle_first_step_size=2)
      >>> [round(float(mom(k)), 4) for k in range(6)]
      [0.8, 0.85, 0.8, 0.85, 0.9, 0.9]
      >>> tx = optax.inject_hyperparams(optax.adamw)(
      ...     learning_rate=one_cycle(0.01, 0.1, cycle_first_step_size=2), b1=mom, b2=0.99, weight_decay=0.0)
    """
    low = _number("cycle_min_mom", cycle_min_mom)
    high = _number("cycle_max_mom", cycle_max_mom)
    total, scale = _cycle(
        cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count
    )
    rate = _number("decay_mom_rate", decay_mom_rate)
    every = _number("decay_step_size", decay_step_size)
    decays = not (math.isclose(every, 0) or math.isclose(rate, 0))

    def at(it: Any) -> Any:
        cycle = high - (high - low) * scale(it)
        after = high * (1.0 + rate * (_float(it) - total + 1.0) / every) if decays else high
        return jnp.where(it < total, cycle, after)

    return _by_optimizer_step(low, at)


def lr_range_test(
    lr_range_test_min_lr: float = 0.001,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
) -> optax.Schedule:
    """DeepSpeed's ``LRRangeTest``: ``min_lr * (1 + step_rate * (i + 1) / step_size)`` at
    iteration ``i``, with ``floor`` of the interval when ``lr_range_test_staircase``; the
    first optimizer step runs at ``min_lr``.

    Example:
      >>> from zerojax.optim.schedules import lr_range_test
      >>> lr = lr_range_test(lr_range_test_min_lr=0.1, lr_range_test_step_size=2,
      ...                    lr_range_test_staircase=True)
      >>> [round(float(lr(k)), 4) for k in range(6)]
      [0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    """
    low = _number("lr_range_test_min_lr", lr_range_test_min_lr)
    size = _whole("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
    rate = _number("lr_range_test_step_rate", lr_range_test_step_rate)
    if not isinstance(lr_range_test_staircase, bool):
        raise TypeError(f"lr_range_test_staircase must be True or False, got {lr_range_test_staircase!r}.")

    def at(it: Any) -> Any:
        interval = (_float(it) + 1.0) / size
        if lr_range_test_staircase:
            interval = jnp.floor(interval)
        return low * (1.0 + rate * interval)

    return _by_optimizer_step(low, at)


# DeepSpeed's scheduler names (deepspeed/runtime/lr_schedules.py VALID_LR_SCHEDULES).
DEEPSPEED_SCHEDULERS: dict[str, Callable[..., optax.Schedule]] = {
    "WarmupLR": warmup_lr,
    "WarmupDecayLR": warmup_decay_lr,
    "WarmupCosineLR": warmup_cosine_lr,
    "OneCycle": one_cycle,
    "LRRangeTest": lr_range_test,
}
