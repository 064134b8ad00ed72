"""Multi-host training as you would write it: every process runs this same script.

Locally, two processes with 4 simulated CPU devices each (gloo collectives):

    python -m zerojax.launch --nprocs 2 --devices-per-proc 4 -- python experiments/multihost.py --out /tmp/run

On a cluster, the same script under ``srun`` (SLURM) or ``mpirun``: ``zj.distributed.initialize()``
reads the launcher's environment. Each process loads only its own rows of every global batch,
trains an MLP with ZeRO-3, and saves a checkpoint (each process writes its own shards); process
0 then writes the full trained parameters to ``OUT/params.npz``. ``OUT`` is created if needed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

IN, HID, OUT, BATCH = 13, 64, 1, 32


def init_params() -> dict:
    """The same initial parameters on every process (numpy, seeded)."""
    rng = np.random.default_rng(0)
    return {
        "l1": {"w": (rng.normal(size=(IN, HID)) / np.sqrt(IN)).astype(np.float32), "b": np.zeros((HID,), np.float32)},
        "l2": {"w": (rng.normal(size=(HID, OUT)) / np.sqrt(HID)).astype(np.float32), "b": np.zeros((OUT,), np.float32)},
    }


def loss_fn(p, batch):
    import jax
    import jax.numpy as jnp

    h = jax.nn.relu(batch["x"] @ p["l1"]["w"] + p["l1"]["b"])
    return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - batch["y"]) ** 2)


def global_batch(step: int) -> dict:
    """Global batch ``step`` (every process can compute it; each keeps its own rows)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def main() -> None:
    import zerojax as zj

    mesh = zj.distributed.initialize()  # first: join the job (before anything else uses JAX)

    import jax
    import optax

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stage", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tx, cfg = optax.adamw(1e-2), zj.ZeroConfig(stage=args.stage)
    state = zj.init_state(init_params(), tx, mesh=mesh, config=cfg)
    train_step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
    rows = zj.distributed.process_rows(BATCH, mesh)  # this process's rows of every global batch
    lead = jax.process_index() == 0
    for step in range(args.steps):
        mine = {k: v[rows] for k, v in global_batch(step).items()}
        state, metrics = train_step(state, zj.distributed.global_batch(mine, mesh))
        if lead:
            print(f"step {step} loss {float(metrics['loss']):.6f}", flush=True)
    zj.save_checkpoint(os.path.join(args.out, "ckpt"), state, step=args.steps, wait=True)
    params = zj.gather_params(state)  # the full parameters, on every process
    if lead:
        flat = {
            jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        np.savez(os.path.join(args.out, "params.npz"), **flat)
        print(f"wrote {os.path.join(args.out, 'params.npz')} and a checkpoint in {os.path.join(args.out, 'ckpt')}")


if __name__ == "__main__":
    main()
