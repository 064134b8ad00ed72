"""The keys DeepSpeed's own config models accept, and the refusal of any other.

DeepSpeed validates ``zero_optimization`` and its ``offload_optimizer`` / ``offload_param``
objects with pydantic models that forbid extra keys (``DeepSpeedConfigModel``:
``extra="forbid"``, ``populate_by_name=True``), so a misspelt key stops DeepSpeed at start;
:func:`check_keys` stops the translation the same way, naming the key and the nearest one
DeepSpeed accepts."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

# DeepSpeedZeroConfig's fields (deepspeed/runtime/zero/config.py), by name ...
_ZERO_FIELDS = (
    "stage",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_param",
    "offload_optimizer",
    "zenflow",
    "sub_group_size",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "cpu_offload",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
)
# ... and these, each also under its stage3_ alias (the spelling the documented configs use).
_STAGE3_FIELDS = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "partition_stream_chunk_size",
)
_ZERO_ALIASES = tuple(f"stage3_{k}" for k in _STAGE3_FIELDS)
ZERO_KEYS = frozenset(_ZERO_FIELDS + _STAGE3_FIELDS + _ZERO_ALIASES)

# DeepSpeedZeroOffloadParamConfig and DeepSpeedZeroOffloadOptimizerConfig
# (deepspeed/runtime/zero/offload_config.py).
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER_KEYS = frozenset(
    {
        "device",
        "nvme_path",
        "buffer_count",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    }
)


def check_keys(section: Mapping, known: Iterable[str], path: str) -> None:
    """Raises ``ValueError`` for the first key of ``section`` that DeepSpeed's model for
    ``path`` does not accept, naming the nearest key it does."""
    known = sorted(known)
    for key in section:
        if key in known:
            continue
        (near,) = difflib.get_close_matches(str(key), known, n=1, cutoff=0.0)
        raise ValueError(
            f"DeepSpeed key '{path}.{key}' is not a key of {path!r}; the nearest one is {near!r}. DeepSpeed "
            f"refuses unknown keys here too (its config model forbids extra fields): correct or remove it."
        )
