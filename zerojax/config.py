"""Typed, validated configuration of a ZeRO train step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from zerojax.remat.policy import resolve as resolve_remat

STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
REDUCE_DTYPES = ("float32", "bfloat16", "float16", "int8")
_AUTO = "auto"


def _dtype_name(value: Any, field: str, allowed: tuple[str, ...]) -> str:
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in allowed:
        raise ValueError(f"ZeroConfig.{field} must be one of {allowed}, got {value!r}.")
    return name


def _check_context_dims(dims: Any) -> Any:
    """``context_dims`` as None, an int, or a tuple of ``(batch leaf path, dims)`` with dims
    an int, a tuple of distinct ints (the first split over the context axis) or None."""

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
        f"ZeroConfig.context_dims must be None (see zerojax.context.batch), an int >= 1 (the sequence "
        f"dimension of every leaf), or {{batch leaf path: dim, (dims...) or None}} (paths as "
        f"jax.tree_util.keystr writes them, e.g. \"['tokens']\"; a [B, T, T] mask: (1, 2)); got {dims!r}."
    )


def _check_rules(rules: Any) -> tuple:
    """``axis_rules`` as a tuple of ``(logical name, mesh axis | tuple of axes | None)``."""
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    bad = ValueError(
        f"ZeroConfig.axis_rules must be a sequence of (logical name, mesh axis or None) pairs, "
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


def _check_axis_map(axis_map: Any) -> tuple:
    """``axis_map`` as a sorted tuple of ``(model mesh axis, zerojax mesh axis | None)``."""
    items = axis_map.items() if isinstance(axis_map, dict) else axis_map
    bad = ValueError(
        f"ZeroConfig.axis_map must map the model's mesh axis names to zerojax's (or None), e.g. "
        f"{{'fsdp': 'data', 'data': 'data', 'tensor': 'tensor'}}, got {axis_map!r}."
    )
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise bad from None
    if not all(len(p) == 2 and isinstance(p[0], str) and (p[1] is None or isinstance(p[1], str)) for p in pairs):
        raise bad
    return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How a train step shards model state and in which precision it computes.

    Sharding:
      stage: 0 (plain data parallelism), 1 (optimizer state sharded), 2 (optimizer
        state and gradients sharded) or 3 (optimizer state, gradients and parameters
        sharded; parameters are gathered where each layer uses them).
      axis: name of the mesh axis that the state is sharded over (and the batch split over).
      replica_axis: name of the mesh axis of replica groups, used where the mesh has it
        (``zj.make_mesh(replicas=R)``; hybrid sharding, FSDP's HSDP, ZeRO++'s hpZ): each
        group of ``N/R`` devices holds one sharded copy of the state, the batch is split
        over all N devices, gathers and reduce-scatters stay inside a group, and only
        gradient shards are all-reduced across groups (Ψ/(N/R) elements per device).
      tensor_axis: name of the mesh axis of tensor parallelism, used where the mesh has it
        (``zj.make_mesh(tensor=T)``): each parameter whose annotation names it (Flax's
        ``with_partitioning`` / ``with_logical_partitioning`` metadata, or
        ``init_state(..., tensor_specs=...)``) is split over it on that dimension, and ZeRO
        shards it over the data axes on another; the loss runs with this axis automatic,
        so XLA inserts the Megatron collectives (see :mod:`zerojax.sharding.annotations`).
      context_axis: name of the mesh axis of context parallelism, used where the mesh has
        it (``zj.make_mesh(context=C)``): each batch leaf's sequence dimension is split over
        it, and ZeRO shards the state over data x context together (every device that holds
        the same weights). The loss sees whole sequences (the axis stays automatic in the
        step, as the tensor axis does), so plain attention is partitioned by XLA and stays
        exact; ``zj.nn.dot_product_attention`` runs Ulysses or ring attention over it.
      expert_axis: name of the mesh axis of expert parallelism, used where the mesh has it
        (``zj.make_mesh(expert=E)``): the batch is split over data x expert, and each
        parameter whose annotation names it (the stacked routed experts' expert dimension,
        e.g. the logical name ``"expert"`` with ``axis_rules=(("expert", "expert"),)``) is
        split over it on that dimension (``n_experts / E`` experts per device) and ZeRO-sharded
        over the data axes on another; every other parameter is ZeRO-sharded over data x
        expert, all the devices that hold it. The axis stays automatic in the step, so a
        MoE written with plain ops is partitioned by XLA and stays exact;
        ``zj.nn.routed_experts`` dispatches tokens by all-to-all over it (docs/moe.md).
      context_layout: how each sequence is split over the context axis: ``"contiguous"``
        (device i holds positions ``[i·T/C, (i+1)·T/C)``) or ``"balanced"`` (ring
        attention's load balancing for causal attention: 2C chunks, device i holds chunks
        i and 2C-1-i, so every device does the same causal work). In the balanced layout
        the step permutes each sequence dimension of the batch into that order
        (``zj.context.Layout.order``) and the loss sees it so. The step hands the loss the
        layout (``make_train_step(..., with_layout=True)``: ``loss_fn(params, batch,
        layout=...)``), which it passes to ``zj.nn.dot_product_attention(...,
        layout=layout)`` and ``zj.nn.global_positions(T, layout)``. Before compiling, the
        step refuses a loss that mixes positions along a permuted dimension (shifted
        targets, rolls, slices, cumulative sums, positions from ``jnp.arange``) or calls
        the attention kernel with another layout, naming the line. Sequence-shaped aux
        outputs come back in that order (``Layout.inverse``).
      context_dims: which dimensions of each batch leaf are sequences (the first split
        over the context axis, all of them permuted in the balanced layout): None (see
        :mod:`zerojax.context.batch`), an int for every leaf, or ``{batch leaf path: dim,
        (dims...) or None}``.
      axis_rules: logical axis rules for models annotated with logical names (linen's
        ``nn.with_logical_partitioning``, MaxText style): ``(("mlp", "tensor"),
        ("heads", "tensor"), ("embed", None), ...)``, each logical name mapped to a mesh
        axis or None (not split). A logical name without a rule is an error. A name given
        more than once resolves as the Flax API that annotated the parameter resolves it:
        linen boxes by precedence (the first rule whose mesh axes the other dimensions
        leave free, as ``nn.logical_to_mesh_axes``), NNX Variables as a table (the last
        rule, as ``nnx.get_partition_spec`` under ``nnx.logical_axis_rules``); see
        :mod:`zerojax.sharding.logical`.
      axis_map: for a model that constrains its own values to a mesh of its own (MaxText's
        ``data``, ``fsdp``, ``tensor``, ...): each of that mesh's axis names mapped onto
        zerojax's mesh, ``{"fsdp": "data", "data": "data", "tensor": "tensor"}`` (None: not
        split). The loss is then traced outside the step's ``shard_map`` and its
        constraints translated (:mod:`zerojax.sharding.foreign`); ``axis_rules`` targets
        are mapped through it too, so MaxText's logical rules can be given as they are.
      donate: let the train step reuse the buffers of the state it is given.

    Precision (the optimizer always updates fp32 master weights):
      compute_dtype: "float32", "bfloat16" or "float16" for forward and backward. Floating
        batch leaves are cast to it too (as DeepSpeed's engine does); integer ones are not.
      reduce_dtype: dtype of the gradient collective (default float32), or "int8" at
        stages 1–3 (ZeRO++'s qgZ): each device quantizes the piece of its gradient that
        each device owns blockwise (one fp32 scale per ``reduce_quant_block_size``
        elements), an all-to-all exchanges them and the owner sums them in fp32; on a
        hybrid mesh the shard then crosses groups the same way. About a quarter of an fp32
        reduction's bytes. Loss scaling, clipping and accumulation see fp32 gradients.
      reduce_quant_block_size: elements per int8 block of an int8 gradient reduction.
      loss_scale: "dynamic", a positive float (static scale), None, or "auto" (the default:
        "dynamic" for float16, None otherwise, decided when read, so that
        ``dataclasses.replace(cfg, compute_dtype=...)`` keeps it right). Scaling bf16 or
        fp32 compute is rejected. :attr:`resolved_loss_scale` is the scaling in effect.
      initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis,
      min_loss_scale: DeepSpeed's dynamic loss-scaling knobs, with its defaults.
      raise_at_min_scale: raise when an overflow happens at the minimum scale (DeepSpeed's
        behaviour); otherwise keep skipping and report it in the metrics.
      skip_nonfinite: skip steps whose gradients are not finite (always on with scaling).

    Activations:
      remat: a rematerialization policy (a name of :mod:`zerojax.remat` or a
        ``zj.remat.Remat``) applied to every layer loop (``scan``) of the loss, one layer
        per remat region, with no change to the model. Unrolled layers opt in with
        ``zj.remat.nnx_module`` / ``zj.remat.linen_module``.

    Gradients:
      grad_clip: clip by the global norm over all shards, after unscaling (None: off).
      grad_accum_steps: micro-batches per optimizer step, inside one compiled step.

    Host memory (ZeRO-Offload; see :mod:`zerojax.optim.offload`):
      offload_optimizer: keep the optimizer state, and the fp32 masters where they are
        kept apart from what forward reads (stages 1–2 with bf16/fp16 compute), in host
        memory ("pinned_host"), sharded as on the device (stages 1–3).
      offload_params: stage 3: keep the fp32 masters (the only copy of the parameters) in
        host memory; each layer's shard moves to the device where it is gathered.
      offload_update: where the optimizer update of offloaded state runs: "host" (inside
        ``compute_on("device_host")``: only gradients go down and parameters come up),
        "device" (the state moves to the device for the update and back), or "auto" (host
        where the backend compiles the update there, device otherwise).
      offload_group_size: with the update on the device, the offloaded state streams
        there and back in groups of at most this many parameter elements (DeepSpeed's
        ``sub_group_size``); leaves whose update reads one another stay in one group.

    Frozen parameters (``init_state(..., trainable=...)``):
      frozen_dtype: the dtype they are stored in. "compute" (the default): the compute dtype
        where it is narrower than theirs (a bf16 run keeps a frozen fp32 base in bf16, half
        the bytes; forward only reads it in bf16, but ``gather_params`` and exports then
        hold the bf16 rounding, not the weights given). "param": their own dtype, exactly
        as given (cast to the compute dtype where used).

    Weight gathers (stage 3; ZeRO++'s qwZ):
      gather_dtype: None (gather in the compute dtype) or "int8": each shard is quantized
        blockwise (symmetric, one fp32 scale per block), all-gathered as int8 plus scales and
        dequantized to the compute dtype, in forward and again in backward; gradients still
        reduce-scatter in ``reduce_dtype`` and the masters stay fp32.
      quant_block_size: elements per quantization block (DeepSpeed's quantizer aims at
        groups of at most 8,000 elements, noting about 4k as best: 4096).

    Overlap (stage 3; refused at other stages, which gather nothing per use):
      prefetch: gather this many layers ahead of their use, so that a gather overlaps the
        compute of the layers before it (0: each layer is gathered when it is reached). A
        ``scan`` over stacked layers then recomputes each layer's forward in backward, as
        ``remat="full"`` does (see :mod:`zerojax.sharding.prefetch`).

    Example:
      >>> import zerojax as zj
      >>> zj.ZeroConfig(stage=3, compute_dtype="float16").resolved_loss_scale
      'dynamic'
      >>> import dataclasses
      >>> dataclasses.replace(zj.ZeroConfig(), compute_dtype="float16").resolved_loss_scale
      'dynamic'
      >>> zj.ZeroConfig(stage=4)
      Traceback (most recent call last):
      ...
      ValueError: ZeroConfig.stage must be one of (0, 1, 2, 3), got 4. ...
    """

    stage: int = 3
    axis: str = "data"
    donate: bool = True
    compute_dtype: Any = "float32"
    reduce_dtype: Any = "float32"
    loss_scale: Any = _AUTO
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min_scale: bool = True
    skip_nonfinite: bool = False
    grad_clip: float | None = None
    grad_accum_steps: int = 1
    remat: Any = None
    prefetch: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_update: str = "auto"
    offload_group_size: int = 1_000_000_000
    gather_dtype: Any = None
    quant_block_size: int = 4096
    reduce_quant_block_size: int = 4096
    replica_axis: str = "replica"
    frozen_dtype: str = "compute"
    tensor_axis: str = "tensor"
    context_axis: str = "context"
    context_dims: Any = None
    context_layout: str = "contiguous"
    axis_rules: Any = ()
    axis_map: Any = None
    expert_axis: str = "expert"

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(
                f"ZeroConfig.stage must be one of {STAGES}, got {self.stage!r}. "
                "Use 0 for plain data parallelism, 1 to shard optimizer state, 2 to also "
                "shard gradients, 3 to also shard parameters."
            )
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"ZeroConfig.axis must be a non-empty mesh axis name (str), got {self.axis!r}.")
        if not isinstance(self.replica_axis, str) or not self.replica_axis or self.replica_axis == self.axis:
            raise ValueError(
                f"ZeroConfig.replica_axis must be a mesh axis name other than axis={self.axis!r}, "
                f"got {self.replica_axis!r}."
            )
        if (
            not isinstance(self.tensor_axis, str)
            or not self.tensor_axis
            or self.tensor_axis in (self.axis, self.replica_axis)
        ):
            raise ValueError(
                f"ZeroConfig.tensor_axis must be a mesh axis name other than axis={self.axis!r} and "
                f"replica_axis={self.replica_axis!r}, got {self.tensor_axis!r}."
            )
        if (
            not isinstance(self.context_axis, str)
            or not self.context_axis
            or self.context_axis in (self.axis, self.replica_axis, self.tensor_axis)
        ):
            raise ValueError(
                f"ZeroConfig.context_axis must be a mesh axis name other than axis={self.axis!r}, "
                f"replica_axis={self.replica_axis!r} and tensor_axis={self.tensor_axis!r}, got "
                f"{self.context_axis!r}."
            )
        if (
            not isinstance(self.expert_axis, str)
            or not self.expert_axis
            or self.expert_axis in (self.axis, self.replica_axis, self.tensor_axis, self.context_axis)
        ):
            raise ValueError(
                f"ZeroConfig.expert_axis must be a mesh axis name other than axis={self.axis!r}, "
                f"replica_axis={self.replica_axis!r}, tensor_axis={self.tensor_axis!r} and "
                f"context_axis={self.context_axis!r}, got {self.expert_axis!r}."
            )
        if self.context_layout not in ("contiguous", "balanced"):
            raise ValueError(
                f"ZeroConfig.context_layout must be 'contiguous' or 'balanced' (ring attention's load "
                f"balancing for causal attention), got {self.context_layout!r}."
            )
        object.__setattr__(self, "context_dims", _check_context_dims(self.context_dims))
        object.__setattr__(self, "axis_rules", _check_rules(self.axis_rules))
        if self.axis_map is not None:
            object.__setattr__(self, "axis_map", _check_axis_map(self.axis_map))
        for name in (
            "donate",
            "consecutive_hysteresis",
            "raise_at_min_scale",
            "skip_nonfinite",
            "offload_optimizer",
            "offload_params",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ZeroConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("compute_dtype", _dtype_name(self.compute_dtype, "compute_dtype", COMPUTE_DTYPES))
        set_("reduce_dtype", _dtype_name(self.reduce_dtype, "reduce_dtype", REDUCE_DTYPES))
        self._check_loss_scale()
        set_("remat", resolve_remat(self.remat))
        for name in ("initial_scale_power", "loss_scale_window", "hysteresis", "grad_accum_steps", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ZeroConfig.{name} must be an int, got {value!r}.")
        if self.loss_scale_window <= 0:
            raise ValueError(f"ZeroConfig.loss_scale_window must be >= 1, got {self.loss_scale_window}.")
        if self.hysteresis <= 0:
            raise ValueError(f"ZeroConfig.hysteresis must be >= 1, got {self.hysteresis}.")
        if not self.min_loss_scale > 0:
            raise ValueError(f"ZeroConfig.min_loss_scale must be > 0, got {self.min_loss_scale!r}.")
        if self.initial_scale_power < 0:
            raise ValueError(f"ZeroConfig.initial_scale_power must be >= 0, got {self.initial_scale_power}.")
        if self.offload_optimizer and self.stage == 0:
            raise ValueError(
                "ZeroConfig.offload_optimizer needs a sharded optimizer state: use stage 1, 2 or 3 "
                "(stage 0 replicates it on every device)."
            )
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_params keeps stage 3's sharded parameters in host memory; "
                f"stage {self.stage} keeps a replicated copy on every device. Use stage=3."
            )
        if self.offload_update not in ("auto", "host", "device"):
            raise ValueError(
                f"ZeroConfig.offload_update must be 'auto', 'host' or 'device', got {self.offload_update!r}."
            )
        if (
            isinstance(self.offload_group_size, bool)
            or not isinstance(self.offload_group_size, int)
            or self.offload_group_size < 1
        ):
            raise ValueError(
                f"ZeroConfig.offload_group_size must be a positive int (parameter elements per "
                f"streamed group), got {self.offload_group_size!r}."
            )
        if self.gather_dtype is not None:
            if self.gather_dtype != "int8":
                raise ValueError(
                    f"ZeroConfig.gather_dtype must be None (gather in the compute dtype) or 'int8', "
                    f"got {self.gather_dtype!r}."
                )
            if self.stage != 3:
                raise ValueError(
                    f"ZeroConfig.gather_dtype='int8' quantizes stage 3's weight gathers; stage "
                    f"{self.stage} gathers none per use. Use stage=3."
                )
        for name in ("quant_block_size", "reduce_quant_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ZeroConfig.{name} must be a positive int (elements per int8 block), got {value!r}.")
        if self.reduce_dtype == "int8" and self.stage == 0:
            raise ValueError(
                "ZeroConfig.reduce_dtype='int8' quantizes the gradient reduce-scatter of stages 1–3 "
                "(ZeRO++'s qgZ); stage 0 all-reduces full gradients. Use stage=1, 2 or 3, or a "
                "float reduce_dtype."
            )
        if self.frozen_dtype not in ("compute", "param"):
            raise ValueError(
                f"ZeroConfig.frozen_dtype must be 'compute' (frozen parameters stored in the compute "
                f"dtype where narrower) or 'param' (in their own dtype), got {self.frozen_dtype!r}."
            )
        if self.prefetch < 0:
            raise ValueError(f"ZeroConfig.prefetch must be >= 0 (layers gathered ahead; 0: none), got {self.prefetch}.")
        if self.prefetch and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.prefetch={self.prefetch} gathers stage 3's weights ahead of their use; stage "
                f"{self.stage} gathers none per use. Use stage=3, or prefetch=0."
            )
        if self.prefetch and self.offload_params:
            raise ValueError(
                f"ZeroConfig.prefetch={self.prefetch} with offload_params=True is not supported: the "
                f"prefetched scan gathers device shards, and offloaded ones are in host memory. "
                f"Use prefetch=0 with offload_params, or keep the parameters on the device."
            )
        if self.grad_accum_steps < 1:
            raise ValueError(
                f"ZeroConfig.grad_accum_steps must be >= 1 (1 = no accumulation), got {self.grad_accum_steps}."
            )
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0):
            raise ValueError(f"ZeroConfig.grad_clip must be a positive number or None, got {self.grad_clip!r}.")

    def _check_loss_scale(self) -> None:
        ls = self.loss_scale
        if (isinstance(ls, str) and ls == _AUTO) or ls is None:
            return
        if self.compute_dtype != "float16":
            raise ValueError(
                f"ZeroConfig.loss_scale={ls!r} cannot apply with compute_dtype={self.compute_dtype!r}: "
                "loss scaling exists for float16's narrow exponent range. Use compute_dtype='float16', "
                "or loss_scale=None (bfloat16 has fp32's range; use skip_nonfinite=True to skip "
                "non-finite steps)."
            )
        if isinstance(ls, str):
            if ls != "dynamic":
                raise ValueError(f"ZeroConfig.loss_scale must be 'dynamic', a positive float or None, got {ls!r}.")
            return
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not ls > 0:
            raise ValueError(
                f"ZeroConfig.loss_scale must be 'dynamic', a positive float or None, got {ls!r}. "
                "(DeepSpeed's loss_scale: 0 means dynamic: write 'dynamic'.)"
            )
        object.__setattr__(self, "loss_scale", float(ls))

    @property
    def reduce_block(self) -> int | None:
        """Elements per int8 block of the gradient reduction; None when it is not int8."""
        return self.reduce_quant_block_size if self.reduce_dtype == "int8" else None

    @property
    def quant_block(self) -> int | None:
        """Elements per int8 block of stage 3's weight gathers; None without quantization."""
        return self.quant_block_size if self.gather_dtype == "int8" else None

    @property
    def resolved_loss_scale(self) -> str | float | None:
        """The loss scaling in effect: ``"dynamic"``, a static scale, or ``None`` (none).

        ``"auto"`` resolves here, where it is read, from the current ``compute_dtype``."""
        if isinstance(self.loss_scale, str) and self.loss_scale == _AUTO:
            return "dynamic" if self.compute_dtype == "float16" else None
        return self.loss_scale

    @property
    def dynamic_scaling(self) -> bool:
        return self.resolved_loss_scale == "dynamic"

    @property
    def scaling(self) -> bool:
        return self.resolved_loss_scale is not None

    @property
    def checks_finite(self) -> bool:
        """Whether non-finite gradients skip the step."""
        return self.scaling or self.skip_nonfinite

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a narrower dtype than the fp32 masters."""
        return self.compute_dtype != "float32"
