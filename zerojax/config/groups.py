"""The groups of :class:`~zerojax.ZeroConfig`: each a small frozen dataclass that validates
its own fields, named after the DeepSpeed section it stands for.

A group is given as an instance or as a dict of its fields (as DeepSpeed's JSON writes a
section); both are checked on construction, and an error names the group and the field.

Example:
  >>> from zerojax.config import Offload
  >>> Offload(optimizer=True)
  Offload(optimizer=True, params=False, update='auto', group_size=1000000000, nvme=None, ratio=1.0)
  >>> Offload(update="disk")
  Traceback (most recent call last):
  ...
  ValueError: Offload.update must be 'auto', 'host' or 'device', got 'disk'.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

REDUCE_DTYPES = ("float32", "bfloat16", "float16", "int8")
AUTO = "auto"


def dtype_name(value: Any, where: str, allowed: tuple[str, ...]) -> str:
    """``value`` as a dtype name among ``allowed``; a ``ValueError`` naming ``where`` otherwise."""
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in allowed:
        raise ValueError(f"{where} must be one of {allowed}, got {value!r}.")
    return name


def check_bool(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {getattr(obj, name)!r}.")


def check_int(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}.{name} must be an int, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Loss scaling for float16 compute: DeepSpeed's ``fp16`` section, with its names and defaults.

    Attributes:
      loss_scale: "dynamic", a positive float (static scale), None, or "auto" (the default:
        "dynamic" for float16 compute, None otherwise, decided where read, so that changing
        ``compute_dtype`` keeps it right). Scaling bf16 or fp32 compute is refused by
        :class:`~zerojax.ZeroConfig`. ``ZeroConfig.resolved_loss_scale`` is the scaling in effect.
      initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis,
      min_loss_scale: DeepSpeed's dynamic loss-scaling knobs.
      raise_at_min_scale: raise when an overflow happens at the minimum scale (DeepSpeed's
        behaviour); otherwise keep skipping and report it in the metrics.
      skip_nonfinite: skip steps whose gradients are not finite (always on with scaling;
        the way to skip them in bf16 or fp32 compute).
    """

    loss_scale: Any = AUTO
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min_scale: bool = True
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        ls = self.loss_scale
        if isinstance(ls, str):
            if ls not in (AUTO, "dynamic"):
                raise ValueError(
                    f"LossScaling.loss_scale must be 'dynamic', a positive float, None or 'auto', got {ls!r}."
                )
        elif ls is not None:
            if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not ls > 0:
                raise ValueError(
                    f"LossScaling.loss_scale must be 'dynamic', a positive float or None, got {ls!r}. "
                    "(DeepSpeed's loss_scale: 0 means dynamic: write 'dynamic'.)"
                )
            object.__setattr__(self, "loss_scale", float(ls))
        check_bool("LossScaling", self, "consecutive_hysteresis", "raise_at_min_scale", "skip_nonfinite")
        check_int("LossScaling", self, "initial_scale_power", "loss_scale_window", "hysteresis")
        if self.loss_scale_window <= 0:
            raise ValueError(f"LossScaling.loss_scale_window must be >= 1, got {self.loss_scale_window}.")
        if self.hysteresis <= 0:
            raise ValueError(f"LossScaling.hysteresis must be >= 1, got {self.hysteresis}.")
        if isinstance(self.min_loss_scale, bool) or not (
            isinstance(self.min_loss_scale, (int, float)) and self.min_loss_scale > 0
        ):
            raise ValueError(f"LossScaling.min_loss_scale must be > 0, got {self.min_loss_scale!r}.")
        if self.initial_scale_power < 0:
            raise ValueError(f"LossScaling.initial_scale_power must be >= 0, got {self.initial_scale_power}.")


