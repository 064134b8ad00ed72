"""A train state born from pretrained weights: ``zj.init_state(..., weights=...)``.

The masters (and frozen weights) are read straight into the storage the plan lays them out
in, each process reading the bytes of its own devices' shards only
(:mod:`zerojax.tensors.weights`); the init program then builds the optimizer state from
them, with the loaded shards donated so that they are never held twice.
"""

from __future__ import annotations

from typing import Any

import jax

from zerojax.sharding.plan import ZeroPlan, master_dtype
from zerojax.tensors.casts import check_cast
from zerojax.tensors.names import tensor_names
from zerojax.tensors.processes import Processes
from zerojax.tensors.weights import as_weights, check_ranges, place, resolve


def loaded_storage(source: Any, params: Any, plan: ZeroPlan, *, init: bool) -> tuple[list, list, bool]:
    """``(trainable storage, frozen storage, params given)``: the storage arrays read from
    ``source`` (``None`` for a parameter ``Weights.optional`` names that the checkpoint
    lacks, which ``params``, an ``init_fn`` or concrete arrays, then provides), and whether
    ``params`` has values. Every other parameter is read, or the call raises before
    anything is placed (on every process of a job: a range error in one process's shards
    is agreed)."""
    weights = as_weights(source)
    names = tensor_names(list(plan.paths))
    leaves = [] if init else jax.tree.leaves(params)
    concrete = not init and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    train_layouts, train_sh = plan.master_layouts, plan.shardings(plan.master_layouts)
    frozen_layouts, frozen_sh = plan.frozen_layouts, plan.shardings(plan.frozen_layouts)
    # A mesh over other processes' devices makes the call collective: agree on its checks.
    group = Processes("init_state") if not plan.replicated.is_fully_addressable else None
    with weights.open() as files:
        exprs, _ = resolve(
            weights,
            files,
            {n: l.shape for n, l in zip(names, plan.layouts)},
            initial=init or concrete,
            what="the parameters given",
        )
        if not exprs:
            raise ValueError(
                f"the map reads no parameter from {weights.path!r}: no parameter name matches it. "
                f"The parameters are named like {', '.join(names[:4])}."
            )
        items, t, f = [], 0, 0
        for i, name in enumerate(names):
            if plan.is_trainable(i):
                layout, sharding, dtype, where = train_layouts[t], train_sh[t], None, ("train", t)
                dtype = master_dtype(layout.dtype)
                t += 1
            else:
                layout, sharding, where = frozen_layouts[f], frozen_sh[f], ("frozen", f)
                dtype = layout.dtype
                f += 1
            if name in exprs:
                items.append((name, exprs[name], layout, sharding, dtype, where))
        for name, expr, _, _, dtype, _ in items:
            check_cast(name, expr.dtype, dtype)
        if group is None:
            check_ranges([it[:5] for it in items], files, weights.buffer_bytes)
        else:
            error = None
            try:
                check_ranges([it[:5] for it in items], files, weights.buffer_bytes, group.alive)
            except Exception as e:  # noqa: BLE001 (agreed by every process, then raised)
                error = e
            group.agree("ranges", error, when="before placing any array")
        loaded = {"train": [None] * len(train_layouts), "frozen": [None] * len(frozen_layouts)}
        for name, expr, layout, sharding, dtype, (kind, j) in items:
            loaded[kind][j] = place(name, expr, layout, sharding, dtype, files, weights.buffer_bytes)
    return loaded["train"], loaded["frozen"], concrete


def donated(plan: ZeroPlan) -> tuple[str, ...]:
    """The init program's arguments, by name, that its outputs can alias: the frozen
    storage (``loaded_frozen``) always; the trainable storage (``loaded_train``) where the
    masters' storage is an output (stages 0 and 3, and with mixed precision; stages 1-2 in
    fp32 keep only the gathered copy) in device memory."""
    keeps = plan.stage in (0, 3) or plan.config.mixed
    return ("loaded_train", "loaded_frozen") if keeps and plan.master_memory is None else ("loaded_frozen",)
