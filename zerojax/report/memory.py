"""Per-device bytes of a state, measured from its arrays, and the ZeRO paper's formulas."""

from __future__ import annotations

from typing import Any

import jax

from zerojax.state import ZeroState


def _bytes_per_device(tree: Any) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def state_bytes_per_device(state: ZeroState) -> dict[str, int]:
    """Bytes each device holds for the state, read from ``addressable_shards``.

    Returns the largest per-device figure for ``params`` (with the fp32 masters where they
    are separate) and ``opt_state``, and the ``total`` of the whole state; ``replicated`` is the part of ``total`` held whole on every device (stage 3
    has none but the step counters), and ``padding`` the per-device bytes of the zeros
    that make every stage-3 parameter leaf divide over the data axis (its optimizer state
    carries the same padding per moment).

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((64, 64))}
      >>> st = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> zj.state_bytes_per_device(st)["total"] == 12 * 64 * 64 // 8 + 4 + 4 + 4
      True
    """
    params = _bytes_per_device((state.params, state.master))
    opt = _bytes_per_device(state.opt_state)
    step = _bytes_per_device((state.step, state.skipped, state.loss_scale))
    devices = set(params) | set(opt)
    totals = {d: params.get(d, 0) + opt.get(d, 0) + step.get(d, 0) for d in devices}
    replicated = 0
    for x in jax.tree.leaves(state):
        if x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
            replicated += x.nbytes
    plan = state.plan
    if plan.stage == 3:
        pad_elems = sum(l.padding * jax.numpy.dtype(l.dtype).itemsize for l in plan.layouts)
    else:
        pad_elems = 0
    return {
        "params": max(params.values()),
        "opt_state": max(opt.values()) if opt else 0,
        "total": max(totals.values()),
        "replicated": replicated if plan.n > 1 else 0,
        "padding": pad_elems // plan.n,
    }


def zero_formula_bytes(num_params: int, n: int, stage: int, *, compute_dtype: str = "float32",
                       opt_bytes: int = 8) -> float:
    """Persistent bytes per device with fp32 masters and ``opt_bytes`` of optimizer state per
    parameter (8 for Adam's m and v).

    fp32 compute: 12Ψ, 4Ψ + 8Ψ/N, 4Ψ + 8Ψ/N, 12Ψ/N. bf16/fp16 compute: stages 1–2 keep a
    replicated compute copy instead of replicated fp32 params: 2Ψ + 12Ψ/N.

    Example:
      >>> import zerojax as zj
      >>> zj.zero_formula_bytes(7.5e9, 64, 1) / 1e9
      30.9375
    """
    psi, master = float(num_params), 4
    if stage == 0:
        return (master + opt_bytes) * psi
    if stage in (1, 2):
        if compute_dtype == "float32":
            return master * psi + opt_bytes * psi / n
        return 2 * psi + (master + opt_bytes) * psi / n
    if stage == 3:
        return (master + opt_bytes) * psi / n
    raise ValueError(f"stage must be 0..3, got {stage!r}")


def compiled_bytes(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program, from ``compiled.memory_analysis()``.

    ``total`` = argument + output − alias + temp: what the program needs on a device before
    anything runs. ``host_temp`` is what XLA placed in host memory (offloading).
    """
    m = compiled.memory_analysis()
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "host_temp": int(getattr(m, "host_temp_size_in_bytes", 0)),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
