"""The largest GPT each ZeRO stage trains within a per-device memory budget, and step times.

On 8 simulated CPU devices, every device gets the same budget (``--budget-mib``). For each
stage the deepest GPT of a fixed width whose compiled train step fits the budget
(``zj.report.step_memory``: argument + output − alias + temp, from ``memory_analysis()``, found
ahead of time without allocating anything) is then built for real and trained for a few
steps; its state is measured from its arrays. This is the ZeRO paper's claim that
sharding model states lets the same devices train much larger models, shown end to end.

Then every stage trains the stage-0 model (the largest all of them fit) and the step
times are reported as ratios to stage 0, measured in the same run, stages interleaved.

    python experiments/scaling.py [--budget-mib 256 --d-model 256 --remat full --steps 3 --time-steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax import data  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MIB = 2**20


class Setup:
    """The model family, optimizer, mesh and batch shared by every measurement."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.mesh = zj.make_mesh()
        self.tx = optax.adamw(1e-4)  # small enough that a 150-layer stack without warm-up stays stable
        self.stream = data.windows(data.stdlib_bytes(1 << 20), args.batch, args.seq_len)
        self.tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), np.int32)

    def cfg(self, layers: int) -> gpt.GPTConfig:
        a = self.args
        return gpt.GPTConfig(
            seq_len=a.seq_len, d_model=a.d_model, n_layers=layers, n_heads=max(1, a.d_model // 64), remat=a.remat
        )

    def zero(self, stage: int) -> zj.ZeroConfig:
        return zj.ZeroConfig(stage=stage, compute_dtype=self.args.compute_dtype)

    def memory(self, stage: int, layers: int) -> zj.report.StepMemory:
        cfg = self.cfg(layers)
        graphdef, params = gpt.init_abstract(cfg)
        return zj.report.step_memory(
            gpt.make_loss(graphdef), params, self.tx, {"tokens": self.tokens}, mesh=self.mesh, config=self.zero(stage)
        )

    def build(self, stage: int, layers: int):
        return harness.zero_setup(self.cfg(layers), self.tx, mesh=self.mesh, config=self.zero(stage))


def largest(setup: Setup, stage: int, budget: float, max_layers: int) -> tuple[int, dict[int, int]]:
    """Deepest layer count that fits, and every total tried. A step's memory grows by about
    the same bytes per layer: the line through depths 1 and 2 predicts the boundary, and
    compiles one layer at a time from there settle it (the depth that fits and the next
    that does not are both compiled; usually four compiles in all)."""
    tried: dict[int, int] = {}

    def fits(layers: int) -> bool:
        if layers not in tried:
            tried[layers] = setup.memory(stage, layers).total
        return tried[layers] <= budget

    if not fits(1):
        return 0, tried
    if max_layers == 1 or not fits(2):
        return 1, tried
    per_layer = tried[2] - tried[1]
    layers = max_layers if per_layer <= 0 else int(min(max_layers, max(2, 1 + (budget - tried[1]) // per_layer)))
    if fits(layers):
        while layers < max_layers and fits(layers + 1):
            layers += 1
    else:
        layers -= 1
        while not fits(layers):
            layers -= 1
    return layers, tried


def train_for_real(setup: Setup, stage: int, layers: int, steps: int) -> dict:
    state, step = setup.build(stage, layers)
    arrays = zj.report.state_bytes_per_device(state)["total"]
    losses, times = [], []
    for _ in range(steps):
        batch = next(setup.stream)
        t0 = time.perf_counter()
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        times.append(time.perf_counter() - t0)
    del state, step
    return {"state_arrays": arrays, "losses": losses, "step_s": statistics.median(times[1:] or times)}


def time_stages(setup: Setup, layers: int, steps: int) -> dict[int, float]:
    """Median step time of each stage on one model, stages interleaved step by step."""
    runs = {s: setup.build(s, layers) for s in range(4)}
    times: dict[int, list[float]] = {s: [] for s in runs}
    batch = next(setup.stream)
    for s, (state, step) in runs.items():  # compile and warm up
        runs[s] = (step(state, batch)[0], step)
    for _ in range(steps):
        batch = next(setup.stream)
        for s, (state, step) in runs.items():
            t0 = time.perf_counter()
            state, m = step(state, batch)
            m["loss"].block_until_ready()
            times[s].append(time.perf_counter() - t0)
            runs[s] = (state, step)
    return {s: statistics.median(t) for s, t in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=256.0, help="memory per device")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", default="full", help="per-block remat (the paper trains with activation checkpointing)")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="real steps of each stage's largest model")
    ap.add_argument("--time-steps", type=int, default=6, help="timed steps per stage on the stage-0 model")
    ap.add_argument("--json", default=None, help="also write the results (exact bytes) here")
    args = ap.parse_args(argv)
    setup = Setup(args)
    budget = args.budget_mib * MIB
    n = setup.mesh.devices.size
    print(
        f"budget {args.budget_mib:g} MiB per device, {n} {jax.devices()[0].platform} devices, GPT width "
        f"{args.d_model}, batch {args.batch} x {args.seq_len}, AdamW, {args.compute_dtype}, remat "
        f"{args.remat}, jax {jax.__version__}\n"
    )
    results = {}
    progress = bar(5, "scaling")
    for stage in range(4):
        progress.set_postfix_str(f"stage {stage}: searching")
        layers, tried = largest(setup, stage, budget, args.max_layers)
        if layers == 0:
            raise SystemExit(
                f"stage {stage}: even one layer needs {tried[1] / MIB:.1f} MiB per device; "
                "raise --budget-mib or lower --d-model/--batch"
            )
        progress.set_postfix_str(f"stage {stage}: {layers} layers fit ({len(tried)} compiles); training it")
        real = train_for_real(setup, stage, layers, args.steps)
        progress.update(1)
        results[stage] = {
            "layers": layers,
            "params": setup.cfg(layers).num_params(),
            "total": tried[layers],
            "next": tried.get(layers + 1),
            **real,
        }
    base = results[0]["params"]
    print(
        "| stage | largest model | parameters | × stage 0 | compiled total per device | next layer needs | "
        "state per device (arrays) | loss over the real steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s, r in results.items():
        nxt = f"{r['next'] / MIB:.1f} MiB" if r["next"] else "—"
        losses = " → ".join(f"{v:.3f}" for v in r["losses"])
        print(
            f"| {s} | {r['layers']} layers | {r['params'] / 1e6:.2f}M | {r['params'] / base:.2f}× | "
            f"{r['total'] / MIB:.1f} MiB | {nxt} | {r['state_arrays'] / MIB:.1f} MiB | {losses} |"
        )

    layers0 = results[0]["layers"]
    progress.set_postfix_str("timing every stage on the stage-0 model")
    times = time_stages(setup, layers0, args.time_steps)
    progress.update(1)
    progress.close()
    print(
        f"\nStep time on the stage-0 model ({layers0} layers, {results[0]['params'] / 1e6:.2f}M parameters), "
        f"median of {args.time_steps} steps, stages interleaved:\n"
    )
    print("| stage | step time | ratio to stage 0 |")
    print("|---|---|---|")
    for s, t in times.items():
        print(f"| {s} | {1e3 * t:.0f} ms | {t / times[0]:.2f} |")
    out = {"budget_bytes": budget, "largest": results, "times": times}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
