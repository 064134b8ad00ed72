"""Traffic per mesh axis: ZeRO-3 on a 1-D mesh against hybrid (replica, data) meshes, with
weights gathered in fp32, bf16 and int8.

For each mesh and gather dtype the GPT's train step is compiled on 8 simulated CPU devices
and its collectives are read from the HLO (``zj.report.communication_report(compiled, mesh=mesh)``):
bytes per device per step inside a replica group (the data axis), across groups (the
replica axis: only the gradient shards' all-reduce) and over every device (the scalar
loss). On a cluster with one replica group per node, only the replica column leaves a node;
on a 1-D mesh over several nodes every gather and reduce-scatter spans them. XLA's CPU
backend widens bf16 collectives to fp32, so for bf16 gathers the all-gathers are counted at
the dtype zerojax asks for (half their fp32 bytes), as ``int8_gathers.py`` does.

    python experiments/hybrid.py [--d-model 128 --layers 2 --replicas 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.report.comm import collectives  # noqa: E402
from zerojax.report.progress import progress  # noqa: E402

GATHERS = {
    "fp32": dict(compute_dtype="float32"),
    "bf16": dict(compute_dtype="bfloat16"),
    "int8": dict(compute_dtype="bfloat16", gather_dtype="int8"),
}


def traffic(cfg: gpt.GPTConfig, replicas: int, gathers: str, batch: int) -> dict[str, int]:
    """Bytes per device per step by the mesh axes each collective spans."""
    graphdef, params = gpt.init(cfg)
    tx, mesh = optax.adamw(3e-3), zj.make_mesh(replicas=replicas)
    zc = zj.ZeroConfig(stage=3, **GATHERS[gathers])
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    tokens = next(data.batches(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
    compiled = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc).lower(state, tokens).compile()
    out: dict[str, int] = {}
    for c in collectives(compiled.as_text()):
        nbytes = c.total_bytes
        if gathers == "bf16" and c.kind == "all-gather" and c.dtype == "f32":
            nbytes //= 2  # asked in bf16; the CPU backend widens it
        key = "+".join(c.axes(mesh))
        out[key] = out.get(key, 0) + nbytes
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--replicas", default="1,2,4", help="replica groups of each mesh (1: the 1-D mesh)")
    args = ap.parse_args(argv)
    cfg = gpt.GPTConfig(
        vocab=256, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 32)
    )
    n = len(jax.devices())
    rows = []
    # One compile per configuration: a bar on a terminal, nothing when piped or in CI.
    configs = [(int(x), g) for x in args.replicas.split(",") for g in GATHERS]
    for r, g in progress(configs, "hybrid", unit="config"):
        t = traffic(cfg, r, g, args.batch)
        rows.append(
            {
                "replicas": r,
                "gathers": g,
                "data": t.get("data", 0),
                "replica": t.get("replica", 0),
                "all": t.get("replica+data", 0) if r > 1 else 0,
                "total": sum(t.values()),
            }
        )
    psi = cfg.num_params()
    print(
        f"GPT d{args.d_model} L{args.layers} ({psi:,} parameters), ZeRO-3, AdamW, batch {args.batch} x "
        f"{cfg.seq_len}, {n} x {jax.devices()[0].platform}, jax {jax.__version__}\n"
    )
    mib = lambda b: f"{b / 2**20:.3f} MiB"
    print(
        "| mesh | gathers | inside a group (data) | across groups (replica) | every device | total | "
        "spans nodes (a group per node) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        r = row["replicas"]
        mesh = f"1-D ({n})" if r == 1 else f"{r} x {n // r}"
        row["spans_nodes"] = row["total"] if r == 1 else row["replica"] + row["all"]
        print(
            f"| {mesh} | {row['gathers']} | {mib(row['data'])} | {mib(row['replica'])} | {mib(row['all'])} | "
            f"{mib(row['total'])} | {mib(row['spans_nodes'])} |"
        )
    return rows


if __name__ == "__main__":
    main()
