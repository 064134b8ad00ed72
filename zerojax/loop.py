"""The training loop a script would write, once: steps over the data, a resumable run, the
monitor, periodic evaluation and an export at the end.

It is not a framework: the loss and the model are the caller's, the step is
:func:`zerojax.make_train_step`'s, and :func:`fit` is the loop below, short enough to read
and copy when a run needs something else.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from zerojax.monitor import Console, Monitor
from zerojax.resume.holder import is_holder, state_of


def fit(
    step: Callable,
    state: Any,
    data: Iterable,
    *,
    steps: int,
    run: Any = None,
    monitor: Monitor | None = None,
    eval_step: Callable | None = None,
    eval_data: Sequence | Callable[[], Iterable] | None = None,
    eval_every: int = 0,
    export: str | os.PathLike | None = None,
    export_options: dict | None = None,
) -> Any:
    """Trains ``state`` with ``step`` on batches from ``data`` until it has taken ``steps``
    steps in all (a resumed run continues from where it stopped); returns the state.
    ``state`` may be a :class:`zerojax.nnx.Optimizer` with ``step`` from
    :func:`zerojax.nnx.make_train_step` (and ``eval_step`` from
    :func:`zerojax.nnx.make_eval_step`): it is trained in place and returned.

    * ``run``: a :class:`zerojax.resume.Run` whose ``restore_or_init`` made ``state`` (with
      ``data=`` the same iterator, so its position resumes): each step is reported to it
      (checkpoints every ``save_every`` steps, a preemption saves and exits), and the last
      step is saved at the end.
    * ``monitor``: a :class:`zerojax.monitor.Monitor` (default: a console line every 10
      steps); ``fit`` watches the step with it and closes it at the end.
    * ``eval_step`` (:func:`zerojax.make_eval_step`, a scalar or a dict of scalars per
      batch) on ``eval_data`` (batches, or a function returning them) every
      ``eval_every`` steps and after the last: the mean over the batches, recorded as
      ``eval_<name>`` (``eval_loss`` for a scalar).
    * ``export``: :func:`zerojax.export_weights` of the final state to this path
      (``export_options``: its keywords, e.g. ``{"format": "hf", "map": ...}``).

    Data that runs out before ``steps`` is an error, not a shorter run.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> mesh = zj.make_mesh(devices=jax.devices()[:1])
      >>> tx = optax.sgd(0.1)
      >>> state = zj.init_state({"w": jnp.ones(3)}, tx, mesh=mesh, config=zj.ZeroConfig())
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
      >>> step = zj.make_train_step(loss, tx, mesh=mesh, config=zj.ZeroConfig())
      >>> batches = iter([{"x": jnp.ones((4, 3))}] * 5)
      >>> history = zj.monitor.History()
      >>> state = zj.fit(step, state, batches, steps=5, monitor=zj.monitor.Monitor([history]))
      >>> int(state.step), len(history.values("loss"))
      (5, 5)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"fit steps must be an int >= 1 (the run's total), got {steps!r}.")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"fit eval_every must be an int >= 0 (0: after the last step only), got {eval_every!r}.")
    if (eval_step is None) != (eval_data is None):
        raise ValueError("fit evaluates with eval_step on eval_data: give both, or neither.")
    if eval_every and eval_step is None:
        raise ValueError(f"fit eval_every={eval_every} needs eval_step and eval_data.")
    monitor = Monitor([Console()]) if monitor is None else monitor
    if not isinstance(monitor, Monitor):
        raise TypeError(f"fit monitor takes a zj.monitor.Monitor, got {type(monitor).__name__}.")
    in_place = is_holder(state)  # a zj.nnx.Optimizer: its step updates it and returns the metrics
    done = run.step if run is not None else int(jax.device_get(state_of(state, "fit").step))
    watched = monitor.watch(step)
    batches = iter(data)
    try:
        while done < steps:
            try:
                batch = next(batches)
            except StopIteration:
                raise ValueError(
                    f"the data ran out after step {done} of {steps}: give an endless iterator (or one "
                    f"with {steps - done} more batches), or fewer steps."
                ) from None
            if in_place:
                watched(state, batch)
            else:
                state, _ = watched(state, batch)
            done += 1
            if run is not None:
                run.completed(state)
            if eval_step is not None and (done == steps or (eval_every and done % eval_every == 0)):
                monitor.write("eval", done, evaluate(eval_step, state, eval_data))
        if run is not None:
            run.finish(state)
    finally:
        monitor.close()
    if export is not None:
        from zerojax.checkpoint import export_weights

        export_weights(state_of(state, "fit's export"), export, **(export_options or {}))
    return state


def evaluate(eval_step: Callable, state: Any, eval_data: Sequence | Callable[[], Iterable]) -> dict[str, float]:
    """The mean of ``eval_step(state, batch)`` over the batches (a scalar, or a dict of
    scalars), as ``{"eval_<name>": value}``."""
    outs = [jax.device_get(eval_step(state, b)) for b in (eval_data() if callable(eval_data) else eval_data)]
    if not outs:
        raise ValueError("eval_data holds no batch.")
    if not isinstance(outs[0], dict):
        outs = [{"loss": o} for o in outs]
    means = {}
    for name in outs[0]:
        values = [np.asarray(o[name]) for o in outs]
        if any(v.size != 1 for v in values):
            raise ValueError(
                f"eval_step returns {name!r} of shape {values[0].shape}; fit records scalars (reduce it with "
                "make_eval_step(..., reduce={name: 'mean'}), or evaluate yourself)."
            )
        means[f"eval_{name}"] = float(np.mean([float(v.reshape(())) for v in values]))
    return means
