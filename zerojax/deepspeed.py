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

The ``scheduler`` section (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
becomes the optimizer's learning rate, an optax schedule from :mod:`zerojax.optim.schedules`
that gives DeepSpeed's rate at every optimizer step; :attr:`Translation.tx` is the optax
optimizer itself. ``"auto"`` values, which the Hugging Face Trainer fills in from its
``TrainingArguments``, are filled the same way (:func:`translate`'s ``auto``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import optax

from zerojax.config import ZeroConfig
from zerojax.optim import schedules

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
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "the legacy name of stage3_gather_16bit_weights_"
                                                                   "on_model_save: zerojax export --dtype bfloat16 "
                                                                   "writes the consolidated weights",
    "zero_optimization.cpu_offload_use_pin_memory": "legacy key: offloaded state is always in pinned host memory",
    "zero_optimization.cpu_offload_params": "not a DeepSpeed key (DeepSpeed refuses unknown zero_optimization keys); "
                                            "the legacy key is cpu_offload_param, today offload_param",
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
# DeepSpeed's zero_optimization fields go by their stage3_ names or their own (populate_by_name).
for _k in ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
           "max_reuse_distance"):
    REASONS[f"zero_optimization.{_k}"] = REASONS[f"zero_optimization.stage3_{_k}"]
for _k in ("stage3_module_granularity_threshold", "module_granularity_threshold", "allgather_sequential",
           "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "stage3_allgather_sequential"):
    REASONS[f"zero_optimization.{_k}"] = _XLA
for _k in ("override_module_apply", "pipeline_loading_checkpoint"):
    REASONS[f"zero_optimization.{_k}"] = "no equivalent"
for _k in ("log_trace_cache_warnings", "enable_sanity_checks"):
    REASONS[f"zero_optimization.{_k}"] = _LOGGING
for _k in ("pipeline", "tensor_parallel", "moe", "sequence_parallel_size", "seq_parallel_communication_data_type"):
    REASONS[_k] = "no equivalent: zerojax is data parallel (ZeRO) only"
for _k in ("compression_training", "data_efficiency", "curriculum_learning", "autotuning", "elasticity", "aio",
           "nebula", "compile", "eigenvalue", "progressive_layer_drop", "quantize_training", "hybrid_engine",
           "weight_quantization", "zero_config", "communication_compression"):
    REASONS.setdefault(_k, "no equivalent in zerojax")

_FP16_MAPPED = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale")
_ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "sub_group_size", "cpu_offload", "cpu_offload_param",
                "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size", "zero_hpz_partition_size")


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
    """

    config: ZeroConfig
    unmapped: dict[str, str]
    notes: tuple[str, ...] = ()
    optimizer: str | None = None
    shard_size: int | None = None
    resolved: tuple[tuple[str, Any, str], ...] = ()
    tx: Any = None
    schedule: str | None = None

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
        """The warning: every unmapped key with its reason, the ``"auto"`` values filled in
        with their sources, then the notes."""
        lines = [f"  {k}: {why}" for k, why in self.unmapped.items()]
        text = ""
        if lines:
            text += f"{len(lines)} DeepSpeed key(s) not mapped to ZeroConfig:\n" + "\n".join(lines)
        if self.resolved:
            text += (("\n" if text else "") + f'{len(self.resolved)} "auto" value(s) filled in:\n'
                     + "\n".join(f"  {k} = {v!r}: {source}" for k, v, source in self.resolved))
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
                         "give its value (translate(..., auto={...}) fills it).")
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
                         "give true or false (translate(..., auto={...}) fills it).")
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed key {key!r} must be true or false, got {value!r}.")
    return value


def _section(ds: dict, key: str) -> dict:
    value = ds.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object, got {value!r}.")
    return dict(value)


# --- "auto" values --------------------------------------------------------------------
#
# The Hugging Face Trainer writes its TrainingArguments into a DeepSpeed config's "auto"
# values (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_
# process and trainer_config_finalize). translate(..., auto=...) fills them the same way:
# from a value given by its key, else from the TrainingArguments field the Trainer maps to
# it (given, else the field's default).

# TrainingArguments' defaults, for the fields the Trainer writes into "auto" values.
HF_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0,
    "max_grad_norm": 1.0, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "warmup_steps": 0,
    "fp16": False, "bf16": False,
}
# Names without a default the Trainer knows: world_size (devices), hidden_size (the model
# config's), max_steps (num_training_steps when > 0), warmup_ratio (of num_training_steps).
HF_NAMES = frozenset(HF_DEFAULTS) | {"world_size", "hidden_size", "max_steps", "warmup_ratio"}

# DeepSpeed keys the Trainer fills from one TrainingArguments field (and checks against it
# when the key is not "auto": the Trainer refuses a mismatch).
_HF_FIELD = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}
# Keys the Trainer derives from the model's hidden_size (trainer_config_finalize).
_HIDDEN = {
    "zero_optimization.reduce_bucket_size": ("hidden_size * hidden_size", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9 * hidden_size * hidden_size)",
                                                      lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("10 * hidden_size", lambda h: 10 * h),
}
_TOTAL_STEPS = "scheduler.params.total_num_steps"
_MISSING = object()


class _NoValue(Exception):
    """An "auto" value with no default: ``how`` says where the Trainer gets it."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


def _get(ds: Mapping, path: str, default: Any = _MISSING) -> Any:
    node: Any = ds
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _set(ds: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = ds
    for part in parents:
        node = node[part]
    node[last] = value


def _auto_paths(node: Mapping, prefix: str = "") -> list[str]:
    """Every key whose value is "auto", as a dotted path, in the config's order."""
    found = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += _auto_paths(value, f"{prefix}{key}.")
        elif isinstance(value, str) and value == "auto":
            found.append(f"{prefix}{key}")
    return found


def _unused(path: str) -> bool:
    """True for a key zerojax does not read (it, or a section above it, has a reason)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in REASONS for i in range(1, len(parts) + 1))


class _Trainer:
    """The values the Hugging Face Trainer writes into "auto" keys, from the given
    TrainingArguments fields (``given``), else their defaults."""

    def __init__(self, ds: Mapping, given: Mapping[str, Any], paths: Mapping[str, Any]):
        self.ds, self.given, self.paths = ds, given, paths

    def arg(self, name: str) -> tuple[Any, str]:
        if name in self.given:
            return self.given[name], f"given (TrainingArguments.{name})"
        if name in HF_DEFAULTS:
            return HF_DEFAULTS[name], f"HF Trainer default (TrainingArguments.{name} = {HF_DEFAULTS[name]!r})"
        raise _NoValue(f"the HF Trainer takes it from TrainingArguments.{name}, which has no default")

    def fill(self, path: str) -> tuple[Any, str]:
        if path in _HF_FIELD:
            return self.arg(_HF_FIELD[path])
        if path == "optimizer.params.betas":
            (b1, s1), (b2, s2) = self.arg("adam_beta1"), self.arg("adam_beta2")
            if s1.startswith("given") and s2.startswith("given"):
                return [b1, b2], "given (TrainingArguments.adam_beta1, adam_beta2)"
            if not (s1.startswith("given") or s2.startswith("given")):
                return [b1, b2], f"HF Trainer default (TrainingArguments.adam_beta1 = {b1!r}, adam_beta2 = {b2!r})"
            return [b1, b2], f"adam_beta1: {s1}; adam_beta2: {s2}"
        if path == "scheduler.params.warmup_min_lr":
            return 0, "HF Trainer fills 0 (not a TrainingArguments field)"
        if path in _HIDDEN:
            formula, fn = _HIDDEN[path]
            if "hidden_size" not in self.given:
                raise _NoValue("the HF Trainer derives it from the model config's hidden_size: give "
                               "auto={'hidden_size': H} or the value")
            return fn(self.given["hidden_size"]), f"HF Trainer: {formula} (hidden_size = {self.given['hidden_size']!r})"
        if path == "train_batch_size":
            return self._train_batch_size()
        if path == _TOTAL_STEPS:
            return self._total_steps()
        if path == "scheduler.params.warmup_num_steps":
            return self._warmup_steps()
        raise _NoValue("the HF Trainer does not fill this key either: give its value")

    def _explicit(self, path: str, name: str) -> tuple[Any, str]:
        """The config's value for ``path``, else the one given for it, else the Trainer's."""
        value = self.paths.get(path, _get(self.ds, path))
        if value is _MISSING or value == "auto":
            return self.arg(name)
        return value, path

    def _train_batch_size(self) -> tuple[Any, str]:
        if "world_size" not in self.given:
            raise _NoValue("the HF Trainer computes world_size x per_device_train_batch_size x "
                           "gradient_accumulation_steps: give auto={'world_size': N} or the value")
        micro, _ = self._explicit("train_micro_batch_size_per_gpu", "per_device_train_batch_size")
        accum, _ = self._explicit("gradient_accumulation_steps", "gradient_accumulation_steps")
        world = self.given["world_size"]
        return world * micro * accum, (f"HF Trainer: world_size x per_device_train_batch_size x "
                                       f"gradient_accumulation_steps = {world!r} x {micro!r} x {accum!r}")

    def _total_steps(self) -> tuple[Any, str]:
        if _positive(self.given.get("max_steps")):
            return self.given["max_steps"], "given (TrainingArguments.max_steps)"
        raise _NoValue("the HF Trainer computes it from the dataset size, epochs and batch size "
                       "(num_training_steps): give auto={'scheduler.params.total_num_steps': N} or "
                       "auto={'max_steps': N}")

    def _warmup_steps(self) -> tuple[Any, str]:
        # TrainingArguments.get_warmup_steps: warmup_steps if > 0, else ceil(warmup_ratio x num_training_steps)
        # (a warmup_steps below 1 is a ratio in recent versions).
        steps = self.given.get("warmup_steps", 0)
        ratio = self.given.get("warmup_ratio", 0)
        if isinstance(steps, float) and 0 < steps < 1:
            ratio, steps = steps, 0
        if steps or not ratio:
            return self.arg("warmup_steps")
        total = self.paths.get(_TOTAL_STEPS, _get(self.ds, _TOTAL_STEPS))
        if total is _MISSING or total == "auto":
            try:
                total, _ = self._total_steps()
            except _NoValue:
                raise _NoValue(f"the HF Trainer computes ceil(warmup_ratio {ratio!r} x num_training_steps): give "
                               "auto={'scheduler.params.total_num_steps': N} or auto={'max_steps': N} too") from None
        return math.ceil(ratio * total), f"HF Trainer: ceil(warmup_ratio {ratio!r} x total_num_steps {total!r})"


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _resolve_auto(ds: dict, auto: Mapping[str, Any] | None,
                  notes: list[str]) -> tuple[dict, tuple[tuple[str, Any, str], ...]]:
    """``ds`` with its "auto" values filled in, and what was filled (key, value, source).
    Every "auto" key zerojax reads that has no value, every ``auto`` entry that applies to
    nothing and every mismatch the Trainer would refuse are named in one ``ValueError``."""
    if auto is None:
        auto = {}
    if not isinstance(auto, Mapping):
        raise TypeError(f"auto takes a dict of values by key, e.g. {{'optimizer.params.lr': 3e-4}}, "
                        f"got {type(auto).__name__}.")
    paths = _auto_paths(ds)
    given_paths = {k: v for k, v in auto.items() if k in paths}
    given_args = {k: v for k, v in auto.items() if k not in paths and k in HF_NAMES}
    problems = [_misplaced(ds, key, paths) for key in auto if key not in paths and key not in HF_NAMES]
    problems += _mismatches(ds, given_args)
    trainer = _Trainer(ds, given_args, given_paths)
    out, resolved, missing, unresolved = copy.deepcopy(ds), [], {}, []
    for path in paths:
        try:
            value, source = (given_paths[path], "given") if path in given_paths else trainer.fill(path)
        except _NoValue as e:
            if _unused(path):
                unresolved.append((path, e.how))
            else:
                missing[path] = e.how
            continue
        _set(out, path, value)
        resolved.append((path, value, source))
    if missing or problems:
        raise ValueError(_auto_error(missing, problems))
    for how in dict.fromkeys(how for _, how in unresolved):
        keys = [path for path, h in unresolved if h == how]
        notes.append(f'{", ".join(keys)} {"is" if len(keys) == 1 else "are"} "auto" and left so, as zerojax does not '
                     f"use {'it' if len(keys) == 1 else 'them'}: {how}")
    return out, tuple(resolved)


def _misplaced(ds: Mapping, key: str, paths: list[str]) -> str:
    value = _get(ds, key)
    if value is not _MISSING:
        return (f"{key}: the config sets it to {value!r}, not \"auto\"; auto fills \"auto\" values only (edit the "
                "config to change it)")
    return (f"{key}: neither an \"auto\" key of this config ({', '.join(paths) or 'it has none'}) nor a "
            f"TrainingArguments field the HF Trainer maps ({', '.join(sorted(HF_NAMES))})")


def _mismatches(ds: Mapping, given: Mapping[str, Any]) -> list[str]:
    """Given TrainingArguments that contradict a value the config sets: the Trainer refuses
    them ("DeepSpeed config values that mismatch TrainingArguments values")."""
    pairs = [(path, name, given[name]) for path, name in _HF_FIELD.items() if name in given]
    if "adam_beta1" in given or "adam_beta2" in given:
        pairs.append(("optimizer.params.betas", "adam_beta1+adam_beta2",
                      [given.get("adam_beta1", HF_DEFAULTS["adam_beta1"]),
                       given.get("adam_beta2", HF_DEFAULTS["adam_beta2"])]))
    if _positive(given.get("max_steps")):  # max_steps <= 0 (the default -1): the Trainer counts the epochs
        pairs.append((_TOTAL_STEPS, "max_steps", given["max_steps"]))
    if _positive(given.get("warmup_steps")) and given["warmup_steps"] >= 1:  # below 1 it is a ratio
        pairs.append(("scheduler.params.warmup_num_steps", "warmup_steps", given["warmup_steps"]))
    found = []
    for path, name, value in pairs:
        current = _get(ds, path)
        if current is not _MISSING and current != "auto" and current != value:
            found.append(f"{path}: the config sets {current!r}, the given {name} is {value!r}; the HF Trainer "
                         f"refuses the mismatch too (set the key to \"auto\" or give the same value)")
    return found


def _auto_error(missing: Mapping[str, str], problems: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f'DeepSpeed config: {len(missing)} "auto" value(s) have no default; give each one:\n'
                     + "\n".join(f"  {k}: {how}" for k, how in missing.items()))
        example = ", ".join(f"{k!r}: ..." for k in missing)
        cli = " ".join(f"--set {k}=..." for k in missing)
        parts.append(f"In Python: translate(config, auto={{{example}}}); on the command line: "
                     f"zerojax from-deepspeed CONFIG {cli}")
    if problems:
        parts.append(f"{len(problems)} given value(s) do not apply:\n" + "\n".join(f"  {p}" for p in problems))
    return "\n".join(parts)


def _offload_device(section: Any, key: str, notes: list[str]) -> bool:
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed key {key!r} must be an object like {{\"device\": \"cpu\"}}, got {section!r}.")
    device = section.get("device", "none")
    if device not in ("cpu", "nvme", "none", None):
        raise ValueError(f"DeepSpeed key '{key}.device' must be 'cpu', 'nvme' or 'none', got {device!r}.")
    if device == "nvme":
        notes.append(f"{key}.device 'nvme' is mapped to host memory (zerojax has no NVMe offload).")
    return device in ("cpu", "nvme")


def translate(source: Any, *, auto: Mapping[str, Any] | None = None) -> Translation:
    """Reads a DeepSpeed config (path or dict) into a :class:`Translation`; raises
    ``ValueError`` for a config DeepSpeed would refuse or that contradicts itself.

    ``"auto"`` values (the Hugging Face Trainer's placeholders) are filled in as the
    Trainer fills them: from ``auto``, by key (``{"optimizer.params.lr": 3e-4}``) or by the
    ``TrainingArguments`` field the Trainer maps to the key (``learning_rate``,
    ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``, ``weight_decay``, ``warmup_steps``,
    ``warmup_ratio``, ``max_steps``, ``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``max_grad_norm``, ``fp16``, ``bf16``, ``world_size``,
    ``hidden_size``), else from the field's default (:data:`HF_DEFAULTS`).
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
    kw: dict[str, Any] = {}
    ds, resolved = _resolve_auto(_load(source), auto, notes)

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
    for legacy, current in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                            ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")):
        if legacy in zero and (current in zero or current.replace("stage3_", "") in zero):
            raise ValueError(f"DeepSpeed config sets both 'zero_optimization.{legacy}' (the legacy name) and "
                             f"'zero_optimization.{current}'; DeepSpeed refuses both together. Keep {current!r}.")
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
               "communication_data_type", "activation_checkpointing", "optimizer", "scheduler"}
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
        sched = _scheduler(ds["scheduler"], _optimizer_lr(ds.get("optimizer")),
                           None if opt is None else opt.has_betas, notes)
        if sched.why:
            unmapped["scheduler"] = sched.why
    tx = None if opt is None else opt.expr(sched.lr, sched.momentum)
    try:
        config = ZeroConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the DeepSpeed config maps to an invalid ZeroConfig: {e}") from None
    return Translation(config, unmapped, tuple(notes), None if tx is None else tx.code(), shard_size, resolved,
                       None if tx is None else tx.build(), None if sched.lr is None else sched.lr.code())


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


@dataclasses.dataclass(frozen=True)
class _Expr:
    """A call of optax or zerojax, as the code the translation prints and as the object
    that code builds: one description for both, so they cannot differ."""

    func: Any  # a dotted name ("optax.adamw", "zj.optim.schedules.warmup_lr") or an _Expr
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    call: bool = True

    def code(self) -> str:
        head = self.func if isinstance(self.func, str) else self.func.code()
        if not self.call:
            return head
        parts = [_code(a) for a in self.args] + [f"{k}={_code(v)}" for k, v in self.kwargs]
        return f"{head}({', '.join(parts)})"

    def build(self) -> Any:
        fn = _lookup(self.func) if isinstance(self.func, str) else self.func.build()
        if not self.call:
            return fn
        return fn(*(_built(a) for a in self.args), **{k: _built(v) for k, v in self.kwargs})


def _call(func: Any, *args: Any, **kwargs: Any) -> _Expr:
    return _Expr(func, args, tuple(kwargs.items()))


def _code(value: Any) -> str:
    return value.code() if isinstance(value, _Expr) else repr(value)


def _built(value: Any) -> Any:
    return value.build() if isinstance(value, _Expr) else value


def _lookup(name: str) -> Any:
    root, *rest = name.split(".")
    found = {"optax": optax, "zj": importlib.import_module("zerojax")}[root]
    for part in rest:
        found = getattr(found, part)
    return found


@dataclasses.dataclass(frozen=True)
class _Optimizer:
    """A DeepSpeed ``optimizer`` section, read into what its optax equivalent takes."""

    family: str  # "adamw", "adam" (L2 weight decay: adam_w_mode false), "lamb", "lion" or "sgd"
    lr: float
    b1: float
    b2: float
    eps: float
    wd: float
    momentum: float | None = None
    nesterov: bool = False

    @property
    def has_betas(self) -> bool:
        return self.family != "sgd"

    def expr(self, learning_rate: Any = None, b1: Any = None) -> _Expr:
        """The optax optimizer at ``learning_rate`` (a number or a schedule; default: the
        section's ``lr``). ``b1``, a schedule of the first beta (OneCycle's momentum), comes
        with DeepSpeed's second beta of 0.99, through ``optax.inject_hyperparams``."""
        lr = self.lr if learning_rate is None else learning_rate
        if self.family == "sgd":
            sgd = _call("optax.sgd", learning_rate=lr, momentum=self.momentum, nesterov=self.nesterov)
            return _call("optax.chain", _call("optax.add_decayed_weights", self.wd), sgd) if self.wd else sgd
        kw: dict[str, Any] = {"learning_rate": lr, "b1": self.b1, "b2": self.b2} if b1 is None else {
            "learning_rate": lr, "b1": b1, "b2": 0.99}
        if self.family != "lion":
            kw["eps"] = self.eps
        if self.family != "adam":
            kw["weight_decay"] = self.wd
        factory = f"optax.{self.family}"
        head = factory if b1 is None else _call("optax.inject_hyperparams", _Expr(factory, call=False))
        opt = _Expr(head, (), tuple(kw.items()))
        if self.family == "adam":  # DeepSpeed's Adam with adam_w_mode false adds the decay to the gradient
            return _call("optax.chain", _call("optax.add_decayed_weights", self.wd), opt)
        return opt


def _parse_optimizer(section: Any) -> tuple[_Optimizer | None, str | None]:
    """The optimizer section read, or None and why it has no optax equivalent here; the
    second item also names what the equivalent leaves out. Raises for names DeepSpeed
    refuses and for bad values."""
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
                             "Trainer fills in; give its value (translate(..., auto={...}) fills it).")
    betas = p.get("betas", (0.9, 0.999))  # DeepSpeed's default for Adam, Lamb and Lion alike
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"DeepSpeed key 'optimizer.params.betas' must be two numbers, got {betas!r}.")
    lr = _number(p.get("lr", 1e-3), "optimizer.params.lr", minimum=0)
    b1, b2 = (_number(b, "optimizer.params.betas", minimum=0) for b in betas)
    eps = _number(p.get("eps", 1e-8), "optimizer.params.eps", minimum=0)
    wd = _number(p.get("weight_decay", 0.0), "optimizer.params.weight_decay", minimum=0)
    momentum, nesterov, notes = None, False, []
    if family == "adam":
        if p.get("amsgrad"):
            return None, "AMSGrad: build optax.amsgrad yourself (with optax.add_decayed_weights for weight decay)"
        decoupled = kind != "adam" or p.get("adam_w_mode", True)  # DeepSpeed's Adam is AdamW by default
        family = "adamw" if decoupled else "adam"
    elif family == "lamb":
        bounds = (_number(p.get("min_coeff", 0.01), "optimizer.params.min_coeff", minimum=0),
                  _number(p.get("max_coeff", 10.0), "optimizer.params.max_coeff", minimum=0))
        notes.append(f"DeepSpeed's Lamb (FusedLamb) clips each layer's trust ratio to [min_coeff, max_coeff] = "
                     f"[{bounds[0]!r}, {bounds[1]!r}]; optax.lamb does not clip it, so layers whose ratio falls "
                     f"outside step differently: check it")
    elif family == "sgd":
        momentum = _number(p.get("momentum", 0.0), "optimizer.params.momentum", minimum=0) or None
        nesterov = bool(p.get("nesterov", False))
    left = sorted(set(p) - known["sgd" if family == "sgd" else family.replace("adamw", "adam")])
    if left:
        notes.insert(0, f"params {left} have no counterpart in the printed optax optimizer (e.g. bias_correction, "
                        "torch_adam): check it")
    return _Optimizer(family, lr, b1, b2, eps, wd, momentum, nesterov), "; ".join(notes) or None


