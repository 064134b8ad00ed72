"""The stage- and device-count-independent form of a state that checkpoints hold.

Every parameter leaf is kept as its fp32 master in *storage* form (flattened and zero-
padded, see :mod:`zerojax.sharding.layout`), sharded over the data axis; optimizer state
leaves shaped like a parameter are kept the same way; everything else (step counts,
scalars) as it is. Converting a state to this form is local slicing (no gathering), and
restoring onto N' devices reads each leaf with N' padding (zero padding is appended or
dropped at the end), then re-lays it out for the target stage inside one jitted program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from zerojax.sharding.layout import LeafLayout
from zerojax.sharding.plan import ZeroPlan
from zerojax.state import ZeroState, has_master, state_shardings
from zerojax.optim import loss_scale as ls

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a checkpoint says about itself (stored as JSON next to the arrays)."""

    paths: tuple[str, ...]  # parameter leaf paths
    layouts: tuple[tuple[tuple[int, ...], tuple[int, ...], int, str], ...]  # lead, inner, n, dtype
    opt_layout: tuple[int | None, ...]  # per optimizer leaf: index of its parameter layout, or None
    opt_shapes: tuple[tuple[int, ...], ...]  # per optimizer leaf, as saved
    opt_dtypes: tuple[str, ...]
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
        if d.pop("format", None) != FORMAT_VERSION:
            raise ValueError(f"checkpoint format {d.get('format')} is not {FORMAT_VERSION}; "
                             "it was written by another zerojax version.")
        tup = lambda x: tuple(tup(i) for i in x) if isinstance(x, list) else x
        return cls(**{k: tup(v) for k, v in d.items()})

    def layout(self, i: int, n: int | None = None) -> LeafLayout:
        lead, inner, n0, dtype = self.layouts[i]
        return LeafLayout(lead=tuple(lead), inner=tuple(inner), n=n0 if n is None else n, dtype=dtype)


def leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def opt_layout_index(plan: ZeroPlan, opt_state: Any) -> list[int | None]:
    """For each optimizer leaf, the parameter it belongs to, or None.

    Optax keeps per-parameter state in subtrees shaped like the params (Adam's ``mu`` and
    ``nu``), so a leaf belongs to parameter i when its path ends with parameter i's path
    and its shape is that parameter's (storage) shape. Independent of the device count.
    """
    param_paths = [jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(plan.treedef, plan.layouts))[0]]
    shapes = [l.shape if plan.stage == 0 else l.storage_shape for l in plan.layouts]
    out: list[int | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        key, shape = jax.tree_util.keystr(path), tuple(np.shape(leaf))
        match = [i for i, pp in enumerate(param_paths) if pp and key.endswith(pp) and shapes[i] == shape]
        out.append(max(match, key=lambda i: len(param_paths[i])) if match else None)
    return out


def to_canonical(state: ZeroState) -> tuple[dict, Meta]:
    """The checkpoint form of ``state`` (sharded arrays) and its metadata."""
    plan = state.plan
    opt_leaves, opt_def = jax.tree.flatten(state.opt_state)
    index = opt_layout_index(plan, state.opt_state)
    storage_sh = plan.storage_shardings()

    def convert(params, master, opt_leaves):
        leaves = jax.tree.leaves(params)
        if plan.stage == 3:
            masters = leaves
        elif master is not None:
            masters = jax.tree.leaves(master)
        else:
            masters = [l.to_storage(x) for l, x in zip(plan.layouts, leaves)]
        opt = [plan.layouts[i].to_storage(x) if (i is not None and plan.stage == 0) else x
               for i, x in zip(index, opt_leaves)]
        return masters, opt

    opt_sh = [storage_sh[i] if i is not None else plan.replicated for i in index]
    masters, opt = jax.jit(convert, out_shardings=(storage_sh, opt_sh))(state.params, state.master, opt_leaves)
    arrays = {
        "master": {str(i): x for i, x in enumerate(masters)},
        "opt": {str(i): x for i, x in enumerate(opt)},
        "step": state.step,
        "skipped": state.skipped,
    }
    if state.loss_scale is not None:
        arrays["loss_scale"] = state.loss_scale._asdict()
    meta = Meta(
        paths=tuple(leaf_paths(jax.tree.unflatten(plan.treedef, masters))),
        layouts=tuple((l.lead, l.inner, l.n, l.dtype) for l in plan.layouts),
        opt_layout=tuple(index),
        opt_shapes=tuple(tuple(int(d) for d in np.shape(x)) for x in opt),
        opt_dtypes=tuple(jnp.dtype(x.dtype).name for x in opt),
        opt_treedef=str(opt_def),
        stage=plan.stage, n=plan.n, compute_dtype=plan.config.compute_dtype,
        scaled=state.loss_scale is not None,
    )
    return arrays, meta


def restore_targets(meta: Meta, plan: ZeroPlan) -> dict:
    """``jax.ShapeDtypeStruct`` targets to read each saved array into on ``plan``'s mesh:
    the saved layout with the target's padding, sharded over the target data axis."""
    def storage_sds(i):
        l = meta.layout(i, plan.n)
        return jax.ShapeDtypeStruct(l.storage_shape, jnp.dtype(_master_dtype(l.dtype)),
                                    sharding=NamedSharding(plan.mesh, l.partition_spec(plan.axis)))

    rep = plan.replicated
    opt = {}
    for k, (i, shape) in enumerate(zip(meta.opt_layout, meta.opt_shapes)):
        if i is None:
            opt[str(k)] = jax.ShapeDtypeStruct(shape, jnp.dtype(meta.opt_dtypes[k]), sharding=rep)
        else:
            sds = storage_sds(i)
            opt[str(k)] = sds
    return {"master": {str(i): storage_sds(i) for i in range(len(meta.layouts))}, "opt": opt}


def _master_dtype(dtype: str):
    return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def from_canonical(arrays: dict, meta: Meta, plan: ZeroPlan, opt_template: Any, config_scaled: bool) -> ZeroState:
    """A state laid out for ``plan`` from restored checkpoint arrays (see ``restore_targets``)."""
    opt_leaves_t, opt_def = jax.tree.flatten(opt_template)
    saved_layouts = [meta.layout(i, plan.n) for i in range(len(meta.layouts))]
    compute = jnp.dtype(plan.config.compute_dtype)

    def relayout(x, i):  # saved layout (target padding) -> target layout
        src, dst = saved_layouts[i], plan.layouts[i]
        return x if src == dst else dst.to_storage(src.from_storage(x))

    def build(masters, opt):
        masters = [relayout(masters[str(i)], i) for i in range(len(plan.layouts))]
        opt_out = []
        for k, i in enumerate(meta.opt_layout):
            x = opt[str(k)]
            if i is not None:
                x = relayout(x, i)
                if plan.stage == 0:
                    x = plan.layouts[i].from_storage(x)
            opt_out.append(x.astype(opt_leaves_t[k].dtype))
        unflat = lambda xs: jax.tree.unflatten(plan.treedef, xs)
        if plan.stage == 0:
            params, master = unflat([l.from_storage(x) for l, x in zip(plan.layouts, masters)]), None
        elif plan.stage == 3:
            params, master = unflat(masters), None
        elif has_master(plan):
            params = unflat([l.from_storage(x).astype(compute) for l, x in zip(plan.layouts, masters)])
            master = unflat(masters)
        else:
            params, master = unflat([l.from_storage(x) for l, x in zip(plan.layouts, masters)]), None
        return params, master, jax.tree.unflatten(opt_def, opt_out)

    scaler = ls.init(plan.config)
    sh = state_shardings(plan, opt_template, scaler)
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
