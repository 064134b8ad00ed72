"""Tokens per second and MFU of the experiments' GPT on one accelerator, ZeRO stages 0 and 3.

Each configuration (stage × remat policy, and for stage 3 each ``--prefetch`` depth and each
``--offload`` setting; bf16 compute on fp32 masters) is compiled, warmed
up, then timed over ``--steps`` steps; the table gives step time, tokens/s, model FLOPs
utilisation (``GPTConfig.flops_per_token()`` × tokens/s ÷ the chip's peak; recompute is
not counted as useful work) and the device's peak memory where the backend reports it.

    python experiments/gpu_throughput.py                       # GPT ~350M, seq 1024, on GPU 0
    python experiments/gpu_throughput.py --json $OUT/gpu.json  # also write the rows as JSON

After the throughput table it prints the remat policies' memory table with the offload
policies (``experiments/remat_table.py --policies none,names,offload_names,dots_no_batch,
offload_dots --check-offload``): host bytes and device bytes of each, and whether each
offload policy really moved its values to host memory (``--no-remat-table`` skips it).

The offload rows (stage 3, the last ``--remat`` policy, prefetch 0) keep the optimizer state
in host memory with the update on the host (``optimizer``) or streamed through the device
(``optimizer-device``), and also the parameters (``params``), or half of the state
(``ratio0.5``, a partial offload); their "state on device / in host memory" columns come
from the arrays, their peak memory from the device's counters.

A long-context table follows (``--long-seqs``; empty to skip): one attention's forward and
backward on the chip, bf16, causal, at each length, as JAX's XLA function, cuDNN's (where
the backend has it) and zerojax's chunked local attention (what every device of a ring or
Ulysses step computes; ``zj.context.attention.chunked_attention``): time, TFLOP/s of the causal
half of the logits' matmuls, and the compiled temp bytes (a length that does not fit
says so instead of stopping the script).

A model-attention table follows (``--no-model-attention`` skips it): the package's Llama
(``zj.models.Llama``: ``--attn-layers`` blocks of ``--attn-d-model``, ``--attn-heads`` heads,
bf16 compute on fp32 masters, batch ``--attn-batch``) trained one step at ``--attn-seq``
tokens with ``attention="einsum"`` (the exact attention, whose ``[B, N, T, T]`` scores it
materialises) and with the default ``attention="fused"``: step time, the compiled step's temp
bytes, and which attention the compiled step runs (``zerojax.models.attention_choice.ran``: cuDNN's
by its ``__cudnn$fmha`` custom call, the others by their scope names).

A pipeline table follows (``--pipeline-stages``; empty to skip): the same GPT at stage 3 on
``P`` stages of the host's devices (``zj.make_mesh(pipeline=P)``, GPipe at ``M = 2P``
micro-batches and the circular schedule at ``M = P``) against ``P = 1`` on the same devices: step time, tokens/s and the ratio. It needs ``P``
devices; on a host with fewer it says so and measures nothing (one GPU has no pipeline).

A monitor table follows (``--monitor-steps``; 0 to skip): the same GPT at stage 3 stepped
with no reads, with ``float(loss)`` after every step (a hand-written print's host sync) and
through ``zj.monitor`` (each step read once the next is queued), in turns, three rounds
(``experiments/monitor_overhead.py``).

XLA's GPU overlap flags (``zerojax.xla_flags``) are set before JAX starts (set
``ZEROJAX_NO_OVERLAP_FLAGS=1`` to measure without them); the table header prints them.

Peak bf16 FLOP/s is looked up from the device kind (H100/H200: 989 TFLOP/s dense, A100:
312); elsewhere pass ``--peak-tflops``. On a CPU it runs too (use a small ``--d-model``),
which checks the script, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerojax.xla_flags import apply_gpu_overlap_flags  # noqa: E402

# XLA reads its flags once, when JAX starts its backends: the overlap flags go first.
if not os.environ.get("ZEROJAX_NO_OVERLAP_FLAGS"):
    apply_gpu_overlap_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from experiments import monitor_overhead, remat_table  # noqa: E402
from experiments.progress import bar  # noqa: E402
from zerojax.models import attention_choice as zattn  # noqa: E402
from zerojax.models import gpt, llama  # noqa: E402

OFFLOAD_POLICIES = "none,names,offload_names,dots_no_batch,offload_dots"

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_flops(device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in device.device_kind:
            return tflops * 1e12
    return None


OFFLOAD = {
    "none": {},
    "optimizer": dict(offload={"optimizer": True, "update": "auto"}),
    "optimizer-device": dict(offload={"optimizer": True, "update": "device"}),
    "params": dict(offload={"optimizer": True, "params": True, "update": "auto"}),
    "ratio0.5": dict(offload={"optimizer": True, "update": "auto", "ratio": 0.5}),  # partial (Twin-Flow)
}


def measure(
    cfg: gpt.GPTConfig, stage: int, batch: int, steps: int, device, prefetch: int = 0, offload: str = "none"
) -> dict:
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-4, b2=0.95, weight_decay=0.1)
    mesh = zj.make_mesh([device])
    zc = zj.ZeroConfig(stage=stage, compute_dtype="bfloat16", grad_clip=1.0, prefetch=prefetch, **OFFLOAD[offload])
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    placed = zj.report.state_bytes_per_device(state)
    del params
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    rng = np.random.default_rng(0)
    tokens = jax.device_put(rng.integers(0, cfg.vocab, (batch, cfg.seq_len + 1), dtype=np.int32), device)
    place = step.update_place(state) if offload != "none" else "device"
    t0 = time.perf_counter()
    state, m = step(state, {"tokens": tokens})
    float(m["loss"])
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        state, m = step(state, {"tokens": tokens})
    float(m["loss"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, {"tokens": tokens})
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    stats = device.memory_stats() or {}
    del state, step
    t = statistics.median(times)
    return {
        "stage": stage,
        "remat": cfg.remat,
        "prefetch": prefetch,
        "offload": offload,
        "update": place,
        "state_device": placed["device"],
        "state_host": placed["host"],
        "step_s": t,
        "tokens_per_s": batch * cfg.seq_len / t,
        "compile_s": compile_s,
        "loss": float(m["loss"]),
        "peak_bytes": stats.get("peak_bytes_in_use"),
    }


def long_context(seqs: list[int], heads: int, block: int, peak: float | None, head_dim: int = 128) -> list[dict]:
    """One causal attention (batch 1, bf16), forward and backward, per implementation and
    length: median time of 5 calls, and the compiled program's temp bytes."""
    import jax.numpy as jnp

    impls = {
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "zerojax chunked": lambda q, k, v: zj.context.attention.chunked_attention(
            q, k, v, is_causal=True, block_size=block
        ),
    }
    rows = []
    for seq in seqs:
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (1, seq, heads, head_dim), jnp.bfloat16) for kk in ks)
        flops = 3 * 2 * 2 * seq * seq * heads * head_dim / 2  # fwd + bwd (2x) of QK^T and PV, causal half
        for name, fn in impls.items():
            row = {"seq": seq, "impl": name}
            try:
                grad = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
                compiled = grad.lower(q, k, v).compile()
                row["temp_bytes"] = zj.report.compiled_bytes(compiled)["temp"]
                jax.block_until_ready(compiled(q, k, v))
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled(q, k, v))
                    times.append(time.perf_counter() - t0)
                row["s"] = statistics.median(times)
                row["tflops"] = flops / row["s"] / 1e12
                row["of_peak"] = flops / row["s"] / peak if peak else None
            except Exception as e:  # not on this backend, or out of memory: say so, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
    if rows:
        print(
            f"\nLong context: one causal attention, batch 1, {heads} heads of {head_dim}, bf16, forward + backward "
            f"(chunked: {block} keys per chunk):\n"
        )
        print("| sequence | attention | time | TFLOP/s (causal) | of peak | compiled temp |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['seq']} | {r['impl']} | {r['error']} | | | |")
                continue
            share = f"{100 * r['of_peak']:.1f}%" if r["of_peak"] is not None else "n/a"
            print(
                f"| {r['seq']} | {r['impl']} | {1e3 * r['s']:.1f} ms | {r['tflops']:.1f} | {share} "
                f"| {r['temp_bytes'] / 2**20:,.1f} MiB |"
            )
    return rows


