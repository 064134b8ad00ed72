"""Per-device loss and gradients, with every collective explicit.

The user's loss runs inside ``jax.shard_map`` on each device's slice of the batch. Two
programs compute gradients; each ZeRO stage (:mod:`zerojax.stages.per_stage`) uses one:

* :func:`replicated_grads`: the full parameters are resident; backward produces full
  gradients, which are then reduced: all-reduced (stage 0) or, once the whole gradient
  exists, reduce-scattered into each device's shard (stage 1);
* :func:`per_use_grads`: the loss is re-evaluated from its jaxpr with each parameter
  *pending* (:mod:`zerojax.sharding.per_use`) and a source saying what a use does: stage 2
  reduce-scatters each gradient where backward produces it (per layer inside ``scan``),
  stage 3 all-gathers each parameter where it is used, in forward and again in backward.

Gradients cross devices in ``reduce_dtype``. With ``grad_accum_steps = k`` each device
runs k micro-batches in a ``scan`` (micro-batch ``j`` is the global rows ``g % k == j`` on
every mesh: :func:`micro_batches`); per-use gradients reduce-scatter every micro-batch into
a sharded fp32 accumulator, replicated ones accumulate the full gradient and reduce once.

Each device back-propagates its local mean loss times ``scale / k`` (DeepSpeed's
semantics: backward runs at the full loss scale, whatever N is); the reduction averages
over the N devices (:func:`zerojax.sharding.collectives.reduce_grad`), so the result is
``scale`` times the gradient of the global-batch mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax import pipeline
from zerojax.config.step_options import StepOptions
from zerojax.context import batch as context_batch
from zerojax.context import checks
from zerojax.sharding import collectives, gathers, in_step, outputs, per_use
from zerojax.sharding.param_sources import ParamSource
from zerojax.sharding.plan import ZeroPlan


def _check_loss(loss: Any, expected: str) -> None:
    shape = getattr(loss, "shape", None)
    if shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        hint = " If it returns (loss, aux), pass has_aux=True." if isinstance(loss, tuple) else ""
        raise ValueError(
            f"loss_fn must return a floating scalar loss{'' if expected == 'loss' else f' as the first of {expected}'}, "
            f"got {type(loss).__name__} with shape {shape} and dtype {getattr(loss, 'dtype', None)}. Reduce it "
            "(e.g. jnp.mean)." + hint
        )


@contextlib.contextmanager
def own_sharding_hint(config) -> Any:
    """Re-raises a mesh error of the user's function inside the step's ``shard_map`` with
    what to set when the model constrains values to a mesh of its own."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        if (
            config.axes.model_axes is not None
            or "mesh" not in text
            or not any(k in text for k in ("manual", "Manual", "should match", "use_abstract_mesh", "Mesh for all"))
        ):
            raise
        raise ValueError(
            f"loss_fn failed inside the train step's shard_map with a mesh error ({text.splitlines()[0]}). If the "
            "model constrains its values to a mesh of its own (with_sharding_constraint, logical axis constraints: "
            "MaxText, hand-written GSPMD code), map that mesh's axes onto zerojax's: ZeroConfig(axes={'model_axes': "
            "{'fsdp': 'data', 'data': 'data', 'tensor': 'tensor'}}) (see zerojax.sharding.foreign)."
        ) from e


def cast_batch(batch: Any, dtype) -> Any:
    """Floating batch leaves in the compute dtype; others unchanged."""
    return jax.tree.map(lambda b: b.astype(dtype) if jnp.issubdtype(b.dtype, jnp.floating) else b, batch)


