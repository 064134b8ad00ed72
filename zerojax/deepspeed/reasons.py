"""Why each DeepSpeed key that zerojax understands but does not map is left out: the
reasons :class:`~zerojax.deepspeed.Translation` lists with its unmapped keys."""

from __future__ import annotations

_XLA = "no equivalent: XLA schedules and fuses the collectives"
_LOADER = (
    "the data loader's job: train_step takes the global batch (micro-batch x accumulation x devices) and splits it"
)
_LOGGING = "logging: zj.monitor.Monitor records the step's metrics and writes them where you log"
_TIMING = "zj.monitor.Monitor records each step's time (step_time_s); XLA fuses the step into one program"

# Reasons for keys that are understood but not mapped (paths as "section.key").
REASONS: dict[str, str] = {
    "train_batch_size": _LOADER,
    "train_micro_batch_size_per_gpu": _LOADER,
    "timers": _TIMING,
    "dump_state": "print(zj.ZeroConfig(...).code()) and zj.report.state_bytes_per_device(state) show the config "
    "and the state",
    "memory_breakdown": "zj.report.state_bytes_per_device(state) and zj.report.step_memory(...) (from the "
    "compiled step) give the memory per device",
    "comms_logger": "zj.report.communication_report(train_step.lower(state, batch).compile()) counts every "
    "collective of the compiled step, by kind, dtype and mesh axis",
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
    "bf16.check_grad_overflow": "set ZeroConfig(loss_scaling={'skip_nonfinite': True}) to skip steps with non-finite gradients",
    "zero_optimization.overlap_comm": _XLA,
    "zero_optimization.contiguous_gradients": _XLA,
    "zero_optimization.reduce_bucket_size": _XLA,
    "zero_optimization.allgather_bucket_size": _XLA,
    "zero_optimization.allgather_partitions": _XLA,
    "zero_optimization.reduce_scatter": _XLA,
    "zero_optimization.round_robin_gradients": _XLA,
    "zero_optimization.use_multi_rank_bucket_allreduce": _XLA,
    # Read by the mapping (ZeroConfig.prefetch); listed so that an "auto" left unfilled is no error.
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
    "zero_optimization.elastic_checkpoint": "zj.restore_checkpoint restores onto any device count",
    "zero_optimization.load_from_fp32_weights": "checkpoints hold the fp32 masters",
    "zero_optimization.ignore_unused_parameters": "an unused parameter gets a zero gradient",
    "zero_optimization.legacy_stage1": "no equivalent",
    "zero_optimization.memory_efficient_linear": "no equivalent",
    "zero_optimization.mics_hierarchical_params_gather": _XLA,
    "zero_optimization.zero_quantized_nontrainable_weights": "frozen parameters are gathered in the compute "
    "dtype (int8 gathers cover the trained ones)",
    "zero_optimization.offload_optimizer.pin_memory": "offloaded state is always in pinned host memory",
    "zero_optimization.offload_optimizer.ratio": "the optimizer state is not offloaded (device 'none')",
    "zero_optimization.offload_optimizer.buffer_count": _XLA,
    "zero_optimization.offload_optimizer.fast_init": "no equivalent",
    "zero_optimization.offload_optimizer.pipeline_read": "read with the NVMe tier only (device 'nvme')",
    "zero_optimization.offload_optimizer.pipeline_write": "read with the NVMe tier only (device 'nvme')",
    "zero_optimization.offload_optimizer.nvme_path": "read with the NVMe tier only (device 'nvme')",
    "zero_optimization.offload_param.pin_memory": "offloaded parameters are always in pinned host memory",
    "zero_optimization.offload_param.buffer_count": _XLA,
    "zero_optimization.offload_param.buffer_size": _XLA,
    "zero_optimization.offload_param.max_in_cpu": "all of the parameters are offloaded",
    "zero_optimization.offload_param.nvme_path": "the parameters stay in host memory (the NVMe tier holds "
    "the optimizer state only)",
    "activation_checkpointing.partition_activations": "DeepSpeed splits the saved activations over the tensor "
    "(model-parallel) group; zerojax's nearest: a context axis splits every activation along the sequence "
    "(zj.make_mesh(context=C)), and ZeroConfig(remat=...) chooses what is saved",
    "activation_checkpointing.cpu_checkpointing": "the nearest is a host-offload policy: ZeroConfig(remat="
    "'offload_dots') or zj.remat.Remat('offload_names', ...)",
    "activation_checkpointing.contiguous_memory_optimization": _XLA,
    "activation_checkpointing.number_checkpoints": "every layer of a scanned stack is one remat region",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no equivalent",
    "activation_checkpointing.profile": _LOGGING,
}
# DeepSpeed's zero_optimization fields go by their stage3_ names or their own (populate_by_name).
for _k in (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
):
    REASONS[f"zero_optimization.{_k}"] = REASONS[f"zero_optimization.stage3_{_k}"]
