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
tokens (micro-batch ``j`` is the global rows ``g % k == j``, on every mesh), and the step averages them over micro-batches, as it averages the loss (DeepSpeed
computes its ``l_aux`` per micro-batch too). It is not the loss over the accumulated
batch: ``fᵢ · Pᵢ`` is not linear in the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax._jaxpr import settings


def manual_batch_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced is manual over (the train step's data axes),
    in the mesh's order; empty outside any ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = settings.manual_axes(mesh)
    return tuple(a for a in getattr(mesh, "axis_names", ()) if a in manual)


def global_counts(
    experts: jax.Array, n_experts: int, axes: tuple[str, ...] = (), mask: jax.Array | None = None
) -> jax.Array:
    """Assignments per expert (``[n_experts]`` int32) over ``experts`` (``[..., k]`` expert
    indices), summed over the manual ``axes``; ``mask`` (``[...]``, False: a padding token)
    leaves tokens out."""
    w = (
        jnp.ones(experts.shape, jnp.int32)
        if mask is None
        else jnp.broadcast_to(mask.reshape(mask.shape + (1,)).astype(jnp.int32), experts.shape)
    )
    counts = jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(w.reshape(-1))
    return jax.lax.psum(counts, axes) if axes else counts


def _tokens(experts_or_probs: jax.Array, mask: jax.Array | None, axes: tuple[str, ...]) -> jax.Array:
    """The tokens counted (the mask's True ones, or all), over the manual ``axes`` too."""
    n = (
        jnp.asarray(experts_or_probs.reshape(-1, experts_or_probs.shape[-1]).shape[0], jnp.float32)
        if mask is None
        else jnp.sum(mask.astype(jnp.float32))
    )
    return jax.lax.stop_gradient(jax.lax.psum(n, axes) if axes else n)


def fractions(
    experts: jax.Array, n_experts: int, axes: tuple[str, ...] = (), mask: jax.Array | None = None
) -> jax.Array:
    """``fᵢ``: assignments routed to each expert per token, over every token of the manual
    ``axes`` too (float32, no gradient; ``Σᵢ fᵢ = k``); ``mask`` leaves padding tokens out."""
    total = jnp.maximum(_tokens(experts, mask, axes), 1.0)
    return jax.lax.stop_gradient(global_counts(experts, n_experts, axes, mask).astype(jnp.float32) / total)


def mean_probs(probs: jax.Array, axes: tuple[str, ...] = (), mask: jax.Array | None = None) -> jax.Array:
    """``Pᵢ`` as this data shard contributes it: the mean of ``probs`` ``[..., E]`` over its
    tokens, scaled so that the mean over the shards of the manual ``axes`` is the mean over
    every token (equal shares without a mask; the mask's tokens with one)."""
    p = probs.reshape(-1, probs.shape[-1]).astype(jnp.promote_types(probs.dtype, jnp.float32))
    if mask is None:
        return jnp.mean(p, axis=0)
    m = mask.reshape(-1).astype(p.dtype)
    shards = jax.lax.psum(1, axes) if axes else 1
    return jnp.sum(m[:, None] * p, axis=0) * shards / jnp.maximum(_tokens(probs, mask, axes), 1.0)


def load_balancing_loss(
    probs: jax.Array, experts: jax.Array, *, axes: tuple[str, ...] | None = None, mask: jax.Array | None = None
) -> jax.Array:
    """``E · Σᵢ fᵢ · Pᵢ`` (module docstring) of ``probs`` ``[..., E]`` and the chosen
    ``experts`` ``[..., k]``; ``axes``: the manual axes the tokens are split over (default:
    those of the trace, :func:`manual_batch_axes`); ``mask`` (``[...]``, False: padding) leaves
    tokens out of both, as Hugging Face's ``load_balancing_loss_func(..., attention_mask)``.

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
    return n * jnp.sum(fractions(experts, n, axes, mask) * mean_probs(probs, axes, mask))


def z_loss(router_logits: jax.Array, mask: jax.Array | None = None, axes: tuple[str, ...] = ()) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)²`` (with ``mask``,
    over its True tokens, this shard's share of the mean over the manual ``axes``).

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(z_loss(jnp.zeros((3, 4)))), 4)   # log(4)² = 1.9218
      1.9218
    """
    z = jax.nn.logsumexp(router_logits.astype(jnp.promote_types(router_logits.dtype, jnp.float32)), axis=-1)
    if mask is None:
        return jnp.mean(z * z)
    m = mask.reshape(z.shape).astype(z.dtype)
    shards = jax.lax.psum(1, axes) if axes else 1
    return jnp.sum(m * z * z) * shards / jnp.maximum(_tokens(router_logits, mask, axes), 1.0)
