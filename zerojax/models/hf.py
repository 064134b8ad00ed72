"""One call from a Hugging Face checkpoint folder to what fine-tuning it needs: the model's
config and the map of its tensors, read from the checkpoint's own ``config.json``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from zerojax.checkpoint.configs import GENERATION
from zerojax.models.hf_config import config_from_hf, read_config
from zerojax.models.hf_map import EXPERT_NAMES, llama_map
from zerojax.models.llama import LlamaConfig
from zerojax.tensors.safetensors_files import TensorFiles, resolve_path
from zerojax.tensors.weight_map import WeightMap

HEAD = "lm_head.weight"


def from_hf(path: str | os.PathLike, *, accept: Iterable[str] = (), **overrides) -> tuple[LlamaConfig, WeightMap]:
    """``(config, map)`` of a Hugging Face Llama, Mistral, Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE or
    Mixtral checkpoint folder: the :class:`~zerojax.models.llama.LlamaConfig` of its
    ``config.json`` (see :func:`~zerojax.models.hf_config.config_from_hf`, which refuses by
    name every field that changes the computation and is not implemented; ``accept`` and
    ``overrides`` as there) and the :class:`~zerojax.maps.WeightMap` of its tensors for that
    config (:func:`~zerojax.models.hf_map.llama_map`), which loads and exports alike. The
    map carries the folder's ``config.json`` (and ``generation_config.json``), which
    ``export_weights(..., format="hf", map=wmap)`` writes beside the weights, so that
    ``from_pretrained`` reads the export as it is.

    A tied checkpoint (``tie_word_embeddings``) that stores ``lm_head.weight`` anyway is
    ambiguous: transformers ties the two if they are equal and keeps them apart if not.
    It is refused unless ``tie_embeddings=`` is given: True (one parameter, the stored head
    is ignored: say so only if it equals the embedding) or False (the head trains apart,
    read from ``lm_head.weight``).

    Example (``tests/data/hf/llama32_tied`` was made by ``transformers``)::

        cfg, wmap = zj.models.from_hf("tests/data/hf/llama32_tied", remat="full")
        state = zj.init_state(zj.models.llama.init_abstract(cfg)[1], tx, mesh=mesh, config=zc,
                              weights=zj.Weights("tests/data/hf/llama32_tied", wmap))
    """
    cfg = config_from_hf(path, accept=accept, **overrides)
    family = read_config(path)[0].get("model_type")
    wmap = llama_map(cfg, experts=family if family in EXPERT_NAMES else "qwen3_moe")
    if config_from_hf(path, accept=accept).tie_embeddings and HEAD in _tensor_names(path):
        if "tie_embeddings" not in overrides:
            raise ValueError(
                f"{os.fspath(path)!r} ties the head to the embedding (tie_word_embeddings) but stores "
                f"{HEAD} too; transformers ties them only if they are equal. Say which: "
                f"from_hf(path, tie_embeddings=True) (one parameter; the stored head is ignored) or "
                f"tie_embeddings=False (the head trains apart, from {HEAD})."
            )
        if cfg.tie_embeddings:
            wmap = dataclasses.replace(wmap, ignore=wmap.ignore + (HEAD,))
    fields, _ = read_config(path)
    generation = os.path.join(os.fspath(path), GENERATION)
    generation = read_config(generation)[0] if os.path.isdir(os.fspath(path)) and os.path.isfile(generation) else None
    return cfg, dataclasses.replace(wmap, hf_config=fields, generation_config=generation)


def _tensor_names(path: str | os.PathLike) -> set[str]:
    """The tensors a checkpoint folder holds (none if it holds only a config)."""
    try:
        resolve_path(path)
    except FileNotFoundError:
        return set()
    with TensorFiles(path) as files:
        return set(files.tensors)
