"""LoRA-style fine-tuning of the experiments' GPT over a frozen base, beside full fine-tuning.

Every block's linear layers get LoRA adapters (``nnx.LoRALinear``, rank ``--rank``); only the
adapters train (``zj.init_state(..., trainable=gpt.is_lora)``), the base is frozen: no
optimizer state, no gradient, stored in the compute dtype. For each stage: the persistent
bytes per device read from the arrays, the formula, the compiled step's temporaries, and
the loss after a short fine-tune on the standard library's source bytes.

    python experiments/lora.py [--d-model 256 --layers 8 --rank 8 --steps 30]
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
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MIB = harness.MIB


def measure(cfg: gpt.GPTConfig, stage: int, lora: bool, args) -> dict:
    graphdef, params = gpt.init(cfg)
    n_lora = sum(
        x.size for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if "lora" in jax.tree_util.keystr(path)
    )
    psi = sum(x.size for x in jax.tree.leaves(params))
    psi_t, psi_f = (n_lora, psi - n_lora) if lora else (psi, 0)
    tx = optax.adamw(args.lr)
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype=args.precision)
    state = zj.init_state(params, tx, mesh=mesh, config=zc, trainable=gpt.is_lora if lora else None)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, cfg.seq_len)
    first = next(stream)
    temp = zj.report.compiled_bytes(step.lower(state, first).compile())["temp"]
    losses, batch = [], first
    for _ in range(args.steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        batch = next(stream)
    return {
        "stage": stage,
        "run": "LoRA" if lora else "full",
        "psi_t": psi_t,
        "psi_f": psi_f,
        "state": zj.report.state_bytes_per_device(state)["total"],
        "formula": zj.report.zero_formula_bytes(
            psi_t, mesh.devices.size, stage, compute_dtype=args.precision, frozen_params=psi_f
        ),
        "temp": temp,
        "loss_first": losses[0],
        "loss_last": sum(losses[-5:]) / len(losses[-5:]),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--stages", default="0,1,2,3")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args, lora_rank=args.rank)
    stages = [int(s) for s in args.stages.split(",")]
    progress = bar(2 * len(stages), "lora")
    rows = []
    for stage in stages:
        for lora in (False, True):
            progress.set_postfix_str(f"stage {stage} {'LoRA' if lora else 'full'}")
            rows.append(measure(cfg, stage, lora, args))
            progress.update(1)
    progress.close()
    r0 = rows[1]
    print(
        f"GPT d{args.d_model} L{args.layers} with LoRA rank {args.rank} on every block linear: "
        f"Ψ = {r0['psi_t'] + r0['psi_f']:,} ({r0['psi_t']:,} adapter parameters, "
        f"{100 * r0['psi_t'] / (r0['psi_t'] + r0['psi_f']):.1f}%), {args.precision} compute, AdamW, "
        f"{len(jax.devices())} x {jax.devices()[0].platform}, batch {args.batch} x 64, {args.steps} steps, "
        f"jax {jax.__version__}\n"
    )
    mib = lambda key: lambda r: f"{r[key] / MIB:.2f} MiB"
    columns = {
        "stage": "{stage}",
        "fine-tune": "{run}",
        "state per device (arrays)": mib("state"),
        "formula": mib("formula"),
        "compiled temp": mib("temp"),
        "loss: first -> last 5": "{loss_first:.3f} -> {loss_last:.3f}",
    }
    print(harness.table(rows, columns))
    return rows


if __name__ == "__main__":
    main()