def model_attention(args, device) -> list[dict]:
    """One training step of the package's Llama at a long sequence, per ``attention`` value:
    median step time of ``--steps`` steps, the compiled step's temp bytes, and which attention
    the compiled step runs."""
    rows = []
    for attention in ("einsum", "fused"):
        cfg = llama.LlamaConfig(
            vocab=args.attn_vocab,
            d_model=args.attn_d_model,
            n_layers=args.attn_layers,
            n_heads=args.attn_heads,
            d_ff=args.attn_d_ff,
            seq_len=args.attn_seq,
            dtype="bfloat16",
            attention=attention,
        )
        row = {"attention": attention, "seq": args.attn_seq, "batch": args.attn_batch, "head_dim": cfg.hd}
        try:
            graphdef, params = llama.init(cfg)
            tx = optax.adamw(1e-4)
            mesh = zj.make_mesh([device])
            zc = zj.ZeroConfig(stage=0, compute_dtype="bfloat16")
            state = zj.init_state(params, tx, mesh=mesh, config=zc)
            del params
            step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, cfg.vocab, (args.attn_batch, args.attn_seq + 1), dtype=np.int32)
            batch = {"tokens": jax.device_put(tokens, device)}
            compiled = step.lower(state, batch).compile()
            row["temp_bytes"] = zj.report.compiled_bytes(compiled)["temp"]
            row["ran"] = list(zattn.ran(compiled))
            state, m = step(state, batch)
            float(m["loss"])
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, m = step(state, batch)
                float(m["loss"])
                times.append(time.perf_counter() - t0)
            row["step_s"] = statistics.median(times)
            row["loss"] = float(m["loss"])
            del state, step
        except Exception as e:  # out of memory, or a kernel the backend lacks: say so, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    print(
        f"\nModel attention: zj.models.Llama, d{args.attn_d_model} L{args.attn_layers}, {args.attn_heads} heads of "
        f"{args.attn_d_model // args.attn_heads}, bf16 compute, batch {args.attn_batch} x {args.attn_seq} tokens, "
        "one AdamW step:\n"
    )
    print("| attention | ran (compiled step) | step time | compiled temp |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['attention']} | {r['error']} | | |")
            continue
        print(
            f"| {r['attention']} | {', '.join(r['ran']) or 'none found'} | {1e3 * r['step_s']:.1f} ms | "
            f"{r['temp_bytes'] / 2**20:,.1f} MiB |"
        )
    return rows


