"""The optimizer update of state kept in host memory (ZeRO-Offload).

With ``ZeroConfig(offload={"optimizer": True})`` the optimizer state, and the fp32 masters where
they are kept apart, live in host memory (memory kind ``"pinned_host"``), sharded as they
would be on the device. The update runs in one of two places
(``ZeroConfig.offload.update``):

* ``"host"``: inside ``jax.experimental.compute_on("device_host")``. Only the gradients go
  down to host memory and only the new parameters come back; the state never touches the
  accelerator. This is DeepSpeed's CPU-Adam arrangement.
* ``"device"``: the state streams to the device and back in groups of at most
  ``ZeroConfig.offload.group_size`` parameter elements (DeepSpeed's ``sub_group_size``),
  group after group: each group's results go back to host memory as soon as they are
  made, and group g's state waits for group g−2's update, so that one group updates while
  the next arrives.

``"auto"`` compiles the host update once per state layout and takes it where the backend
accepts it; with only the parameters offloaded (the optimizer state on the device) it
updates on the device, streaming the masters.

Each group traces ``tx.update`` whole (XLA then drops what the group does not need), so
tracing and compiling grow with the number of groups: with the default group size most
models are one group.

Groups have to be independent for the streamed update to equal the whole one. optax
transforms are traced once and each output traced back to the inputs it reads: leaves
whose update reads one another (a global-norm clip inside ``tx``, for instance) form one
group, however large. Scalars (step counts, injected hyperparameters) are read by every
group and sent with each. A group's update is the whole ``tx.update`` given that group's
arrays and zeros elsewhere; XLA drops everything the group's outputs do not read.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import check, walk
from zerojax.optim.update import keep_if, update
from zerojax.sharding.plan import HOST, OffloadSplit, ZeroPlan

PLACES = ("auto", "host", "device")


@dataclasses.dataclass(frozen=True)
class UpdateGroups:
    """How the streamed update splits: ``groups[g]`` is ``(inputs, outputs)``, indices into
    the update's flat inputs ``grads + opt_state + masters`` and flat outputs
    ``masters + opt_state``; ``shared`` are the inputs every group reads (scalars)."""

    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    shared: tuple[int, ...]


class _Reads(walk.Dataflow):
    """Which inputs a value reads, as a bit set: a pass on zerojax's program walk. A call
    (``jit``: jax 0.12's optax runs its tree maps through one) is followed inside; any other
    equation's outputs read all of its inputs (loops count whole)."""

    follows = frozenset({"call"})

    def literal(self, value: Any) -> int:
        return 0

    def constant(self, value: Any) -> int:
        return 0

    def primitive(self, eqn: Any, ins: list[int]) -> list[int]:
        d = 0
        for x in ins:
            d |= x
        return [d] * len(eqn.outvars)

    def join(self, a: int, b: int) -> int:
        return a | b


def _dependencies(jaxpr: Any, given: list[int] | None = None) -> list[int]:
    """For each output of ``jaxpr``, the set of inputs it reads, as a bit set (see :class:`_Reads`)."""
    given = [1 << i for i in range(len(jaxpr.invars))] if given is None else given
    return _Reads().run(jaxpr, [0] * len(jaxpr.constvars), given)


def _sds(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


@dataclasses.dataclass(frozen=True)
class _Components:
    """The update's independent parts: ``root[u]`` names the component of unit ``u`` (leaf
    ``i < n``: its gradient and master; ``n + j``: optimizer-state array ``j``), ``order`` the
    components by their first unit, ``size`` their parameter elements; ``out_units[k]`` is
    output k's unit (None: reads only shared inputs)."""

    n: int
    m: int
    shared: tuple[int, ...]
    root: tuple[int, ...]
    order: tuple[int, ...]
    size: dict
    out_units: tuple[int | None, ...]

    def unit_of_input(self, i: int) -> int:
        n, m = self.n, self.m
        return i if i < n else (i if i < n + m else i - n - m)


def _components(plan: ZeroPlan, tx: Any) -> _Components:
    """The update of ``tx`` split into the parts that do not read one another, read from the
    update's program; where zerojax reads none (:func:`zerojax._jaxpr.check.reading`), one part."""
    layouts, opt_layouts = plan.master_layouts, plan.opt_storage_layouts
    n, m = len(layouts), len(opt_layouts)
    shared = tuple(n + j for j, l in enumerate(opt_layouts) if l.kind == "replicated")
    shared_set = set(shared)
    parent = list(range(n + m))

    def find(u):
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    unit_of_input = list(range(n)) + [n + j for j in range(m)] + list(range(n))
    out_units: list[int | None] = []
    if not check.reading():
        units = [u for u in range(n + m) if u not in shared_set]
        for u in units[1:]:
            parent[find(u)] = find(units[0])
        out_units = [units[0] if units else None] * (n + m)  # one group writes everything
    else:
        grads = [jax.ShapeDtypeStruct(l.storage_shape, jnp.float32, sharding=plan.sharding(l)) for l in layouts]
        masters = [
            jax.ShapeDtypeStruct(l.storage_shape, plan.master_storage_dtype(l), sharding=plan.sharding(l))
            for l in layouts
        ]
        opt = [jax.ShapeDtypeStruct(l.storage_shape, l.dtype, sharding=plan.sharding(l)) for l in opt_layouts]
        jaxpr = jax.make_jaxpr(lambda g, o, w: update(plan, tx, g, o, w, step=jnp.int32(0)))(grads, opt, masters).jaxpr
        for k, d in enumerate(_dependencies(jaxpr)):
            own = None if k in shared_set else k  # output k belongs to unit k (opt leaf j: input and output n+j)
            units = {unit_of_input[i] for i in range(2 * n + m) if d >> i & 1 and i not in shared_set}
            if own is not None:
                units.add(own)
            units = sorted(units)
            for u in units[1:]:
                parent[find(u)] = find(units[0])
            out_units.append(units[0] if units else None)
    root = tuple(find(u) for u in range(n + m))
    size: dict[int, int] = {}  # parameter elements per component (DeepSpeed's sub_group_size counts those)
    for u in range(n + m):
        if u not in shared_set:
            size[root[u]] = size.get(root[u], 0) + (layouts[u].size if u < n else 0)
    order = tuple(sorted(size, key=lambda r: min(u for u in range(n + m) if root[u] == r)))
    return _Components(n, m, shared, root, order, size, tuple(out_units))


def _offloaded_roots(plan: ZeroPlan, comps: _Components) -> set[int]:
    """The components whose state lives in host memory: all of them, or with ``offload.ratio <
    1`` the last ones, in parameter order, until they hold at least that share of the elements
    (DeepSpeed's Twin-Flow offloads its last sub-groups)."""
    if not plan.partial:
        return set(comps.order)
    total = sum(comps.size.values())
    taken, roots = 0, set()
    for r in reversed(comps.order):
        if taken >= plan.config.offload.ratio * total:
            break
        roots.add(r)
        taken += comps.size[r]
    return roots


def split_for(plan: ZeroPlan, tx: Any) -> OffloadSplit | None:
    """Which leaves of ``plan`` (with the layouts of ``tx``'s state) live in host memory with
    ``Offload.ratio < 1`` (None without one): the update's independent groups of leaves (leaves
    whose update reads one another stay together, as for the streamed update), from the last
    parameter back, until at least ``ratio`` of the parameter elements are offloaded. Scalars no
    group writes (step counts) stay on the device."""
    if not plan.partial:
        return None
    comps = _components(plan, tx)
    roots = _offloaded_roots(plan, comps)
    total = sum(comps.size.values())
    n, m = comps.n, comps.m
    shared = set(comps.shared)
    # A leaf lives where its update runs: an array every group reads (a 0-d parameter's Adam
    # moment) where the group that writes it is; one no group writes (a step count) on the device.
    writer = [comps.out_units[u] if u in shared else u for u in range(n + m)]
    host = [w is not None and comps.root[w] in roots for w in writer]
    share = sum(comps.size[r] for r in roots) / total if total else 1.0
    ratio = plan.config.offload.ratio
    if share > ratio + 0.1:
        below = share - comps.size[min(roots, key=comps.order.index)] / total  # one group fewer: under the ratio
        other = f"the next share down is {below:.3g}" if below > 0 else "no smaller share exists"
        warnings.warn(
            f"Offload.ratio={ratio} keeps {share:.3g} of the optimizer state in host memory: the state moves in "
            f"whole groups of leaves (a leaf, or leaves whose update reads one another) and {other}. Give "
            f"ratio={share:.3g} to say that is what you mean.",
            stacklevel=3,
        )
    return OffloadSplit(masters=tuple(host[:n]), opt=tuple(host[n:]), share=share)


def with_split(plan: ZeroPlan, tx: Any) -> ZeroPlan:
    """``plan`` with its partial offload's split chosen (:func:`split_for`); unchanged without one."""
    if not plan.partial or plan.offload_split is not None:
        return plan
    return dataclasses.replace(plan, offload_split=split_for(plan, tx))


def update_groups(plan: ZeroPlan, tx: Any, group_size: int) -> UpdateGroups:
    """Splits the update of ``tx`` into independent groups of at most ``group_size``
    parameter elements each (a set of leaves that read one another stays together; with a
    partial offload, no group holds both host and device leaves). Which leaves read one
    another is read from the update's program; where zerojax reads none
    (:func:`zerojax._jaxpr.check.reading`), the update is one group."""
    comps = _components(plan, tx)
    n, m, shared_set = comps.n, comps.m, set(comps.shared)
    offloaded = _offloaded_roots(plan, comps)
    # Components in order of their first unit, packed into groups up to group_size elements.
    buckets: list[list[int]] = []
    filled = 0
    for root in comps.order:
        side_changes = bool(buckets) and buckets[-1] and (buckets[-1][-1] in offloaded) != (root in offloaded)
        if not buckets or side_changes or filled + comps.size[root] > group_size:
            buckets.append([])
            filled = 0
        buckets[-1].append(root)
        filled += comps.size[root]
    if not buckets:
        buckets = [[]]
    bucket_of = {root: b for b, roots in enumerate(buckets) for root in roots}
    groups = []
    for b in range(len(buckets)):
        ins = tuple(
            i for i in range(2 * n + m) if i not in shared_set and bucket_of[comps.root[comps.unit_of_input(i)]] == b
        )
        outs = tuple(k for k, u in enumerate(comps.out_units) if (0 if u is None else bucket_of[comps.root[u]]) == b)
        groups.append((ins, outs))
    return UpdateGroups(tuple(groups), comps.shared)


def apply_on_host(
    plan: ZeroPlan, tx: Any, grads: list, opt: list, masters: list, skip: jax.Array | None, step: Any = None
):
    """The update inside ``compute_on("device_host")``, on host-memory copies."""
    g, m, o = (
        _move(plan, grads, plan.master_layouts, HOST),
        _move(plan, masters, plan.master_layouts, HOST),
        _move(plan, opt, plan.opt_storage_layouts, HOST),
    )
    flag = None if skip is None else jax.device_put(skip, NamedSharding(plan.mesh, P(), memory_kind=HOST))

    def run(g, o, m, flag):
        new_m, new_o = update(plan, tx, g, o, m, HOST, step)
        return keep_if(flag, m, new_m), keep_if(flag, o, new_o)

    try:
        return on_host(run, g, o, m, flag)
    except ValueError as e:
        if "memory_space" not in str(e):
            raise
        raise ValueError(
            "ZeroConfig.offload.update='host', but this optimizer's update makes arrays in device memory and "
            "cannot run in host memory (a clip inside tx, LAMB's trust ratio and Adafactor's update clipping do). "
            "Use offload update='device' or 'auto' (which chooses the device for it), or clip with "
            f"ZeroConfig(grad_clip=...) outside tx. JAX said: {e}"
        ) from None


def on_host(fn, *args):
    """``fn(*args)`` compiled for the host (``compute_on("device_host")``), its outputs in
    host memory: jax 0.10's context manager, or jax 0.11+'s function transformation."""
    if _compute_on_is_context_manager():
        with compute_on("device_host"):
            return fn(*args)
    host = jax.tree.map(lambda _: jax.memory.Space.Host, jax.eval_shape(fn, *args))
    return compute_on(fn, compute_type="device_host", out_memory_spaces=host)(*args)


def apply_streamed(
    plan: ZeroPlan, tx: Any, grads: list, opt: list, masters: list, skip: jax.Array | None, step: Any = None
):
    """The update on the device, the offloaded state streamed in groups (module docstring)."""
    n, m = len(masters), len(opt)
    groups = update_groups(plan, tx, plan.config.offload.group_size)
    layouts = list(plan.master_layouts) + list(plan.opt_storage_layouts) + list(plan.master_layouts)
    inputs = list(grads) + list(opt) + list(masters)
    device = lambda i: plan.sharding(layouts[i])
    on_device = {i: jax.device_put(inputs[i], device(i)) for i in groups.shared}
    homes = [plan.master_memory_of(i) for i in range(n)] + [plan.opt_memory_of(j) for j in range(m)]
    out_layouts = list(plan.master_layouts) + list(plan.opt_storage_layouts)
    outputs: list[Any] = [None] * (n + m)
    done: list[list[jax.Array]] = []
    for ins, outs in groups.groups:
        moved = [jax.device_put(inputs[i], device(i)) for i in ins]
        if len(done) >= 2 and moved and done[-2]:  # at most two groups on the device at once
            moved, _ = jax.lax.optimization_barrier((moved, done[-2]))
        args = dict(on_device)
        args.update(zip(ins, moved))
        results = group_results(plan, tx, args, outs, skip, step)
        for k, r in zip(outs, results):  # back where it lives as soon as it is made
            outputs[k] = jax.device_put(r, plan.sharding(out_layouts[k], homes[k]))
        done.append(results)
    return outputs[:n], outputs[n:]


def group_results(
    plan: ZeroPlan, tx: Any, given: dict, outs: tuple, skip: jax.Array | None, step: Any, kind: str | None = None
) -> list:
    """One group's share of the update: the outputs ``outs`` (indices into ``masters +
    opt_state``) given the inputs ``given`` (index into ``grads + opt_state + masters`` ->
    array in memory ``kind``: the device's by default, host memory inside ``on_host``) and
    zeros for the rest; with ``skip`` set, the old values."""
    layouts, opt_layouts = plan.master_layouts, plan.opt_storage_layouts
    n, m = len(layouts), len(opt_layouts)
    kinds = (
        [(l, jnp.float32) for l in layouts]
        + [(l, l.dtype) for l in opt_layouts]
        + [(l, plan.master_storage_dtype(l)) for l in layouts]
    )
    full = [
        given[i]
        if i in given
        else jax.lax.with_sharding_constraint(jnp.zeros(l.storage_shape, dtype), plan.sharding(l, kind))
        for i, (l, dtype) in enumerate(kinds)
    ]
    new_m, new_o = update(plan, tx, full[:n], full[n : n + m], full[n + m :], kind, step=step)
    new = list(new_m) + list(new_o)
    old = full[n + m :] + full[n : n + m]
    return [new[k] if skip is None else jnp.where(skip, old[k], new[k]) for k in outs]


def _move(plan: ZeroPlan, xs: list, layouts, kind: str | None) -> list:
    return [jax.device_put(x, plan.sharding(l, kind)) for x, l in zip(xs, layouts)]


def apply_offloaded(
    plan: ZeroPlan, tx: Any, grads: list, opt: list, masters: list, skip: jax.Array | None, place: str, step: Any = None
) -> tuple[list, list]:
    """New masters and optimizer-state leaves of offloaded state, each back where it lives."""
    if place == "host":
        new_m, new_o = apply_on_host(plan, tx, grads, opt, masters, skip, step)
        new_m = [jax.device_put(x, s) for x, s in zip(new_m, plan.master_shardings())]
        new_o = [jax.device_put(x, s) for x, s in zip(new_o, plan.opt_shardings())]
        if plan.partial:  # the device part updates on the device (its host results are unused: dropped)
            return _device_part(plan, tx, grads, opt, masters, skip, step, new_m, new_o)
        return new_m, new_o
    return apply_streamed(plan, tx, grads, opt, masters, skip, step)


def _device_part(plan: ZeroPlan, tx: Any, grads, opt, masters, skip, step, new_m: list, new_o: list):
    """``new_m``/``new_o`` with the results of the leaves a partial offload keeps on the device
    replaced by their update on the device."""
    n, m = len(masters), len(opt)
    split = plan.offload_split
    on_host = list(split.masters) + list(split.opt)  # each unit's side (a master on the device may read host state)
    outs = tuple(k for k in range(n + m) if not on_host[k])
    ins = [i for i in range(2 * n + m) if not on_host[i if i < n + m else i - n - m]]
    inputs = list(grads) + list(opt) + list(masters)
    layouts = list(plan.master_layouts) + list(plan.opt_storage_layouts) + list(plan.master_layouts)
    given = {i: jax.device_put(inputs[i], plan.sharding(layouts[i])) for i in ins}
    results = group_results(plan, tx, given, outs, skip, step)
    new = list(new_m) + list(new_o)
    for k, r in zip(outs, results):
        new[k] = r
    return new[:n], new[n:]


def _compute_on_is_context_manager() -> bool:
    """Whether this jax has ``compute_on(compute_type)`` as a context manager (jax 0.10);
    jax 0.11 made it a function transformation with ``out_memory_spaces``."""
    try:
        params = inspect.signature(compute_on).parameters
    except (TypeError, ValueError):  # no signature to read: assume the context manager
        return True
    return "compute_type" not in params or params["compute_type"].kind != inspect.Parameter.KEYWORD_ONLY


def choose_place(plan: ZeroPlan, tx: Any, opt: list) -> str:
    """Where the update of offloaded state runs: ``"device"`` when nothing is offloaded,
    else ``ZeroConfig.offload.update``, with ``"auto"`` resolved by compiling the host
    update for these shapes (``"host"`` if the backend accepts it; ``"device"`` when only
    the parameters are offloaded)."""
    cfg = plan.config
    if plan.opt_memory is None and plan.master_memory is None:
        return "device"
    if cfg.offload.update == "auto" and plan.opt_memory is None:
        return "device"  # offload_params alone: the optimizer state is on the device already
    if cfg.offload.update != "auto":
        return cfg.offload.update
    grads = [jax.ShapeDtypeStruct(l.storage_shape, jnp.float32, sharding=plan.sharding(l)) for l in plan.master_layouts]
    masters = [
        jax.ShapeDtypeStruct(
            l.storage_shape, plan.master_storage_dtype(l), sharding=plan.sharding(l, plan.master_memory)
        )
        for l in plan.master_layouts
    ]
    probe = lambda g, o, w, skip: apply_on_host(plan, tx, g, o, w, skip, jnp.int32(0))
    # Only the two refusals that mean "this update cannot run in host memory here" choose the
    # device: JAX's, while tracing, of an operation mixing host and device memory (the
    # optimizer makes a device array, as optax.clip_by_global_norm's norm does), and the
    # backend compiler's. Any other error is a bug to report, and propagates.
    try:
        lowered = jax.jit(probe).lower(
            grads, [_sds(x) for x in opt], masters, jax.ShapeDtypeStruct((), jnp.bool_, sharding=plan.replicated)
        )
    except ValueError as e:
        if "memory_space" not in str(e):
            raise
        return "device"
    try:
        lowered.compile()
    except jax.errors.JaxRuntimeError:
        return "device"
    return "host"
