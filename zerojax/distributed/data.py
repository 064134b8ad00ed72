"""Global batches from the rows each process loads itself."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _axes(mesh: Mesh, axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    axes = tuple(mesh.axis_names) if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"mesh has axes {mesh.axis_names}; the batch cannot be split over {a!r}.")
    if np.prod([mesh.shape[a] for a in axes]) != mesh.devices.size:
        raise ValueError(f"the batch is split over every device: axes {axes} cover "
                         f"{int(np.prod([mesh.shape[a] for a in axes]))} of the mesh's {mesh.devices.size}. "
                         f"Pass axis=None (all of {mesh.axis_names}).")
    return axes


def process_rows(global_batch_size: int, mesh: Mesh, axis: str | tuple[str, ...] | None = None) -> slice:
    """The rows of the global batch this process loads: its devices' contiguous block.

    The batch is split over every axis of the mesh (``axis=None``: the data axis, and the
    replica axis of a hybrid mesh, in the mesh's order), which lists devices process by
    process, so process p owns rows ``[p * B / P, (p + 1) * B / P)`` of a global batch of
    B rows over P processes.

    Example:
      >>> import zerojax as zj
      >>> zj.distributed.process_rows(64, zj.make_mesh())   # one process owns all rows
      slice(0, 64, None)
    """
    _axes(mesh, axis)
    n = mesh.devices.size
    if global_batch_size % n:
        raise ValueError(f"global batch of {global_batch_size} rows does not divide over {n} devices.")
    per_device = global_batch_size // n
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError("this process's devices are not contiguous on the data axis; build the "
                         "mesh with zj.make_mesh() (devices in process order).")
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def global_batch(local_batch: Any, mesh: Mesh, axis: str | tuple[str, ...] | None = None) -> Any:
    """A global batch (leading axis split over ``axis``, default every mesh axis, as the
    train step splits it) from this process's own rows
    (``jax.make_array_from_process_local_data``); see :func:`process_rows` for which rows.

    Example:
      >>> import numpy as np, zerojax as zj
      >>> mesh = zj.make_mesh()
      >>> rows = zj.distributed.process_rows(16, mesh)
      >>> b = zj.distributed.global_batch({"x": np.arange(16.0)[rows]}, mesh)
      >>> b["x"].shape
      (16,)
    """
    sharding = NamedSharding(mesh, P(_axes(mesh, axis)))
    n_proc = len({d.process_index for d in mesh.devices.flat})

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * n_proc,) + x.shape[1:])

    return jax.tree.map(one, local_batch)
