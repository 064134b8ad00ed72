"""Per-step metrics of a run, read a step late so that reading never stalls the devices."""

from __future__ import annotations

import atexit
import collections
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from zerojax.monitor import rates
from zerojax.monitor.writers import Console, Writer

# The step's own scalar metrics a record carries, in order (those the step returns).
_STEP_METRICS = ("loss", "learning_rate", "grad_norm")
_SCALING_METRICS = ("loss_scale", "skipped_steps")


class Monitor:
    """Records every train step (loss, learning rate, gradient norm, loss scale and skipped
    steps under fp16 scaling, step time, samples/s, tokens/s, MFU, device memory) and hands
    them to ``writers`` on process 0.

    Wrap the step with :meth:`watch`; the loop is unchanged. Step ``k``'s metrics are read
    when step ``k + 1`` has been dispatched (and the last at :meth:`close`), so the host
    never waits on a step the devices are still running while the next one could be queued.
    The step time is the time between two steps' ends as the loop sees them (the first
    step's excludes its compile, which is a record of its own, announced before it starts).

    ``tokens_per_step``: tokens in one global batch (tokens/s; with ``flops_per_token``,
    MFU). ``flops_per_token``: training FLOPs per token (forward + backward; the package
    models' ``cfg.flops_per_token()``). ``flops_per_step``: FLOPs of one global step
    instead, or ``"compiled"`` to read them from the compiled step
    (:func:`zerojax.tuning.hlo_cost.loop_cost`: what the devices execute, recompute
    included; one extra compile at the first step). ``device``: a
    :class:`zerojax.tuning.DeviceSpec` or datasheet name for the peak FLOP/s (default: the
    datasheet of the mesh's devices; the CPU backend has none, so no MFU there unless one
    is given). What cannot be reported (learning rate, memory, MFU) is said once, with why.

    Example:
      >>> import io, jax, jax.numpy as jnp, optax, zerojax as zj
      >>> mesh = zj.make_mesh(devices=jax.devices()[:1])
      >>> tx = optax.sgd(0.1)
      >>> state = zj.init_state({"w": jnp.ones(3)}, tx, mesh=mesh, config=zj.ZeroConfig())
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
      >>> out = io.StringIO()
      >>> monitor = zj.monitor.Monitor([zj.monitor.Console(every=1, stream=out)], tokens_per_step=4)
      >>> step = monitor.watch(zj.make_train_step(loss, tx, mesh=mesh, config=zj.ZeroConfig()))
      >>> for _ in range(2):
      ...     state, metrics = step(state, {"x": jnp.ones((4, 3))})
      >>> monitor.close()
      >>> print(out.getvalue())  # doctest: +ELLIPSIS
      MFU: not reported; give Monitor(flops_per_token=..., tokens_per_step=...) ...
      device memory: not reported, the backend keeps no memory statistics (the CPU's)
      step 1: compiling the train step (the first call traces and compiles it)
      step 1: compiled in ... s
      step 1 | loss 9.0000 | lr 1.000e-01 | grad 10.4 | ... ms/step | ... tok/s | ... samples/s
      step 2 | loss 1.4400 | lr 1.000e-01 | grad 4.16 | ... ms/step | ... tok/s | ... samples/s
      <BLANKLINE>
    """

    def __init__(
        self,
        writers: Sequence[Writer] | None = None,
        *,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
        flops_per_step: float | str | None = None,
        device: Any = None,
    ) -> None:
        writers = [Console()] if writers is None else list(writers)
        for w in writers:
            if not isinstance(w, Writer):
                raise TypeError(
                    f"writers take zj.monitor writers (Console, JSONL, CSV, TensorBoard, WandB), got {type(w).__name__}."
                )
        for name, v in (("tokens_per_step", tokens_per_step), ("flops_per_token", flops_per_token)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"Monitor {name} must be a positive number, got {v!r}.")
        if flops_per_token is not None and flops_per_step is not None:
            raise ValueError("give flops_per_token or flops_per_step, not both: they say the same thing twice.")
        if flops_per_token is not None and tokens_per_step is None:
            raise ValueError(
                "flops_per_token needs tokens_per_step (FLOPs per step = flops_per_token x tokens_per_step)."
            )
        if flops_per_step is not None and flops_per_step != "compiled":
            if isinstance(flops_per_step, bool) or not isinstance(flops_per_step, (int, float)) or flops_per_step <= 0:
                raise ValueError(f"flops_per_step must be a positive number or 'compiled', got {flops_per_step!r}.")
        self.writers = writers if jax.process_index() == 0 else []
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_token * tokens_per_step if flops_per_token is not None else flops_per_step
        self.device = device
        self._pending: collections.deque = collections.deque()
        self._last_done: float | None = None
        self._peak: float | None = None
        self._devices = 1
        self._mesh_devices: list = []
        self._scaling = False
        self._noted: set[str] = set()
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    def watch(self, step: Callable) -> Callable:
        """``step`` with every call recorded; same arguments, same results. ``step`` is a
        :class:`zerojax.TrainStep` (or any ``step(state, batch) -> (state, metrics)``), or a
        step that updates its first argument in place and returns the metrics:
        ``zj.nnx.make_train_step``'s, called ``metrics = step(optimizer, batch)``."""
        return _Watched(self, step)

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """Hands any record (an evaluation's, say) to the writers now, after the train steps
        still pending (records stay in step order); values are read from the devices (a
        sync) and must be scalars."""
        self.flush()
        self._emit(kind, int(step), {k: _scalar(k, v) for k, v in values.items()})

    def note(self, text: str) -> None:
        for w in self.writers:
            w.note(text)

    def flush(self) -> None:
        """Reads and writes every step still pending (waits for them)."""
        while self._pending:
            self._record_one()

    def close(self) -> None:
        """Writes the pending steps and closes the writers; a second call does nothing. Also
        runs at interpreter exit (a preempted run that exits still writes its last steps)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for w in self.writers:
                w.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals

    def _note_once(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.note(text)

    def _emit(self, kind: str, step: int, values: dict[str, float]) -> None:
        if self._closed:
            raise ValueError("this Monitor is closed; build a new one for a new run.")
        for w in self.writers:
            w.write(kind, step, values)

    def _first_call(self, step: Callable, state: Any, batch: Any, called: Callable) -> None:
        """``step``: the zerojax step that runs (its mesh and config); ``called``: what the
        loop calls, as it is called (``called.lower(state, batch)`` for compiled FLOPs)."""
        mesh = getattr(step, "mesh", None)
        self._devices = int(mesh.devices.size) if mesh is not None else jax.device_count()
        self._mesh_devices = list(mesh.local_devices) if mesh is not None else jax.local_devices()
        config = getattr(step, "config", None)
        self._scaling = bool(getattr(config, "scaling", False))
        self._peak, why = rates.peak_flops(self.device, mesh, getattr(config, "compute_dtype", "float32"))
        if self.flops_per_step == "compiled":
            self.note("reading the step's FLOPs from its compiled program (one more compile)")
            self.flops_per_step = rates.compiled_flops(called, state, batch) * self._devices
        if self.flops_per_step is None:
            self._note_once(
                "mfu",
                "MFU: not reported; give Monitor(flops_per_token=..., tokens_per_step=...) (the package models: "
                "cfg.flops_per_token()) or flops_per_step='compiled'",
            )
        elif self._peak is None:
            self._note_once("mfu", f"MFU: not reported, {why}")
        if not rates.memory(self._mesh_devices):
            self._note_once("memory", "device memory: not reported, the backend keeps no memory statistics (the CPU's)")

    def _called(self, metrics: dict, rows: int | None, returned: float) -> None:
        self._pending.append((metrics, rows, returned))
        while len(self._pending) > 1:
            self._record_one()

    def _record_one(self) -> None:
        metrics, rows, returned = self._pending.popleft()
        keys = [k for k in _STEP_METRICS if k in metrics]
        if self._scaling:
            keys += [k for k in _SCALING_METRICS if k in metrics]
        host = jax.device_get({k: metrics[k] for k in (*keys, "step")})
        done = time.perf_counter()
        # The loop's period: from the previous step's end (the first step: from its dispatch,
        # its compile excluded) to this one's, as the loop sees them.
        seconds = max(done - (returned if self._last_done is None else self._last_done), 1e-9)
        self._last_done = done
        values = {k: float(host[k]) for k in keys}
        values["step_time_s"] = seconds
        if rows is not None:
            values["samples_per_s"] = rows / seconds
        if self.tokens_per_step is not None:
            values["tokens_per_s"] = self.tokens_per_step / seconds
        if isinstance(self.flops_per_step, (int, float)) and self._peak is not None:
            values["mfu"] = self.flops_per_step / (seconds * self._devices * self._peak)
        values.update(rates.memory(self._mesh_devices))
        self._emit("train", int(host["step"]) + 1, values)


class _Watched:
    def __init__(self, monitor: Monitor, step: Callable) -> None:
        self.monitor, self.step = monitor, step
        self._calls = 0

    def __getattr__(self, name: str) -> Any:  # lower(), config, mesh, ... of the step
        return getattr(self.step, name)

    def __call__(self, state: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        m = self.monitor
        first = self._calls == 0
        if first:
            # zj.nnx's step runs a zerojax TrainStep on the optimizer's state: its mesh,
            # config and program are that step's.
            inner = getattr(self.step, "step_for", None)
            m._first_call(self.step if inner is None else inner(state), state, batch, self.step)
            m.note("step 1: compiling the train step (the first call traces and compiles it)")
            begin = time.perf_counter()
        out = self.step(state, batch, *args, **kwargs)
        returned = time.perf_counter()
        metrics = _metrics_of(out, self.step)
        self._calls += 1
        if first:
            m._emit("compile", 1, {"compile_s": returned - begin})
        m._called(metrics, _rows(batch), returned)
        return out


def _metrics_of(out: Any, step: Any) -> Mapping:
    """The metrics of a step's result: ``(state, metrics)``, or the metrics alone from a step
    that updates its argument in place (zj.nnx's)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[1]
    if isinstance(out, Mapping):
        return out
    raise TypeError(
        f"a watched step returns (state, metrics) (zj.make_train_step's) or the metrics alone (zj.nnx's, which "
        f"updates the optimizer in place); {getattr(step, '__name__', type(step).__name__)} returned "
        f"{type(out).__name__}."
    )


def _rows(batch: Any) -> int | None:
    leaves = jax.tree.leaves(batch)
    shape = getattr(leaves[0], "shape", ()) if leaves else ()
    return int(shape[0]) if shape else None


def _scalar(name: str, v: Any) -> float:
    a = np.asarray(jax.device_get(v))
    if a.size != 1:
        raise ValueError(f"metric {name!r} has shape {a.shape}; a record holds scalars.")
    return float(a.reshape(()))


def _close_at_exit(ref: weakref.ref) -> None:
    monitor = ref()
    if monitor is not None:
        monitor.close()
