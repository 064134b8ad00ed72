"""Multi-process ZeRO on JAX's distributed runtime: joining a job, global batches."""

from zerojax.distributed.data import global_batch, process_rows, process_slices
from zerojax.distributed.init import Launch, detect, initialize

__all__ = ["Launch", "detect", "global_batch", "initialize", "process_rows", "process_slices"]
