"""The optimizer update of state kept on disk, group by group.

The update splits into the independent groups of :func:`zerojax.optim.offload.update_groups`
(at most ``Offload.group_size`` parameter elements each). For group g the driver has the
chunks of group g+1 read on the I/O threads while group g's update runs (a jitted program
per group, compiled once: the same :func:`zerojax.optim.offload.group_results` as the
streamed device update), and the chunks of group g-1's new state written behind it. Every
chunk is written into the next version's directory; once all are written and fsync'ed the
manifest switches to it (:mod:`zerojax.nvme.store`).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import wait
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config.groups import NVMe
from zerojax.nvme.handles import OnDisk, chunk_shape
from zerojax.nvme.store import Store
from zerojax.nvme.stream import Streamer, assemble
from zerojax.optim.offload import group_results, on_host, update_groups
from zerojax.sharding.plan import HOST, ZeroPlan
from zerojax.state import ZeroState


class Tier:
    """One run's optimizer state on disk: opens (and locks) the store, moves a state's
    optimizer state there (:meth:`adopt`), and runs the update (:meth:`update`)."""

    def __init__(self, plan: ZeroPlan, tx: Any, nvme: NVMe):
        self.plan, self.tx, self.nvme = plan, tx, nvme
        self.groups = update_groups(plan, tx, plan.config.offload.group_size)
        self.n, self.m = len(plan.master_layouts), len(plan.opt_storage_layouts)
        # Opt leaves kept in memory: the scalars, and with a partial offload (Offload.ratio) the
        # leaves it keeps on the device (their groups hold no leaf on disk: update_groups).
        self.shared = {i - self.n for i in self.groups.shared}
        if plan.partial:
            self.shared |= {j for j in range(self.m) if not plan.offload_split.opt[j]}
        self._check_chunks()
        self.store = Store(nvme.path, jax.process_index())
        self.store.check_room(2 * self.local_bytes())
        self.streamer = Streamer(nvme.buffer_count, nvme.buffer_size)
        self._fns: dict[int, Any] = {}

    def close(self) -> None:
        self.streamer.close()
        self.store.close()

    def _on_disk(self) -> list[int]:
        return [j for j in range(self.m) if j not in self.shared]

    def _sharding(self, j: int):
        return self.plan.sharding(self.plan.opt_storage_layouts[j])

    def local_bytes(self) -> int:
        """Bytes of this process's chunks of one version."""
        total = 0
        for j in self._on_disk():
            l = self.plan.opt_storage_layouts[j]
            indices = {str(i) for i in self._sharding(j).addressable_devices_indices_map(l.storage_shape).values()}
            per = int(np.prod(l.storage_shape, dtype=np.int64)) // max(1, len(self._sharding(j).device_set))
            total += len(indices) * per * np.dtype(l.dtype).itemsize
        return total

    def _check_chunks(self) -> None:
        for j in self._on_disk():
            l = self.plan.opt_storage_layouts[j]
            for index in self._sharding(j).addressable_devices_indices_map(l.storage_shape).values():
                nbytes = int(np.prod(chunk_shape(index, l.storage_shape), dtype=np.int64)) * np.dtype(l.dtype).itemsize
                if nbytes > self.nvme.buffer_size:
                    raise ValueError(
                        f"optimizer-state leaf {j} (shape {l.storage_shape}, {l.dtype}) has shards of {nbytes:,} bytes, "
                        f"larger than NVMe.buffer_size={self.nvme.buffer_size:,}: each shard moves through one "
                        f"buffer. Set NVMe(buffer_size={nbytes}) or more."
                    )

    # -- the state -------------------------------------------------------------------------

    def adopt(self, state: ZeroState) -> ZeroState:
        """``state`` with its optimizer state's arrays written to a new committed version and
        replaced by :class:`OnDisk` handles (the scalars stay arrays)."""
        leaves = jax.tree.leaves(state.opt_state)
        version = self._next_version()
        directory = self.store.begin(version)
        futures = [f for j in self._on_disk() for f in self.streamer.write(directory, j, leaves[j])]
        _finish(futures)
        return self._commit(state, version, leaves)

    def _next_version(self) -> int:
        manifest = self.store.manifest()
        return 0 if manifest is None else manifest["version"] + 1

    def _commit(self, state: ZeroState, version: int, leaves: list) -> ZeroState:
        chunks = {}
        for j in self._on_disk():
            l = self.plan.opt_storage_layouts[j]
            chunks[str(j)] = {"shape": list(l.storage_shape), "dtype": np.dtype(l.dtype).name}
        self.store.commit(version, chunks)
        out = [
            leaves[j]
            if j in self.shared
            else OnDisk(j, tuple(l.storage_shape), np.dtype(l.dtype), self._sharding(j), self.store.dir, version)
            for j, l in enumerate(self.plan.opt_storage_layouts)
        ]
        return dataclasses.replace(state, opt_state=self.plan.unflatten_opt(out))

    # -- the update -------------------------------------------------------------------------

    def update(
        self, state: ZeroState, grads: list, masters: list, skip: jax.Array | None, step: jax.Array
    ) -> tuple[list, ZeroState]:
        """New masters, and ``state`` with the new optimizer state committed on disk."""
        n, plan = self.n, self.plan
        leaves = jax.tree.leaves(state.opt_state)
        handles = [x for x in leaves if isinstance(x, OnDisk)]
        if handles and handles[0].version != self.store.manifest()["version"]:
            raise ValueError(
                f"this state's optimizer state is version {handles[0].version} on disk, but {self.store.dir!r} holds "
                f"version {self.store.manifest()['version']}: a later step consumed it. Pass the state the last step returned."
            )
        old_dir = self.store.version_dir(handles[0].version) if handles else None
        version = self._next_version()
        new_dir = self.store.begin(version)
        shared = {n + j: leaves[j] for j in self.shared}  # moved to the device inside each group's program

        def read(g: int) -> dict:
            ins = self.groups.groups[g][0]
            out = {}
            for i in ins:
                if n <= i < n + self.m and (i - n) not in self.shared:
                    l = plan.opt_storage_layouts[i - n]
                    out[i] = (l, self.streamer.read(old_dir, i - n, l.storage_shape, l.dtype, self._sharding(i - n)))
            return out

        new_masters: list = [None] * n
        new_opt: list = list(leaves)
        writes: list = []
        pending = read(0) if self.groups.groups else {}
        try:
            self._groups(grads, masters, skip, step, read, pending, shared, new_masters, new_opt, new_dir, writes)
        finally:  # nothing keeps writing into the new version once this step has failed
            wait(writes)
        _finish(writes)
        return new_masters, self._commit(state, version, new_opt)

    def _groups(self, grads, masters, skip, step, read, pending, shared, new_masters, new_opt, new_dir, writes) -> None:
        n = self.n
        for g, (ins, outs) in enumerate(self.groups.groups):
            current = pending
            if g + 1 < len(self.groups.groups):
                pending = read(g + 1)  # reads ahead while this group updates
            given = {i: assemble(l.storage_shape, self._sharding(i - n), fs) for i, (l, fs) in current.items()}
            for i in ins:
                if i < n:
                    given[i] = grads[i]
                elif i >= n + self.m:
                    given[i] = masters[i - n - self.m]
            given.update(shared)
            results = self._fn(g)(given, skip, step)
            for k, r in zip(outs, results):
                if k < n:
                    new_masters[k] = r
                elif (k - n) in self.shared:
                    new_opt[k - n] = r
                else:
                    writes += self.streamer.write(new_dir, k - n, r)  # written behind the next group's update

    def _fn(self, g: int):
        fn = self._fns.get(g)
        if fn is None:
            plan, outs = self.plan, self.groups.groups[g][1]
            n, m = self.n, self.m
            layouts = list(plan.master_layouts) + list(plan.opt_storage_layouts) + list(plan.master_layouts)
            homes = [plan.master_memory_of(i) for i in range(n)] + [
                plan.opt_memory_of(j) if j in self.shared else None for j in range(m)
            ]
            out_layouts = list(plan.master_layouts) + list(plan.opt_storage_layouts)

            on_disk = any(n <= i < n + m and (i - n) not in self.shared for i in self.groups.groups[g][0])
            host = on_disk and plan.config.offload.update == "host"  # the device's own part updates there

            def run(given, skip, step):
                if host:  # DeepSpeed's arrangement: the state read from disk updates in host memory
                    rep = NamedSharding(plan.mesh, P(), memory_kind=HOST)
                    given = {i: jax.device_put(x, plan.sharding(layouts[i], HOST)) for i, x in given.items()}
                    flag = None if skip is None else jax.device_put(skip, rep)
                    results = on_host(
                        lambda g, f, t: group_results(plan, self.tx, g, outs, f, t, HOST),
                        given,
                        flag,
                        jax.device_put(step, rep),
                    )
                else:
                    given = {i: jax.device_put(x, plan.sharding(layouts[i])) for i, x in given.items()}
                    results = group_results(plan, self.tx, given, outs, skip, step)
                return [jax.device_put(r, plan.sharding(out_layouts[k], homes[k])) for k, r in zip(outs, results)]

            fn = self._fns[g] = jax.jit(run)
        return fn


def _finish(futures: list) -> None:
    """Waits for every future, then raises the first failure among them."""
    wait(futures)
    for f in futures:
        f.result()
