"""What the tuner returns: plans that fit, best first, and how the search went."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

from zerojax.config import ZeroConfig
from zerojax.report.memory import StepMemory
from zerojax.tuning.budget import fmt_bytes
from zerojax.tuning.candidates import Candidate, remat_name
from zerojax.tuning.cost import StepCost
from zerojax.tuning.devices import DeviceSpec

MEMORY_SOURCES = ("compiled", "formula")


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """Bytes per device of a plan.

    Fields:
      device: predicted device memory: ``compiled`` × (1 + margin), what must fit the budget.
      compiled: the compiled program's device bytes, argument + output − alias + temp (less
        offloaded state where the backend counts it with the rest, as
        :attr:`zerojax.report.StepMemory.device_total`).
      host: host memory per device: offloaded state and host temporaries (and with the NVMe
        tier its buffers, ``buffer_count · buffer_size`` per process over its devices).
      disk: the NVMe tier's bytes per device (the optimizer state; twice that while a step
        writes its next version).
      state: the persistent train state on the device.
      source: "compiled" (``memory_analysis()``), or "formula" where the backend reported
        zeros (then ``compiled`` is the state formula plus the batch: no activations).
      step: the compiled program's breakdown (None for "formula").
    """

    device: int
    compiled: int
    host: int
    state: int
    source: str = "compiled"
    step: StepMemory | None = None
    disk: int = 0

    def __post_init__(self) -> None:
        for name in ("device", "compiled", "host", "state", "disk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PlanMemory.{name} must be an int >= 0 (bytes), got {value!r}.")
        if self.source not in MEMORY_SOURCES:
            raise ValueError(f"PlanMemory.source must be one of {MEMORY_SOURCES}, got {self.source!r}.")
        if self.device < self.compiled:
            raise ValueError(
                f"PlanMemory.device ({self.device}) is the compiled bytes ({self.compiled}) plus a "
                "margin; it cannot be smaller."
            )


@dataclasses.dataclass(frozen=True)
class Plan:
    """A configuration that fits, with its predicted memory and step time.

    ``config`` is the user's ``ZeroConfig`` with the tuned fields set (stage,
    ``grad_accum_steps``, remat, prefetch, offload, gather dtype); ``memory`` per device
    (:class:`PlanMemory`); ``time`` the predicted seconds per step (:mod:`zerojax.tuning.cost`),
    ``cost`` what it is predicted from; ``micro_batch`` the rows each device runs at once;
    ``program`` a short hash of the lowered program (plans with the same one compile to the
    same step: a remat policy on a model without a layer loop changes nothing); ``context``
    the context-parallel degree, ``expert`` the expert-parallel one, ``pipeline`` the pipeline
    degree (its micro-batches are ``config.pipeline.microbatches``), and ``mesh`` the mesh the
    plan was compiled for (the given one, or ``zj.make_mesh(context=C, expert=E, pipeline=P)``
    over its devices where ``SearchSpace(context=..., expert=..., pipeline=...)`` searched
    other degrees): train with ``zj.make_train_step(..., mesh=plan.mesh, config=plan.config)``.
    """

    config: ZeroConfig
    memory: PlanMemory
    time: float
    cost: StepCost
    micro_batch: int
    offload: str = "none"
    program: str = ""
    context: int = 1
    mesh: Any = None
    expert: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.config, ZeroConfig):
            raise TypeError(f"Plan.config must be a ZeroConfig, got {type(self.config).__name__}.")
        if not isinstance(self.memory, PlanMemory):
            raise TypeError(f"Plan.memory must be a PlanMemory, got {type(self.memory).__name__}.")
        if (
            isinstance(self.time, bool)
            or not isinstance(self.time, (int, float))
            or not (math.isfinite(self.time) and self.time > 0)
        ):
            raise ValueError(f"Plan.time must be positive finite seconds, got {self.time!r}.")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"Plan.micro_batch must be a positive int (rows per device), got {self.micro_batch!r}.")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"Plan.context must be a positive int (context-parallel degree), got {self.context!r}.")
        if isinstance(self.expert, bool) or not isinstance(self.expert, int) or self.expert < 1:
            raise ValueError(f"Plan.expert must be a positive int (expert-parallel degree), got {self.expert!r}.")
        if isinstance(self.pipeline, bool) or not isinstance(self.pipeline, int) or self.pipeline < 1:
            raise ValueError(f"Plan.pipeline must be a positive int (pipeline degree), got {self.pipeline!r}.")

    def describe(self) -> str:
        return Candidate(self.config, self.offload, 0.0, self.context, self.expert, self.pipeline).describe()


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A candidate the search did not compile, and why: ``"dominated"`` (a plan that fits
    pulls no lever further: it is predicted at least as fast) or ``"ruled out"`` (one that
    pulls every lever at least as far does not fit), naming that plan."""

    candidate: Candidate
    reason: str
    by: Candidate


