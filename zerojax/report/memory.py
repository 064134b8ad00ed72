"""Per-device bytes of a state, measured from its arrays, and the ZeRO paper's formulas."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.context.batch import batch_shardings
from zerojax.state import ZeroState, abstract_state


def _in_host(x: Any) -> bool:
    """Whether an array (or abstract leaf) lives in host memory (offloaded)."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind in ("pinned_host", "unpinned_host")


def _bytes_per_device(tree: Any, memory: str | None = None) -> dict[Any, int]:
    """Bytes per device of arrays (their addressable shards) or of abstract
    ``ShapeDtypeStruct`` leaves (from their shardings); ``memory="device"`` / ``"host"``
    counts only the arrays in that memory (offloaded state is in host memory, attributed to
    the device whose shard it is)."""
    out: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        if memory is not None and _in_host(x) != (memory == "host"):
            continue
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
    stored to make sharded arrays (masters and optimizer state) divide over the data axis;
    ``device`` and ``host`` split ``total`` by memory: offloaded state
    (``ZeroConfig(offload={"optimizer": ...})``) counts in ``host``.

    Example:
      >>> import jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((64, 64))}
      >>> st = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> zj.report.state_bytes_per_device(st)["total"] == 12 * 64 * 64 // 8 + 4 + 4 + 4
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
    pad_bytes = sum(
        l.padding * np.dtype(x.dtype).itemsize // (l.tensor if l.tp else 1) for l, x in stored if l.kind != "replicated"
    )  # per tensor shard
    on = lambda memory: max(_bytes_per_device(state, memory).values(), default=0)
    return {
        "params": max(params.values()),
        "frozen": max(frozen.values()) if frozen else 0,
        "opt_state": max(opt.values()) if opt else 0,
        "total": max(totals.values()),
        "replicated": replicated if plan.shards > 1 else 0,
        "padding": pad_bytes // plan.shards,
        "device": on("device"),
        "host": on("host"),
    }


