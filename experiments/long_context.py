"""Long sequences over a context axis: memory per device against the context degree C, the
longest sequence within a per-device budget, and the context-axis collectives of the step.

The experiments' Llama (GQA, RoPE, SwiGLU) at ZeRO-3 with full remat on 8 simulated CPU
devices, as ``zj.make_mesh(context=C)`` (data = 8 / C), one sequence per data group: each
device holds 1/C of a sequence. For each C and attention (plain ops partitioned by XLA,
Ulysses, ring) the train step is compiled, not run, and read: its temp bytes (activations,
gathered layers) and state bytes per device (``zj.report.compiled_bytes``), and the collectives
over the context axis in its HLO (per execution, scanned layers counted per layer).

    python experiments/long_context.py                       # the tables in docs/long_context.md
    python experiments/long_context.py --seq-len 2048 --budget-mib 64

A table times causal ring attention alone (forward and backward, jitted, on the simulated
devices) with every chunk computed, and with the chunks the causal mask hides left out in
the contiguous and the balanced layout, beside each layout's logits per device. The last
compares packed batches (documents end to end in rows of the sequence length, with
``segment_ids`` and positions restarting per document) with the same documents one per row,
padded, at C = 1, 4, 8: compiled memory per device and step time, side by side.

    python experiments/long_context.py --only-packed          # the packed-sequence table alone
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zerojax as zj  # noqa: E402
from zerojax.models import llama  # noqa: E402
from zerojax.report.comm import collectives  # noqa: E402

ATTENTIONS = ("einsum", "ulysses", "ring")


def compiled(cfg: llama.LlamaConfig, c: int, seq: int):
    graphdef, abstract = llama.init_abstract(cfg)
    mesh, zc = zj.make_mesh(context=c), zj.ZeroConfig(stage=3)
    tx = optax.adamw(1e-4)
    state = zj.abstract_state(abstract, tx, mesh=mesh, config=zc)
    rows = 8 // c  # one sequence per data group
    batch = {
        "inputs": jax.ShapeDtypeStruct((rows, seq), jnp.int32),
        "targets": jax.ShapeDtypeStruct((rows, seq), jnp.int32),
    }
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
    return step.lower(state, batch).compile(), mesh


def context_traffic(comp, mesh) -> dict[str, tuple[int, float]]:
    """``{kind: (executions, MiB per device)}`` of the collectives whose groups span the
    context axis only."""
    out: dict[str, list] = {}
    for col in collectives(comp.as_text()):
        if col.axes(mesh) != ("context",):
            continue
        k = out.setdefault(col.kind, [0, 0.0])
        k[0] += col.count
        k[1] += col.total_bytes / 2**20
    return {k: (n, mib) for k, (n, mib) in sorted(out.items())}


def ring_work(seq: int, c: int, layout: str, skip: bool) -> list[int]:
    """Logits each device computes in causal ring attention over ``c`` devices: its own chunk,
    then each other device's chunk whole (``skip=False``) or as the kernel's rule leaves it
    (``zerojax.context.attention._causal_update``: contiguous, the whole chunk of an earlier device
    and nothing of a later one; balanced, half a chunk from every device)."""
    t = seq // c
    out = []
    for i in range(c):
        n = t * t
        for src in range(c):
            if src != i:
                n += t * t if not skip else (t * t if src < i else 0) if layout == "contiguous" else t * t // 2
        out.append(n)
    return out


def time_ring(
    seq: int, c: int, heads: int, head_dim: int, block: int, layout: str, skip: bool, repeats: int = 5
) -> float:
    """Median seconds of one jitted forward + backward of causal ring attention."""
    mesh = Mesh(np.array(jax.devices()).reshape(8 // c, c), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (8 // c, seq, heads, head_dim)) for kk in ks)
    # Every chunk computed: the causal mask given as a mask (not is_causal), which the ring
    # cannot skip by; the same values.
    mask = (
        None
        if skip
        else jnp.asarray(
            np.tril(np.ones((seq, seq), bool))[zj.context.Layout(layout, c).order(seq)][
                :, zj.context.Layout(layout, c).order(seq)
            ]
        )[None, None]
    )

    def loss(q, k, v):
        out = zj.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=skip, method="ring", layout=layout, block_size=block
        )
        return (out.astype(jnp.float32) ** 2).sum()

    sh = NamedSharding(mesh, P("data", "context"))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--budget-mib", type=float, default=48.0, help="per-device budget for the longest sequence")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=128, help="keys per chunk of the kernels' local attention")
    ap.add_argument(
        "--longest-attention",
        default="ring",
        choices=ATTENTIONS[1:],
        help="the kernel of the longest-sequence search (C > 1)",
    )
    ap.add_argument("--ring-seq", type=int, default=4096, help="sequence of the causal ring timing (0: skip it)")
    ap.add_argument("--ring-c", type=int, default=4, help="context degree of the causal ring timing")
    ap.add_argument("--only-ring", action="store_true", help="only the causal ring timing")
    ap.add_argument("--tune-seq", type=int, default=4096, help="sequence of the zj.autotune search over C (0: skip it)")
    ap.add_argument("--only-tune", action="store_true", help="only the zj.autotune search over C")
    ap.add_argument("--packed-seq", type=int, default=1024, help="row length of the packed-sequence table (0: skip)")
    ap.add_argument("--only-packed", action="store_true", help="only the packed-sequence table")
    args = ap.parse_args()
    base = llama.LlamaConfig(
        vocab=256,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        d_ff=4 * args.d_model,
        seq_len=args.seq_len,
        remat="full",
        attention_block=args.block,
    )
    print(
        f"Llama d{args.d_model} L{args.layers}, 8 heads (4 KV), ZeRO-3, AdamW, full remat, 8 x cpu, one sequence of "
        f"{args.seq_len} per data group, kernels' chunks of {args.block} keys, jax {jax.__version__}\n"
    )
    only = args.only_ring or args.only_tune or args.only_packed
    if not only:
        memory_tables(args, base)
    if args.ring_seq and (args.only_ring or not only):
        ring_table(args)
    if args.tune_seq and (args.only_tune or not only):
        tune_table(args, base)
    if args.packed_seq and (args.only_packed or not only):
        packed_table(args, base)


def documents(total: int, longest: int, seed: int = 0) -> list[int]:
    """Document lengths (uniform in [longest / 8, longest]) adding up to ``total`` tokens."""
    rng, out = np.random.default_rng(seed), []
    while sum(out) < total:
        out.append(int(rng.integers(longest // 8, longest + 1)))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def pack(lengths: list[int], seq: int, rows: int) -> dict:
    """The documents end to end in ``rows`` rows of ``seq`` tokens (first fit, largest first):
    ``segment_ids`` and ``positions`` restarting per document; tokens are arbitrary ids."""
    free, seg, pos = [seq] * rows, np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.int32)
    count = [0] * rows
    for n in sorted(lengths, reverse=True):
        r = next(i for i in range(rows) if free[i] >= n)
        a = seq - free[r]
        seg[r, a : a + n], pos[r, a : a + n] = count[r] + 1, np.arange(n)
        free[r] -= n
        count[r] += 1
    toks = (np.arange(rows * seq).reshape(rows, seq) * 7) % 256
    w = (seg > 0).astype(np.float32)
    return {
        "inputs": toks.astype(np.int32),
        "targets": np.roll(toks, -1, 1).astype(np.int32),
        "segment_ids": seg,
        "positions": pos,
        "weights": w * (w.size / w.sum()),
    }


def unpacked(lengths: list[int], longest: int, multiple: int) -> dict:
    """One document per row, padded to ``longest`` (rows padded to a ``multiple``): a key mask
    and per-target weights instead of segments."""
    rows = -(-len(lengths) // multiple) * multiple
    m = np.zeros((rows, longest), bool)
    for r, n in enumerate(lengths):
        m[r, :n] = True
    toks = (np.arange(rows * longest).reshape(rows, longest) * 7) % 256
    w = m.astype(np.float32)
    return {
        "inputs": toks.astype(np.int32),
        "targets": np.roll(toks, -1, 1).astype(np.int32),
        "mask": m,
        "weights": w * (w.size / w.sum()),
    }


def packed_table(args, base) -> None:
    """Packed rows against the same documents padded one per row: the Llama at ZeRO-3 with
    ring attention (JAX's function at C = 1), compiled memory per device and the median of 3
    steps, each pair measured side by side."""
    seq, longest = args.packed_seq, args.packed_seq // 2
    lengths = documents(8 * seq * 7 // 8, longest)  # 7/8 of 8 rows of seq: the packing fits
    packed = pack(lengths, seq, 8)
    print(
        f"\nPacked sequences: {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens "
        f"({sum(lengths)} in all), packed into 8 rows of {seq} (segment_ids, positions restarting per document) "
        f"or one per row padded to {longest}; Llama d{args.d_model} L{args.layers}, ring attention, ZeRO-3, "
        f"full remat, median of 3 steps on the simulated devices:\n"
    )
    print("| C | batch | rows x length | tokens (padding) | temp MiB/device | step seconds | packed vs padded |")
    print("|---|---|---|---|---|---|---|")
    cfg = llama.LlamaConfig(**{**base.__dict__, "attention": "ring", "seq_len": seq})
    graphdef, abstract = llama.init_abstract(cfg)
    params = llama.init(cfg)[1]
    for c in (1, 4, 8):
        padded = unpacked(lengths, longest, 8 // c)
        mesh, zc = zj.make_mesh(context=c), zj.ZeroConfig(stage=3)
        tx = optax.adamw(1e-4)
        step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
        rows = {}
        for name, batch in (("packed", packed), ("padded", padded)):
            batch = {k: jnp.asarray(v) for k, v in batch.items()}
            state = zj.init_state(params, tx, mesh=mesh, config=zc)
            temp = zj.report.compiled_bytes(step.lower(state, batch).compile())["temp"]
            state, m = step(state, batch)
            jax.block_until_ready(m["loss"])
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                state, m = step(state, batch)
                jax.block_until_ready(m["loss"])
                times.append(time.perf_counter() - t0)
            rows[name] = (batch["inputs"].shape, temp, float(np.median(times)))
        for name in ("packed", "padded"):
            (r, t), temp, sec = rows[name]
            ratio = (
                (
                    f"{rows['padded'][2] / rows['packed'][2]:.2f}x faster, "
                    f"{rows['padded'][1] / rows['packed'][1]:.2f}x less temp"
                )
                if name == "packed"
                else ""
            )
            print(
                f"| {c} | {name} | {r} x {t} | {r * t} ({r * t - sum(lengths)}) | {temp / 2**20:.2f} "
                f"| {sec:.3f} | {ratio} |",
                flush=True,
            )


def tune_table(args, base) -> None:
    """zj.autotune over the context degree: the Llama (ring attention) on sequences of
    ``--tune-seq``, a global batch of 8, within ``--budget-mib``, priced as an H100."""
    from zerojax.tuning import SearchSpace

    seq = args.tune_seq
    cfg = llama.LlamaConfig(**{**base.__dict__, "attention": "ring", "seq_len": seq})
    graphdef, abstract = llama.init_abstract(cfg)
    tokens = jax.ShapeDtypeStruct((8, seq), jnp.int32)
    space = SearchSpace(stages=(2, 3), remat=("dots", "full"), offload=("none",), prefetch=(0,), context=(1, 2, 4, 8))
    print(
        f"\nzj.autotune over the context degree: 8 sequences of {seq}, {args.budget_mib} MiB per device, "
        f"ring attention, stages 2-3, remat dots/full, every accumulation count, priced with the H100's "
        f"datasheet rates (memory from the CPU "
        f"compiler):\n"
    )
    result = zj.autotune(
        llama.make_loss(graphdef),
        abstract,
        optax.adamw(1e-4),
        {"inputs": tokens, "targets": tokens},
        mesh=zj.make_mesh(),
        memory=int(args.budget_mib * 2**20),
        device="H100",
        space=space,
    )
    print(result.table())
    print(f"\nbest: {result.best.describe()} on {dict(result.best.mesh.shape)}")


def ring_table(args) -> None:
    seq, c = args.ring_seq, args.ring_c
    print(
        f"\nCausal ring attention alone, forward + backward, {8 // c} sequences of {seq} (one per data group), "
        f"8 heads of 64, C = {c}, chunks of {args.block} keys; median of 5 calls on the simulated CPU devices "
        f"(they share the cores: the time follows the work summed over devices):\n"
    )
    print(
        "| layout | chunks the causal mask hides | seconds | vs every chunk | logits per device, millions per head and sequence (max / min over devices) |"
    )
    print("|---|---|---|---|---|")
    base = None
    for layout, skip in (("contiguous", False), ("contiguous", True), ("balanced", True)):
        sec = time_ring(seq, c, 8, 64, args.block, layout, skip)
        base = base or sec
        work = ring_work(seq, c, layout, skip)
        print(
            f"| {layout} | {'left out' if skip else 'computed'} | {sec:.3f} | {sec / base:.2f}x "
            f"| {max(work) / 1e6:.2f} / {min(work) / 1e6:.2f} |",
            flush=True,
        )


def memory_tables(args, base) -> None:
    print(
        "| C (data x context) | attention | temp MiB/device | arguments MiB/device (state, batch) | temp vs C = 1 | context-axis collectives (executions, MiB/device) |"
    )
    print("|---|---|---|---|---|---|")
    first = None
    for c in (1, 2, 4, 8):
        for att in ATTENTIONS if c > 1 else ("einsum",):
            comp, mesh = compiled(llama.LlamaConfig(**{**base.__dict__, "attention": att}), c, args.seq_len)
            b = zj.report.compiled_bytes(comp)
            first = first or b["temp"]
            traffic = ", ".join(f"{k} {n} ({mib:.2f})" for k, (n, mib) in context_traffic(comp, mesh).items()) or "-"
            print(
                f"| {8 // c} x {c} | {att} | {b['temp'] / 2**20:.2f} | {b['argument'] / 2**20:.2f} "
                f"| {first / b['temp']:.2f}x smaller | {traffic} |",
                flush=True,
            )

    print(
        f"\nLongest sequence whose compiled step (state + temp) fits {args.budget_mib} MiB per device "
        f"(lengths tried: doubling from 256 x C, then bisected to a multiple of 128 x C):\n"
    )
    print("| C | attention | longest sequence | vs C = 1 |")
    print("|---|---|---|---|")
    longest1 = None
    for c in (1, 2, 4, 8):
        att = "einsum" if c == 1 else args.longest_attention
        unit, best, seq = 128 * c, 0, 256 * c
        while True:
            comp, _ = compiled(llama.LlamaConfig(**{**base.__dict__, "attention": att, "seq_len": seq}), c, seq)
            if zj.report.compiled_bytes(comp)["total"] > args.budget_mib * 2**20:
                break
            best, seq = seq, seq * 2
        lo, hi = best, seq  # refine between the last fit and the first miss
        while hi - lo > unit:
            mid = (lo + hi) // 2 // unit * unit
            if mid in (lo, hi):
                break
            comp, _ = compiled(llama.LlamaConfig(**{**base.__dict__, "attention": att, "seq_len": mid}), c, mid)
            lo, hi = (mid, hi) if zj.report.compiled_bytes(comp)["total"] <= args.budget_mib * 2**20 else (lo, mid)
        if not lo:
            print(f"| {c} | {att} | none of {unit} or more fits | - |", flush=True)
            continue
        longest1 = longest1 or lo
        print(f"| {c} | {att} | {lo} | {lo / longest1:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
