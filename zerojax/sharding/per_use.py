"""Materialise sharded parameters where a traced function uses them, not before.

ZeRO-3 gathers a layer's parameters just before the layer runs and frees them after;
ZeRO-2 reduce-scatters a parameter's gradient as soon as backward has produced it. Both
need to act at each *use* of a parameter inside the user's loss function, which was
written for full, unsharded parameters.

``call_per_use`` traces the loss to a jaxpr with full-shape parameters and evaluates it
again with each parameter replaced by a :class:`Pending` value that holds only the
sharded storage. A pending parameter becomes a real array only in the equation that
consumes it:

* shape-only equations (reshape, transpose, dtype casts, ...) stay pending;
* ``scan`` over a stacked parameter (``nnx.scan``, ``nn.scan``, ``lax.scan``) slices the
  *storage* per iteration, so each iteration materialises one layer; so does taking one
  layer of a stack by index (``w[i]`` in a Python loop);
* with a ``TraceOptions(scan_remat=...)``, every scan body (one layer of a stack) becomes a
  remat region with that policy;
* nested ``jit`` calls are evaluated inline and ``checkpoint`` (remat) regions are
  rebuilt around their pending inputs, so a rematerialised layer re-gathers in backward;
* any other equation materialises the parameter right there. With a source that gathers
  (:class:`zerojax.sharding.param_sources.ParamSource`), the gather and the equation run so that
  backward gathers the parameter again instead of keeping the full copy alive (a ``custom_vjp`` whose
  backward gathers once the cotangent exists, so no compiler pass can merge the two).

Everything else in the program is evaluated unchanged.

The evaluation is a pass on :mod:`zerojax._jaxpr.walk` (:class:`Evaluator`): the walk
goes through the program and binds every equation without a pending operand as JAX would;
this module's hook takes the equations with one. What it reads of JAX's program form (which
equations are shape-only, a call's body, a scan's operand split, a checkpoint's options, a
slice's bounds) it reads through :mod:`zerojax._jaxpr`, which knows each supported JAX
release's form and checks it the first time a program is read
(:func:`zerojax._jaxpr.check.reading`). Where the check fails, or where
``ZEROJAX_NO_PROGRAM_READING=1`` is set, :func:`traced` reads no program: it materialises
every parameter before calling the function (stage 3 gathers each one whole, stage 2
reduce-scatters each gradient once backward is done), the same numbers at more memory.
A stacked parameter that reaches a higher-order primitive this module does not handle
(``while``, ``cond``, ...) is gathered whole there, with a warning that says so.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._jaxpr import check, constructs, form, walk
from zerojax._jaxpr.form import Equation, Jaxpr
from zerojax.sharding import prefetch
from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.param_sources import ParamSource, in_host_memory


@dataclasses.dataclass(frozen=True)
class Pending:
    """A parameter that is not materialised yet: its storage arrays and what to do."""

    arrays: tuple[jax.Array, ...]
    layout: LeafLayout
    source: ParamSource
    ops: tuple[constructs.Unary, ...] = ()  # shape-only equations to apply once materialised
    name: str = ""  # the parameter's path, for messages

    def materialize(self) -> jax.Array:
        value = self.source.materialize(self.layout, self.arrays)
        for op in self.ops:
            value = op.apply(value)
        return value

    def then(self, op: constructs.Unary) -> Pending:
        return dataclasses.replace(self, ops=self.ops + (op,))

    @property
    def sliceable(self) -> bool:
        return self.layout.can_slice_layers and all(op.slice_safe for op in self.ops)

    # Flattening for passing through jax.checkpoint / lax.scan boundaries.
    def rebuild(self, arrays: Sequence[jax.Array], *, sliced: bool = False) -> Pending:
        layout = self.layout.row() if sliced else self.layout
        return dataclasses.replace(self, arrays=tuple(arrays), layout=layout)


_bind = form.bind


def _materialize_all(vals: Sequence[Any]) -> list[Any]:
    return [v.materialize() if isinstance(v, Pending) else v for v in vals]


def _split_pending(vals: Sequence[Any]) -> tuple[list[jax.Array], Callable[[Sequence[jax.Array]], list[Any]]]:
    """Flattens the storage arrays of pending values; returns them and a rebuild function."""
    flat: list[jax.Array] = []
    for v in vals:
        if isinstance(v, Pending):
            flat.extend(v.arrays)

    def rebuild(arrays: Sequence[jax.Array]) -> list[Any]:
        it = iter(arrays)
        out = []
        for v in vals:
            if isinstance(v, Pending):
                out.append(v.rebuild([next(it) for _ in v.arrays]))
            else:
                out.append(v)
        return out

    return flat, rebuild


def _is_array(v: Any) -> bool:
    return isinstance(v, jax.Array) or hasattr(v, "aval")


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """How a traced program is evaluated per use (:func:`traced`, :func:`eval_jaxpr`), and what
    one evaluation carries along: ``scan_remat`` wraps every scan body (one layer) in a remat
    region."""

    scan_remat: Any = None  # zerojax.remat.Remat or None
    in_remat: bool = False  # inside a remat region: backward recomputes, gathers included
    # Stacked storage split into its layers, once per evaluation (see ``_row``).
    rows: dict | None = dataclasses.field(default=None, compare=False)
    # XLA's CPU backend drops optimization barriers: there, also order by a data dependency.
    order_by_data: bool = True
    prefetch: int = 0  # gather this many layers ahead (stage 3; see zerojax.sharding.prefetch)
    # The activation inputs of the gathers so far in this jaxpr (forward prefetch of unrolled layers).
    deps: list | None = dataclasses.field(default=None, compare=False)


_PLAIN = TraceOptions()


def _eqn_with_pending(eqn: Equation, invals: list[Any], opts: TraceOptions) -> list[Any]:
    pending = [v for v in invals if isinstance(v, Pending)]

    shape_only = constructs.shape_only(eqn)
    if shape_only is not None and len(invals) == 1:
        return [invals[0].then(shape_only)]
    if constructs.is_call(eqn):
        return eval_jaxpr(*constructs.call_body(eqn), invals, opts)
    if constructs.is_scan(eqn):
        return _scan(eqn, invals, opts)
    if constructs.is_slice(eqn) and len(invals) == 1 and _is_row(eqn, invals[0]):
        return [_row(invals[0], constructs.static_slice(eqn).start[0], opts)]
    if constructs.is_remat(eqn):
        return _checkpoint(eqn, invals, opts)
    _warn_if_stack_gathered_whole(eqn, pending)

    # Any other consumer: materialise here. Gathered sources are gathered again in backward
    # rather than kept alive from forward.
    if not any(p.source.regathers for p in pending):
        return _bind(eqn, _materialize_all(invals))
    if constructs.keeps_no_operands(eqn) or opts.in_remat:
        # Inside a remat region the gathered value is recomputed (gathered again) for this
        # layer's backward anyway; a second re-gather would only add traffic.
        return _bind(eqn, _materialize_all(_tied_to_inputs(invals, opts)))
    return _regathered(eqn, invals, opts)


def _warn_if_stack_gathered_whole(eqn: Equation, pending: list[Pending], how: str = "") -> None:
    """A stacked parameter entering a loop or branch this module cannot look into is
    materialised whole for all of it: say so, once per trace."""
    if not how and not constructs.has_sub_programs(eqn):
        return
    for p in pending:
        if p.layout.can_slice_layers:
            warnings.warn(
                f"zerojax: the stacked parameter {p.name or '(unnamed)'} of shape {p.layout.shape} enters "
                f"a '{form.name(eqn)}'{how} whole, so it is gathered (stage 3) or its gradient "
                "reduced (stage 2) whole there, not one layer at a time. Run the layers with "
                "jax.lax.scan over the stack (nnx.scan, nn.scan) to keep one layer live.",
                stacklevel=2,
            )


def _is_row(eqn: Equation, v: Pending) -> bool:
    """Whether ``eqn`` takes one whole layer of a stacked parameter (``w[i]`` in a Python
    loop over layers: ``slice`` of one row along the layer axis, everything else whole)."""
    sl = constructs.static_slice(eqn)
    if not v.sliceable or sl.strides not in (None, (1,) * len(v.layout.shape)):
        return False
    start, limit = sl.start, sl.limit
    return limit[0] - start[0] == 1 and all(s == 0 for s in start[1:]) and tuple(limit[1:]) == v.layout.shape[1:]


def _row(v: Pending, i: int, opts: TraceOptions) -> Pending:
    """Row ``i`` of a stacked pending parameter, still pending, shaped ``(1, *inner)`` like
    the ``slice`` it replaces: only that layer is gathered (stage 3) and only its gradient
    is reduce-scattered (stage 2), not the whole stack once per layer.

    The storage is split into all its layers once (``lax.split``, whose transpose is one
    concatenation): slicing each layer on its own would give every layer's gradient a
    zero-padded copy of the whole stack's shard in backward."""
    key = tuple(id(a) for a in v.arrays)
    cache = opts.rows
    if key not in cache:
        split = [[jnp.squeeze(r, 0) for r in jax.lax.split(a, [1] * a.shape[0], axis=0)] for a in v.arrays]
        cache[key] = (v.arrays, split)  # the arrays are kept so their ids stay unique
    split = cache[key][1]
    row = v.rebuild([rows[i] for rows in split], sliced=True)
    inner = jax.ShapeDtypeStruct(v.layout.shape[1:], v.layout.dtype)
    for op in constructs.unary_ops(lambda x: jnp.expand_dims(x, 0), inner):
        row = row.then(op)
    return row


