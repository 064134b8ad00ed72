"""Meshes for ZeRO: one data axis, or replicas of it (hybrid sharding).

A zerojax mesh has the data axis that state is sharded over and, for hybrid sharding
(FSDP's HSDP, DeepSpeed's MiCS and ZeRO++'s hpZ), a replica axis outside it: each replica
group of ``N/R`` devices holds one sharded copy of the state, and the batch is split over
every device. Devices are laid out in ``jax.devices()`` order (process by process), so
row ``r`` of the ``(R, N/R)`` grid is ``devices[r·N/R : (r+1)·N/R]``: when a process's
devices fill whole groups (or a group's devices fill whole processes), the data axis,
whose gathers and reduce-scatters run every layer, stays inside a host, and only the
gradient shards' all-reduce crosses hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(
    devices: Sequence[jax.Device] | None = None,
    axis: str = "data",
    *,
    replicas: int = 1,
    replica_axis: str = "replica",
    tensor: int = 1,
    tensor_axis: str = "tensor",
    group_size: int | None = None,
    context: int = 1,
    context_axis: str = "context",
    expert: int = 1,
    expert_axis: str = "expert",
    pipeline: int = 1,
    pipeline_axis: str = "pipeline",
) -> Mesh:
    """Builds the mesh zerojax shards over: ``(N,)`` named ``axis``, or with ``replicas=R``,
    ``(R, N/R)`` named ``(replica_axis, axis)``: every stage shards over ``axis`` within a
    group of ``N/R`` devices and replicates over ``replica_axis`` (hybrid sharding).

    Every axis is ``AxisType.Auto`` (classic GSPMD), on every JAX version, so that the
    optimizer update, which zerojax leaves to XLA's partitioner, stays local to each shard
    and reduces only where it must. (``jax.make_mesh`` itself defaults to ``Explicit`` axes
    on jax 0.12; zerojax uses such a mesh in its ``Auto`` form, see :func:`auto_axes`.) On a multi-host
    job with one replica group per process (``R == jax.process_count()``), the grid comes
    from ``mesh_utils.create_hybrid_device_mesh`` (each group one process's devices, laid out
    for its interconnect); otherwise devices are taken in ``jax.devices()`` order, process by
    process, ``N/R`` per group (see the module docstring).

    With ``tensor=T`` the mesh gains a tensor-parallel axis ``tensor_axis`` innermost:
    ``(N/T,)`` data x ``T`` tensor, or ``(R, N/(R·T), T)`` with replicas; the ``T`` devices of
    a tensor group are neighbours in device order (the fastest links, one host), and the
    model's annotated weights are split over them (see ``ZeroConfig.axes.tensor``).

    With ``context=C`` the mesh gains a context-parallel axis ``context_axis`` between the
    data and tensor axes: ``(replica, data, context, tensor)``, the replica and tensor axes
    only where asked. The batch's sequence dimension is split over it and ZeRO shards the
    state over data x context (see ``ZeroConfig.axes.context``).

    With ``expert=E`` the mesh gains an expert-parallel axis ``expert_axis`` after the data
    axis: ``(replica, data, expert, context, tensor)``. The batch is split over data x expert
    (an expert group's devices are data-parallel for every layer but the routed experts);
    weights annotated with the expert axis (the stacked experts' expert dimension) are
    split over it, each device holding ``n_experts / E`` experts (see ``ZeroConfig.axes.expert``
    and docs/moe.md).

    With ``pipeline=P`` the mesh gains a pipeline axis ``pipeline_axis`` outermost:
    ``(pipeline, replica, data, expert, context, tensor)``. The devices (in process order)
    are cut into ``P`` contiguous groups, one per stage, and each group is laid out as the
    mesh of the other arguments would lay out its devices alone. The pipeline axis is the
    slowest link: on a multi-host job a stage is whole hosts where ``P`` divides the process
    count (one activation per micro-batch crosses between neighbouring stages), and the data,
    expert, context and tensor axes, whose collectives run every layer, stay inside a stage
    (see docs/pipeline.md).

    ``group_size=G`` asks for replica groups of ``G`` devices instead of a number of them
    (``replicas = N // G``, DeepSpeed's ``mics_shard_size``), refused where ``G`` does not
    divide ``N``.

    Example:
      >>> import jax, zerojax as zj
      >>> zj.make_mesh().axis_names
      ('data',)
      >>> zj.make_mesh().axis_types == (jax.sharding.AxisType.Auto,)
      True
      >>> mesh = zj.make_mesh(replicas=2)
      >>> mesh.axis_names, dict(mesh.shape)
      (('replica', 'data'), {'replica': 2, 'data': 4})
      >>> zj.make_mesh(replicas=3)
      Traceback (most recent call last):
      ...
      ValueError: make_mesh(replicas=3): 8 devices do not split into 3 equal replica groups. ...
      >>> dict(zj.make_mesh(tensor=2).shape)
      {'data': 4, 'tensor': 2}
      >>> dict(zj.make_mesh(replicas=2, tensor=2).shape)
      {'replica': 2, 'data': 2, 'tensor': 2}
      >>> dict(zj.make_mesh(context=4).shape)
      {'data': 2, 'context': 4}
      >>> dict(zj.make_mesh(expert=4).shape)
      {'data': 2, 'expert': 4}
      >>> dict(zj.make_mesh(group_size=4).shape)
      {'replica': 2, 'data': 4}
      >>> dict(zj.make_mesh(pipeline=2).shape)
      {'pipeline': 2, 'data': 4}
      >>> dict(zj.make_mesh(pipeline=2, tensor=2).shape)
      {'pipeline': 2, 'data': 2, 'tensor': 2}
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device; got an empty list.")
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"make_mesh(pipeline=...) must be a positive int (pipeline stages), got {pipeline!r}.")
    if pipeline > 1:
        inner = dict(
            axis=axis,
            replicas=replicas,
            replica_axis=replica_axis,
            tensor=tensor,
            tensor_axis=tensor_axis,
            group_size=group_size,
            context=context,
            context_axis=context_axis,
            expert=expert,
            expert_axis=expert_axis,
        )
        return _with_pipeline(devices, pipeline, pipeline_axis, inner)
    if group_size is not None:
        replicas = _replicas_of_groups(len(devices), group_size, replicas)
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"make_mesh(tensor=...) must be a positive int (tensor-parallel degree), got {tensor!r}.")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"make_mesh(context=...) must be a positive int (context-parallel degree), got {context!r}.")
    if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1:
        raise ValueError(f"make_mesh(expert=...) must be a positive int (expert-parallel degree), got {expert!r}.")
    if expert > 1:
        return _with_expert(
            devices, axis, replicas, replica_axis, tensor, tensor_axis, context, context_axis, expert, expert_axis
        )
    if context > 1:
        return _with_context(devices, axis, replicas, replica_axis, tensor, tensor_axis, context, context_axis)
    if tensor > 1:
        return _with_tensor(devices, axis, replicas, replica_axis, tensor, tensor_axis)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"make_mesh(replicas=...) must be a positive int (replica groups), got {replicas!r}.")
    if replicas == 1:
        return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,), devices=devices)
    if not isinstance(replica_axis, str) or not replica_axis or replica_axis == axis:
        raise ValueError(
            f"make_mesh(replica_axis={replica_axis!r}) must be a non-empty name other than the data axis {axis!r}."
        )
    if len(devices) % replicas:
        ok = [r for r in range(1, len(devices) + 1) if len(devices) % r == 0]
        raise ValueError(
            f"make_mesh(replicas={replicas}): {len(devices)} devices do not split into {replicas} "
            f"equal replica groups. Use one of {ok}."
        )
    grid = _hybrid_grid(devices, replicas)
    return Mesh(grid, (replica_axis, axis), axis_types=(AxisType.Auto, AxisType.Auto))


