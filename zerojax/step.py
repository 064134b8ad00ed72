"""``make_train_step``: one jitted ZeRO train step for any loss function and optax optimizer."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import compile_cache, nvme, on_stall
from zerojax.config import StepOptions, ZeroConfig
from zerojax.config.step_options import PLAIN
from zerojax.context import batch as context_batch
from zerojax.nvme.driver import Tier
from zerojax.optim import learning_rate
from zerojax.optim import loss_scale as ls
from zerojax.optim.apply import apply_optimizer
from zerojax.optim.offload import choose_place
from zerojax.optim.update import check_optimizer, clip_by_global_norm, keep_if
from zerojax.sharding.mesh import auto_axes, batch_devices, row_split
from zerojax.sharding.partial_axes import warn_partial
from zerojax.sharding.plan import ZeroPlan
from zerojax.stages.gradients import Loss, own_sharding_hint
from zerojax.stages.per_stage import stage_of
from zerojax.state import ZeroState, check_alive, state_shardings


class LossScaleError(RuntimeError):
    """fp16 gradients overflowed at the minimum loss scale.

    ``state`` is the newest state (after the call that raised), still valid: every update
    it holds was finite; the overflowing step changed nothing.
    """

    def __init__(self, message: str, state: ZeroState, metrics: dict):
        super().__init__(message)
        self.state, self.metrics = state, metrics


def _leaves(tree: Any) -> list | None:
    return None if tree is None else jax.tree.leaves(tree)


def _step(
    loss_fn: Callable, tx: Any, options: StepOptions, update_place: str, state: ZeroState, batch: Any
) -> tuple[ZeroState, dict[str, Any]]:
    plan = state.plan
    head = _head(loss_fn, options, state, batch)
    # A non-finite step changes nothing, bit for bit.
    new_masters, opt_state = apply_optimizer(
        plan, tx, head.grads, state.opt_state, head.masters, head.skip_or_none, update_place, state.step
    )
    return _tail(tx, options, state, head, new_masters, opt_state)


@dataclasses.dataclass(frozen=True)
class _Head:
    """What the step computes before the optimizer: the gradients (unscaled, clipped) in the
    masters' layouts, the masters, and whether the step is skipped. A pytree, so that a step
    whose optimizer state is not in the program (the NVMe tier) can return it from one
    compiled program and hand it to the next."""

    value: Any
    aux: Any
    model_state: Any
    grads: list
    masters: list
    grad_norm: Any
    skip: Any
    checks_finite: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def skip_or_none(self) -> Any:
        return self.skip if self.checks_finite else None


jax.tree_util.register_dataclass(_Head)


def _head(loss_fn: Callable, options: StepOptions, state: ZeroState, batch: Any) -> _Head:
    plan = state.plan
    cfg = plan.config
    stage = stage_of(plan)
    scale = state.loss_scale.scale if cfg.scaling else jnp.float32(1.0)
    params = _leaves(state.params)
    masters = stage.masters(plan, params, _leaves(state.master))  # what the optimizer updates
    frozen = _leaves(state.frozen) or []
    rng = jax.random.fold_in(state.rng, state.step) if options.with_rng else None
    model_state = state.model_state if options.with_model_state else None
    loss = Loss.build(plan, loss_fn, batch, options, rng=rng, model_state=model_state)
    if (
        plan.replica and cfg.axes.model_axes is None
    ):  # hybrid mesh: a collective over one batch axis only sees part of the batch
        shape = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), t)
        rows = lambda b: jax.ShapeDtypeStruct(
            (b.shape[0] // (plan.world * cfg.grad_accum_steps),) + b.shape[1:], b.dtype
        )
        warn_partial(
            loss,
            plan.mesh,
            plan.batch_axes,
            (loss.param_shapes, jax.tree.map(rows, batch), shape(rng), shape(model_state)),
        )
    value, aux, new_model_state, grads = stage.grads(loss, params, masters, frozen, batch, scale, rng, model_state)

    grads = [g / scale for g in grads]
    grad_norm = optax.tree.norm(grads)  # over all shards (storage padding is zero): XLA reduces
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(value)
    if cfg.grad_clip is not None:
        grads = clip_by_global_norm(grads, grad_norm, cfg.grad_clip)
    skip = jnp.logical_not(finite) if cfg.checks_finite else jnp.asarray(False)
    return _Head(value, aux, new_model_state, grads, masters, grad_norm, skip, cfg.checks_finite)


def _tail(
    tx: Any, options: StepOptions, state: ZeroState, head: _Head, new_masters: list, opt_state: Any
) -> tuple[ZeroState, dict[str, Any]]:
    """The step after the optimizer: the fields forward reads, the loss scale, the counters, the metrics."""
    plan = state.plan
    cfg = plan.config
    stage = stage_of(plan)
    skip = head.skip
    new_model_state = head.model_state
    if cfg.checks_finite and options.with_model_state:
        new_model_state = keep_if(skip, state.model_state, new_model_state)
    new_params, new_master = stage.fields(plan, new_masters)

    scale = state.loss_scale.scale if cfg.scaling else jnp.float32(1.0)
    scaler, at_min = ls.update(state.loss_scale, skip, cfg) if cfg.scaling else (None, jnp.asarray(False))
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        params=None if new_params is None else plan.unflatten_train(new_params),
        master=None if new_master is None else plan.unflatten_train(new_master),
        opt_state=opt_state,
        model_state=new_model_state if options.with_model_state else state.model_state,
        loss_scale=scaler,
        skipped=state.skipped + skip.astype(jnp.int32),
    )
    metrics = {
        "step": state.step,
        "loss": head.value,
        "grad_norm": head.grad_norm,
        "loss_scale": scale,
        "skipped": skip,
        "skipped_steps": new_state.skipped,
        "overflow_at_min_scale": at_min,
    }
    rate = learning_rate.find(tx, state.opt_state)
    if isinstance(rate, learning_rate.Reader):
        before, after = jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_state)
        metrics["learning_rate"] = rate.read(before, after, functools.partial(_on_device, plan))
    if options.has_aux:
        metrics["aux"] = head.aux
    return new_state, metrics


def _on_device(plan: ZeroPlan, x: jax.Array) -> jax.Array:
    """A scalar read from optimizer state, in device memory (offloaded state is on the host)."""
    if plan.opt_memory is None:
        return x
    return jax.device_put(x, NamedSharding(plan.mesh, P(), memory_kind="device"))


# Seconds an in-flight checkpoint save gets to finish when a step times out.
SAVE_GRACE_S = 60.0


def _wait_or_fail(x: jax.Array, timeout_s: float) -> None:
    """Waits for ``x``; if it is not ready within ``timeout_s``, another process has most
    likely stalled or died mid-collective: this process exits with a clear message
    (status 1) rather than waiting forever. The computation cannot be cancelled, so
    raising would leave the interpreter hanging at exit. An asynchronous checkpoint save
    still running is given a bounded time to finish first; the message says whether it did."""
    done = threading.Event()

    def wait():
        try:
            jax.block_until_ready(x)
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True).start()
    if not done.wait(timeout_s):
        sys.stderr.write(
            f"zerojax: the train step did not finish within timeout_s={timeout_s:g}s on process "
            f"{jax.process_index()}: another process has probably stalled or died and this one is "
            "waiting for it in a collective.\n"
        )
        for line in on_stall.finish_all(max(timeout_s, SAVE_GRACE_S)):
            sys.stderr.write(f"zerojax: {line}\n")
        sys.stderr.write("zerojax: exiting with status 1.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


class TrainStep:
    """A jitted ZeRO train step: ``state, metrics = train_step(state, batch)``.

    Inputs are checked before anything is traced or run. ``lower`` gives the compiled
    program for inspection (``train_step.lower(state, batch).compile()``).

    Metrics: ``step`` (this step's index), ``loss`` (mean over the global batch),
    ``grad_norm`` (global, after unscaling, before clipping), ``loss_scale`` (the scale
    this step's backward ran at), ``skipped`` (this step was skipped for non-finite
    gradients), ``skipped_steps`` (so far), ``overflow_at_min_scale``, and ``aux`` with
    ``has_aux=True`` (its floating "mean" and "sum" leaves combined and returned in
    float32, whatever the compute dtype: see :mod:`zerojax.sharding.outputs`).

    The step consumes (donates) the state it is given unless ``ZeroConfig(donate=False)``:
    continue from the state it returns; passing a consumed state raises ``ValueError``.

    With fp16 dynamic scaling and ``raise_at_min_scale``, an overflow at the minimum scale
    raises :class:`LossScaleError` from the *next* call (or from :meth:`check_loss_scale`),
    so that no step waits for the host to read a flag; the error carries the newest state,
    which holds only finite updates (a skipped step changes nothing).
    """

    def __init__(
        self,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        *,
        mesh: Mesh,
        config: ZeroConfig,
        options: StepOptions = PLAIN,
        timeout_s: float | None = None,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(params, batch), got {loss_fn!r}.")
        check_optimizer(tx)
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}.")
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a zj.config.StepOptions, got {type(options).__name__}.")
        self.n = batch_devices(mesh, config.axes.data, config.axes.replica)
        self.mesh, self.config, self.tx, self.loss_fn = auto_axes(mesh), config, tx, loss_fn
        self.timeout_s = timeout_s
        self._jitted: dict[ZeroPlan, Any] = {}
        self._places: dict[ZeroPlan, str] = {}
        self._compiles = 0
        self._unchecked: tuple[jax.Array, int] | None = None  # (overflow_at_min_scale, step)
        self.options = options
        check_keywords(loss_fn, "loss_fn", **options.keywords())

        def step(state, batch, place="device"):
            self._compiles += 1  # runs once per trace: once per compiled program
            return _step(loss_fn, tx, options, place, state, batch)

        self._step = step

        def head(state, batch):
            self._compiles += 1
            return _head(loss_fn, options, state, batch)

        def tail(state, head, new_masters, opt_state):
            self._compiles += 1
            return _tail(tx, options, state, head, new_masters, opt_state)

        self._nvme_parts = (jax.jit(head), jax.jit(tail))
        self._tiers: dict[ZeroPlan, Any] = {}

    def _jit_for(self, state: ZeroState):
        plan = state.plan
        fn = self._jitted.get(plan)
        if fn is None:
            if plan.with_optimizer(self.tx) != plan:
                raise ValueError(
                    f"state holds the optimizer state {plan.opt_treedef}, but this train step's tx "
                    f"creates {plan.with_optimizer(self.tx).opt_treedef}. Build the state and the "
                    "step with the same optimizer."
                )
            out = state_shardings(plan, state.loss_scale, state.model_state, state.rng)
            step = functools.partial(self._step, place=self.update_place(state))
            fn = jax.jit(
                step,
                out_shardings=(out, plan.replicated),
                donate_argnums=(0,) if self.config.donate else (),
                **compile_cache.jit_options(plan.mesh),
            )
            self._jitted[plan] = fn
        return fn

    def check(self, state: ZeroState, batch: Any) -> None:
        """Raises a clear error for a state or batch this step cannot take."""
        check_state(state, self.config, self.mesh, "train step")
        if self.options.with_rng and state.rng is None:
            raise ValueError(
                "make_train_step(..., with_rng=True) hands the loss a key: build the state with "
                "zj.init_state(..., rng=jax.random.key(seed))."
            )
        if self.options.with_model_state and state.model_state is None:
            raise ValueError(
                "make_train_step(..., with_model_state=True) hands the loss the model state: build "
                "the state with zj.init_state(..., model_state=...)."
            )
        check_batch(batch, *row_split(self.mesh, self.config), self.config.grad_accum_steps)
        context_batch.check(state.plan, batch)

    def __call__(self, state: ZeroState, batch: Any, *extra: Any) -> tuple[ZeroState, dict[str, jax.Array]]:
        if extra:
            raise TypeError(
                f"a zerojax train step is called as step(state, batch) -> (state, metrics); it got "
                f"{2 + len(extra)} arguments. The state holds the parameters and the optimizer state: "
                "state, metrics = step(state, batch)."
            )
        self.check(state, batch)
        batch = place_batch(batch, self.mesh, row_split(self.mesh, self.config)[1])
        with own_sharding_hint(self.config), compile_cache.compiling(state.plan.mesh):
            if self.config.offload.nvme is not None:
                new_state, metrics = self._nvme_step(state, batch)
            else:
                new_state, metrics = self._jit_for(state)(state, batch)
        if self.timeout_s is not None:
            _wait_or_fail(metrics["loss"], self.timeout_s)
        if self.config.dynamic_scaling and self.config.loss_scaling.raise_at_min_scale:
            previous, self._unchecked = self._unchecked, (metrics["overflow_at_min_scale"], metrics["step"])
            if previous is not None:
                self._raise_if_at_min(previous, new_state, metrics)
        return new_state, metrics

    def _nvme_step(self, state: ZeroState, batch: Any) -> tuple[ZeroState, dict[str, jax.Array]]:
        """The step with the optimizer state on disk: the compiled head (to the clipped
        gradients), the disk tier's group-by-group update, the compiled tail."""
        tier = self.nvme_tier(state)
        if not nvme.on_disk(state):
            state = tier.adopt(state)
        head_fn, tail_fn = self._nvme_parts
        head = head_fn(dataclasses.replace(state, opt_state=None), batch)
        new_masters, moved = tier.update(state, head.grads, head.masters, head.skip_or_none, state.step)
        new_state, metrics = tail_fn(
            dataclasses.replace(state, opt_state=nvme.scalars_only(state.opt_state)),
            head,
            new_masters,
            nvme.scalars_only(moved.opt_state),
        )
        return dataclasses.replace(new_state, opt_state=moved.opt_state), metrics

    def nvme_tier(self, state: ZeroState) -> Any:
        """The :class:`zerojax.nvme.driver.Tier` of ``state``'s plan: opened (its directory
        checked, locked and sized) on first use, before any step runs."""
        plan = state.plan
        if plan not in self._tiers:
            if plan.with_optimizer(self.tx) != plan:
                raise ValueError(
                    f"state holds the optimizer state {plan.opt_treedef}, but this train step's tx creates "
                    f"{plan.with_optimizer(self.tx).opt_treedef}. Build the state and the step with the same optimizer."
                )
            self._tiers[plan] = Tier(plan, self.tx, self.config.offload.nvme)
        return self._tiers[plan]

    def close(self) -> None:
        """Releases what the step holds outside the process (the NVMe tier's directory lock)."""
        for tier in self._tiers.values():
            tier.close()
        self._tiers.clear()

    def check_loss_scale(self, state: ZeroState, metrics: dict) -> None:
        """Raises :class:`LossScaleError` now if the last step overflowed at the minimum loss
        scale (the next call would raise it otherwise). Waits for that step."""
        previous, self._unchecked = self._unchecked, None
        if previous is not None:
            self._raise_if_at_min(previous, state, metrics)

    def _raise_if_at_min(self, flag: tuple[jax.Array, Any], state: ZeroState, metrics: dict) -> None:
        at_min, step = flag
        if bool(at_min):
            raise LossScaleError(
                f"Current loss scale already at minimum ({self.config.loss_scaling.min_loss_scale}) and the "
                f"gradients overflowed again at step {int(step)}; that step was skipped. "
                "Lower the learning rate, check the data for non-finite values, use "
                "compute_dtype='bfloat16', or set raise_at_min_scale=False to keep skipping.",
                state,
                metrics,
            )

    def lower(self, state: ZeroState, batch: Any):
        """``jax.jit(...).lower`` of the step: ``.compile()`` it to inspect the program."""
        self.check(state, batch)
        with own_sharding_hint(self.config):
            lowered = self._jit_for(state).lower(state, batch)
        return compile_cache.GuardedLowered(lowered, state.plan.mesh)

    def update_place(self, state: ZeroState) -> str:
        """Where this step runs the optimizer update of ``state`` (see
        ``ZeroConfig.offload.update``): "device" without offloaded state, else "host" or
        "device", with "auto" resolved once per plan by compiling the update in host memory;
        with the NVMe tier "host" where the config says so, "device" otherwise.

        Example:
          >>> import jax.numpy as jnp, optax, zerojax as zj
          >>> cfg = zj.ZeroConfig(stage=2, offload={"optimizer": True})
          >>> st = zj.init_state({"w": jnp.ones((8, 4))}, optax.adam(1e-3), mesh=zj.make_mesh(), config=cfg)
          >>> step = zj.make_train_step(lambda p, x: jnp.sum(x @ p["w"]), optax.adam(1e-3), mesh=zj.make_mesh(), config=cfg)
          >>> step.update_place(st)   # the CPU backend compiles it in host memory
          'host'
        """
        plan = state.plan
        if self.config.offload.nvme is not None:
            return "host" if self.config.offload.update == "host" else "device"
        if plan not in self._places:
            self._places[plan] = choose_place(plan, self.tx, jax.tree.leaves(state.opt_state))
        return self._places[plan]

    def compile_count(self) -> int:
        """Number of programs this step has traced and compiled (one per state layout and
        batch shape; ``lower`` counts too)."""
        return self._compiles


def check_state(state: Any, config: ZeroConfig, mesh: Mesh, what: str) -> None:
    """Raises a clear error for a state that is not one, or not of this config and mesh."""
    if not isinstance(state, ZeroState):
        raise TypeError(f"state must come from zj.init_state, got {type(state).__name__}.")
    if state.plan.config != config or state.plan.mesh != mesh:
        differ = [] if state.plan.config == config else [f"config: {state.plan.config.differences(config)}"]
        if state.plan.mesh != mesh:
            differ.append(f"mesh: {dict(state.plan.mesh.shape)} -> {dict(mesh.shape)}")
        raise ValueError(
            f"state and this {what} were built with different settings (state -> {what}): "
            f"{'; '.join(differ)}. Build both with the same mesh and config (the state's is {state.plan.config})."
        )
    check_alive(state, f"the {what}")


def check_keywords(fn: Callable, name: str, **wanted: bool) -> None:
    """Raises if ``fn(params, batch, **keywords)`` cannot take the keywords asked for."""
    keywords = {k: None for k, on in wanted.items() if on}
    if not keywords:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return
    try:
        sig.bind(None, None, **keywords)
    except TypeError as e:
        flags = ", ".join(f"with_{k}=True" for k in keywords)
        raise TypeError(
            f"{name} is called as {name}(params, batch, {', '.join(f'{k}=...' for k in keywords)}) with {flags}, "
            f"but its signature {sig} does not take that ({e}). Add the parameter(s), e.g. "
            f"def {name}(params, batch, {', '.join(keywords)})."
        ) from None


def check_batch(batch: Any, n: int, axis: str | tuple[str, ...], k: int = 1) -> None:
    """Raises a clear error for a global batch that does not split over the ``n`` devices of
    ``axis`` (one mesh axis, or several) and ``k`` micro-batches."""
    axis = axis if isinstance(axis, str) else " x ".join(axis)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError("batch has no arrays; pass the global batch (leading axis = examples).")
    rows = {}
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        if shape:
            rows.setdefault(shape[0], jax.tree_util.keystr(path) or "<root>")
    if len(rows) > 1:
        (a, name_a), (b, name_b) = list(rows.items())[:2]
        raise ValueError(
            f"batch leaves have different numbers of rows: {name_a} has {a} and {name_b} has {b}. Every "
            "batch leaf is split over the devices along its first dimension, one row per example: give "
            "each leaf the global batch's rows (a per-batch constant belongs in the loss, or repeated per row)."
        )
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        name = jax.tree_util.keystr(path) or "<root>"
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"batch leaf {name} has no leading axis (shape {shape}); every batch leaf "
                f"is split over the {axis!r} axis along its first dimension."
            )
        if shape[0] % n:
            raise ValueError(
                f"batch leaf {name} has leading dimension {shape[0]}, which does not divide "
                f"over the {n} devices of the {axis!r} axis. Use a global batch size that is "
                f"a multiple of {n} (e.g. {max(1, shape[0] // n) * n} or {(shape[0] // n + 1) * n})."
            )
        if (shape[0] // n) % k:
            raise ValueError(
                f"batch leaf {name} has leading dimension {shape[0]}: {shape[0] // n} rows per "
                f"device, which do not split into grad_accum_steps={k} equal micro-batches. "
                f"Use a global batch size that is a multiple of {n * k} (devices x grad_accum_steps)."
            )


def place_batch(batch: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
    """The batch with each leaf committed to one device (a single-device loader's habit:
    ``jax.device_put(x, jax.devices()[0])``) moved onto the mesh, its rows split over
    ``axes`` as the step takes them; other leaves unchanged. In a multi-process job such a
    leaf holds only this process's data and is refused, naming the fix.

    On the CPU backend (one process) every single-device leaf, committed or not, is split
    on the host: the same rows to the same devices as the step's own transfer, without the
    slicing program JAX would otherwise compile for each new shape."""
    if mesh.devices.size == 1:
        return batch
    one_process = jax.process_count() == 1

    def one(path, x):
        if not (isinstance(x, jax.Array) and len(x.sharding.device_set) == 1):
            return x
        committed = getattr(x, "committed", False)
        on_cpu = next(iter(x.sharding.device_set)).platform == "cpu" and one_process
        if not committed and not on_cpu:
            return x
        if not one_process:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} is committed to one device "
                f"({next(iter(x.sharding.device_set))}), but the step splits the global batch over "
                f"{mesh.devices.size} devices of {jax.process_count()} processes. Build the global batch from "
                "each process's rows: zj.distributed.data.global_batch(...) or "
                "jax.make_array_from_process_local_data(...)."
            )
        return jax.device_put(np.asarray(x) if on_cpu else x, NamedSharding(mesh, P(axes)))

    return jax.tree_util.tree_map_with_path(one, batch)


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh,
    config: ZeroConfig,
    has_aux: bool = False,
    aux_reduce: Any = None,
    with_rng: bool = False,
    with_model_state: bool = False,
    with_layout: bool = False,
    timeout_s: float | None = None,
) -> TrainStep:
    """Builds the train step for ``loss_fn(params, batch)`` and optimizer ``tx``.

    ``loss_fn`` sees the full parameter tree (in the compute dtype) and this device's share
    of the batch, exactly as in single-device training; it returns a scalar mean over its
    examples (or ``(scalar, aux)`` with ``has_aux=True``). The step's loss and gradient are
    the mean over devices and micro-batches of those means: the global-batch mean when
    every example weighs the same. **A masked mean** (a count that varies between
    devices) is not: write ``jnp.mean(zj.nn.global_weights(mask) * token_loss)``
    (:func:`zerojax.nn.global_weights`), not ``sum(mask * l) / sum(mask)``.

    ``aux_reduce`` says how each aux leaf combines over devices and micro-batches:
    ``"mean"``, ``"sum"`` or ``"concat"`` (per-example rows, in global batch order), for
    all leaves or as a tree (prefix) of those names (see :mod:`zerojax.sharding.outputs`).
    By default floating scalars are averaged and any other leaf is refused until a rule
    is given.

    ``with_rng=True`` calls ``loss_fn(params, batch, rng=key)`` with a key of its own for
    every step, device and micro-batch, folded from ``state.rng`` (the same at every stage).
    ``with_model_state=True`` calls ``loss_fn(params, batch, model_state=state)`` and expects
    ``(loss, new_model_state)`` back (``(loss, (new_model_state, aux))`` with ``has_aux``);
    the data axis is bound inside the loss, so ``nn.BatchNorm(axis_name=config.axes.data)``
    syncs its statistics over devices. The new state is carried from micro-batch to
    micro-batch, then averaged over the devices (floating leaves; integer ones are taken
    from the first device), and kept unchanged by a skipped step. ``with_layout=True``
    calls ``loss_fn(params, batch, layout=layout)`` with the step's sequence layout (a
    :class:`zerojax.context.Layout`; see ``ZeroConfig.context.layout``), to hand to
    ``zj.nn.dot_product_attention(..., layout=layout)`` and ``zj.nn.global_positions(T,
    layout)``. The keywords are the whole contract: declare them as ordinary parameters if
    you like.

    ``timeout_s`` bounds each step in multi-process jobs: a step that has not finished by
    then (a peer stalled or died inside a collective) ends this process with status 1 and
    a message saying so. It waits for each step, so steps no longer overlap with the next
    one's dispatch; leave it ``None`` on one process.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1)
      >>> params = {"w": jnp.zeros((3, 1))}
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = zj.init_state(params, tx, mesh=mesh, config=cfg)
      >>> step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
      >>> state, metrics = step(state, batch)
      >>> float(metrics["loss"])
      1.0
    """
    options = StepOptions(
        has_aux=has_aux,
        aux_reduce=aux_reduce,
        with_rng=with_rng,
        with_model_state=with_model_state,
        with_layout=with_layout,
    )
    return TrainStep(loss_fn, tx, mesh=mesh, config=config, options=options, timeout_s=timeout_s)
