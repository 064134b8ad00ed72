"""The static plan of a ZeRO state: config, mesh, tree structures and array layouts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import MaskedNode

from zerojax.config import ZeroConfig
from zerojax.sharding.leaf_layout import LeafLayout, layout_for
from zerojax.sharding.mesh import (
    auto_axes,
    axis_size,
    batch_axes,
    batch_devices,
    context_size,
    expert_size,
    manual_axes,
    pipeline_size,
    tensor_size,
)

HOST = "pinned_host"  # the memory kind of offloaded state


@dataclasses.dataclass(frozen=True)
class OffloadSplit:
    """Which leaves a partial offload (``Offload.ratio < 1``) keeps in host memory: one flag per
    master (trainable parameter) and per optimizer-state array, chosen by
    :func:`zerojax.optim.offload.split_for`; ``share`` is the parameter elements whose state is
    in host memory over all trainable ones."""

    masters: tuple[bool, ...]
    opt: tuple[bool, ...]
    share: float


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Everything static about a ZeRO state; hashable, so it rides in the pytree structure.

    ``layouts`` (one per parameter) and ``opt_layouts`` (one per optimizer-state array) are
    the sharded layouts (:mod:`zerojax.sharding.leaf_layout`) chosen from each array's shape:
    what stages 1–3 store and what checkpoints hold. Stage 0 stores the same arrays
    replicated (:meth:`stored`).
    """

    config: ZeroConfig
    mesh: Mesh
    treedef: Any  # jax.tree_util.PyTreeDef of the user's params
    layouts: tuple[LeafLayout, ...]
    paths: tuple[str, ...] = ()  # each parameter's path (jax.tree_util.keystr), for messages
    opt_treedef: Any = None  # the optimizer state's structure (set by with_optimizer)
    opt_layouts: tuple[LeafLayout, ...] = ()
    trainable: tuple[bool, ...] = ()  # per parameter; empty: every parameter trains
    offload_split: OffloadSplit | None = None  # with Offload.ratio < 1 (set with the optimizer)

    @property
    def axis(self) -> str:
        return self.config.axes.data

    @property
    def shards(self) -> int:
        """Devices the state is sharded over (one replica group: data x context, and x expert
        on an expert mesh, and x pipeline with ``pipeline.shard_outside``): every leaf's
        shard count but a routed expert's and a layer stack's (:meth:`shards_of`)."""
        return int(self.mesh.shape[self.config.axes.data]) * self.context * self.expert * self._outside

    @property
    def _outside(self) -> int:
        """The pipeline degree where the parameters outside the stack are ZeRO-sharded over
        pipeline x data (``ZeroConfig.pipeline.shard_outside``), else 1."""
        return self.pipeline if self.config.pipeline.shard_outside else 1

    def is_expert(self, layout: LeafLayout) -> bool:
        """Whether ``layout`` is split over the expert axis (a routed expert's weight)."""
        return layout.tp and layout.taxis == self.config.axes.expert

    def shards_of(self, layout: LeafLayout) -> int:
        """The shard count of a leaf of ``layout``: data x context for a routed expert's
        (the expert axis splits its experts), :attr:`shards` for every other."""
        if self.is_stack(layout):
            return self.shards // self._outside
        return self.shards // self.expert if self.is_expert(layout) else self.shards

    def storage_axes_of(self, layout: LeafLayout) -> str | tuple[str, ...]:
        """The mesh axes the split dimension of a leaf of ``layout`` lies over: data, then
        expert (but for a routed expert's, which the expert axis splits by expert), then
        context; data-major, so that inside the step's ``shard_map`` (manual over the data
        axis) a device's block is contiguous and split over the others automatically."""
        axes = [self.config.axes.data]
        if self.expert > 1 and not self.is_expert(layout):
            axes.append(self.config.axes.expert)
        if self.context > 1:
            axes.append(self.config.axes.context)
        if self._outside > 1 and not self.is_stack(layout):
            axes.append(self.config.axes.pipeline)
        return axes[0] if len(axes) == 1 else tuple(axes)

    @property
    def pipeline(self) -> int:
        """Devices of the pipeline axis (1 without pipeline parallelism)."""
        return pipeline_size(self.mesh, self.config.axes.pipeline)

    def is_stack(self, layout: LeafLayout) -> bool:
        """Whether ``layout`` is a layer stack's, split over the pipeline axis by its layers."""
        return layout.tp and layout.taxis == self.config.axes.pipeline

    @property
    def stack_leaves(self) -> tuple[int, ...]:
        """The indices (in ``layouts``) of the layer stack's parameters on a pipeline mesh."""
        return tuple(i for i, l in enumerate(self.layouts) if self.is_stack(l))

    def axis_degree(self, name: str) -> int:
        """Devices of the mesh axis ``name`` (1 for an axis the mesh lacks, or none)."""
        return int(self.mesh.shape[name]) if name and name in self.mesh.axis_names else 1

    @property
    def context(self) -> int:
        """Devices of the context axis (1 without context parallelism)."""
        return context_size(self.mesh, self.config.axes.context)

    @property
    def expert(self) -> int:
        """Devices of the expert axis (1 without expert parallelism)."""
        return expert_size(self.mesh, self.config.axes.expert)

    @property
    def replica(self) -> str | None:
        """The mesh axis of replica groups (hybrid sharding), or None on a 1-D mesh."""
        return self.config.axes.replica if self.config.axes.replica in self.mesh.axis_names else None

    @property
    def replicas(self) -> int:
        return int(self.mesh.shape[self.replica]) if self.replica else 1

    @property
    def world(self) -> int:
        """Devices the batch is split over and gradients are averaged over: all of them but
        the tensor axis's (a tensor group shares its rows of the batch)."""
        return int(self.mesh.shape[self.config.axes.data]) * self.replicas

    @property
    def tensor(self) -> int:
        """Devices of the tensor axis (1 without tensor parallelism)."""
        return tensor_size(self.mesh, self.config.axes.tensor)

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes the step's ``shard_map`` is manual over (the batch axes; the tensor axis
        stays automatic)."""
        return manual_axes(self.mesh, self.config.axes.data, self.config.axes.replica)

    @property
    def batch_axes(self) -> str | tuple[str, str]:
        """The mesh axes of the batch (and of every mean over devices)."""
        return batch_axes(self.mesh, self.config.axes.data, self.config.axes.replica)

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def whole(self, layouts) -> list[NamedSharding]:
        """Shardings of full arrays of ``layouts``, replicated over the data axes (split over
        the tensor axis where their layout is): stage 0–2's ``params``."""
        return [NamedSharding(self.mesh, l.tensor_spec()) for l in layouts]

    def stored(self, layout: LeafLayout) -> LeafLayout:
        """How this stage stores an array: replicated at stage 0, sharded from stage 1 on."""
        return layout.replicated() if self.stage == 0 else layout

    # Trainable and frozen parameters.
    def is_trainable(self, i: int) -> bool:
        return not self.trainable or self.trainable[i]

    @property
    def train_layouts(self) -> tuple[LeafLayout, ...]:
        """The sharded layouts of the parameters that train (all but the frozen ones)."""
        return tuple(l for i, l in enumerate(self.layouts) if self.is_trainable(i))

    @property
    def has_frozen(self) -> bool:
        return not all(self.is_trainable(i) for i in range(len(self.layouts)))

    @property
    def master_layouts(self) -> tuple[LeafLayout, ...]:
        """Layouts of the fp32 master weights (trainable parameters) as this stage stores them."""
        return tuple(self.stored(l) for l in self.train_layouts)

    @property
    def frozen_sharded_layouts(self) -> tuple[LeafLayout, ...]:
        """Sharded layouts of the frozen parameters (what stage 3 stores and checkpoints
        hold), in the dtype they are stored in (``ZeroConfig.frozen_dtype``): the compute
        dtype when it is narrower ("compute"), or their own ("param")."""
        compute = jnp.dtype(self.config.compute_dtype)
        out = []
        for i, l in enumerate(self.layouts):
            if not self.is_trainable(i):
                narrow = self.config.frozen_dtype == "compute" and compute.itemsize < jnp.dtype(l.dtype).itemsize
                out.append(dataclasses.replace(l, dtype=compute.name if narrow else l.dtype))
        return tuple(out)

    @property
    def frozen_layouts(self) -> tuple[LeafLayout, ...]:
        """Layouts of the frozen parameters as stored: replicated at stages 0–2, sharded at
        stage 3 (see :attr:`frozen_sharded_layouts`)."""
        return tuple(l.replicated() if self.stage < 3 else l for l in self.frozen_sharded_layouts)

    def split(self, leaves) -> tuple[list, list]:
        """All parameter leaves -> (trainable ones, frozen ones)."""
        leaves = list(leaves)
        return (
            [x for i, x in enumerate(leaves) if self.is_trainable(i)],
            [x for i, x in enumerate(leaves) if not self.is_trainable(i)],
        )

    def join(self, train, frozen) -> list:
        """The inverse of :meth:`split`."""
        train, frozen = iter(train), iter(frozen)
        return [next(train) if self.is_trainable(i) else next(frozen) for i in range(len(self.layouts))]

    def unflatten_train(self, leaves) -> Any:
        """The user's tree with the trainable ``leaves`` and ``optax.MaskedNode()`` in place of
        each frozen parameter (what the optimizer sees, as inside ``optax.masked``)."""
        return self.unflatten(self.join(leaves, [MaskedNode()] * (len(self.layouts) - len(self.train_layouts))))

    def unflatten_frozen(self, leaves) -> Any:
        """The user's tree with the frozen ``leaves`` and ``optax.MaskedNode()`` elsewhere."""
        return self.unflatten(self.join([MaskedNode()] * len(self.train_layouts), leaves))

    @property
    def opt_storage_layouts(self) -> tuple[LeafLayout, ...]:
        """The optimizer state's layouts as this stage stores them, in the storage dtype
        (``ZeroConfig.state_dtypes.optimizer``); :attr:`opt_layouts` keep the dtype
        ``tx.init`` gives, the one the update computes in and checkpoints hold."""
        return tuple(self.stored(dataclasses.replace(l, dtype=self.opt_storage_dtype(l))) for l in self.opt_layouts)

    def opt_storage_dtype(self, layout: LeafLayout) -> str:
        """The dtype an optimizer-state array of ``layout`` is stored in: bf16 for the float32
        arrays (not scalars) with ``state_dtypes.optimizer="bfloat16"``, its own otherwise."""
        narrow = self.config.state_dtypes.optimizer
        if narrow != "float32" and layout.shape != () and jnp.dtype(layout.dtype) == jnp.float32:
            return narrow
        return layout.dtype

    def master_storage_dtype(self, layout: LeafLayout) -> jnp.dtype:
        """The dtype the master of a trainable parameter of ``layout`` is stored in:
        ``state_dtypes.masters`` where it is bf16, else :func:`master_dtype` (fp32 for
        narrow float parameters). The update computes in :func:`master_dtype` either way."""
        narrow = self.config.state_dtypes.masters
        return jnp.dtype(narrow) if narrow != "float32" else master_dtype(layout.dtype)

    def sharding(self, layout: LeafLayout, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, layout.storage_spec(self.storage_axes_of(layout)), memory_kind=memory_kind)

    def shardings(self, layouts, memory_kind: str | None = None) -> list[NamedSharding]:
        return [self.sharding(l, memory_kind) for l in layouts]

    # Host memory (ZeroConfig.offload).
    @property
    def opt_memory(self) -> str | None:
        """Where offloaded optimizer state lives: host memory with ``offload.optimizer``
        (with ``offload.ratio < 1`` only part of it: :meth:`opt_memory_of`)."""
        return HOST if self.config.offload.optimizer else None

    @property
    def master_memory(self) -> str | None:
        """Where offloaded fp32 masters live: host memory when offloaded, if they are kept apart
        (stages 1–2 in bf16/fp16) or are the parameters (stage 3 with ``offload_params``);
        with ``offload.ratio < 1`` only part of them (:meth:`master_memory_of`)."""
        cfg = self.config
        if (cfg.offload.params and self.stage == 3) or (cfg.offload.optimizer and self.stage in (1, 2) and cfg.mixed):
            return HOST
        return None

    @property
    def partial(self) -> bool:
        """Whether the offloaded state is split between host and device (``offload.ratio < 1``)."""
        return self.opt_memory is not None and self.config.offload.ratio < 1

    def _split(self) -> OffloadSplit:
        if self.offload_split is None:
            raise RuntimeError(
                "this plan has Offload.ratio < 1 but no split of its leaves: plans with an optimizer come from "
                "zj.init_state / zj.abstract_state, which choose it (zerojax.optim.offload.split_for)."
            )
        return self.offload_split

    def opt_memory_of(self, j: int) -> str | None:
        """Where optimizer-state array ``j`` lives."""
        if not self.partial:
            return self.opt_memory
        return HOST if self._split().opt[j] else None

    def master_memory_of(self, i: int) -> str | None:
        """Where the master of trainable parameter ``i`` lives."""
        if self.master_memory is None or not self.partial or (self.config.offload.params and self.stage == 3):
            return self.master_memory
        return HOST if self._split().masters[i] else None

    def opt_shardings(self) -> list[NamedSharding]:
        """Each optimizer-state array's sharding, in the memory it lives in."""
        return [self.sharding(l, self.opt_memory_of(j)) for j, l in enumerate(self.opt_storage_layouts)]

    def master_shardings(self) -> list[NamedSharding]:
        """Each master's sharding, in the memory it lives in."""
        return [self.sharding(l, self.master_memory_of(i)) for i, l in enumerate(self.master_layouts)]

    def unflatten(self, leaves) -> Any:
        return jax.tree.unflatten(self.treedef, list(leaves))

    def unflatten_opt(self, leaves) -> Any:
        return jax.tree.unflatten(self.opt_treedef, list(leaves))

    def with_optimizer(self, tx: Any) -> ZeroPlan:
        """This plan with the layouts of ``tx``'s state over the trainable parameters' fp32
        masters (frozen ones are ``optax.MaskedNode()``: they get no optimizer state)."""
        masters = self.unflatten_train(jax.ShapeDtypeStruct(l.shape, master_dtype(l.dtype)) for l in self.train_layouts)
        leaves, treedef = jax.tree.flatten(jax.eval_shape(tx.init, masters))
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, masters))[0]
        ]
        layouts = tuple(self._opt_layout(path, x) for path, x in zip(paths, leaves))
        return dataclasses.replace(self, opt_treedef=treedef, opt_layouts=layouts)

    def _opt_layout(self, path: str, x: Any) -> LeafLayout:
        """An optimizer-state array's layout: its parameter's tensor split where it has the
        parameter's shape and path (Adam's moments), none otherwise (scalars, factored stats)."""
        match = None
        best = -1
        for p, l in zip(self.paths, self.layouts):
            if l.tp and tuple(x.shape) == l.shape and path.endswith(p) and len(p) > best:
                match, best = l, len(p)
        if match is None:
            return layout_for(x.shape, x.dtype, self.shards)
        return layout_for(
            x.shape, x.dtype, self.shards_of(match), tensor=match.tensor, tdim=match.tdim, taxis=match.taxis
        )


