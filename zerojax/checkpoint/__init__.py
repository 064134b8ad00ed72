"""Sharded, resharding checkpoints on orbax-checkpoint, and consolidated weight export."""

from zerojax.checkpoint.export import export_weights
from zerojax.checkpoint.io import Retention, checkpoint_steps, restore_checkpoint, save_checkpoint, wait

__all__ = ["Retention", "export_weights", "checkpoint_steps", "restore_checkpoint", "save_checkpoint", "wait"]