@dataclasses.dataclass(frozen=True)
class Loss:
    """The user's loss as the gradient programs call it: on all parameter leaves in the
    compute dtype, one device's micro-batch, and (when asked for) a key and the model
    state; returning ``(fp32 loss, aux, new model state)``.

    The loss is called ``fn(params, batch, **extras)`` with ``rng=`` (``with_rng``),
    ``model_state=`` (``with_model_state``) and ``layout=`` (``with_layout``: the step's
    :class:`zerojax.context.Layout`) as keywords. It returns ``loss``, ``(loss, aux)``
    (``has_aux``), ``(loss, new_model_state)`` (``with_model_state``) or
    ``(loss, (new_model_state, aux))`` (both)."""

    plan: ZeroPlan
    fn: Callable
    has_aux: bool = False
    with_rng: bool = False
    with_model_state: bool = False
    layout: Any = None  # the zerojax.context.Layout handed to the loss (with_layout), else None
    aux: outputs.Combine | None = None  # how aux combines (has_aux only)
    # ZeroConfig.axes.model_axes: the loss traced outside the step's shard_map, and its output shapes
    program: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def build(
        cls, plan: ZeroPlan, fn: Callable, batch: Any, options: StepOptions, *, rng: Any = None, model_state: Any = None
    ) -> Loss:
        """The loss, checked once on abstract values of one device's micro-batch (on a
        context mesh, also for the sequence layout: :func:`zerojax.context.checks.check`)."""
        o = options
        loss = cls(
            plan,
            fn,
            o.has_aux,
            o.with_rng,
            o.with_model_state,
            context_batch.layout_of(plan) if o.with_layout else None,
        )
        cfg = plan.config
        rows = lambda b: jax.ShapeDtypeStruct(
            (b.shape[0] // (plan.world * cfg.grad_accum_steps),) + b.shape[1:], b.dtype
        )
        abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), t)
        args = (loss.param_shapes, jax.tree.map(rows, batch), abstract(rng), abstract(model_state))
        if cfg.axes.model_axes is not None:  # a model with its own sharding: traced outside the shard_map
            from zerojax.sharding import foreign

            closed, shapes = foreign.trace(loss.__call__, args, plan)
            if plan.context > 1:
                checks.check(plan, closed, args, 1)
            loss = dataclasses.replace(loss, program=(closed, shapes))
            _, aux, new_ms = shapes
        else:
            with own_sharding_hint(cfg):
                _, aux, new_ms = local_shapes(plan, loss.__call__, *args, batch_at=1)
        if o.with_model_state:
            _check_model_state(model_state, new_ms)
        return dataclasses.replace(loss, aux=outputs.plan(o.aux_reduce, aux)) if o.has_aux else loss

    @property
    def param_shapes(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(l.shape, self.plan.config.compute_dtype) for l in self.plan.layouts]

    def __call__(self, leaves: list, batch: Any, rng: Any = None, model_state: Any = None) -> tuple:
        kwargs = {}
        if self.layout is not None:
            kwargs["layout"] = self.layout
        if self.with_rng:
            kwargs["rng"] = rng
        if self.with_model_state:
            # New tree nodes at this trace: NNX Variables (nnx.BatchStat) refuse updates in a
            # trace other than the one that built them, and the state comes from outside grad.
            kwargs["model_state"] = jax.tree.map(lambda x: x, model_state)
        fn = gathers.wrap(self.plan, self.fn)  # a data x context x tensor mesh: batched gathers rewritten
        fn = pipeline.wrap(self.plan, fn)  # a pipeline mesh: the layer scan run through the stages
        with in_step.tracing(self.plan, self.plan.config.grad_accum_steps):
            out = fn(self.plan.unflatten(leaves), cast_batch(batch, self.plan.config.compute_dtype), **kwargs)
        return _parse(out, self.has_aux, self.with_model_state)

    def traced(self) -> Callable:
        """``f(leaves, (batch, rng, model_state))``: the loss re-evaluated from its jaxpr, so
        that parameters may be pending, with every layer loop a remat region when a policy
        is configured."""
        program = None
        if self.program is not None:
            from zerojax.sharding import foreign

            closed, shapes = self.program
            program = lambda: (foreign.Translator(self.plan).program(closed), shapes)
        return per_use.traced(
            lambda leaves, inputs: self(leaves, *inputs), self.param_shapes, trace_options(self.plan), program
        )

    # Across devices and micro-batches.
    def out_specs(self) -> tuple:
        """``shard_map`` output specs of (loss, aux, model state)."""
        return P(), (self.aux.specs(self.plan.batch_axes) if self.has_aux else P()), P()

    def combine(self, value: jax.Array, aux: Any, model_state: Any) -> tuple:
        """Over the devices of the batch (the data axis, and the replica axis where the mesh
        has one): the mean loss (each device's is its mean), aux by its rules, the model
        state averaged (floating leaves; others taken from device 0)."""
        axis = self.plan.batch_axes
        aux = self.aux.over_devices(aux, axis) if self.has_aux else None
        return jax.lax.pmean(value, axis), aux, jax.tree.map(lambda x: _from_all(x, axis), model_state)

    def accumulate(self, fn: Callable, batch: Any, key: Any, model_state: Any):
        """Runs ``fn(micro_batch, key, model_state) -> (loss, aux, grads, model_state)`` on the
        k micro-batches of ``batch`` in order, with ``key`` folded with each micro-batch's
        index and the model state carried from one to the next; sums the gradients (fp32),
        averages the loss and combines the aux by its rules.

        Micro-batch ``j`` is the global rows ``g`` with ``g % k == j``, on every mesh and
        process count (:func:`micro_batches`)."""
        k = self.plan.config.grad_accum_steps
        key_of = lambda j: None if key is None else jax.random.fold_in(key, j)
        if k == 1:
            return fn(batch, key_of(0), model_state)
        micro = micro_batches(batch, k)
        _, _, grads_s, _ = jax.eval_shape(fn, jax.tree.map(lambda b: b[0], micro), key_of(0), model_state)

        def step(carry, xs):
            acc, ms = carry
            mb, j = xs
            value, aux, grads, ms = fn(mb, key_of(j), ms)
            return ([a + g for a, g in zip(acc, grads)], ms), (value, aux)

        zeros = [jnp.zeros(g.shape, g.dtype) for g in grads_s]
        (grads, ms), (values, auxes) = jax.lax.scan(step, (zeros, model_state), (micro, jnp.arange(k)))
        return jnp.mean(values), (self.aux.over_micro_batches(auxes) if self.has_aux else None), grads, ms