def optax_code(section: Any) -> tuple[str | None, str | None]:
    """The optax equivalent of a DeepSpeed ``optimizer`` section, as code, or None and the
    reason. Weight decay is always written out: DeepSpeed's Adam/AdamW default to 0.0,
    ``optax.adamw`` to 1e-4.

    Example:
      >>> from zerojax.deepspeed import optax_code
      >>> optax_code({"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}})
      ('optax.adamw(learning_rate=0.0003, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.1)', None)
    """
    opt, why = _parse_optimizer(section)
    return (None if opt is None else opt.expr().code()), why


# --- scheduler --------------------------------------------------------------------------

_REQUIRED = object()
# DeepSpeed's schedulers: their constructors' keywords and defaults (deepspeed/runtime/
# lr_schedules.py), which the config's params are passed to; last_batch_iteration aside.
_SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": _REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": _REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": _REQUIRED, "cycle_max_lr": _REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
}
# torch.optim.lr_scheduler classes DeepSpeed builds by their exact names, with the optax
# schedule to write instead. torch's schedulers step once in their constructor, so the
# optimizer step with count k runs at their step k: an optax schedule of the count.
_TORCH_SCHEDULERS = {
    "StepLR": "optax.exponential_decay(lr, transition_steps=step_size, decay_rate=gamma, staircase=True)",
    "MultiStepLR": "optax.piecewise_constant_schedule(lr, {m: gamma for m in milestones})",
    "ExponentialLR": "optax.exponential_decay(lr, transition_steps=1, decay_rate=gamma)",
    "CosineAnnealingLR": "optax.cosine_decay_schedule(lr, decay_steps=T_max, alpha=eta_min / lr)",
    "LinearLR": "optax.linear_schedule(lr * start_factor, lr * end_factor, transition_steps=total_iters)",
    "ConstantLR": "optax.piecewise_constant_schedule(lr * factor, {total_iters: 1 / factor})",
    "PolynomialLR": "optax.polynomial_schedule(lr, 0.0, power, transition_steps=total_iters)",
    "OneCycleLR": "optax.cosine_onecycle_schedule(total_steps, max_lr, pct_start, div_factor, final_div_factor)",
    "CosineAnnealingWarmRestarts": "optax.sgdr_schedule([...]) or optax.join_schedules",
    "CyclicLR": "optax.join_schedules of optax.linear_schedule pieces",
    "LambdaLR": "the lambda times lr, as a function of the step count",
    "MultiplicativeLR": "optax.join_schedules, or a function of the step count",
    "SequentialLR": "optax.join_schedules",
    "ChainedScheduler": "a function of the step count multiplying the schedules",
    "ReduceLROnPlateau": "optax.contrib.reduce_on_plateau (a transformation, not a schedule)",
}