def zero_formula_bytes(
    num_params: int,
    n: int,
    stage: int,
    *,
    compute_dtype: str = "float32",
    opt_bytes: int = 8,
    frozen_params: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    memory: str = "total",
    frozen_dtype: str = "compute",
    tensor: int = 1,
    tensor_replicated: float = 0,
) -> float:
    """Persistent bytes per device with fp32 masters and ``opt_bytes`` of optimizer state per
    trainable parameter (8 for Adam's m and v); ``num_params`` trainable parameters (Ψ_t) and
    ``frozen_params`` fp32 frozen ones (Ψ_f).

    fp32 compute: 12Ψ, 4Ψ + 8Ψ/N, 4Ψ + 8Ψ/N, 12Ψ/N. bf16/fp16 compute: stages 1–2 keep a
    replicated compute copy instead of replicated fp32 params: 2Ψ + 12Ψ/N. Frozen
    parameters add c·Ψ_f at stages 0–2 and c·Ψ_f/N at stage 3, c the bytes of the compute
    dtype (2 for bf16/fp16, 4 for fp32) with ``frozen_dtype="compute"`` (as
    ``ZeroConfig.frozen_dtype``), 4 with ``"param"``: they are stored in it, with no master
    and no optimizer state.

    With offload (``ZeroConfig.offload.optimizer`` / ``offload_params``), ``memory`` picks
    the part in ``"device"`` or ``"host"`` memory (``"total"``: both): offloading the
    optimizer moves the optimizer state (opt_bytes·Ψ/N) and, at stages 1–2 in bf16/fp16,
    the sharded masters (4Ψ/N) to the host; offloading the parameters (stage 3) moves the
    masters (4Ψ/N).

    With tensor parallelism (``tensor=T``; ``n`` is then the data axis's devices, N/T), each
    device holds 1/T of every tensor-split parameter: Ψ becomes (Ψ − Ψ_r)/T + Ψ_r, where
    ``tensor_replicated`` Ψ_r counts the trainable parameters no annotation splits
    (LayerNorm scales, row-parallel biases), held by every tensor shard; frozen parameters
    are taken as split. At stage 3 with Ψ_r = 0 this is 12Ψ/(N/T · T) = 12Ψ/N for fp32 Adam.

    Example:
      >>> import zerojax as zj
      >>> zj.report.zero_formula_bytes(7.5e9, 64, 1) / 1e9
      30.9375
      >>> zj.report.zero_formula_bytes(7.5e9, 64, 3, offload_optimizer=True, memory="device") / 1e9
      0.46875
      >>> zj.report.zero_formula_bytes(7.5e9, 16, 3, tensor=4) == zj.report.zero_formula_bytes(7.5e9, 64, 3)
      True
    """
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"tensor must be a positive int (tensor-parallel degree), got {tensor!r}.")
    if not 0 <= tensor_replicated <= num_params:
        raise ValueError(f"tensor_replicated must be between 0 and num_params={num_params}, got {tensor_replicated!r}.")
    if tensor > 1:
        num_params = (num_params - tensor_replicated) / tensor + tensor_replicated
        frozen_params = frozen_params / tensor
    if compute_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or 'float16', got {compute_dtype!r}.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage!r}")
    if memory not in ("total", "device", "host"):
        raise ValueError(f"memory must be 'total', 'device' or 'host', got {memory!r}.")
    if (offload_optimizer and stage == 0) or (offload_params and stage != 3):
        raise ValueError(f"stage {stage} cannot offload that (offload_optimizer: stages 1-3; offload_params: stage 3).")
    psi, mixed = float(num_params), compute_dtype != "float32"
    if frozen_dtype not in ("compute", "param"):
        raise ValueError(
            f"frozen_dtype must be 'compute' or 'param' (as ZeroConfig.frozen_dtype), got {frozen_dtype!r}."
        )
    frozen = (4 if compute_dtype == "float32" or frozen_dtype == "param" else 2) * float(frozen_params)
    # (bytes, in host memory?) of each part of the state.
    if stage == 0:
        parts = [((4 + opt_bytes) * psi + frozen, False)]
    elif stage in (1, 2):
        forward = [(2 * psi, False), (4 * psi / n, offload_optimizer)] if mixed else [(4 * psi, False)]
        parts = forward + [(opt_bytes * psi / n, offload_optimizer), (frozen, False)]
    else:
        parts = [(4 * psi / n, offload_params), (opt_bytes * psi / n, offload_optimizer), (frozen / n, False)]
    return sum(b for b, host in parts if memory == "total" or host == (memory == "host"))


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
        "host_argument": int(getattr(m, "host_argument_size_in_bytes", 0)),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled train step, known before it runs.

    ``state`` is the persistent train state (from its shardings, what
    :func:`zerojax.report.state_bytes_per_device` reports once it exists), ``batch`` this device's
    share of the batch; the rest is ``compiled.memory_analysis()`` (see
    :func:`compiled_bytes`). ``total`` = argument + output − alias + temp.

    ``state_host`` is the part of ``state`` offloaded to host memory
    (``ZeroConfig(offload={"optimizer": ..., "params": ...})``), read from the state's
    shardings. Where the backend reports host arguments apart
    (``host_argument_size_in_bytes``), ``argument`` is device memory only; where it does not
    (the CPU backend reports every argument together), the offloaded state is counted in
    ``argument`` (and, donated, in ``output`` and ``alias``), and :attr:`device_total`
    takes it out.
    """

    state: int
    batch: int
    argument: int
    output: int
    alias: int
    temp: int
    host_temp: int
    state_host: int = 0
    host_argument: int = 0

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def device_total(self) -> int:
        """``total`` less the offloaded state where the backend counted it with the rest."""
        lumped = self.host_argument == 0
        return self.total - (self.state_host if lumped else 0)

    @property
    def _state_in_argument(self) -> int:
        """The state bytes that ``argument`` counts (all, or the device part where the
        backend reports host arguments apart)."""
        return self.state - (0 if self.host_argument == 0 else self.state_host)

    def fits(self, budget_bytes: float) -> bool:
        """Whether the step's device memory (:attr:`device_total`) is at most
        ``budget_bytes`` per device."""
        return self.device_total <= budget_bytes

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:,.1f} MiB"
        return (
            f"per device: total {mib(self.total)} = state {mib(self.state)} + batch "
            f"{mib(self.batch)} + temp {mib(self.temp)} (+ outputs not donated "
            f"{mib(self.output - self.alias)}, arguments other than state and batch "
            f"{mib(self.argument - self._state_in_argument - self.batch)}); host temp {mib(self.host_temp)}"
            + (
                f"; offloaded state {mib(self.state_host)}, device total {mib(self.device_total)}"
                if self.state_host
                else ""
            )
        )


def abstract_batch(plan: Any, batch: Any) -> Any:
    """``batch`` as ``jax.ShapeDtypeStruct`` leaves placed where the step splits them (rows
    over the batch axes, the sequence over a context axis); leaves that carry a sharding
    keep it."""
    leaves, treedef = jax.tree.flatten(batch)
    return jax.tree.unflatten(
        treedef,
        [
            x
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
            else jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)
            for x, sh in zip(leaves, batch_shardings(plan, batch))
        ],
    )


def step_memory(
    loss_fn, params: Any, tx, batch: Any, *, mesh: Mesh, config: ZeroConfig, has_aux: bool = False
) -> StepMemory:
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
      >>> mem = zj.report.step_memory(loss_fn, params, optax.adam(1e-3), batch,
      ...                      mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> mem.state == 12 * 2048 * 2048 // 8 + 4 + 4 + 4   # 12Ψ/N plus the step counters
      True
      >>> mem.fits(64 * 2**20)
      True
    """
    from zerojax.step import make_train_step

    state = abstract_state(params, tx, mesh=mesh, config=config)
    batch = abstract_batch(state.plan, batch)
    step = make_train_step(loss_fn, tx, mesh=mesh, config=config, has_aux=has_aux)
    m = compiled_bytes(step.lower(state, batch).compile())
    batch_bytes = _bytes_per_device(batch)
    return StepMemory(
        state=max(_bytes_per_device(state).values()),
        batch=max(batch_bytes.values()),
        argument=m["argument"],
        output=m["output"],
        alias=m["alias"],
        temp=m["temp"],
        host_temp=m["host_temp"],
        host_argument=m["host_argument"],
        state_host=max(_bytes_per_device(state, "host").values(), default=0),
    )