def micro_batches(batch: Any, k: int) -> Any:
    """One device's rows ``[m, ...]`` -> ``[k, m // k, ...]``, strided: local row ``r`` goes
    to micro-batch ``r % k``. A device's rows are a contiguous block of the global batch
    starting at a multiple of ``m`` (and ``k`` divides ``m``), so micro-batch ``j`` holds
    the global rows ``g`` with ``g % k == j`` whatever the number of data devices: a loss
    that is not linear in its rows (a MoE load-balancing loss, BatchNorm statistics synced
    over devices, a per-micro-batch normalisation) is the same on every mesh, and an
    elastic resume keeps it. Contiguous blocks (``reshape((k, m // k))``) would give
    micro-batch ``j`` a different set of global rows on each data degree."""
    return jax.tree.map(lambda b: b.reshape((b.shape[0] // k, k) + b.shape[1:]).swapaxes(0, 1), batch)


def on_cpu(plan: ZeroPlan) -> bool:
    return plan.mesh.devices.flat[0].platform == "cpu"


def trace_options(plan: ZeroPlan, remat: bool = True) -> per_use.TraceOptions:
    """How the loss is re-evaluated for ``plan``: the remat policy of every layer loop, the
    prefetch depth (stage 3), and the backend's ordering."""
    cfg = plan.config
    return per_use.TraceOptions(
        scan_remat=cfg.remat if remat else None,
        order_by_data=on_cpu(plan),
        prefetch=cfg.prefetch if plan.stage == 3 else 0,
    )


def local_shapes(plan: ZeroPlan, fn: Callable, *args: Any, batch_at: int | None = None) -> Any:
    """The output shapes of ``fn`` called on one device with ``args`` (shapes of that device's
    inputs), with the data axis bound, as in the step (a BatchNorm may ``pmean`` over it).
    On a context mesh the traced program is checked for the step's sequence layout
    (:func:`zerojax.context.checks.check`; ``args[batch_at]`` is the batch)."""
    run = jax.shard_map(fn, mesh=plan.mesh, in_specs=P(), out_specs=P(), axis_names=plan.manual_axes, check_vma=False)
    if plan.context == 1 or batch_at is None:
        return jax.eval_shape(run, *args)
    closed, shapes = jax.make_jaxpr(run, return_shape=True)(*args)
    checks.check(plan, closed, args, batch_at)
    return shapes


def _parse(out: Any, has_aux: bool, with_model_state: bool) -> tuple:
    shape = (
        "(loss, (new_model_state, aux))"
        if has_aux and with_model_state
        else ("(loss, new_model_state)" if with_model_state else "(loss, aux)" if has_aux else "loss")
    )
    if has_aux or with_model_state:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"loss_fn must return {shape} (has_aux={has_aux}, with_model_state="
                f"{with_model_state}), got {type(out).__name__}."
            )
        loss, rest = out
        if has_aux and with_model_state:
            if not (isinstance(rest, tuple) and len(rest) == 2):
                raise ValueError(f"loss_fn must return {shape}; its second element is a {type(rest).__name__}.")
            model_state, aux = rest
        else:
            model_state, aux = (rest, None) if with_model_state else (None, rest)
    else:
        loss, aux, model_state = out, None, None
    _check_loss(loss, shape)
    return loss.astype(jnp.float32), aux, model_state


def _check_model_state(given: Any, new: Any) -> None:
    a, b = jax.tree.structure(given), jax.tree.structure(new)
    if a != b:
        raise ValueError(
            f"loss_fn returned a model state of structure {b}; it was given {a}. Return the "
            "updated model state with the structure it came in."
        )
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(given)[0], jax.tree.leaves(new)):
        if tuple(jnp.shape(x)) != tuple(y.shape) or jnp.dtype(x.dtype) != jnp.dtype(y.dtype):
            raise ValueError(
                f"model_state{jax.tree_util.keystr(path)} came in as {jnp.shape(x)} {x.dtype} and "
                f"came back as {y.shape} {y.dtype}; keep each leaf's shape and dtype."
            )


def _from_all(x: jax.Array, axis) -> jax.Array:
    """A model-state leaf over the data axis: the mean of a floating one, device 0's otherwise."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axis)
    first = jax.lax.axis_index(axis) == 0
    as_int = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    return jax.lax.psum(jnp.where(first, as_int, jnp.zeros_like(as_int)), axis).astype(x.dtype)


def _device_key(rng: Any, axis) -> Any:
    return None if rng is None else jax.random.fold_in(rng, jax.lax.axis_index(axis))


def replicated_grads(loss: Loss, *, scatter: bool) -> Callable:
    """``f(train, frozen, batch, scale, rng, model_state) -> (loss, aux, model_state, grads)``
    for resident, replicated parameter leaves in the compute dtype (the trainable ones, then
    the frozen ones, which get no gradient). ``grads`` are fp32, averaged over the devices,
    times ``scale``: full and replicated (``scatter=False``: all-reduce), or each device's
    shard of the masters' storage (``scatter=True``: reduce-scatter once the whole gradient
    exists). ``rng`` is this step's key (folded with each device's index and micro-batch)."""
    plan = loss.plan
    axis, n, k, replica = plan.axis, plan.world, plan.config.grad_accum_steps, plan.replica
    reduce, block = plan.config.collectives.reduce_dtype, plan.config.reduce_block
    traced = loss.traced() if plan.config.remat.active or loss.program is not None else None

    def loss_and_grad(train, frozen, batch, key, model_state, scale):
        def f(train):
            leaves = plan.join(train, frozen)
            value, aux, ms = (
                traced(leaves, (batch, key, model_state)) if traced else loss(leaves, batch, key, model_state)
            )
            return value * scale / k, (value, aux, ms)

        (_, (value, aux, ms)), g = jax.value_and_grad(f, has_aux=True)(train)
        return value, aux, [x.astype(jnp.float32) for x in g], ms

    def reduce_all(grads):
        grads = [context_batch.whole(plan, g, l) for g, l in zip(grads, plan.master_layouts)]
        if not scatter:
            return [
                collectives.reduce_grad(g, axis, n, reduce, l.replicated() if l.tp else None, replica, block)
                for l, g in zip(plan.master_layouts, grads)
            ]
        grads = per_use.after_all(grads, on_cpu(plan))  # ZeRO-1: the whole gradient exists first
        return [
            collectives.reduce_grad(g, axis, n, reduce, l, replica, block) for l, g in zip(plan.master_layouts, grads)
        ]

    def body(train, frozen, batch, scale, rng, model_state):
        value, aux, grads, ms = loss.accumulate(
            lambda b, key, ms: loss_and_grad(train, frozen, b, key, ms, scale),
            batch,
            _device_key(rng, plan.batch_axes),
            model_state,
        )
        return (*loss.combine(value, aux, ms), reduce_all(grads))

    grad_specs = [l.partition_spec(axis) for l in plan.master_layouts] if scatter else [P()] * len(plan.master_layouts)

    def run(train, frozen, batch, scale, rng, model_state):
        batch = context_batch.constrain(plan, batch)
        batch_spec = jax.tree.map(lambda _: P(plan.batch_axes), batch)
        return jax.shard_map(
            body,
            mesh=plan.mesh,
            in_specs=([P()] * len(train), [P()] * len(frozen), batch_spec, P(), P(), P()),
            out_specs=(*loss.out_specs(), grad_specs),
            axis_names=plan.manual_axes,
            check_vma=False,
        )(train, frozen, batch, scale, rng, model_state)

    return run


def pending(arrays: list[tuple], layouts: list, source: ParamSource, names: list[str]) -> list[per_use.Pending]:
    """Parameter leaves kept pending: stored ``arrays`` (a tuple each), used as ``source`` says."""
    return [per_use.Pending(arrays=a, layout=l, source=source, name=name) for a, l, name in zip(arrays, layouts, names)]


def per_use_grads(loss: Loss, source: ParamSource, frozen_source: ParamSource | None = None) -> Callable:
    """``f(resident, sinks, frozen, batch, scale, rng, model_state) -> (loss, aux,
    model_state, grads)``: the loss evaluated with every trainable parameter pending, made
    of ``(*resident[i], sinks[i])`` as ``source`` needs (stage 3: ``resident=[]``, the sinks
    are the master shards; stage 2: ``resident`` are the full compute-dtype leaves), and the
    frozen ones pending from ``frozen_source`` (stage 3: their shards) or resident
    (``frozen_source=None``: full, replicated). ``grads`` come out shaped like the sinks:
    each device's shard of the masters' storage, fp32, averaged, times ``scale``."""
    plan = loss.plan
    axis, k = plan.axis, plan.config.grad_accum_steps
    traced = loss.traced()
    compute = plan.config.compute_dtype
    train_names, frozen_names = plan.split(plan.paths)

    def shard_grads(resident, sinks, frozen, batch, key, model_state, scale):
        if frozen_source is None:
            fro = [x.astype(compute) for x in frozen]
        else:
            fro = pending([(x,) for x in frozen], plan.frozen_layouts, frozen_source, frozen_names)

        def f(sinks):
            arrays = [(r, s) for r, s in zip(resident, sinks)] if resident else [(s,) for s in sinks]
            train = pending(arrays, plan.master_layouts, source, train_names)
            value, aux, ms = traced(plan.join(train, fro), (batch, key, model_state))
            return value * scale / k, (value, aux, ms)

        (_, (value, aux, ms)), g = jax.value_and_grad(f, has_aux=True)(sinks)
        return value, aux, [x.astype(jnp.float32) for x in g], ms

    def body(resident, sinks, frozen, batch, scale, rng, model_state):
        value, aux, grads, ms = loss.accumulate(
            lambda b, key, ms: shard_grads(resident, sinks, frozen, b, key, ms, scale),
            batch,
            _device_key(rng, plan.batch_axes),
            model_state,
        )
        return (*loss.combine(value, aux, ms), grads)

    storage = [l.partition_spec(axis) for l in plan.master_layouts]
    frozen_specs = [l.partition_spec(axis) for l in plan.frozen_layouts]

    # Resident leaves: full and replicated (stage 2), or host-memory shards (offload_params).
    resident_specs = [P()] * len(plan.master_layouts) if source.resident else storage

    def run(resident, sinks, frozen, batch, scale, rng, model_state):
        batch = context_batch.constrain(plan, batch)
        batch_spec = jax.tree.map(lambda _: P(plan.batch_axes), batch)
        return jax.shard_map(
            body,
            mesh=plan.mesh,
            in_specs=(resident_specs[: len(resident)], storage, frozen_specs, batch_spec, P(), P(), P()),
            out_specs=(*loss.out_specs(), storage),
            axis_names=plan.manual_axes,
            check_vma=False,
        )(resident, sinks, frozen, batch, scale, rng, model_state)

    return run