@dataclasses.dataclass(frozen=True)
class _Schedule:
    lr: _Expr | None = None  # the learning-rate schedule
    momentum: _Expr | None = None  # OneCycle's first beta
    why: str | None = None  # why it is not translated (lr is None)


def _scheduler(section: Any, opt_lr: float | None, has_betas: bool | None, notes: list[str]) -> _Schedule:
    """The ``scheduler`` section as an optax schedule of :mod:`zerojax.optim.schedules`,
    or why not. ``opt_lr`` is the optimizer section's ``lr`` (None without one) and
    ``has_betas`` whether its optimizer has betas (None: unknown). Raises for what
    DeepSpeed refuses: an unknown type, params its constructor does not take, required
    params left out."""
    if not isinstance(section, Mapping) or "type" not in section:
        raise ValueError(f"DeepSpeed key 'scheduler' needs a 'type' (e.g. {', '.join(_SCHEDULER_PARAMS)}), "
                         f"got {section!r}.")
    name, params = section["type"], section.get("params", {})
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed key 'scheduler.params' must be an object, got {params!r}.")
    if name not in _SCHEDULER_PARAMS:
        if name in _TORCH_SCHEDULERS:
            return _Schedule(why=f"torch.optim.lr_scheduler.{name} is not translated: write it with optax, "
                                 f"{_TORCH_SCHEDULERS[name]}, as the optimizer's learning_rate (optimizer step k "
                                 f"runs at its step k)")
        raise ValueError(f"DeepSpeed key 'scheduler.type' is {name!r}, which DeepSpeed refuses: it takes "
                         f"{', '.join(_SCHEDULER_PARAMS)} or a torch.optim.lr_scheduler class by its exact name.")
    keywords = _SCHEDULER_PARAMS[name]
    unknown = sorted(set(params) - set(keywords) - {"last_batch_iteration"})
    if unknown:
        raise ValueError(f"DeepSpeed key 'scheduler.params' has {unknown}, which {name} does not take (DeepSpeed "
                         f"passes the params to its constructor, which refuses them); it takes "
                         f"{', '.join(keywords)}.")
    absent = [k for k, v in keywords.items() if v is _REQUIRED and k not in params]
    if absent:
        raise ValueError(f"DeepSpeed scheduler {name} needs {', '.join(f'scheduler.params.{k}' for k in absent)} "
                         f"(its constructor has no default for it; DeepSpeed refuses the config too).")
    p = {**{k: v for k, v in keywords.items() if v is not _REQUIRED}, **params}
    function = schedules.DEEPSPEED_SCHEDULERS[name].__name__
    if p.pop("last_batch_iteration", -1) != -1:
        return _Schedule(why=f"last_batch_iteration {params['last_batch_iteration']!r} resumes the schedule part-way: "
                             f"not translated. The optax schedule follows the optimizer step count, which "
                             f"zj.restore_checkpoint restores: write zj.optim.schedules.{function}(...) with the "
                             f"other params")
    per_group = sorted(k for k, v in p.items() if isinstance(v, (list, tuple)))
    if per_group:
        return _Schedule(why=f"{', '.join(per_group)} give one value per parameter group: not translated; build one "
                             f"zj.optim.schedules.{function}(...) per group and combine the optimizers with "
                             f"optax.multi_transform")
    if name in ("WarmupLR", "WarmupCosineLR") and opt_lr is None and p.get("warmup_max_lr") is None:
        what = "warms up to" if name == "WarmupLR" else "scales"
        return _Schedule(why=f"{name} {what} the optimizer's lr, and the config has no optimizer section: write "
                             f"zj.optim.schedules.{function}(...) with your learning rate")
    kw = _schedule_kwargs(name, p, opt_lr, notes)
    lr = _call(f"zj.optim.schedules.{function}", **kw)
    momentum = _one_cycle_momentum(p, kw, has_betas, notes) if name == "OneCycle" else None
    notes.append(f"scheduler {name} is zj.optim.schedules.{function}, the learning rate of the printed optimizer "
                 f"(Translation.tx): DeepSpeed's rate at every optimizer step, the first steps included"
                 + ("" if has_betas is not None else "; with no optax optimizer here, pass Translation.schedule "
                                                     "as your optimizer's learning_rate"))
    return _Schedule(lr, momentum)


