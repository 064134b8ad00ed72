"""DeepSpeed JSON configs, translated into :class:`zerojax.ZeroConfig`.

:func:`translate` reads a DeepSpeed config (a path or a dict) and returns a
:class:`Translation`: the ``ZeroConfig``, the keys it did not map with the reason for
each, and the optax equivalent of the ``optimizer`` section as code.
``zj.from_deepspeed`` returns the config and names every unmapped key in one
warning; ``zerojax from-deepspeed ds_config.json`` prints both.

What maps: ``zero_optimization.stage``, ``fp16`` (``loss_scale`` 0 is dynamic scaling,
otherwise a static scale, and DeepSpeed's scaler knobs), ``bf16.enabled``,
``gradient_clipping``, ``gradient_accumulation_steps``, ``communication_data_type``,
``zero_optimization.offload_optimizer`` / ``offload_param`` / ``sub_group_size``
(host memory; NVMe is mapped to host memory, with a note), ``zero_quantized_weights``
(int8 weight gathers), ``activation_checkpointing`` (full rematerialization of every
scanned layer stack) and hybrid sharding: ``mics_shard_size`` (MiCS: shard over groups of
that many devices, replicate across groups) and ``zero_hpz_partition_size`` (mapped, with a
note, to the same layout) give :attr:`Translation.shard_size`, which lives in the mesh,
not the config: ``zj.make_mesh(replicas=jax.device_count() // shard_size)``
(:meth:`Translation.mesh_code`, printed by the CLI and named in the warning).
``zero_quantized_gradients`` (qgZ) maps to ``reduce_dtype="int8"`` at stage 3 (DeepSpeed
ignores it at stages 1–2, and so does the mapping): its exchange is
hierarchical wherever the mesh has replica groups (inside a group, then across groups),
which is what DeepSpeed's intra-node/inter-node all-to-all does.

DeepSpeed's ``gradient_clipping`` default was 0.0 (off) until PR #8068 (merged
2026-06-23) made it 1.0, so that configs which omit it are clipped. zerojax follows the
current default, 1.0, and the warning says so whenever the key is absent: set it to say
which you mean.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from zerojax.config import ZeroConfig

DEFAULT_GRAD_CLIP = 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT since PR #8068 (0.0 before)

_COMM_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                "bf16": "bfloat16", "bfp16": "bfloat16", "bfloat16": "bfloat16"}

_XLA = "no equivalent: XLA schedules and fuses the collectives"
_LOADER = "the data loader's job: train_step takes the global batch (micro-batch x accumulation x devices) and splits it"
_LOGGING = "logging: the train step returns its metrics (experiments/train.py --log writes them)"

# Reasons for keys that are understood but not mapped (paths as "section.key").
REASONS: dict[str, str] = {
    "train_batch_size": _LOADER,
    "train_micro_batch_size_per_gpu": _LOADER,
    "steps_per_print": _LOGGING, "wall_clock_breakdown": _LOGGING, "dump_state": _LOGGING,
    "memory_breakdown": _LOGGING, "tensorboard": _LOGGING, "wandb": _LOGGING, "csv_monitor": _LOGGING,
    "comet": _LOGGING, "comms_logger": _LOGGING, "flops_profiler": _LOGGING, "timers": _LOGGING,
    "scheduler": "write the schedule with optax (optax.linear_schedule, optax.warmup_cosine_decay_schedule, ...) and "
                 "pass it as the optimizer's learning rate; DeepSpeed's WarmupLR warms up logarithmically by default",
    "prescale_gradients": "zerojax averages gradients in fp32 after the reduction (a float16 reduction divides first)",
    "gradient_predivide_factor": "zerojax averages gradients in fp32 after the reduction (a float16 reduction "
                                 "divides first)",
    "sparse_gradients": "no equivalent: gradients are dense",
    "amp": "no equivalent: set compute_dtype",
    "zero_allow_untested_optimizer": "any optax transformation works at every stage",
    "zero_force_ds_cpu_optimizer": "the offloaded update runs whatever optax transformation you give",
    "checkpoint": "zj.save_checkpoint / zj.restore_checkpoint restore onto any stage and device count",
    "load_universal_checkpoint": "zj.restore_checkpoint restores onto any stage and device count",
    "data_types": "gradients accumulate in fp32",
    "fp16.auto_cast": "zerojax always casts floating batch leaves to the compute dtype",
    "fp16.fp16_master_weights_and_grads": "the masters are always fp32",
    "bf16.immediate_grad_update": "no equivalent: gradients are reduced inside the compiled step",
    "bf16.check_grad_overflow": "set ZeroConfig(skip_nonfinite=True) to skip steps with non-finite gradients",
    "zero_optimization.overlap_comm": _XLA,
    "zero_optimization.contiguous_gradients": _XLA,
    "zero_optimization.reduce_bucket_size": _XLA,
    "zero_optimization.allgather_bucket_size": _XLA,
    "zero_optimization.allgather_partitions": _XLA,
    "zero_optimization.reduce_scatter": _XLA,
    "zero_optimization.round_robin_gradients": _XLA,
    "zero_optimization.use_multi_rank_bucket_allreduce": _XLA,
    "zero_optimization.stage3_prefetch_bucket_size": "zerojax prefetches whole layers: ZeroConfig(prefetch=1)",
    "zero_optimization.stage3_max_live_parameters": "stage 3 gathers each layer where it is used; "
                                                    "ZeroConfig(prefetch=d) bounds the layers live at once",
    "zero_optimization.stage3_max_reuse_distance": "stage 3 gathers each layer where it is used, again in backward",
    "zero_optimization.stage3_param_persistence_threshold": "every parameter is sharded, small ones too",
    "zero_optimization.stage3_model_persistence_threshold": "every parameter is sharded, small ones too",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "zerojax export --dtype bfloat16 writes the "
                                                                    "consolidated weights",
    "zero_optimization.gather_16bit_weights_on_model_save": "zerojax export --dtype bfloat16 writes the "
                                                             "consolidated weights",
    "zero_optimization.elastic_checkpoint": "zj.restore_checkpoint restores onto any device count",
    "zero_optimization.load_from_fp32_weights": "checkpoints hold the fp32 masters",
    "zero_optimization.ignore_unused_parameters": "an unused parameter gets a zero gradient",
    "zero_optimization.legacy_stage1": "no equivalent",
    "zero_optimization.memory_efficient_linear": "no equivalent",
    "zero_optimization.mics_hierarchical_params_gather": _XLA,
    "zero_optimization.zero_quantized_nontrainable_weights": "frozen parameters are gathered in the compute "
                                                             "dtype (int8 gathers cover the trained ones)",
    "zero_optimization.offload_optimizer.pin_memory": "offloaded state is always in pinned host memory",
    "zero_optimization.offload_optimizer.ratio": "all of the optimizer state is offloaded",
    "zero_optimization.offload_optimizer.buffer_count": _XLA,
    "zero_optimization.offload_optimizer.fast_init": "no equivalent",
    "zero_optimization.offload_optimizer.pipeline_read": "no NVMe offload",
    "zero_optimization.offload_optimizer.pipeline_write": "no NVMe offload",
    "zero_optimization.offload_optimizer.nvme_path": "no NVMe offload: host memory instead",
    "zero_optimization.offload_param.pin_memory": "offloaded parameters are always in pinned host memory",
    "zero_optimization.offload_param.buffer_count": _XLA,
    "zero_optimization.offload_param.buffer_size": _XLA,
    "zero_optimization.offload_param.max_in_cpu": "all of the parameters are offloaded",
    "zero_optimization.offload_param.nvme_path": "no NVMe offload: host memory instead",
    "activation_checkpointing.partition_activations": "no equivalent: no model parallelism to partition over",
    "activation_checkpointing.cpu_checkpointing": "the nearest is a host-offload policy: ZeroConfig(remat="
                                                  "'offload_dots') or zj.remat.Remat('offload_names', ...)",
    "activation_checkpointing.contiguous_memory_optimization": _XLA,
    "activation_checkpointing.number_checkpoints": "every layer of a scanned stack is one remat region",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no equivalent",
    "activation_checkpointing.profile": _LOGGING,
}
for _k in ("pipeline", "tensor_parallel", "moe", "sequence_parallel_size", "seq_parallel_communication_data_type"):
    REASONS[_k] = "no equivalent: zerojax is data parallel (ZeRO) only"
for _k in ("compression_training", "data_efficiency", "curriculum_learning", "autotuning", "elasticity", "aio",
           "nebula", "compile", "eigenvalue", "progressive_layer_drop", "quantize_training", "hybrid_engine",
           "weight_quantization", "zero_config", "communication_compression"):
    REASONS.setdefault(_k, "no equivalent in zerojax")

_FP16_MAPPED = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale")
_ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "sub_group_size", "cpu_offload",
                "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size", "zero_hpz_partition_size")


@dataclasses.dataclass(frozen=True)
class Translation:
    """A DeepSpeed config in zerojax terms.

    Attributes:
      config: the :class:`ZeroConfig`.
      unmapped: each DeepSpeed key (``"section.key"``) not mapped, with the reason.
      notes: choices made where the DeepSpeed config is silent or maps only in part
        (the ``gradient_clipping`` default, NVMe offload mapped to host memory).
      optimizer: the optax equivalent of the ``optimizer`` section, as code (None if absent).
      shard_size: devices per replica group for hybrid sharding (``mics_shard_size`` or
        ``zero_hpz_partition_size``), or None: the state is sharded over every device. It is
        a property of the mesh: see :meth:`mesh_code`.
    """

    config: ZeroConfig
    unmapped: dict[str, str]
    notes: tuple[str, ...] = ()
    optimizer: str | None = None
    shard_size: int | None = None

    def mesh_code(self) -> str:
        """The mesh to build: ``zj.make_mesh()``, or with replica groups of ``shard_size``
        devices, ``zj.make_mesh(replicas=jax.device_count() // shard_size)``."""
        if self.shard_size is None:
            return "zj.make_mesh()"
        return f"zj.make_mesh(replicas=jax.device_count() // {self.shard_size})"

    def make_mesh(self, devices: Any = None) -> Any:
        """The mesh :meth:`mesh_code` describes, on ``devices`` (default: all), refused as
        DeepSpeed refuses it when ``shard_size`` does not divide the number of devices
        (``jax.device_count() // shard_size`` would silently make larger groups)."""
        import jax

        from zerojax.sharding.mesh import make_mesh

        devices = list(jax.devices() if devices is None else devices)
        if self.shard_size is None:
            return make_mesh(devices)
        if len(devices) % self.shard_size:
            raise ValueError(
                f"the DeepSpeed config shards over groups of {self.shard_size} devices (mics_shard_size / "
                f"zero_hpz_partition_size), which do not divide the {len(devices)} devices; DeepSpeed refuses it "
                f"too. Use a group size that divides {len(devices)}, or that many devices.")
        return make_mesh(devices, replicas=len(devices) // self.shard_size)

    def code(self) -> str:
        """``zj.ZeroConfig(...)`` with the fields that differ from zerojax's defaults."""
        args, default = [], ZeroConfig()
        for f in dataclasses.fields(ZeroConfig):
            value = getattr(self.config, f.name)
            if value != getattr(default, f.name) or f.name == "stage":
                if f.name == "remat" and not value.names:
                    value = value.kind  # the policy's name is what ZeroConfig takes
                args.append(f"{f.name}={value!r}")
        return f"zj.ZeroConfig({', '.join(args)})"

    def message(self) -> str:
        """The warning: every unmapped key with its reason, then the notes."""
        lines = [f"  {k}: {why}" for k, why in self.unmapped.items()]
        text = ""
        if lines:
            text += f"{len(lines)} DeepSpeed key(s) not mapped to ZeroConfig:\n" + "\n".join(lines)
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
                raise ValueError(f"DeepSpeed config {os.fspath(source)!r} repeats the key(s) {dup}; DeepSpeed refuses "
                                 "duplicate keys too. Keep one of each.")
            return dict(pairs)

        try:
            with open(source) as f:
                return json.load(f, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {os.fspath(source)!r} is not valid JSON: {e}") from None
    raise TypeError(f"from_deepspeed takes a path to a DeepSpeed JSON config or a dict, got {type(source).__name__}.")


def _number(value: Any, key: str, *, integer: bool = False, minimum: float | None = None,
            strict: bool = False) -> Any:
    if value == "auto":
        raise ValueError(f"DeepSpeed key {key!r} is 'auto', a placeholder the Hugging Face Trainer fills in; "
                         "give its value.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed key {key!r} must be a number, got {value!r}.")
    if integer:
        if float(value) != int(value):
            raise ValueError(f"DeepSpeed key {key!r} must be a whole number, got {value!r}.")
        value = int(value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"DeepSpeed key {key!r} must be {'>' if strict else '>='} {minimum}, got {value!r}.")
    return value


def _flag(value: Any, key: str) -> bool:
    if value == "auto":
        raise ValueError(f"DeepSpeed key {key!r} is 'auto', a placeholder the Hugging Face Trainer fills in; "
                         "give true or false.")
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed key {key!r} must be true or false, got {value!r}.")
    return value


def _section(ds: dict, key: str) -> dict:
    value = ds.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object, got {value!r}.")
    return dict(value)


def _offload_device(section: Any, key: str, notes: list[str]) -> bool:
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object like {{\"device\": \"cpu\"}}, got {section!r}.")
    device = section.get("device", "none")
    if device not in ("cpu", "nvme", "none", None):
        raise ValueError(f"DeepSpeed key '{key}.device' must be 'cpu', 'nvme' or 'none', got {device!r}.")
    if device == "nvme":
        notes.append(f"{key}.device 'nvme' is mapped to host memory (zerojax has no NVMe offload).")
    return device in ("cpu", "nvme")


def translate(source: Any) -> Translation:
    """Reads a DeepSpeed config (path or dict) into a :class:`Translation`; raises
    ``ValueError`` for a config DeepSpeed would refuse or that contradicts itself.

    Example:
      >>> from zerojax.deepspeed import translate
      >>> t = translate({"zero_optimization": {"stage": 2, "overlap_comm": True},
      ...                "bf16": {"enabled": True}, "gradient_clipping": 1.0})
      >>> t.code()
      "zj.ZeroConfig(stage=2, compute_dtype='bfloat16', grad_clip=1.0)"
      >>> t.unmapped
      {'zero_optimization.overlap_comm': 'no equivalent: XLA schedules and fuses the collectives'}
    """
    ds = _load(source)
    unmapped: dict[str, str] = {}
    notes: list[str] = []
    kw: dict[str, Any] = {}

    # ZeRO stage and offload.
    zero = ds.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's old form: true means stage 1
        zero = {"stage": 1 if zero else 0}
    if not isinstance(zero, Mapping):
        raise ValueError(f"DeepSpeed key 'zero_optimization' must be an object, got {zero!r}.")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed key 'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage!r}.")
    kw["stage"] = int(stage)
    offload_opt = False
    if "offload_optimizer" in zero:
        offload_opt = _offload_device(zero["offload_optimizer"], "zero_optimization.offload_optimizer", notes)
    if "cpu_offload" in zero:  # DeepSpeed's old stage-2 key
        offload_opt = offload_opt or _flag(zero["cpu_offload"], "zero_optimization.cpu_offload")
    offload_par = False
    if "offload_param" in zero:
        offload_par = _offload_device(zero["offload_param"], "zero_optimization.offload_param", notes)
    if offload_opt and stage == 0:
        raise ValueError("DeepSpeed key 'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3, "
                         "but the stage is 0.")
    if offload_par and stage != 3:
        raise ValueError(f"DeepSpeed key 'zero_optimization.offload_param' needs ZeRO stage 3, but the stage is "
                         f"{stage}.")
    if offload_opt:
        kw["offload_optimizer"] = True
    if offload_par:
        kw["offload_params"] = True
    if "zero_quantized_weights" in zero and _flag(zero["zero_quantized_weights"],
                                                  "zero_optimization.zero_quantized_weights"):
        if stage != 3:
            raise ValueError(f"DeepSpeed key 'zero_optimization.zero_quantized_weights' quantizes ZeRO-3's weight "
                             f"gathers, but the stage is {stage}.")
        kw["gather_dtype"] = "int8"
    if "zero_quantized_gradients" in zero and _flag(zero["zero_quantized_gradients"],
                                                    "zero_optimization.zero_quantized_gradients") and stage != 3:
        unmapped["zero_optimization.zero_quantized_gradients"] = (
            f"DeepSpeed quantizes gradients at ZeRO stage 3 only and ignores it at stage {stage}, so gradients stay "
            f"as they are; zerojax's reduce_dtype='int8' works at stages 1-3 if you want it")
    elif "zero_quantized_gradients" in zero and _flag(zero["zero_quantized_gradients"],
                                                      "zero_optimization.zero_quantized_gradients"):
        if "communication_data_type" in ds and ds["communication_data_type"] is not None:
            notes.append(f"zero_quantized_gradients moves gradients as int8 (reduce_dtype='int8'); "
                         f"communication_data_type={ds['communication_data_type']!r} does not apply to them.")
        kw["reduce_dtype"] = "int8"
    shard_size = _shard_size(zero, notes, kw["stage"], unmapped)
    if "sub_group_size" in zero:
        kw["offload_group_size"] = _number(zero["sub_group_size"], "zero_optimization.sub_group_size",
                                           integer=True, minimum=1)
    for key, value in zero.items():
        if key in _ZERO_MAPPED:
            if key in ("offload_optimizer", "offload_param") and isinstance(value, Mapping):
                for sub in value:
                    if sub != "device":
                        path = f"zero_optimization.{key}.{sub}"
                        unmapped[path] = REASONS.get(path, "no equivalent")
            continue
        path = f"zero_optimization.{key}"
        unmapped[path] = REASONS.get(path, "unknown to this mapping (not a DeepSpeed key zerojax knows)")

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
            kw["loss_scale"] = float(scale)
        for key, field, integer, minimum, strict in (
                ("initial_scale_power", "initial_scale_power", True, 0, False),
                ("loss_scale_window", "loss_scale_window", True, 0, True),
                ("hysteresis", "hysteresis", True, 1, False),
                ("min_loss_scale", "min_loss_scale", False, 0, True)):
            if key in fp16:
                kw[field] = _number(fp16[key], f"fp16.{key}", integer=integer, minimum=minimum, strict=strict)
        if "min_loss_scale" in kw:
            kw["min_loss_scale"] = float(kw["min_loss_scale"])
        if "consecutive_hysteresis" in fp16:
            kw["consecutive_hysteresis"] = _flag(fp16["consecutive_hysteresis"], "fp16.consecutive_hysteresis")
    elif bf16_on:
        kw["compute_dtype"] = "bfloat16"
    for name, section, on in (("fp16", fp16, fp16_on), ("bf16", bf16, bf16_on)):
        for key in section:
            if key == "enabled" or (name == "fp16" and on and key in _FP16_MAPPED):
                continue
            path = f"{name}.{key}"
            unmapped[path] = (REASONS.get(path, "no equivalent") if on else
                              f"{name} is not enabled (DeepSpeed ignores it too)")

    # Gradients.
    if "gradient_clipping" in ds:
        clip = _number(ds["gradient_clipping"], "gradient_clipping", minimum=0)
        if clip:
            kw["grad_clip"] = float(clip)
    else:
        kw["grad_clip"] = DEFAULT_GRAD_CLIP
        notes.append("gradient_clipping is absent: DeepSpeed's default is 1.0 since PR #8068 (2026-06-23), 0.0 (off) "
                     "before; zerojax follows the current default, grad_clip=1.0. Set gradient_clipping to say which.")
    if "gradient_accumulation_steps" in ds:
        kw["grad_accum_steps"] = _number(ds["gradient_accumulation_steps"], "gradient_accumulation_steps",
                                         integer=True, minimum=1)
    if "communication_data_type" in ds and ds["communication_data_type"] is not None:
        name = ds["communication_data_type"]
        if name not in _COMM_DTYPES:
            raise ValueError(f"DeepSpeed key 'communication_data_type' must be one of {sorted(_COMM_DTYPES)}, "
                             f"got {name!r}.")
        if kw.get("reduce_dtype") != "int8":  # zero_quantized_gradients wins (noted above)
            kw["reduce_dtype"] = _COMM_DTYPES[name]
    elif "compute_dtype" in kw and kw.get("reduce_dtype") != "int8":
        notes.append(f"communication_data_type is absent: DeepSpeed then reduces gradients in the compute dtype "
                     f"({kw['compute_dtype']}); zerojax keeps reduce_dtype='float32' (exact sums, twice the bytes "
                     f"of a {kw['compute_dtype']} reduction). Set communication_data_type to "
                     f"'{'bf16' if kw['compute_dtype'] == 'bfloat16' else 'fp16'}' to reduce as DeepSpeed does.")
    batch = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu")]
    if all(isinstance(b, int) and not isinstance(b, bool) for b in batch):
        accum = kw.get("grad_accum_steps", 1)
        if "gradient_accumulation_steps" not in ds and batch[0] > batch[1]:
            notes.append(f"gradient_accumulation_steps is absent: DeepSpeed derives it from train_batch_size "
                         f"{batch[0]} / (train_micro_batch_size_per_gpu {batch[1]} x devices); zerojax keeps "
                         "grad_accum_steps=1 (the same gradients from one larger micro-batch; set it to bound "
                         "activation memory).")
        if batch[0] % (batch[1] * accum):
            raise ValueError(f"DeepSpeed config: train_batch_size {batch[0]} is not train_micro_batch_size_per_gpu "
                             f"{batch[1]} x gradient_accumulation_steps {accum} x a number of devices.")

    # Activations.
    ac = ds.get("activation_checkpointing")
    if ac is not None:
        if not isinstance(ac, Mapping):
            raise ValueError(f"DeepSpeed key 'activation_checkpointing' must be an object, got {ac!r}.")
        kw["remat"] = "full"
        notes.append("activation_checkpointing is mapped to remat='full': every layer of a scanned stack is "
                     "recomputed in backward (DeepSpeed recomputes what the model wraps in its checkpoint call).")
        for key in ac:
            path = f"activation_checkpointing.{key}"
            unmapped[path] = REASONS.get(path, "no equivalent")

    # Everything else at the top level.
    handled = {"zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping", "gradient_accumulation_steps",
               "communication_data_type", "activation_checkpointing", "optimizer"}
    for key in ds:
        if key not in handled:
            unmapped[key] = REASONS.get(key, "unknown to this mapping (not a DeepSpeed key zerojax knows)")

    optimizer = None
    if "optimizer" in ds:
        optimizer, why = optax_code(ds["optimizer"])
        if why:
            unmapped["optimizer"] = why
    try:
        config = ZeroConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the DeepSpeed config maps to an invalid ZeroConfig: {e}") from None
    return Translation(config, unmapped, tuple(notes), optimizer, shard_size)


def _shard_size(zero: Mapping, notes: list[str], stage: int, unmapped: dict[str, str]) -> int | None:
    """Devices per replica group from MiCS's or hpZ's key (None: off, DeepSpeed's -1 / 1).
    Both are ZeRO-3 features in DeepSpeed, which ignores them at stages 0-2: so does this
    mapping, and says so."""
    mics = _number(zero.get("mics_shard_size", -1), "zero_optimization.mics_shard_size", integer=True)
    hpz = _number(zero.get("zero_hpz_partition_size", 1), "zero_optimization.zero_hpz_partition_size",
                  integer=True, minimum=1)
    if mics == 0 or mics < -1:
        raise ValueError(f"DeepSpeed key 'zero_optimization.mics_shard_size' must be -1 (off) or a positive number "
                         f"of devices, got {mics}.")
    mics = mics if mics > 0 else None
    hpz = hpz if hpz > 1 else None
    if mics and hpz and mics != hpz:
        raise ValueError(f"DeepSpeed keys 'zero_optimization.mics_shard_size' ({mics}) and 'zero_hpz_partition_size' "
                         f"({hpz}) ask for different shard groups; keep one.")
    size = mics or hpz
    if size is None:
        return None
    if stage != 3:
        for key, value in (("mics_shard_size", mics), ("zero_hpz_partition_size", hpz)):
            if value:
                unmapped[f"zero_optimization.{key}"] = (
                    f"DeepSpeed applies it at ZeRO stage 3 only and ignores it at stage {stage}; so does zerojax "
                    f"(the state is sharded over every device). Use stage 3 for {value}-device groups")
        return None
    mesh = f"zj.make_mesh(replicas=jax.device_count() // {size})"
    divides = (f"{size} must divide the device count (DeepSpeed refuses other sizes; Translation.make_mesh() "
               f"checks it)")
    if hpz and not mics:
        notes.append(f"zero_hpz_partition_size={hpz} is mapped to hybrid sharding over groups of {hpz} devices: "
                     f"build the mesh with {mesh}. hpZ keeps only a secondary copy of the weights per group and "
                     f"shards the optimizer state over every device; zerojax's groups hold the whole state "
                     f"(12Ψ/{hpz} per device for Adam instead of 12Ψ/N) and no gather or reduce-scatter leaves a "
                     f"group; {divides}.")
    else:
        notes.append(f"mics_shard_size={mics}: hybrid sharding over groups of {mics} devices, replicated across "
                     f"groups. It is the mesh's: build it with {mesh}; {divides}.")
    return size


# DeepSpeed's own optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS, compared lower-cased).
_DS_OPTIMIZERS = frozenset({"adam", "adamw", "lamb", "lion", "adagrad", "onebitadam", "onebitlamb", "zerooneadam",
                            "muadam", "muadamw", "musgd", "muon"})
# torch.optim classes DeepSpeed builds by their exact names when the type is none of its own.
_TORCH_OPTIMIZERS = frozenset({"SGD", "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop",
                               "SparseAdam"})


def optax_code(section: Any) -> tuple[str | None, str | None]:
    """The optax equivalent of a DeepSpeed ``optimizer`` section, as code, or None and the
    reason. Weight decay is always written out: DeepSpeed's Adam/AdamW default to 0.0,
    ``optax.adamw`` to 1e-4."""
    if not isinstance(section, Mapping) or "type" not in section:
        return None, "the optimizer section needs a 'type'"
    name, p = section["type"], dict(section.get("params", {}))
    kind = str(name).lower()
    known = {"adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad"},
             "lamb": {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff"},
             "lion": {"lr", "betas", "weight_decay"}, "sgd": {"lr", "momentum", "nesterov", "weight_decay"}}
    # DeepSpeed reads its own optimizers' names in any case, and otherwise a torch.optim
    # class by its exact name ("SGD"); it refuses anything else ("sgd", "FusedAdam", "CPUAdam").
    if kind in _DS_OPTIMIZERS:
        family = "adam" if kind in ("adam", "adamw") else kind
    elif name in _TORCH_OPTIMIZERS:
        family = "sgd" if name == "SGD" else name
    else:
        raise ValueError(
            f"DeepSpeed key 'optimizer.type' is {name!r}, which DeepSpeed refuses: it takes its own optimizers "
            f"({', '.join(sorted(_DS_OPTIMIZERS))}, in any case) or a torch.optim class by its exact name (e.g. "
            f"'SGD'). FusedAdam and CPUAdam are what 'Adam' runs as (with or without offload): write 'Adam'.")
    if family not in known:
        return None, (f"optimizer type {name!r} has no optax equivalent written here: build the optax "
                      "transformation yourself (any works)")
    for key, value in p.items():
        if value == "auto":
            raise ValueError(f"DeepSpeed key 'optimizer.params.{key}' is 'auto', a placeholder the Hugging Face "
                             "Trainer fills in; give its value.")
    betas = p.get("betas", (0.9, 0.999))  # DeepSpeed's default for Adam, Lamb and Lion alike
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"DeepSpeed key 'optimizer.params.betas' must be two numbers, got {betas!r}.")
    lr = _number(p.get("lr", 1e-3), "optimizer.params.lr", minimum=0)
    b1, b2 = (_number(b, "optimizer.params.betas", minimum=0) for b in betas)
    eps = _number(p.get("eps", 1e-8), "optimizer.params.eps", minimum=0)
    wd = _number(p.get("weight_decay", 0.0), "optimizer.params.weight_decay", minimum=0)
    if family == "adam":
        if p.get("amsgrad"):
            return None, "AMSGrad: build optax.amsgrad yourself (with optax.add_decayed_weights for weight decay)"
        decoupled = kind != "adam" or p.get("adam_w_mode", True)  # DeepSpeed's Adam is AdamW by default
        if decoupled:
            code = f"optax.adamw(learning_rate={lr!r}, b1={b1!r}, b2={b2!r}, eps={eps!r}, weight_decay={wd!r})"
        else:
            code = (f"optax.chain(optax.add_decayed_weights({wd!r}), optax.adam(learning_rate={lr!r}, b1={b1!r}, "
                    f"b2={b2!r}, eps={eps!r}))")
    elif family == "lamb":
        code = f"optax.lamb(learning_rate={lr!r}, b1={b1!r}, b2={b2!r}, eps={eps!r}, weight_decay={wd!r})"
        bounds = (_number(p.get("min_coeff", 0.01), "optimizer.params.min_coeff", minimum=0),
                  _number(p.get("max_coeff", 10.0), "optimizer.params.max_coeff", minimum=0))
        lamb_note = (f"DeepSpeed's Lamb (FusedLamb) clips each layer's trust ratio to [min_coeff, max_coeff] = "
                     f"[{bounds[0]!r}, {bounds[1]!r}]; optax.lamb does not clip it, so layers whose ratio falls "
                     f"outside step differently: check it")
    elif family == "lion":
        code = f"optax.lion(learning_rate={lr!r}, b1={b1!r}, b2={b2!r}, weight_decay={wd!r})"
    else:
        momentum = _number(p.get("momentum", 0.0), "optimizer.params.momentum", minimum=0) or None
        code = f"optax.sgd(learning_rate={lr!r}, momentum={momentum!r}, nesterov={bool(p.get('nesterov', False))!r})"
        code = f"optax.chain(optax.add_decayed_weights({wd!r}), {code})" if wd else code
    left = sorted(set(p) - known[family])
    why = None
    if left:
        why = (f"params {left} have no counterpart in the printed optax optimizer (e.g. bias_correction, "
               "torch_adam): check it")
    if family == "lamb":
        why = lamb_note if why is None else f"{why}; {lamb_note}"
    return code, why


def from_deepspeed(source: Any) -> ZeroConfig:
    """The :class:`ZeroConfig` of a DeepSpeed JSON config (a path or a dict): stage, fp16
    and its scaler, bf16, gradient clipping and accumulation, communication dtype, offload
    and activation checkpointing. Every key it does not map is named, with the reason, in
    one warning; contradictions raise ``ValueError`` (see :func:`translate`).

    Example:
      >>> import zerojax as zj
      >>> zj.from_deepspeed({"zero_optimization": {"stage": 3},
      ...     "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
      ...     "gradient_clipping": 1.0}).initial_scale_power
      12
    """
    t = translate(source)
    message = t.message()
    if message:
        warnings.warn(message, stacklevel=2)
    return t.config
