"""One call from a Hugging Face checkpoint folder to what fine-tuning it needs: the model's
config and the map of its tensors, read from the checkpoint's own ``config.json``."""

from __future__ import annotations

import os
from collections.abc import Iterable

from zerojax.checkpoint.tensor_map import WeightMap
from zerojax.models.hf_config import config_from_hf
from zerojax.models.hf_map import llama_map
from zerojax.models.llama import LlamaConfig


def from_hf(path: str | os.PathLike, *, accept: Iterable[str] = (), **overrides) -> tuple[LlamaConfig, WeightMap]:
    """``(config, map)`` of a Hugging Face Llama, Mistral, Qwen2 / Qwen2.5 or Qwen3
    checkpoint folder: the :class:`~zerojax.models.llama.LlamaConfig` of its
    ``config.json`` (see :func:`~zerojax.models.hf_config.config_from_hf`, which refuses by
    name every field that changes the computation and is not implemented; ``accept`` and
    ``overrides`` as there) and the :class:`~zerojax.WeightMap` of its tensors for that
    config (:func:`~zerojax.models.hf_map.llama_map`), which loads and exports alike.

    Example (a checkpoint made by ``transformers``; see docs/pretrained.md)::

        cfg, wmap = zj.models.from_hf("Llama-3.2-1B", remat="full")
        state = zj.init_state(zj.models.llama.init_abstract(cfg)[1], tx, mesh=mesh, config=zc,
                              weights=zj.Weights("Llama-3.2-1B", wmap))
    """
    cfg = config_from_hf(path, accept=accept, **overrides)
    return cfg, llama_map(cfg)