def _schedule_kwargs(name: str, p: dict[str, Any], opt_lr: float | None, notes: list[str]) -> dict[str, Any]:
    """The keywords of the schedule function for scheduler ``name`` with params ``p``
    (DeepSpeed's defaults filled in), checked."""

    def number(key: str, **kw: Any) -> Any:
        return _number(p[key], f"scheduler.params.{key}", **kw)

    if name == "LRRangeTest":
        return {"lr_range_test_min_lr": number("lr_range_test_min_lr", minimum=0),
                "lr_range_test_step_size": number("lr_range_test_step_size", integer=True, minimum=1),
                "lr_range_test_step_rate": number("lr_range_test_step_rate"),
                "lr_range_test_staircase": _flag(p["lr_range_test_staircase"],
                                                 "scheduler.params.lr_range_test_staircase")}
    if name == "OneCycle":
        return {"cycle_min_lr": number("cycle_min_lr", minimum=0), "cycle_max_lr": number("cycle_max_lr", minimum=0),
                "decay_lr_rate": number("decay_lr_rate"), **_cycle_shape(p)}
    warm = {"warmup_num_steps": _warmup_steps(p["warmup_num_steps"], notes),
            "warmup_type": _warmup_type(p["warmup_type"], notes)}
    if name == "WarmupCosineLR":
        return {"total_num_steps": number("total_num_steps", minimum=0), "learning_rate": opt_lr,
                "warmup_min_ratio": number("warmup_min_ratio"), "warmup_num_steps": warm["warmup_num_steps"],
                "cos_min_ratio": number("cos_min_ratio"), "warmup_type": warm["warmup_type"]}
    if p["warmup_max_lr"] is None:  # WarmupLR: DeepSpeed takes the optimizer's lr
        p = {**p, "warmup_max_lr": opt_lr}
        notes.append(f"scheduler.params.warmup_max_lr is absent: DeepSpeed (0.17.2 and later) warms up to the "
                     f"optimizer's lr, {opt_lr!r}, and so does the schedule; earlier versions warm up to 0.001.")
    bounds = {"warmup_min_lr": number("warmup_min_lr", minimum=0), "warmup_max_lr": number("warmup_max_lr", minimum=0)}
    if name == "WarmupLR":
        return {"warmup_max_lr": bounds["warmup_max_lr"], "warmup_min_lr": bounds["warmup_min_lr"], **warm}
    return {"total_num_steps": number("total_num_steps", minimum=0), **bounds, **warm}


