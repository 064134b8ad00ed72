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
not the config: ``zj.make_mesh(group_size=shard_size)``
(:meth:`Translation.mesh_code`, printed by the CLI and named in the warning).
``zero_quantized_gradients`` (qgZ) maps to ``reduce_dtype="int8"`` at stage 3 (DeepSpeed
ignores it at stages 1–2, and so does the mapping): its exchange is
hierarchical wherever the mesh has replica groups (inside a group, then across groups),
which is what DeepSpeed's intra-node/inter-node all-to-all does.
``stage3_prefetch_bucket_size`` sets ``prefetch`` (1: one whole layer gathered ahead; 0:
none), ``sequence_parallel_size``, AutoTP's ``tensor_parallel.autotp_size`` and AutoEP's
``expert_parallel.autoep_size`` are the context, tensor and expert axes of the mesh.

DeepSpeed refuses keys its ``zero_optimization`` model does not have (it forbids extra
fields), and so does the translation, naming the nearest key; ``gradient_allreduce_op:
"sum"`` is refused (zerojax averages, as DeepSpeed's default ``"mean"`` does).

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

from zerojax.deepspeed.auto import HF_DEFAULTS, HF_NAMES
from zerojax.deepspeed.mapping import DEFAULT_GRAD_CLIP, Translation, from_deepspeed, translate
from zerojax.deepspeed.optimizer_section import optax_code
from zerojax.deepspeed.reasons import REASONS

__all__ = [
    "DEFAULT_GRAD_CLIP",
    "HF_DEFAULTS",
    "HF_NAMES",
    "REASONS",
    "Translation",
    "from_deepspeed",
    "optax_code",
    "translate",
]
