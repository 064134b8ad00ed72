"""The stage- and device-count-independent form of a state that checkpoints hold.

Every fp32 master weight and every optimizer-state array is kept in its sharded layout
(``plan.layouts`` / ``plan.opt_layouts``, see :mod:`zerojax.sharding.leaf_layout`), whatever
the stage that saved it, and the layout is recorded beside it. Converting a state to this
form is local slicing (stage 0) or nothing (stages 1–3). Restoring onto N' devices reads
each array in its saved layout for N' shards (orbax pads or truncates the zero padding at
the end of the split axis), then re-lays it out for the target stage and device count
inside one jitted program (nothing moves when the layout is the same, which is the usual
case: a layout depends on N only through divisibility).

Dtypes: a checkpoint holds the dtypes the optimizer computes in (fp32 masters, the
optimizer state as ``tx.init`` makes it), whatever ``ZeroConfig.state_dtypes`` stores:
saving widens bf16 exactly, restoring into bf16 storage rounds to nearest. So a state saved
with bf16 moments or masters restores into an fp32 run and the other way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.optim import loss_scale as ls
from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.plan import ZeroPlan, master_dtype
from zerojax.stages.per_stage import stage_of
from zerojax.state import ZeroState, state_shardings

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a checkpoint says about itself (stored as JSON next to the arrays)."""

    paths: tuple[str, ...]  # parameter leaf paths
    layouts: tuple[dict, ...]  # LeafLayout.to_json() of each parameter (its sharded layout)
    opt_layouts: tuple[dict, ...]  # ... of each optimizer-state array
    opt_treedef: str
    stage: int
    n: int
    compute_dtype: str
    scaled: bool
    trainable: tuple[bool, ...] = ()  # empty: every parameter trains
    frozen_layouts: tuple[dict, ...] = ()  # of the frozen parameters, in their stored dtype
    model_state: tuple[tuple[tuple[int, ...], str], ...] | None = None  # (shape, dtype) per leaf
    model_state_treedef: str | None = None
    rng_impl: str | None = None  # the key's implementation, when the state has one

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
                "written by earlier zerojax versions: restore them with that version and save again."
            )
        ms = d.get("model_state")
        return cls(
            paths=tuple(d["paths"]),
            layouts=tuple(d["layouts"]),
            opt_layouts=tuple(d["opt_layouts"]),
            opt_treedef=d["opt_treedef"],
            stage=d["stage"],
            n=d["n"],
            compute_dtype=d["compute_dtype"],
            scaled=d["scaled"],
            trainable=tuple(d.get("trainable", ())),
            frozen_layouts=tuple(d.get("frozen_layouts", ())),
            model_state=None if ms is None else tuple((tuple(shape), dtype) for shape, dtype in ms),
            model_state_treedef=d.get("model_state_treedef"),
            rng_impl=d.get("rng_impl"),
        )

    def layout(self, i: int, plan: Any = None) -> LeafLayout:
        """Parameter ``i``'s saved layout, as saved, or read onto ``plan``'s mesh (see
        :func:`_for_reading`)."""
        return _for_reading(LeafLayout.from_json(self.layouts[i]), plan)

    def opt_layout(self, k: int, plan: Any = None) -> LeafLayout:
        return _for_reading(LeafLayout.from_json(self.opt_layouts[k]), plan)

    def frozen_layout(self, j: int, plan: Any = None) -> LeafLayout:
        return _for_reading(LeafLayout.from_json(self.frozen_layouts[j]), plan)

    def is_trainable(self, i: int) -> bool:
        return not self.trainable or self.trainable[i]


def _for_reading(l: LeafLayout, plan: Any) -> LeafLayout:
    """A saved layout read onto ``plan``'s mesh (None: as saved): split over a tensor or
    expert axis of another degree there than when saved, its grid is read whole over that
    axis and re-laid out (checkpoints reshard across tensor and expert degrees, e.g. saved at
    T=2 or E=4, restored at T=1 or E=2); then sharded over the plan's devices for it."""
    if plan is None:
        return l
    if l.tp and l.tensor != plan.axis_degree(l.taxis):
        l = l.without_tensor()
    return l.with_n(plan.shards_of(l))