def _first_float(vals: Sequence[Any]) -> jax.Array | None:
    for v in vals:
        if not isinstance(v, Pending) and _is_array(v) and jnp.issubdtype(v.dtype, jnp.inexact):
            return v
    return None


def _tied_to_inputs(invals: list[Any], opts: TraceOptions) -> list[Any]:
    """Pending values whose gather waits for the equation's other (activation) input, so
    the compiler gathers a layer when the layer is reached, not all layers up front (with
    prefetch, when the layer ``opts.prefetch`` uses earlier is reached)."""
    dep = _order_after(_first_float(invals), opts, record=False)
    if dep is None:
        return invals
    return [
        v.rebuild([_after(a, dep, opts.order_by_data) for a in v.arrays]) if isinstance(v, Pending) else v
        for v in invals
    ]


def _order_after(dep: jax.Array | None, opts: TraceOptions, record: bool = True) -> jax.Array | None:
    """What a gather used with activation input ``dep`` waits for: ``dep`` itself, or with
    prefetch d the input of the d-th layer before it in this jaxpr, so that the gather
    runs while those layers compute. A layer is a use that keeps its parameter for
    backward (a matmul: ``record``); lighter uses (adding a bias) wait with the last one."""
    if not opts.prefetch or opts.deps is None or dep is None:
        return dep
    back = opts.prefetch if record else opts.prefetch - 1
    earlier = opts.deps[-back] if back and len(opts.deps) >= back else dep
    if record:
        opts.deps.append(dep)
    return earlier