@dataclasses.dataclass(frozen=True)
class NVMe:
    """The disk tier (ZeRO-Infinity): DeepSpeed's ``nvme_path``, ``buffer_count``,
    ``buffer_size`` and ``pin_memory``; see :mod:`zerojax.nvme`.

    Attributes:
      path: a directory that exists; each process keeps its shards of the optimizer state
        under ``path/process_{jax.process_index()}/``, one version per step.
      buffer_count: host buffers in flight between the disk and the update (reads ahead of
        the group updating, writes behind it); at least 2 to overlap.
      buffer_size: bytes per buffer; a chunk of state larger than one buffer is refused
        before step 1, naming the chunk and the size it needs.
      pin_memory: stage the buffers in page-locked host memory where the backend has it
        (accepted for DeepSpeed's key; on the CPU backend host memory is the device's).
    """

    path: Any
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.path, bytes) or not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise TypeError(f"NVMe.path must be a directory path (a str or os.PathLike), got {self.path!r}.")
        object.__setattr__(self, "path", os.fspath(self.path))
        check_int("NVMe", self, "buffer_count", "buffer_size")
        if self.buffer_count < 2:
            raise ValueError(
                f"NVMe.buffer_count must be at least 2 (one buffer reading while one updates), got {self.buffer_count}."
            )
        if self.buffer_size < 1:
            raise ValueError(f"NVMe.buffer_size must be a positive number of bytes, got {self.buffer_size}.")
        check_bool("NVMe", self, "pin_memory")