def relayout(src: LeafLayout, dst: LeafLayout, x: jax.Array) -> jax.Array:
    """An array stored by ``src``, stored by ``dst`` instead (same shape, any layouts)."""
    return x if src == dst else dst.to_storage(src.from_storage(x))


def _leaves(tree: Any) -> list:
    return [] if tree is None else jax.tree.leaves(tree)


def to_canonical(state: ZeroState) -> tuple[dict, Meta]:
    """The checkpoint form of ``state`` (sharded arrays) and its metadata."""
    plan = state.plan
    stage = stage_of(plan)
    train_layouts = plan.train_layouts

    def convert(params, master, frozen, opt):
        masters = stage.masters(plan, _leaves(params) or None, _leaves(master) or None)
        # Checkpoints hold what the optimizer computes in: masters in fp32 and the optimizer state in
        # tx.init's dtypes, whatever ZeroConfig.state_dtypes stores (bf16 widens exactly).
        masters = [
            relayout(s, d, x).astype(master_dtype(d.dtype))
            for s, d, x in zip(plan.master_layouts, train_layouts, masters)
        ]
        frozen = [
            relayout(s, d, x) for s, d, x in zip(plan.frozen_layouts, plan.frozen_sharded_layouts, _leaves(frozen))
        ]
        opt = [
            relayout(s, d, x).astype(d.dtype)
            for s, d, x in zip(plan.opt_storage_layouts, plan.opt_layouts, _leaves(opt))
        ]
        return masters, frozen, opt

    out = (plan.shardings(train_layouts), plan.shardings(plan.frozen_sharded_layouts), plan.shardings(plan.opt_layouts))
    masters, frozen, opt = jax.jit(convert, out_shardings=out)(
        state.params, state.master, state.frozen, state.opt_state
    )
    train_idx = [i for i in range(len(plan.layouts)) if plan.is_trainable(i)]
    frozen_idx = [i for i in range(len(plan.layouts)) if not plan.is_trainable(i)]
    arrays = {
        "master": {str(i): x for i, x in zip(train_idx, masters)},
        "opt": {str(i): x for i, x in enumerate(opt)},
        "step": state.step,
        "skipped": state.skipped,
    }
    if frozen:
        arrays["frozen"] = {str(i): x for i, x in zip(frozen_idx, frozen)}
    if state.loss_scale is not None:
        arrays["loss_scale"] = state.loss_scale._asdict()
    ms_leaves, ms_def = jax.tree.flatten(state.model_state)
    if state.model_state is not None:
        arrays["model_state"] = {str(i): x for i, x in enumerate(ms_leaves)}
    if state.rng is not None:
        arrays["rng"] = jax.random.key_data(state.rng)
    meta = Meta(
        paths=plan.paths,
        layouts=tuple(l.to_json() for l in plan.layouts),
        opt_layouts=tuple(l.to_json() for l in plan.opt_layouts),
        opt_treedef=str(plan.opt_treedef),
        stage=plan.stage,
        n=plan.shards,
        compute_dtype=plan.config.compute_dtype,
        scaled=state.loss_scale is not None,
        trainable=plan.trainable,
        frozen_layouts=tuple(l.to_json() for l in plan.frozen_sharded_layouts),
        model_state=None
        if state.model_state is None
        else tuple((tuple(int(d) for d in x.shape), jnp.dtype(x.dtype).name) for x in ms_leaves),
        model_state_treedef=None if state.model_state is None else str(ms_def),
        rng_impl=None if state.rng is None else str(jax.random.key_impl(state.rng)),
    )
    return arrays, meta