def _after(x: jax.Array, dep: jax.Array, order_by_data: bool = True) -> jax.Array:
    """``x``, scheduled after ``dep`` exists, its value unchanged whatever ``dep`` holds.

    An optimization barrier orders them where the backend honours it. XLA's CPU pipeline
    drops barriers, so there a data dependency does it too, one that cannot change a
    value: ``x`` plus a negative zero computed from ``dep``'s first element
    (-|d * 0| if d is finite, else -|0|: -0.0 for every d, NaN and infinities included,
    and x + -0.0 is x for every x, signed zeros included), so that the compiler cannot
    gather a layer before the layer is reached, or merge a backward re-gather with the
    forward one. A shard in host memory (``offload_params``) gets the same sum on a device
    copy, moved back (moves are no-ops on CPU): the program, and so its rounding, stays
    that of the run without offload."""
    dep = jax.lax.stop_gradient(dep)  # an order, not a value: no gradient flows through it
    x, _ = jax.lax.optimization_barrier((x, dep))
    if order_by_data:
        d = _first(dep)
        zero = -jnp.abs(jnp.where(jnp.isfinite(d), d * 0, jnp.zeros_like(d)))
        if in_host_memory(x):  # offload_params: the same sum, on a device copy (a no-op move on CPU)
            return jax.device_put(
                jax.device_put(x, jax.memory.Space.Device) + zero.astype(x.dtype), jax.memory.Space.Host
            )
        x = x + zero.astype(x.dtype)
    return x


def _first(x: jax.Array) -> jax.Array:
    """``x``'s first element, read by index (a ``ravel`` of an array split over the tensor
    axis on an inner dimension would gather it whole first)."""
    return x[(0,) * x.ndim] if x.ndim else x


def after_all(xs: Sequence[jax.Array], order_by_data: bool = True) -> list[jax.Array]:
    """Each of ``xs``, scheduled after all of them exist (nothing proceeds until all do)."""
    dep = sum(_first(x).astype(jnp.float32) for x in xs)  # needs every one of them
    return [_after(x, dep, order_by_data) for x in xs]


