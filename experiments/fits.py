"""Will it fit? Compile the GPT's train step for a mesh of any size, ahead of time.

Nothing is allocated: parameters come from ``nnx.eval_shape`` and the state from
``zj.abstract_state``, so a model far larger than this machine is compiled for, say, 64
devices (simulated CPU devices when no accelerator is present) and each stage's per-device
bytes are read from ``memory_analysis()``, beside the closed-form estimates.

    python experiments/fits.py --model gpt2-xl --devices 64 --batch 64 --precision bf16 --remat full --budget-gib 80

On simulated CPU devices the figures are the CPU compiler's: state and batch bytes are
exact for any backend, temporaries are an estimate of a GPU's (the CPU backend fuses
differently and runs 16-bit collectives in f32). Run it on the GPU machine itself for
that backend's own figure.
"""

from __future__ import annotations

import argparse
import os
import sys

MIB = 2**20


def fmt(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / MIB:,.2f} MiB"


def parse_args(argv=None) -> argparse.Namespace:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from zerojax.report.estimate import MODELS, GPTShape

    MODELS = {name: shape for name, shape in MODELS.items() if isinstance(shape, GPTShape)}  # what gpt.py builds
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small", help="one of: " + ", ".join(MODELS))
    ap.add_argument("--devices", type=int, default=8, help="devices on the data axis")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 1 per device)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--budget-gib", type=float, default=None, help="device memory, to answer fits / does not")
    args = ap.parse_args(argv)
    if args.model not in MODELS:
        ap.error(f"unknown --model {args.model!r}; this script builds the experiments' GPT, one of {', '.join(MODELS)}")
    if args.devices < 1:
        ap.error(f"--devices must be >= 1, got {args.devices}")
    args.batch = args.batch or args.devices
    if args.batch % args.devices:
        ap.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax

    import zerojax as zj
    from zerojax.models import gpt
    from zerojax.report import estimate

    devices = jax.devices()
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices here")
    mesh = zj.make_mesh(devices[: args.devices])
    shape = estimate.MODELS[args.model]
    seq_len = args.seq_len or shape.seq_len
    cfg = gpt.GPTConfig(
        vocab=shape.vocab,
        seq_len=seq_len,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=max(1, shape.d_model // 64),
        mlp_ratio=shape.mlp_ratio,
        remat=args.remat,
    )
    graphdef, params = gpt.init_abstract(cfg)
    psi = cfg.num_params()
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.precision]
    tokens = jax.ShapeDtypeStruct((args.batch, seq_len + 1), "int32")
    tx = optax.adamw(1e-4)
    n = args.devices
    print(
        f"{args.model}: Ψ = {psi / 1e9:.3f}B parameters, seq {seq_len}, global batch {args.batch}; "
        f"N = {n} {devices[0].platform} devices; {args.precision} compute, fp32 masters, AdamW; "
        f"remat {args.remat}; jax {jax.__version__}\n"
    )
    print("| stage | paper (K=12) | zerojax state formula | compiled: state | temp | total per device | fits |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        zc = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
        mem = zj.report.step_memory(gpt.make_loss(graphdef), params, tx, {"tokens": tokens}, mesh=mesh, config=zc)
        formula = zj.report.zero_formula_bytes(psi, n, stage, compute_dtype=dtype)
        fits = "—" if args.budget_gib is None else ("yes" if mem.fits(args.budget_gib * 2**30) else "no")
        rows.append(
            {"stage": stage, "state": mem.state, "temp": mem.temp, "total": mem.total, "formula": formula, "fits": fits}
        )
        print(
            f"| {stage} | {fmt(estimate.paper_bytes(psi, n, stage))} | {fmt(formula)} | {fmt(mem.state)} | "
            f"{fmt(mem.temp)} | {fmt(mem.total)} | {fits} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
