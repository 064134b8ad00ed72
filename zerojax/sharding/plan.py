"""The static plan of a ZeRO state: config, mesh, tree structure and leaf layouts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.sharding.layout import LeafLayout, layout_for
from zerojax.sharding.mesh import auto_axes, axis_size


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Everything static about a ZeRO state; hashable, so it rides in the pytree structure."""

    config: ZeroConfig
    mesh: Mesh
    treedef: Any  # jax.tree_util.PyTreeDef of the user's params
    layouts: tuple[LeafLayout, ...]
    paths: tuple[str, ...] = ()  # each leaf's path (jax.tree_util.keystr), for messages

    @property
    def axis(self) -> str:
        return self.config.axis

    @property
    def n(self) -> int:
        return int(self.mesh.shape[self.config.axis])

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def storage_shardings(self) -> list[NamedSharding]:
        return [NamedSharding(self.mesh, l.partition_spec(self.axis)) for l in self.layouts]

    def param_shardings(self) -> list[NamedSharding]:
        """Shardings of ``state.params`` leaves: storage for stage 3, replicated otherwise."""
        if self.stage == 3:
            return self.storage_shardings()
        return [self.replicated] * len(self.layouts)

    def update_shapes(self) -> set[tuple[int, ...]]:
        """Shapes of the arrays the optimizer updates (storage from stage 1 on)."""
        if self.stage == 0:
            return {l.shape for l in self.layouts}
        return {l.storage_shape for l in self.layouts}

    def opt_sharding(self, leaf: Any) -> NamedSharding:
        """Optimizer state leaves shaped like a parameter's storage are sharded like it
        from stage 1 on; everything else (step counts, scalars) is replicated."""
        shape = tuple(np.shape(leaf))
        if self.stage >= 1 and shape in self.update_shapes() and len(shape) >= 1:
            return NamedSharding(self.mesh, P(*([None] * (len(shape) - 1)), self.axis))
        return self.replicated

    def opt_shardings(self, opt_state: Any) -> Any:
        return jax.tree.map(self.opt_sharding, opt_state)


def make_plan(params: Any, mesh: Mesh, config: ZeroConfig) -> ZeroPlan:
    """Validates ``params`` and chooses the layout of every leaf."""
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
    n = axis_size(mesh, config.axis)
    mesh = auto_axes(mesh)
    if mesh.devices.size != n:
        raise ValueError(
            f"mesh {dict(mesh.shape)} has axes other than {config.axis!r} with size > 1; "
            f"zerojax shards over one data axis. Build the mesh with zj.make_mesh()."
        )
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
        layouts.append(layout_for(tuple(leaf.shape), leaf.dtype, n))
    return ZeroPlan(config=config, mesh=mesh, treedef=treedef, layouts=tuple(layouts), paths=tuple(paths))
