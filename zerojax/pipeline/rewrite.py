"""The loss with its layer scan run as a pipeline: no model edits.

On a mesh with a pipeline axis the step evaluates the user's loss from its jaxpr
(:class:`~zerojax._jaxpr.retrace.Retracer`) with the one ``scan`` over the layer stack
(:func:`zerojax.pipeline.facts.find`) replaced by :func:`zerojax.pipeline.gpipe.run`. Its
operands are taken as they come:

* scanned operands (the stacked parameters, per-layer keys or constants) ``[L, ...]`` are
  cut into ``[P, L / P, ...]``, one block of layers per stage;
* a carried value that comes from the batch (the activations) and a constant that does (an
  attention mask, positions) must have the device's rows first; they are split into the
  ``M`` micro-batches (row ``r`` to micro-batch ``r % M``) and put back together after the
  last stage. A carried value that does not come from the batch (a layer counter) goes
  through the stages with every micro-batch; its result is micro-batch ``M - 1``'s, which
  is every micro-batch's, since the layers may not make it depend on the batch (refused);
* a key (a constant or a per-layer key, from the step's key) is folded with the
  micro-batch's index, so dropout draws one mask per micro-batch and layer, the same on any
  number of stages.

Everything before and after the stack (embeddings, the final norm, the head, the loss) runs
on the whole of the device's rows on every stage: their compute is repeated on each of the
``P`` stages, no activation moves for them, and their parameters' gradients come out the
same on every stage (docs/pipeline.md measures the cost). Refused with the fix: per-layer
outputs of the scan (``ys``), a reversed scan, the model state inside the stack, batch data
scanned per layer, and rows that do not split into ``M`` micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._jaxpr import check
from zerojax._jaxpr.form import Equation
from zerojax._jaxpr.retrace import Retracer
from zerojax.pipeline import circular as circular_schedule
from zerojax.pipeline import facts, gpipe


def needed(plan: Any) -> bool:
    return plan.pipeline > 1


def wrap(plan: Any, fn: Callable) -> Callable:
    """``fn`` (called ``fn(params, batch, **kwargs)``) as it is, or on a pipeline mesh
    evaluated with its layer scan pipelined (see the module docstring)."""
    if not needed(plan):
        return fn
    check.require(
        f"A pipeline axis ({plan.pipeline} stages)", "Train on a mesh without one (zj.make_mesh() without pipeline=)"
    )
    stack = plan.stack_leaves
    paths = [plan.paths[i] for i in stack]

    @functools.wraps(fn)
    def rewritten(params, batch, **kwargs):
        flat, tree = jax.tree.flatten(((params, batch), kwargs))
        closed, shapes = jax.make_jaxpr(lambda *f: _call(fn, tree, f), return_shape=True)(*flat)
        tags = _tags(params, batch, kwargs, stack)
        scan = facts.find(closed, tags, paths)
        # The same loss traced on one micro-batch's rows: an operand of the layer scan whose
        # leading dimension follows the rows is per row (split into micro-batches), whatever
        # it is made from (the batch, or only its shape: a mask built for B rows).
        micro = plan.config.pipeline.microbatches
        rows = _rows(batch, micro)
        small = jax.tree.map(lambda b: jax.ShapeDtypeStruct((b.shape[0] // micro,) + b.shape[1:], b.dtype), batch)
        flat_small = jax.tree.leaves(((params, small), kwargs))
        one = facts.find(jax.make_jaxpr(lambda *f: _call(fn, tree, f))(*flat_small), tags, paths)
        per_row = _per_row(scan, one, rows, micro)
        out = Pipelined(plan, scan, one, per_row).evaluate(closed, flat)
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return rewritten


def _call(fn: Callable, tree: Any, flat: Any) -> Any:
    (params, batch), kwargs = jax.tree.unflatten(tree, flat)
    return fn(params, batch, **kwargs)


def _rows(batch: Any, micro: int) -> int:
    """The device's rows (every batch leaf's leading dimension), checked to split into ``micro``."""
    rows = {int(jnp.shape(b)[0]) for b in jax.tree.leaves(batch) if jnp.ndim(b)}
    if len(rows) != 1:
        raise ValueError(
            f"a pipeline splits the batch's rows into micro-batches, and its leaves have different leading "
            f"dimensions {sorted(rows)} (or none). Give every batch leaf the rows first, the same number in each."
        )
    (m,) = rows
    if m % micro:
        raise ValueError(
            f"each device's {m} rows of the batch do not split into ZeroConfig.pipeline.microbatches={micro} "
            f"micro-batches. Give a global batch divisible by {micro} x the data devices, or fewer micro-batches."
        )
    return m


def _per_row(whole: facts.LayerScan, one: facts.LayerScan, rows: int, micro: int) -> tuple[bool, ...]:
    """Per operand of the layer scan: whether it is per row (its leading dimension is the
    rows, ``rows`` in ``whole`` and ``rows / micro`` in ``one``, the trace on one
    micro-batch); an operand whose shape changes otherwise is refused."""
    a = [tuple(v.aval.shape) for v in whole.eqn.invars]
    b = [tuple(v.aval.shape) for v in one.eqn.invars]
    n = whole.scan.n_consts + whole.scan.n_carry
    out = []
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x == y:
            out.append(False)
        elif k < n and x[1:] == y[1:] and x[:1] == (rows,) and y[:1] == (rows // micro,):
            out.append(True)
        else:
            what = "scanned per layer" if k >= n else "read by the layers"
            raise ValueError(
                f"the layer scan at {whole.where} has an operand {what} of shape {x} on {rows} rows and {y} on "
                f"{rows // micro}; a pipeline splits values by their leading dimension (the rows) only. Keep the "
                "batch's rows first in what the layers carry or read, and out of what they scan."
            )
    return tuple(out)


def _tags(params: Any, batch: Any, kwargs: dict, stack: tuple[int, ...]) -> list[frozenset]:
    """The facts of the flat inputs ``((params, batch), kwargs)``, in their flat order."""
    position = {leaf: k for k, leaf in enumerate(stack)}
    out = [
        frozenset({facts.stack_tag(position[i])}) if i in position else frozenset()
        for i, _ in enumerate(jax.tree.leaves(params))
    ]
    out += [frozenset({facts.BATCH})] * len(jax.tree.leaves(batch))
    for name in sorted(kwargs):
        tag = {"rng": facts.KEY, "model_state": facts.STATE}.get(name)
        out += [frozenset({tag}) if tag else frozenset()] * len(jax.tree.leaves(kwargs[name]))
    return out


def _is_key(x: Any, stacked: bool) -> bool:
    dtype = jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(x) == (1 if stacked else 0)
    return dtype == jnp.uint32 and tuple(jnp.shape(x))[-1:] == (2,) and jnp.ndim(x) == (2 if stacked else 1)


def _fold(key: jax.Array, j: jax.Array, stacked: bool) -> jax.Array:
    if stacked:
        return jax.vmap(lambda k: jax.random.fold_in(k, j))(key)
    return jax.random.fold_in(key, j)


class Pipelined(Retracer):
    """The loss re-traced with its layer scan pipelined."""

    def __init__(self, plan: Any, scan: facts.LayerScan, one: facts.LayerScan, per_row: tuple[bool, ...]):
        # ``one``: the layer scan of the loss traced on one micro-batch's rows, whose body the
        # stages run (its shapes are a micro-batch's; the whole trace's are the device's rows).
        self.plan, self.layer_scan, self.one, self.per_row = plan, scan, one, per_row

    def replace(self, eqn: Equation, invals: list[Any]) -> list[Any] | None:
        if eqn is not self.layer_scan.eqn:
            return None
        return self._pipelined(invals)

    def _refuse(self, what: str, fix: str) -> None:
        raise ValueError(f"the layer scan at {self.layer_scan.where} {what}; a pipeline cannot split it. {fix}")

    def _pipelined(self, invals: list[Any]) -> list[Any]:
        ls, s = self.layer_scan, self.layer_scan.scan
        stages, micro = self.plan.pipeline, self.plan.config.pipeline.microbatches
        axis = self.plan.config.axes.pipeline
        nc, nk = s.n_consts, s.n_carry
        n_ys = len(ls.outs) - nk
        if s.reverse:
            self._refuse("runs its layers in reverse", "Scan the layers in their order (reverse=False).")
        if n_ys:
            self._refuse(
                f"returns {n_ys} per-layer output(s) (the scan's ys)",
                "Carry what the layers produce (a sum of per-layer losses as a carried value) or compute it after "
                "the stack; per-layer outputs are not built yet beside a pipeline.",
            )
        circular = self.plan.config.pipeline.schedule == "circular"
        repeats = self.plan.config.pipeline.repeats if circular else 1
        if s.length % (stages * repeats):
            self._refuse(
                f"runs {s.length} layers, which do not split into {stages} stages"
                + (f" x {repeats} repeats" if repeats > 1 else ""),
                f"Use a pipeline degree{' and repeats' if repeats > 1 else ''} whose product divides {s.length}.",
            )
        if circular and micro != stages:
            self._refuse(
                f"runs the circular schedule with {micro} micro-batches on {stages} stages",
                f"Give ZeroConfig(pipeline={{'microbatches': {stages}, ...}}): a micro-batch comes round to the first "
                "stage as the last new one leaves it only when they are as many as the stages (more rows per "
                "micro-batch, or grad_accum_steps, take a larger batch)",
            )
        if micro > 1 and not any(self.per_row[nc : nc + nk]):
            self._refuse(
                "carries nothing per row of the batch",
                "Carry the activations through the scan (the layers' input as the scan's carry), rows first.",
            )
        consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        per_micro_at: list[int] = []  # consts split by micro-batch
        key_consts: list[int] = []
        for k, (x, tag) in enumerate(zip(consts, ls.ins[:nc])):
            self._no_state(tag)
            if self.per_row[k]:
                per_micro_at.append(k)
            elif facts.KEY in tag:
                if not _is_key(x, stacked=False):
                    self._refuse(
                        f"reads a value drawn from the step's key ({jnp.shape(x)} {jnp.asarray(x).dtype}) that is "
                        "not a key",
                        "Pass the key into the layers and draw inside them, so that each micro-batch draws its own.",
                    )
                key_consts.append(k)
        key_xs = []
        for k, (x, tag) in enumerate(zip(xs, ls.ins[nc + nk :])):
            self._no_state(tag)
            if facts.BATCH in tag:
                self._refuse(
                    f"scans batch data per layer (operand {jnp.shape(x)})",
                    "Pass batch data into the layers as a closed-over value or a carry, with the rows first.",
                )
            if facts.KEY in tag:
                if not _is_key(x, stacked=True):
                    self._refuse(
                        f"scans values drawn from the step's key that are not keys ({jnp.shape(x)})",
                        "Scan per-layer keys (jax.random.split(key, L)) and draw inside the layers.",
                    )
                key_xs.append(k)
        batch_carry, reduced = [], []
        how = self.plan.config.pipeline.carry_reduce
        for k, (tag_in, tag_out) in enumerate(zip(ls.ins[nc : nc + nk], ls.outs[:nk])):
            self._no_state(tag_in | tag_out)
            if self.per_row[nc + k]:
                batch_carry.append(k)
            elif micro > 1 and (facts.BATCH in tag_out or facts.KEY in tag_out):
                if how is None:
                    self._refuse(
                        f"carries a value (carry {k}, {jnp.shape(carry[k])}) that does not start from the batch but "
                        "that the layers make depend on the batch or the key (a load-balancing loss summed over the "
                        "layers), so its micro-batches' values must be combined",
                        "Say how: ZeroConfig(pipeline={'carry_reduce': 'mean'}) (the micro-batches' mean, as "
                        "grad_accum_steps averages a loss) or 'sum'; or carry batch-shaped values with the rows first",
                    )
                reduced.append(k)
        K = s.length // stages
        if circular:  # block v = r·P + p of l layers to stage p, round r: [R, P, l] -> [P, R, l]
            l = s.length // (stages * repeats)
            blocks = [x.reshape((repeats, stages, l) + x.shape[1:]).swapaxes(0, 1) for x in xs]
        else:
            blocks = [x.reshape((stages, K) + x.shape[1:]) for x in xs]
        carries = [
            gpipe.split(c, micro) if k in batch_carry else jnp.broadcast_to(c, (micro,) + jnp.shape(c))
            for k, c in enumerate(carry)
        ]
        per_micro = [gpipe.split(consts[k], micro) for k in per_micro_at]
        body, body_consts = self.one.scan.body, [self.constant(c) for c in self.one.scan.body_consts]

        def stage(xs_p, carry_p, micro_p, j):
            now = list(consts)
            for k, v in zip(per_micro_at, micro_p):
                now[k] = v
            for k in key_consts:
                now[k] = _fold(now[k], j, stacked=False)
            xs_now = [_fold(x, j, stacked=True) if k in key_xs else x for k, x in enumerate(xs_p)]

            def layer(c, x):
                out = self.run(body, body_consts, [*now, *c, *x])
                return out[:nk], None

            out, _ = jax.lax.scan(layer, list(carry_p), xs_now, unroll=s.unroll)
            return out

        if circular:
            outs = circular_schedule.run(stage, blocks, carries, per_micro, stages, repeats, axis)
        else:
            outs = gpipe.run(stage, blocks, carries, per_micro, stages, micro, axis)
        out = []
        for k, o in enumerate(outs):
            if k in batch_carry:
                out.append(gpipe.merge(o))
            elif k in reduced and how == "mean":
                out.append(jnp.mean(o, axis=0).astype(o.dtype))
            elif k in reduced:  # "sum": each micro-batch started from the carry's start; count it once
                out.append((jnp.sum(o, axis=0) - (micro - 1) * carry[k]).astype(o.dtype))
            else:
                out.append(o[micro - 1])
        return out

    def _no_state(self, tag: frozenset) -> None:
        if facts.STATE in tag:
            self._refuse(
                "reads or updates the model state (BatchNorm statistics, counters)",
                "Keep model state out of the pipelined layers, or train without a pipeline axis.",
            )
