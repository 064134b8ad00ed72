"""zj.autotune, checked: the plans it picks without running a step, then every plan run.

Part 1 (8 simulated CPU devices): the experiments' GPT (layers in a ``scan``) at two sizes
(``gpt6``: d_model 128, 6 layers, 37.8 MiB, where remat changes the time; ``gpt``: d_model
256, 4 layers, 28 MiB) and an MLP stack (unrolled), each with a memory budget that stages 0
and 1 cannot meet (``gpt6``'s admits stage 0 with remat). The tuner searches
(its time, and the candidates compiled, pruned by the formula, decided without compiling and
sharing a program are printed). Then, as validation only: each returned plan is compiled
directly (``zj.report.step_memory``: against the budget and the tuner's figure) and run, one warm-up
step and ``--rounds`` timed steps each, the plans taking turns in a shuffled order each round
so that a busy stretch of the machine falls on all of them; reported are the Spearman rank
correlation of predicted and measured (median) step times and how far the chosen plan is from
the fastest measured. For the MLP the search is also run exhaustively (every candidate the
formula leaves compiled): its plans are the ones measured, and the fast search's decisions
(same best plan, nothing ruled out that fits, nothing dominated predicted faster) are checked
against it. ``--top N`` measures only the N plans predicted fastest (one per program), and
``--passes P`` runs P blocks of ``--rounds`` interleaved rounds one after the other, each
block's medians reported apart, so that a verdict that holds in every block is not one busy
minute's. ``--remat-family`` also measures every remat policy at the fastest setting where
all of them fit, side by side with what the cost model counts for each.

Part 2 (``--paper``, its own process: 64 simulated devices): the plan picked for the ZeRO
paper's 7.5B-parameter model on 64 H100s with 80 GB each, compiled ahead of time for 64
devices on the CPU backend and priced with the H100's datasheet rates.

    python experiments/autotune.py [--models gpt6,gpt,mlp] [--rounds 11] [--top 5 --passes 3 --remat-family] [--png docs/img/autotune.png] [--json out.json]
    python experiments/autotune.py --paper

Part 1 takes 12 to 16 minutes and part 2 about 6 on a busy 2-core machine, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt6,gpt,mlp", help="gpt6, gpt and/or mlp")
    ap.add_argument("--rounds", type=int, default=11, help="timed steps per plan and pass (after one warm-up step)")
    ap.add_argument("--top", type=int, default=0, help="measure the N plans predicted fastest (0: every plan)")
    ap.add_argument("--passes", type=int, default=1, help="blocks of --rounds interleaved rounds, reported apart")
    ap.add_argument(
        "--remat-family",
        action="store_true",
        help="also measure every remat policy at the fastest setting where all of them fit",
    )
    ap.add_argument("--png", default=None, help="predicted vs measured step time (needs matplotlib)")
    ap.add_argument("--json", default=None, help="write every plan's figures here")
    ap.add_argument("--paper", action="store_true", help="part 2: the 7.5B model on 64 abstract H100s, 80 GB")
    ap.add_argument("--paper-batch", type=int, default=512, help="part 2's global batch in 2048-token sequences")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 64 if args.paper else 8)
    # Validation compiles each plan twice (step_memory, then the step it runs): cache them, in a
    # directory of this run's own, so that the search's time is never a cache's.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="zerojax-autotune-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.paper:
        return paper(args)
    out = {"jax": jax.__version__, "models": {}}
    for name in args.models.split(","):
        out["models"][name] = run_model(name, args)
    if args.png:
        plot(out["models"], args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


# --- the models -------------------------------------------------------------------------


def _gpt(cfg, memory: str, space: dict) -> dict:
    import jax
    import numpy as np
    import optax

    from zerojax.models import gpt

    graphdef, params = gpt.init(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (32, cfg.seq_len + 1), dtype=np.int32)
    desc = (
        f"GPT d_model {cfg.d_model}, {cfg.n_layers} layers (scan), {cfg.n_heads} heads, seq {cfg.seq_len}, "
        f"Ψ = {cfg.num_params():,}; global batch 32; AdamW, fp32"
    )
    return dict(
        loss_fn=gpt.make_loss(graphdef),
        params=params,
        tx=optax.adamw(1e-3),
        batch={"tokens": jax.numpy.asarray(tokens)},
        memory=memory,
        space=space,
        desc=desc,
    )


def gpt6_setup():
    from zerojax.models import gpt

    return _gpt(gpt.GPTConfig(vocab=256, seq_len=64, d_model=128, n_layers=6, n_heads=2), "37.8MiB", {})


def gpt_setup():
    from zerojax.models import gpt

    return _gpt(gpt.GPTConfig(vocab=256, seq_len=32, d_model=256, n_layers=4, n_heads=4), "28MiB", {})


def mlp_loss(params, batch):
    import jax
    import jax.numpy as jnp

    h = batch["x"]
    for layer in params["layers"]:  # unrolled: no layer loop, so remat and prefetch change nothing
        h = h + jax.nn.gelu(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def mlp_setup():
    import jax.numpy as jnp
    import numpy as np
    import optax

    d, layers, rows = 1024, 4, 64
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
    params = {"layers": [{"w": w(d, d), "b": jnp.zeros((d,))} for _ in range(layers)], "out": w(d, 1)}
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, d)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, 1)), jnp.float32),
    }
    psi = layers * (d * d + d) + d
    desc = f"MLP {layers} x {d} (unrolled), Ψ = {psi:,}; global batch {rows}; AdamW, fp32"
    return dict(
        loss_fn=mlp_loss,
        params=params,
        tx=optax.adamw(1e-3),
        batch=batch,
        memory="36MiB",
        space={"accum": (1, 2)},
        exhaustive=True,
        desc=desc,
    )


SETUPS = {"gpt6": gpt6_setup, "gpt": gpt_setup, "mlp": mlp_setup}


# --- part 1 -----------------------------------------------------------------------------


def run_model(name: str, args) -> dict:
    import jax

    import zerojax as zj
    from zerojax.tuning import SearchSpace

    s = SETUPS[name]()
    mesh = zj.make_mesh()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s["params"])
    batch_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s["batch"])
    print(f"\n## {name}: {s['desc']}; {s['memory']} per device; 8 CPU devices, jax {jax.__version__}\n", flush=True)
    tune = lambda exhaustive: zj.autotune(
        s["loss_fn"],
        shapes,
        s["tx"],
        batch_shapes,
        mesh=mesh,
        memory=s["memory"],
        space=SearchSpace(**s["space"]),
        exhaustive=exhaustive,
        verbose=True,
    )
    result = tune(False)
    print(result.table(), flush=True)
    spec = result.device
    print(
        f"\ndevice rates (calibrated): {spec.peak_flops / 1e9:.2f} GFLOP/s, {spec.hbm_bandwidth / 1e9:.2f} GB/s "
        f"memory, {spec.link_bandwidth / 1e9:.2f} GB/s links, {spec.collective_latency * 1e3:.2f} ms per collective "
        f"(per device; 8 devices share the host's cores)",
        flush=True,
    )
    checked = result
    if s.get("exhaustive"):  # validate the search's rules, and the model over every plan that fits
        checked = tune(True)
        print(f"\nexhaustive search (every candidate the formula leaves compiled): {checked.summary()}")
        check_rules(result, checked)

    # Validation: compile each distinct program directly, then run them all in turns.
    plans = list({p.program: p for p in reversed(checked.plans)}.values())[::-1]  # one plan per program
    if args.top:
        plans = plans[: args.top]
    family = remat_family(checked.plans) if args.remat_family else []
    plans += [p for p in family if p.program not in {q.program for q in plans}]
    rows = []
    for plan in plans:
        direct = zj.report.step_memory(s["loss_fn"], shapes, s["tx"], batch_shapes, mesh=mesh, config=plan.config)
        rows.append(
            {
                "plan": plan.describe(),
                "stage": plan.config.stage,
                "predicted_bytes": plan.memory.device,
                "tuner_compiled_bytes": plan.memory.compiled,
                "direct_bytes": direct.device_total,
                "predicted_s": plan.time,
                "parts": plan.cost.breakdown(spec),
                "flops": plan.cost.flops,
                "bytes_accessed": plan.cost.bytes_accessed,
                "comm_bytes": plan.cost.comm_bytes,
                "collectives": plan.cost.collectives,
                "same_program": [p.describe() for p in checked.plans if p.program == plan.program][1:],
            }
        )
    load = os.getloadavg()[0]
    measured = measure([p.config for p in plans], s, mesh, args.rounds * args.passes)
    for row, times in zip(rows, measured):
        row["measured_s"] = sorted(times)[len(times) // 2]
        row["fastest_s"] = min(times)
        row["times"] = times
    chosen = next(i for i, p in enumerate(plans) if p.program == result.best.program)
    report(name, result, rows, chosen, (load, os.getloadavg()[0]), args.rounds * args.passes)
    if args.passes > 1:
        report_passes(rows, chosen, args.rounds, args.passes)
    if family:
        report_remat(rows, [p.describe() for p in family])
    return {
        "desc": s["desc"],
        "budget": result.budget,
        "search_seconds": result.search_seconds,
        "compiled": result.compiled,
        "pruned": len(result.pruned),
        "skipped": len(result.skipped),
        "shared": result.shared,
        "candidates": result.candidates,
        "rows": rows,
        "chosen": chosen,
        "device": {
            k: getattr(spec, k) for k in ("peak_flops", "hbm_bandwidth", "link_bandwidth", "collective_latency")
        },
    }


def remat_family(plans) -> list:
    """The plans predicted fastest that differ in their remat policy only: the first
    (stage, accumulation, offload, prefetch, gather) setting, in predicted order, at which
    every remat policy of the search fits, one plan per policy."""
    policies = {p.config.remat for p in plans}
    groups: dict = {}
    for p in plans:  # fastest predicted first
        c = p.config
        key = (
            c.stage,
            c.grad_accum_steps,
            c.offload.optimizer,
            c.offload.params,
            c.prefetch,
            c.collectives.gather_dtype,
        )
        groups.setdefault(key, {}).setdefault(c.remat, p)
    full = [g for g in groups.values() if set(g) == policies and len(policies) > 1]
    return sorted(full[0].values(), key=lambda p: p.time) if full else []


def report_remat(rows: list[dict], family: list[str]) -> None:
    """The remat policies side by side at one setting: what the model counts (FLOPs, bytes
    accessed) and predicts, and what each ran at."""
    print("\nremat side by side (the same stage, accumulation and offload; each plan measured with the others):\n")
    print("| plan | FLOPs per device | bytes accessed | predicted | compute, memory | measured, median |")
    print("|---|---|---|---|---|---|")
    for r in (r for r in rows if r["plan"] in family):
        parts = r["parts"]
        print(
            f"| {r['plan']} | {r['flops'] / 1e9:.2f} G | {r['bytes_accessed'] / 2**20:.0f} MiB | "
            f"{r['predicted_s'] * 1e3:.0f} ms | {parts['compute'] * 1e3:.0f} ms, {parts['memory'] * 1e3:.0f} ms | "
            f"{r['measured_s'] * 1e3:.0f} ms |",
            flush=True,
        )


def check_rules(fast, full) -> None:
    """The fast search's decisions against the exhaustive one: the same best plan; no
    candidate ruled out fits; no dominated candidate predicted faster than its dominator."""
    time_of = {p.config: p.time for p in full.plans}
    ruled_out_fit = [s for s in fast.skipped if s.reason == "ruled out" and s.candidate.config in time_of]
    faster = [
        s
        for s in fast.skipped
        if s.reason == "dominated"
        and s.candidate.config in time_of
        and s.by.config in time_of
        and time_of[s.candidate.config] < time_of[s.by.config]
    ]
    print(
        f"rules checked: same best plan as the exhaustive search: "
        f"{'yes' if fast.best.config == full.best.config else 'NO: ' + full.best.describe()}; candidates ruled "
        f"out that fit: {len(ruled_out_fit)}; dominated candidates predicted faster than the plan dominating "
        f"them: {len(faster)} (of {sum(s.reason == 'dominated' for s in fast.skipped)} dominated, "
        f"{sum(s.reason == 'ruled out' for s in fast.skipped)} ruled out)"
    )
    for s in ruled_out_fit + faster:
        print(f"  {s.reason}: {s.candidate.describe()} (by {s.by.describe()})")


def measure(configs, s, mesh, rounds: int) -> list[list[float]]:
    """Seconds per step of each config: one warm-up step each, then ``rounds`` rounds in which
    every config runs one step, in an order shuffled each round (the same seed every run)."""
    import jax
    import numpy as np

    import zerojax as zj

    live = []
    for cfg in configs:
        state = zj.init_state(s["params"], s["tx"], mesh=mesh, config=cfg)
        step = zj.make_train_step(s["loss_fn"], s["tx"], mesh=mesh, config=cfg)
        state, m = step(state, s["batch"])
        jax.block_until_ready(m["loss"])
        live.append([step, state])
    times = [[] for _ in configs]
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for i in order.permutation(len(live)):
            step, state = live[i]
            t0 = time.perf_counter()
            state, m = step(state, s["batch"])
            jax.block_until_ready(m["loss"])
            times[i].append(time.perf_counter() - t0)
            live[i][1] = state
    return times


def spearman(a, b) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    import numpy as np

    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def report(name: str, result, rows: list[dict], chosen: int, load: tuple[float, float], rounds: int) -> None:
    fits = all(r["direct_bytes"] <= result.budget for r in rows)
    ratios = [r["predicted_bytes"] / r["direct_bytes"] for r in rows]
    pred, meas = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    rho = spearman(pred, meas)
    rho_fast = spearman(pred, [r["fastest_s"] for r in rows])
    off = meas[chosen] / min(meas) - 1
    print(f"\n### {name}: validation (each plan compiled directly, and run {rounds} times: median and fastest)\n")
    print(
        "| # | plan | predicted memory | compiled directly | predicted / compiled | predicted time | "
        "measured, median | fastest |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        same = f" (= {'; '.join(r['same_program'])})" if r["same_program"] else ""
        print(
            f"| {i} | {r['plan']}{same} | {r['predicted_bytes'] / MIB:.2f} MiB | {r['direct_bytes'] / MIB:.2f} MiB | "
            f"{r['predicted_bytes'] / r['direct_bytes']:.3f} | {r['predicted_s'] * 1e3:.0f} ms | "
            f"{r['measured_s'] * 1e3:.0f} ms | {r['fastest_s'] * 1e3:.0f} ms |"
        )
    stages = sorted({r["stage"] for r in rows})
    print(
        f"\nbudget {result.budget / MIB:.1f} MiB; stages returned: {stages}; every plan's directly compiled memory "
        f"within the budget: {'yes' if fits else 'NO'}; predicted / compiled: {min(ratios):.3f} to "
        f"{max(ratios):.3f} (the {result.margin:.0%} margin; the tuner's compiled figure equals the direct one: "
        f"{'yes' if all(r['tuner_compiled_bytes'] == r['direct_bytes'] for r in rows) else 'NO'})"
    )
    print(
        f"chosen plan ({rows[chosen]['plan']}): {meas[chosen] * 1e3:.0f} ms measured, {off:+.1%} from the "
        f"fastest measured ({min(meas) * 1e3:.0f} ms, {rows[meas.index(min(meas))]['plan']}): "
        f"{'within' if off <= 0.10 else 'NOT within'} 1.10x"
    )
    print(
        f"Spearman rank correlation, predicted vs measured step time over {len(rows)} plans: {rho:.2f} "
        f"({'>=' if rho >= 0.8 else 'below'} 0.8; against each plan's fastest step: {rho_fast:.2f}); host load "
        f"average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores while measuring"
    )
    print(
        f"search: {result.search_seconds:.0f} s; {result.candidates} candidates: {result.compiled} compiled, "
        f"{len(result.pruned)} pruned by the formula, {len(result.skipped)} decided without compiling, "
        f"{result.shared} shared a compiled program",
        flush=True,
    )


def report_passes(rows: list[dict], chosen: int, rounds: int, passes: int) -> None:
    """Each block of ``rounds`` rounds on its own: the medians, and the chosen plan against
    the fastest of the measured plans in that block."""
    print(f"\nper pass ({passes} blocks of {rounds} interleaved rounds, one after the other), median ms:\n")
    print("| plan | " + " | ".join(f"pass {i + 1}" for i in range(passes)) + " |")
    print("|---|" + "---|" * passes)
    med = [[float(sorted(r["times"][i * rounds : (i + 1) * rounds])[rounds // 2]) for i in range(passes)] for r in rows]
    for r, m in zip(rows, med):
        print(f"| {r['plan']} | " + " | ".join(f"{x * 1e3:.0f}" for x in m) + " |")
    ratios = [med[chosen][i] / min(m[i] for m in med) for i in range(passes)]
    print(
        "chosen / fastest measured, per pass: "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f"; worst {max(ratios):.3f} ({'within' if max(ratios) <= 1.10 else 'NOT within'} 1.10x)",
        flush=True,
    )
    for r, m in zip(rows, med):
        r["pass_medians_s"] = m


def plot(models: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install -e '.[experiments]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.4), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        pred = [r["predicted_s"] * 1e3 for r in m["rows"]]
        meas = [r["measured_s"] * 1e3 for r in m["rows"]]
        colors = ["tab:blue" if r["stage"] == 3 else "tab:orange" for r in m["rows"]]
        ax.scatter(pred, meas, c=colors, s=30)
        c = m["chosen"]
        ax.scatter(pred[c : c + 1], meas[c : c + 1], s=160, facecolors="none", edgecolors="red", label="chosen plan")
        for i, (x, y) in enumerate(zip(pred, meas), 1):
            ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        rho = spearman(pred, meas)
        ax.set_xlabel("predicted step time (ms)")
        ax.set_ylabel("measured step time (ms)")
        ax.set_title(f"{name}: Spearman {rho:.2f} over {len(pred)} plans\n(orange: stage 2, blue: stage 3)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# --- part 2 -----------------------------------------------------------------------------


def paper(args) -> dict:
    import jax
    import optax

    import zerojax as zj
    from zerojax.models import gpt
    from zerojax.report.estimate import MODELS

    shape = MODELS["gpt-7.5b"]
    cfg = gpt.GPTConfig(
        vocab=shape.vocab,
        seq_len=shape.seq_len,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=shape.d_model // 64,
    )  # as fits.py and `zerojax autotune --model` do
    graphdef, params = gpt.init_abstract(cfg)
    tokens = jax.ShapeDtypeStruct((args.paper_batch, cfg.seq_len + 1), "int32")
    print(
        f"## The ZeRO paper's 7.5B model: GPT d_model {cfg.d_model}, {cfg.n_layers} layers, seq {cfg.seq_len}, "
        f"Ψ = {cfg.num_params():,}; global batch {args.paper_batch}; bf16 compute, fp32 masters, AdamW; 64 H100 "
        f"(80 GB), compiled ahead of time for 64 simulated CPU devices; jax {jax.__version__}\n",
        flush=True,
    )
    result = zj.autotune(
        gpt.make_loss(graphdef),
        params,
        optax.adamw(1e-4),
        {"tokens": tokens},
        mesh=zj.make_mesh(),
        memory="80GB",
        config=zj.ZeroConfig(compute_dtype="bfloat16"),
        device="H100",
        verbose=True,
    )
    print(result.table(limit=10))
    from zerojax.tuning.command import code

    print(f"\nbest: {code(result.best.config)}")
    return {"search_seconds": result.search_seconds, "best": code(result.best.config)}


if __name__ == "__main__":
    main()
