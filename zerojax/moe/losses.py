"""The router's auxiliary losses, over the step's whole (micro-)batch wherever its tokens lie.

Definitions (``T`` tokens, ``E`` experts, ``k`` per token; the same as Hugging Face's
``load_balancing_loss_func`` for Mixtral and Qwen-MoE, and Switch Transformer's for k = 1):

- load balancing: ``E · Σᵢ fᵢ · Pᵢ``, ``fᵢ`` the assignments routed to expert ``i`` (before
  any capacity drop) per token (``Σᵢ fᵢ = k``), ``Pᵢ`` the router's mean probability of
  ``i`` over the tokens. 1·k when perfectly balanced.
- z-loss (ST-MoE): the mean over tokens of ``logsumexp(router logits)²``.

**Over the global batch.** ``fᵢ`` and ``Pᵢ`` are means over every token of the step's
micro-batch, on every device. The z-loss is a mean of per-token terms, and ``fᵢ`` has no
gradient (it counts discrete choices), so the load-balancing loss is linear in ``Pᵢ``:
each data shard (the train step's ``shard_map`` is manual over the data axes) computes
``E · Σᵢ fᵢ(global) · Pᵢ(its tokens)``, with the counts summed over the manual axes. The
step's mean over shards of those values, and of their gradients, is then exactly the
global loss and its gradient: no gradient flows through a collective. Over the context
and expert axes (automatic in the step) the arrays are already global.

**Gradient accumulation**: each micro-batch's losses are over that micro-batch's global
tokens, and the step averages them over micro-batches, as it averages the loss (DeepSpeed
computes its ``l_aux`` per micro-batch too). It is not the loss over the accumulated
batch: ``fᵢ · Pᵢ`` is not linear in the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.sharding import jax_compat


def manual_batch_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced is manual over (the train step's data axes),
    in the mesh's order; empty outside any ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax_compat.manual_axes(mesh)
    return tuple(a for a in getattr(mesh, "axis_names", ()) if a in manual)


def global_counts(experts: jax.Array, n_experts: int, axes: tuple[str, ...] = ()) -> jax.Array:
    """Assignments per expert (``[n_experts]`` int32) over ``experts`` (any shape of expert
    indices), summed over the manual ``axes``."""
    counts = jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)
    return jax.lax.psum(counts, axes) if axes else counts


def fractions(experts: jax.Array, n_experts: int, axes: tuple[str, ...] = ()) -> jax.Array:
    """``fᵢ``: assignments routed to each expert per token, over every token of the manual
    ``axes`` too (float32, no gradient; ``Σᵢ fᵢ = k``)."""
    tokens = experts.reshape(-1, experts.shape[-1]).shape[0]
    total = tokens * (jax.lax.psum(1, axes) if axes else 1)
    return jax.lax.stop_gradient(global_counts(experts, n_experts, axes).astype(jnp.float32) / total)


def load_balancing_loss(probs: jax.Array, experts: jax.Array, *, axes: tuple[str, ...] | None = None) -> jax.Array:
    """``E · Σᵢ fᵢ · Pᵢ`` (module docstring) of ``probs`` ``[..., E]`` and the chosen
    ``experts`` ``[..., k]``; ``axes``: the manual axes the tokens are split over (default:
    those of the trace, :func:`manual_batch_axes`).

    Example:
      >>> import jax.numpy as jnp
      >>> probs = jnp.array([[0.5, 0.5], [0.5, 0.5]])
      >>> float(load_balancing_loss(probs, jnp.array([[0], [1]])))   # balanced: 1
      1.0
      >>> round(float(load_balancing_loss(jnp.array([[0.9, 0.1], [0.9, 0.1]]), jnp.array([[0], [0]]))), 4)
      1.8
    """
    axes = manual_batch_axes() if axes is None else tuple(axes)
    n = probs.shape[-1]
    f = fractions(experts, n, axes)
    p = jnp.mean(probs.reshape(-1, n).astype(jnp.float32), axis=0)
    return n * jnp.sum(f * p)


def z_loss(router_logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)²``.

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(z_loss(jnp.zeros((3, 4)))), 4)   # log(4)² = 1.9218
      1.9218
    """
    z = jax.nn.logsumexp(router_logits.astype(jnp.promote_types(router_logits.dtype, jnp.float32)), axis=-1)
    return jnp.mean(z * z)
