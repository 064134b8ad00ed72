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


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.progress import progress  # noqa: E402


def traffic(cfg: gpt.GPTConfig, replicas: int, gathers: str, batch: int) -> dict[str, int]:
    """Bytes per device per step by the mesh axes each collective spans."""
    mesh = zj.make_mesh(replicas=replicas)
    zc = zj.ZeroConfig(stage=3, **harness.GATHERS[gathers])
    _, _, compiled = harness.compile_step(cfg, mesh, zc, batch=batch)
    return harness.traffic(compiled, mesh, narrow_gathers=gathers == "bf16")  # asked in bf16; the CPU widens it


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=128, layers=2)
    ap.add_argument("--replicas", default="1,2,4", help="replica groups of each mesh (1: the 1-D mesh)")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args, head_dim=32)
    n = len(jax.devices())
    rows = []
    # One compile per configuration: a bar on a terminal, nothing when piped or in CI.
    configs = [(int(x), g) for x in args.replicas.split(",") for g in harness.GATHERS]
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
    print(harness.header(cfg, f"ZeRO-3, AdamW, batch {args.batch} x {cfg.seq_len}"))
    mib = lambda b: f"{b / 2**20:.3f} MiB"
    for row in rows:
        r = row["replicas"]
        row["mesh"] = f"1-D ({n})" if r == 1 else f"{r} x {n // r}"
        row["spans_nodes"] = row["total"] if r == 1 else row["replica"] + row["all"]
    columns = {"mesh": "{mesh}", "gathers": "{gathers}"}
    for title, key in (
        ("inside a group (data)", "data"),
        ("across groups (replica)", "replica"),
        ("every device", "all"),
        ("total", "total"),
        ("spans nodes (a group per node)", "spans_nodes"),
    ):
        columns[title] = lambda row, key=key: mib(row[key])
    print(harness.table(rows, columns))
    return rows


if __name__ == "__main__":
    main()
