"""``config.json`` (and ``generation_config.json``) beside a Hugging Face export.

``from_pretrained(folder)`` needs the model's config beside its weights. An export writes
the source checkpoint's config when it has one (``WeightMap(hf_config=...)``, which a map
built from a checkpoint carries, or ``export_weights(..., hf_config=...)``), updated for
what the export wrote:

- the dtype: transformers 5 records it as ``"dtype"``, 4.x as ``"torch_dtype"``; each of
  those keys the source has (at any depth: a multimodal model's ``text_config`` too) is set
  to the export's dtype, and none is added;
- the head: where the export writes ``lm_head.weight`` (a head of its own) but the config
  ties the head to the embedding (``"tie_word_embeddings"`` true, or absent, where many
  architectures default to true), it is set to false: transformers would otherwise read
  the embedding as the head and ignore the trained ``lm_head.weight``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from zerojax.tensors.weight_map import json_object

CONFIG = "config.json"
GENERATION = "generation_config.json"
DTYPE_KEYS = ("dtype", "torch_dtype")
HEAD = "lm_head.weight"


def _read(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not JSON: {e}.") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {path!r} is not a JSON object.")
    return doc


def source_configs(
    hf_config: Any, generation_config: Any, wmap_config: dict | None, wmap_generation: dict | None
) -> tuple[dict | None, dict | None]:
    """``(config, generation config)`` of the source: ``hf_config`` (a dict, a
    ``config.json`` path, or a folder holding one and perhaps ``generation_config.json``)
    over the map's; ``generation_config`` (a dict or a path) over both."""
    config, generation = wmap_config, wmap_generation
    if hf_config is not None:
        if isinstance(hf_config, (str, os.PathLike)):
            path = os.fspath(hf_config)
            if os.path.isdir(path):
                if not os.path.isfile(os.path.join(path, CONFIG)):
                    raise FileNotFoundError(f"hf_config={path!r} is a folder without {CONFIG}.")
                config = _read(os.path.join(path, CONFIG), "hf_config")
                gen = os.path.join(path, GENERATION)
                generation = _read(gen, "the generation config") if os.path.isfile(gen) else None
            elif os.path.isfile(path):
                config = _read(path, "hf_config")
            else:
                raise FileNotFoundError(f"hf_config={path!r} does not exist (a config.json, or the folder holding it).")
        else:
            config = json_object(hf_config, "hf_config")
    if generation_config is not None:
        if isinstance(generation_config, (str, os.PathLike)):
            generation = _read(os.fspath(generation_config), "generation_config")
        else:
            generation = json_object(generation_config, "generation_config")
    return config, generation


def _set_dtype(doc: dict, dtype: str) -> None:
    for key in DTYPE_KEYS:
        if key in doc and (doc[key] is None or isinstance(doc[key], str)):
            doc[key] = dtype
    for value in doc.values():
        if isinstance(value, dict):
            _set_dtype(value, dtype)


def exported(config: dict | None, generation: dict | None, *, dtype: str, tensors: list[str]) -> dict[str, dict]:
    """``{file name: JSON object}`` to write beside the export (see the module docstring).

    Example:
      >>> exported({"dtype": "float32", "tie_word_embeddings": True}, None, dtype="bfloat16",
      ...          tensors=["lm_head.weight", "model.embed_tokens.weight"])
      {'config.json': {'dtype': 'bfloat16', 'tie_word_embeddings': False}}
    """
    out = {}
    if config is not None:
        config = json.loads(json.dumps(config))
        _set_dtype(config, dtype)
        if HEAD in tensors and config.get("tie_word_embeddings") is not False:
            config["tie_word_embeddings"] = False
        out[CONFIG] = config
    if generation is not None:
        generation = json.loads(json.dumps(generation))
        _set_dtype(generation, dtype)
        out[GENERATION] = generation
    return out
