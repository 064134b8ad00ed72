"""The stage- and device-count-independent form of a state that checkpoints hold.

Every fp32 master weight and every optimizer-state array is kept in its sharded layout
(``plan.layouts`` / ``plan.opt_layouts``, see :mod:`zerojax.sharding.layout`), whatever
the stage that saved it, and the layout is recorded beside it. Converting a state to this
form is local slicing (stage 0) or nothing (stages 1–3). Restoring onto N' devices reads
each array in its saved layout for N' shards (orbax pads or truncates the zero padding at
the end of the split axis), then re-lays it out for the target stage and device count
inside one jitted program (nothing moves when the layout is the same, which is the usual
case: a layout depends on N only through divisibility).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.optim import loss_scale as ls
from zerojax.sharding.layout import LeafLayout
from zerojax.sharding.plan import ZeroPlan, master_dtype
from zerojax.sharding.stages import stage_of
from zerojax.state import ZeroState, state_shardings

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a checkpoint says about itself (stored as JSON next to the arrays)."""

    paths: tuple[str, ...]  # parameter leaf paths
    layouts: tuple[dict, ...]  # LeafLayout.to_json() of each parameter, as saved
    opt_layouts: tuple[dict, ...]  # ... of each optimizer-state array
    opt_treedef: str
    stage: int
    n: int
    compute_dtype: str
    scaled: bool

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict) -> Meta:
        d = dict(d)
        version = d.pop("format", None)
        if version != FORMAT_VERSION:
            raise ValueError(
                f"this checkpoint has format {version}; this zerojax reads format {FORMAT_VERSION} "
                "(arrays stored in their own shapes). Format 1 checkpoints (flattened storage) were "
                "written by earlier zerojax versions: restore them with that version and save again.")
        return cls(paths=tuple(d["paths"]), layouts=tuple(d["layouts"]), opt_layouts=tuple(d["opt_layouts"]),
                   opt_treedef=d["opt_treedef"], stage=d["stage"], n=d["n"], compute_dtype=d["compute_dtype"],
                   scaled=d["scaled"])

    def layout(self, i: int, n: int | None = None) -> LeafLayout:
        """Parameter ``i``'s saved layout, for ``n`` shards (default: as saved)."""
        l = LeafLayout.from_json(self.layouts[i])
        return l if n is None else l.with_n(n)

    def opt_layout(self, k: int, n: int | None = None) -> LeafLayout:
        l = LeafLayout.from_json(self.opt_layouts[k])
        return l if n is None else l.with_n(n)


def relayout(src: LeafLayout, dst: LeafLayout, x: jax.Array) -> jax.Array:
    """An array stored by ``src``, stored by ``dst`` instead (same shape, any layouts)."""
    return x if src == dst else dst.to_storage(src.from_storage(x))


def to_canonical(state: ZeroState) -> tuple[dict, Meta]:
    """The checkpoint form of ``state`` (sharded arrays) and its metadata."""
    plan = state.plan
    stage = stage_of(plan)
    leaves = lambda t: None if t is None else jax.tree.leaves(t)

    def convert(params, master, opt):
        masters = stage.masters(plan, leaves(params), leaves(master))
        masters = [relayout(s, d, x) for s, d, x in zip(plan.master_layouts, plan.layouts, masters)]
        opt = [relayout(s, d, x) for s, d, x in zip(plan.opt_storage_layouts, plan.opt_layouts, leaves(opt))]
        return masters, opt

    out = (plan.shardings(plan.layouts), plan.shardings(plan.opt_layouts))
    masters, opt = jax.jit(convert, out_shardings=out)(state.params, state.master, state.opt_state)
    arrays = {
        "master": {str(i): x for i, x in enumerate(masters)},
        "opt": {str(i): x for i, x in enumerate(opt)},
        "step": state.step,
        "skipped": state.skipped,
    }
    if state.loss_scale is not None:
        arrays["loss_scale"] = state.loss_scale._asdict()
    meta = Meta(
        paths=plan.paths, layouts=tuple(l.to_json() for l in plan.layouts),
        opt_layouts=tuple(l.to_json() for l in plan.opt_layouts), opt_treedef=str(plan.opt_treedef),
        stage=plan.stage, n=plan.n, compute_dtype=plan.config.compute_dtype, scaled=state.loss_scale is not None,
    )
    return arrays, meta


def restore_targets(meta: Meta, plan: ZeroPlan) -> dict:
    """``jax.ShapeDtypeStruct`` targets to read each saved array into on ``plan``'s mesh:
    the saved layout for the target's device count, sharded over the target data axis."""
    def target(layout: LeafLayout, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(layout.storage_shape, jnp.dtype(dtype), sharding=plan.sharding(layout))

    return {
        "master": {str(i): target(meta.layout(i, plan.n), master_dtype(meta.layout(i).dtype))
                   for i in range(len(meta.layouts))},
        "opt": {str(k): target(meta.opt_layout(k, plan.n), meta.opt_layout(k).dtype)
                for k in range(len(meta.opt_layouts))},
    }


def from_canonical(arrays: dict, meta: Meta, plan: ZeroPlan) -> ZeroState:
    """A state laid out for ``plan`` from restored checkpoint arrays (see ``restore_targets``)."""
    stage = stage_of(plan)

    def build(masters, opt):
        masters = [relayout(meta.layout(i, plan.n), l, masters[str(i)]) for i, l in enumerate(plan.master_layouts)]
        opt = [relayout(meta.opt_layout(k, plan.n), l, opt[str(k)]).astype(l.dtype)
               for k, l in enumerate(plan.opt_storage_layouts)]
        params, master = stage.fields(plan, masters)
        return (None if params is None else plan.unflatten(params), None if master is None else plan.unflatten(master),
                plan.unflatten_opt(opt))

    scaler = ls.init(plan.config)
    sh = state_shardings(plan, scaler)
    params, master, opt_state = jax.jit(build, out_shardings=(sh.params, sh.master, sh.opt_state))(
        arrays["master"], arrays["opt"])
    if scaler is not None and meta.scaled and "loss_scale" in arrays:
        scaler = ls.LossScaleState(**{k: jnp.asarray(v) for k, v in arrays["loss_scale"].items()})
    rep = plan.replicated
    return ZeroState(
        step=jax.device_put(jnp.asarray(arrays["step"], jnp.int32), rep), params=params, master=master,
        opt_state=opt_state, loss_scale=jax.device_put(scaler, rep) if scaler is not None else None,
        skipped=jax.device_put(jnp.asarray(arrays["skipped"], jnp.int32), rep), plan=plan,
    )
