"""Temp memory and FLOPs of the GPT train step under each remat policy (fixed batch).

Memory from ``compiled.memory_analysis()``, FLOPs from ``compiled.cost_analysis()``, which
counts the body of the layer loop once: the FLOPs are those of one layer plus the
embedding, head and optimizer. (The loop stays rolled: unrolled, XLA's CPU pipeline merges
the recomputation with the forward pass and remat has no effect.) Prints a markdown table:

    python experiments/remat_table.py [--stage 3 --batch 32 --how config]

``--how config`` applies the policy through ``ZeroConfig(remat=...)`` (every layer loop,
no model change); ``--how model`` builds the blocks with ``zj.remat.nnx_module``.

``--check-offload`` (for a GPU: XLA's CPU backend lowers moves to host memory as no-ops)
exits with status 1 unless each offload policy measured puts bytes in host memory and
keeps less on the device than the policy that keeps the same values there
(``offload_names`` against ``names``, ``offload_dots`` against ``dots_no_batch``).
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
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

POLICIES = {
    "none": zj.remat.Remat("none"),
    "dots": zj.remat.Remat("dots"),
    "dots_no_batch": zj.remat.Remat("dots_no_batch"),
    "names": zj.remat.Remat("names", names=("attn_out", "mlp_out")),
    "full": zj.remat.Remat("full"),
    "offload_names": zj.remat.Remat("offload_names", names=("attn_out", "mlp_out")),
    "offload_dots": zj.remat.Remat("offload_dots"),
}
MIB = 2**20
# Each offload policy and the policy that keeps the same values on the device.
OFFLOAD_PAIRS = {"offload_names": "names", "offload_dots": "dots_no_batch"}


def measure(policy: zj.remat.Remat, stage: int, batch: int, how: str, layers: int, d_model: int) -> dict:
    cfg = gpt.GPTConfig(
        vocab=256,
        seq_len=64,
        d_model=d_model,
        n_layers=layers,
        n_heads=4,
        remat=policy.kind if how == "model" and not policy.names else "none",
    )
    if how == "model" and policy.names:
        raise SystemExit("--how model takes policies without names; use --how config")
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-3)
    zc = zj.ZeroConfig(stage=stage, remat=policy if how == "config" else None)
    mesh = zj.make_mesh()
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    b = next(data.windows(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
    compiled = step.lower(state, b).compile()
    mem = zj.report.compiled_bytes(compiled)
    return {"temp": mem["temp"], "host_temp": mem["host_temp"], "flops": compiled.cost_analysis()["flops"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--how", choices=["config", "model"], default="config")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--check-offload",
        action="store_true",
        help="exit 1 unless offload policies use host memory and save device memory (GPU)",
    )
    args = ap.parse_args(argv)
    chosen = [p for p in POLICIES if p in args.policies.split(",")]
    rows = {
        name: measure(POLICIES[name], args.stage, args.batch, args.how, args.layers, args.d_model) for name in chosen
    }
    base = rows[chosen[0]]
    print(
        f"GPT d_model {args.d_model}, {args.layers} layers, seq 64, batch {args.batch} "
        f"({args.batch // len(jax.devices())} sequences per device), ZeRO-{args.stage}, "
        f"remat via {args.how}, {len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}; "
        "names = attn_out, mlp_out\n"
    )
    print("| policy | device temp | vs none | host temp | FLOPs per device | vs none |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['temp'] / MIB:.2f} MiB | {base['temp'] / r['temp']:.2f}x less | "
            f"{r['host_temp'] / MIB:.2f} MiB | {r['flops'] / 1e9:.3f} G | {r['flops'] / base['flops']:.2f}x |"
        )
    if args.check_offload:
        failures = offload_failures(rows)
        for line in failures:
            print(f"offload check: {line}")
        if failures:
            raise SystemExit(1)
        print("offload check: every offload policy moved its values to host memory")
    return rows


def offload_failures(rows: dict) -> list[str]:
    """What the offload policies measured in ``rows`` fail to show (empty: all shown)."""
    out = []
    pairs = [(o, k) for o, k in OFFLOAD_PAIRS.items() if o in rows]
    if not pairs:
        return ["no offload policy measured: add offload_names or offload_dots to --policies"]
    for off, kept in pairs:
        if rows[off]["host_temp"] <= 0:
            out.append(f"{off}: no bytes in host memory (host temp 0)")
        if kept in rows and rows[off]["temp"] >= rows[kept]["temp"]:
            out.append(
                f"{off}: device temp {rows[off]['temp'] / MIB:.2f} MiB is not below {kept}'s "
                f"{rows[kept]['temp'] / MIB:.2f} MiB"
            )
    return out


if __name__ == "__main__":
    main()
