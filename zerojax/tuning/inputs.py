"""What is checked, and said, before anything compiles: the parameters' size and optimizer
bytes, the batch against the mesh, and the errors that name what would fit."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from zerojax.config import ZeroConfig
from zerojax.context.batch import check_lengths, sequence_dims
from zerojax.sharding.mesh import context_size, expert_size, make_mesh
from zerojax.state import is_init_fn
from zerojax.tuning.budget import fmt_bytes
from zerojax.tuning.candidates import Candidate, SearchSpace, valid_batch_sizes


def abstract_params(params: Any) -> Any:
    """The parameters as ``jax.ShapeDtypeStruct`` leaves (an init function is traced, not run)."""
    if is_init_fn(params):
        return jax.eval_shape(params)
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(x), x.dtype), params
    )


def param_counts(shapes: Any, tx: Any) -> tuple[int, float]:
    """(Ψ, optimizer-state bytes per parameter): the optimizer's own state for fp32
    masters, divided by Ψ."""
    import jax.numpy as jnp

    leaves = jax.tree.leaves(shapes)
    psi = sum(math.prod(x.shape) for x in leaves)
    if psi == 0:
        raise ValueError("params has no elements; pass the model's parameters (or their shapes).")
    masters = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, shapes
    )
    opt = jax.eval_shape(tx.init, masters)
    opt_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt))
    return psi, opt_bytes / psi


def batch_devices(mesh, config: ZeroConfig) -> int:
    sizes = dict(mesh.shape)
    return sizes[config.axes.data] * sizes.get(config.axes.replica, 1)


def rows_per_device(batch: Any, mesh, config: ZeroConfig, *, searched_pipeline: bool = False) -> tuple[int, int]:
    """(rows per device, global rows) of a batch, checked: leaves with a leading axis, all
    of one size, divisible over the batch devices (``searched_pipeline``: ``mesh`` is one
    the search built with a pipeline axis)."""
    check_mesh(mesh, config, searched_pipeline=searched_pipeline)
    return _rows(batch, mesh, config)


def check_mesh(mesh, config: ZeroConfig, *, searched_pipeline: bool = False) -> None:
    """Refuses a mesh without the data axis, or with axes whose memory the formulas do not
    model (tensor parallelism), or a pipeline axis the search did not build itself."""
    if config.axes.data not in mesh.axis_names:
        raise ValueError(
            f"the mesh has no axis {config.axes.data!r} (ZeroConfig.axes.data); its axes: {mesh.axis_names}."
        )
    other = {
        a: s
        for a, s in dict(mesh.shape).items()
        if a not in (config.axes.data, config.axes.replica, config.axes.context, config.axes.expert)
        and s > 1
        and not (searched_pipeline and a == config.axes.pipeline)
    }
    if other:
        hint = (
            f" (the pipeline degree is searched: give the mesh without it and SearchSpace(pipeline="
            f"({other[config.axes.pipeline]},)))"
            if config.axes.pipeline in other
            else ""
        )
        raise ValueError(
            f"autotune searches ZeRO over the data axis {config.axes.data!r} (and {config.axes.replica!r} for "
            f"hybrid sharding, {config.axes.context!r} for context parallelism, {config.axes.expert!r} "
            f"for expert parallelism); this mesh also splits {other}, whose memory its formulas do not "
            f"model. Tune on the mesh without those axes{hint}."
        )


def _rows(batch: Any, mesh, config: ZeroConfig) -> tuple[int, int]:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError("batch has no arrays; pass one global batch (arrays or jax.ShapeDtypeStruct).")
    sizes = {}
    for path, x in leaves:
        shape = np.shape(x) if not hasattr(x, "shape") else tuple(x.shape)
        if not shape:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has no leading axis; every leaf "
                "is split over the devices along its first dimension."
            )
        sizes[jax.tree_util.keystr(path) or "<root>"] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves have different leading sizes {sizes}; give one global batch.")
    global_batch = next(iter(sizes.values()))
    n = batch_devices(mesh, config)
    if global_batch % n:
        below, above = valid_batch_sizes(global_batch, n, (1,))
        sizes_text = " or ".join(str(b) for b in (below, above) if b)
        raise ValueError(
            f"the global batch of {global_batch} rows does not split over the {n} devices, whatever the "
            f"accumulation count; valid global batch sizes near it: {sizes_text} (multiples of {n})."
        )
    return global_batch // n, global_batch


def split_meshes(
    mesh, config: ZeroConfig, space: SearchSpace, batch: Any, shapes: Any = None
) -> dict[tuple[int, int, int], Any]:
    """``{(C, E, P): mesh}`` for each context, expert and pipeline degree of ``space`` (None:
    the mesh's own, and no pipeline): the given mesh for its own degrees,
    ``zj.make_mesh(devices, replicas=R, context=C, expert=E, pipeline=P)`` over its devices
    for the others. Refuses, before anything compiles, degrees that do not divide a replica
    group's devices or a batch leaf's sequence, and pipeline degrees the devices or the layer
    stack of ``shapes`` do not split into (naming the degrees that would); ``"auto"`` takes
    the pipeline degrees that do."""
    sizes = dict(mesh.shape)
    own_c, own_e = context_size(mesh, config.axes.context), expert_size(mesh, config.axes.expert)
    contexts = space.context if space.context is not None else (own_c,)
    experts = space.expert if space.expert is not None else (own_e,)
    replicas = sizes.get(config.axes.replica, 1)
    group = sizes[config.axes.data] * own_c * own_e
    bad = [c for c in contexts if group % c]
    if bad:
        fits = [c for c in range(1, group + 1) if group % c == 0]
        raise ValueError(
            f"SearchSpace(context={contexts}): {bad} do not divide the {group} devices that hold the same "
            f"weights (a replica group); use context degrees among {fits}."
        )
    bad = [(c, e) for c in contexts for e in experts if group % (c * e)]
    if bad:
        fits = [e for e in range(1, group + 1) if all(group % (c * e) == 0 for c in contexts)]
        raise ValueError(
            f"SearchSpace(expert={experts}): {sorted({e for _, e in bad})} do not divide the {group} "
            f"devices of a replica group{f' with context degrees {contexts}' if contexts != (1,) else ''}; "
            f"use expert degrees among {fits}."
        )
    if any(c > 1 for c in contexts) and not any(sequence_dims(config, batch)):
        raise ValueError(
            f"SearchSpace(context={contexts}) splits each sequence over the context axis, but no batch "
            f"leaf has a sequence dimension (leaves with 2+ dimensions, or ZeroConfig.context.dims)."
        )
    for c in contexts:
        try:
            check_lengths(config, batch, c)
        except ValueError as e:
            raise ValueError(f"SearchSpace(context={contexts}), context {c}: {e}") from None
    devices = list(mesh.devices.flat)

    def build(c: int, e: int, p: int):
        if (c, e, p) == (own_c, own_e, 1):
            return mesh
        return make_mesh(
            devices,
            config.axes.data,
            replicas=replicas,
            replica_axis=config.axes.replica,
            context=c,
            context_axis=config.axes.context,
            expert=e,
            expert_axis=config.axes.expert,
            pipeline=p,
            pipeline_axis=config.axes.pipeline,
        )

    out = {(c, e, 1): build(c, e, 1) for c in contexts for e in experts}
    for p in pipeline_degrees(space, len(devices), group, [c * e for c in contexts for e in experts]):
        for c in contexts:
            for e in experts:
                out[c, e, p] = build(c, e, p)
                problem = _stack_problem(shapes, out[c, e, p], config)
                if problem is None:
                    continue
                del out[c, e, p]
                if space.pipeline != "auto":
                    raise ValueError(f"SearchSpace(pipeline={space.pipeline}), pipeline {p}: {problem}")
    return out


def pipeline_degrees(space: SearchSpace, devices: int, per_group: int, splits: list[int]) -> tuple[int, ...]:
    """The pipeline degrees above 1 to search: ``space.pipeline``'s, or with ``"auto"`` every
    divisor of the devices that leaves each stage whole replica groups of whole context and
    expert splits; an explicit degree that does not is refused, naming those that would."""
    replicas = devices // per_group
    fits = [p for p in range(2, devices + 1) if per_group % p == 0 and all((per_group // p) % s == 0 for s in splits)]
    if space.pipeline is None:
        return ()
    if space.pipeline == "auto":
        return tuple(fits)
    bad = [p for p in space.pipeline if p > 1 and p not in fits]
    if bad:
        raise ValueError(
            f"SearchSpace(pipeline={space.pipeline}): {bad} do not split the {devices} devices into stages of "
            f"{'whole replica groups and ' if replicas > 1 else ''}whole context and expert splits; use "
            f"pipeline degrees among {[1, *fits]}."
        )
    return tuple(p for p in space.pipeline if p > 1)


def _stack_problem(shapes: Any, mesh, config: ZeroConfig) -> str | None:
    """Why the layer stack of ``shapes`` does not split over ``mesh``'s pipeline axis (no
    stack, an ambiguous one, a layer count the degree does not divide), or None."""
    if shapes is None:
        return None
    from zerojax.sharding.plan import make_plan

    try:
        make_plan(shapes, mesh, config)
    except ValueError as e:
        return str(e)
    return None


def accumulation_counts(space: SearchSpace, rows: int, global_batch: int, devices: int) -> tuple[int, ...]:
    """The accumulation counts of ``space`` that split ``rows`` per device; when none does,
    an error naming the nearest global batch sizes that one would."""
    counts = space.accumulation_counts(rows)
    if not counts:
        below, above = valid_batch_sizes(global_batch, devices, space.tried_counts())
        sizes = " or ".join(str(b) for b in (below, above) if b)
        raise ValueError(
            f"the global batch of {global_batch} rows gives each of the {devices} devices {rows} rows, "
            f"which no accumulation count tried ({_counts(space.tried_counts())}) divides. Use a global "
            f"batch of {sizes} rows, or other SearchSpace(accum=...) counts."
        )
    return counts


def _counts(counts) -> str:
    counts = tuple(counts)
    return ", ".join(map(str, counts)) if len(counts) <= 8 else f"{counts[0]}..{counts[-1]}"


def nothing_fits_formula(pruned: list[Candidate], budget: int, margin: float, shards: int, psi: int) -> str:
    """The error when every candidate's state alone is over the budget: the smallest, how
    far over, the levers left."""
    smallest = min(pruned, key=lambda c: c.formula_bytes)
    need = smallest.formula_bytes * (1 + margin)
    levers = []
    if smallest.offload != "params":
        levers.append(
            "offload (SearchSpace(offload=('params',)) at stage 3 keeps the fp32 masters and optimizer "
            "state in host memory)"
        )
    ratio = math.ceil(need / budget)
    levers.append(
        f"more devices (the state is sharded {shards} ways; about {ratio * shards} devices would hold "
        f"{fmt_bytes(need / ratio)} each)"
    )
    return (
        f"no configuration fits {fmt_bytes(budget)} per device: the smallest, {smallest.describe()}, holds "
        f"{fmt_bytes(smallest.formula_bytes)} of persistent state alone ({psi:,} parameters; "
        f"{fmt_bytes(need)} with the {margin:.0%} margin), {fmt_bytes(need - budget)} over the budget. Nothing "
        f"was compiled. Next: {'; or '.join(levers)}."
    )


def nothing_fits_compiled(plans: dict, space: SearchSpace, counts: dict, rows: dict, budget: int, margin: float) -> str:
    """The error when no compiled plan fits: the smallest, how far over, the levers left
    (``counts`` and ``rows``: the accumulation counts tried and rows per device, by context
    degree)."""
    smallest = min(plans.items(), key=lambda kv: kv[1].memory.device)
    cand, plan = smallest
    counts, rows = counts[cand.split], rows[cand.split]
    over = plan.memory.device - budget
    levers = []
    bigger_k = [k for k in range(cand.config.grad_accum_steps + 1, rows + 1) if rows % k == 0]
    if cand.pipeline > 1:  # the pipeline's micro-batches take accumulation's place (it stays 1)
        m = cand.config.pipeline.microbatches
        more = [k for k in range(m + 1, rows + 1) if rows % k == 0]
        if more:
            levers.append(
                f"more micro-batches through the pipeline (SearchSpace(microbatches=({more[0]}, ...)): each "
                f"device's {rows} rows in smaller parts; the bubble shrinks too)"
            )
    elif bigger_k and cand.config.grad_accum_steps >= max(counts):
        levers.append(
            f"a smaller micro-batch (grad_accum_steps={bigger_k[0]} or more: SearchSpace(accum=...); "
            f"each device has {rows} rows)"
        )
    elif bigger_k:
        levers.append("a smaller micro-batch (a larger grad_accum_steps)")
    if cand.config.remat.kind not in ("full",) and "full" not in space.remat:
        levers.append("remat='full' (SearchSpace(remat=('full',)))")
    if cand.offload != "params":
        levers.append("offload (SearchSpace(offload=('optimizer', 'params')) at stage 3)")
    if cand.context == max(space.context or (cand.context,)):
        levers.append(
            f"a larger context degree (SearchSpace(context=(..., {2 * cand.context})): each device "
            f"holds 1/C of every sequence's activations)"
        )
    levers.append("more devices (stage 3's state is 12Ψ/N)")
    return (
        f"no configuration fits {fmt_bytes(budget)} per device: the smallest compiled, {cand.describe()}, "
        f"needs {fmt_bytes(plan.memory.device)} ({fmt_bytes(plan.memory.compiled)} compiled + {margin:.0%} "
        f"margin), {fmt_bytes(over)} ({over / budget:.0%}) over the budget. Next: {'; or '.join(levers)}."
    )
