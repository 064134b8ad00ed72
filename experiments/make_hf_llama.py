"""Make a tiny random Hugging Face ``LlamaForCausalLM`` checkpoint and its reference logits.

Writes to ``--out`` (``tests/data/hf_llama_tiny``, about 150 KB):

- ``config.json``, ``generation_config.json``: 3 layers, d 32, 4 query / 2 KV heads (GQA),
  MLP 56, vocab 97, untied head, no biases, ``rms_norm_eps`` 1e-6, ``rope_theta`` 1e4;
- ``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``: the weights in
  Hugging Face's *sharded* layout (``max_shard_size`` 40 KB: several shards), float32,
  drawn from normal(0, 0.2), the RMSNorm weights 1 + normal(0, 0.1);
- ``reference.npz``: ``tokens`` int32 [2, 11]; ``mask`` int32 [2, 11] (row 0 all ones,
  row 1 two left-padded and three right-padded positions); ``logits`` float32 [2, 11, 97]
  of ``model(tokens, attention_mask=mask)`` and ``logits_nomask`` of ``model(tokens)``
  (eager attention; positions ``arange(11)`` in both, as Hugging Face's forward without
  ``position_ids``); ``positions`` int32 [2, 11] (``max(cumsum(mask) - 1, 0)``, as
  ``generate()`` numbers left-padded rows) and ``logits_positions`` of
  ``model(tokens, attention_mask=mask, position_ids=positions)``. Logits of a query with
  no unmasked key at or before it (row 1's left padding) are meaningless.

It needs ``torch`` and ``transformers``, which are not dependencies of the project; run it
in a private virtual environment::

    python3 -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfref/bin/python experiments/make_hf_llama.py --out tests/data/hf_llama_tiny

Made with torch 2.13.0 and transformers 5.24.0; the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)


def build(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**CONFIG, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG["vocab_size"], size=(2, 11)).astype(np.int32)
    mask = np.ones((2, 11), np.int32)
    mask[1, :2] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return tokens, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/hf_llama_tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="40KB")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("model*.safetensors*"):  # stale shards of an earlier run
        f.unlink()

    model = build(args.seed)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=args.max_shard_size)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    if len(shards) < 2:
        raise SystemExit(f"expected a sharded checkpoint, got {shards}: lower --max-shard-size")

    tokens, mask = batch()
    with torch.no_grad():
        ids = torch.from_numpy(tokens).long()
        logits = model(ids, attention_mask=torch.from_numpy(mask).long()).logits.float().numpy()
        logits_nomask = model(ids).logits.float().numpy()
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)  # as generate() counts them
        logits_positions = (
            model(ids, attention_mask=torch.from_numpy(mask).long(), position_ids=torch.from_numpy(positions).long())
            .logits.float()
            .numpy()
        )
    np.savez(
        out / "reference.npz",
        tokens=tokens,
        mask=mask,
        logits=logits,
        logits_nomask=logits_nomask,
        positions=positions,
        logits_positions=logits_positions,
    )

    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}: {len(shards)} shards, "
        f"{len(index['weight_map'])} tensors, {size / 1e3:.0f} KB in {out}{os.sep}"
    )


if __name__ == "__main__":
    main()
