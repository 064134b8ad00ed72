"""The configurations the tuner considers, and what can be said of them before compiling.

A candidate is the user's :class:`~zerojax.ZeroConfig` with the tuned fields set: stage,
``grad_accum_steps``, remat policy, offload, prefetch and gather dtype; every other field
(compute dtype, clipping, loss scaling, ...) is the user's. :class:`SearchSpace` says which
values each tuned field takes.

Before anything is compiled a candidate whose persistent state alone
(:func:`zerojax.report.zero_formula_bytes`, on the device) exceeds the usable budget is pruned:
its compiled program holds that state as arguments, so it cannot fit.

Three levers trade memory: accumulation (more micro-batches: the same FLOPs, weights read
again and, at stages 2–3, collectives run again per micro-batch), remat (more recompute:
``none`` < ``dots`` < ``dots_no_batch`` < ``full``) and offload (state crossing the host
link: ``none`` < ``optimizer`` < ``params``). Candidates that agree on everything else form
a family. Within a family the search (:mod:`zerojax.tuning.search`) uses two rules:

* a candidate that pulls accumulation and offload at least as far as one that fits, with the
  same remat policy, is never predicted faster than it: it is not compiled (*dominated*,
  :func:`more_levers`). Remat is not a time lever: recomputing adds FLOPs but saves the
  writing and reading of the saved activations, and where a step is bound by memory traffic
  (a CPU, small layers) ``dots`` and ``full`` run faster than ``none``
  (docs/autotune.md measures it), so each policy is compiled on its own;
* a candidate that pulls no lever further than one that does not fit needs at least its
  memory: it is not compiled either (*ruled out*, :func:`needs_more_memory`). Accumulation
  is monotone in memory only from 2 micro-batches on (the gradient accumulator exists from
  k = 2), so k = 1 is compared only with k = 1.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from zerojax.config import ZeroConfig
from zerojax.config.groups import Offload
from zerojax.remat.policy import Remat, resolve
from zerojax.report.memory import zero_formula_bytes

OFFLOADS = ("none", "optimizer", "params", "nvme")
# How far each offload pulls its lever, as a partial order: "params" moves more than
# "optimizer" to host memory, "nvme" moves the optimizer state on to disk (less host memory,
# more time), but "nvme" (its update streamed through the device) and "params" or "optimizer"
# (updated in host memory) are not ordered in device memory: neither decides the other.
_OFFLOAD_BELOW = {"none": set(OFFLOADS), "optimizer": {"optimizer", "params"}, "params": {"params"}, "nvme": {"nvme"}}
_REMAT_RANK = {"none": 0, "dots": 1, "dots_no_batch": 2, "full": 3}  # recompute, least to most


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The values the tuner tries for each tuned ``ZeroConfig`` field.

    Fields:
      stages: ZeRO stages (0–3).
      accum: accumulation counts to try; None: every count that divides the rows each device
        gets of the global batch (up to ``max_accum``).
      max_accum: the largest accumulation count tried when ``accum`` is None.
      remat: remat policies (names of :mod:`zerojax.remat`, or ``zj.remat.Remat``).
      offload: "none", "optimizer" (``offload_optimizer``, stages 1–3), "params"
        (``offload_optimizer`` and ``offload_params``, stage 3) and "nvme" (the optimizer
        state on disk, stages 1–3: searched when ``zj.autotune`` is given ``nvme=``; the
        default space takes it then).
      prefetch: layers gathered ahead at stage 3 (other stages take 0).
      gather_dtypes: stage 3's weight-gather dtype: None (the compute dtype) and/or "int8"
        (ZeRO++'s qwZ, lossy: opt in by listing it).
      context: context-parallel degrees ``C`` (``zj.make_mesh(context=C)`` over the same
        devices: each sequence split over ``C`` devices, the state over data × context as
        before); None: the given mesh's own (1 without a context axis). Each ``C`` must divide
        the devices of a replica group and every batch leaf's sequence (``2C`` in the
        balanced layout); a plan's ``context`` says which mesh it runs on.
      expert: expert-parallel degrees ``E`` (``zj.make_mesh(expert=E)`` over the same
        devices: the batch over data × expert, the weights annotated with the expert axis
        split over it); None: the given mesh's own (1 without an expert axis). Each ``E``
        must divide the devices of a replica group (with ``C``) and every expert stack; a
        plan's ``expert`` says which mesh it runs on.
      pipeline: pipeline degrees ``P`` (``zj.make_mesh(pipeline=P)`` over the same devices:
        the layer stack split into ``P`` stages, ZeRO over each stage's devices; see
        docs/pipeline.md); None: no pipeline (1); ``"auto"``: every divisor of the device
        count into which the model's layer stack splits. An explicit ``P`` the devices or the
        stack do not split into is refused, naming the ones that do. A plan's ``pipeline``
        says which mesh it runs on.
      microbatches: the pipeline's micro-batches ``M`` tried for each ``P > 1`` (they take
        the place of accumulation there: ``grad_accum_steps`` stays 1); None: ``P`` and
        ``2P``. Those that do not divide a device's rows are left out; the bubble is
        ``(P - 1) / (M + P - 1)``.
      ratios: shares of the optimizer state a host offload ("optimizer", "params") keeps in
        host memory (``Offload.ratio``, DeepSpeed's Twin-Flow), in (0, 1]: the rest stays on
        the device, less host traffic for more device memory. Default ``(1.0,)``: all of it.

    Combinations a ``ZeroConfig`` refuses (offload at stage 0, prefetch with offloaded
    parameters, ...) are left out.

    Example:
      >>> from zerojax.tuning import SearchSpace
      >>> SearchSpace(stages=(2, 3), remat=("full",)).remat
      ('full',)
      >>> SearchSpace(offload=("disk",))
      Traceback (most recent call last):
      ...
      ValueError: SearchSpace.offload values must be among ('none', 'optimizer', 'params', 'nvme'), got ('disk',).
    """

    stages: tuple[int, ...] = (0, 1, 2, 3)
    accum: tuple[int, ...] | None = None
    max_accum: int = 16
    remat: tuple[Any, ...] = ("none", "dots", "full")
    offload: tuple[str, ...] = OFFLOADS[:3]
    prefetch: tuple[int, ...] = (0, 1)
    gather_dtypes: tuple[Any, ...] = (None,)
    context: tuple[int, ...] | None = None
    expert: tuple[int, ...] | None = None
    pipeline: tuple[int, ...] | str | None = None
    microbatches: tuple[int, ...] | None = None
    ratios: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        for name in ("stages", "remat", "offload", "prefetch", "gather_dtypes"):
            value = getattr(self, name)
            if isinstance(value, (str, int, Remat)) or value is None:
                value = (value,)
            value = tuple(dict.fromkeys(value))
            if not value:
                raise ValueError(f"SearchSpace.{name} is empty; give at least one value.")
            set_(name, value)
        if any(isinstance(s, bool) or s not in (0, 1, 2, 3) for s in self.stages):
            raise ValueError(f"SearchSpace.stages values must be among (0, 1, 2, 3), got {self.stages}.")
        for r in self.remat:
            resolve(r)  # an unknown policy raises here, naming the valid ones
        if any(o not in OFFLOADS for o in self.offload):
            raise ValueError(f"SearchSpace.offload values must be among {OFFLOADS}, got {self.offload}.")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in self.prefetch):
            raise ValueError(f"SearchSpace.prefetch values must be ints >= 0, got {self.prefetch}.")
        if any(g not in (None, "int8") for g in self.gather_dtypes):
            raise ValueError(f"SearchSpace.gather_dtypes values must be None or 'int8', got {self.gather_dtypes}.")
        for name, what in (("context", "context-parallel"), ("expert", "expert-parallel")):
            value = getattr(self, name)
            if value is None:
                continue
            degrees = (value,) if isinstance(value, int) else tuple(dict.fromkeys(value))
            if not degrees or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in degrees):
                raise ValueError(
                    f"SearchSpace.{name} must be positive ints ({what} degrees) or None (the mesh's "
                    f"own), got {value!r}."
                )
            set_(name, tuple(sorted(degrees)))
        if self.pipeline is not None and self.pipeline != "auto":
            degrees = (self.pipeline,) if isinstance(self.pipeline, int) else self.pipeline
            if (
                isinstance(degrees, str)
                or not degrees
                or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in degrees)
            ):
                raise ValueError(
                    f"SearchSpace.pipeline must be positive ints (pipeline degrees), 'auto' (every degree the "
                    f"devices and the layer stack split into) or None (no pipeline), got {self.pipeline!r}."
                )
            set_("pipeline", tuple(sorted(dict.fromkeys(degrees))))
        if self.microbatches is not None:
            ms = (self.microbatches,) if isinstance(self.microbatches, int) else tuple(dict.fromkeys(self.microbatches))
            if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
                raise ValueError(
                    f"SearchSpace.microbatches must be positive ints (the pipeline's micro-batches) or None "
                    f"(P and 2P), got {self.microbatches!r}."
                )
            set_("microbatches", tuple(sorted(ms)))
        if self.accum is not None:
            accum = (self.accum,) if isinstance(self.accum, int) else tuple(dict.fromkeys(self.accum))
            if not accum or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in accum):
                raise ValueError(
                    f"SearchSpace.accum must be positive ints (or None: every divisor), got {self.accum!r}."
                )
            set_("accum", tuple(sorted(accum)))
        ratios = (self.ratios,) if isinstance(self.ratios, (int, float)) else tuple(self.ratios)
        if not ratios or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1 for r in ratios):
            raise ValueError(
                f"SearchSpace.ratios must be numbers in (0, 1] (the share of the optimizer state a host offload "
                f"keeps in host memory), got {self.ratios!r}."
            )
        set_("ratios", tuple(sorted({float(r) for r in ratios})))
        if isinstance(self.max_accum, bool) or not isinstance(self.max_accum, int) or self.max_accum < 1:
            raise ValueError(f"SearchSpace.max_accum must be a positive int, got {self.max_accum!r}.")

    def accumulation_counts(self, rows_per_device: int) -> tuple[int, ...]:
        """The counts tried for ``rows_per_device`` rows: those of ``accum`` (or every count
        up to ``max_accum``) that divide it.

        Example:
          >>> from zerojax.tuning import SearchSpace
          >>> SearchSpace().accumulation_counts(12)
          (1, 2, 3, 4, 6, 12)
          >>> SearchSpace(accum=(2, 5)).accumulation_counts(12)
          (2,)
        """
        tried = self.accum if self.accum is not None else range(1, self.max_accum + 1)
        return tuple(k for k in tried if rows_per_device % k == 0)

    def microbatch_counts(self, pipeline: int, rows_per_device: int) -> tuple[int, ...]:
        """The pipeline's micro-batch counts tried at degree ``pipeline`` for
        ``rows_per_device`` rows: those of ``microbatches`` (or ``P`` and ``2P``) that divide
        them; ``(1,)`` without a pipeline.

        Example:
          >>> from zerojax.tuning import SearchSpace
          >>> SearchSpace().microbatch_counts(2, 8), SearchSpace(microbatches=(3, 4)).microbatch_counts(4, 8)
          ((2, 4), (4,))
        """
        if pipeline == 1:
            return (1,)
        tried = self.microbatches if self.microbatches is not None else (pipeline, 2 * pipeline)
        return tuple(m for m in tried if rows_per_device % m == 0)

    def tried_counts(self) -> tuple[int, ...]:
        """The accumulation counts asked for, before any batch divides them."""
        return self.accum if self.accum is not None else tuple(range(1, self.max_accum + 1))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration to consider, with its formula bytes (persistent state per device on
    the device, :func:`zerojax.report.zero_formula_bytes`) and offload name."""

    config: ZeroConfig
    offload: str
    formula_bytes: float
    context: int = 1  # context-parallel degree: the mesh is zj.make_mesh(context=context)
    expert: int = 1  # expert-parallel degree: the mesh is zj.make_mesh(expert=expert)
    pipeline: int = 1  # pipeline degree: the mesh is zj.make_mesh(pipeline=pipeline)

    @property
    def split(self) -> tuple[int, int, int]:
        """(context degree, expert degree, pipeline degree): which of the searched meshes it
        runs on."""
        return (self.context, self.expert, self.pipeline)

    @property
    def family(self) -> tuple:
        """What the levers leave fixed: stage, prefetch, gather dtype, context degree, and a
        remat policy outside the ranked ones (named values, host offload of activations).
        Candidates of different context degrees run different programs over different
        meshes (rows per device, sequence per device): neither decides the other."""
        c = self.config
        rank = _REMAT_RANK.get(c.remat.kind)
        return (
            c.stage,
            c.prefetch,
            c.collectives.gather_dtype,
            c.remat if rank is None else None,
            self.context,
            self.expert,
            self.pipeline,
            self.config.pipeline.microbatches,
        )

    @property
    def ratio(self) -> float:
        """The share of the optimizer state offloaded: 0 without offload, ``Offload.ratio`` with."""
        return 0.0 if self.offload == "none" else self.config.offload.ratio

    @property
    def levers(self) -> tuple[int, int, tuple[int, float]]:
        """(accumulation count, remat rank, (offload rank, ratio)): the offload rank sorts only;
        :func:`offload_at_least` and the ratio order offloads."""
        c = self.config
        return (c.grad_accum_steps, _REMAT_RANK.get(c.remat.kind, 0), (OFFLOADS.index(self.offload), self.ratio))

    def describe(self) -> str:
        """A short name: ``stage 3, accum 2, remat full, offload optimizer, prefetch 1``
        (and ``context 4`` on a context mesh, ``expert 4`` on an expert mesh)."""
        c = self.config
        parts = [f"stage {c.stage}", f"accum {c.grad_accum_steps}", f"remat {remat_name(c.remat)}"]
        if self.context > 1:
            parts.append(f"context {self.context}")
        if self.expert > 1:
            parts.append(f"expert {self.expert}")
        if self.pipeline > 1:
            m = c.pipeline.microbatches
            parts.append(f"pipeline {self.pipeline} ({m} micro-batches, bubble {bubble(self.pipeline, m):.0%})")
        if self.offload != "none":
            parts.append(f"offload {self.offload}" + (f" (ratio {self.ratio:g})" if self.ratio < 1 else ""))
        if c.prefetch:
            parts.append(f"prefetch {c.prefetch}")
        if c.collectives.gather_dtype is not None:
            parts.append(f"gather {c.collectives.gather_dtype}")
        return ", ".join(parts)


def bubble(pipeline: int, microbatches: int) -> float:
    """GPipe's bubble: the share ``(P - 1) / (M + P - 1)`` of a stage's ticks that compute on
    padding (in one SPMD program they run, so the compiled FLOPs hold them)."""
    return (pipeline - 1) / (microbatches + pipeline - 1)


def remat_name(remat: Remat) -> str:
    return remat.kind if not remat.names else f"{remat.kind}({','.join(remat.names)})"


def offload_at_least(a: str, b: str) -> bool:
    """Whether offload ``a`` pulls its lever at least as far as ``b`` (a partial order:
    "nvme" is ordered with "none" and itself only)."""
    return a in _OFFLOAD_BELOW[b]


def more_levers(c: Candidate, d: Candidate) -> bool:
    """Whether ``c`` pulls accumulation and offload at least as far as ``d``, with the same
    remat policy (same family): never predicted faster than ``d``, and never needing more
    memory. Remat policies are not ordered in time (see the module docstring)."""
    (kc, rc, _), (kd, rd, _) = c.levers, d.levers
    further = offload_at_least(c.offload, d.offload) and c.ratio >= d.ratio
    return c.family == d.family and rc == rd and kc >= kd and further


def needs_more_memory(c: Candidate, d: Candidate) -> bool:
    """Whether ``c`` needs at least ``d``'s memory: same family, no lever pulled further
    (accumulation compared within k = 1 or within k >= 2, see the module docstring)."""
    if c.family != d.family:
        return False
    (kc, rc, _), (kd, rd, _) = c.levers, d.levers
    k_ok = kc == kd or (2 <= kc <= kd)
    return k_ok and rc <= rd and offload_at_least(d.offload, c.offload) and c.ratio <= d.ratio


def enumerate_candidates(
    base: ZeroConfig,
    space: SearchSpace,
    counts: Sequence[int],
    *,
    num_params: float,
    shards: int,
    opt_bytes: float,
    context: int = 1,
    expert: int = 1,
    pipeline: int = 1,
    nvme: Any = None,
) -> list[Candidate]:
    """Every valid configuration of ``space`` over ``base`` with accumulation ``counts``,
    each with its persistent device bytes (``num_params`` trainable parameters sharded over
    ``shards`` devices, ``opt_bytes`` of optimizer state per parameter), on the mesh of
    context degree ``context``, expert degree ``expert`` and pipeline degree ``pipeline``
    (there ``num_params`` is what one stage holds: the rest and ``1 / P`` of the stack);
    ``nvme`` (a ``zj.config.NVMe``) is the tier of the "nvme" candidates."""
    out: list[Candidate] = []
    for stage in space.stages:
        for offload in space.offload:
            if (offload != "none" and stage == 0) or (offload == "params" and stage != 3):
                continue
            formula = zero_formula_bytes(
                num_params,
                shards,
                stage,
                compute_dtype=base.compute_dtype,
                opt_bytes=opt_bytes,
                offload_optimizer=offload != "none",
                offload_params=offload == "params",
                memory="device",
            )
            # A partial offload's device bytes are at most the full offload's plus the share kept: the
            # full offload's formula bounds every ratio's from below (what pruning needs).
            for prefetch, gather, remat, k, ratio in itertools.product(
                space.prefetch if stage == 3 else (0,),
                space.gather_dtypes if stage == 3 else (None,),
                space.remat,
                counts,
                space.ratios if offload in ("optimizer", "params") else (1.0,),
            ):
                if prefetch and offload == "params":
                    continue
                config = dataclasses.replace(
                    base,
                    stage=stage,
                    grad_accum_steps=k,
                    remat=resolve(remat),
                    prefetch=prefetch,
                    offload=_offload(base.offload, offload, nvme, ratio),
                    collectives=dataclasses.replace(base.collectives, gather_dtype=gather),
                )
                out.append(
                    Candidate(
                        config=config,
                        offload=offload,
                        formula_bytes=formula,
                        context=context,
                        expert=expert,
                        pipeline=pipeline,
                    )
                )
    return _unique(out)


def _offload(base: Offload, offload: str, nvme: Any, ratio: float) -> Offload:
    """The user's ``Offload`` with the searched offload and ratio set (a ratio below 1 only
    where the optimizer state goes to host memory)."""
    return dataclasses.replace(
        base,
        optimizer=offload != "none",
        params=offload == "params",
        nvme=nvme if offload == "nvme" else None,
        update="auto" if offload == "nvme" and base.update == "host" else base.update,
        ratio=ratio if offload in ("optimizer", "params") else 1.0,
    )


def _unique(cands: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in cands:
        if (c.config, c.split) not in seen:
            seen.add((c.config, c.split))
            out.append(c)
    return out


def valid_batch_sizes(global_batch: int, batch_devices: int, counts: Sequence[int]) -> tuple[int, int | None]:
    """The nearest global batch sizes (below, above) that split over ``batch_devices``
    devices and at least one of ``counts`` micro-batches.

    Example:
      >>> from zerojax.tuning.candidates import valid_batch_sizes
      >>> valid_batch_sizes(30, 8, (1, 2, 4))
      (24, 32)
      >>> valid_batch_sizes(30, 8, (3,))
      (24, 48)
    """
    unit = lambda b: any(b % (batch_devices * k) == 0 for k in counts)
    below = next((b for b in range(global_batch - 1, 0, -1) if unit(b)), None)
    above = next(b for b in range(global_batch + 1, global_batch + batch_devices * max(counts) + 1) if unit(b))
    return below, above
