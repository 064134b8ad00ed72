"""The trained values an NNX module holds, as ``nnx.Optimizer`` leaves them in the module.

Flax's ``nnx.Optimizer(model, tx).update(model, grads)`` changes ``model`` in place, so
``model(x)`` after training runs the trained weights. ``zj.nnx.Optimizer`` keeps the same
contract: after every change of its state (a train step, a skipped fp16 step, a restore)
the module it was given holds:

* each trainable parameter's fp32 master, in the parameter's own shape and dtype, still
  sharded over the data axis where its storage splits evenly (no copy: the very array the
  optimizer holds), whole on every device where its storage is padded or flattened (small
  arrays, by the storage rule: :mod:`zerojax.sharding.leaf_layout`);
* its model state (``nnx.BatchStat``, rng counters) as the step left it.

Frozen parameters never change, so the module keeps its own.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.sharding.leaf_layout import LeafLayout
from zerojax.sharding.plan import ZeroPlan


def _even(layout: LeafLayout) -> bool:
    """Whether the array in its own shape splits over the data devices as stored."""
    return layout.kind == "dim" and layout.n * layout.chunk == layout.grid[layout.dim]


def _spec(plan: ZeroPlan, layout: LeafLayout) -> P:
    if _even(layout) or layout.kind == "replicated":
        return layout.view_spec(plan.storage_axes_of(layout))
    return layout.tensor_spec()  # padded or flattened storage: whole over the data axis


@functools.lru_cache(maxsize=64)
def values_fn(plan: ZeroPlan, from_storage: bool, memory_kinds: tuple[str | None, ...]):
    """``f(train leaves as stored) -> the trainable parameters`` in their own shapes and
    dtypes (see the module docstring), in the memory the state keeps them in."""
    layouts = plan.master_layouts
    dtypes = [l.dtype for l in plan.train_layouts]

    def values(train):
        return [(l.from_storage(x) if from_storage else x).astype(d) for l, x, d in zip(layouts, train, dtypes)]

    shardings = [
        NamedSharding(plan.mesh, _spec(plan, l) if from_storage else P(), memory_kind=m)
        for l, m in zip(layouts, memory_kinds)
    ]
    return jax.jit(values, out_shardings=shardings)


def trained_values(state: Any) -> list[jax.Array]:
    """The trainable parameters of a :class:`zerojax.ZeroState`, in ``plan.train_layouts``
    order, as the module holds them."""
    from_storage = state.master is not None  # else the replicated params are the fp32 masters
    train = jax.tree.leaves(state.master if from_storage else state.params)
    kinds = tuple(getattr(x.sharding, "memory_kind", None) for x in train)
    return values_fn(state.plan, from_storage, kinds)(train)
