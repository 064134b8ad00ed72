"""Maps from a model's parameters to a checkpoint's tensors (see
:mod:`zerojax.tensors.tensor_map`), and ready ones for Hugging Face layouts."""

from zerojax.models.hf_map import family_map, llama_map
from zerojax.tensors.tensor_map import (
    IDENTITY,
    WeightMap,
    concat,
    infer_tensors,
    merge_dims,
    part,
    split_dim,
    stack,
    transpose,
)

__all__ = [
    "IDENTITY",
    "WeightMap",
    "concat",
    "family_map",
    "infer_tensors",
    "llama_map",
    "merge_dims",
    "part",
    "split_dim",
    "stack",
    "transpose",
]
