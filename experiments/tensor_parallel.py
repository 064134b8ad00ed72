"""Tensor parallelism beside ZeRO-3: the experiments' GPT with Megatron annotations on 8
devices as data x tensor = 8x1, 4x2 and 2x4, at the same global batch and at the same rows
per data group (the model replica's batch, what tensor parallelism is meant to make room for).

For each tensor degree T the train step (ZeRO-3, AdamW, fp32) is compiled on 8 simulated
CPU devices and measured: the persistent state bytes per device, read from the arrays
(``zj.report.state_bytes_per_device``), against 12Ψ/8 and zerojax's formula with ``tensor=T``
(the parameters no annotation splits, LayerNorms and row-parallel biases, are held by
every tensor shard); the compiled program's temp bytes (activations and gathered layers:
each tensor shard computes 1/T of every column-parallel activation); collective bytes per
device per step over each mesh axis, from the HLO; and milliseconds per step (median of a
few steps after compilation; on the 2-core CPU host this says little about a GPU). A third
table compiles the same global batch without sequence parallelism, with it marked only
(``GPTConfig.sequence_parallel``: the residual stream split along the sequence over
"tensor") and with Megatron's collectives written out (``GPTConfig.sp_matmuls``), under each
remat policy (``--sp-remat``) and model width (``--sp-d-model``).

    python experiments/tensor_parallel.py [--d-model 256 --layers 2 --seq-len 128 --batch 16 --rows 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.progress import progress  # noqa: E402
from zerojax.report.comm import collectives  # noqa: E402


def measure(cfg: gpt.GPTConfig, tensor: int, batch: int, steps: int = 5) -> dict:
    graphdef, params = gpt.init(cfg)
    tx, mesh = optax.adamw(3e-4), zj.make_mesh(tensor=tensor)
    zc = zj.ZeroConfig(stage=3)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    tokens = next(data.windows(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
    compiled = step.lower(state, tokens).compile()
    axes: dict[str, int] = {}
    for c in collectives(compiled.as_text()):
        key = "+".join(c.axes(mesh))
        axes[key] = axes.get(key, 0) + c.total_bytes
    replicated = sum(l.size for l in state.plan.layouts if not l.tp)
    times = []
    state, m = step(state, tokens)
    jax.block_until_ready(m["loss"])
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, tokens)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    psi = cfg.num_params()
    return {
        "tensor": tensor,
        "data": 8 // tensor,
        "state": zj.report.state_bytes_per_device(state)["total"],
        "formula": zj.report.zero_formula_bytes(
            psi, 8 // tensor, 3, opt_bytes=8, tensor=tensor, tensor_replicated=replicated
        ),
        "paper": 12 * psi / 8,
        "temp": zj.report.compiled_bytes(compiled)["temp"],
        "axes": axes,
        "ms": 1e3 * statistics.median(times),
        "loss": float(m["loss"]),
        "replicated": replicated,
        "batch": batch,
    }


SP_VARIANTS = (("alone", False, False), ("marked", True, False), ("matmuls", True, True))


def sequence_rows(args, degrees: list[int]) -> list[dict]:
    """Compiled temp and collectives over "tensor" at the same global batch: tensor
    parallelism alone, sequence parallelism with the values marked only
    (``zj.nn.sequence_parallel`` on the residual stream, ``zj.nn.tensor_parallel`` on the
    column-parallel outputs: XLA's partitioner places the collectives) and with Megatron's
    collectives written out (``zj.nn.column_parallel`` / ``zj.nn.row_parallel``,
    ``GPTConfig.sp_matmuls``), per model width and remat policy. Compiled from abstract
    state: nothing runs."""
    import jax.numpy as jnp

    out = []
    for d in (int(v) for v in args.sp_d_model.split(",")):
        for remat in args.sp_remat.split(","):
            for t in degrees:
                for name, sp, matmuls in SP_VARIANTS if t > 1 else SP_VARIANTS[:1]:
                    cfg = gpt.GPTConfig(
                        vocab=256,
                        seq_len=args.seq_len,
                        d_model=d,
                        n_layers=args.layers,
                        n_heads=max(1, d // 64),
                        tensor_parallel=True,
                        sequence_parallel=sp,
                        sp_matmuls=matmuls,
                    )
                    graphdef, params = gpt.init_abstract(cfg)
                    tx, mesh, zc = optax.adamw(3e-4), zj.make_mesh(tensor=t), zj.ZeroConfig(stage=3, remat=remat)
                    state = zj.abstract_state(params, tx, mesh=mesh, config=zc)
                    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
                    batch = {"tokens": jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32)}
                    compiled = step.lower(state, batch).compile()
                    kinds: dict[str, int] = {}
                    for c in collectives(compiled.as_text()):
                        if "tensor" in c.axes(mesh) and c.total_bytes:
                            kinds[c.kind] = kinds.get(c.kind, 0) + c.total_bytes
                    out.append(
                        {
                            "d_model": d,
                            "remat": remat,
                            "tensor": t,
                            "variant": name,
                            "temp": zj.report.compiled_bytes(compiled)["temp"],
                            "tensor_kinds": kinds,
                        }
                    )
    return out


def print_sequence_table(rows: list[dict], batch: int) -> None:
    mib = lambda b: f"{b / 2**20:.1f}"
    base = {(r["d_model"], r["remat"]): r["temp"] for r in rows if r["tensor"] == 1}
    print(
        f"Sequence parallelism, same global batch ({batch}), ZeRO-3, compiled temp MiB per device "
        f'(against T = 1 at the same width and remat policy) and collectives over "tensor" per step '
        f"(MiB per device):\n"
    )
    print(
        "| d_model | remat | data x tensor | temp, TP alone | temp, SP marked | temp, SP matmuls | "
        "tensor-axis collectives: TP alone | SP marked | SP matmuls |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda r: ", ".join(f"{kind} {v / 2**20:.1f}" for kind, v in sorted(r["tensor_kinds"].items())) or "none"
    for d, remat in dict.fromkeys((r["d_model"], r["remat"]) for r in rows):
        for t in sorted({r["tensor"] for r in rows}):
            got = {r["variant"]: r for r in rows if (r["d_model"], r["remat"], r["tensor"]) == (d, remat, t)}
            ratio = lambda r: f"{mib(r['temp'])} ({r['temp'] / base[d, remat]:.2f}x)"
            cell = lambda v, f: f(got[v]) if v in got else "-"
            print(
                f"| {d} | {remat} | {8 // t} x {t} | {ratio(got['alone'])} | {cell('marked', ratio)} | "
                f"{cell('matmuls', ratio)} | {fmt(got['alone'])} | {cell('marked', fmt)} | {cell('matmuls', fmt)} |"
            )
    print()


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["tensor"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(t, [r["state"] / 2**20 for r in rows], "o-", label="persistent state (arrays)")
    ax.plot(t, [r["temp"] / 2**20 for r in rows], "s-", label="compiled temp (activations, gathers)")
    ax.axhline(rows[0]["paper"] / 2**20, color="0.6", ls="--", label="12Ψ/8")
    ax.set_xscale("log", base=2)
    ax.set_xticks(t, [f"{r['data']}x{r['tensor']}" for r in rows])
    ax.set_xlabel(f"data x tensor (8 devices), {rows[0]['batch'] // rows[0]['data']} rows per data group")
    ax.set_ylabel("MiB per device")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16, help="global batch of the first table")
    ap.add_argument("--rows", type=int, default=2, help="rows per data group of the second table")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tensor", default="1,2,4")
    ap.add_argument("--plot", default="", help="write the memory-vs-T plot to this PNG")
    ap.add_argument(
        "--sp-remat",
        default="none,dots,full",
        help="remat policies of the sequence-parallelism table ('' to leave it out)",
    )
    ap.add_argument("--sp-d-model", default="256,1024", help="model widths of the sequence-parallelism table")
    args = ap.parse_args(argv)
    cfg = gpt.GPTConfig(
        vocab=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=max(1, args.d_model // 64),
        tensor_parallel=True,
    )
    degrees = [int(t) for t in args.tensor.split(",")]
    runs = list(dict.fromkeys((t, b) for t in degrees for b in (args.batch, args.rows * 8 // t)))
    rows = [measure(cfg, t, b) for t, b in progress(runs, "tensor", unit="config")]
    psi = cfg.num_params()
    print(
        f"GPT d{args.d_model} L{args.layers} seq {args.seq_len} ({psi:,} parameters, {rows[-1]['replicated']:,} "
        f"not split by an annotation at T > 1: LayerNorms, row-parallel biases, embeddings), ZeRO-3, AdamW, fp32, "
        f"8 x {jax.devices()[0].platform}, jax {jax.__version__}\n"
    )
    mib = lambda b: f"{b / 2**20:.3f}"
    for title, pick in (
        (f"Same global batch ({args.batch})", lambda r: r["batch"] == args.batch),
        (
            f"Same rows per data group ({args.rows}; global batch {args.rows} x data)",
            lambda r: r["batch"] == args.rows * r["data"],
        ),
    ):
        print(f"{title}:\n")
        print(
            "| data x tensor | batch | state MiB/device (arrays) | formula (tensor=T) | 12Ψ/8 | compiled temp MiB | "
            "data-axis MiB/step | tensor-axis MiB/step | other MiB/step | ms/step | loss |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in [r for r in rows if pick(r)]:
            a = dict(r["axes"])
            d, t = a.pop("data", 0), a.pop("tensor", 0)
            print(
                f"| {r['data']} x {r['tensor']} | {r['batch']} | {mib(r['state'])} | {mib(r['formula'])} | "
                f"{mib(r['paper'])} | {mib(r['temp'])} | {mib(d)} | {mib(t)} | {mib(sum(a.values()))} | "
                f"{r['ms']:.1f} | {r['loss']:.4f} |"
            )
        print()
    if args.sp_remat:
        print_sequence_table(sequence_rows(args, degrees), args.batch)
    if args.plot:
        plot([r for r in rows if r["batch"] == args.rows * r["data"]], args.plot)
        print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
