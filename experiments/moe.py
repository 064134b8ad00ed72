"""Mixture of experts on an expert axis: the largest MoE that fits a per-device budget at
stage 3 with E = 8 against E = 1, and what the dispatch costs (temp memory and all-to-all
bytes against the formulas of docs/moe.md), from compiled programs on 8 simulated devices.

    python experiments/moe.py [--budget-mib 64] [--only-largest | --only-dispatch]

Largest: zerojax.models' Llama with routed experts (d 128, 2 layers, 4 heads, experts of
512 features, top-2), AdamW, 8 sequences of 32 tokens, ZeRO-3, at E = 1, 4 and 8 (data 8,
2 and 1) dropless, and at E = 8 with a capacity factor of 1.25; the number of experts is doubled from 8 until the compiled step (argument +
output - alias + temp, per device) exceeds the budget, then bisected in steps of 8.

Dispatch: ``zj.nn.routed_experts`` alone, forward and backward, on ``make_mesh(expert=8)``,
512 tokens per device of width 64, 64 experts of 128 features, top-2: dropless and with
capacity factors 1.0 and 1.25.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zerojax as zj  # noqa: E402
from zerojax.models import llama  # noqa: E402
from zerojax.report.comm import collectives  # noqa: E402
from zerojax.report.memory import compiled_bytes  # noqa: E402

MIB = 2**20


def moe_config(n_experts: int, capacity_factor: float | None = None) -> llama.LlamaConfig:
    return llama.LlamaConfig(
        vocab=256,
        d_model=128,
        n_layers=2,
        n_heads=4,
        d_ff=512,
        n_experts=n_experts,
        top_k=2,
        moe_d_ff=512,
        router_aux_loss_coef=0.01,
        capacity_factor=capacity_factor,
    )


def step_total(n_experts: int, ep: int, capacity_factor: float | None = None) -> tuple[int, int]:
    """(compiled bytes per device, parameters) of the stage-3 step."""
    cfg = moe_config(n_experts, capacity_factor)
    graphdef, abstract = llama.init_abstract(cfg)
    batch = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
    mem = zj.report.step_memory(
        llama.make_loss(graphdef),
        abstract,
        optax.adamw(1e-3),
        batch,
        mesh=zj.make_mesh(expert=ep),
        config=zj.ZeroConfig(stage=3),
    )
    return mem.argument + mem.output - mem.alias + mem.temp, cfg.num_params()


def largest(budget: int, ep: int, capacity_factor: float | None = None) -> tuple[int, int, int]:
    """The most experts (a multiple of 8) whose step fits ``budget``: (experts, bytes, params)."""
    n, fit = 8, None
    while True:
        total, params = step_total(n, ep, capacity_factor)
        print(f"  E={ep}: {n} experts, {params / 1e6:.2f} M parameters: {total / MIB:.2f} MiB", flush=True)
        if total > budget:
            break
        fit, n = (n, total, params), n * 2
    lo, hi = (fit[0] if fit else 0), n
    while hi - lo > 8:
        mid = (lo + hi) // 16 * 8
        total, params = step_total(mid, ep, capacity_factor)
        print(f"  E={ep}: {mid} experts, {params / 1e6:.2f} M parameters: {total / MIB:.2f} MiB", flush=True)
        if total <= budget:
            lo, fit = mid, (mid, total, params)
        else:
            hi = mid
    return fit


def dispatch_rows() -> list[tuple]:
    tokens, d, f, n_experts, k, ep = 512, 64, 128, 64, 2, 8
    mesh = zj.make_mesh(expert=ep)
    key = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(key[0], (tokens * ep, d))
    logits = jax.random.normal(key[1], (tokens * ep, n_experts))
    up, gate = jax.random.normal(key[2], (n_experts, d, f)), jax.random.normal(key[3], (n_experts, d, f))
    down = jax.random.normal(key[4], (n_experts, f, d))
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in (x, logits, up, down, gate)]
    rows = []
    for cf in (None, 1.0, 1.25):

        def loss(x, lg, u, dn, g):
            y, st = zj.nn.routed_experts(x, lg, u, dn, g, top_k=k, normalize=True, capacity_factor=cf)
            return jnp.sum(y * y) + st.load_balancing_loss

        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*placed).compile()
        temp = compiled_bytes(compiled)["temp"]
        a2a = [c for c in collectives(compiled.as_text()) if c.kind == "all-to-all"]
        moved = sum(c.total_bytes for c in a2a if c.dtype == "f32")
        slots = tokens * k if cf is None else (n_experts // ep) * zj.moe.capacity(tokens, k, n_experts, cf)
        rows.append((cf, temp, len(a2a), moved, ep * slots * d * 4, tokens * k * d * 4))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-mib", type=float, default=64.0)
    p.add_argument("--only-largest", action="store_true")
    p.add_argument("--only-dispatch", action="store_true")
    a = p.parse_args()
    if not a.only_dispatch:
        budget = int(a.budget_mib * MIB)
        fits = {(ep, None): largest(budget, ep) for ep in (1, 4, 8)}
        fits[(8, 1.25)] = largest(budget, 8, 1.25)
        print(
            f"\nLargest MoE whose ZeRO-3 step fits {a.budget_mib:g} MiB per device (Llama d128 L2, experts of 512 "
            "features, top-2, AdamW, 8 x 32 tokens, 8 simulated devices):\n"
        )
        print("| expert axis | mesh | dispatch | experts | parameters | step MiB/device | vs E = 1 |")
        print("|---|---|---|---|---|---|---|")
        for (ep, cf), (n, total, params) in fits.items():
            mesh = dict(zj.make_mesh(expert=ep).shape)
            print(
                f"| E = {ep} | {mesh} | {'dropless' if cf is None else f'capacity {cf}'} | {n} | "
                f"{params / 1e6:.2f} M | {total / MIB:.2f} | {params / fits[(1, None)][2]:.2f}x |"
            )
    if not a.only_largest:
        print(
            "\nDispatch of zj.nn.routed_experts alone, forward + backward, E = 8, 512 tokens per device of width "
            "64, 64 experts of 128 features, top-2 (float32):\n"
        )
        print(
            "| capacity | temp MiB/device | all-to-alls | f32 bytes moved/device | one row buffer E·S·d·4 | "
            "tokens·k·d·4 |"
        )
        print("|---|---|---|---|---|---|")
        for cf, temp, n, moved, buf, base in dispatch_rows():
            print(
                f"| {'dropless' if cf is None else cf} | {temp / MIB:.2f} | {n} | {moved / MIB:.2f} MiB | "
                f"{buf / MIB:.2f} MiB | {base / MIB:.2f} MiB |"
            )


if __name__ == "__main__":
    main()