def pipeline_rows(args, stages: list[int]) -> list[dict]:
    """Stage-3 steps of the GPT on P pipeline stages x (devices / P) data devices, M = 2P
    micro-batches (GPipe) and the circular schedule at M = P (R = 2 rounds where the layers
    split so, else 1), and on all devices without a pipeline (P = 1), side by side."""
    import optax

    n = len(jax.devices())
    usable = [p for p in stages if 1 < p <= n and n % p == 0 and args.layers % p == 0]
    for p in stages:
        if p not in usable:
            print(
                f"pipeline P={p}: needs {p} devices dividing the host's {n} and the {args.layers} layers; not measured"
            )
    if not usable:
        return []
    cfg = gpt.GPTConfig(
        vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    graphdef, params = gpt.init(cfg)
    loss_fn, tx = gpt.make_loss(graphdef), optax.adamw(1e-4)
    rows = []
    runs = [(1, "gpipe", 1, 1)]
    for p in usable:
        runs += [(p, "gpipe", 2 * p, 1), (p, "circular", p, 2 if args.layers % (2 * p) == 0 else 1)]
    for p, schedule, micro, repeats in runs:
        mesh = zj.make_mesh(pipeline=p)
        group = {"microbatches": micro, "schedule": schedule, "repeats": repeats}
        config = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", pipeline=group)
        batch_rows = args.batch * n
        tokens = jax.numpy.zeros((batch_rows, args.seq_len + 1), jax.numpy.int32)
        state = zj.init_state(params, tx, mesh=mesh, config=config)
        step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=config)
        state, m = step(state, {"tokens": tokens})
        jax.block_until_ready(m["loss"])
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = step(state, {"tokens": tokens})
            jax.block_until_ready(m["loss"])
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows.append(
            {
                "P": p,
                "M": micro,
                "schedule": schedule,
                "R": repeats,
                "step_s": t,
                "tokens_per_s": batch_rows * args.seq_len / t,
            }
        )
    print(f"\nPipeline, stage 3, bf16, {n} devices, global batch {args.batch * n} x {args.seq_len}:\n")
    print("| P | schedule | M | R | step time | tokens/s | x P=1 |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['P']} | {r['schedule']} | {r['M']} | {r['R']} | {1e3 * r['step_s']:.1f} ms | "
            f"{r['tokens_per_s']:,.0f} | {rows[0]['step_s'] / r['step_s']:.2f} |"
        )
    return rows


