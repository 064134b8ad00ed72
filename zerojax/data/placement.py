"""A host batch placed on the mesh as the train step takes it: the step's shardings and the
step's refusals, applied before the step sees the batch.

The shardings are the ones an ahead-of-time compile of the step gives its batch
(:func:`zerojax.context.batch.batch_shardings`): rows over the batch axes (data, and replica
on a hybrid mesh; the expert axis after them on an expert mesh), and on a context mesh each
leaf's first sequence dimension over the context axis. A batch placed so goes through the
step's own placement unchanged (:func:`zerojax.step.place_batch`) and into its program with
no transfer.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import numpy as np

from zerojax.config import ZeroConfig
from zerojax.context import batch as context_batch
from zerojax.sharding.mesh import auto_axes, row_split
from zerojax.sharding.plan import ZeroPlan
from zerojax.step import check_batch

Rows = Literal["global", "process"]
ROWS = ("global", "process")


def batch_plan(mesh: Any, config: ZeroConfig | None) -> ZeroPlan:
    """The part of a train step's plan that decides where its batch goes (no parameters):
    the step's mesh (every axis ``Auto``, as the step uses it) and config."""
    if config is None:
        config = ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be the train step's zj.ZeroConfig, got {type(config).__name__}.")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see zj.make_mesh()), got {type(mesh).__name__}.")
    row_split(mesh, config)  # a mesh without the config's data axis is refused here, naming it
    return ZeroPlan(config=config, mesh=auto_axes(mesh), treedef=None, layouts=())


def check_global(plan: ZeroPlan, batch: Any) -> None:
    """The train step's refusals of a global batch (leaves with no leading axis, rows that do
    not split over the batch devices and micro-batches, sequences that do not split over the
    context axis), made on shapes alone."""
    check_batch(batch, *row_split(plan.mesh, plan.config), plan.config.grad_accum_steps)
    context_batch.check(plan, batch)


def _host(batch: Any) -> Any:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} is already a global array across processes; "
                "give Prefetch the host arrays (numpy) it should place."
            )
    return jax.tree.map(np.asarray, batch)


def place(plan: ZeroPlan, batch: Any, rows: Rows) -> Any:
    """``batch`` (a pytree of host arrays) as global ``jax.Array`` s laid out as the step
    takes them. ``rows="global"``: every process gives the whole global batch and each device
    receives its block; ``rows="process"``: each process gives only the rows (and on a
    context mesh, the sequence chunks) its devices hold, as
    :func:`zerojax.distributed.process_slices` says, joined with
    ``jax.make_array_from_process_local_data``."""
    batch = _host(batch)
    if rows == "global":
        check_global(plan, batch)
        leaves, treedef = jax.tree.flatten(batch)
        out = [
            jax.make_array_from_callback(x.shape, s, lambda index, x=x: x[index])
            for x, s in zip(leaves, context_batch.batch_shardings(plan, batch))
        ]
        return jax.tree.unflatten(treedef, out)
    _check_local_rows(plan, batch)
    leaves, treedef = jax.tree.flatten(batch)
    paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    out = []
    for name, x, s in zip(paths, leaves, context_batch.batch_shardings(plan, batch)):
        try:
            out.append(jax.make_array_from_process_local_data(s, x))
        except ValueError as e:
            raise ValueError(
                f"batch leaf {name} {list(x.shape)} (this process's part, rows='process') does not split as "
                f"{s.spec} over this process's devices: {e} Give each process its rows and sequence chunks "
                "(zj.distributed.process_slices(global_batch, seq_len, mesh, config=config))."
            ) from None
    placed = jax.tree.unflatten(treedef, out)
    check_global(plan, placed)
    return placed


def _check_local_rows(plan: ZeroPlan, batch: Any) -> None:
    """A process's rows divide over its own row blocks (its devices' distinct positions on
    the batch axes), else the global shape is not this process's rows times the processes."""
    n, axes = row_split(plan.mesh, plan.config)
    spec = jax.sharding.PartitionSpec(axes)
    blocks = jax.sharding.NamedSharding(plan.mesh, spec).addressable_devices_indices_map((n,))
    mine = len({idx[0].start for idx in blocks.values()})
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if x.ndim == 0 or x.shape[0] % mine:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape {list(x.shape)}: with "
                f"rows='process' each process gives its own rows, a multiple of the {mine} row block(s) its "
                f"devices hold ({n} in all, over {' x '.join(axes)}). Give this process "
                "batch[zj.distributed.process_rows(global_batch, mesh)], or pass rows='global' with the whole batch."
            )
