"""Per-device memory of every ZeRO stage for several GPT sizes: measured beside the formula.

For each model size and stage, on 8 simulated CPU devices: the train state's bytes per
device read from its arrays (``addressable_shards``), the same from the compiled step's
``memory_analysis()`` (argument bytes less the batch), the ZeRO formula, and the step's
compiled temp and total. Prints a markdown table and draws a bar chart in the style of the
ZeRO paper's Figure 1 (the paper's own 7.5B-parameter, 64-GPU example first, from its
formula, then the measured bars):

    python experiments/memory_table.py [--sizes 128x4,256x8,384x12] [--png docs/img/memory.png]

Exits with status 1 if a measured state differs from its formula by more than 2%.
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
from zerojax.report import estimate  # noqa: E402

FORMULA = {
    "float32": {0: "12Ψ", 1: "4Ψ+8Ψ/N", 2: "4Ψ+8Ψ/N", 3: "12Ψ/N"},
    "mixed": {0: "12Ψ", 1: "2Ψ+12Ψ/N", 2: "2Ψ+12Ψ/N", 3: "12Ψ/N"},
}
MIB = 2**20
TOLERANCE = 0.02


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"128x4,256x8"`` -> [(d_model, layers), ...]."""
    sizes = []
    for item in text.split(","):
        try:
            d, layers = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--sizes item {item!r} is not D_MODELxLAYERS (e.g. 256x8)") from None
        sizes.append((d, layers))
    return sizes


