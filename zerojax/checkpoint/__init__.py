"""Sharded, resharding checkpoints on orbax-checkpoint, consolidated weight export, and
loading the exported weights back into a parameter tree."""

from zerojax.checkpoint.export import export_weights
from zerojax.checkpoint.io import Retention, checkpoint_steps, restore_checkpoint, save_checkpoint, wait
from zerojax.checkpoint.load import load_weights

__all__ = ["Retention", "export_weights", "checkpoint_steps", "load_weights", "restore_checkpoint",
           "save_checkpoint", "wait"]
