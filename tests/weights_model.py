"""A model in Hugging Face's naming for the tests of pretrained weights: a stack of MLP
layers between an embedding and a head, its checkpoint written by ``safetensors`` itself
in the sharded format (``model.safetensors.index.json`` + files), bf16 on disk."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from zerojax.maps import WeightMap, stack, transpose

V, D, F, L = 1024, 256, 1024, 20  # 11.0M parameters: 22 MiB in bf16, 44 MiB of fp32 masters

MAP = WeightMap(
    {
        "embed": "model.embed_tokens.weight",
        "norm": stack("model.layers.{i}.input_layernorm.weight"),
        "up": stack(transpose("model.layers.{i}.mlp.up_proj.weight")),
        "down": stack(transpose("model.layers.{i}.mlp.down_proj.weight")),
        "head": transpose("lm_head.weight"),
    }
)


def abstract_params() -> dict:
    f32 = np.float32
    return {
        "embed": jax.ShapeDtypeStruct((V, D), f32),
        "norm": jax.ShapeDtypeStruct((L, D), f32),
        "up": jax.ShapeDtypeStruct((L, D, F), f32),
        "down": jax.ShapeDtypeStruct((L, F, D), f32),
        "head": jax.ShapeDtypeStruct((D, V), f32),
    }


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bf = lambda *s: rng.normal(size=s).astype(np.float32).astype(ml_dtypes.bfloat16)
    out = {"model.embed_tokens.weight": bf(V, D), "lm_head.weight": bf(V, D)}
    for i in range(L):
        out[f"model.layers.{i}.input_layernorm.weight"] = bf(D)
        out[f"model.layers.{i}.mlp.up_proj.weight"] = bf(F, D)  # torch Linear: [out, in]
        out[f"model.layers.{i}.mlp.down_proj.weight"] = bf(D, F)
    return out


def write_sharded(folder: str, ts: dict[str, np.ndarray], max_bytes: int = 3_000_000) -> list[str]:
    """``ts`` as Hugging Face's sharded format, files of about ``max_bytes``."""
    os.makedirs(folder, exist_ok=True)
    groups, cur, size = [], {}, 0
    for name, x in ts.items():
        if cur and size + x.nbytes > max_bytes:
            groups.append(cur)
            cur, size = {}, 0
        cur[name], size = x, size + x.nbytes
    groups.append(cur)
    files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for f, g in zip(files, groups):
        save_file(g, os.path.join(folder, f), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(x.nbytes for x in ts.values())},
        "weight_map": {n: f for f, g in zip(files, groups) for n in g},
    }
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh)
    return files


def reference(ts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters ``MAP`` reads from ``ts``, by plain numpy, in fp32."""
    f = lambda x: np.asarray(x, np.float32)
    return {
        "embed": f(ts["model.embed_tokens.weight"]),
        "head": f(ts["lm_head.weight"]).T,
        "norm": np.stack([f(ts[f"model.layers.{i}.input_layernorm.weight"]) for i in range(L)]),
        "up": np.stack([f(ts[f"model.layers.{i}.mlp.up_proj.weight"]).T for i in range(L)]),
        "down": np.stack([f(ts[f"model.layers.{i}.mlp.down_proj.weight"]).T for i in range(L)]),
    }