def _warmup_steps(value: Any, notes: list[str]) -> int:
    steps = _number(value, "scheduler.params.warmup_num_steps", integer=True, minimum=0)
    if steps == 0:
        notes.append("scheduler.params.warmup_num_steps is 0 (the HF Trainer's default warmup): DeepSpeed 0.19.3 and "
                     "later refuse it; earlier versions warm up over max(2, 0) = 2 steps, and so does the schedule.")
    return steps


def _warmup_type(value: Any, notes: list[str]) -> str:
    if value in schedules.WARMUP_TYPES:
        return value
    notes.append(f"scheduler.params.warmup_type {value!r} is neither 'log' nor 'linear': DeepSpeed warns and warms "
                 "up logarithmically, and so does the schedule.")
    return "log"


def _cycle_shape(p: dict[str, Any]) -> dict[str, Any]:
    """OneCycle's cycle keywords, shared by its learning rate and its momentum."""
    def count(key: str) -> Any:
        return None if p[key] is None else _number(p[key], f"scheduler.params.{key}", integer=True, minimum=0)

    return {"cycle_first_step_size": _number(p["cycle_first_step_size"], "scheduler.params.cycle_first_step_size",
                                             minimum=0, strict=True),
            "cycle_second_step_size": None if p["cycle_second_step_size"] is None else _number(
                p["cycle_second_step_size"], "scheduler.params.cycle_second_step_size", minimum=0),
            "cycle_first_stair_count": count("cycle_first_stair_count"),
            "cycle_second_stair_count": count("cycle_second_stair_count"),
            "decay_step_size": _number(p["decay_step_size"], "scheduler.params.decay_step_size", minimum=0)}