def _regathered(eqn: Equation, invals: list[Any], opts: TraceOptions) -> list[Any]:
    """Applies ``eqn`` to freshly gathered parameters, in forward and again in backward.

    Only the shards and the equation's other inputs are kept for backward; backward
    gathers again, once the output cotangent exists, and differentiates the equation there.
    The transpose of the gather reduce-scatters the parameter's gradient. With prefetch,
    the forward gather waits only for an earlier layer's input (see ``_order_after``).
    """
    flat, rebuild = _split_pending(invals)
    traced = [i for i, v in enumerate(invals) if not isinstance(v, Pending) and _is_array(v)]
    # The forward gather waits for the input (or, with prefetch, an earlier layer's input),
    # with or without differentiation (an eval step runs the region's primal alone). The
    # untied shards are what backward keeps.
    dep = _order_after(_first_float([invals[i] for i in traced]), opts)
    tie = lambda flat, dep: flat if dep is None else [_after(a, dep, opts.order_by_data) for a in flat]

    def compute(flat, traced_vals):
        vals = rebuild(flat)
        for i, t in zip(traced, traced_vals):
            vals[i] = t
        return _bind(eqn, _materialize_all(vals))

    @jax.custom_vjp
    def region(flat, traced_vals, dep):
        return compute(tie(flat, dep), traced_vals)

    def fwd(flat, traced_vals, dep):
        return compute(tie(flat, dep), traced_vals), (flat, traced_vals)

    def bwd(res, cts):
        flat, traced_vals = res
        flat = tie(flat, _first_float(cts))  # gathered again once the cotangent exists
        _, vjp = jax.vjp(compute, flat, traced_vals)
        d_flat, d_traced = vjp(list(cts))
        # Shards in host memory (offload_params) get no cotangent: their gradient goes to a sink.
        d_flat = [None if in_host_memory(x) else d for x, d in zip(flat, d_flat)]
        return d_flat, d_traced, None

    region.defvjp(fwd, bwd)
    return region(flat, [invals[i] for i in traced], dep)


def _checkpoint(eqn: Equation, invals: list[Any], opts: TraceOptions) -> list[Any]:
    spec = constructs.remat(eqn)
    flat, rebuild = _split_pending(invals)
    others_idx = [i for i, v in enumerate(invals) if not isinstance(v, Pending)]

    inner_ctx = dataclasses.replace(opts, in_remat=True)

    def inner(flat, others):
        vals = rebuild(flat)
        for i, o in zip(others_idx, others):
            vals[i] = o
        return eval_jaxpr(spec.body, spec.body_consts, vals, inner_ctx)

    inner = jax.checkpoint(inner, prevent_cse=spec.prevent_cse, policy=spec.policy)
    return list(inner(flat, [invals[i] for i in others_idx]))


def _scan(eqn: Equation, invals: list[Any], opts: TraceOptions) -> list[Any]:
    p = constructs.scan(eqn)
    n_consts, n_carry = p.n_consts, p.n_carry
    _warn_if_stack_gathered_whole(
        eqn,
        [v for v in invals[: n_consts + n_carry] if isinstance(v, Pending)],
        " as a loop constant or carry (not scanned over)",
    )
    consts = _materialize_all(invals[:n_consts])
    carry = _materialize_all(invals[n_consts : n_consts + n_carry])
    xs_in = invals[n_consts + n_carry :]
    # Stacked parameters are sliced in storage form; anything else is materialised first.
    xs_in = [
        v if isinstance(v, Pending) and v.sliceable else (v.materialize() if isinstance(v, Pending) else v)
        for v in xs_in
    ]
    xs_arrays = [v.arrays if isinstance(v, Pending) else v for v in xs_in]
    stack_pos = [k for k, v in enumerate(xs_in) if isinstance(v, Pending) and v.source.regathers]
    if opts.prefetch and stack_pos and not p.reverse:
        others = [v for k, v in enumerate(xs_in) if k not in stack_pos]
        if prefetch.applies(carry, others, [v.aval for v in p.body.outvars]):
            inner = TraceOptions(order_by_data=opts.order_by_data)

            def run_body(consts, carry, xs_vals):
                return eval_jaxpr(p.body, p.body_consts, [*consts, *carry, *xs_vals], inner)

            return prefetch.prefetched_scan(
                run_body,
                n_carry,
                p.length,
                opts.prefetch,
                [xs_in[k] for k in stack_pos],
                stack_pos,
                consts,
                carry,
                others,
                len(xs_in),
            )
        warnings.warn(
            "zerojax: prefetch skipped for a layer loop whose carry, scanned inputs or outputs are "
            "not all floating; its layers are gathered one at a time without prefetch.",
            stacklevel=2,
        )

    remat = opts.scan_remat is not None and opts.scan_remat.active
    body_ctx = dataclasses.replace(opts, in_remat=True) if remat else opts

    def step(carry, xs_slices):
        xs_vals = [
            orig.rebuild(sl, sliced=True) if isinstance(orig, Pending) else sl for orig, sl in zip(xs_in, xs_slices)
        ]
        outs = eval_jaxpr(p.body, p.body_consts, [*consts, *carry, *xs_vals], body_ctx)
        return outs[:n_carry], outs[n_carry:]

    if remat:
        step = jax.checkpoint(step, policy=opts.scan_remat.jax_policy(), prevent_cse=False)
    carry_out, ys = jax.lax.scan(step, carry, xs_arrays, length=p.length, reverse=p.reverse, unroll=p.unroll)
    return [*carry_out, *ys]


