"""The learning rate a step's update applies, read from the optax transformation itself.

A train step reports ``metrics["learning_rate"]`` with no code from the user when the
transformation says it unambiguously, in one of three ways (checked in this order):

* **injected**: one ``optax.inject_hyperparams(...)(learning_rate=...)`` in the chain; the
  rate is the ``hyperparams["learning_rate"]`` the update wrote into the new state (the
  value it used, schedule or number);
* **schedule**: one ``optax.scale_by_schedule`` (what ``learning_rate=schedule`` builds in
  every optax alias, through ``scale_by_learning_rate``) and no constant ``optax.scale``;
  the rate is ``-step_size_fn(count)`` at the count the update reads, so it follows
  ``MultiSteps``, masked and skipped steps exactly as the update does;
* **constant**: one ``optax.scale`` (``learning_rate=3e-4``) and no schedule: ``-step_size``.

Anything else (two rates under ``optax.multi_transform``, a schedule times a constant,
a hand-written transformation) has no single learning rate: none is reported, and
:func:`find` says why, so a monitor can say so instead of printing a guess.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from zerojax.optim import learning_rate
  >>> tx = optax.adamw(optax.linear_schedule(1e-3, 0.0, 10))
  >>> reader = learning_rate.find(tx, jax.eval_shape(tx.init, {"w": jnp.zeros(3)}))
  >>> reader.kind
  'schedule'
  >>> state = tx.init({"w": jnp.zeros(3)})
  >>> round(float(reader.read(jax.tree.leaves(state), jax.tree.leaves(state))), 6)
  0.001
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

_INJECTED = tuple(
    t
    for t in (getattr(optax, "InjectHyperparamsState", None), getattr(optax, "InjectStatefulHyperparamsState", None))
    if t
)
_SCHEDULE = "scale_by_schedule.<locals>.update_fn"
_CONSTANT = "scale.<locals>.update_fn"


@dataclasses.dataclass(frozen=True)
class Reader:
    """Reads one step's learning rate from the optimizer state's leaves
    (``jax.tree.leaves(opt_state)``) before and after the update.

    ``kind``: ``"injected"``, ``"schedule"`` or ``"constant"``; ``index``: the leaf read
    (the injected hyperparameter in the new state, or the schedule's count in the old);
    ``fn``: the schedule's step-size function; ``value``: the constant rate, or the sign
    the schedule's step size is multiplied by (``optax.scale(-1)`` flips it).
    """

    kind: str
    index: int | None = None
    fn: Callable | None = None
    value: float | None = None

    def read(self, before: list, after: list, fetch: Callable = lambda x: x) -> jax.Array:
        """The rate, as float32; ``fetch`` brings the leaf read where it can be computed on
        (device memory, for optimizer state offloaded to the host)."""
        if self.kind == "injected":
            return jnp.asarray(fetch(after[self.index]), jnp.float32)
        if self.kind == "schedule":
            return -self.value * jnp.asarray(self.fn(fetch(before[self.index])), jnp.float32)
        return jnp.asarray(self.value, jnp.float32)


@dataclasses.dataclass(frozen=True)
class NotFound:
    """No single learning rate: ``reason`` says why and what to do instead."""

    reason: str


def find(tx: Any, opt_state: Any) -> Reader | NotFound:
    """How to read ``tx``'s learning rate from its state (``opt_state`` may be abstract:
    ``jax.eval_shape(tx.init, params)``); :class:`NotFound` with the reason otherwise."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    index = {tuple(p): i for i, p in enumerate(paths)}
    nodes = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: isinstance(x, (optax.ScaleByScheduleState, *_INJECTED))
    )[0]
    injected = [
        index.get((*path, jax.tree_util.GetAttrKey("hyperparams"), jax.tree_util.DictKey("learning_rate")))
        for path, node in nodes
        if isinstance(node, _INJECTED) and "learning_rate" in node.hyperparams
    ]
    counts = [
        index.get((*path, jax.tree_util.GetAttrKey("count")))
        for path, node in nodes
        if isinstance(node, optax.ScaleByScheduleState)
    ]
    fix = (
        "Build the optimizer with optax.inject_hyperparams(...)(learning_rate=...) to have it "
        "reported, or give the rate to the monitor yourself."
    )
    if injected:
        if len(injected) > 1 or injected[0] is None:
            return NotFound(f"{len(injected)} injected learning rates, so no single one. {fix}")
        return Reader("injected", index=injected[0])
    schedules, constants = _scales(tx)
    # optax.scale(-1) (adafactor's sign flip) scales no magnitude: it sets the sign only.
    sign = -1.0 if sum(1 for c in constants if float(c) == -1.0) % 2 else 1.0
    rates = sorted({float(c) for c in constants if abs(float(c)) != 1.0})
    if len(schedules) == 1 and not rates:
        if len(counts) != 1 or counts[0] is None:
            return NotFound(f"one schedule but {len(counts)} schedule counts in the state. {fix}")
        return Reader("schedule", index=counts[0], fn=schedules[0], value=sign)
    if len(rates) == 1 and not schedules:
        return Reader("constant", value=-sign * rates[0])
    if not schedules and not rates:
        return NotFound(f"the transformation scales its updates by no optax schedule or constant. {fix}")
    return NotFound(
        f"the transformation scales its updates by {len(schedules)} schedule(s) and "
        f"{len(rates)} different constant(s), so no single number is its learning rate. {fix}"
    )


def _scales(tx: Any) -> tuple[list[Callable], list[Any]]:
    """The step-size functions of every ``scale_by_schedule`` and the factors of every
    ``scale`` reachable from ``tx`` (closures, partials, bound methods, optax objects)."""
    schedules, constants, seen = [], [], set()

    def cell(fn: Any, name: str) -> Any:
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        return cells[name].cell_contents if name in cells else None

    def walk(x: Any, depth: int) -> None:
        if depth > 40 or id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), jax.Array)):
            return
        seen.add(id(x))
        if isinstance(x, types.FunctionType):
            if x.__qualname__.endswith(_SCHEDULE) and "step_size_fn" in x.__code__.co_freevars:
                schedules.append(cell(x, "step_size_fn"))
                return
            if x.__qualname__.endswith(_CONSTANT) and "step_size" in x.__code__.co_freevars:
                constants.append(cell(x, "step_size"))
                return
            for c in x.__closure__ or ():
                try:
                    walk(c.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(x, types.MethodType):
            walk(x.__self__, depth + 1)
        elif isinstance(x, functools.partial):
            walk(x.func, depth + 1)
            for a in (*x.args, *x.keywords.values()):
                walk(a, depth + 1)
        elif isinstance(x, (tuple, list)):
            for a in x:
                walk(a, depth + 1)
        elif isinstance(x, dict):
            for a in x.values():
                walk(a, depth + 1)
        elif type(x).__module__.startswith("optax") and hasattr(x, "__dict__"):
            for a in vars(x).values():
                walk(a, depth + 1)

    walk(tx, 0)
    unique = {}
    for fn in schedules:  # scale_by_learning_rate's lambda: one per use of the same schedule
        inner = (
            cell(fn, "learning_rate")
            if "learning_rate" in getattr(fn, "__code__", types.SimpleNamespace(co_freevars=())).co_freevars
            else fn
        )
        unique.setdefault((id(inner), cell(fn, "m") if inner is not fn else None), fn)
    return list(unique.values()), constants