def _one_cycle_momentum(p: dict[str, Any], kw: dict[str, Any], has_betas: bool | None,
                        notes: list[str]) -> _Expr | None:
    """OneCycle's momentum schedule when DeepSpeed applies it: ``cycle_momentum`` on (its
    default) and an optimizer with betas, whose first beta it sets at every step (and the
    second to 0.99)."""
    if not _flag(p["cycle_momentum"], "scheduler.params.cycle_momentum"):
        return None
    mom = _call("zj.optim.schedules.one_cycle_momentum",
                cycle_min_mom=_number(p["cycle_min_mom"], "scheduler.params.cycle_min_mom", minimum=0),
                cycle_max_mom=_number(p["cycle_max_mom"], "scheduler.params.cycle_max_mom", minimum=0),
                decay_mom_rate=_number(p["decay_mom_rate"], "scheduler.params.decay_mom_rate"),
                **{k: v for k, v in kw.items() if k.startswith(("cycle_first", "cycle_second", "decay_step"))})
    if has_betas is False:
        notes.append("OneCycle's cycle_momentum applies to optimizers with betas; DeepSpeed turns it off for SGD, "
                     "and so does the translation.")
        return None
    if has_betas is None:
        notes.append(f"OneCycle's cycle_momentum sets an optimizer's betas to (momentum, 0.99) at every step: with "
                     f"an optax optimizer that has betas, pass b1={mom.code()}, b2=0.99 through "
                     f"optax.inject_hyperparams.")
        return None
    notes.append("OneCycle's cycle_momentum (on by default) sets the optimizer's betas to (momentum, 0.99) at every "
                 "step, in place of optimizer.params.betas: the printed optimizer does the same, through "
                 "optax.inject_hyperparams.")
    return mom


def _optimizer_lr(section: Any) -> float | None:
    """The ``lr`` of an optimizer section (DeepSpeed's default 1e-3), or None without one."""
    if not isinstance(section, Mapping) or not isinstance(section.get("params", {}), Mapping):
        return None
    return _number(section.get("params", {}).get("lr", 1e-3), "optimizer.params.lr", minimum=0)


def from_deepspeed(source: Any, *, auto: Mapping[str, Any] | None = None) -> ZeroConfig:
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
      ...     "gradient_clipping": 1.0}).initial_scale_power
      12
    """
    t = translate(source, auto=auto)
    message = t.message()
    if message:
        warnings.warn(message, stacklevel=2)
    return t.config
