"""``make_eval_step``: a forward-only function of the parameters, under the state's ZeRO layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax import compile_cache, pipeline
from zerojax.config import StepOptions, ZeroConfig
from zerojax.config.step_options import PLAIN
from zerojax.context import batch as context_batch
from zerojax.sharding import gathers, in_step, outputs, per_use
from zerojax.sharding.mesh import auto_axes, batch_devices, row_split
from zerojax.sharding.plan import ZeroPlan
from zerojax.stages.gradients import cast_batch, local_shapes, pending, trace_options
from zerojax.stages.per_stage import stage_of
from zerojax.state import ZeroState
from zerojax.step import check_batch, check_keywords, check_state, place_batch


class EvalStep:
    """A jitted forward-only step: ``outputs = eval_step(state, batch)``.

    ``fn(params, batch)`` runs on each device's rows of the batch with the full parameters
    in the compute dtype, exactly as the loss does in training; at stage 3 each parameter is
    gathered where it is used and freed after, so no device holds the whole model. No
    gradient, no optimizer, and the state is not donated. Outputs combine over devices by
    ``reduce`` (see :mod:`zerojax.sharding.outputs`): floating scalars are averaged by
    default; per-example outputs take ``"concat"``.
    """

    def __init__(
        self, fn: Callable, *, mesh: Mesh, config: ZeroConfig, reduce: Any = None, options: StepOptions = PLAIN
    ):
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(params, batch), got {fn!r}.")
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        self.n = batch_devices(mesh, config.axes.data, config.axes.replica)
        self.mesh, self.config, self.fn, self.reduce = auto_axes(mesh), config, fn, reduce
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a zj.config.StepOptions, got {type(options).__name__}.")
        if options.has_aux or options.with_rng:
            raise ValueError(
                "an eval step returns what fn returns (no aux to split off) and draws no keys: "
                f"build its StepOptions with has_aux=False and with_rng=False, got {options}."
            )
        self.options = options
        check_keywords(fn, "fn", **options.keywords())
        self._jitted: dict[ZeroPlan, Any] = {}
        self._compiles = 0

    def check(self, state: ZeroState, batch: Any) -> None:
        check_state(state, self.config, self.mesh, "eval step")
        if self.options.with_model_state and state.model_state is None:
            raise ValueError(
                "make_eval_step(..., with_model_state=True) needs a state built with "
                "zj.init_state(..., model_state=...)."
            )
        check_batch(batch, *row_split(self.mesh, self.config))
        context_batch.check(state.plan, batch)

    def _run(self, state: ZeroState, batch: Any) -> Any:
        self._compiles += 1
        plan = state.plan
        axis, n, compute = plan.axis, plan.world, jnp.dtype(plan.config.compute_dtype)
        over = plan.batch_axes
        shapes = [jax.ShapeDtypeStruct(l.shape, compute) for l in plan.layouts]

        def user_fn(leaves, inputs):
            b, ms = inputs
            kwargs = {"model_state": jax.tree.map(lambda x: x, ms)} if self.options.with_model_state else {}
            if self.options.with_layout:
                kwargs["layout"] = context_batch.layout_of(plan)
            with in_step.tracing(plan, 1):
                fn = pipeline.wrap(plan, gathers.wrap(plan, self.fn))  # a pipeline mesh: layers through the stages
                return fn(plan.unflatten(leaves), cast_batch(b, compute), **kwargs)

        ms = state.model_state if self.options.with_model_state else None
        local = jax.tree.map(lambda b: jax.ShapeDtypeStruct((b.shape[0] // n,) + b.shape[1:], b.dtype), batch)
        program = None
        if plan.config.axes.model_axes is not None:  # a model with its own sharding: traced outside the shard_map
            from zerojax.sharding import foreign

            closed, out_shapes = foreign.trace(user_fn, (shapes, (local, ms)), plan)
            program = lambda: (foreign.Translator(plan).program(closed), out_shapes)
        else:
            out_shapes = local_shapes(
                plan, lambda leaves, b, ms: user_fn(leaves, (b, ms)), shapes, local, ms, batch_at=1
            )
        combine = outputs.plan(self.reduce, out_shapes, "outputs", "reduce")
        batch = context_batch.constrain(plan, batch)
        batch_spec = jax.tree.map(lambda _: P(over), batch)
        frozen = jax.tree.leaves(state.frozen) if state.frozen is not None else []
        frozen_specs = [l.partition_spec(axis) for l in plan.frozen_layouts]
        train_names, frozen_names = plan.split(plan.paths)
        read = stage_of(plan).forward(plan)
        # Leaves with a source are used pending (gathered where used); the others as they are.
        run = (
            per_use.traced(user_fn, shapes, trace_options(plan, remat=False), program)
            if read.source or program
            else user_fn
        )

        def body(train, frozen, b, ms):
            cast = lambda xs: [x.astype(compute) for x in xs]
            train = (
                pending([(x,) for x in train], plan.master_layouts, read.source, train_names)
                if read.source
                else cast(train)
            )
            frozen = (
                pending([(x,) for x in frozen], plan.frozen_layouts, read.frozen_source, frozen_names)
                if read.frozen_source
                else cast(frozen)
            )
            return combine.over_devices(run(plan.join(train, frozen), (b, ms)), over)

        arrays = getattr(state, read.field)
        return jax.shard_map(
            body,
            mesh=plan.mesh,
            in_specs=(read.specs, frozen_specs, batch_spec, P()),
            out_specs=combine.specs(over),
            axis_names=plan.manual_axes,
            check_vma=False,
        )(jax.tree.leaves(arrays), frozen, batch, ms)

    def _jit_for(self, state: ZeroState):
        fn = self._jitted.get(state.plan)
        if fn is None:
            fn = self._jitted[state.plan] = jax.jit(self._run, **compile_cache.jit_options(state.plan.mesh))
        return fn

    def __call__(self, state: ZeroState, batch: Any) -> Any:
        self.check(state, batch)
        batch = place_batch(batch, self.mesh, row_split(self.mesh, self.config)[1])
        with compile_cache.compiling(state.plan.mesh):
            return self._jit_for(state)(state, batch)

    def lower(self, state: ZeroState, batch: Any):
        """``jax.jit(...).lower`` of the step: ``.compile()`` it to inspect the program."""
        self.check(state, batch)
        return compile_cache.GuardedLowered(self._jit_for(state).lower(state, batch), state.plan.mesh)

    def compile_count(self) -> int:
        """Number of programs this step has traced and compiled."""
        return self._compiles


def make_eval_step(
    fn: Callable,
    *,
    mesh: Mesh,
    config: ZeroConfig,
    reduce: Any = None,
    with_model_state: bool = False,
    with_layout: bool = False,
) -> EvalStep:
    """Builds a forward-only step for ``fn(params, batch)`` (a held-out loss, per-example
    predictions) that reads the parameters where they live: at stage 3, gathered layer by
    layer as in training, never the whole model on one device. ``with_model_state=True``
    calls ``fn(params, batch, model_state=state.model_state)`` (BatchNorm in inference
    mode reads its running statistics) and leaves the state as it is. ``with_layout=True``
    calls ``fn(params, batch, layout=layout)``, as ``make_train_step`` does.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
      >>> state = zj.init_state({"w": jnp.ones((3, 1))}, optax.sgd(0.1), mesh=mesh, config=cfg)
      >>> def fn(p, b):
      ...     pred = b["x"] @ p["w"]
      ...     return {"loss": jnp.mean((pred - b["y"]) ** 2), "pred": pred}
      >>> ev = zj.make_eval_step(fn, mesh=mesh, config=cfg, reduce={"loss": "mean", "pred": "concat"})
      >>> out = ev(state, {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))})
      >>> float(out["loss"]), out["pred"].shape
      (9.0, (8, 1))
    """
    return EvalStep(
        fn,
        mesh=mesh,
        config=config,
        reduce=reduce,
        options=StepOptions(with_model_state=with_model_state, with_layout=with_layout),
    )
