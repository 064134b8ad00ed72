"""XLA's GPU flags for overlapping zerojax's collectives with compute.

``ZeroConfig(prefetch=...)`` makes each layer's gather independent of the compute it can
overlap; whether they actually run at the same time is the GPU scheduler's decision.
These flags turn on what does it (the set MaxText and NVIDIA's JAX containers run FSDP
with). Every flag here is checked against the installed jaxlib by the tests (an unknown
flag in ``XLA_FLAGS`` is a fatal error at startup).

Set them before JAX starts its backends: ``zj.xla_flags.apply_gpu_overlap_flags()`` at the
top of a script, ``python -m zerojax.launch --gpu-overlap ...`` for every process of a job,
or ``XLA_FLAGS="$(python -m zerojax.xla_flags)"`` in a shell. On the CPU backend they parse
and do nothing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# flag -> what it does
GPU_OVERLAP_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler=true": "schedules asynchronous collectives early and the compute that does not depend on them "
    "in between, so a layer's all-gather runs while earlier layers compute",
    "--xla_gpu_enable_highest_priority_async_stream=true": "runs those collectives on a high-priority stream, so compute kernels do not starve them",
    "--xla_gpu_enable_pipelined_all_gather=true": "in a loop over layers (scan), moves the next iteration's all-gather into this one: "
    "XLA's own prefetch of the next layer",
    "--xla_gpu_enable_pipelined_reduce_scatter=true": "in a loop over layers, lets a layer's gradient reduce-scatter finish during the next "
    "iteration's backward compute",
    "--xla_gpu_enable_pipelined_all_reduce=true": "the same for all-reduces (stage 0 gradients, the loss, norms)",
    "--xla_gpu_enable_while_loop_double_buffering=true": "unrolls layer loops by two so that iterations alternate between two buffers, and a "
    "gather can fill one while the other is read",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728": "combines small all-gathers (a layer's biases and norms) into one, up to 128 MiB",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728": "combines small reduce-scatters into one, up to 128 MiB",
}


def gpu_overlap_flags() -> list[str]:
    """The flags, as ``XLA_FLAGS`` entries.

    Example:
      >>> import zerojax as zj
      >>> "--xla_gpu_enable_latency_hiding_scheduler=true" in zj.xla_flags.gpu_overlap_flags()
      True
    """
    return list(GPU_OVERLAP_FLAGS)


def with_gpu_overlap_flags(xla_flags: str = "") -> str:
    """``xla_flags`` with each overlap flag added unless the same flag is already set there
    (a value you chose wins)."""
    present = {f.split("=")[0] for f in xla_flags.split()}
    added = [f for f in GPU_OVERLAP_FLAGS if f.split("=")[0] not in present]
    return " ".join([*xla_flags.split(), *added])


def apply_gpu_overlap_flags(environ: MutableMapping[str, str] | None = None) -> str:
    """Adds the flags to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``); returns the new
    value. XLA reads ``XLA_FLAGS`` once, when JAX starts its backends: call this at the top
    of the script, before the first ``jax.devices()`` or computation."""
    environ = os.environ if environ is None else environ
    environ["XLA_FLAGS"] = with_gpu_overlap_flags(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]


if __name__ == "__main__":  # XLA_FLAGS="$(python -m zerojax.xla_flags)"
    print(with_gpu_overlap_flags(os.environ.get("XLA_FLAGS", "")))