class Evaluator(walk.Evaluate):
    """The walk's hook for per-use evaluation: an equation with a pending operand (or, with
    a per-layer remat policy, a scan or call whose bodies get it) goes to
    :func:`_eqn_with_pending`; the walk binds every other one as it is."""

    def __init__(self, opts: TraceOptions):
        self.opts = opts

    def replace(self, eqn: Equation, ins: list[Any]) -> list[Any] | None:
        opts = self.opts
        if any(isinstance(v, Pending) for v in ins):
            return _eqn_with_pending(eqn, ins, opts)
        if (
            (constructs.is_scan(eqn) or constructs.is_call(eqn))
            and opts.scan_remat is not None
            and opts.scan_remat.active
        ):
            return _eqn_with_pending(eqn, ins, opts)
        return None


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], opts: TraceOptions = _PLAIN) -> list[Any]:
    """Evaluates ``jaxpr`` like ``jax.core.eval_jaxpr``, keeping parameters pending."""
    if opts.rows is None:  # one split of each stack per evaluation (see ``_row``)
        opts = dataclasses.replace(opts, rows={})
    if opts.prefetch:
        opts = dataclasses.replace(opts, deps=[])  # this jaxpr's own order of gathered uses
    return _materialize_all(Evaluator(opts).run(jaxpr, consts, args))


def call_per_use(closed: Any, params: Sequence[Any], args: Sequence[Any], opts: TraceOptions = _PLAIN) -> list[Any]:
    """Evaluates ``closed`` (traced with full parameters first, then ``args``) with the
    parameters given as pending values (or plain arrays)."""
    opts = dataclasses.replace(opts, rows=None)
    return eval_jaxpr(*form.open_jaxpr(closed), [*params, *args], opts)


def traced(
    fn: Callable,
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    opts: TraceOptions = _PLAIN,
    program: Callable | None = None,
) -> Callable:
    """``fn(param_leaves, batch)`` re-evaluated from its jaxpr, so that the parameter leaves
    it is called with may be :class:`Pending` (``param_shapes`` are their full shapes).
    ``program()``, when given, returns that jaxpr and its output shapes, made elsewhere
    (a model with its own sharding: :mod:`zerojax.sharding.foreign`).

    Where zerojax reads no program (:func:`zerojax._jaxpr.check.reading`, asked when the
    caller is traced), ``fn`` is called on the parameters materialised up front instead:
    the same values and gradients, without per-use gathering, prefetch or ``opts``'s remat."""

    def call(params: Sequence[Any], batch: Any) -> Any:
        if program is None and not check.reading():
            return fn(_materialize_all(params), batch)
        if program is not None:
            closed, out_shape = program()
        else:
            batch_sds = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype), batch)
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(list(param_shapes), batch_sds)
        if opts.scan_remat is not None and opts.scan_remat.active:
            warn_if_no_layer_regions(closed, opts.scan_remat)
        outs = call_per_use(closed, params, jax.tree.leaves(batch), opts)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return call


class RematNotApplied(UserWarning):
    """``ZeroConfig(remat=...)`` found no layer to apply to: nothing is rematerialized."""


def warn_if_no_layer_regions(closed: Any, remat: Any) -> None:
    """Warns when the loss has no layer loop (``scan``) for the config's remat policy to
    apply to, and no remat region of its own: unrolled layers (a Python loop over a list
    of blocks) would otherwise keep every activation with no word."""
    jaxpr, _ = form.open_jaxpr(closed)
    if any(constructs.is_scan(e) or constructs.is_remat(e) for e in walk.equations(jaxpr)):
        return
    warnings.warn(
        f"ZeroConfig(remat={remat.kind!r}) applies to each layer loop (scan) of the loss, and this loss has "
        "none (its layers are unrolled) and no remat region of its own: nothing is rematerialized. Run the "
        "layers as a scan (nnx.scan, nn.scan, lax.scan over stacked layers), or make each block a remat "
        "region in the model: Block = zj.remat.nnx_module(Block, ...), zj.remat.linen_module(Block, ...) "
        "or zj.remat.checkpoint(block_fn, ...). (zj.nnx steps do this for blocks held in an nnx.List.)",
        RematNotApplied,
        stacklevel=2,
    )
