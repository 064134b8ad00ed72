"""The optimizer step of the train step, wherever the state lives."""

from __future__ import annotations

from typing import Any

import jax

from zerojax.optim.offload import apply_offloaded
from zerojax.optim.update import keep_if, update
from zerojax.sharding.plan import ZeroPlan


def apply_optimizer(
    plan: ZeroPlan,
    tx: Any,
    grads: list[jax.Array],
    opt_state: Any,
    masters: list[jax.Array],
    skip: jax.Array | None = None,
    place: str = "device",
    step: jax.Array | None = None,
) -> tuple[list[jax.Array], Any]:
    """New fp32 masters (in ``plan.master_layouts``) and optimizer state after one step of
    ``tx``, each stored where it lives (``plan.master_memory``, ``plan.opt_memory``); a
    step with ``skip`` set changes neither, bit for bit. With offloaded state, ``place``
    ("host" or "device") says where the update runs (:mod:`zerojax.optim.offload`). ``step`` (the state's step count) keys stochastic
    rounding of bf16 masters (``ZeroConfig.state_dtypes``)."""
    opt = jax.tree.leaves(opt_state)
    if plan.opt_memory is None and plan.master_memory is None:
        new_m, new_o = update(plan, tx, grads, opt, masters, step=step)
        new_m, new_o = keep_if(skip, masters, new_m), keep_if(skip, opt, new_o)
    else:
        new_m, new_o = apply_offloaded(plan, tx, grads, opt, masters, skip, place, step)
    return new_m, plan.unflatten_opt(new_o)