for _k in (
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "allgather_sequential",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
):
    REASONS[f"zero_optimization.{_k}"] = _XLA
for _k in ("override_module_apply", "pipeline_loading_checkpoint"):
    REASONS[f"zero_optimization.{_k}"] = "no equivalent"
for _k in ("log_trace_cache_warnings", "enable_sanity_checks"):
    REASONS[f"zero_optimization.{_k}"] = _LOGGING
# DeepSpeed's own "auto" (not the HF Trainer's): the stage count of the PipelineModule, which
# from_deepspeed(..., pipeline_stages=P) takes from the model's side.
REASONS["pipeline.stages"] = "DeepSpeed takes 'auto' stages from the PipelineModule: give pipeline_stages=P"
REASONS["tensor_parallel.tp_overlap_comm"] = _XLA
REASONS["tensor_parallel.partition_config"] = (
    "zerojax reads the split from the model's own annotations (nnx.with_partitioning, tensor_specs=...)"
)
REASONS["tensor_parallel.dtype"] = "set the compute dtype with the bf16 / fp16 sections (ZeroConfig.compute_dtype)"
REASONS["disable_allgather"] = _XLA
REASONS["gradient_allreduce_op"] = "zerojax averages gradients, DeepSpeed's 'mean'"
REASONS["autotuning"] = (
    "zerojax's autotuner is zj.autotune (and `zerojax autotune`): it compiles each candidate configuration "
    "ahead of time and prices it from the compiled program, with no trial run"
)
REASONS["elasticity"] = (
    "DeepSpeed's elasticity picks batch sizes valid across GPU counts; zerojax.resume.Run resumes a run on "
    "another device count (run.micro_batches(config, mesh, global_batch) keeps the global batch) and "
    "zj.restore_checkpoint restores onto any device count"
)
REASONS["moe"] = (
    "no equivalent: DeepSpeed-MoE's ep_size is an argument of deepspeed.moe.layer.MoE in the model; "
    "zerojax's is zj.make_mesh(expert=E) (docs/moe.md)"
)
REASONS["seq_parallel_communication_data_type"] = (
    "no equivalent: the context axis's all-to-alls and permutes move the compute dtype"
)
for _k in (
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "aio",
    "nebula",
    "compile",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "hybrid_engine",
    "weight_quantization",
    "zero_config",
    "communication_compression",
):
    REASONS.setdefault(_k, "no equivalent in zerojax")
REASONS["zero_optimization.zenflow"] = "no equivalent: the optimizer updates every parameter at every step"
REASONS["zero_optimization.zeropp_loco_param"] = (
    "no equivalent: int8 gradients (reduce_dtype='int8') carry no error feedback"
)
REASONS["zero_optimization.leaf_module"] = (
    "no equivalent: stage 3 gathers each parameter where the traced loss uses it, with no module hooks"
)
for _k in ("partition_stream_chunk_size", "stage3_partition_stream_chunk_size"):
    REASONS[f"zero_optimization.{_k}"] = (
        "no equivalent: init_state places each parameter's shards as it is given them; to build a model "
        "larger than one device, give init_state a function that builds the parameters"
    )
REASONS["zero_optimization.save_muon_momentum_buffer_in_memory"] = "no NVMe offload: the state is in memory"
