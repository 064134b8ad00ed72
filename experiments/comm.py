"""Communication per device per step of every ZeRO stage and compute dtype, beside the paper.

For one GPT on 8 simulated CPU devices, each stage is compiled in fp32 and bf16 and its
collectives are read from the compiled HLO (``zj.report.communication_report``: every collective
counted as often as it runs, layer loops included). Volumes are given in parameter
elements (the paper's unit: an all-gather or reduce-scatter of Ψ elements moves Ψ, an
all-reduce 2Ψ) and in bytes, beside the paper's 2Ψ / 2Ψ / 2Ψ / 3Ψ.

XLA's CPU backend runs 16-bit collectives in f32, so the compiled dtypes here are f32; the
last column lists the dtypes zerojax asks for (read from the lowered program), which a GPU
keeps.

    python experiments/comm.py [--layers 8 --d-model 256 --batch 8]
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
from zerojax.report.comm import collectives  # noqa: E402
from zerojax.report.hlo import DTYPE_BYTES  # noqa: E402

PAPER = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
WHAT = {
    0: "all-reduce of gradients",
    1: "reduce-scatter of gradients + all-gather of parameters",
    2: "reduce-scatter per gradient + all-gather of parameters",
    3: "all-gather forward + all-gather backward + reduce-scatter",
}


def measure(cfg: gpt.GPTConfig, stage: int, compute_dtype: str, batch_size: int, mesh) -> dict:
    """Collectives of one compiled step: elements and bytes per device, and the dtypes asked for."""
    zc = zj.ZeroConfig(stage=stage, compute_dtype=compute_dtype)
    state, step = harness.zero_setup(cfg, optax.adamw(1e-3), mesh=mesh, config=zc)
    batch = next(data.windows(data.stdlib_bytes(1 << 20), batch_size, cfg.seq_len))
    lowered = step.lower(state, batch)
    report = zj.report.communication_report(lowered.compile())
    psi = cfg.num_params()
    small = 1e-3 * psi  # per-step scalars (loss, norms, overflow flags) are not model traffic
    kinds, elements, nbytes = {}, 0.0, 0
    for key, r in report.items():
        if key == "total":
            continue
        kind, dtype = key.split(":")
        elems = r["zero_bytes"] / DTYPE_BYTES[dtype]
        if elems / r["count"] < small:
            continue
        kinds[key] = r["count"]
        elements += elems
        nbytes += r["zero_bytes"]
    asked = sorted(
        {
            f"{c.kind} {c.dtype}"
            for c in collectives(lowered.as_text(dialect="hlo"))
            if c.bytes / DTYPE_BYTES.get(c.dtype, 4) >= small
        }
    )
    # The same volume at the dtypes asked for (what a backend that keeps 16-bit collectives moves).
    asked_bytes = 0.0
    for key in kinds:
        kind, dtype = key.split(":")
        wanted = [a.split()[1] for a in asked if a.split()[0] == kind]
        size = DTYPE_BYTES[wanted[0]] if len(wanted) == 1 else DTYPE_BYTES[dtype]
        asked_bytes += report[key]["zero_bytes"] / DTYPE_BYTES[dtype] * size
    return {
        "stage": stage,
        "compute_dtype": compute_dtype,
        "params": psi,
        "kinds": kinds,
        "elements": elements,
        "bytes": nbytes,
        "psi_units": elements / psi,
        "asked": asked,
        "asked_bytes": asked_bytes,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| stage | compute | collectives as compiled (runs per step) | volume per device per step | "
        "paper | bytes per device per step (as compiled) | dtypes zerojax asks for (lowered) | "
        "bytes at those dtypes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k.replace(':', ' ')} ×{v}" for k, v in r["kinds"].items())
        asked = ", ".join(r["asked"]) or "— (GSPMD inserts them at compile time)"
        lines.append(
            f"| {r['stage']} | {r['compute_dtype']} | {kinds} | {r['psi_units']:.3f}Ψ | "
            f"{PAPER[r['stage']]:.0f}Ψ | {r['bytes'] / 2**20:.2f} MiB | {asked} | "
            f"{r['asked_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(ap, d_model=256, layers=8, batch=8, seq_len=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    mesh = zj.make_mesh()
    psi = cfg.num_params()
    print(
        f"GPT d{cfg.d_model} L{cfg.n_layers}: Ψ = {psi:,} parameters, N = {mesh.devices.size} "
        f"{jax.devices()[0].platform} devices, AdamW, jax {jax.__version__}\n"
    )
    rows = []
    dtypes = args.dtypes.split(",")
    progress = bar(4 * len(dtypes), "comm")
    for dtype in dtypes:
        for stage in range(4):
            progress.set_postfix_str(f"stage {stage} {dtype}")
            rows.append(measure(cfg, stage, dtype, args.batch, mesh))
            progress.update(1)
    progress.close()
    print(table(rows))
    print()
    for s in range(4):
        print(f"- stage {s}: {WHAT[s]} = {PAPER[s]:.0f}Ψ")
    return rows


if __name__ == "__main__":
    main()
