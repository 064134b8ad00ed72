"""Typed, validated configuration of a ZeRO train step: :class:`ZeroConfig`."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from zerojax.config.groups import (
    AUTO,
    FLAT,
    GROUPS,
    Axes,
    Collectives,
    ContextParallel,
    LossScaling,
    Offload,
    Pipeline,
    StateDtypes,
    check_bool,
    check_int,
    dtype_name,
)
from zerojax.remat.policy import resolve as resolve_remat

STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class _InitSignature:
    """The signature of a class whose ``__new__`` only checks keywords: its ``__init__``'s
    (``inspect.signature`` would otherwise report ``__new__``'s ``*args, **kwargs``)."""

    def __get__(self, obj: Any, owner: type) -> inspect.Signature:
        sig = inspect.signature(owner.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=None)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How a train step shards model state and in which precision it computes.

    The knobs of every run are fields; the rest sit in groups named after the DeepSpeed
    section each stands for (:mod:`zerojax.config.groups`), given as the group's class or as
    a dict of its fields: ``zj.ZeroConfig(stage=2, offload={"optimizer": True})``.

    Fields:
      stage: 0 (plain data parallelism), 1 (optimizer state sharded), 2 (optimizer
        state and gradients sharded) or 3 (optimizer state, gradients and parameters
        sharded; parameters are gathered where each layer uses them).
      compute_dtype: "float32", "bfloat16" or "float16" for forward and backward; the
        optimizer always computes on fp32 master weights (stored in fp32 unless
        ``state_dtypes.masters="bfloat16"``). Floating batch leaves are cast to it
        too (as DeepSpeed's engine does); integer ones are not.
      grad_clip: clip by the global norm over all shards, after unscaling (None: off).
      grad_accum_steps: micro-batches per optimizer step, inside one compiled step.
      remat: a rematerialization policy (a name of :mod:`zerojax.remat` or a
        ``zj.remat.Remat``) applied to every layer loop (``scan``) of the loss, one layer
        per remat region, with no change to the model. Unrolled layers opt in with
        ``zj.remat.nnx_module`` / ``zj.remat.linen_module`` (``zj.nnx`` steps do it for
        blocks held in an ``nnx.List``); a loss with neither gets a ``RematNotApplied``
        warning.
      prefetch: stage 3: gather this many layers ahead of their use, so that a gather
        overlaps the compute of the layers before it (0: each layer is gathered when it is
        reached). A ``scan`` over stacked layers then recomputes each layer's forward in
        backward, as ``remat="full"`` does (see :mod:`zerojax.sharding.prefetch`).
      frozen_dtype: the dtype frozen parameters (``init_state(..., trainable=...)``) are
        stored in. "compute" (the default): the compute dtype where it is narrower than
        theirs (a bf16 run keeps a frozen fp32 base in bf16, half the bytes; forward only
        reads it in bf16, but ``gather_params`` and exports then hold the bf16 rounding).
        "param": their own dtype, exactly as given.
      donate: let the train step reuse the buffers of the state it is given.

    Groups:
      loss_scaling: :class:`~zerojax.config.LossScaling`, float16's loss scaling
        (DeepSpeed's ``fp16`` section).
      offload: :class:`~zerojax.config.Offload`, host memory (ZeRO-Offload).
      collectives: :class:`~zerojax.config.Collectives`, the gradient reduction's dtype and
        ZeRO++'s int8 collectives.
      axes: :class:`~zerojax.config.Axes`, the mesh's axis names and a model's own names.
      context: :class:`~zerojax.config.ContextParallel`, the sequence layout over the context axis.
      pipeline: :class:`~zerojax.config.Pipeline`, micro-batches and schedule over the pipeline axis.
      state_dtypes: :class:`~zerojax.config.StateDtypes`, bf16 storage of the optimizer state
        and the masters (opt-in; DeepSpeed's ``bf16_optimizer_states``).

    One spelling: a group's fields are given and read through the group
    (``offload={"optimizer": True}``, ``config.offload.optimizer``). A keyword or attribute
    spelt the flat way of before the groups (``offload_optimizer=True``,
    ``config.offload_optimizer``; the table is :data:`zerojax.config.groups.FLAT`) is refused
    with the grouped form to write instead.

    Example:
      >>> import zerojax as zj
      >>> cfg = zj.ZeroConfig(stage=2, compute_dtype="float16", offload={"optimizer": True})
      >>> cfg.offload.optimizer, cfg.resolved_loss_scale
      (True, 'dynamic')
      >>> cfg.code()
      "zj.ZeroConfig(stage=2, compute_dtype='float16', offload=zj.config.Offload(optimizer=True))"
      >>> import dataclasses
      >>> dataclasses.replace(zj.ZeroConfig(), compute_dtype="float16").resolved_loss_scale
      'dynamic'
      >>> zj.ZeroConfig(stage=4)
      Traceback (most recent call last):
      ...
      ValueError: ZeroConfig.stage must be one of (0, 1, 2, 3), got 4. ...
      >>> zj.ZeroConfig(offload_optimizer=True)
      Traceback (most recent call last):
      ...
      TypeError: ZeroConfig has no keyword 'offload_optimizer'; it is offload.optimizer: ZeroConfig(offload={'optimizer': True}). ...
    """

    stage: int = 3
    _: dataclasses.KW_ONLY
    compute_dtype: Any = "float32"
    grad_clip: float | None = None
    grad_accum_steps: int = 1
    remat: Any = None
    prefetch: int = 0
    frozen_dtype: str = "compute"
    donate: bool = True
    loss_scaling: LossScaling = LossScaling()
    offload: Offload = Offload()
    collectives: Collectives = Collectives()
    axes: Axes = Axes()
    context: ContextParallel = ContextParallel()
    pipeline: Pipeline = Pipeline()
    state_dtypes: StateDtypes = StateDtypes()

    __signature__ = _InitSignature()

    def __new__(cls, *args: Any, **kwargs: Any) -> ZeroConfig:
        """Refuses a keyword that is not a field, naming the grouped form (the generated
        ``__init__``, which ``dataclasses.replace`` calls too, then runs as usual)."""
        unknown = [k for k in kwargs if k not in _FIELDS]
        if unknown:
            raise TypeError(_unknown_keywords(unknown, kwargs))
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name that is not an attribute: a group's field read the flat
        way (``config.offload_optimizer``) is refused with its grouped name."""
        if name in _GROUPED:
            group, field = _GROUPED[name]
            raise AttributeError(
                f"ZeroConfig has no attribute {name!r}; it is {group}.{field}: read config.{group}.{field}."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(
                f"ZeroConfig.stage must be one of {STAGES}, got {self.stage!r}. "
                "Use 0 for plain data parallelism, 1 to shard optimizer state, 2 to also "
                "shard gradients, 3 to also shard parameters."
            )
        for name, cls in GROUPS.items():
            set_(name, _as_group(name, cls, getattr(self, name)))
        set_("compute_dtype", dtype_name(self.compute_dtype, "ZeroConfig.compute_dtype", COMPUTE_DTYPES))
        set_("remat", resolve_remat(self.remat))
        check_bool("ZeroConfig", self, "donate")
        check_int("ZeroConfig", self, "grad_accum_steps", "prefetch")
        if self.grad_accum_steps < 1:
            raise ValueError(
                f"ZeroConfig.grad_accum_steps must be >= 1 (1 = no accumulation), got {self.grad_accum_steps}."
            )
        if self.grad_clip is not None and not (
            isinstance(self.grad_clip, (int, float)) and not isinstance(self.grad_clip, bool) and self.grad_clip > 0
        ):
            raise ValueError(f"ZeroConfig.grad_clip must be a positive number or None, got {self.grad_clip!r}.")
        if self.frozen_dtype not in ("compute", "param"):
            raise ValueError(
                f"ZeroConfig.frozen_dtype must be 'compute' (frozen parameters stored in the compute "
                f"dtype where narrower) or 'param' (in their own dtype), got {self.frozen_dtype!r}."
            )
        if self.prefetch < 0:
            raise ValueError(f"ZeroConfig.prefetch must be >= 0 (layers gathered ahead; 0: none), got {self.prefetch}.")
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        """The rules that tie a group to the stage or the compute dtype."""
        _warn_unused_scaling(self)
        ls = self.loss_scaling.loss_scale
        if ls is not None and ls != AUTO and self.compute_dtype != "float16":
            raise ValueError(
                f"ZeroConfig.loss_scaling.loss_scale={ls!r} cannot apply with compute_dtype="
                f"{self.compute_dtype!r}: loss scaling exists for float16's narrow exponent range. Use "
                "compute_dtype='float16', or loss_scale=None (bfloat16 has fp32's range; use "
                "skip_nonfinite=True to skip non-finite steps)."
            )
        if self.offload.optimizer and self.stage == 0:
            raise ValueError(
                "ZeroConfig.offload.optimizer needs a sharded optimizer state: use "
                "stage 1, 2 or 3 (stage 0 replicates it on every device)."
            )
        if self.offload.params and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload.params keeps stage 3's sharded parameters in host "
                f"memory; stage {self.stage} keeps a replicated copy on every device. Use stage=3."
            )
        if self.collectives.gather_dtype is not None and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.collectives.gather_dtype='int8' quantizes stage 3's weight "
                f"gathers; stage {self.stage} gathers none per use. Use stage=3."
            )
        if self.collectives.reduce_dtype == "int8" and self.stage == 0:
            raise ValueError(
                "ZeroConfig.collectives.reduce_dtype='int8' quantizes the gradient "
                "reduce-scatter of stages 1–3 (ZeRO++'s qgZ); stage 0 all-reduces full gradients. Use "
                "stage=1, 2 or 3, or a float reduce_dtype."
            )
        if self.prefetch and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.prefetch={self.prefetch} gathers stage 3's weights ahead of their use; stage "
                f"{self.stage} gathers none per use. Use stage=3, or prefetch=0."
            )
        masters = self.state_dtypes.masters
        if masters != "float32" and self.stage == 0:
            raise ValueError(
                f"ZeroConfig.state_dtypes.masters={masters!r} stores the sharded masters of stages 1–3; "
                "stage 0's masters are the replicated parameters. Use stage=1, 2 or 3, or masters='float32'."
            )
        if masters != "float32" and self.compute_dtype != masters:
            raise ValueError(
                f"ZeroConfig.state_dtypes.masters={masters!r} needs compute_dtype={masters!r} (forward then "
                f"reads the stored values as they are), got compute_dtype={self.compute_dtype!r}. Use "
                f"compute_dtype={masters!r}, or masters='float32'."
            )
        if self.prefetch and self.offload.params:
            raise ValueError(
                f"ZeroConfig.prefetch={self.prefetch} with offload.params=True is not supported: the "
                f"prefetched scan gathers device shards, and offloaded ones are in host memory. "
                f"Use prefetch=0 with offloaded parameters, or keep the parameters on the device."
            )

    def code(self) -> str:
        """The shortest grouped ``zj.ZeroConfig(...)`` call that builds this config: the stage,
        then each field and group field that differs from the defaults.

        Example:
          >>> import zerojax as zj
          >>> zj.ZeroConfig(grad_accum_steps=4, remat="full", collectives={"reduce_dtype": "int8"}).code()
          "zj.ZeroConfig(stage=3, grad_accum_steps=4, remat='full', collectives=zj.config.Collectives(reduce_dtype='int8'))"
        """
        default = _DEFAULT
        parts = [f"stage={self.stage}"]
        for f in dataclasses.fields(self):
            value, base = getattr(self, f.name), getattr(default, f.name)
            if f.name == "stage" or value == base:
                continue
            if f.name in GROUPS:
                parts.append(f"{f.name}={_group_code(value, base)}")
            elif f.name == "remat":  # a name where that says it all, else the policy itself
                parts.append(f"remat={value.kind!r}" if not value.names else f"remat=zj.remat.{value!r}")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"zj.ZeroConfig({', '.join(parts)})"

    def __repr__(self) -> str:
        """:meth:`code`: only what differs from the defaults, as code that builds it."""
        return self.code()

    def differences(self, other: ZeroConfig) -> str:
        """The fields where ``self`` and ``other`` differ, ``name: self's -> other's``
        (``"none"`` when they are equal).

        Example:
          >>> import zerojax as zj
          >>> zj.ZeroConfig(stage=2).differences(zj.ZeroConfig(stage=3, remat="full"))
          "stage: 2 -> 3; remat: 'none' -> 'full'"
        """
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a == b:
                continue
            if f.name in GROUPS:
                out += [
                    f"{f.name}.{g.name}: {getattr(a, g.name)!r} -> {getattr(b, g.name)!r}"
                    for g in dataclasses.fields(a)
                    if getattr(a, g.name) != getattr(b, g.name)
                ]
            elif f.name == "remat" and not (a.names or b.names):
                out.append(f"remat: {a.kind!r} -> {b.kind!r}")
            else:
                out.append(f"{f.name}: {a!r} -> {b!r}")
        return "; ".join(out) or "none"

    @property
    def reduce_block(self) -> int | None:
        """Elements per int8 block of the gradient reduction; None when it is not int8."""
        c = self.collectives
        return c.reduce_block_size if c.reduce_dtype == "int8" else None

    @property
    def quant_block(self) -> int | None:
        """Elements per int8 block of stage 3's weight gathers; None without quantization."""
        c = self.collectives
        return c.gather_block_size if c.gather_dtype == "int8" else None

    @property
    def resolved_loss_scale(self) -> str | float | None:
        """The loss scaling in effect: ``"dynamic"``, a static scale, or ``None`` (none).

        ``"auto"`` resolves here, where it is read, from the current ``compute_dtype``."""
        ls = self.loss_scaling.loss_scale
        if isinstance(ls, str) and ls == AUTO:
            return "dynamic" if self.compute_dtype == "float16" else None
        return ls

    @property
    def dynamic_scaling(self) -> bool:
        return self.resolved_loss_scale == "dynamic"

    @property
    def scaling(self) -> bool:
        return self.resolved_loss_scale is not None

    @property
    def checks_finite(self) -> bool:
        """Whether non-finite gradients skip the step."""
        return self.scaling or self.loss_scaling.skip_nonfinite

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a narrower dtype than the fp32 masters."""
        return self.compute_dtype != "float32"


_FIELDS = frozenset(f.name for f in dataclasses.fields(ZeroConfig))
# Each name that is a group's field, not ZeroConfig's, -> (group, field): the flat keywords of
# before the groups (groups.FLAT) and the groups' own field names given at the top level.
# A name two groups share (offload.optimizer, state_dtypes.optimizer) names the first group's.
_GROUPED: dict[str, tuple[str, str]] = {
    **{
        f.name: (g, f.name)
        for g, cls in reversed(GROUPS.items())
        for f in dataclasses.fields(cls)
        if f.name not in _FIELDS
    },
    **FLAT,
}


def _group_code(value: Any, base: Any = None) -> str:
    """``zj.config.<Group>(...)`` with the fields that differ from ``base`` (a group of the
    default config), or from the class's own defaults; a group inside a group (``Offload``'s
    ``NVMe``) is written the same way, so the whole call evaluates."""
    inner = []
    for g in dataclasses.fields(value):
        v = getattr(value, g.name)
        default = getattr(base, g.name) if base is not None else g.default
        if g.default is not dataclasses.MISSING or base is not None:
            if v == default:
                continue
        inner.append(f"{g.name}={_group_code(v) if dataclasses.is_dataclass(v) else repr(v)}")
    return f"zj.config.{type(value).__name__}({', '.join(inner)})"


def _unknown_keywords(unknown: list[str], kwargs: Mapping[str, Any]) -> str:
    """The message for keywords of ``ZeroConfig(...)`` that are not its fields: the grouped
    call that sets the group fields among them, else a close match for the first name."""
    flat = [k for k in unknown if k in _GROUPED]
    if not flat:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(_FIELDS | set(_GROUPED)), n=1)
        if close and close[0] in _GROUPED:
            group, field = _GROUPED[close[0]]
            return f"ZeroConfig has no keyword {key!r}; did you mean {group}.{field} ({group}={{{field!r}: ...}})?"
        if close:
            return f"ZeroConfig has no keyword {key!r}; did you mean {close[0]!r}?"
        return f"ZeroConfig has no keyword {key!r}; its fields are {sorted(_FIELDS)}."
    grouped: dict[str, dict[str, Any]] = {}
    for key in flat:
        group, field = _GROUPED[key]
        grouped.setdefault(group, {})[field] = kwargs[key]
    names = ", ".join(repr(k) for k in flat)
    paths = ", ".join(".".join(_GROUPED[k]) for k in flat)
    call = ", ".join(f"{g}={fields!r}" for g, fields in grouped.items())
    group, fields = next(iter(grouped.items()))
    keep = ", ".join(f"{f}={v!r}" for f, v in fields.items())
    return (
        f"ZeroConfig has no keyword{'s' if len(flat) > 1 else ''} {names}; "
        f"{'they are' if len(flat) > 1 else 'it is'} {paths}: ZeroConfig({call}). "
        f"(In dataclasses.replace, {group}=dataclasses.replace(config.{group}, {keep}) keeps the group's other fields.)"
    )


def _as_group(name: str, cls: type, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise TypeError(f"ZeroConfig.{name} has no field(s) {unknown}; {cls.__name__}'s fields are {fields}.")
        return cls(**value)
    raise TypeError(
        f"ZeroConfig.{name} must be a zj.config.{cls.__name__} or a dict of its fields, got {type(value).__name__}."
    )


_said_unused_scaling = False
# The float16 loss-scaling knobs: settings with no effect where no loss scaling runs.
_SCALING_KNOBS = (
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "raise_at_min_scale",
)


def _warn_unused_scaling(config: ZeroConfig) -> None:
    """Warns once when float16's dynamic loss-scaling knobs are set where no dynamic
    scaling runs (bf16 or fp32 compute, or a static or no scale): they would do nothing."""
    global _said_unused_scaling
    if _said_unused_scaling or config.dynamic_scaling:
        return
    base = LossScaling()
    set_ = [k for k in _SCALING_KNOBS if getattr(config.loss_scaling, k) != getattr(base, k)]
    if not set_:
        return
    _said_unused_scaling = True
    why = (
        f"compute_dtype={config.compute_dtype!r} runs no loss scaling"
        if config.compute_dtype != "float16"
        else f"loss_scale={config.loss_scaling.loss_scale!r} is not dynamic"
    )
    warnings.warn(
        f"ZeroConfig.loss_scaling sets {', '.join(set_)}, float16's dynamic loss-scaling settings, but {why}: "
        "they do nothing. Drop them, or use compute_dtype='float16' (said once).",
        UserWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The stack level of the first frame outside this module and ``dataclasses``."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_code.co_filename in (__file__, dataclasses.__file__):
        frame, level = frame.f_back, level + 1
    return level - 1


_DEFAULT = ZeroConfig()
