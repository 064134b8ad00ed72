"""Global batches from the rows (and, on a context mesh, the sequence chunks) each process
loads itself."""

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
        raise ValueError(
            f"the batch is split over every device: axes {axes} cover "
            f"{int(np.prod([mesh.shape[a] for a in axes]))} of the mesh's {mesh.devices.size}. "
            f"Pass axis=None (all of {mesh.axis_names})."
        )
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
        raise ValueError(
            "this process's devices are not contiguous on the data axis; build the "
            "mesh with zj.make_mesh() (devices in process order)."
        )
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def _axis_names(mesh: Mesh, config: Any, context_axis: str, tensor_axis: str) -> tuple[str, str]:
    """``(context axis, tensor axis)``: a ``ZeroConfig``'s names when one is given."""
    if config is not None:
        from zerojax.config import ZeroConfig

        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a zj.ZeroConfig, got {type(config).__name__}.")
        context_axis, tensor_axis = config.axes.context, config.axes.tensor
    return context_axis, tensor_axis


def _groups(mesh: Mesh, context_axis: str, tensor_axis: str) -> int:
    """Data groups: the devices of one context x tensor block hold the same rows."""
    t = int(mesh.shape[tensor_axis]) if tensor_axis in mesh.axis_names else 1
    return mesh.devices.size // int(mesh.shape[context_axis]) // t


def _context_blocks(mesh: Mesh, context_axis: str, tensor_axis: str) -> tuple[range, range]:
    """The (data-group, context-position) rectangle this process's devices cover."""
    names = list(mesh.axis_names)
    c_dim = names.index(context_axis)
    row_dims = [i for i, n in enumerate(names) if i != c_dim and n != tensor_axis]
    cells = set()
    for idx in np.ndindex(mesh.devices.shape):
        if mesh.devices[idx].process_index == jax.process_index():
            row = int(np.ravel_multi_index([idx[i] for i in row_dims], [mesh.devices.shape[i] for i in row_dims]))
            cells.add((row, idx[c_dim]))
    rows = sorted({r for r, _ in cells})
    cols = sorted({c for _, c in cells})
    if (
        len(cells) != len(rows) * len(cols)
        or rows != list(range(rows[0], rows[-1] + 1))
        or cols != list(range(cols[0], cols[-1] + 1))
    ):
        raise ValueError(
            "this process's devices do not cover a block of data groups x context positions; build "
            "the mesh with zj.make_mesh(context=C) (devices in process order)."
        )
    return range(rows[0], rows[-1] + 1), range(cols[0], cols[-1] + 1)


def process_slices(
    global_batch_size: int,
    seq_len: int,
    mesh: Mesh,
    *,
    context_axis: str = "context",
    tensor_axis: str = "tensor",
    config: Any = None,
) -> tuple[slice, slice]:
    """``(rows, positions)`` of the global batch this process loads on a context mesh
    (``zj.make_mesh(context=C)``): the rows of its data groups and the sequence chunks of
    its context positions, so that no process reads a token its devices do not hold. The
    axis names are the step's: ``config`` (a ``ZeroConfig``) gives them, else
    ``context_axis`` and ``tensor_axis`` (whose devices share rows and chunks).

    Example:
      >>> import zerojax as zj
      >>> zj.distributed.process_slices(8, 64, zj.make_mesh(context=4))  # one process: everything
      (slice(0, 8, None), slice(0, 64, None))
    """
    context_axis, tensor_axis = _axis_names(mesh, config, context_axis, tensor_axis)
    if context_axis not in mesh.axis_names:
        return process_rows(global_batch_size, mesh), slice(0, seq_len)
    c = int(mesh.shape[context_axis])
    groups = _groups(mesh, context_axis, tensor_axis)
    if global_batch_size % groups:
        raise ValueError(f"global batch of {global_batch_size} rows does not divide over {groups} data groups.")
    from zerojax.context.layout import Layout

    Layout("contiguous", c).check(seq_len)
    rows, cols = _context_blocks(mesh, context_axis, tensor_axis)
    r, t = global_batch_size // groups, seq_len // c
    return slice(rows.start * r, rows.stop * r), slice(cols.start * t, cols.stop * t)


def global_batch(
    local_batch: Any,
    mesh: Mesh,
    axis: str | tuple[str, ...] | None = None,
    *,
    context_axis: str = "context",
    context_dims: Any = None,
    tensor_axis: str = "tensor",
    config: Any = None,
) -> Any:
    """A global batch (leading axis split over ``axis``, default every mesh axis, as the
    train step splits it) from this process's own rows
    (``jax.make_array_from_process_local_data``); see :func:`process_rows` for which rows.
    On a context mesh each leaf's sequence is split as the step splits it: pass the step's
    ``config`` (a ``ZeroConfig``: its axis names and ``context_dims``), or the names and
    ``context_dims`` one by one.

    Example:
      >>> import numpy as np, zerojax as zj
      >>> mesh = zj.make_mesh()
      >>> rows = zj.distributed.process_rows(16, mesh)
      >>> b = zj.distributed.global_batch({"x": np.arange(16.0)[rows]}, mesh)
      >>> b["x"].shape
      (16,)
    """
    context_axis, tensor_axis = _axis_names(mesh, config, context_axis, tensor_axis)
    if context_axis in mesh.axis_names and mesh.shape[context_axis] > 1:
        if config is None:
            from zerojax.config import ZeroConfig

            config = ZeroConfig(axes={"context": context_axis, "tensor": tensor_axis}, context={"dims": context_dims})
        return _context_global_batch(local_batch, mesh, config)
    sharding = NamedSharding(mesh, P(_axes(mesh, axis)))
    n_proc = len({d.process_index for d in mesh.devices.flat})

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * n_proc,) + x.shape[1:])

    return jax.tree.map(one, local_batch)


def _context_global_batch(local_batch: Any, mesh: Mesh, config: Any) -> Any:
    """On a context mesh: each leaf's rows over the data axes, its first sequence dimension
    (``config.context.dims``, as the step reads it) over the context axis."""
    from zerojax.context.batch import sequence_dims

    context_axis, tensor_axis = config.axes.context, config.axes.tensor
    rows_axes = tuple(n for n in mesh.axis_names if n not in (context_axis, tensor_axis))
    rows, cols = _context_blocks(mesh, context_axis, tensor_axis)
    groups = _groups(mesh, context_axis, tensor_axis)
    dims = sequence_dims(config, local_batch)
    leaves, treedef = jax.tree.flatten(local_batch)
    out = []
    for x, d in zip(leaves, dims):
        x = np.asarray(x)
        spec = [rows_axes] + [None] * (x.ndim - 1)
        shape = list(x.shape)
        shape[0] = x.shape[0] // len(rows) * groups
        if d:
            spec[d[0]] = context_axis
            shape[d[0]] = x.shape[d[0]] // len(cols) * int(mesh.shape[context_axis])
        out.append(jax.make_array_from_process_local_data(NamedSharding(mesh, P(*spec)), x, tuple(shape)))
    return jax.tree.unflatten(treedef, out)
