"""Maps from a model's parameters to a checkpoint's tensors (see
:mod:`zerojax.tensors.weight_map` and :mod:`zerojax.tensors.specs`), and ready ones for Hugging Face's tensor names."""

from zerojax.models.hf_map import family_map, llama_map
from zerojax.tensors.specs import concat, merge_dims, part, split_dim, stack, transpose
from zerojax.tensors.weight_map import IDENTITY, WeightMap, infer_tensors

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
