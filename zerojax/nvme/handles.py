"""What ``state.opt_state`` holds for an NVMe run: a handle per leaf on disk, and how to read them back.

An NVMe run's state holds its optimizer state's scalars (step counts, injected
hyperparameters) as ordinary arrays and every other leaf as an :class:`OnDisk` handle: the
leaf's shape, dtype and sharding, and the committed version of the files that hold it. A
handle is never an array; :func:`materialize` reads the leaves back (a checkpoint save does).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from zerojax.nvme.store import read_chunk, read_manifest
from zerojax.state import ZeroState


@dataclasses.dataclass(frozen=True)
class OnDisk:
    """One optimizer-state leaf on disk: ``leaf`` (its index in ``jax.tree.leaves(opt_state)``),
    ``shape``, ``dtype``, ``sharding`` (where it lives when read), and the store ``directory``
    and ``version`` holding it."""

    leaf: int
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    directory: str
    version: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its leaf, as a file-name-safe string."""
    return "_".join(f"{s.indices(n)[0]}-{s.indices(n)[1]}" for s, n in zip(index, shape)) or "all"


def chunk_name(leaf: int, index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    return f"{leaf}.{index_key(index, shape)}"


def local_chunks(leaf: int, shape: tuple[int, ...], sharding: Any) -> dict[str, list]:
    """This process's chunks of a leaf: chunk name -> the addressable devices holding it."""
    out: dict[str, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        out.setdefault(chunk_name(leaf, index, shape), []).append(device)
    return out


def chunk_shape(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def read_leaf(handle: OnDisk, sharding: Any = None) -> jax.Array:
    """The leaf ``handle`` names, read from its committed version into ``sharding`` (its own by default)."""
    manifest = read_manifest(handle.directory)
    if manifest is None or manifest["version"] != handle.version:
        now = None if manifest is None else manifest["version"]
        raise ValueError(
            f"this state's optimizer state is version {handle.version} under {handle.directory!r}, but the "
            f"directory now holds version {now}: a later train step has consumed this state. Use the state "
            "the last step returned."
        )
    arrays = []
    for device, index in handle.sharding.addressable_devices_indices_map(handle.shape).items():
        out = np.empty(chunk_shape(index, handle.shape), handle.dtype)
        name = chunk_name(handle.leaf, index, handle.shape)
        read_chunk(os.path.join(handle.directory, f"v{handle.version}", name + ".bin"), out)
        arrays.append(jax.device_put(out, device))
    x = jax.make_array_from_single_device_arrays(handle.shape, handle.sharding, arrays)
    return x if sharding is None else jax.jit(lambda y: y, out_shardings=sharding)(x)  # jit: any memory kind


def materialize(state: ZeroState) -> ZeroState:
    """``state`` with every :class:`OnDisk` leaf of its optimizer state read back, in the
    memory the plan gives offloaded optimizer state (the ordinary host-offload state)."""
    leaves = jax.tree.leaves(state.opt_state)
    if not any(isinstance(x, OnDisk) for x in leaves):
        return state
    plan = state.plan
    out = [
        read_leaf(x, plan.sharding(l, plan.opt_memory_of(j))) if isinstance(x, OnDisk) else x
        for j, (x, l) in enumerate(zip(leaves, plan.opt_storage_layouts))
    ]
    return dataclasses.replace(state, opt_state=plan.unflatten_opt(out))


def on_disk(state: ZeroState) -> bool:
    """Whether ``state``'s optimizer state is on disk (holds :class:`OnDisk` handles)."""
    return any(isinstance(x, OnDisk) for x in jax.tree.leaves(state.opt_state))


def scalars_only(opt_state: Any) -> Any:
    """``opt_state`` with each handle replaced by an empty array, for a compiled program that
    reads only the scalars kept in memory (the learning rate a step reports)."""
    return jax.tree.map(lambda x: np.zeros((0,), np.float32) if isinstance(x, OnDisk) else x, opt_state)
