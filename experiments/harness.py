"""What the experiment scripts share, so that each keeps only what is its own.

- :func:`add_gpt_args` / :func:`gpt_config`: the experiments' GPT from the command line.
- :data:`GATHERS`: the precisions of stage 3's weight gathers the tables compare.
- :func:`compile_step`: a ZeRO train step compiled for a batch; its memory is
  ``zj.report.compiled_bytes`` (``total`` = argument + output - alias + temp: on the CPU
  backend ``peak_memory_in_bytes`` is about the arguments only); :func:`traffic` its
  collective bytes by the mesh axes each spans, read from the compiled HLO.
- :func:`table`: a markdown table from rows and column formats.
- :func:`side_by_side`: step times measured interleaved in one run, so that ratios between
  them hold on a noisy machine.

Example::

    ap = argparse.ArgumentParser()
    harness.add_gpt_args(ap, d_model=128, layers=2)
    args = ap.parse_args([])
    cfg = harness.gpt_config(args)
    state, step, compiled = harness.compile_step(cfg, zj.make_mesh(), zj.ZeroConfig(stage=3), batch=8)
    print(harness.table([zj.report.compiled_bytes(compiled)], {"temp": "{temp:,}", "total": "{total:,}"}))
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

import zerojax as zj
from zerojax import data
from zerojax.models import gpt
from zerojax.report.comm import collectives

MIB = 2**20

GATHERS = {
    "fp32": dict(compute_dtype="float32"),
    "bf16": dict(compute_dtype="bfloat16"),
    "int8": dict(compute_dtype="bfloat16", collectives={"gather_dtype": "int8"}),
}
"""Stage 3's weight gathers: in fp32, in bf16 (the compute dtype), as blockwise int8 (qwZ)."""


def add_gpt_args(
    ap: argparse.ArgumentParser, *, d_model: int = 256, layers: int = 8, batch: int = 16, seq_len: int | None = None
) -> argparse.ArgumentParser:
    """``--d-model``, ``--layers``, ``--batch`` (and ``--seq-len`` when given a default)."""
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--batch", type=int, default=batch)
    if seq_len is not None:
        ap.add_argument("--seq-len", type=int, default=seq_len)
    return ap


def gpt_config(args: argparse.Namespace, *, vocab: int = 256, head_dim: int = 64, **extra: Any) -> gpt.GPTConfig:
    """The GPT of ``args``: ``d_model / head_dim`` heads (at least one), byte vocabulary."""
    return gpt.GPTConfig(
        vocab=vocab,
        seq_len=getattr(args, "seq_len", 64),
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=max(1, args.d_model // head_dim),
        **extra,
    )


def header(cfg: gpt.GPTConfig, what: str) -> str:
    """The line above a table: the model, ``what`` was run, the devices and the JAX version."""
    d = jax.devices()
    return (
        f"GPT d{cfg.d_model} L{cfg.n_layers} ({cfg.num_params():,} parameters), {what}, "
        f"{len(d)} x {d[0].platform}, jax {jax.__version__}\n"
    )


def compile_step(
    cfg: gpt.GPTConfig,
    mesh: Any,
    config: zj.ZeroConfig,
    *,
    batch: int,
    tx: optax.GradientTransformation | None = None,
    trainable: Any = None,
) -> tuple[zj.ZeroState, zj.TrainStep, Any]:
    """The GPT's state, train step and compiled step for a ``batch`` x ``cfg.seq_len`` batch
    of the standard library's bytes (AdamW at 3e-3 unless ``tx`` is given)."""
    graphdef, params = gpt.init(cfg)
    tx = optax.adamw(3e-3) if tx is None else tx
    state = zj.init_state(params, tx, mesh=mesh, config=config, trainable=trainable)
    step = zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=config)
    tokens = next(data.windows(data.stdlib_bytes(1 << 20), batch, cfg.seq_len))
    return state, step, step.lower(state, tokens).compile()


def traffic(compiled: Any, mesh: Any, *, narrow_gathers: bool = False) -> dict[str, int]:
    """Collective bytes per device per step, keyed by the mesh axes each collective spans
    (``"data"``, ``"replica+data"``, ...). ``narrow_gathers``: count f32 all-gathers at half
    their bytes, for a step that asks for bf16 gathers which the CPU backend widens to f32."""
    out: dict[str, int] = {}
    for c in collectives(compiled.as_text()):
        nbytes = c.total_bytes
        if narrow_gathers and c.kind == "all-gather" and c.dtype == "f32":
            nbytes //= 2
        key = "+".join(c.axes(mesh))
        out[key] = out.get(key, 0) + nbytes
    return out


def table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str | Callable[[Mapping[str, Any]], str]]) -> str:
    """A markdown table: one column per ``columns`` entry, its cell a format string applied
    to the row (``"{state:,}"``) or a function of the row."""
    cell = lambda fmt, row: fmt(row) if callable(fmt) else fmt.format(**row)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(f, row) for f in columns.values()) + " |" for row in rows]
    return "\n".join(lines)


def side_by_side(runs: Mapping[str, Callable[[], Any]], repeats: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each run, the runs taking turns (``a b c a b c ...``), after
    ``warmup`` untimed rounds; each call's result is waited for (``jax.block_until_ready``)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run())
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def median_ms(times: Sequence[float]) -> float:
    return 1e3 * statistics.median(times)


def zero_setup(cfg: gpt.GPTConfig, tx: optax.GradientTransformation, *, mesh, config: zj.ZeroConfig, seed: int = 0):
    """``(state, train_step)`` of a fresh GPT under ``config``: what every experiment builds."""
    graphdef, params = gpt.init(cfg, seed)
    state = zj.init_state(params, tx, mesh=mesh, config=config)
    return state, zj.make_train_step(gpt.make_loss(graphdef), tx, mesh=mesh, config=config)
