"""Global batches from the rows each process loads itself."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def process_rows(global_batch_size: int, mesh: Mesh, axis: str = "data") -> slice:
    """The rows of the global batch this process loads: its devices' contiguous block.

    The data axis lists devices process by process, so process p owns rows
    ``[p * B / P, (p + 1) * B / P)`` of a global batch of B rows over P processes.

    Example:
      >>> import zerojax as zj
      >>> zj.distributed.process_rows(64, zj.make_mesh())   # one process owns all rows
      slice(0, 64, None)
    """
    n = int(mesh.shape[axis])
    if global_batch_size % n:
        raise ValueError(f"global batch of {global_batch_size} rows does not divide over {n} devices.")
    per_device = global_batch_size // n
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError("this process's devices are not contiguous on the data axis; build the "
                         "mesh with zj.make_mesh() (devices in process order).")
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def global_batch(local_batch: Any, mesh: Mesh, axis: str = "data") -> Any:
    """A global batch (leading axis split over ``axis``) from this process's own rows
    (``jax.make_array_from_process_local_data``); see :func:`process_rows` for which rows.

    Example:
      >>> import numpy as np, zerojax as zj
      >>> mesh = zj.make_mesh()
      >>> rows = zj.distributed.process_rows(16, mesh)
      >>> b = zj.distributed.global_batch({"x": np.arange(16.0)[rows]}, mesh)
      >>> b["x"].shape
      (16,)
    """
    sharding = NamedSharding(mesh, P(axis))
    n_proc = len({d.process_index for d in mesh.devices.flat})

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * n_proc,) + x.shape[1:])

    return jax.tree.map(one, local_batch)