@dataclasses.dataclass(frozen=True)
class AutotuneResult(Sequence):
    """The plans that fit, fastest predicted first (a sequence of :class:`Plan`), and the
    search that found them.

    ``best`` is the first plan; ``compiled`` the number of programs compiled; ``pruned`` the
    candidates never compiled because their persistent state alone (the formula) exceeds
    the budget; ``skipped`` those the search decided from a compiled neighbour
    (:class:`Skipped`); ``shared`` candidates whose lowered program equalled one already
    compiled; ``search_seconds`` the wall time of the search; ``table()`` a markdown table.

    Example (built by hand here; ``zj.autotune`` returns it):
      >>> import zerojax as zj
      >>> from zerojax.tuning import AutotuneResult, DeviceSpec, Plan, PlanMemory, StepCost
      >>> spec = DeviceSpec(name="1 TFLOP/s", peak_flops=1e12, peak_flops_fp32=1e12, hbm_bandwidth=1e12,
      ...                   link_bandwidth=1e11)
      >>> memory = PlanMemory(device=11 * 2**20, compiled=10 * 2**20, host=0, state=4 * 2**20)
      >>> plan = Plan(config=zj.ZeroConfig(stage=3), memory=memory, time=0.5,
      ...             cost=StepCost(flops=5e11, bytes_accessed=0.0), micro_batch=4)
      >>> result = AutotuneResult(plans=(plan,), budget=16 * 2**20, margin=0.1, device=spec, compiled=1,
      ...                         pruned=(), skipped=(), shared=0, candidates=1, search_seconds=2.0,
      ...                         global_batch=32)
      >>> result.best.config.stage, len(result)
      (3, 1)
      >>> print(result.table().splitlines()[-1])
      | 1 | 3 | 1 (4) | none | none | 0 | float32 | 11.0 MiB | 0 B | 500 ms | 500 ms | 0 ms |
      >>> PlanMemory(device=1, compiled=2, host=0, state=0)
      Traceback (most recent call last):
      ...
      ValueError: PlanMemory.device (1) is the compiled bytes (2) plus a margin; it cannot be smaller.
    """

    plans: tuple[Plan, ...]
    budget: int
    margin: float
    device: DeviceSpec
    compiled: int
    pruned: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]
    shared: int
    candidates: int
    search_seconds: float
    global_batch: int

    def __post_init__(self) -> None:
        if not self.plans:
            raise ValueError("AutotuneResult needs at least one plan (no plan fitting raises instead).")
        times = [p.time for p in self.plans]
        if times != sorted(times):
            raise ValueError("AutotuneResult.plans must be ordered by predicted time, fastest first.")
        if any(p.memory.device > self.budget for p in self.plans):
            raise ValueError("AutotuneResult.plans must all fit the budget.")

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i):
        return self.plans[i]

    def __iter__(self) -> Iterator[Plan]:
        return iter(self.plans)

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def summary(self) -> str:
        """One line: what was searched, how, and how long it took."""
        plural = "" if self.candidates == 1 else "s"
        return (
            f"{self.candidates} candidate{plural} for {fmt_bytes(self.budget)} per device "
            f"({self.margin:.0%} margin), {self.device.name}: {self.compiled} compiled, "
            f"{len(self.pruned)} pruned by the state formula, {len(self.skipped)} decided without compiling, "
            f"{self.shared} sharing a compiled program; {len(self.plans)} fit; "
            f"search {self.search_seconds:.1f} s"
        )

    def table(self, limit: int | None = None) -> str:
        """A markdown table of the plans (the first ``limit``), with the summary line."""
        context = any(p.context > 1 for p in self.plans)  # a context column where a plan splits sequences
        expert = any(p.expert > 1 for p in self.plans)  # an expert column where a plan splits experts
        pipe = any(p.pipeline > 1 for p in self.plans)  # a pipeline column: P (M micro-batches)
        disk = any(p.memory.disk for p in self.plans)  # disk bytes and time where a plan uses the NVMe tier
        rows = [
            f"| # | stage |{' context |' if context else ''}{' expert |' if expert else ''}"
            f"{' pipeline (M) |' if pipe else ''} accum (rows) | remat | "
            "offload | prefetch | gather | device memory | host |"
            + (" disk |" if disk else "")
            + " time / step | compute | comm |"
            + (" disk time |" if disk else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"
            + ("---|" if context else "")
            + ("---|" if expert else "")
            + ("---|" if pipe else "")
            + ("---|---|" if disk else ""),
        ]
        for i, p in enumerate(self.plans[:limit], 1):
            c, parts = p.config, p.cost.breakdown(self.device)
            stages = f" {p.pipeline} ({c.pipeline.microbatches}) |" if p.pipeline > 1 else " 1 |"
            rows.append(
                f"| {i} | {c.stage} |{f' {p.context} |' if context else ''}{f' {p.expert} |' if expert else ''}"
                f"{stages if pipe else ''} "
                f"{c.grad_accum_steps} ({p.micro_batch}) | "
                f"{remat_name(c.remat)} | {p.offload}{f' ({c.offload.ratio:g})' if c.offload.ratio < 1 else ''} | "
                f"{c.prefetch} | {c.collectives.gather_dtype or c.compute_dtype} | {fmt_bytes(p.memory.device)}"
                f"{'*' if p.memory.source == 'formula' else ''} | {fmt_bytes(p.memory.host)} |"
                f"{f' {fmt_bytes(p.memory.disk)} |' if disk else ''} {_seconds(p.time)} | "
                f"{_seconds(parts['compute'] + parts['memory'])} | {_seconds(parts['comm'])} |"
                + (f" {_seconds(parts['disk'])} |" if disk else "")
            )
        return "\n".join([self.summary(), "", *rows])

    def __str__(self) -> str:
        return self.table()


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
