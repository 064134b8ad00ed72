"""Pipeline parallelism beside ZeRO: the loss's layer scan split into stages over the
pipeline axis (docs/pipeline.md)."""

from zerojax.pipeline.rewrite import needed, wrap

__all__ = ["needed", "wrap"]
