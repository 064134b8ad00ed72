"""Per-device bytes of a state, measured from its arrays, and the ZeRO paper's formulas."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax.state import ZeroState, abstract_state


def _bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes per device of arrays (their addressable shards) or of abstract
    ``ShapeDtypeStruct`` leaves (from their shardings)."""
    out: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is None:
                raise ValueError(f"abstract leaf {x} has no sharding; build it with zj.abstract_state.")
            itemsize = _itemsize(x.dtype)
            for device, index in x.sharding.devices_indices_map(x.shape).items():
                size = math.prod(len(range(*sl.indices(dim))) for sl, dim in zip(index, x.shape))
                out[device] = out.get(device, 0) + size * itemsize
            continue
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _itemsize(dtype) -> int:
    """Bytes per element, keys (extended dtypes) included."""
    return getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize


def state_bytes_per_device(state: ZeroState) -> dict[str, int]:
    """Bytes each device holds for the state, read from ``addressable_shards`` (or, for
    an :func:`zerojax.abstract_state`, from the shardings of its leaves).

    Returns the largest per-device figure for ``params`` (with the fp32 masters where they
    are separate, and the frozen parameters, also counted apart in ``frozen``) and
    ``opt_state``, and the ``total`` of the whole state; ``replicated``
    is the part of ``total`` held whole on every device (at stage 3 only the scalars:
    step counters, scalar parameters), and ``padding`` the per-device bytes of the zeros
    stored to make sharded arrays (masters and optimizer state) divide over the data axis.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((64, 64))}
      >>> st = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> zj.state_bytes_per_device(st)["total"] == 12 * 64 * 64 // 8 + 4 + 4 + 4
      True
    """
    params = _bytes_per_device((state.params, state.master, state.frozen))
    frozen = _bytes_per_device(state.frozen)
    opt = _bytes_per_device(state.opt_state)
    other = _bytes_per_device((state.step, state.skipped, state.loss_scale, state.model_state, state.rng))
    devices = set(params) | set(opt)
    totals = {d: params.get(d, 0) + opt.get(d, 0) + other.get(d, 0) for d in devices}
    replicated = 0
    for x in jax.tree.leaves(state):
        if x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
            replicated += math.prod(x.shape) * _itemsize(x.dtype)
    plan = state.plan
    stored = list(zip(plan.opt_storage_layouts, jax.tree.leaves(state.opt_state)))
    if state.master is not None:
        stored += list(zip(plan.master_layouts, jax.tree.leaves(state.master)))
    if state.frozen is not None:
        stored += list(zip(plan.frozen_layouts, jax.tree.leaves(state.frozen)))
    pad_bytes = sum(l.padding * np.dtype(x.dtype).itemsize for l, x in stored if l.kind != "replicated")
    return {
        "params": max(params.values()),
        "frozen": max(frozen.values()) if frozen else 0,
        "opt_state": max(opt.values()) if opt else 0,
        "total": max(totals.values()),
        "replicated": replicated if plan.n > 1 else 0,
        "padding": pad_bytes // plan.n,
    }


def zero_formula_bytes(num_params: int, n: int, stage: int, *, compute_dtype: str = "float32",
                       opt_bytes: int = 8, frozen_params: int = 0) -> float:
    """Persistent bytes per device with fp32 masters and ``opt_bytes`` of optimizer state per
    trainable parameter (8 for Adam's m and v); ``num_params`` trainable parameters (Ψ_t) and
    ``frozen_params`` fp32 frozen ones (Ψ_f).

    fp32 compute: 12Ψ, 4Ψ + 8Ψ/N, 4Ψ + 8Ψ/N, 12Ψ/N. bf16/fp16 compute: stages 1–2 keep a
    replicated compute copy instead of replicated fp32 params: 2Ψ + 12Ψ/N. Frozen
    parameters add c·Ψ_f at stages 0–2 and c·Ψ_f/N at stage 3, c the bytes of the compute
    dtype (2 for bf16/fp16, 4 for fp32): they are stored in it, with no master and no
    optimizer state.

    Example:
      >>> import zerojax as zj
      >>> zj.zero_formula_bytes(7.5e9, 64, 1) / 1e9
      30.9375
    """
    if compute_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or 'float16', got {compute_dtype!r}.")
    psi, master = float(num_params), 4
    frozen = (4 if compute_dtype == "float32" else 2) * float(frozen_params)
    if stage == 0:
        return (master + opt_bytes) * psi + frozen
    if stage in (1, 2):
        if compute_dtype == "float32":
            return master * psi + opt_bytes * psi / n + frozen
        return 2 * psi + (master + opt_bytes) * psi / n + frozen
    if stage == 3:
        return (master + opt_bytes) * psi / n + frozen / n
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


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled train step, known before it runs.

    ``state`` is the persistent train state (from its shardings, what
    :func:`zerojax.state_bytes_per_device` reports once it exists), ``batch`` this device's
    share of the batch; the rest is ``compiled.memory_analysis()`` (see
    :func:`compiled_bytes`). ``total`` = argument + output − alias + temp.
    """

    state: int
    batch: int
    argument: int
    output: int
    alias: int
    temp: int
    host_temp: int

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def fits(self, budget_bytes: float) -> bool:
        """Whether the step's ``total`` is at most ``budget_bytes`` per device."""
        return self.total <= budget_bytes

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:,.1f} MiB"
        return (f"per device: total {mib(self.total)} = state {mib(self.state)} + batch "
                f"{mib(self.batch)} + temp {mib(self.temp)} (+ outputs not donated "
                f"{mib(self.output - self.alias)}, arguments other than state and batch "
                f"{mib(self.argument - self.state - self.batch)}); host temp {mib(self.host_temp)}")


def step_memory(loss_fn, params: Any, tx, batch: Any, *, mesh: Mesh, config: ZeroConfig,
                has_aux: bool = False) -> StepMemory:
    """Compiles the train step for ``params`` and ``batch`` without running it (ahead of
    time) and reports its per-device memory, so a user learns before a run whether it fits.

    ``params`` and ``batch`` may be real arrays or ``jax.ShapeDtypeStruct`` (e.g. from
    ``jax.eval_shape`` / ``nnx.eval_shape``): nothing is allocated, so a model that would
    not fit on this machine can still be planned. Batch leaves without a sharding are
    split over the data axis, as the train step splits them.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jax.ShapeDtypeStruct((2048, 2048), "float32")}
      >>> batch = jax.ShapeDtypeStruct((64, 2048), "float32")
      >>> loss_fn = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]))
      >>> mem = zj.step_memory(loss_fn, params, optax.adam(1e-3), batch,
      ...                      mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> mem.state == 12 * 2048 * 2048 // 8 + 4 + 4 + 4   # 12Ψ/N plus the step counters
      True
      >>> mem.fits(64 * 2**20)
      True
    """
    from zerojax.step import make_train_step

    state = abstract_state(params, tx, mesh=mesh, config=config)
    split = NamedSharding(state.plan.mesh, P(config.axis))

    def abstract(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=split)

    batch = jax.tree.map(abstract, batch)
    step = make_train_step(loss_fn, tx, mesh=mesh, config=config, has_aux=has_aux)
    m = compiled_bytes(step.lower(state, batch).compile())
    batch_bytes = _bytes_per_device(batch)
    return StepMemory(
        state=max(_bytes_per_device(state).values()),
        batch=max(batch_bytes.values()),
        argument=m["argument"], output=m["output"], alias=m["alias"], temp=m["temp"],
        host_temp=m["host_temp"],
    )
