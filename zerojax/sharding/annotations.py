"""Which dimension of each parameter the model splits over the tensor axis.

The split comes from the model's own annotations, as Flax writes them, or from a tree of
``PartitionSpec`` s:

* NNX: ``nnx.with_partitioning(init, (None, "tensor"))`` keeps the names as the Variable's
  ``out_sharding`` metadata (read from the ``nnx.State`` given as ``params``; layers made
  by ``nnx.vmap`` / ``nnx.scan`` carry their layer axis when built with
  ``transform_metadata={nnx.PARTITION_NAME: None}``);
* linen: ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` box the parameters
  (``nn.Partitioned``, ``nn.LogicallyPartitioned``); zerojax reads the names and unboxes;
* plain JAX: ``init_state(..., tensor_specs=...)``, a tree of ``PartitionSpec`` (or None)
  shaped like ``params``.

Each name is a mesh axis or a logical name that ``ZeroConfig.axes.rules`` maps to one (or to
None), resolved as the Flax API that wrote the annotation resolves it (linen's rules by
precedence, NNX's as a table: :mod:`zerojax.sharding.logical`). The tensor axis (``ZeroConfig.axes.tensor``) marks the split dimension; it is known
even where the mesh has none. The data and replica axes may be named too: ZeRO shards every
parameter over them anyway. With a tensor axis in the mesh, or rules given, any other name
is an error naming the parameter, never a silent fallback; with neither, nothing is split
and the annotations are not read (a model annotated for another mesh trains as it is).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.sharding import logical
from zerojax.sharding.logical import Annotation

_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")  # Flax's names for the metadata, newest first


def is_boxed(tree: Any) -> bool:
    """Whether ``tree`` holds linen's annotation boxes (``nn.Partitioned``, ...)."""
    from flax.core import meta

    return any(
        isinstance(x, meta.AxisMetadata)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    )


def unbox(tree: Any) -> Any:
    """``tree`` without linen's annotation boxes (the arrays they hold)."""
    from flax.core import meta

    return meta.unbox(tree) if is_boxed(tree) else tree


def leaf_names(params: Any, tensor_specs: Any = None) -> list[Annotation | None]:
    """Per parameter leaf (in ``jax.tree.leaves`` order of the unboxed tree): its annotation
    (the names it gives each dimension, and how Flax resolves them), or None where it has
    none."""
    from flax import linen as nn
    from flax import nnx
    from flax.core import meta

    if tensor_specs is not None:
        treedef = jax.tree.structure(unbox(params))
        boxed = jax.tree.map(lambda s: _Spec(s), tensor_specs, is_leaf=lambda x: x is None or isinstance(x, P))
        try:
            specs = treedef.flatten_up_to(boxed)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"tensor_specs must be a tree of PartitionSpec (or None) with the structure of params: {e}"
            ) from None
        return [None if s.names is None else Annotation(s.names, logical.LINEN) for s in specs]
    out: list[Annotation | None] = []
    is_node = lambda x: isinstance(x, (meta.AxisMetadata, nnx.Variable))
    for x in jax.tree.leaves(params, is_leaf=is_node):
        if isinstance(x, meta.AxisMetadata):
            names = getattr(x, "names", None)
            if names is None:
                out.append(None)
            elif isinstance(x, nn.LogicallyPartitioned):
                out.append(Annotation(tuple(names), logical.LINEN, getattr(x, "rules", None)))
            else:  # nn.Partitioned: mesh axes, no rule applies
                out.append(Annotation(tuple(names), logical.MESH))
        elif isinstance(x, nnx.Variable):
            md = x.get_metadata() if hasattr(x, "get_metadata") else dict(getattr(x, "metadata", {}))
            names = next((md[k] for k in _NNX_KEYS if md.get(k) is not None), None)
            out.append(None if names is None else Annotation(tuple(names), logical.NNX, md.get("sharding_rules")))
        else:
            out.append(None)
    return out


class _Spec:
    """A leaf of ``tensor_specs`` kept whole while flattening."""

    def __init__(self, spec: Any):
        if spec is not None and not isinstance(spec, (P, tuple, list)):
            raise TypeError(f"tensor_specs leaves must be PartitionSpec, a tuple of axis names, or None; got {spec!r}.")
        self.names = None if spec is None else tuple(spec)