def _with_pipeline(devices: list, pipeline: int, pipeline_axis: str, inner: dict) -> Mesh:
    """``(pipeline, *inner mesh)``: ``pipeline`` contiguous groups of ``devices`` in process
    order, each laid out by :func:`make_mesh` with the ``inner`` arguments."""
    names = [inner[k] for k in ("axis", "replica_axis", "tensor_axis", "context_axis", "expert_axis")]
    if not isinstance(pipeline_axis, str) or not pipeline_axis or pipeline_axis in names:
        raise ValueError(
            f"make_mesh(pipeline_axis={pipeline_axis!r}) must be a non-empty name other than the other axes {names}."
        )
    if len(devices) % pipeline:
        ok = [p for p in range(1, len(devices) + 1) if len(devices) % p == 0]
        raise ValueError(
            f"make_mesh(pipeline={pipeline}): {len(devices)} devices do not split into {pipeline} equal "
            f"pipeline stages. Use pipeline in {ok}."
        )
    ordered = [d for _, d in sorted(enumerate(devices), key=lambda t: (t[1].process_index, t[0]))]
    per = len(ordered) // pipeline
    meshes = [make_mesh(ordered[i * per : (i + 1) * per], **inner) for i in range(pipeline)]
    grid = np.stack([m.devices for m in meshes])
    axes = (pipeline_axis, *meshes[0].axis_names)
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def pipeline_size(mesh: Any, pipeline_axis: str = "pipeline") -> int:
    """Devices of the pipeline axis of ``mesh`` (1 when it has none, or for no mesh)."""
    if mesh is None:
        return 1
    return int(dict(mesh.shape)[pipeline_axis]) if pipeline_axis in mesh.axis_names else 1


