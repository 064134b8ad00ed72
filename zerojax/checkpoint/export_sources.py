"""What an export reads: a live state's shards on each process, or a checkpoint's leaves.

A source names the parameters (their dotted names, shapes and the dtypes of the values it
gives) and yields, for one parameter, the boxes this process writes and their values:

- :class:`StateSource`: every process yields the shards its own devices hold (one writer
  per distinct shard over the job: the replica whose ``replica_id`` is 0), in the storage
  layout the plan keeps them in (the fp32 masters; frozen parameters as the run stored them),
  in pieces of at most ``limit`` bytes. Nothing is gathered.
- :class:`CheckpointSource`: process 0 restores one leaf of an orbax checkpoint at a time,
  whole, in the parameter's shape, and yields it in pieces; other processes yield nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint import canonical
from zerojax.checkpoint.io import _manager, checkpoint_steps
from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.plan import master_dtype
from zerojax.state import ZeroState, check_alive
from zerojax.tensors import boxes
from zerojax.tensors.names import tensor_names


class ExportSource:
    """The parameters an export reads (see the module docstring)."""

    what: str  # "the state" / "the checkpoint", for messages
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]  # of the values chunks() yields
    stored: dict[str, str]  # the dtype the run stored each parameter in
    metadata: dict[str, Any]  # step, source_stage, source_devices
    writes: bool  # whether this process yields anything

    def layout(self, name: str) -> LeafLayout | None:
        """The storage layout the boxes of ``chunks(name)`` are in (None: the parameter's shape)."""
        raise NotImplementedError

    def chunks(self, name: str, limit: int) -> Iterator[tuple[boxes.Box, np.ndarray]]:
        raise NotImplementedError

    def whole(self, names: list[str]) -> dict[str, np.ndarray]:
        """Small parameters (LoRA adapters) whole, in float32, where this process writes.
        Called by every process at the same point (it may be a collective)."""
        raise NotImplementedError


def _pieces(box: boxes.Box, host: np.ndarray, limit: int):
    origin = [a for a, _ in box]
    for piece in boxes.pieces(box, host.dtype.itemsize, limit):
        yield piece, host[boxes.slices(boxes.shift(piece, origin))]


class StateSource(ExportSource):
    """A live ``ZeroState``: each process its own shards."""

    what = "the state"

    def __init__(self, state: ZeroState):
        check_alive(state, "export_weights")
        self.state, plan = state, state.plan
        self.names = tensor_names(list(plan.paths))
        from_master = state.master is not None
        train = jax.tree.leaves(state.master if from_master else state.params)
        frozen = jax.tree.leaves(state.frozen) if state.frozen is not None else []
        layouts = [l if from_master else l.replicated() for l in plan.master_layouts]
        pairs = plan.join(list(zip(train, layouts)), list(zip(frozen, plan.frozen_layouts)))
        self.leaves = dict(zip(self.names, pairs))
        self.shapes = {n: tuple(l.shape) for n, (_, l) in self.leaves.items()}
        self.dtypes = {n: np.dtype(x.dtype) for n, (x, _) in self.leaves.items()}
        self.stored = {
            n: ("float32" if plan.is_trainable(i) else np.dtype(self.leaves[n][1].dtype).name)
            for i, n in enumerate(self.names)
        }
        step = state.step.addressable_data(0) if isinstance(state.step, jax.Array) else state.step
        self.metadata = {"step": int(np.asarray(step)), "source_stage": plan.stage, "source_devices": plan.shards}
        self.writes = True

    def layout(self, name):
        return self.leaves[name][1]

    def chunks(self, name, limit):
        arr = self.leaves[name][0]
        for shard in arr.addressable_shards:
            if shard.replica_id != 0:  # one writer per distinct shard, over all processes
                continue
            yield from _pieces(boxes.from_index(shard.index, tuple(arr.shape)), np.asarray(shard.data), limit)

    def whole(self, names):
        if not names:
            return {}
        arrays = [self.leaves[n][0] for n in names]
        layouts = [self.leaves[n][1] for n in names]
        rep = self.state.plan.replicated
        full = jax.jit(
            lambda xs: [l.from_storage(x).astype(np.float32) for l, x in zip(layouts, xs)],
            out_shardings=[rep] * len(arrays),
        )(arrays)
        return {n: np.asarray(x.addressable_data(0)) for n, x in zip(names, full)}


class CheckpointSource(ExportSource):
    """Step ``step`` (default: the latest) of a checkpoint directory, read by process 0."""

    what = "the checkpoint"

    def __init__(self, directory: Any, step: int | None):
        if isinstance(directory, (str, os.PathLike)):
            if not os.path.exists(directory):
                raise FileNotFoundError(f"checkpoint directory {os.fspath(directory)!r} does not exist.")
            if not os.path.isdir(directory):
                raise NotADirectoryError(f"checkpoint directory {os.fspath(directory)!r} is not a directory.")
        steps = checkpoint_steps(directory)
        where = repr(os.fspath(directory)) if isinstance(directory, (str, os.PathLike)) else "the directory"
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {where}: it has no complete saved step.")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {where}; it has steps {steps}.")
        self.mngr, self.step = _manager(directory), step
        meta = canonical.Meta.from_json(
            self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        )
        self.meta = meta
        self.names = tensor_names(list(meta.paths))
        self.index = {n: i for i, n in enumerate(self.names)}
        self.frozen = {i: j for j, i in enumerate(i for i in range(len(self.names)) if not meta.is_trainable(i))}
        self.shapes = {n: tuple(meta.layout(i).shape) for i, n in enumerate(self.names)}
        self.dtypes = {
            n: np.dtype(
                meta.frozen_layout(self.frozen[i]).dtype if i in self.frozen else master_dtype(meta.layout(i).dtype)
            )
            for i, n in enumerate(self.names)
        }
        self.stored = {
            n: (np.dtype(meta.frozen_layout(self.frozen[i]).dtype).name if i in self.frozen else "float32")
            for i, n in enumerate(self.names)
        }
        self.metadata = {"step": step, "source_stage": meta.stage, "source_devices": meta.n}
        self.writes = jax.process_index() == 0

    def layout(self, name):
        return None

    def _restore(self, name: str) -> np.ndarray:
        """Parameter ``name`` whole: its fp32 master, or a frozen one as stored."""
        i, meta, key = self.index[name], self.meta, str(self.index[name])
        group, layout = (
            ("frozen", meta.frozen_layout(self.frozen[i])) if i in self.frozen else ("master", meta.layout(i))
        )
        arrays = self.mngr.restore(
            self.step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item={group: {key: 0}},
                    restore_args={group: {key: ocp.RestoreArgs(restore_type=np.ndarray)}},
                    partial_restore=True,
                )
            ),
        )["state"][group]
        return np.asarray(layout.from_storage(np.asarray(arrays[key])))

    def chunks(self, name, limit):
        if self.writes:
            x = self._restore(name)
            yield from _pieces(boxes.full(x.shape), x, limit)

    def whole(self, names):
        return {n: self._restore(n).astype(np.float32) for n in names} if self.writes else {}