def restore_targets(meta: Meta, plan: ZeroPlan) -> dict:
    """``jax.ShapeDtypeStruct`` targets to read each saved array into on ``plan``'s mesh:
    the saved layout for the target's device count, sharded over the target data axis."""

    def target(layout: LeafLayout, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(layout.storage_shape, jnp.dtype(dtype), sharding=plan.sharding(layout))

    frozen_idx = [i for i in range(len(meta.layouts)) if not meta.is_trainable(i)]
    out = {
        "master": {
            str(i): target(meta.layout(i, plan), master_dtype(meta.layout(i).dtype))
            for i in range(len(meta.layouts))
            if meta.is_trainable(i)
        },
        "opt": {
            str(k): target(meta.opt_layout(k, plan), meta.opt_layout(k).dtype) for k in range(len(meta.opt_layouts))
        },
    }
    if frozen_idx:
        out["frozen"] = {
            str(i): target(meta.frozen_layout(j, plan), meta.frozen_layout(j).dtype) for j, i in enumerate(frozen_idx)
        }
    if meta.model_state is not None:
        out["model_state"] = {
            str(i): jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=plan.replicated)
            for i, (shape, dtype) in enumerate(meta.model_state)
        }
    if meta.rng_impl is not None:
        key_shape = jax.random.key_data(jax.random.key(0, impl=meta.rng_impl)).shape
        out["rng"] = jax.ShapeDtypeStruct(key_shape, jnp.uint32, sharding=plan.replicated)
    return out


def from_canonical(arrays: dict, meta: Meta, plan: ZeroPlan, model_state_def: Any = None) -> ZeroState:
    """A state laid out for ``plan`` from restored checkpoint arrays (see ``restore_targets``).
    ``model_state_def`` is the tree structure to give the restored model state."""
    stage = stage_of(plan)
    train_idx = [i for i in range(len(plan.layouts)) if plan.is_trainable(i)]
    frozen_idx = [i for i in range(len(plan.layouts)) if not plan.is_trainable(i)]

    def build(masters, frozen, opt):
        # Into the storage dtypes of ZeroConfig.state_dtypes: bf16 rounds to nearest.
        masters = [
            relayout(meta.layout(i, plan), l, masters[str(i)]).astype(plan.master_storage_dtype(l))
            for i, l in zip(train_idx, plan.master_layouts)
        ]
        frozen = [
            relayout(meta.frozen_layout(j, plan), l, frozen[str(i)]).astype(l.dtype)
            for j, (i, l) in enumerate(zip(frozen_idx, plan.frozen_layouts))
        ]
        opt = [
            relayout(meta.opt_layout(k, plan), l, opt[str(k)]).astype(l.dtype)
            for k, l in enumerate(plan.opt_storage_layouts)
        ]
        params, master = stage.fields(plan, masters)
        return (
            None if params is None else plan.unflatten_train(params),
            None if master is None else plan.unflatten_train(master),
            plan.unflatten_frozen(frozen) if plan.has_frozen else None,
            plan.unflatten_opt(opt),
        )

    model_state = None
    if meta.model_state is not None:
        model_state = jax.tree.unflatten(
            model_state_def, [arrays["model_state"][str(i)] for i in range(len(meta.model_state))]
        )
    rng = None
    if meta.rng_impl is not None:
        rng = jax.device_put(jax.random.wrap_key_data(jnp.asarray(arrays["rng"]), impl=meta.rng_impl), plan.replicated)
    scaler = ls.init(plan.config)
    sh = state_shardings(plan, scaler, model_state, rng)
    params, master, frozen, opt_state = jax.jit(build, out_shardings=(sh.params, sh.master, sh.frozen, sh.opt_state))(
        arrays["master"], arrays.get("frozen", {}), arrays["opt"]
    )
    if scaler is not None and meta.scaled and "loss_scale" in arrays:
        scaler = ls.LossScaleState(**{k: jnp.asarray(v) for k, v in arrays["loss_scale"].items()})
    rep = plan.replicated
    return ZeroState(
        step=jax.device_put(jnp.asarray(arrays["step"], jnp.int32), rep),
        params=params,
        master=master,
        frozen=frozen,
        opt_state=opt_state,
        model_state=model_state,
        rng=rng,
        loss_scale=jax.device_put(scaler, rep) if scaler is not None else None,
        skipped=jax.device_put(jnp.asarray(arrays["skipped"], jnp.int32), rep),
        plan=plan,
    )