def master_dtype(dtype) -> jnp.dtype:
    """fp32 for narrow float params (bf16/fp16), the params' own dtype otherwise."""
    return jnp.promote_types(dtype, jnp.float32)


def make_plan(
    params: Any, mesh: Mesh, config: ZeroConfig, tx: Any = None, trainable: Any = None, tensor_specs: Any = None
) -> ZeroPlan:
    """Validates ``params`` and chooses the layout of every parameter (and, given ``tx``, of
    every optimizer-state array). ``trainable`` marks the parameters that train (a tree of
    bools shaped like ``params``, a callable on ``params`` returning one, or an NNX filter
    such as ``nnx.LoRAParam``; None: all). The tensor split of each parameter comes from
    its annotation or ``tensor_specs`` (:mod:`zerojax.sharding.annotations`)."""
    from zerojax.sharding import annotations

    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
    n = axis_size(mesh, config.axes.data)
    mesh = auto_axes(mesh)
    t = tensor_size(mesh, config.axes.tensor)
    c = context_size(mesh, config.axes.context)
    e = expert_size(mesh, config.axes.expert)
    pp = pipeline_size(mesh, config.axes.pipeline)
    if mesh.devices.size != batch_devices(mesh, config.axes.data, config.axes.replica) * t * c * e * pp:
        raise ValueError(
            f"mesh {dict(mesh.shape)} has axes other than {config.axes.data!r} (the data axis), "
            f"{config.axes.tensor!r} (tensor parallelism), {config.axes.context!r} (context parallelism), "
            f"{config.axes.expert!r} (expert parallelism), {config.axes.pipeline!r} (pipeline parallelism) and "
            f"{config.axes.replica!r} (replica groups) with size > 1; "
            f"zerojax shards over one data axis, optionally replicated, beside tensor, context, expert and pipeline "
            f"axes. Build the mesh with zj.make_mesh(), zj.make_mesh(replicas=R), zj.make_mesh(tensor=T), "
            f"zj.make_mesh(context=C), zj.make_mesh(expert=E) or zj.make_mesh(pipeline=P)."
        )
    if pp == 1 and config.pipeline.microbatches != 1:
        raise ValueError(
            f"ZeroConfig.pipeline.microbatches={config.pipeline.microbatches} needs a pipeline axis; mesh "
            f"{dict(mesh.shape)} has none. Build the mesh with zj.make_mesh(pipeline=P), or take the batch in "
            f"parts without a pipeline with ZeroConfig(grad_accum_steps={config.pipeline.microbatches})."
        )
    if e > 1 and config.axes.model_axes is not None:
        raise ValueError(
            "ZeroConfig.axes.model_axes (a model with its own sharding) is not supported on an expert mesh yet: "
            "its constraints are translated onto the data and tensor axes only. Annotate the experts "
            "with a logical name and ZeroConfig.axes.rules instead (docs/moe.md)."
        )
    if c > 1 and config.axes.model_axes is not None:
        raise ValueError(
            "ZeroConfig.axes.model_axes (a model with its own sharding) is not supported on a context mesh yet: "
            "its constraints are translated onto the data and tensor axes only. Use zj.make_mesh() or "
            "zj.make_mesh(tensor=T)."
        )
    for model_axis, target in config.axes.model_axes or ():
        if target is not None and target not in mesh.axis_names and target != config.axes.tensor:
            raise ValueError(
                f"ZeroConfig.axes.model_axes maps the model's axis {model_axis!r} to {target!r}, which is not an "
                f"axis of the mesh {dict(mesh.shape)}. Map it to one of {mesh.axis_names}, "
                f"{config.axes.tensor!r} or None."
            )
    names = annotations.leaf_names(params, tensor_specs)
    params = annotations.unbox(params)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves_with_path:
        raise ValueError("params has no leaves; pass the model's parameter tree.")
    layouts, paths = [], []
    for path, leaf in leaves_with_path:
        name = jax.tree_util.keystr(path) or "<root>"
        paths.append(name)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"params leaf {name} is a {type(leaf).__name__}, not an array. Pass the "
                "parameter arrays only (nnx.split(model, nnx.Param) or variables['params'])."
            )
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"params leaf {name} has dtype {leaf.dtype}; only floating-point parameters "
                "are trained. Keep integer or boolean state (counters, masks) out of params."
            )
    if len(names) != len(leaves_with_path):
        raise ValueError(
            f"params has {len(leaves_with_path)} leaves but its annotations name {len(names)}; pass "
            "the parameter tree as the model gives it."
        )
    splits = annotations.split_dims(names, [tuple(x.shape) for _, x in leaves_with_path], paths, mesh, config)
    if pp > 1:
        from zerojax.sharding.stack_leaves import stack_splits

        splits = stack_splits(paths, [tuple(x.shape) for _, x in leaves_with_path], splits, pp, config)
    degree = {config.axes.tensor: t, config.axes.expert: e, config.axes.pipeline: pp}
    for (_, leaf), (tdim, taxis) in zip(leaves_with_path, splits):
        # A routed expert's weight is sharded over data x context (the expert axis splits its
        # experts); every other over data x context x expert, all the devices that hold it.
        # A layer stack's leaf is ZeRO-sharded within its pipeline stage; every other over the
        # stages too with pipeline.shard_outside.
        outside = pp if config.pipeline.shard_outside else 1
        if tdim >= 0 and taxis == config.axes.pipeline:
            shards = n * c * e
        else:
            shards = n * c * outside if (tdim >= 0 and taxis == config.axes.expert) else n * c * e * outside
        layouts.append(
            layout_for(
                tuple(leaf.shape),
                leaf.dtype,
                shards,
                tensor=degree[taxis] if tdim >= 0 else 1,
                tdim=tdim,
                taxis=taxis or config.axes.tensor,
            )
        )
    mask = _trainable_mask(trainable, params, treedef, paths)
    plan = ZeroPlan(
        config=config,
        mesh=mesh,
        treedef=treedef,
        layouts=tuple(layouts),
        paths=tuple(paths),
        trainable=() if all(mask) else mask,
    )
    return plan if tx is None else plan.with_optimizer(tx)


def _trainable_mask(trainable: Any, params: Any, treedef: Any, paths: list[str]) -> tuple[bool, ...]:
    if trainable is None:
        return (True,) * len(paths)
    from zerojax.sharding.filters import is_filter, select

    if is_filter(trainable):
        return select(trainable, params, name="trainable")
    mask = trainable(params) if callable(trainable) else trainable
    try:
        leaves = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"trainable must be a tree of bools with the structure of params (or a callable on params "
            f"returning one): {e}"
        ) from None
    out = []
    for path, m in zip(paths, leaves):
        m = bool(m) if isinstance(m, (bool, np.bool_)) else m
        if not isinstance(m, bool):
            raise TypeError(f"trainable{path} must be a bool (True: train, False: frozen), got {m!r}.")
        out.append(m)
    if not any(out):
        raise ValueError("trainable marks every parameter frozen: nothing would train. Mark at least one True.")
    return tuple(out)
