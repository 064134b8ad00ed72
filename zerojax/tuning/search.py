"""``zj.autotune``: which ZeRO configuration fits the devices, and which is fastest, without
running a step.

Everything the search decides, it decides before compiling where it can: the budget and the
batch are checked, every candidate (:mod:`zerojax.tuning.candidates`) whose persistent
state alone exceeds the budget is pruned, and the device's rates are looked up or measured
(:mod:`zerojax.tuning.devices`). Then, family by family, the candidate pulling the fewest
levers is compiled first (when it fits it dominates the whole family); after it, the one
whose result decides the most others by the dominance rules, either way, like a bisection,
until every candidate is compiled or decided.
Each compile is ahead of time, on the parameters' and the batch's shapes: memory from
``memory_analysis()`` (as :func:`zerojax.report.step_memory`), time from the cost model
(:mod:`zerojax.tuning.cost`). Candidates that lower to the same program (a remat policy on
a model with no layer loop) share one compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zerojax.config import ZeroConfig
from zerojax.report.memory import StepMemory, abstract_batch, compiled_bytes
from zerojax.sharding.mesh import context_size, expert_size
from zerojax.state import abstract_state
from zerojax.tuning.budget import check_margin, fmt_bytes, parse_host_memory, parse_memory, usable
from zerojax.tuning.candidates import Candidate, SearchSpace, enumerate_candidates, more_levers, needs_more_memory
from zerojax.tuning.cost import StepCost, step_cost
from zerojax.tuning.devices import DeviceSpec, device_spec, measure_matmuls
from zerojax.tuning.disk import DiskRates, measure_disk
from zerojax.tuning.inputs import (
    abstract_params,
    accumulation_counts,
    batch_devices,
    check_mesh,
    nothing_fits_compiled,
    nothing_fits_formula,
    param_counts,
    rows_per_device,
    split_meshes,
)
from zerojax.tuning.result import AutotuneResult, Plan, PlanMemory, Skipped

Progress = Callable[[int, int, str], None]


def autotune(
    loss_fn: Callable,
    params: Any,
    tx: Any,
    batch: Any,
    *,
    mesh,
    memory: int | str,
    config: ZeroConfig | None = None,
    device: DeviceSpec | str | None = None,
    space: SearchSpace | None = None,
    margin: float = 0.10,
    has_aux: bool = False,
    exhaustive: bool = False,
    verbose: bool = False,
    progress: Progress | None = None,
    host_memory: int | str | None = None,
    nvme: Any = None,
    disk: DiskRates | None = None,
) -> AutotuneResult:
    """The ZeRO configurations that fit ``memory`` bytes per device, fastest predicted
    first, found by compiling candidate steps ahead of time: no step runs.

    Args:
      loss_fn, tx: as for :func:`zerojax.make_train_step` (``has_aux`` too).
      params: the parameters, their shapes (``jax.ShapeDtypeStruct`` leaves, e.g. from
        ``nnx.eval_shape``) or a function that builds them: nothing is allocated.
      batch: one global batch (arrays or shapes); each device gets
        ``global / (devices × grad_accum_steps)`` rows per micro-batch, and accumulation
        counts that divide its rows are tried.
      mesh: the mesh the step runs on (e.g. ``zj.make_mesh()``).
      memory: usable bytes per device: an int or ``"80GiB"``, ``"16GB"``.
      config: the base ``ZeroConfig``: its compute dtype and every field the search does
        not tune are kept.
      device: the devices' rates: a :class:`~zerojax.tuning.DeviceSpec`, a name
        (``"H100"``, ``"tpu-v5e"``), or None: the mesh's device kind, measured once per
        process on the CPU backend and on devices without datasheet figures.
      space: the :class:`~zerojax.tuning.SearchSpace` (stages, accumulation counts, remat
        policies, offload, prefetch, gather dtypes).
      margin: fraction added to the compiled bytes for what the program does not count
        (allocator fragmentation, communication buffers); default 0.10.
      exhaustive: compile every candidate the formula does not prune (no dominance rules).
      verbose: print a line per candidate to stderr.
      progress: called as ``progress(done, total, message)`` after each candidate.
      host_memory: usable host memory per device (the host's RAM for offloaded state over
        its devices), or None: unbounded. A plan fits when its host bytes fit too.
      nvme: a ``zj.config.NVMe`` (or a dict of its fields, or its path): search the NVMe
        tier too (``SearchSpace(offload=...)``'s "nvme", added to the default space), for
        when host memory is short. Its plan's device memory is the streamed device update's
        (``Offload(update="device")``: the same programs around the tier's reads and
        writes), its host memory that less the optimizer state plus the tier's buffers, and
        its time that plus ``disk.seconds(optimizer state per process)``.
      disk: the disk's :class:`~zerojax.tuning.DiskRates` under ``nvme.path``, or None:
        measured once (:func:`~zerojax.tuning.measure_disk`).

    Returns an :class:`~zerojax.tuning.AutotuneResult`: a sequence of
    :class:`~zerojax.tuning.Plan` (``.config``, ``.memory``, ``.time``), with ``.best``,
    ``.compiled``, ``.pruned``, ``.skipped``, ``.search_seconds`` and ``.table()``.

    Raises ``ValueError`` before compiling anything for a budget outside 1 MiB .. 1 TiB,
    a batch no accumulation count splits (naming the sizes that would), or when every
    candidate's state alone exceeds the budget; after the search when no compiled plan fits
    (naming the smallest, by how much it is over, and the next lever).

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> from zerojax.tuning import SearchSpace
      >>> params = [jax.ShapeDtypeStruct((512, 512), "float32") for _ in range(4)]   # Ψ = 1M
      >>> def loss_fn(ws, x):
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x ** 2)
      >>> batch = jax.ShapeDtypeStruct((64, 512), "float32")
      >>> result = zj.autotune(loss_fn, params, optax.adam(1e-3), batch, mesh=zj.make_mesh(),
      ...                      memory="8MiB", space=SearchSpace(stages=(0, 3), accum=(1,), remat=("none",),
      ...                                                       offload=("none",), prefetch=(0,)))
      >>> result.best.config.stage, len(result.pruned)   # stage 0's 12Ψ = 12 MiB is pruned unseen
      (3, 1)
      >>> result.best.memory.device <= 8 * 2**20
      True
    """
    t0 = time.perf_counter()
    budget = parse_memory(memory)
    margin = check_margin(margin)
    base = ZeroConfig() if config is None else config
    if not isinstance(base, ZeroConfig):
        raise TypeError(f"config must be a zj.ZeroConfig (the base whose untuned fields are kept), got {base!r}.")
    if base.offload.ratio != 1:
        raise ValueError(
            f"config.offload.ratio={base.offload.ratio}: the search sets the ratio of a host offload itself; give "
            f"SearchSpace(ratios=({base.offload.ratio},)) (or several) instead, and leave the base config's at 1."
        )
    given_space = space
    space = SearchSpace() if space is None else space
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be a zerojax.tuning.SearchSpace, got {type(space).__name__}.")
    host_budget = None if host_memory is None else parse_host_memory(host_memory)
    nvme, disk = _tier(nvme, disk, space)
    if nvme is not None and given_space is None:
        space = dataclasses.replace(space, offload=space.offload + ("nvme",))
    shapes = abstract_params(params)
    check_mesh(mesh, base)
    meshes = split_meshes(mesh, base, space, batch, shapes)
    psi, opt_bytes = param_counts(shapes, tx)
    # A replica group's devices: data x context x expert, whatever the split (C and E move none).
    axes = base.axes
    shards = dict(mesh.shape)[axes.data] * context_size(mesh, axes.context) * expert_size(mesh, axes.expert)
    cands, rows, counts = [], {}, {}
    for (c, e, p), mesh_c in meshes.items():
        try:
            rows[c, e, p], global_batch = rows_per_device(batch, mesh_c, base, searched_pipeline=p > 1)
            if rows[c, e, p] % e:
                raise ValueError(
                    f"the global batch of {global_batch} rows gives each of the "
                    f"{batch_devices(mesh_c, base)} data groups {rows[c, e, p]} rows, which do not split over "
                    f"the {e} devices of the expert axis."
                )
            rows[c, e, p] //= e  # each device of an expert group runs its own rows
            if p > 1:  # the pipeline's micro-batches take accumulation's place
                counts[c, e, p] = space.microbatch_counts(p, rows[c, e, p])
                if not counts[c, e, p]:
                    raise ValueError(
                        f"each device's {rows[c, e, p]} rows split into none of the micro-batch counts tried "
                        f"({space.microbatches or (p, 2 * p)}); give SearchSpace(microbatches=...) counts that "
                        f"divide {rows[c, e, p]}."
                    )
            else:
                counts[c, e, p] = accumulation_counts(
                    space, rows[c, e, p], global_batch, batch_devices(mesh_c, base) * e
                )
        except ValueError as err:
            if p > 1:
                if space.pipeline == "auto":
                    continue  # "auto": the degrees the batch splits into
                raise ValueError(f"SearchSpace(pipeline={space.pipeline}), pipeline {p}: {err}") from None
            if [k for k in meshes if k[2] == 1] == [(1, 1, 1)]:
                raise
            contexts, experts = tuple(dict.fromkeys(k[0] for k in meshes)), tuple(dict.fromkeys(k[1] for k in meshes))
            if experts == (1,):
                raise ValueError(
                    f"SearchSpace(context={contexts}), context {c} (the batch over "
                    f"{batch_devices(mesh_c, base)} data groups): {err}"
                ) from None
            raise ValueError(
                f"SearchSpace(context={contexts}, expert={experts}), context {c}, expert {e} (the batch "
                f"over {batch_devices(mesh_c, base) * e} devices): {err}"
            ) from None
        # Stages 0-2 keep Ψ_d + Ψ_e / E parameters whole per device (a routed expert's stack is
        # split E ways): the formula with that count over the whole group is a lower bound of the
        # state (what it shards is Ψ / N), so it prunes no candidate that could fit.
        num = psi if e == 1 else psi - expert_params(shapes, mesh_c, base) * (1 - 1 / e)
        if p == 1:
            cands += enumerate_candidates(
                base,
                space,
                counts[c, e, p],
                num_params=num,
                shards=shards,
                opt_bytes=opt_bytes,
                context=c,
                expert=e,
                nvme=nvme,
            )
            continue
        # A stage holds the rest and 1/P of the stack, sharded over its N/P devices (docs/pipeline.md).
        num -= stack_params(shapes, mesh_c, base) * (1 - 1 / p)
        for m in counts[c, e, p]:
            cands += enumerate_candidates(
                dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, microbatches=m)),
                space,
                (1,),
                num_params=num,
                shards=shards // p,
                opt_bytes=opt_bytes,
                context=c,
                expert=e,
                pipeline=p,
                nvme=nvme,
            )
    limit = usable(budget, margin)
    pruned = [c for c in cands if c.formula_bytes > limit]
    alive = [c for c in cands if c.formula_bytes <= limit]
    if not alive:
        raise ValueError(nothing_fits_formula(pruned, budget, margin, shards, psi))
    spec = device_spec(device, mesh)
    search = _Search(
        loss_fn, shapes, tx, batch, meshes, spec, budget, margin, has_aux, rows, len(cands), verbose, progress
    )
    search.pipeline_space = space.pipeline
    search.host_budget, search.disk = host_budget, disk
    for c in pruned:
        search.report(f"{c.describe()}: pruned, state {fmt_bytes(c.formula_bytes)} > {fmt_bytes(limit)}")
    search.run(alive, exhaustive)
    spec = search.price(
        measure_matmuls(spec, mesh, {mnk for _, cost in search.by_program.values() for mnk, _ in cost.matmul_shapes})
    )
    plans = sorted((p for c, p in search.plans.items() if search.fits[c]), key=lambda p: p.time)
    if not plans:
        device_ok = [(c, p) for c, p in search.plans.items() if search.on_device[c]]
        if device_ok:  # the device has room; host memory does not
            c, p = min(device_ok, key=lambda cp: cp[1].memory.host)
            nxt = (
                "a larger host_memory, or a partial offload (SearchSpace(ratios=(0.5, ...)): part of the state stays "
                "on the device)"
                if nvme is not None
                else "the NVMe tier (zj.autotune(..., nvme=zj.config.NVMe(path)): the optimizer state on disk), "
                "a partial offload (SearchSpace(ratios=(0.5, ...))), or a larger host_memory"
            )
            raise ValueError(
                f"no configuration fits {fmt_bytes(host_budget)} of host memory per device: the one that needs "
                f"least, {c.describe()}, keeps {fmt_bytes(p.memory.host)} in host memory. Next: {nxt}."
            )
        raise ValueError(nothing_fits_compiled(search.plans, space, counts, rows, budget, margin))
    return AutotuneResult(
        plans=tuple(plans),
        budget=budget,
        margin=margin,
        device=spec,
        compiled=search.compiles,
        pruned=tuple(pruned),
        skipped=tuple(search.skipped.values()),
        shared=search.shared,
        candidates=len(cands),
        search_seconds=time.perf_counter() - t0,
        global_batch=global_batch,
    )


class _Search:
    """The compile loop and what it has learned so far."""

    def __init__(
        self,
        loss_fn,
        shapes,
        tx,
        batch,
        meshes: dict,
        spec: DeviceSpec,
        budget: int,
        margin: float,
        has_aux: bool,
        rows: dict[int, int],
        total: int,
        verbose: bool,
        progress: Progress | None,
    ):
        self.loss_fn, self.shapes, self.tx, self.batch, self.meshes = loss_fn, shapes, tx, batch, meshes
        self.spec, self.budget, self.margin, self.has_aux, self.rows = spec, budget, margin, has_aux, rows
        self.total, self.done, self.verbose, self.progress = total, 0, verbose, progress
        self.plans: dict[Candidate, Plan] = {}  # every evaluated candidate, fitting or not
        self.fits: dict[Candidate, bool] = {}
        self.skipped: dict[Candidate, Skipped] = {}
        self.by_program: dict[str, tuple[PlanMemory, StepCost]] = {}
        self.compiles = self.shared = 0
        self.warned = False
        self.pipeline_space: Any = None  # SearchSpace.pipeline
        self.refused: dict[int, str] = {}  # pipeline degree -> why the step refuses the loss on it
        self.on_device: dict[Candidate, bool] = {}  # fits the device budget (the host's aside)
        self.host_budget: int | None = None  # usable host bytes per device (autotune's host_memory)
        self.disk: DiskRates | None = None  # the NVMe tier's disk

    def report(self, message: str) -> None:
        self.done += 1
        if self.verbose:
            print(f"[{self.done:>{len(str(self.total))}}/{self.total}] {message}", file=sys.stderr, flush=True)
        if self.progress is not None:
            self.progress(self.done, self.total, message)

    def run(self, alive: list[Candidate], exhaustive: bool) -> None:
        families: dict[tuple, list[Candidate]] = {}
        for c in alive:
            families.setdefault(c.family, []).append(c)
        for members in families.values():
            members.sort(key=_lever_order(members))
            if exhaustive:
                for c in members:
                    self.evaluate(c)
                continue
            self.evaluate(members[0])  # fewest levers: when it fits, it dominates its remat policy's members
            while True:
                for c in members:
                    if not self.known(c):
                        self.infer(c)
                open_ = [c for c in members if not self.known(c)]
                if not open_:
                    break
                self.evaluate(max(open_, key=lambda u: (_informative(u, open_), -members.index(u))))

    def known(self, c: Candidate) -> bool:
        return c in self.fits or c in self.skipped or c.pipeline in self.refused

    def infer(self, c: Candidate) -> None:
        """Decides ``c`` without compiling where a compiled neighbour in its family does."""
        for d, fits in self.fits.items():
            if fits and more_levers(c, d):
                self.skipped[c] = Skipped(c, "dominated", d)
                self.report(f"{c.describe()}: not compiled, dominated by {d.describe()} (fits)")
                return
            # Ruled out by device memory only: fewer levers pulled means more of it, but less host memory.
            if not self.on_device[d] and needs_more_memory(c, d):
                self.skipped[c] = Skipped(c, "ruled out", d)
                self.report(f"{c.describe()}: not compiled, ruled out by {d.describe()} (does not fit)")
                return

    def evaluate(self, c: Candidate) -> None:
        if c.pipeline in self.refused:
            return
        t0 = time.perf_counter()
        try:
            state, lowered = self.lower(c)
        except ValueError as e:
            if c.pipeline == 1:
                raise
            if self.pipeline_space != "auto":
                raise ValueError(f"SearchSpace(pipeline={self.pipeline_space}), pipeline {c.pipeline}: {e}") from None
            self.refused[c.pipeline] = str(e)  # "auto": the degrees whose step takes the loss
            self.report(f"pipeline {c.pipeline}: not searched, the step refuses the loss on it: {e}")
            return
        key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if key in self.by_program:
            self.shared += 1
            memory, cost = self.by_program[key]
            how = "same program as one compiled before"
        else:
            mesh = self.meshes[c.split]
            compiled = lowered.compile(**_compile_options(mesh))
            self.compiles += 1
            memory = self.memory(compiled, state, c)
            host_state = memory.step.state_host if memory.step is not None else 0
            cost = step_cost(
                compiled,
                mesh,
                compute_dtype=c.config.compute_dtype,
                host_state_bytes=host_state,
                overlap=c.config.prefetch > 0,
            )
            self.by_program[key] = (memory, cost)
            how = f"compiled in {time.perf_counter() - t0:.1f} s"
        if c.offload == "nvme":
            memory, cost = self.on_disk(c, state, memory, cost)
        plan = Plan(
            config=c.config,
            memory=memory,
            time=cost.seconds(self.spec),
            cost=cost,
            micro_batch=self.rows[c.split] // (c.config.grad_accum_steps * c.config.pipeline.microbatches),
            offload=c.offload,
            program=key[:12],
            context=c.context,
            mesh=self.meshes[c.split],
            expert=c.expert,
            pipeline=c.pipeline,
        )
        self.plans[c] = plan
        self.on_device[c] = memory.device <= self.budget
        over_host = self.host_budget is not None and memory.host > self.host_budget
        self.fits[c] = self.on_device[c] and not over_host
        verdict = "fits" if self.on_device[c] else f"over by {fmt_bytes(memory.device - self.budget)}"
        if over_host:
            verdict += f", host memory {fmt_bytes(memory.host)} over by {fmt_bytes(memory.host - self.host_budget)}"
        self.report(
            f"{c.describe()}: {how}; {fmt_bytes(memory.device)} per device, {verdict}; "
            f"{plan.time * 1e3:.3g} ms per step predicted"
        )

    def price(self, spec: DeviceSpec) -> DeviceSpec:
        """Every plan's time again with ``spec`` (a measured device's rates for the matmul
        shapes the compiled programs run, known only once they are compiled)."""
        if spec is not self.spec:
            self.spec = spec
            self.plans = {c: dataclasses.replace(p, time=p.cost.seconds(spec)) for c, p in self.plans.items()}
        return spec

    def lower(self, c: Candidate):
        from zerojax.step import make_train_step

        mesh = self.meshes[c.split]
        config = c.config
        if c.offload == "nvme":  # the device's programs: the streamed update of host-offloaded state
            config = dataclasses.replace(
                config, offload=dataclasses.replace(config.offload, nvme=None, update="device")
            )
        state = abstract_state(self.shapes, self.tx, mesh=mesh, config=config)
        step = make_train_step(self.loss_fn, self.tx, mesh=mesh, config=config, has_aux=self.has_aux)
        return state, step.lower(state, abstract_batch(state.plan, self.batch))

    def on_disk(self, c: Candidate, state, memory: PlanMemory, cost: StepCost) -> tuple[PlanMemory, StepCost]:
        """The NVMe plan's memory and cost from its streamed host-offload proxy's: the optimizer
        state moves from host memory to disk, the tier's buffers take host memory, and each step
        reads and writes the state once per process."""
        on_disk = sum(
            _shard_bytes(x)
            for x in jax.tree.leaves(state.opt_state)
            if getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host") and x.ndim
        )
        local = len(self.meshes[c.split].local_devices)
        tier = c.config.offload.nvme
        buffers = -(-tier.buffer_count * tier.buffer_size // local)
        memory = dataclasses.replace(memory, host=memory.host - on_disk + buffers, disk=on_disk)
        return memory, dataclasses.replace(cost, disk_seconds=self.disk.seconds(on_disk * local))

    def memory(self, compiled, state, c: Candidate) -> PlanMemory:
        m = compiled_bytes(compiled)
        state_bytes, state_host = _state_bytes(state)
        batch_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(abstract_batch(state.plan, self.batch)))
        if m["argument"] == 0 and m["output"] == 0 and m["temp"] == 0:  # jax issue #18954
            if not self.warned:
                warnings.warn(
                    "memory_analysis() of the compiled step reports zero bytes on this backend (jax issue "
                    "#18954): plan memory falls back to zerojax's state formula plus the batch, which does "
                    "not count activations or temporaries; leave more margin, or check the chosen plan "
                    "with zj.report.step_memory on a backend that reports it.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.warned = True
            compiled_total = int(math.ceil(c.formula_bytes)) + batch_bytes
            return PlanMemory(
                device=int(math.ceil(compiled_total * (1 + self.margin))),
                compiled=compiled_total,
                host=state_host,
                state=int(math.ceil(c.formula_bytes)),
                source="formula",
            )
        step = StepMemory(
            state=state_bytes,
            batch=batch_bytes,
            argument=m["argument"],
            output=m["output"],
            alias=m["alias"],
            temp=m["temp"],
            host_temp=m["host_temp"],
            state_host=state_host,
            host_argument=m["host_argument"],
        )
        total = step.device_total
        return PlanMemory(
            device=int(math.ceil(total * (1 + self.margin))),
            compiled=total,
            host=state_host + m["host_temp"],
            state=state_bytes - state_host,
            step=step,
        )


def _lever_order(members: list[Candidate]):
    """Sort key: fewest levers first (each lever's values ranked within the family)."""
    ranks = [sorted({c.levers[i] for c in members}) for i in range(3)]
    return lambda c: (sum(r.index(v) for r, v in zip(ranks, c.levers)), c.levers)


def stack_params(shapes: Any, mesh: Any, config: ZeroConfig) -> int:
    """Ψ_stack: the parameters of the layer stack split over ``mesh``'s pipeline axis."""
    from zerojax.sharding.plan import make_plan

    plan = make_plan(shapes, mesh, config)
    return sum(plan.layouts[i].size for i in plan.stack_leaves)


def expert_params(shapes: Any, mesh: Any, config: ZeroConfig) -> int:
    """Ψ_e: the parameters split over ``mesh``'s expert axis (the routed experts' stacks the
    model's annotations mark), read from the plan of ``shapes`` on it."""
    from zerojax.sharding.plan import make_plan

    plan = make_plan(shapes, mesh, config)
    return sum(l.size for l in plan.layouts if plan.is_expert(l))


def _compile_options(mesh) -> dict:
    """On the CPU backend: LLVM's optimisation off, which halves compile time and leaves
    the HLO, ``memory_analysis()`` and ``cost_analysis()`` unchanged (buffers are assigned
    before code generation; a test checks they are equal). Elsewhere: the default."""
    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return {"compiler_options": {"xla_backend_optimization_level": 0}}
    return {}


def _informative(u: Candidate, open_: list[Candidate]) -> int:
    """How many open candidates compiling ``u`` decides either way (the smaller count):
    those it dominates if it fits, those it rules out if it does not."""
    up = sum(more_levers(v, u) for v in open_)
    down = sum(needs_more_memory(v, u) for v in open_)
    return min(up, down)


def _state_bytes(state) -> tuple[int, int]:
    """(all, host) bytes per device of an abstract state, from its leaves' shardings."""
    total = host = 0
    for x in jax.tree.leaves(state):
        shard = x.sharding.shard_shape(x.shape)
        nbytes = math.prod(shard) * (getattr(x.dtype, "itemsize", None) or np.dtype(x.dtype).itemsize)
        total += nbytes
        if getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            host += nbytes
    return total, host


def _shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    return math.prod(x.sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize


def _tier(nvme: Any, disk: DiskRates | None, space: SearchSpace) -> tuple[Any, DiskRates | None]:
    """autotune's ``nvme`` as a ``zj.config.NVMe`` (None without one) and its disk's rates."""
    from zerojax.config.groups import NVMe

    if nvme is None:
        if "nvme" in space.offload:
            raise ValueError(
                "SearchSpace(offload=...) has 'nvme' but autotune was given no nvme=: give the tier, "
                "zj.autotune(..., nvme=zj.config.NVMe(path)) (or its path)."
            )
        if disk is not None:
            raise ValueError("autotune's disk= rates the NVMe tier's disk: give nvme= with it.")
        return None, None
    if isinstance(nvme, str):
        nvme = NVMe(path=nvme)
    elif isinstance(nvme, dict):
        nvme = NVMe(**nvme)
    if not isinstance(nvme, NVMe):
        raise TypeError(f"nvme must be a zj.config.NVMe, a dict of its fields or its path, got {nvme!r}.")
    if disk is None:
        disk = measure_disk(nvme.path)
    if not isinstance(disk, DiskRates):
        raise TypeError(f"disk must be a zerojax.tuning.DiskRates, got {disk!r}.")
    return nvme, disk
