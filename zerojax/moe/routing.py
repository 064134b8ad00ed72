"""Routers: from router logits to each token's ``k`` experts and their weights.

One function, :func:`route`, covers the routers of the mixture-of-experts models people
fine-tune, as configuration:

- ``score="softmax"`` (Mixtral, Qwen2/3-MoE, DeepSeek-V2): probabilities over every expert,
  the ``k`` largest kept; ``normalize=True`` rescales the kept ones to sum to one
  (Mixtral always, which is the same as a softmax over the top-k logits; Qwen3-MoE's
  ``norm_topk_prob``);
- ``score="sigmoid"`` (DeepSeek-V3): an independent sigmoid per expert, the ``k`` largest of
  ``score + selection_bias`` kept (the bias chooses, it never weighs: its gradient is none,
  and it is an input, not a parameter, so no optimizer touches it; DeepSeek-V3's
  auxiliary-loss-free balancing updates it from the expert counts outside the step),
  weights normalized as asked and multiplied by ``scale`` (``routed_scaling_factor``).

Ties between experts go to the lower index, as ``jax.lax.top_k`` breaks them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

SCORES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """Where each token goes.

    Attributes:
      weights: ``[..., k]`` the weight of each chosen expert's output (float32, or the
        logits' dtype where wider).
      experts: ``[..., k]`` int32 expert indices, in decreasing score order.
      probs: ``[..., n_experts]`` the router's distribution over every expert (softmax, or the
        sigmoid scores normalized to sum to one): the ``P`` of the load-balancing loss.
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array


def check_router(
    router_logits: Any, top_k: Any, n_experts: int, score: str = "softmax", selection_bias: Any = None, scale: Any = 1.0
) -> None:
    """Refuses a router configuration before anything is traced: ``top_k`` outside
    ``1..n_experts``, an unknown ``score``, logits whose last dimension is not the experts,
    a ``selection_bias`` that is not ``[n_experts]`` or is given to a softmax router."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an int in 1..{n_experts} (the number of experts), got {top_k!r}.")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    shape = tuple(getattr(router_logits, "shape", ()))
    if len(shape) < 1 or shape[-1] != n_experts:
        raise ValueError(
            f"router_logits has shape {shape}; its last dimension must be the {n_experts} experts "
            f"(the experts' weights are stacked [{n_experts}, ...])."
        )
    if selection_bias is not None:
        if score != "sigmoid":
            raise ValueError(
                "selection_bias is DeepSeek-V3's balancing bias, used with score='sigmoid'; a softmax "
                "router has none. Remove it, or route with score='sigmoid'."
            )
        if tuple(getattr(selection_bias, "shape", ())) != (n_experts,):
            raise ValueError(
                f"selection_bias must have shape ({n_experts},) (one per expert), got "
                f"{tuple(getattr(selection_bias, 'shape', ()))}."
            )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number (routed_scaling_factor), got {scale!r}.")


def route(
    router_logits: jax.Array,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = False,
    selection_bias: jax.Array | None = None,
    scale: float = 1.0,
) -> Routing:
    """Each token's ``top_k`` experts and their weights (see the module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> r = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2)
      >>> r.experts.tolist(), [round(float(w), 3) for w in r.weights[0]]
      ([[1, 2]], [0.6, 0.3])
      >>> [round(float(w), 3) for w in route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, normalize=True).weights[0]]
      [0.667, 0.333]
    """
    n = router_logits.shape[-1]
    check_router(router_logits, top_k, n, score, selection_bias, scale)
    logits = router_logits.astype(jnp.promote_types(router_logits.dtype, jnp.float32))  # float32 or wider
    if score == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        scores = jax.nn.sigmoid(logits)
        choose = (
            scores
            if selection_bias is None
            else scores + jax.lax.stop_gradient(jnp.asarray(selection_bias, scores.dtype))
        )
        _, experts = jax.lax.top_k(choose, top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:
        weights = weights * scale
    return Routing(weights, experts.astype(jnp.int32), probs)
