"""Routed experts: router logits in, the experts' combined output out, on one device or
split over an expert axis.

:func:`routed_experts` is the one call a mixture-of-experts layer makes for its routed
experts (in the spirit of ``zj.nn.dot_product_attention``). Each token goes to its ``k``
experts (:mod:`zerojax.moe.routing`); the assignments are laid out in a buffer per
destination device, each device's experts run as a grouped matmul (``jax.lax.ragged_dot``
over the rows sorted by expert, or ``method="dense"``: every local expert on every row,
masked), and the outputs return to their tokens, weighted and summed over the ``k``.

Off an expert mesh that is the whole computation on one device. On a mesh with an
``"expert"`` axis of ``E`` devices (``zj.make_mesh(expert=E)``), the experts' stacked
weights ``[n_experts, ...]`` split over it (``n_experts / E`` per device), it runs as a
``shard_map`` manual over that axis: each device routes its own tokens (the batch is split
over the axis), sends each assignment's row to the device holding its expert by one
all-to-all, runs its experts, and a second all-to-all brings the outputs back. Backward
is the same two all-to-alls transposed. Inside the train step (manual over the data axes,
automatic over "expert") it nests as the context kernels do; inside a user's own
``shard_map`` already manual over the axis it runs on the local tokens and experts.

**Dropless by default**: a device's buffer for each destination holds all of its
``tokens x k`` assignments (the worst case: every one to the same device), so no token is
ever dropped; the dispatch buffers cost ``E x tokens x k x d`` per device on an expert mesh
of ``E``. **Capacity** (``capacity_factor=c``): each expert takes at most
``ceil(c · tokens x k / n_experts)`` assignments of a *capacity group* (a contiguous block of
the tokens as flattened; by default one group per device the tokens are split over, which
is where a capacity is applied in GShard and DeepSpeed), first the tokens' first choices,
then their second, ..., each in token order; the rest are dropped (their weight's output
is zero) and counted. The buffers then hold ``n_experts x capacity`` rows per device. On one
device, ``capacity_groups=G`` gives the result of ``G`` devices.

Buffer rows that hold no assignment (padding) are zero, are excluded from the grouped
matmul's groups, and are never read back: they cannot reach an output or a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import settings
from zerojax.context import sequence_order
from zerojax.moe import losses, routing
from zerojax.sharding import in_step
from zerojax.sharding.mesh import expert_size

METHODS = ("ragged", "dense")


class MoEStats(NamedTuple):
    """What a routed-experts call reports (each a global value over the step's micro-batch).

    Attributes:
      load_balancing_loss: ``E · Σᵢ fᵢ · Pᵢ`` (:mod:`zerojax.moe.losses`); add it to the loss
        with the model's coefficient.
      z_loss: the router z-loss.
      counts: ``[n_experts]`` int32, assignments routed to each expert (before drops).
      dropped: the fraction of assignments dropped by the capacity (0 when dropless).
      fractions: ``[n_experts]`` the ``fᵢ`` of the load-balancing loss (global, no gradient).
      mean_probs: ``[n_experts]`` the ``Pᵢ`` over this data shard's tokens (see
        :mod:`zerojax.moe.losses`): a model that balances over several layers at once (Hugging
        Face's loss concatenates the layers' tokens) combines ``E · Σ mean(f) · mean(P)``.
    """

    load_balancing_loss: jax.Array
    z_loss: jax.Array
    counts: jax.Array
    dropped: jax.Array
    fractions: jax.Array
    mean_probs: jax.Array


def _expert_axis(axis: str | None, mesh: Any) -> str:
    """The expert axis: ``axis`` as given, else the step's configured one (a renamed axis
    read as "expert" would find size 1 and run every expert on every device, silently);
    an ``axis`` other than the step's on a mesh that splits the step's is refused."""
    step = in_step.current()
    configured = step[0].config.axes.expert if step is not None else None
    if axis is None:
        return configured or "expert"
    if configured is not None and axis != configured and expert_size(mesh, configured) > 1:
        raise ValueError(
            f"routed_experts(axis={axis!r}), but the step's expert axis is {configured!r} "
            f"(ZeroConfig(axes={{'expert': {configured!r}}})), split over {expert_size(mesh, configured)} devices. "
            f"Leave axis= out (the step's is used), or pass axis={configured!r}."
        )
    return axis


def routed_experts(
    x: jax.Array,
    router_logits: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    top_k: int,
    activation: Callable = jax.nn.silu,
    score: str = "softmax",
    normalize: bool = False,
    selection_bias: jax.Array | None = None,
    scale: float = 1.0,
    capacity_factor: float | None = None,
    capacity_groups: int | None = None,
    method: str = "ragged",
    token_mask: jax.Array | None = None,
    mesh: Any = None,
    axis: str | None = None,
) -> tuple[jax.Array, MoEStats]:
    """The routed experts' combined output for tokens ``x`` (see the module docstring).

    Args:
      x: ``[..., d]`` tokens (on an expert mesh, the batch split over ``axis`` on dimension 0).
      router_logits: ``[..., n_experts]`` the router's logits for those tokens.
      up: ``[n_experts, d, f]``; ``down``: ``[n_experts, f, d]``; ``gate``: ``[n_experts, d, f]``
        or None. Each expert computes ``activation(t @ gate) * (t @ up) @ down`` (SwiGLU, as
        Mixtral and Qwen-MoE), or ``activation(t @ up) @ down`` without a gate.
      top_k, score, normalize, selection_bias, scale: the router (:func:`zerojax.moe.routing.route`).
      capacity_factor: None (dropless), or the capacity per expert as a multiple of an even
        share of a capacity group's assignments (> 0).
      capacity_groups: capacity groups among the tokens given (default: the devices of
        ``axis`` they are split over, or 1).
      method: ``"ragged"`` (grouped matmul) or ``"dense"`` (every local expert on every row).
      token_mask: ``bool[...]`` (x's leading dimensions), False for padding: such a token is
        not dispatched (its output is zero, it takes no capacity) and is left out of the
        auxiliary losses and the counts, as Hugging Face's ``load_balancing_loss_func`` leaves
        out what ``attention_mask`` masks. None: every token.
      mesh: the mesh (default: the one in context); ``axis``: its expert axis (default:
        inside a train or eval step, the config's ``axes.expert``; elsewhere ``"expert"``).

    Returns:
      ``(y, stats)``: ``y`` shaped like ``x``, and :class:`MoEStats`.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> from zerojax.moe import routed_experts
      >>> k = jax.random.split(jax.random.key(0), 5)
      >>> x = jax.random.normal(k[0], (2, 6, 8))
      >>> logits = jax.random.normal(k[1], (2, 6, 4))
      >>> up, gate = jax.random.normal(k[2], (4, 8, 16)), jax.random.normal(k[3], (4, 8, 16))
      >>> down = jax.random.normal(k[4], (4, 16, 8))
      >>> run = jax.jit(functools.partial(routed_experts, top_k=2, normalize=True))
      >>> y, stats = run(x, logits, up, down, gate)
      >>> y.shape, stats.counts.sum().item(), stats.dropped.item()
      ((2, 6, 8), 24, 0.0)
    """
    n_experts = _check(x, router_logits, up, down, gate, top_k, score, selection_bias, scale, capacity_factor, method)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    given_mesh = mesh if not isinstance(mesh, jax.sharding.AbstractMesh) else None
    axis = _expert_axis(axis, mesh)
    ep = expert_size(mesh, axis)
    inside = ep > 1 and axis in settings.manual_axes(jax.sharding.get_abstract_mesh())
    if n_experts % ep:
        ok = [e for e in range(1, n_experts + 1) if n_experts % e == 0 and e <= max(ep, n_experts)]
        raise ValueError(
            f"{n_experts} experts do not split over the {ep} devices of the expert axis {axis!r}; use "
            f"an expert degree dividing {n_experts} (one of {ok}) or a number of experts that {ep} divides."
        )
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    n = xf.shape[0]
    lf = router_logits.reshape(-1, n_experts)
    if lf.shape[0] != n:
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)} do not match x {tuple(x.shape)}: one row of "
            f"{n_experts} logits per token."
        )
    split = ep if ep > 1 and not inside else 1
    groups = split if capacity_groups is None else capacity_groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or groups % split or n % groups:
        raise ValueError(
            f"capacity_groups={capacity_groups!r}: the {n} tokens (x {tuple(x.shape)} flattened) must "
            f"split into whole groups, a multiple of the {split} device(s) of {axis!r} they are split "
            f"over. Use a group count dividing {n} that {split} divides."
        )
    mask = None
    if token_mask is not None:
        if tuple(getattr(token_mask, "shape", ())) != tuple(x.shape[:-1]):
            raise ValueError(
                f"token_mask has shape {tuple(getattr(token_mask, 'shape', ()))}; it must be x's leading "
                f"dimensions {tuple(x.shape[:-1])} (True: a token, False: padding)."
            )
        mask = jnp.asarray(token_mask).astype(bool).reshape(-1)
    r = routing.route(lf, top_k, score=score, normalize=normalize, selection_bias=selection_bias, scale=scale)
    axes = losses.manual_batch_axes()
    counts = losses.global_counts(r.experts, n_experts, axes, mask)
    fractions = losses.fractions(r.experts, n_experts, axes, mask)
    mean_probs = losses.mean_probs(r.probs, axes, mask)
    stats_lb = n_experts * jnp.sum(fractions * mean_probs)
    stats_z = losses.z_loss(lf, mask, axes)
    body = lambda xf, e, w, m, u, dn, g: _dispatch(
        xf,
        e,
        w,
        m,
        u,
        dn,
        g,
        ep=ep if ep > 1 else 1,
        axis=axis,
        groups=groups // split,
        capacity_factor=capacity_factor,
        activation=activation,
        method=method,
        n_experts=n_experts,
    )
    args = (xf, r.experts, r.weights, jnp.ones((n,), bool) if mask is None else mask, up, down, gate)
    if split > 1:
        specs = (P(axis), P(axis), P(axis), P(axis), P(axis), P(axis), None if gate is None else P(axis))
        kw = {} if given_mesh is None else {"mesh": given_mesh}
        run = jax.shard_map(
            body, in_specs=specs, out_specs=(P(axis), P(axis)), axis_names={axis}, check_vma=False, **kw
        )
        if not any(settings.is_tracer(a) for a in args if a is not None):
            run = jax.jit(run)  # eager: jax 0.10 refuses an eager shard_map manual over some axes
    else:
        run = body
    # Dropless, each token's output is its own whatever the tokens' order (the balanced
    # context layout permutes them); with a capacity, an expert keeps its first assignments.
    how = "routed_experts, dropless" if capacity_factor is None else "routed_experts with a capacity_factor"
    y, kept = sequence_order.rows(run, order_free=capacity_factor is None, what=how)(*args)
    kept = jnp.sum(kept)
    total = n * top_k if mask is None else jnp.sum(mask.astype(jnp.int32)) * top_k
    if axes:
        kept, total = jax.lax.psum(kept, axes), total * jax.lax.psum(1, axes)
    if inside:
        kept, total = jax.lax.psum(kept, axis), total * ep
    dropped = 1.0 - kept.astype(jnp.float32) / jnp.maximum(total, 1)
    return y.reshape(x.shape), MoEStats(stats_lb, stats_z, counts, dropped, fractions, mean_probs)


def _check(x, router_logits, up, down, gate, top_k, score, selection_bias, scale, capacity_factor, method) -> int:
    for name, a in (("x", x), ("router_logits", router_logits), ("up", up), ("down", down)):
        if not hasattr(a, "shape"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}.")
    if len(up.shape) != 3:
        raise ValueError(f"up must be the experts' stacked weights [n_experts, d, f], got shape {tuple(up.shape)}.")
    n_experts, d, f = up.shape
    if tuple(x.shape[-1:]) != (d,):
        raise ValueError(f"x has shape {tuple(x.shape)} but up {tuple(up.shape)} takes d = {d} features.")
    if tuple(down.shape) != (n_experts, f, d):
        raise ValueError(
            f"down must have shape {(n_experts, f, d)} (the experts of up {tuple(up.shape)}), got {tuple(down.shape)}."
        )
    if gate is not None and tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"gate must have up's shape {tuple(up.shape)}, got {tuple(gate.shape)}.")
    routing.check_router(router_logits, top_k, n_experts, score, selection_bias, scale)
    if tuple(router_logits.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)} must be x's leading dimensions "
            f"{tuple(x.shape[:-1])} and the {n_experts} experts."
        )
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0
    ):
        raise ValueError(f"capacity_factor must be None (dropless) or a number > 0, got {capacity_factor!r}.")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    return n_experts


def capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Assignments an expert takes from a capacity group of ``tokens`` tokens.

    Example:
      >>> capacity(64, 2, 8, 1.25)
      20
    """
    return max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))