def _replicas_of_groups(n: int, group_size: Any, replicas: int) -> int:
    """``replicas`` for groups of ``group_size`` devices (DeepSpeed's ``mics_shard_size``),
    refused where the groups do not divide the devices, as DeepSpeed refuses them."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"make_mesh(group_size=...) must be a positive int (devices per replica group), got {group_size!r}."
        )
    if replicas != 1:
        raise ValueError(
            f"make_mesh takes group_size={group_size} or replicas={replicas}, not both: "
            f"group_size=G is replicas=N // G, checked."
        )
    if n % group_size:
        ok = [g for g in range(1, n + 1) if n % g == 0]
        raise ValueError(
            f"make_mesh(group_size={group_size}): replica groups of {group_size} devices do not divide "
            f"the {n} devices (DeepSpeed refuses it too). Use a group size in {ok}, or a device count "
            f"that {group_size} divides."
        )
    return n // group_size


def _with_context(
    devices: list,
    axis: str,
    replicas: int,
    replica_axis: str,
    tensor: int,
    tensor_axis: str,
    context: int,
    context_axis: str,
) -> Mesh:
    """``(replica, data, context, tensor)`` with the size-1 replica and tensor axes left out:
    a context group is neighbouring devices (after the tensor group, innermost)."""
    names = [n for n in (axis, replica_axis, tensor_axis) if isinstance(n, str) and n]
    if not isinstance(context_axis, str) or not context_axis or context_axis in names:
        raise ValueError(
            f"make_mesh(context_axis={context_axis!r}) must be a non-empty name other than the data, "
            f"replica and tensor axes {names}."
        )
    for name, value in (("replicas", replicas), ("tensor", tensor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_mesh({name}=...) must be a positive int, got {value!r}.")
    if len(devices) % (replicas * context * tensor):
        ok = [c for c in range(1, len(devices) + 1) if len(devices) % (replicas * c * tensor) == 0]
        raise ValueError(
            f"make_mesh(context={context}, tensor={tensor}, replicas={replicas}): {len(devices)} devices "
            f"do not split into groups of {context} x {tensor}{f' in {replicas} replica groups' if replicas > 1 else ''}. "
            f"Use context in {ok}."
        )
    return _laid_out(
        devices, axis, replicas, replica_axis, [(context_axis, context), (tensor_axis, tensor)], keep=context_axis
    )


def _with_expert(
    devices: list,
    axis: str,
    replicas: int,
    replica_axis: str,
    tensor: int,
    tensor_axis: str,
    context: int,
    context_axis: str,
    expert: int,
    expert_axis: str,
) -> Mesh:
    """``(replica, data, expert, context, tensor)``, the size-1 replica, context and tensor
    axes left out: an expert group is neighbouring devices (its all-to-alls stay close)."""
    names = [n for n in (axis, replica_axis, tensor_axis, context_axis) if isinstance(n, str) and n]
    if not isinstance(expert_axis, str) or not expert_axis or expert_axis in names:
        raise ValueError(
            f"make_mesh(expert_axis={expert_axis!r}) must be a non-empty name other than the data, "
            f"replica, tensor and context axes {names}."
        )
    for name, value in (("replicas", replicas), ("tensor", tensor), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_mesh({name}=...) must be a positive int, got {value!r}.")
    other = replicas * context * tensor
    if len(devices) % (other * expert):
        ok = [e for e in range(1, len(devices) + 1) if len(devices) % (other * e) == 0]
        raise ValueError(
            f"make_mesh(expert={expert}, context={context}, tensor={tensor}, replicas={replicas}): "
            f"{len(devices)} devices do not split into groups of {expert} x {context} x {tensor}"
            f"{f' in {replicas} replica groups' if replicas > 1 else ''}. Use expert in {ok}."
        )
    return _laid_out(
        devices,
        axis,
        replicas,
        replica_axis,
        [(expert_axis, expert), (context_axis, context), (tensor_axis, tensor)],
        keep=expert_axis,
    )


def _laid_out(
    devices: list, axis: str, replicas: int, replica_axis: str, inner: list[tuple[str, int]], keep: str
) -> Mesh:
    """``(replica, data, *inner)`` over ``devices`` in process order, the data axis sized by
    what is left, and the size-1 axes left out but the data axis and ``keep``."""
    ordered = [d for _, d in sorted(enumerate(devices), key=lambda t: (t[1].process_index, t[0]))]
    data = len(devices) // (replicas * int(np.prod([k for _, k in inner])))
    shape = [(replica_axis, replicas), (axis, data), *inner]
    shape = [(n, k) for n, k in shape if k > 1 or n in (axis, keep)]
    grid = np.array(ordered, dtype=object).reshape([k for _, k in shape])
    return Mesh(grid, tuple(n for n, _ in shape), axis_types=(AxisType.Auto,) * len(shape))


def expert_size(mesh: Any, expert_axis: str = "expert") -> int:
    """Devices of the expert axis of ``mesh`` (1 when it has none, or for no mesh)."""
    if mesh is None:
        return 1
    return int(dict(mesh.shape)[expert_axis]) if expert_axis in mesh.axis_names else 1


def context_size(mesh: Any, context_axis: str = "context") -> int:
    """Devices of the context axis of ``mesh`` (a ``Mesh`` or the abstract mesh in context;
    1 when it has none, or for no mesh)."""
    if mesh is None:
        return 1
    return int(dict(mesh.shape)[context_axis]) if context_axis in mesh.axis_names else 1


def _with_tensor(devices: list, axis: str, replicas: int, replica_axis: str, tensor: int, tensor_axis: str) -> Mesh:
    if not isinstance(tensor_axis, str) or not tensor_axis or tensor_axis in (axis, replica_axis):
        raise ValueError(
            f"make_mesh(tensor_axis={tensor_axis!r}) must be a non-empty name other than the data "
            f"axis {axis!r} and the replica axis {replica_axis!r}."
        )
    if len(devices) % (tensor * replicas):
        ok = [t for t in range(1, len(devices) + 1) if len(devices) % (t * replicas) == 0]
        raise ValueError(
            f"make_mesh(tensor={tensor}{f', replicas={replicas}' if replicas > 1 else ''}): "
            f"{len(devices)} devices do not split into groups of {tensor} tensor-parallel devices"
            f"{f' in {replicas} replica groups' if replicas > 1 else ''}. Use tensor in {ok}."
        )
    ordered = [d for _, d in sorted(enumerate(devices), key=lambda t: (t[1].process_index, t[0]))]
    data = len(devices) // (tensor * replicas)
    if replicas == 1:
        grid = np.array(ordered, dtype=object).reshape(data, tensor)
        return Mesh(grid, (axis, tensor_axis), axis_types=(AxisType.Auto,) * 2)
    grid = np.array(ordered, dtype=object).reshape(replicas, data, tensor)
    return Mesh(grid, (replica_axis, axis, tensor_axis), axis_types=(AxisType.Auto,) * 3)


def _hybrid_grid(devices: list[jax.Device], replicas: int) -> np.ndarray:
    per_group = len(devices) // replicas
    processes = sorted({d.process_index for d in devices})
    if len(processes) == replicas > 1 and all(
        sum(d.process_index == p for d in devices) == per_group for p in processes
    ):
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_hybrid_device_mesh((1, per_group), (replicas, 1), devices, process_is_granule=True)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # topologies mesh_utils does not lay out: process order below is still per host
    ordered = [d for _, d in sorted(enumerate(devices), key=lambda t: (t[1].process_index, t[0]))]
    return np.array(ordered, dtype=object).reshape(replicas, per_group)


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh``; a clear error when the mesh has no such axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see zj.make_mesh()), got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names} but the config names axis {axis!r}. "
            f"Build the mesh with zj.make_mesh(axis={axis!r}) or set ZeroConfig(axes={{'data': ...}}) "
            "to one of the mesh's axes."
        )
    return int(mesh.shape[axis])


def batch_axes(mesh: Mesh, axis: str, replica_axis: str) -> str | tuple[str, str]:
    """The mesh axes a batch is split over: ``axis``, or ``(replica_axis, axis)`` when the
    mesh has replica groups (the order of ``mesh.devices``, so that device ``i`` of the
    flattened grid holds rows ``i·B/N`` on)."""
    return (replica_axis, axis) if replica_axis in mesh.axis_names else axis


def batch_devices(mesh: Mesh, axis: str, replica_axis: str) -> int:
    """How many devices a batch is split over (every device of a zerojax mesh but the
    tensor axis's: a tensor group shares its batch rows)."""
    n = axis_size(mesh, axis)
    return n * int(mesh.shape[replica_axis]) if replica_axis in mesh.axis_names else n


def row_split(mesh: Mesh, config: Any) -> tuple[int, tuple[str, ...]]:
    """How many ways, and over which axes, a batch's rows are split: the batch axes, and
    the expert axis after them where the mesh has one (automatic in the step)."""
    b = batch_axes(mesh, config.axes.data, config.axes.replica)
    axes = (b,) if isinstance(b, str) else tuple(b)
    n = batch_devices(mesh, config.axes.data, config.axes.replica)
    e = expert_size(mesh, config.axes.expert)
    return (n * e, (*axes, config.axes.expert)) if e > 1 else (n, axes)


def tensor_size(mesh: Mesh, tensor_axis: str) -> int:
    """Devices of the tensor axis (1 when the mesh has none)."""
    return int(mesh.shape[tensor_axis]) if tensor_axis in mesh.axis_names else 1


def manual_axes(mesh: Mesh, axis: str, replica_axis: str) -> frozenset[str]:
    """The axes the step's ``shard_map`` is manual over: the batch axes (the tensor axis,
    where the mesh has one, stays automatic: XLA partitions the model over it)."""
    b = batch_axes(mesh, axis, replica_axis)
    return frozenset((b,) if isinstance(b, str) else b)


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``Auto``.

    zerojax places every collective itself (``shard_map``) and leaves the optimizer update
    to XLA's partitioner, so a mesh built with explicit axes (``jax.make_mesh``'s default)
    is used in its ``Auto`` form; the arrays it returns carry that mesh.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
