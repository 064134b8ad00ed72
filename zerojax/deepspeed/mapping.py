"""A DeepSpeed config translated: :func:`translate` maps its ``zero_optimization``,
precision, gradient and activation sections onto :class:`ZeroConfig`, with the
optimizer and scheduler sections as optax, into a :class:`Translation`;
:func:`from_deepspeed` returns the config and warns."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from zerojax.config import ZeroConfig
from zerojax.deepspeed import monitor_section
from zerojax.deepspeed.auto import _resolve_auto
from zerojax.deepspeed.keys import OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS, ZERO_KEYS, check_keys
from zerojax.deepspeed.monitor_section import STEPS_PER_PRINT_DEFAULT, MonitorSpec
from zerojax.deepspeed.optimizer_section import _optimizer_lr, _parse_optimizer
from zerojax.deepspeed.reasons import REASONS
from zerojax.deepspeed.scheduler import _Schedule, _scheduler
from zerojax.deepspeed.values import _flag, _number, _section

DEFAULT_GRAD_CLIP = 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT since PR #8068 (0.0 before)

_COMM_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfp16": "bfloat16",
    "bfloat16": "bfloat16",
}

_FP16_MAPPED = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)
_BF16_MAPPED = ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states")
_ZERO_MAPPED = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "sub_group_size",
    "cpu_offload",
    "cpu_offload_param",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
    "zero_hpz_partition_size",
)


@dataclasses.dataclass(frozen=True)
class Translation:
    """A DeepSpeed config in zerojax terms.

    Attributes:
      config: the :class:`ZeroConfig`.
      unmapped: each DeepSpeed key (``"section.key"``) not mapped, with the reason.
      notes: choices made where the DeepSpeed config is silent or maps only in part
        (the ``gradient_clipping`` default, NVMe offload mapped to host memory).
      optimizer: the optax equivalent of the ``optimizer`` section, with the ``scheduler``
        section as its learning rate, as code (None if absent or not translated).
      shard_size: devices per replica group for hybrid sharding (``mics_shard_size`` or
        ``zero_hpz_partition_size``), or None: the state is sharded over every device. It is
        a property of the mesh: see :meth:`mesh_code`.
      resolved: each ``"auto"`` value filled in, as ``(key, value, source)``: ``source`` is
        ``"given"``, ``"given (TrainingArguments.x)"``, ``"HF Trainer default
        (TrainingArguments.x = v)"`` or how the Hugging Face Trainer derives it.
      tx: the optax ``GradientTransformation`` that :attr:`optimizer` prints (None when
        :attr:`optimizer` is None).
      schedule: the ``scheduler`` section as an optax schedule, as code (None if absent or
        not translated); it is already the learning rate of :attr:`optimizer` and :attr:`tx`.
      context: devices of the context axis (``sequence_parallel_size``, DeepSpeed-Ulysses),
        or None: a property of the mesh, as :attr:`shard_size` is (see :meth:`mesh_code`).
      expert: devices of the expert axis (AutoEP's ``expert_parallel.autoep_size``), or None.
      tensor: devices of the tensor axis (AutoTP's ``tensor_parallel.autotp_size``), or None.
      pipeline: pipeline stages (the ``PipelineModule``'s ``num_stages``, or the ``pipeline``
        section's ``stages``), or None.
      monitor: the logging keys (``steps_per_print``, ``tensorboard``, ``wandb``,
        ``csv_monitor``, ``wall_clock_breakdown``, ``flops_profiler``) as a
        :class:`zerojax.monitor.Monitor` to build: ``monitor.code()`` prints it,
        ``monitor.build(tokens_per_step=...)`` makes it.
    """

    config: ZeroConfig
    unmapped: dict[str, str]
    notes: tuple[str, ...] = ()
    optimizer: str | None = None
    shard_size: int | None = None
    resolved: tuple[tuple[str, Any, str], ...] = ()
    tx: Any = None
    schedule: str | None = None
    context: int | None = None
    expert: int | None = None
    tensor: int | None = None
    pipeline: int | None = None
    monitor: MonitorSpec = MonitorSpec((("Console", (("every", STEPS_PER_PRINT_DEFAULT),)),))

    def _mesh_kwargs(self) -> dict[str, int]:
        kw = {}
        if self.pipeline is not None:
            kw["pipeline"] = self.pipeline
        if self.shard_size is not None:
            kw["group_size"] = self.shard_size
        if self.context is not None:
            kw["context"] = self.context
        if self.expert is not None:
            kw["expert"] = self.expert
        if self.tensor is not None:
            kw["tensor"] = self.tensor
        return kw

    def mesh_code(self) -> str:
        """The mesh to build: ``zj.make_mesh()``; with replica groups of ``shard_size``
        devices ``zj.make_mesh(group_size=shard_size)``, which refuses a size that does not
        divide the devices, as DeepSpeed does and as :meth:`make_mesh` does; with
        ``sequence_parallel_size`` ``context=C`` (the context axis); with AutoEP's
        ``expert_parallel.autoep_size`` ``expert=E`` (the expert axis); with AutoTP's
        ``tensor_parallel.autotp_size`` ``tensor=T`` (the tensor axis); with pipeline stages
        ``pipeline=P`` (the pipeline axis, outermost)."""
        return "zj.make_mesh(" + ", ".join(f"{k}={v}" for k, v in self._mesh_kwargs().items()) + ")"

    def make_mesh(self, devices: Any = None) -> Any:
        """The mesh :meth:`mesh_code` describes, on ``devices`` (default: all), refused as
        DeepSpeed refuses it when ``shard_size`` does not divide the number of devices."""
        from zerojax.sharding.mesh import make_mesh

        try:
            return make_mesh(devices, **self._mesh_kwargs())
        except ValueError as e:
            if self.shard_size is None:
                raise
            raise ValueError(
                f"the DeepSpeed config shards over groups of {self.shard_size} devices "
                f"(mics_shard_size / zero_hpz_partition_size): {e}"
            ) from None

    def code(self) -> str:
        """``zj.ZeroConfig(...)`` with the fields that differ from zerojax's defaults (``config.code()``)."""
        return self.config.code()

    def message(self) -> str:
        """The warning: every unmapped key with its reason, the ``"auto"`` values filled in
        with their sources, then the notes."""
        lines = [f"  {k}: {why}" for k, why in self.unmapped.items()]
        text = ""
        if lines:
            text += f"{len(lines)} DeepSpeed key(s) not mapped to ZeroConfig:\n" + "\n".join(lines)
        if self.resolved:
            text += (
                ("\n" if text else "")
                + f'{len(self.resolved)} "auto" value(s) filled in:\n'
                + "\n".join(f"  {k} = {v!r}: {source}" for k, v, source in self.resolved)
            )
        if self.notes:
            text += ("\n" if text else "") + "Notes:\n" + "\n".join(f"  {n}" for n in self.notes)
        return text


def _load(source: Any) -> dict:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):

        def no_duplicates(pairs):
            keys = [k for k, _ in pairs]
            dup = sorted({k for k in keys if keys.count(k) > 1})
            if dup:
                raise ValueError(
                    f"DeepSpeed config {os.fspath(source)!r} repeats the key(s) {dup}; DeepSpeed refuses "
                    "duplicate keys too. Keep one of each."
                )
            return dict(pairs)

        try:
            with open(source) as f:
                return json.load(f, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {os.fspath(source)!r} is not valid JSON: {e}") from None
    raise TypeError(f"from_deepspeed takes a path to a DeepSpeed JSON config or a dict, got {type(source).__name__}.")


def _offload_device(section: Any, key: str, notes: list[str]) -> bool:
    if not isinstance(section, Mapping):
        raise ValueError(f'DeepSpeed key {key!r} must be an object like {{"device": "cpu"}}, got {section!r}.')
    check_keys(section, OFFLOAD_PARAM_KEYS if key.endswith("offload_param") else OFFLOAD_OPTIMIZER_KEYS, key)
    device = section.get("device", "none")
    if device not in ("cpu", "nvme", "none", None):
        raise ValueError(f"DeepSpeed key '{key}.device' must be 'cpu', 'nvme' or 'none', got {device!r}.")
    if device == "nvme" and key.endswith("offload_param"):
        notes.append(
            f"{key}.device 'nvme' is mapped to host memory (zerojax's NVMe tier holds the optimizer state, "
            "not the parameters)."
        )
    return device in ("cpu", "nvme")


# offload_optimizer's keys the NVMe tier reads (the rest are listed as unmapped, with reasons).
_NVME_MAPPED = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "ratio")
# The aio section's keys: those the tier's plain-thread I/O has a meaning for, and why the rest are refused.
_AIO_REFUSED = {
    "block_size": "chunks are read and written whole, one shard per call",
    "queue_depth": "the I/O threads (NVMe.buffer_count) keep that many requests in flight",
    "single_submit": "there is no libaio submission queue",
    "use_gds": "no GPUDirect Storage: chunks pass through host buffers",
    "intra_op_parallelism": "NVMe.buffer_count threads move the chunks",
    "thread_count": "NVMe.buffer_count threads move the chunks",
}


def _nvme(section: Mapping, aio: Any, notes: list[str]) -> dict:
    """The NVMe tier (``Offload.nvme``) of an ``offload_optimizer`` section with device "nvme"."""
    key = "zero_optimization.offload_optimizer"
    if "nvme_path" not in section:
        raise ValueError(
            f"DeepSpeed key '{key}.device' is 'nvme' but '{key}.nvme_path' is not set: give the directory."
        )
    for sub in ("pipeline_read", "pipeline_write"):
        if sub in section and not _flag(section[sub], f"{key}.{sub}"):
            notes.append(f"{key}.{sub}=false: the NVMe tier always overlaps its reads and writes with the update.")
    nvme = {"path": section["nvme_path"]}
    if "buffer_count" in section:
        nvme["buffer_count"] = _number(section["buffer_count"], f"{key}.buffer_count", integer=True, minimum=2)
    if "pin_memory" in section:
        nvme["pin_memory"] = _flag(section["pin_memory"], f"{key}.pin_memory")
    if aio is not None:
        if not isinstance(aio, Mapping):
            raise ValueError(f"DeepSpeed key 'aio' must be an object, got {aio!r}.")
        refused = [k for k in aio if k != "overlap_events"]
        if refused:
            raise ValueError(
                "DeepSpeed's 'aio' keys "
                + ", ".join(f"'aio.{k}' ({_AIO_REFUSED.get(k, 'not a key of the aio section')})" for k in refused)
                + " have no meaning for zerojax's NVMe tier, which reads and writes with plain threads; remove them."
            )
        if "overlap_events" in aio and not _flag(aio["overlap_events"], "aio.overlap_events"):
            notes.append("aio.overlap_events=false: the NVMe tier always overlaps its I/O with the update.")
    return nvme


def translate(source: Any, *, auto: Mapping[str, Any] | None = None, pipeline_stages: int | None = None) -> Translation:
    """Reads a DeepSpeed config (path or dict) into a :class:`Translation`; raises
    ``ValueError`` for a config DeepSpeed would refuse or that contradicts itself.

    ``"auto"`` values (the Hugging Face Trainer's placeholders) are filled in as the
    Trainer fills them: from ``auto``, by key (``{"optimizer.params.lr": 3e-4}``) or by the
    ``TrainingArguments`` field the Trainer maps to the key (``learning_rate``,
    ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``, ``weight_decay``, ``warmup_steps``,
    ``warmup_ratio``, ``max_steps``, ``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``max_grad_norm``, ``fp16``, ``bf16``, ``world_size``,
    ``hidden_size``), else from the field's default (:data:`HF_DEFAULTS`).
    ``pipeline_stages``: the ``PipelineModule``'s ``num_stages`` (DeepSpeed reads it from the
    model, not the JSON): with more than one, ``gradient_accumulation_steps`` are the
    pipeline's micro-batches (its engine runs that many through the stages per step),
    mapped to ``ZeroConfig.pipeline.microbatches`` (see :func:`_pipeline`).
    :attr:`Translation.resolved` lists each value with its source. The keys zerojax reads
    that have no default (``scheduler.params.total_num_steps``, which the Trainer computes
    from the dataset) are named together in one ``ValueError``; so are ``auto`` entries that
    match no ``"auto"`` key and values that contradict the config.

    Example:
      >>> from zerojax.deepspeed import translate
      >>> t = translate({"zero_optimization": {"stage": 2, "overlap_comm": True},
      ...                "bf16": {"enabled": True}, "gradient_clipping": 1.0})
      >>> t.code()
      "zj.ZeroConfig(stage=2, compute_dtype='bfloat16', grad_clip=1.0)"
      >>> t.unmapped
      {'zero_optimization.overlap_comm': 'no equivalent: XLA schedules and fuses the collectives'}
      >>> t = translate({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      ...                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
      ...                              "warmup_num_steps": 100, "warmup_max_lr": "auto"}}},
      ...               auto={"learning_rate": 3e-4, "max_steps": 1000})
      >>> for key, value, source in t.resolved:
      ...     print(key, value, source)
      gradient_clipping 1.0 HF Trainer default (TrainingArguments.max_grad_norm = 1.0)
      optimizer.params.lr 0.0003 given (TrainingArguments.learning_rate)
      scheduler.params.total_num_steps 1000 given (TrainingArguments.max_steps)
      scheduler.params.warmup_max_lr 0.0003 given (TrainingArguments.learning_rate)
      >>> t.optimizer
      "optax.adamw(learning_rate=zj.optim.schedules.warmup_decay_lr(total_num_steps=1000, warmup_min_lr=0.0, \
warmup_max_lr=0.0003, warmup_num_steps=100, warmup_type='log'), b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.0)"
    """
    unmapped: dict[str, str] = {}
    notes: list[str] = []
    # ZeroConfig's own fields, and its groups filled from the DeepSpeed sections they stand for.
    kw: dict[str, Any] = {}
    fp16_kw: dict[str, Any] = {}  # the fp16 section: LossScaling
    offload: dict[str, Any] = {}  # offload_optimizer, offload_param, sub_group_size: Offload
    collectives: dict[str, Any] = {}  # communication_data_type, ZeRO++'s quantization: Collectives
    state_dtypes: dict[str, Any] = {}  # bf16's bf16_master_weights_and_grads, bf16_optimizer_states: StateDtypes
    ds, resolved = _resolve_auto(_load(source), auto, notes)

    # ZeRO stage and offload.
    zero = ds.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's old form: true means stage 1
        zero = {"stage": 1 if zero else 0}
    if not isinstance(zero, Mapping):
        raise ValueError(f"DeepSpeed key 'zero_optimization' must be an object, got {zero!r}.")
    check_keys(zero, ZERO_KEYS, "zero_optimization")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed key 'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage!r}.")
    kw["stage"] = int(stage)
    offload_opt = False
    for legacy, current in (
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
        ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
    ):
        if legacy in zero and (current in zero or current.replace("stage3_", "") in zero):
            raise ValueError(
                f"DeepSpeed config sets both 'zero_optimization.{legacy}' (the legacy name) and "
                f"'zero_optimization.{current}'; DeepSpeed refuses both together. Keep {current!r}."
            )
    if "offload_optimizer" in zero:
        offload_opt = _offload_device(zero["offload_optimizer"], "zero_optimization.offload_optimizer", notes)
    if "cpu_offload" in zero:  # DeepSpeed's legacy key for offload_optimizer {"device": "cpu"}
        offload_opt = _flag(zero["cpu_offload"], "zero_optimization.cpu_offload")
    offload_par = False
    if "offload_param" in zero:
        offload_par = _offload_device(zero["offload_param"], "zero_optimization.offload_param", notes)
    if "cpu_offload_param" in zero:  # DeepSpeed's legacy key for offload_param {"device": "cpu"}
        offload_par = _flag(zero["cpu_offload_param"], "zero_optimization.cpu_offload_param")
    if offload_opt and stage == 0:
        raise ValueError(
            "DeepSpeed key 'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3, but the stage is 0."
        )
    if offload_par and stage != 3:
        raise ValueError(
            f"DeepSpeed key 'zero_optimization.offload_param' needs ZeRO stage 3, but the stage is {stage}."
        )
    if offload_opt:
        offload["optimizer"] = True
    opt_section = zero.get("offload_optimizer")
    on_nvme = isinstance(opt_section, Mapping) and opt_section.get("device") == "nvme"
    if on_nvme:
        offload["nvme"] = _nvme(opt_section, ds.get("aio"), notes)
    if offload_opt and isinstance(opt_section, Mapping) and "ratio" in opt_section:
        ratio = _number(opt_section["ratio"], "zero_optimization.offload_optimizer.ratio", minimum=0)
        if not 0 < ratio <= 1:
            raise ValueError(
                f"DeepSpeed key 'zero_optimization.offload_optimizer.ratio' must be in (0, 1], got {ratio!r}."
            )
        if ratio < 1 and stage != 3:
            raise ValueError(
                f"DeepSpeed key 'zero_optimization.offload_optimizer.ratio' is {ratio!r} at ZeRO stage {stage}: "
                "DeepSpeed refuses a partial offload below stage 3 ('Partial offloading only supported for ZeRO "
                "Stage 3'). Use stage 3, or remove 'ratio' (zerojax's Offload(ratio=...) itself works at stages 1-3)."
            )
        offload["ratio"] = float(ratio)
    if offload_par:
        offload["params"] = True
    if "zero_quantized_weights" in zero and _flag(
        zero["zero_quantized_weights"], "zero_optimization.zero_quantized_weights"
    ):
        if stage != 3:
            raise ValueError(
                f"DeepSpeed key 'zero_optimization.zero_quantized_weights' quantizes ZeRO-3's weight "
                f"gathers, but the stage is {stage}."
            )
        collectives["gather_dtype"] = "int8"
    if (
        "zero_quantized_gradients" in zero
        and _flag(zero["zero_quantized_gradients"], "zero_optimization.zero_quantized_gradients")
        and stage != 3
    ):
        unmapped["zero_optimization.zero_quantized_gradients"] = (
            f"DeepSpeed quantizes gradients at ZeRO stage 3 only and ignores it at stage {stage}, so gradients stay "
            f"as they are; zerojax's reduce_dtype='int8' works at stages 1-3 if you want it"
        )
    elif "zero_quantized_gradients" in zero and _flag(
        zero["zero_quantized_gradients"], "zero_optimization.zero_quantized_gradients"
    ):
        if "communication_data_type" in ds and ds["communication_data_type"] is not None:
            notes.append(
                f"zero_quantized_gradients moves gradients as int8 (reduce_dtype='int8'); "
                f"communication_data_type={ds['communication_data_type']!r} does not apply to them."
            )
        collectives["reduce_dtype"] = "int8"
    shard_size = _shard_size(zero, notes, kw["stage"], unmapped)
    if "sub_group_size" in zero:
        offload["group_size"] = _number(
            zero["sub_group_size"], "zero_optimization.sub_group_size", integer=True, minimum=1
        )
    prefetch = _prefetch(zero, kw["stage"], offload_par, notes, unmapped)
    if prefetch is not None:
        kw["prefetch"] = prefetch
    for key, value in zero.items():
        if key in _ZERO_MAPPED or key in _PREFETCH_KEYS:
            if key in ("offload_optimizer", "offload_param") and isinstance(value, Mapping):
                for sub in value:
                    mapped = on_nvme and sub in _NVME_MAPPED or (offload_opt and sub == "ratio")
                    if sub != "device" and not (key == "offload_optimizer" and mapped):
                        path = f"zero_optimization.{key}.{sub}"
                        unmapped[path] = REASONS.get(path, "no equivalent")
            continue
        path = f"zero_optimization.{key}"
        unmapped[path] = REASONS.get(path, "no equivalent in zerojax")

    # Precision.
    fp16 = _section(ds, "fp16")
    bf16 = _section(ds, "bf16" if "bf16" in ds else "bfloat16")  # DeepSpeed reads "bf16" when both are given
    if "bf16" in ds and "bfloat16" in ds:
        unmapped["bfloat16"] = "DeepSpeed reads the 'bf16' section when both are given; this one is ignored"
    fp16_on = _flag(fp16.get("enabled", False), "fp16.enabled")
    bf16_on = _flag(bf16.get("enabled", False), "bf16.enabled")
    if fp16_on and bf16_on:
        raise ValueError("DeepSpeed config enables both fp16 and bf16; enable one (DeepSpeed refuses both too).")
    if fp16_on:
        kw["compute_dtype"] = "float16"
        scale = _number(fp16.get("loss_scale", 0), "fp16.loss_scale", minimum=0)
        if scale:
            fp16_kw["loss_scale"] = float(scale)
        for key, field, integer, minimum, strict in (
            ("initial_scale_power", "initial_scale_power", True, 0, False),
            ("loss_scale_window", "loss_scale_window", True, 0, True),
            ("hysteresis", "hysteresis", True, 1, False),
            ("min_loss_scale", "min_loss_scale", False, 0, True),
        ):
            if key in fp16:
                fp16_kw[field] = _number(fp16[key], f"fp16.{key}", integer=integer, minimum=minimum, strict=strict)
        if "min_loss_scale" in fp16_kw:
            fp16_kw["min_loss_scale"] = float(fp16_kw["min_loss_scale"])
        if "consecutive_hysteresis" in fp16:
            fp16_kw["consecutive_hysteresis"] = _flag(fp16["consecutive_hysteresis"], "fp16.consecutive_hysteresis")
    elif bf16_on:
        kw["compute_dtype"] = "bfloat16"
        state_dtypes.update(_bf16_state(bf16, notes))
    for name, section, on in (("fp16", fp16, fp16_on), ("bf16", bf16, bf16_on)):
        for key in section:
            if key == "enabled" or (on and key in {"fp16": _FP16_MAPPED, "bf16": _BF16_MAPPED}[name]):
                continue
            path = f"{name}.{key}"
            unmapped[path] = (
                REASONS.get(path, "no equivalent") if on else f"{name} is not enabled (DeepSpeed ignores it too)"
            )

    # Gradients.
    _allreduce_op(ds)
    if "gradient_clipping" in ds:
        clip = _number(ds["gradient_clipping"], "gradient_clipping", minimum=0)
        if clip:
            kw["grad_clip"] = float(clip)
    else:
        kw["grad_clip"] = DEFAULT_GRAD_CLIP
        notes.append(
            "gradient_clipping is absent: DeepSpeed's default is 1.0 since PR #8068 (2026-06-23), 0.0 (off) "
            "before; zerojax follows the current default, grad_clip=1.0. Set gradient_clipping to say which."
        )
    if "gradient_accumulation_steps" in ds:
        kw["grad_accum_steps"] = _number(
            ds["gradient_accumulation_steps"], "gradient_accumulation_steps", integer=True, minimum=1
        )
    if "communication_data_type" in ds and ds["communication_data_type"] is not None:
        name = ds["communication_data_type"]
        if name not in _COMM_DTYPES:
            raise ValueError(
                f"DeepSpeed key 'communication_data_type' must be one of {sorted(_COMM_DTYPES)}, got {name!r}."
            )
        if collectives.get("reduce_dtype") != "int8":  # zero_quantized_gradients wins (noted above)
            collectives["reduce_dtype"] = _COMM_DTYPES[name]
    elif "compute_dtype" in kw and collectives.get("reduce_dtype") != "int8":
        notes.append(
            f"communication_data_type is absent: DeepSpeed then reduces gradients in the compute dtype "
            f"({kw['compute_dtype']}); zerojax keeps reduce_dtype='float32' (exact sums, twice the bytes "
            f"of a {kw['compute_dtype']} reduction). Set communication_data_type to "
            f"'{'bf16' if kw['compute_dtype'] == 'bfloat16' else 'fp16'}' to reduce as DeepSpeed does."
        )
    batch = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu")]
    if all(isinstance(b, int) and not isinstance(b, bool) for b in batch):
        accum = kw.get("grad_accum_steps", 1)
        if "gradient_accumulation_steps" not in ds and batch[0] > batch[1]:
            notes.append(
                f"gradient_accumulation_steps is absent: DeepSpeed derives it from train_batch_size "
                f"{batch[0]} / (train_micro_batch_size_per_gpu {batch[1]} x devices); zerojax keeps "
                "grad_accum_steps=1 (the same gradients from one larger micro-batch; set it to bound "
                "activation memory)."
            )
        if batch[0] % (batch[1] * accum):
            raise ValueError(
                f"DeepSpeed config: train_batch_size {batch[0]} is not train_micro_batch_size_per_gpu "
                f"{batch[1]} x gradient_accumulation_steps {accum} x a number of devices."
            )

    # Activations.
    ac = ds.get("activation_checkpointing")
    if ac is not None:
        if not isinstance(ac, Mapping):
            raise ValueError(f"DeepSpeed key 'activation_checkpointing' must be an object, got {ac!r}.")
        kw["remat"] = "full"
        notes.append(
            "activation_checkpointing is mapped to remat='full': every layer of a scanned stack is "
            "recomputed in backward (DeepSpeed recomputes what the model wraps in its checkpoint call)."
        )
        for key in ac:
            path = f"activation_checkpointing.{key}"
            unmapped[path] = REASONS.get(path, "no equivalent")

    # DeepSpeed-Ulysses: sequence_parallel_size devices share each sequence (the context axis).
    context = None
    if "sequence_parallel_size" in ds:
        sp = _number(ds["sequence_parallel_size"], "sequence_parallel_size", integer=True, minimum=1)
        if sp > 1:
            context = sp
            notes.append(
                f"sequence_parallel_size={sp} is the context axis: build the mesh with "
                f"zj.make_mesh(context={sp}) (each sequence split over {sp} devices, ZeRO over data x "
                f"context as DeepSpeed-Ulysses shards over the data and sequence groups together); the model's "
                f"attention runs Ulysses with zj.nn.dot_product_attention (method='ulysses')."
            )

    # AutoEP: {"expert_parallel": {"enabled": true, "autoep_size": E, "expert_tensor_parallel_size": 1}}.
    expert = _expert_parallel(ds.get("expert_parallel"), notes, unmapped)
    # AutoTP: {"tensor_parallel": {"autotp_size": T}} splits the linear layers over T devices (the tensor axis).
    tensor = _tensor_parallel(ds.get("tensor_parallel"), notes, unmapped)

    # Pipeline: the stage count comes from the model (PipelineModule(num_stages=P)).
    pipeline = _pipeline(ds.get("pipeline"), pipeline_stages, kw, notes, unmapped)

    # Everything else at the top level.
    handled = {
        "pipeline",
        "zero_optimization",
        "fp16",
        "bf16",
        "bfloat16",
        "gradient_clipping",
        "gradient_accumulation_steps",
        "communication_data_type",
        "activation_checkpointing",
        "optimizer",
        "scheduler",
        "sequence_parallel_size",
        "expert_parallel",
        "tensor_parallel",
        "gradient_allreduce_op",
        *monitor_section.KEYS,
    }
    if on_nvme:
        handled.add("aio")
    for key in ds:
        if key not in handled:
            unmapped[key] = REASONS.get(key, "unknown to this mapping (not a DeepSpeed key zerojax knows)")

    # Optimizer, with the scheduler as its learning rate.
    opt = None
    if "optimizer" in ds:
        opt, why = _parse_optimizer(ds["optimizer"])
        if why:
            unmapped["optimizer"] = why
    sched = _Schedule()
    if "scheduler" in ds:
        sched = _scheduler(
            ds["scheduler"], _optimizer_lr(ds.get("optimizer")), None if opt is None else opt.has_betas, notes
        )
        if sched.why:
            unmapped["scheduler"] = sched.why
    tx = None if opt is None else opt.expr(sched.lr, sched.momentum)
    monitor = monitor_section.parse(ds, unmapped, notes)
    try:
        config = ZeroConfig(
            **kw, loss_scaling=fp16_kw, offload=offload, collectives=collectives, state_dtypes=state_dtypes
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"the DeepSpeed config maps to an invalid ZeroConfig: {e}") from None
    return Translation(
        config,
        unmapped,
        tuple(notes),
        None if tx is None else tx.code(),
        shard_size,
        resolved,
        None if tx is None else tx.build(),
        None if sched.lr is None else sched.lr.code(),
        context,
        expert,
        tensor,
        pipeline,
        monitor,
    )


_PIPELINE_REASONS = {
    "seed_layers": "no equivalent: a scanned stack's layers are initialised by the model, not per stage",
    "pipe_partitioned": "no equivalent: the activation between two stages moves whole (DeepSpeed splits it over "
    "the tensor group)",
    "grad_partitioned": "no equivalent: the activation gradient between two stages moves whole",
    "activation_checkpoint_interval": "set ZeroConfig(remat=...): a remat policy applies to every layer of each stage",
}


def _bf16_state(bf16: Mapping, notes: list[str]) -> dict[str, Any]:
    """``StateDtypes`` fields from the bf16 section's ``bf16_master_weights_and_grads`` and
    ``bf16_optimizer_states`` (DeepSpeed PR #7700): bf16 masters round to nearest, as DeepSpeed's do."""
    masters = _flag(bf16.get("bf16_master_weights_and_grads", False), "bf16.bf16_master_weights_and_grads")
    opt = _flag(bf16.get("bf16_optimizer_states", False), "bf16.bf16_optimizer_states")
    if opt and not masters:
        raise ValueError(
            "DeepSpeed config sets bf16.bf16_optimizer_states without bf16.bf16_master_weights_and_grads, which "
            "DeepSpeed refuses. Set both, or, for bf16 moments with fp32 masters (which zerojax runs), "
            "ZeroConfig(state_dtypes={'optimizer': 'bfloat16'})."
        )
    out: dict[str, Any] = {}
    if masters:
        out["masters"] = "bfloat16"
        notes.append(
            "bf16.bf16_master_weights_and_grads: the masters are stored in bf16 and round to nearest as DeepSpeed's "
            "do (state_dtypes.masters='bfloat16'); the update computes in fp32, and at stages 2-3 the reduced "
            "gradient shard is bf16 too. StateDtypes(rounding='stochastic') keeps the trajectory closer to fp32 "
            "(docs/state_dtypes.md)."
        )
    if opt:
        out["optimizer"] = "bfloat16"
    return out


def _pipeline(section: Any, stages: int | None, kw: dict, notes: list[str], unmapped: dict[str, str]) -> int | None:
    """DeepSpeed's pipeline: the stage count (``pipeline_stages``, or the section's
    ``stages``: they must agree), ``gradient_accumulation_steps`` as the micro-batches, the
    ``partition`` method (zerojax splits the scanned stack by layers: ``uniform``, and
    ``parameters``/``best`` on a stack whose layers are alike); other keys named."""
    if section is not None and not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed key 'pipeline' must be an object, got {section!r}.")
    present = section is not None
    section = dict(section or {})
    given = section.pop("stages", "auto")
    if given != "auto":
        given = _number(given, "pipeline.stages", integer=True, minimum=1)
        if stages is not None and stages != given:
            raise ValueError(
                f"pipeline.stages={given} in the DeepSpeed config and pipeline_stages={stages} disagree; give one."
            )
        stages = given
    if stages is not None:
        stages = _number(stages, "pipeline_stages", integer=True, minimum=1)
    if stages is None or stages == 1:
        if present:
            unmapped["pipeline"] = (
                "no stage count: give the PipelineModule's num_stages, zj.from_deepspeed(config, pipeline_stages=P)"
                if stages is None
                else "one pipeline stage: nothing to split"
            )
        return None
    micro = kw.pop("grad_accum_steps", 1)
    kw["pipeline"] = {"microbatches": micro}
    notes.append(
        f"{stages} pipeline stages: build the mesh with zj.make_mesh(pipeline={stages}); "
        f"gradient_accumulation_steps={micro} are the pipeline's micro-batches "
        f"(ZeroConfig(pipeline={{'microbatches': {micro}}}), grad_accum_steps=1), as DeepSpeed's pipeline engine "
        "runs them through the stages each step."
        + (
            f" DeepSpeed's pipeline engine refuses ZeRO stage {kw.get('stage')}; zerojax shards each stage's "
            "layers over its data devices (docs/pipeline.md)."
            if kw.get("stage", 0) >= 2
            else ""
        )
    )
    partition = section.pop("partition", "best")
    if partition not in ("uniform", "parameters", "best"):
        unmapped["pipeline.partition"] = (
            f"{partition!r}: zerojax splits the scanned layer stack into equal numbers of layers per stage"
        )
    elif partition != "uniform":
        notes.append(
            f"pipeline.partition={partition!r}: zerojax gives each stage the same number of layers of the scanned "
            "stack, which balances parameters too (a scanned stack's layers are alike)."
        )
    for key in section:
        unmapped[f"pipeline.{key}"] = _PIPELINE_REASONS.get(key, "unknown to this mapping")
    return stages


_PREFETCH_KEYS = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")


def _prefetch(
    zero: Mapping, stage: int, offload_params: bool, notes: list[str], unmapped: dict[str, str]
) -> int | None:
    """``ZeroConfig.prefetch`` for DeepSpeed's ``stage3_prefetch_bucket_size`` (elements
    fetched ahead of use; 0 turns prefetching off), or None where the config does not set it
    or it does not apply. zerojax prefetches whole layers: a positive size is one layer
    ahead. ``"auto"`` (the HF Trainer's ``0.9 * hidden_size**2``, always positive) is too."""
    given = [k for k in _PREFETCH_KEYS if k in zero]
    if len(given) > 1:
        raise ValueError(
            "DeepSpeed config sets both 'zero_optimization.stage3_prefetch_bucket_size' and its other name "
            "'prefetch_bucket_size'; keep one."
        )
    if not given:
        return None
    key = given[0]
    path = f"zero_optimization.{key}"
    value = zero[key]
    if value != "auto":
        value = _number(value, path, minimum=0)
    if stage != 3:
        unmapped[path] = (
            f"DeepSpeed prefetches ZeRO-3's parameters only and ignores it at stage {stage}; so does zerojax "
            "(ZeroConfig(prefetch=1) needs stage 3)"
        )
        return None
    if value == 0:
        return 0
    if offload_params:
        unmapped[path] = (
            "zerojax's prefetch does not combine with offload_param (the prefetching scan gathers device shards, "
            "offloaded ones are in host memory): prefetch stays 0"
        )
        return None
    size = "the HF Trainer's 0.9 x hidden_size^2" if value == "auto" else f"{value:g}"
    notes.append(
        f"{key}={size} is mapped to prefetch=1: each layer of a scanned stack is gathered one layer ahead "
        f"of its use (DeepSpeed fetches up to {size} elements ahead; zerojax prefetches whole layers, "
        f"prefetch=d for d layers), and the stack is recomputed in backward as with remat='full'."
    )
    return 1


def _allreduce_op(ds: Mapping) -> None:
    """DeepSpeed's ``gradient_allreduce_op``: ``"mean"`` (its default) is what zerojax does;
    ``"sum"`` is refused with the fix, as is any other value (DeepSpeed refuses those)."""
    if "gradient_allreduce_op" not in ds:
        return
    op = ds["gradient_allreduce_op"]
    op = op.lower() if isinstance(op, str) else op
    if op == "mean":
        return
    if op == "sum":
        raise ValueError(
            "DeepSpeed key 'gradient_allreduce_op' is 'sum': zerojax averages gradients over the data "
            "devices (DeepSpeed's 'mean') and cannot sum them. Remove the key (or set 'mean'); for the "
            "summed gradient, multiply the loss by the number of data-parallel devices."
        )
    raise ValueError(f"DeepSpeed key 'gradient_allreduce_op' must be 'mean' or 'sum' (as in DeepSpeed), got {op!r}.")


def _tensor_parallel(tp: Any, notes: list[str], unmapped: dict[str, str]) -> int | None:
    """DeepSpeed AutoTP's ``tensor_parallel`` section: ``autotp_size`` devices split the
    linear layers (the tensor axis, ``zj.make_mesh(tensor=T)``); None when it is 0 or 1."""
    if tp is None:
        return None
    if not isinstance(tp, Mapping):
        raise ValueError(f"DeepSpeed key 'tensor_parallel' must be an object, got {tp!r}.")
    size = _number(tp.get("autotp_size", 0), "tensor_parallel.autotp_size", integer=True, minimum=0)
    for key in tp:
        if key != "autotp_size":
            path = f"tensor_parallel.{key}"
            unmapped[path] = REASONS.get(path, "no equivalent (zerojax reads the split from the model's annotations)")
    if size <= 1:
        return None
    notes.append(
        f"tensor_parallel.autotp_size={size} is the tensor axis: build the mesh with zj.make_mesh(tensor={size}). "
        f"AutoTP splits a Hugging Face model's linear layers by itself; zerojax splits the weights the model "
        f"annotates (nnx.with_partitioning(init, (None, 'tensor')), init_state(..., tensor_specs=...), or "
        f"zj.models' LlamaConfig(tensor_parallel=True)), and shards them with ZeRO over the data axes beside."
    )
    return size


def _expert_parallel(ep: Any, notes: list[str], unmapped: dict[str, str]) -> int | None:
    """DeepSpeed AutoEP's ``expert_parallel`` section: ``autoep_size`` devices split the
    routed experts (the expert axis); an expert tensor-parallel degree is refused."""
    if ep is None:
        return None
    if not isinstance(ep, Mapping):
        raise ValueError(f"DeepSpeed key 'expert_parallel' must be an object, got {ep!r}.")
    if not ep.get("enabled", False):
        return None
    size = _number(ep.get("autoep_size", 1), "expert_parallel.autoep_size", integer=True, minimum=1)
    etp = _number(
        ep.get("expert_tensor_parallel_size", 1), "expert_parallel.expert_tensor_parallel_size", integer=True, minimum=1
    )
    if etp != 1:
        raise ValueError(
            f"DeepSpeed key 'expert_parallel.expert_tensor_parallel_size' = {etp}: an expert split over "
            f"a tensor axis too is not supported by zerojax yet. Use 1."
        )
    for key in ep:
        if key not in ("enabled", "autoep_size", "expert_tensor_parallel_size"):
            unmapped[f"expert_parallel.{key}"] = "no equivalent (zj.nn.routed_experts takes its own arguments)"
    if size == 1:
        return None
    notes.append(
        f"expert_parallel.autoep_size={size} is the expert axis: build the mesh with zj.make_mesh(expert={size}) "
        f"(the routed experts split over {size} devices, the batch over data x expert) and annotate the "
        f"experts' stacked weights with the expert axis (docs/moe.md); DeepSpeed finds the MoE layers itself, "
        f"zerojax reads the model's annotations."
    )
    return size


def _shard_size(zero: Mapping, notes: list[str], stage: int, unmapped: dict[str, str]) -> int | None:
    """Devices per replica group from MiCS's or hpZ's key (None: off, DeepSpeed's -1 / 1).
    Both are ZeRO-3 features in DeepSpeed, which ignores them at stages 0-2: so does this
    mapping, and says so."""
    mics = _number(zero.get("mics_shard_size", -1), "zero_optimization.mics_shard_size", integer=True)
    hpz = _number(
        zero.get("zero_hpz_partition_size", 1), "zero_optimization.zero_hpz_partition_size", integer=True, minimum=1
    )
    if mics == 0 or mics < -1:
        raise ValueError(
            f"DeepSpeed key 'zero_optimization.mics_shard_size' must be -1 (off) or a positive number "
            f"of devices, got {mics}."
        )
    mics = mics if mics > 0 else None
    hpz = hpz if hpz > 1 else None
    if mics and hpz and mics != hpz:
        raise ValueError(
            f"DeepSpeed keys 'zero_optimization.mics_shard_size' ({mics}) and 'zero_hpz_partition_size' "
            f"({hpz}) ask for different shard groups; keep one."
        )
    size = mics or hpz
    if size is None:
        return None
    if stage != 3:
        for key, value in (("mics_shard_size", mics), ("zero_hpz_partition_size", hpz)):
            if value:
                unmapped[f"zero_optimization.{key}"] = (
                    f"DeepSpeed applies it at ZeRO stage 3 only and ignores it at stage {stage}; so does zerojax "
                    f"(the state is sharded over every device). Use stage 3 for {value}-device groups"
                )
        return None
    mesh = f"zj.make_mesh(group_size={size})"
    divides = f"{size} must divide the device count (DeepSpeed refuses other sizes; so does make_mesh)"
    if hpz and not mics:
        notes.append(
            f"zero_hpz_partition_size={hpz} is mapped to hybrid sharding over groups of {hpz} devices: "
            f"build the mesh with {mesh}. hpZ keeps only a secondary copy of the weights per group and "
            f"shards the optimizer state over every device; zerojax's groups hold the whole state "
            f"(12Ψ/{hpz} per device for Adam instead of 12Ψ/N) and no gather or reduce-scatter leaves a "
            f"group; {divides}."
        )
    else:
        notes.append(
            f"mics_shard_size={mics}: hybrid sharding over groups of {mics} devices, replicated across "
            f"groups. It is the mesh's: build it with {mesh}; {divides}."
        )
    return size


def from_deepspeed(
    source: Any, *, auto: Mapping[str, Any] | None = None, pipeline_stages: int | None = None
) -> ZeroConfig:
    """The :class:`ZeroConfig` of a DeepSpeed JSON config (a path or a dict): stage, fp16
    and its scaler, bf16, gradient clipping and accumulation, communication dtype, offload
    and activation checkpointing. Every key it does not map is named, with the reason, in
    one warning, with the ``"auto"`` values filled in (``auto``: see :func:`translate`);
    contradictions raise ``ValueError``. The optimizer and its schedule are
    ``translate(source).tx``.

    Example:
      >>> import zerojax as zj
      >>> zj.from_deepspeed({"zero_optimization": {"stage": 3},
      ...     "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
      ...     "gradient_clipping": 1.0}).loss_scaling.initial_scale_power
      12
    """
    t = translate(source, auto=auto, pipeline_stages=pipeline_stages)
    message = t.message()
    if message:
        warnings.warn(message, stacklevel=2)
    return t.config
