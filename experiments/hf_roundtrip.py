"""Fine-tune every transformers-made fixture at ZeRO-3 and export it for transformers to read.

For each checkpoint of ``tests/data/hf`` (one per Llama-family feature, made by
``experiments/make_hf_fixtures.py``): ``zj.models.from_hf``, ``zj.init_state`` from the
weights on 8 simulated CPU devices at stage 3 (a mixture of experts on ``make_mesh(expert=4)``),
three AdamW steps, the fine-tuned model's
logits on the fixture's batch, and ``zj.export_weights(..., format="hf")`` (sharded files,
index and ``config.json``) to ``OUT/<name>``, with the logits in ``OUT/<name>_logits.npz``.
Then transformers itself loads each export (no missing or unexpected keys) and compares its
logits with zerojax's, in the private venv of the fixture script::

    python experiments/hf_roundtrip.py --out /tmp/exports
    for n in $(ls tests/data/hf); do
      $HFVENV/bin/python experiments/make_hf_fixtures.py --check-export /tmp/exports/$n \\
          --reference tests/data/hf/$n/reference.npz --logits /tmp/exports/${n}_logits.npz
    done
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax.models import llama  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "hf"


def roundtrip(name: str, out: pathlib.Path, steps: int = 3) -> tuple[float, float]:
    """``(last loss, how far the logits moved from the checkpoint's)``; writes the export."""
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, wmap = zj.models.from_hf(FIXTURES / name)
    graphdef, abstract = llama.init_abstract(cfg)
    # A mixture of experts trains with its experts split over an expert axis of 4.
    tx, mesh, zc = optax.adamw(1e-2), zj.make_mesh(expert=4 if cfg.n_experts else 1), zj.ZeroConfig(stage=3)
    state = zj.init_state(abstract, tx, mesh=mesh, config=zc, weights=zj.Weights(FIXTURES / name, wmap))
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        state, metrics = step(state, {"tokens": jnp.asarray(rng.integers(0, cfg.vocab, (8, 17)), jnp.int32)})
    model = nnx.merge(graphdef, zj.gather_params(state))
    tokens = jnp.asarray(ref["tokens"])
    logits = np.asarray(model(tokens))
    masked = np.asarray(model(tokens, mask=jnp.asarray(ref["mask"], bool)))
    zj.export_weights(state, out / name, format="hf", map=wmap, max_shard_size="10KB" if cfg.n_experts else "40KB")
    np.savez(out / f"{name}_logits.npz", logits=logits, logits_mask=masked)
    return float(metrics["loss"]), float(np.abs(logits - ref["logits"]).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the exports and their logits")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="these fixtures only (default: every one)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| fixture | loss after the steps | logits moved from the checkpoint's |\n|---|---|---|")
    for name in args.only or sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()):
        loss, moved = roundtrip(name, out, args.steps)
        print(f"| {name} | {loss:.4f} | {moved:.2f} |", flush=True)


if __name__ == "__main__":
    main()