@dataclasses.dataclass(frozen=True)
class Offload:
    """Host memory (ZeRO-Offload): DeepSpeed's ``offload_optimizer`` and ``offload_param``
    sections with its ``sub_group_size``; see :mod:`zerojax.optim.offload`.

    Attributes:
      optimizer: keep the optimizer state, and the fp32 masters where they are kept apart
        from what forward reads (stages 1–2 with bf16/fp16 compute), in host memory
        ("pinned_host"), sharded as on the device (stages 1–3).
      params: stage 3: keep the fp32 masters (the only copy of the parameters) in host
        memory; each layer's shard moves to the device where it is gathered.
      update: where the optimizer update of offloaded state runs: "host" (inside
        ``compute_on("device_host")``: only gradients go down and parameters come up),
        "device" (the state moves to the device for the update and back), or "auto" (host
        where the backend compiles the update there, device otherwise).
      group_size: with the update on the device, the offloaded state streams there and
        back in groups of at most this many parameter elements (DeepSpeed's
        ``sub_group_size``); leaves whose update reads one another stay in one group.
      nvme: :class:`NVMe`, or None: keep the optimizer state on disk instead of in host
        memory (the masters stay where ``optimizer``/``params`` put them); each group is read,
        updated (on the device, or in host memory with ``update="host"``: DeepSpeed's CPU
        Adam on swapped state) and written back, one version per step (docs/offload.md).
      ratio: the share of the optimizer state kept in the offload tier (host memory, or disk
        with ``nvme``), in (0, 1] (DeepSpeed's ``offload_optimizer.ratio``, its Twin-Flow):
        the update's independent groups of leaves, from the last parameter back, go there
        until at least this share of the parameter elements is; the rest, with their masters,
        stay on the device and update there. Leaves whose update reads one another move together, so the share
        taken can be larger (the state's ``plan.offload_split.share``).
    """

    optimizer: bool = False
    params: bool = False
    update: str = "auto"
    group_size: int = 1_000_000_000
    nvme: NVMe | None = None
    ratio: float = 1.0

    def __post_init__(self) -> None:
        check_bool("Offload", self, "optimizer", "params")
        if isinstance(self.nvme, Mapping):
            object.__setattr__(self, "nvme", NVMe(**self.nvme))
        if self.nvme is not None and not isinstance(self.nvme, NVMe):
            raise TypeError(f"Offload.nvme must be None, a zj.config.NVMe or a dict of its fields, got {self.nvme!r}.")
        if self.nvme is not None and not self.optimizer:
            raise ValueError("Offload.nvme keeps the optimizer state on disk: set Offload(optimizer=True) with it.")
        if self.update not in ("auto", "host", "device"):
            raise ValueError(f"Offload.update must be 'auto', 'host' or 'device', got {self.update!r}.")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(
                f"Offload.group_size must be a positive int (parameter elements per streamed group), "
                f"got {self.group_size!r}."
            )
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(
                f"Offload.ratio must be a number in (0, 1] (the share of the optimizer state in host memory), "
                f"got {self.ratio!r}."
            )
        object.__setattr__(self, "ratio", float(self.ratio))
        if self.ratio < 1 and not self.optimizer:
            raise ValueError(
                f"Offload.ratio={self.ratio} splits the offloaded optimizer state between host and device, but "
                "Offload.optimizer is False: nothing is offloaded. Set Offload(optimizer=True) with it."
            )


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The dtypes of ZeRO's collectives: DeepSpeed's ``communication_data_type`` and ZeRO++'s
    quantized gradients (qgZ) and weights (qwZ).

    Attributes:
      reduce_dtype: dtype of the gradient collective (default float32), or "int8" at stages
        1–3 (qgZ): each device quantizes the piece of its gradient that each device owns
        blockwise (one fp32 scale per ``reduce_block_size`` elements), an all-to-all
        exchanges them and the owner sums them in fp32; on a hybrid mesh the shard then
        crosses groups the same way. About a quarter of an fp32 reduction's bytes. Loss
        scaling, clipping and accumulation see fp32 gradients.
      gather_dtype: stage 3's weight gathers: None (in the compute dtype) or "int8" (qwZ):
        each shard is quantized blockwise (symmetric, one fp32 scale per block),
        all-gathered as int8 plus scales and dequantized to the compute dtype, in forward
        and again in backward; the masters stay fp32.
      reduce_block_size, gather_block_size: elements per int8 block (DeepSpeed's quantizer
        aims at groups of at most 8,000 elements, noting about 4k as best: 4096).
    """

    reduce_dtype: Any = "float32"
    gather_dtype: Any = None
    reduce_block_size: int = 4096
    gather_block_size: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "reduce_dtype", dtype_name(self.reduce_dtype, "Collectives.reduce_dtype", REDUCE_DTYPES)
        )
        if self.gather_dtype is not None and self.gather_dtype != "int8":
            raise ValueError(
                f"Collectives.gather_dtype must be None (gather in the compute dtype) or 'int8', "
                f"got {self.gather_dtype!r}."
            )
        for name in ("reduce_block_size", "gather_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Collectives.{name} must be a positive int (elements per int8 block), got {value!r}.")


STATE_DTYPES = ("float32", "bfloat16")
ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class StateDtypes:
    """The storage dtypes of the optimizer state and the masters (opt-in low precision):
    DeepSpeed's ``bf16.bf16_optimizer_states`` and ``bf16.bf16_master_weights_and_grads``.

    The optimizer always computes in fp32: each step casts the stored state up, runs the
    optax update, and casts the result down to its storage dtype (see docs/state_dtypes.md).

    Attributes:
      optimizer: "float32" (default) or "bfloat16": the optax state's float32 arrays
        (Adam's moments, factored statistics) stored in bf16, half their bytes. Scalars
        (step counts, injected hyperparameters) and non-float leaves keep their dtype.
      masters: "float32" (default) or "bfloat16": the master weights of stages 1–3 stored
        in bf16 (needs ``compute_dtype="bfloat16"``: forward reads bf16 then, so the stored
        bf16 value is exactly what it reads). At stages 2–3 the reduced gradient shard is
        made in the masters' dtype, so it is bf16 too, as in DeepSpeed.
      rounding: how a new master is cast down to bf16: "nearest" (round to nearest even,
        what DeepSpeed does; updates smaller than half a bf16 ulp are lost) or "stochastic"
        (rounded up with probability equal to the remainder, so the stored value is
        unbiased: its expectation is the fp32 result). Only with ``masters="bfloat16"``.
      seed: the seed of stochastic rounding's keys: step ``s`` rounds with
        ``fold_in(key(seed), s)``, so a resumed run rounds as the uninterrupted one did.

    Example:
      >>> from zerojax.config import StateDtypes
      >>> StateDtypes(optimizer="bfloat16")
      StateDtypes(optimizer='bfloat16', masters='float32', rounding='nearest', seed=0)
      >>> StateDtypes(rounding="stochastic")
      Traceback (most recent call last):
      ...
      ValueError: StateDtypes.rounding='stochastic' rounds bf16 masters; masters='float32' rounds nothing. Set masters='bfloat16', or rounding='nearest'.
    """

    optimizer: Any = "float32"
    masters: Any = "float32"
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("optimizer", "masters"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), f"StateDtypes.{name}", STATE_DTYPES))
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"StateDtypes.rounding must be 'nearest' or 'stochastic', got {self.rounding!r}.")
        if self.rounding == "stochastic" and self.masters == "float32":
            raise ValueError(
                "StateDtypes.rounding='stochastic' rounds bf16 masters; masters='float32' rounds nothing. "
                "Set masters='bfloat16', or rounding='nearest'."
            )
        check_int("StateDtypes", self, "seed")


def _check_rules(rules: Any) -> tuple:
    """``rules`` as a tuple of ``(logical name, mesh axis | tuple of axes | None)``."""
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    bad = ValueError(
        f"Axes.rules must be a sequence of (logical name, mesh axis or None) pairs, "
        f"e.g. (('mlp', 'tensor'), ('embed', None)), got {rules!r}."
    )
    if isinstance(rules, str) or not isinstance(rules, (tuple, list)):
        raise bad
    out = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise bad
        name, target = rule
        if isinstance(target, list):
            target = tuple(target)
        ok = (
            target is None
            or isinstance(target, str)
            or (isinstance(target, tuple) and all(isinstance(t, str) for t in target))
        )
        if not ok:
            raise bad
        out.append((name, target))
    return tuple(out)


def _check_model_axes(model_axes: Any) -> tuple:
    """``model_axes`` as a sorted tuple of ``(model mesh axis, zerojax mesh axis | None)``."""
    items = model_axes.items() if isinstance(model_axes, dict) else model_axes
    bad = ValueError(
        f"Axes.model_axes must map the model's mesh axis names to zerojax's (or None), e.g. "
        f"{{'fsdp': 'data', 'data': 'data', 'tensor': 'tensor'}}, got {model_axes!r}."
    )
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise bad from None
    if not all(len(p) == 2 and isinstance(p[0], str) and (p[1] is None or isinstance(p[1], str)) for p in pairs):
        raise bad
    return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class Axes:
    """The mesh's axis names, and how a model's own axis names land on them.

    An axis is used where the mesh has it (``zj.make_mesh(replicas=R, tensor=T, context=C,
    expert=E)``); the names must differ.

    Attributes:
      data: the axis the state is sharded over (and the batch split over).
      replica: the axis of replica groups (hybrid sharding, FSDP's HSDP, ZeRO++'s hpZ):
        each group of ``N/R`` devices holds one sharded copy of the state, the batch is
        split over all N devices, gathers and reduce-scatters stay inside a group, and only
        gradient shards are all-reduced across groups (Ψ/(N/R) elements per device).
      tensor: the axis of tensor parallelism: each parameter whose annotation names it
        (Flax's ``with_partitioning`` / ``with_logical_partitioning`` metadata, or
        ``init_state(..., tensor_specs=...)``) is split over it on that dimension, and ZeRO
        shards it over the data axes on another; the loss runs with this axis automatic, so
        XLA inserts the Megatron collectives (see :mod:`zerojax.sharding.annotations`).
      context: the axis of context parallelism: each batch leaf's sequence dimension is
        split over it, and ZeRO shards the state over data x context together. The loss
        sees whole sequences (the axis stays automatic in the step), so plain attention is
        partitioned by XLA and stays exact; ``zj.nn.dot_product_attention`` runs Ulysses or
        ring attention over it (see :class:`ContextParallel` for the layout).
      expert: the axis of expert parallelism: the batch is split over data x expert, and
        each parameter whose annotation names it (the stacked routed experts' expert
        dimension) is split over it on that dimension and ZeRO-sharded over the data axes
        on another; every other parameter is ZeRO-sharded over data x expert. The axis
        stays automatic in the step; ``zj.nn.routed_experts`` dispatches tokens by
        all-to-all over it (docs/moe.md).
      pipeline: the axis of pipeline parallelism (``zj.make_mesh(pipeline=P)``, outermost):
        the layer stack the loss scans over is split into ``P`` stages along it, each
        stage's layers held by its devices and ZeRO-sharded over the data axes within
        them (see :class:`Pipeline` and docs/pipeline.md).
      rules: logical axis rules for models annotated with logical names (linen's
        ``nn.with_logical_partitioning``, MaxText style): ``(("mlp", "tensor"), ("heads",
        "tensor"), ("embed", None), ...)``, each logical name mapped to a mesh axis or None
        (not split). A logical name without a rule is an error. A name given more than once
        resolves as the Flax API that annotated the parameter resolves it: linen boxes by
        precedence (as ``nn.logical_to_mesh_axes``), NNX Variables as a table (the last
        rule, as ``nnx.get_partition_spec``); see :mod:`zerojax.sharding.logical`.
      model_axes: for a model that constrains its own values to a mesh of its own
        (MaxText's ``data``, ``fsdp``, ``tensor``, ...): each of that mesh's axis names
        mapped onto zerojax's, ``{"fsdp": "data", "data": "data", "tensor": "tensor"}``
        (None: not split). The loss is then traced outside the step's ``shard_map`` and its
        constraints translated (:mod:`zerojax.sharding.foreign`); ``rules`` targets are
        mapped through it too, so MaxText's logical rules can be given as they are.
    """

    data: str = "data"
    replica: str = "replica"
    tensor: str = "tensor"
    context: str = "context"
    expert: str = "expert"
    pipeline: str = "pipeline"
    rules: Any = ()
    model_axes: Any = None

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for name in ("data", "replica", "tensor", "context", "expert", "pipeline"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Axes.{name} must be a non-empty mesh axis name (str), got {value!r}.")
            if value in seen.values():
                taken = ", ".join(f"{k}={v!r}" for k, v in seen.items())
                raise ValueError(f"Axes.{name} must be a mesh axis name other than {taken}, got {value!r}.")
            seen[name] = value
        object.__setattr__(self, "rules", _check_rules(self.rules))
        if self.model_axes is not None:
            object.__setattr__(self, "model_axes", _check_model_axes(self.model_axes))


def _check_dims(dims: Any) -> Any:
    """``dims`` as None, an int, or a tuple of ``(batch leaf path, dims)`` with dims an int, a
    tuple of distinct ints (the first split over the context axis) or None."""

    def dim(d):
        return isinstance(d, int) and not isinstance(d, bool) and d >= 1

    if dims is None or dim(dims):
        return dims
    if isinstance(dims, Mapping) or (
        isinstance(dims, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in dims)
    ):
        pairs = tuple(dims.items()) if isinstance(dims, Mapping) else tuple(tuple(p) for p in dims)
        out = []
        for path, d in pairs:
            if isinstance(d, list):
                d = tuple(d)
            ok = (
                d is None or dim(d) or (isinstance(d, tuple) and d and all(dim(x) for x in d) and len(set(d)) == len(d))
            )
            if not isinstance(path, str) or not ok:
                break
            out.append((path, d))
        else:
            return tuple(out)
    raise ValueError(
        f"ContextParallel.dims must be None (see zerojax.context.batch), an int >= 1 (the sequence "
        f"dimension of every leaf), or {{batch leaf path: dim, (dims...) or None}} (paths as "
        f"jax.tree_util.keystr writes them, e.g. \"['tokens']\"; a [B, T, T] mask: (1, 2)); got {dims!r}."
    )


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How each batch sequence is split over the context axis (DeepSpeed-Ulysses' and ring
    attention's sequence split).

    Attributes:
      layout: the kind of the :class:`zerojax.context.Layout` the step splits by (the step
        builds ``zj.context.Layout(layout, C)``): ``"contiguous"`` (device i holds positions
        ``[i·T/C, (i+1)·T/C)``) or ``"balanced"`` (ring attention's load balancing for causal attention: 2C chunks,
        device i holds chunks i and 2C-1-i, so every device does the same causal work). In
        the balanced layout the step permutes each sequence dimension of the batch into that
        order (``zj.context.Layout.order``) and the loss sees it so. The step hands the loss
        the layout (``make_train_step(..., with_layout=True)``: ``loss_fn(params, batch,
        layout=...)``), which it passes to ``zj.nn.dot_product_attention(...,
        layout=layout)`` and ``zj.nn.global_positions(T, layout)``. Before compiling, the
        step refuses a loss that mixes positions along a permuted dimension (shifted
        targets, rolls, slices, cumulative sums, positions from ``jnp.arange``) or calls the
        attention kernel with another layout, naming the line. Sequence-shaped aux outputs
        come back in that order (``Layout.inverse``).
      dims: which dimensions of each batch leaf are sequences (the first split over the
        context axis, all of them permuted in the balanced layout): None (see
        :mod:`zerojax.context.batch`), an int for every leaf, or ``{batch leaf path: dim,
        (dims...) or None}``.
    """

    layout: str = "contiguous"
    dims: Any = None

    def __post_init__(self) -> None:
        if self.layout not in ("contiguous", "balanced"):
            raise ValueError(
                f"ContextParallel.layout must be 'contiguous' or 'balanced' (ring attention's load "
                f"balancing for causal attention), got {self.layout!r}."
            )
        object.__setattr__(self, "dims", _check_dims(self.dims))


SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over the mesh's pipeline axis (``zj.make_mesh(pipeline=P)``):
    DeepSpeed's ``pipeline`` section and ``PipelineModule(num_stages=P)``.

    The layer stack the loss runs with ``scan`` (``nnx.scan``, ``nn.scan``, ``jax.lax.scan``
    over parameters stacked ``[L, ...]``) is split into ``P`` stages of ``L / P`` layers, one
    per device of the pipeline axis, and each device's rows of the batch go through the
    stages in ``microbatches`` micro-batches (see :mod:`zerojax.pipeline`).

    Attributes:
      microbatches: micro-batches per step (``M``). The bubble, the share of stage-ticks
        that compute on padding, is ``(P - 1) / (M + P - 1)``; each device's rows must
        divide into ``M``. On a mesh without a pipeline axis it must stay 1 (use
        ``grad_accum_steps`` to take a batch in parts there).
      schedule: ``"gpipe"``: all micro-batches forward through the stages, then all backward
        (autodiff of the forward loop); ``"circular"``: each stage holds ``repeats`` blocks
        of ``L / (P·repeats)`` layers and every micro-batch goes round the stages
        ``repeats`` times (bubble ``(P - 1) / (repeats·P + P - 1)``; ``microbatches`` must
        equal ``P``).
      repeats: rounds of the circular schedule; 1 for ``"gpipe"``.
      carry_reduce: how a value the layer scan carries that is not per row but that the
        layers make depend on the batch (a mixture of experts' load-balancing loss summed
        over the layers) combines over the micro-batches: None (refused, naming the carry),
        ``"mean"`` (the micro-batches' mean, as ``grad_accum_steps`` averages a loss over
        its micro-batches) or ``"sum"`` (their sum, the carry's start counted once).
      shard_outside: ZeRO-shard the parameters outside the stack (embeddings, the head)
        over pipeline x data instead of over each stage's data devices (every stage then
        holds ``1 / (P·D)`` of their state, not ``1 / D``; their gathers and gradient
        reductions cross the pipeline axis, once per step at stage 3). Stages 1–3.
      stack: which parameters are the layer stack split over the stages: a path prefix as
        ``jax.tree_util.keystr`` writes it (``"['blocks']"``), or None: the parameters that
        the loss's layer ``scan`` iterates over, found from their shared leading dimension
        (the step checks it against the loss and names the fix where they differ).

    Example:
      >>> from zerojax.config import Pipeline
      >>> Pipeline(microbatches=4)
      Pipeline(microbatches=4, schedule='gpipe', repeats=1, carry_reduce=None, shard_outside=False, stack=None)
      >>> Pipeline(microbatches=0)
      Traceback (most recent call last):
      ...
      ValueError: Pipeline.microbatches must be >= 1 (micro-batches per step), got 0.
    """

    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    carry_reduce: str | None = None
    shard_outside: bool = False
    stack: str | None = None

    def __post_init__(self) -> None:
        check_int("Pipeline", self, "microbatches", "repeats")
        if self.microbatches < 1:
            raise ValueError(f"Pipeline.microbatches must be >= 1 (micro-batches per step), got {self.microbatches}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Pipeline.schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        if self.repeats < 1:
            raise ValueError(f"Pipeline.repeats must be >= 1 (rounds of the circular schedule), got {self.repeats}.")
        if self.repeats != 1 and self.schedule != "circular":
            raise ValueError(
                f"Pipeline.repeats={self.repeats} belongs to the circular schedule (stage repeats); give "
                f"schedule='circular' with it, or repeats=1 with schedule={self.schedule!r}."
            )
        check_bool("Pipeline", self, "shard_outside")
        if self.carry_reduce not in (None, "mean", "sum"):
            raise ValueError(f"Pipeline.carry_reduce must be None, 'mean' or 'sum', got {self.carry_reduce!r}.")
        if self.stack is not None and (not isinstance(self.stack, str) or not self.stack):
            raise TypeError(
                f"Pipeline.stack must be None or a parameter path prefix such as \"['blocks']\", got {self.stack!r}."
            )


GROUPS: dict[str, type] = {
    "loss_scaling": LossScaling,
    "offload": Offload,
    "collectives": Collectives,
    "axes": Axes,
    "context": ContextParallel,
    "pipeline": Pipeline,
    "state_dtypes": StateDtypes,
}
"""Each group's field in ``ZeroConfig`` and its class."""

FLAT: dict[str, tuple[str, str]] = {
    **{f.name: ("loss_scaling", f.name) for f in dataclasses.fields(LossScaling)},
    "offload_optimizer": ("offload", "optimizer"),
    "offload_params": ("offload", "params"),
    "offload_update": ("offload", "update"),
    "offload_group_size": ("offload", "group_size"),
    "reduce_dtype": ("collectives", "reduce_dtype"),
    "gather_dtype": ("collectives", "gather_dtype"),
    "reduce_quant_block_size": ("collectives", "reduce_block_size"),
    "quant_block_size": ("collectives", "gather_block_size"),
    "axis": ("axes", "data"),
    "replica_axis": ("axes", "replica"),
    "tensor_axis": ("axes", "tensor"),
    "context_axis": ("axes", "context"),
    "expert_axis": ("axes", "expert"),
    "axis_rules": ("axes", "rules"),
    "axis_map": ("axes", "model_axes"),
    "context_layout": ("context", "layout"),
    "context_dims": ("context", "dims"),
}
"""Each flat name of the config before the groups (``offload_optimizer``) and the group field
it became (``("offload", "optimizer")``). ``ZeroConfig`` accepts none of them, as keyword or
attribute: this table only lets its errors name the grouped form to write instead."""