def monitor_table(args, device) -> list[dict]:
    """What watching costs: the first row's model (ZeRO-3, bf16) stepped with no reads, with
    ``float(loss)`` after every step, and through ``zj.monitor`` (read a step late), side
    by side (experiments/monitor_overhead.py)."""
    cfg = gpt.GPTConfig(
        vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(1e-4, b2=0.95, weight_decay=0.1)
    mesh = zj.make_mesh([device])
    zc = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", grad_clip=1.0)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    del params
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=zc)
    rng = np.random.default_rng(0)
    batches = [
        {"tokens": jax.device_put(rng.integers(0, cfg.vocab, (args.batch, cfg.seq_len + 1), dtype=np.int32), device)}
        for _ in range(2)
    ]
    state, m = step(state, batches[0])
    float(m["loss"])
    rows, state = monitor_overhead.loops_side_by_side(
        step, state, batches, args.monitor_steps, 3, args.batch * cfg.seq_len
    )
    del state, step
    print(f"\nWatching a run (ZeRO-3 bf16, {args.monitor_steps} steps x 3 rounds, medians):\n")
    print(monitor_overhead.table(rows))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stages", default="0,3")
    ap.add_argument("--remat", default="none,dots_no_batch,full")
    ap.add_argument("--prefetch", default="0,1", help="stage-3 prefetch depths to measure")
    ap.add_argument(
        "--offload",
        default="optimizer,optimizer-device,params,ratio0.5",
        help=f"stage-3 offload rows ({', '.join(o for o in OFFLOAD if o != 'none')}; '' for none)",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s of the device")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--no-remat-table", action="store_true", help="skip the remat/offload memory table")
    ap.add_argument(
        "--long-seqs",
        default="8192,32768,131072",
        help="sequence lengths of the long-context attention table (empty: skip it)",
    )
    ap.add_argument("--long-heads", type=int, default=16, help="heads of 128 in the long-context table")
    ap.add_argument("--long-block", type=int, default=1024, help="keys per chunk of the chunked attention")
    ap.add_argument(
        "--no-model-attention", action="store_true", help="skip the model-attention table (einsum against fused)"
    )
    ap.add_argument("--attn-seq", type=int, default=8192, help="sequence length of the model-attention table")
    ap.add_argument("--attn-d-model", type=int, default=1024, help="d_model of the model-attention table's Llama")
    ap.add_argument("--attn-layers", type=int, default=4, help="layers of the model-attention table's Llama")
    ap.add_argument("--attn-heads", type=int, default=8, help="heads of the model-attention table's Llama")
    ap.add_argument("--attn-d-ff", type=int, default=2816, help="MLP features of the model-attention table's Llama")
    ap.add_argument("--attn-vocab", type=int, default=32000, help="vocabulary of the model-attention table's Llama")
    ap.add_argument("--attn-batch", type=int, default=1, help="batch of the model-attention table")
    ap.add_argument("--pipeline-stages", default="2,4", help="pipeline degrees of the pipeline table (empty: skip)")
    ap.add_argument(
        "--monitor-steps", type=int, default=20, help="steps per loop of the monitor-overhead table (0: skip)"
    )
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    peak = peak_flops(device, args.peak_tflops)
    rows = []
    remats, stages = args.remat.split(","), [int(s) for s in args.stages.split(",")]
    prefetches = [int(p) for p in args.prefetch.split(",")]
    offloads = [o for o in args.offload.split(",") if o]
    for o in offloads:
        if o not in OFFLOAD:
            raise SystemExit(f"--offload: unknown setting {o!r}; choose from {', '.join(OFFLOAD)}")
    runs = [
        (remat, stage, pf, "none") for remat in remats for stage in stages for pf in (prefetches if stage == 3 else [0])
    ]
    runs += [(remats[-1], 3, 0, o) for o in offloads if o != "none"]
    progress = bar(len(runs), "gpu_throughput")
    for remat, stage, pf, offload in runs:
        cfg = gpt.GPTConfig(
            vocab=args.vocab,
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            remat=remat,
        )
        progress.set_postfix_str(f"stage {stage} remat {remat} prefetch {pf} offload {offload}")
        r = measure(cfg, stage, args.batch, args.steps, device, pf, offload)
        r["model_tflops_per_s"] = cfg.flops_per_token() * r["tokens_per_s"] / 1e12
        r["mfu"] = cfg.flops_per_token() * r["tokens_per_s"] / peak if peak else None
        rows.append(r)
        progress.update(1)
    progress.close()
    print(
        f"{device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; GPT {cfg.num_params() / 1e6:.0f}M parameters (d{args.d_model} "
        f"L{args.layers}, seq {args.seq_len}, vocab {args.vocab}), batch {args.batch} x {args.seq_len} tokens, "
        f"bf16 compute, fp32 masters, AdamW; {cfg.flops_per_token() / 1e9:.2f} GFLOP per token; peak "
        f"{'%.1f TFLOP/s' % (peak / 1e12) if peak else 'unknown (pass --peak-tflops)'}\n"
    )
    print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}\n")
    print(
        "| stage | remat | prefetch | offload (update on) | step time | tokens/s | model TFLOP/s | MFU | "
        "peak memory | state on device | state in host memory | compile |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = gib(r["peak_bytes"]) if r["peak_bytes"] else "n/a"
        off = "none" if r["offload"] == "none" else f"{r['offload']} ({r['update']})"
        print(
            f"| {r['stage']} | {r['remat']} | {r['prefetch']} | {off} | {1e3 * r['step_s']:.1f} ms | "
            f"{r['tokens_per_s']:,.0f} | {r['model_tflops_per_s']:.1f} | {mfu} | {mem} | {gib(r['state_device'])} | "
            f"{gib(r['state_host'])} | {r['compile_s']:.1f} s |"
        )
    offload = None
    if not args.no_remat_table:
        print("\nRemat policies, ZeRO-3 (device and host bytes from memory_analysis):\n")
        table = remat_table.main(["--policies", OFFLOAD_POLICIES])
        failures = remat_table.offload_failures(table)
        for line in failures or ["every offload policy moved its values to host memory"]:
            print(f"offload check: {line}")
        offload = {"rows": table, "failures": failures}
    long_rows = long_context([int(x) for x in args.long_seqs.split(",") if x], args.long_heads, args.long_block, peak)
    attention_rows = [] if args.no_model_attention else model_attention(args, device)
    pipe_rows = pipeline_rows(args, [int(x) for x in args.pipeline_stages.split(",") if x])
    monitor_rows = monitor_table(args, device) if args.monitor_steps else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device.device_kind,
                    "jax": jax.__version__,
                    "args": vars(args),
                    "rows": rows,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "remat_offload": offload,
                    "long_context": long_rows,
                    "model_attention": attention_rows,
                    "pipeline": pipe_rows,
                    "monitor": monitor_rows,
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