def _dispatch(
    xf,
    experts,
    weights,
    mask,
    up,
    down,
    gate,
    *,
    ep: int,
    axis: str,
    groups: int,
    capacity_factor,
    activation,
    method: str,
    n_experts: int,
):
    """One device's tokens ``xf`` [n, d] (its ``groups`` capacity groups; ``mask`` [n]: False
    for padding, never dispatched) through the experts (``up``/``down``/``gate`` this device's
    ``n_experts / ep``); ``ep > 1``: manual over ``axis``. Returns the combined output
    ``[n, d]`` and the kept assignments ``[1]``."""
    n, d = xf.shape
    k = experts.shape[-1]
    local = n_experts // ep
    # Assignments in priority order: group-major, then slot (first choices first), then token.
    ng = n // groups
    e = experts.reshape(groups, ng, k).transpose(0, 2, 1).reshape(-1)  # [a]
    token = jnp.arange(n).reshape(groups, ng)[:, None, :].repeat(k, 1).reshape(-1)
    real = mask[token]  # padding tokens take no slot and no capacity
    dest, lexp = e // local, e % local
    if capacity_factor is None:
        slots = n * k  # every assignment of this device may go to one destination
        onehot = (dest[:, None] == jnp.arange(ep)[None, :]).astype(jnp.int32)
        pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]
        keep = real
    else:
        cap = capacity(ng, k, n_experts, capacity_factor)
        slots = local * groups * cap
        onehot = (
            (e.reshape(groups, ng * k)[..., None] == jnp.arange(n_experts)) & real.reshape(groups, ng * k, 1)
        ).astype(jnp.int32)
        rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=1) - 1, e.reshape(groups, ng * k, 1), axis=2).reshape(-1)
        keep = (rank < cap) & real
        group = jnp.arange(groups).repeat(ng * k)
        pos = jnp.where(keep, (lexp * groups + group) * cap + rank, slots)
    pos = jnp.where(keep, pos, slots)  # out of range: dropped on the scatter, never read
    send = jnp.zeros((ep, slots, d), xf.dtype).at[dest, pos].set(xf[token], mode="drop")
    ids = jnp.full((ep, slots), local, jnp.int32).at[dest, pos].set(lexp, mode="drop")
    if ep > 1:
        send = jax.lax.all_to_all(send, axis, 0, 0)
        ids = jax.lax.all_to_all(ids, axis, 0, 0)
    out = _experts(send.reshape(ep * slots, d), ids.reshape(-1), up, down, gate, local, activation, method)
    out = out.reshape(ep, slots, d)
    if ep > 1:
        out = jax.lax.all_to_all(out, axis, 0, 0)
    y = out.at[dest, pos].get(mode="fill", fill_value=0)  # [a, d]
    y = jnp.where(keep[:, None], y, 0)
    w = weights.reshape(groups, ng, k).transpose(0, 2, 1).reshape(-1)
    acc = jnp.promote_types(xf.dtype, jnp.float32)  # the sum over the k in float32, or wider
    combined = jnp.zeros((n, d), acc).at[token].add(y.astype(acc) * w[:, None].astype(acc))
    return combined.astype(xf.dtype), jnp.sum(keep).reshape(1)


def _experts(rows, ids, up, down, gate, local: int, activation, method: str):
    """Each row through its local expert ``ids`` (``local``: padding, output zero)."""
    if method == "dense":
        mask = (ids[:, None] == jnp.arange(local)[None, :]).astype(rows.dtype)  # [r, e]
        h = jnp.einsum("rd,edf->erf", rows, up)
        h = activation(jnp.einsum("rd,edf->erf", rows, gate)) * h if gate is not None else activation(h)
        return jnp.einsum("erd,re->rd", jnp.einsum("erf,efd->erd", h, down), mask)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.zeros((local,), jnp.int32).at[ids].add(1, mode="drop")  # padding (id == local) dropped
    xs = rows[order]
    h = jax.lax.ragged_dot(xs, up, sizes)
    h = activation(jax.lax.ragged_dot(xs, gate, sizes)) * h if gate is not None else activation(h)
    ys = jax.lax.ragged_dot(h, down, sizes)
    ys = jnp.where((ids[order] < local)[:, None], ys, 0)
    return jnp.zeros_like(ys).at[order].set(ys)
