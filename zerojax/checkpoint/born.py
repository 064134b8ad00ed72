"""A train state born from pretrained weights: ``zj.init_state(..., weights=...)``.

The masters (and frozen weights) are read straight into the storage the plan lays them out
in, each process reading the bytes of its own devices' shards only
(:mod:`zerojax.checkpoint.weights`); the init program then builds the optimizer state from
them, with the loaded shards donated so that they are never held twice.
"""

from __future__ import annotations

from typing import Any

import jax

from zerojax.checkpoint.export import tensor_names
from zerojax.checkpoint.weights import as_weights, check_ranges, place, resolve
from zerojax.sharding.plan import ZeroPlan, master_dtype


def loaded_storage(source: Any, params: Any, plan: ZeroPlan, *, init: bool) -> tuple[list, list, bool]:
    """``(trainable storage, frozen storage, params given)``: the storage arrays read from
    ``source`` (``None`` for a parameter the map does not name, which ``params``, an
    ``init_fn`` or concrete arrays, then provides), and whether ``params`` has values."""
    weights = as_weights(source)
    names = tensor_names(list(plan.paths))
    leaves = [] if init else jax.tree.leaves(params)
    concrete = not init and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    optional = (lambda name: True) if (init or concrete) else (lambda name: False)
    train_layouts, train_sh = plan.master_layouts, plan.shardings(plan.master_layouts)
    frozen_layouts, frozen_sh = plan.frozen_layouts, plan.shardings(plan.frozen_layouts)
    with weights.open() as files:
        exprs = resolve(weights, files, {n: l.shape for n, l in zip(names, plan.layouts)}, optional=optional,
                        what="the parameters given")
        if not exprs:
            raise ValueError(f"the map reads no parameter from {weights.path!r}: no parameter name matches it. "
                             f"The parameters are named like {', '.join(names[:4])}.")
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
        check_ranges([it[:5] for it in items], files, weights.buffer_bytes)
        loaded = {"train": [None] * len(train_layouts), "frozen": [None] * len(frozen_layouts)}
        for name, expr, layout, sharding, dtype, (group, j) in items:
            loaded[group][j] = place(name, expr, layout, sharding, dtype, files, weights.buffer_bytes)
    return loaded["train"], loaded["frozen"], concrete


def donated(plan: ZeroPlan) -> tuple[int, ...]:
    """The init program's arguments (2: trainable storage, 3: frozen) that its outputs can
    alias: the masters' storage is an output at stages 0 and 3 and with mixed precision
    (stages 1-2 in fp32 keep only the gathered copy), in device memory."""
    out = [3]
    keeps = plan.stage in (0, 3) or plan.config.mixed
    if keeps and plan.master_memory is None:
        out.insert(0, 2)
    return tuple(out)