def measure(cfg: gpt.GPTConfig, stage: int, compute_dtype: str, batch_size: int, mesh) -> dict:
    """One row: a real state and its compiled step for ``cfg`` at ``stage``."""
    zc = zj.ZeroConfig(stage=stage, compute_dtype=compute_dtype)
    state, step = harness.zero_setup(cfg, optax.adamw(1e-3), mesh=mesh, config=zc)
    batch = next(data.windows(data.stdlib_bytes(1 << 20), batch_size, cfg.seq_len))
    mem = zj.report.compiled_bytes(step.lower(state, batch).compile())
    arrays = zj.report.state_bytes_per_device(state)
    n = mesh.devices.size
    psi = cfg.num_params()
    formula = zj.report.zero_formula_bytes(psi, n, stage, compute_dtype=compute_dtype)
    row = {
        "d_model": cfg.d_model,
        "layers": cfg.n_layers,
        "params": psi,
        "stage": stage,
        "n": n,
        "compute_dtype": compute_dtype,
        "params_bytes": arrays["params"],
        "opt_bytes": arrays["opt_state"],
        "state_arrays": arrays["total"],
        "state_compiled": mem["argument"] - batch["tokens"].nbytes // n,
        "formula": formula,
        "temp": mem["temp"],
        "total": mem["total"],
    }
    row["error"] = max(abs(row["state_arrays"] - formula), abs(row["state_compiled"] - formula)) / formula
    del state, step
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | Ψ | stage | state, arrays | state, memory_analysis | formula | "
        "difference | compiled temp | compiled total |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kind = "float32" if r["compute_dtype"] == "float32" else "mixed"
        lines.append(
            f"| d{r['d_model']} L{r['layers']} | {r['params'] / 1e6:.2f}M | {r['stage']} | "
            f"{r['state_arrays'] / MIB:.2f} MiB | {r['state_compiled'] / MIB:.2f} MiB | "
            f"{FORMULA[kind][r['stage']]} = {r['formula'] / MIB:.2f} MiB | {100 * r['error']:.3f}% | "
            f"{r['temp'] / MIB:.2f} MiB | {r['total'] / MIB:.2f} MiB |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: str, paper_params: float = 7.5e9, paper_n: int = 64) -> None:
    """Figure-1-style bars: stages side by side, stacked by what the bytes hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(r["d_model"], r["layers"]) for r in rows})
    fig, axes = plt.subplots(1, 1 + len(sizes), figsize=(3.6 * (1 + len(sizes)), 4.2))
    stages = ["0\n(DP)", "1\n$P_{os}$", "2\n$P_{os+g}$", "3\n$P_{os+g+p}$"]
    colors = {"params": "tab:blue", "grads": "tab:orange", "opt": "tab:green", "temp": "0.85"}

    # The paper's example: fp16 params 2Ψ, fp16 grads 2Ψ, K=12 optimizer state.
    ax, psi, n = axes[0], paper_params, paper_n
    p = [2 * psi, 2 * psi, 2 * psi, 2 * psi / n]
    g = [2 * psi, 2 * psi, 2 * psi / n, 2 * psi / n]
    o = [12 * psi, 12 * psi / n, 12 * psi / n, 12 * psi / n]
    x = range(4)
    ax.bar(x, [v / 1e9 for v in p], color=colors["params"], label="parameters")
    ax.bar(x, [v / 1e9 for v in g], bottom=[v / 1e9 for v in p], color=colors["grads"], label="gradients")
    ax.bar(
        x,
        [v / 1e9 for v in o],
        bottom=[(a + b) / 1e9 for a, b in zip(p, g)],
        color=colors["opt"],
        label="optimizer states",
    )
    for i in x:
        total = estimate.paper_bytes(psi, n, i)
        ax.text(i, total / 1e9, f"{total / 1e9:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), stages, fontsize=8)
    ax.set_ylabel("GB per device")
    ax.set_title(f"ZeRO paper: Ψ = {psi / 1e9:.1f}B, N = {n}\n(formula, K = 12)", fontsize=9)

    for ax, (d, layers) in zip(axes[1:], sizes):
        rs = sorted((r for r in rows if (r["d_model"], r["layers"]) == (d, layers)), key=lambda r: r["stage"])
        pb = [r["params_bytes"] / MIB for r in rs]
        ob = [r["opt_bytes"] / MIB for r in rs]
        tb = [r["temp"] / MIB for r in rs]
        x = range(len(rs))
        ax.bar(x, pb, color=colors["params"], label="parameters")
        ax.bar(x, ob, bottom=pb, color=colors["opt"], label="optimizer states")
        ax.bar(
            x,
            tb,
            bottom=[a + b for a, b in zip(pb, ob)],
            color=colors["temp"],
            hatch="//",
            edgecolor="0.6",
            label="compiled temp (grads, activations)",
        )
        ax.scatter(
            x, [r["formula"] / MIB for r in rs], marker="_", s=400, color="black", zorder=3, label="formula (state)"
        )
        ax.set_xticks(list(x), [stages[r["stage"]] for r in rs], fontsize=8)
        ax.set_ylabel("MiB per device")
        ax.set_title(
            f"measured: GPT d{d} L{layers}, Ψ = {rs[0]['params'] / 1e6:.1f}M,\n"
            f"N = {rs[0]['n']}, {rs[0]['compute_dtype']}",
            fontsize=9,
        )
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128x4,256x8,384x12", help="D_MODELxLAYERS, comma separated")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--png", default=None, help="write the bar chart here")
    args = ap.parse_args(argv)
    mesh = zj.make_mesh()
    print(
        f"{mesh.devices.size} {jax.devices()[0].platform} devices, AdamW (fp32 masters, m, v), "
        f"compute {args.compute_dtype}, batch {args.batch} x {args.seq_len}, jax {jax.__version__}\n"
    )
    rows = []
    sizes = parse_sizes(args.sizes)
    progress = bar(4 * len(sizes), "memory_table")
    for d, layers in sizes:
        cfg = gpt.GPTConfig(vocab=args.vocab, seq_len=args.seq_len, d_model=d, n_layers=layers, n_heads=max(1, d // 64))
        for stage in range(4):
            progress.set_postfix_str(f"d{d} L{layers} stage {stage}")
            rows.append(measure(cfg, stage, args.compute_dtype, args.batch, mesh))
            progress.update(1)
    progress.close()
    print(table(rows))
    worst = max(r["error"] for r in rows)
    print(f"\nlargest difference from the formula: {100 * worst:.3f}% (limit {100 * TOLERANCE:.0f}%)")
    if args.png:
        chart(rows, args.png)
        print(f"chart: {args.png}")
    if worst > TOLERANCE:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
