"""Meshes for ZeRO: every device on one data axis."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


def make_mesh(devices: Sequence[jax.Device] | None = None, axis: str = "data") -> Mesh:
    """Builds a one-axis mesh named ``axis`` over ``devices`` (default: all devices).

    The axis uses ``AxisType.Auto`` so that the optimizer update, which zerojax leaves to
    XLA's partitioner, stays local to each shard and reduces only where it must.

    Example:
      >>> import zerojax as zj
      >>> mesh = zj.make_mesh()
      >>> mesh.axis_names
      ('data',)
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device; got an empty list.")
    return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh``; a clear error when the mesh has no such axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see zj.make_mesh()), got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names} but the config names axis {axis!r}. "
            f"Build the mesh with zj.make_mesh(axis={axis!r}) or set ZeroConfig(axis=...) "
            "to one of the mesh's axes."
        )
    return int(mesh.shape[axis])


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``Auto``.

    zerojax places every collective itself (``shard_map``) and leaves the optimizer update
    to XLA's partitioner, so a mesh built with explicit axes (``jax.make_mesh``'s default)
    is used in its ``Auto`` form; the arrays it returns carry that mesh.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