def split_dims(
    names: list[Annotation | None], shapes: list[tuple[int, ...]], paths: list[str], mesh: Mesh, config: ZeroConfig
) -> tuple[tuple[int, str], ...]:
    """Per parameter: ``(dimension, axis)`` split over the tensor axis or the expert axis
    (``ZeroConfig.axes.expert``, a routed expert's expert dimension), or ``(-1, "")``,
    checked: a weight is split over one of them on one dimension."""
    rules = tuple(config.axes.rules)
    t_axis, e_axis = config.axes.tensor, config.axes.expert
    sizes = {a: int(mesh.shape[a]) if a in mesh.axis_names else 1 for a in (t_axis, e_axis)}
    split = any(k > 1 for k in sizes.values())
    known = set(mesh.axis_names) | {t_axis, e_axis}
    out = []
    for ann, shape, path in zip(names, shapes, paths):
        if ann is None or (not split and not rules):
            # Without a tensor or expert axis and without rules nothing is split: annotations
            # (logical names of a model written for another mesh too) are not read.
            out.append((-1, ""))
            continue
        leaf_names = ann.names
        if len(leaf_names) > len(shape):
            raise ValueError(
                f"params{path} has shape {shape} but its annotation names {len(leaf_names)} dimensions "
                f"{leaf_names}. Give one name (or None) per dimension."
            )
        try:
            targets = logical.resolve(ann, rules)
        except ValueError as e:
            raise ValueError(f"params{path}: {e}") from None
        dims = {t_axis: [], e_axis: []}
        for d, (name, target) in enumerate(zip(leaf_names, targets)):
            if target is logical.UNRULED:
                axes = _unruled(name, known, path, d, mesh, config)
            else:
                axes = _rule_target(name, target, known, path, d, mesh, config)
            for a in dims:
                if a in axes:
                    dims[a].append(d)
        for a, ds in dims.items():
            if len(ds) > 1:
                what = "tensor" if a == t_axis else "expert"
                raise ValueError(
                    f"params{path} (shape {shape}): its annotation {leaf_names} puts the {what} axis "
                    f"{a!r} on dimensions {ds}; a weight is split over it on one dimension. Annotate "
                    f"one of them (e.g. the output features of a column-parallel kernel, or the "
                    f"stacked experts' expert dimension)."
                )
        used = [(ds[0], a) for a, ds in dims.items() if ds and sizes[a] > 1]
        if len(used) > 1:
            raise ValueError(
                f"params{path} (shape {shape}): its annotation {leaf_names} splits it over both the "
                f"tensor axis {t_axis!r} (dimension {dims[t_axis][0]}) and the expert axis {e_axis!r} "
                f"(dimension {dims[e_axis][0]}); a weight split over both is not supported yet. Leave "
                f"one of them whole on this mesh (a rule mapping its name to None), or use a mesh "
                f"without one of the two axes."
            )
        if not used:
            out.append((-1, ""))
            continue
        d, a = used[0]
        k = sizes[a]
        if shape[d] % k:
            ok = [j for j in range(1, shape[d] + 1) if shape[d] % j == 0 and mesh.devices.size % j == 0]
            what = "tensor" if a == t_axis else "expert"
            raise ValueError(
                f"params{path} (shape {shape}) is split over {a!r} on dimension {d} of size "
                f"{shape[d]}, which does not divide into {k} {what} shards. Use {'an' if what == 'expert' else 'a'} {what} degree "
                f"dividing {shape[d]} (one of {ok}), or a model size that divides {k}."
            )
        out.append((d, a))
    return tuple(out)


def _rule_target(name: Any, target: Any, known: set, path: str, dim: int, mesh: Mesh, config: ZeroConfig) -> tuple:
    """The zerojax mesh axes of a rule's target (model axes through ``ZeroConfig.axes.model_axes``)."""
    amap = dict(config.axes.model_axes or ())
    target = () if target is None else (target,) if isinstance(target, str) else tuple(logical._leaves(target))
    target = tuple(t for t in (amap.get(a, a) if a in amap else a for a in target) if t is not None)
    for a in target:
        if a not in known:
            raise ValueError(
                f"ZeroConfig.axes.rules maps {name!r} to mesh axis {a!r}, which the mesh "
                f"{dict(mesh.shape)} lacks (used by params{path}, dimension {dim}). Map it to one "
                f"of {sorted(known)} or to None."
            )
    return target


def _unruled(name: Any, known: set, path: str, dim: int, mesh: Mesh, config: ZeroConfig) -> tuple:
    """The mesh axes a name no rule covers stands for: a mesh axis, or a model axis of
    ``ZeroConfig.axes.model_axes`` (a tuple; empty: not split)."""
    if name is None:
        return ()
    if isinstance(name, (tuple, list)):
        return tuple(a for n in name for a in _unruled(n, known, path, dim, mesh, config))
    if not isinstance(name, str):
        raise TypeError(f"params{path}: dimension {dim}'s annotation {name!r} is not an axis name (str or None).")
    amap = dict(config.axes.model_axes or ())
    if name in amap:  # a model mesh axis, through ZeroConfig.axes.model_axes
        return () if amap[name] is None else (amap[name],)
    if name in known:
        return (name,)
    raise ValueError(
        f"params{path}: dimension {dim} is annotated {name!r}, which is neither an axis of the mesh "
        f"{dict(mesh.shape)} (nor the tensor axis {config.axes.tensor!r}) nor a logical name of "
        f"ZeroConfig.axes.rules (nor a model axis of ZeroConfig.axes.model_axes). Add a rule, e.g. "
        f"ZeroConfig(axes={{'rules': (({name!r}, {config.axes.tensor!r}),)}}) "
        f"to split it over the tensor axis, or (({name!r}, None),) to leave it whole."
    )
