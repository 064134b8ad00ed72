"""Saving and restoring ZeRO states with orbax-checkpoint.

Each process writes only the shards it holds; orbax writes a step into a temporary
directory and renames it when complete, so a save killed half-way is never listed as a
checkpoint and the previous one stays restorable. Saves are asynchronous: training goes
on while the arrays are written; :func:`wait` (also run at interpreter exit) blocks until
they are on disk. On CPython 3.12.0 and 3.12.1, which refuse to start a thread once the
interpreter has begun to exit (CPython issue gh-113964, fixed in 3.12.2), a save still in
flight at exit could not finish, so there every save completes before it returns (with one
warning saying so).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from zerojax import nvme, on_stall
from zerojax.checkpoint import canonical
from zerojax.config import ZeroConfig
from zerojax.optim.offload import with_split
from zerojax.optim.update import check_optimizer
from zerojax.sharding.plan import make_plan
from zerojax.state import ZeroState, check_alive, is_init_fn

Directory = str | os.PathLike | ocp.CheckpointManager


class CheckpointMismatchError(ValueError):
    """The checkpoint holds another model or optimizer than the restore asks for (leaves,
    shapes, frozen mask, model state or optimizer state differ): a wrong restore target,
    never a damaged checkpoint."""


class CheckpointNotSavedError(RuntimeError):
    """orbax declined to write a step: the directory already holds that step or a later one
    (orbax writes only steps newer than its newest)."""


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which checkpoints to keep: the last ``keep_last`` (None: all), plus every step that
    is a multiple of ``keep_every`` (None: none extra)."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}.")


# One manager per directory, with the retention it was made for.
_MANAGERS: dict[str, tuple[ocp.CheckpointManager, Retention]] = {}
# Managers users passed in: waited for at exit and when a step times out, never closed here.
_USER_MANAGERS: list[ocp.CheckpointManager] = []


def _manager(directory: Directory, retention: Retention | None = None) -> ocp.CheckpointManager:
    """The manager for ``directory``. ``retention=None`` (reading) takes the directory's
    current manager whatever its retention; a save passes its own retention, and a cached
    manager made for another one is finished, closed and replaced."""
    if isinstance(directory, ocp.CheckpointManager):
        if not any(m is directory for m in _USER_MANAGERS):
            _USER_MANAGERS.append(directory)
        return directory
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"a checkpoint directory is a path or an orbax CheckpointManager, got {directory!r}.")
    path = os.path.abspath(os.fspath(directory))
    cached = _MANAGERS.get(path)
    if cached is not None and (retention is None or cached[1] == retention):
        return cached[0]
    if cached is not None:
        cached[0].wait_until_finished()
        cached[0].close()
    retention = retention or Retention()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=retention.keep_last, keep_period=retention.keep_every, create=True, enable_async_checkpointing=True
    )
    mngr = ocp.CheckpointManager(path, options=options)
    _MANAGERS[path] = (mngr, retention)
    return mngr


def _all_managers() -> list[ocp.CheckpointManager]:
    return [m for m, _ in _MANAGERS.values()] + list(_USER_MANAGERS)


def _describe(directory: Directory) -> str:
    if isinstance(directory, ocp.CheckpointManager):
        return f"{os.fspath(directory.directory)!r}"
    return repr(os.fspath(directory))


def save_checkpoint(
    directory: Directory,
    state: ZeroState,
    step: int,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    wait: bool = False,
    extra: dict | None = None,
) -> None:
    """Saves ``state`` as checkpoint ``step`` under ``directory``, asynchronously.

    ``directory`` is a path or your own ``orbax.checkpoint.CheckpointManager`` (whose
    options then decide retention and asynchrony). Only each process's own shards are
    written. ``keep_last`` / ``keep_every`` set the retention of the directory for this
    save: a call without them keeps every step. ``wait=True`` blocks until the checkpoint
    is complete; otherwise it completes in the background, and at the latest when the
    interpreter exits (on CPython 3.12.0–3.12.1, before it returns: see the module docstring).
    ``extra`` (a JSON-serialisable dict: a data position, a run's counters) is saved in the
    same step directory, complete or absent together with the state; read it back with
    :func:`checkpoint_extra`.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, zerojax as zj
      >>> mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.adam(1e-3)
      >>> params = {"w": jnp.ones((13, 7))}
      >>> state = zj.init_state(params, tx, mesh=mesh, config=cfg)
      >>> d = tempfile.mkdtemp()
      >>> zj.save_checkpoint(d, state, step=0, wait=True)
      >>> restored = zj.restore_checkpoint(d, params, tx, mesh=mesh, config=zj.ZeroConfig(stage=1))
      >>> restored.params["w"].shape
      (13, 7)
    """
    if not isinstance(state, ZeroState):
        raise TypeError(f"save_checkpoint takes a zj.init_state state, got {type(state).__name__}.")
    check_alive(state, "save_checkpoint")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}.")
    if isinstance(directory, ocp.CheckpointManager) and (keep_last or keep_every):
        raise ValueError(
            "keep_last / keep_every apply to a directory zerojax manages; with your own "
            "CheckpointManager set max_to_keep / keep_period in its options."
        )
    if extra is not None:
        _check_json(extra)
    mngr = _manager(directory, Retention(keep_last, keep_every))
    _wait_at_exit()
    arrays, meta = canonical.to_canonical(nvme.materialize(state))  # an NVMe run's state read back from disk
    items = dict(state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta.to_json()))
    if extra is not None:
        items["extra"] = ocp.args.JsonSave(extra)
    if not mngr.save(step, args=ocp.args.Composite(**items)) and (mngr.latest_step() or 0) >= step:
        raise CheckpointNotSavedError(
            f"checkpoint step {step} was not saved to {_describe(directory)}: it already holds step "
            f"{mngr.latest_step()} (orbax writes only steps newer than its newest). Save a later step, or move "
            f"the steps from {step} on out of the directory."
        )
    if not wait and _EXIT_CANNOT_FINISH_SAVES:
        _warn_synchronous()
    if wait or _EXIT_CANNOT_FINISH_SAVES:
        mngr.wait_until_finished()


def _check_json(extra: Any) -> None:
    import json

    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of JSON values, got {type(extra).__name__}.")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold JSON values only (str, int, float, bool, None, lists, dicts): {e}") from None


def checkpoint_extra(directory: Directory, step: int) -> dict | None:
    """The ``extra`` dict saved with checkpoint ``step`` (None when it was saved without one).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, zerojax as zj
      >>> st = zj.init_state({"w": jnp.ones(8)}, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig())
      >>> d = tempfile.mkdtemp()
      >>> zj.save_checkpoint(d, st, step=3, wait=True, extra={"data": {"position": 96}})
      >>> zj.checkpoint.checkpoint_extra(d, 3)
      {'data': {'position': 96}}
    """
    steps = checkpoint_steps(directory)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {_describe(directory)}; it has steps {steps}.")
    return read_step_json(directory, step, "extra")


def _path(directory: Directory) -> str:
    if isinstance(directory, ocp.CheckpointManager):
        return os.fspath(directory.directory)
    return os.path.abspath(os.fspath(directory))


def read_step_json(directory: Directory, step: int, item: str) -> Any:
    """The JSON item ``item`` (``"extra"``, ``"meta"``) of checkpoint ``step`` read from its
    file by this process alone (no collective, unlike an orbax restore), or None when the
    step has no such item. Raises ``OSError`` / ``ValueError`` when the file does not read."""
    path = os.path.join(_path(directory), str(step), item, "metadata")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# CPython 3.12.0 and 3.12.1 refuse new threads once exit begins (gh-113964), and finishing an
# asynchronous orbax save needs new threads: on them, saves complete before returning.
_EXIT_CANNOT_FINISH_SAVES = (3, 12) <= sys.version_info[:3] < (3, 12, 2)
_WARNED: list[bool] = []


def _warn_synchronous() -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            f"zerojax: on Python {sys.version.split()[0]} a save still running when the interpreter exits "
            "cannot finish (CPython gh-113964: no new threads at exit; fixed in 3.12.2), so "
            "save_checkpoint waits for each save to complete. Upgrade to Python 3.12.2 or newer for "
            "asynchronous saves.",
            stacklevel=3,
        )


def wait(directory: Directory | None = None) -> None:
    """Blocks until pending saves (of ``directory``, or all) are complete on disk."""
    if directory is None:
        for m in _all_managers():
            m.wait_until_finished()
        return
    if isinstance(directory, ocp.CheckpointManager):
        directory.wait_until_finished()
        return
    cached = _MANAGERS.get(os.path.abspath(os.fspath(directory)))
    if cached is not None:
        cached[0].wait_until_finished()


def finish_pending_saves(timeout_s: float) -> list[str]:
    """Gives every save still in progress up to ``timeout_s`` seconds in all to complete;
    returns one line per such save saying whether it completed or was abandoned. An
    abandoned save is never listed as a checkpoint (orbax renames a step only when it is
    complete), so the directory's previous checkpoints stay the latest."""
    lines = []
    deadline = time.monotonic() + timeout_s
    for mngr in _all_managers():
        if not mngr.is_saving_in_progress():
            continue
        done = threading.Event()

        def finish(m=mngr):
            try:
                m.wait_until_finished()
            finally:
                done.set()

        threading.Thread(target=finish, daemon=True).start()
        where = os.fspath(mngr.directory)
        if done.wait(max(0.0, deadline - time.monotonic())):
            lines.append(
                f"an asynchronous checkpoint save to {where} was in progress; it completed "
                f"(latest step {mngr.latest_step()})."
            )
        else:
            lines.append(
                f"an asynchronous checkpoint save to {where} was in progress and did not finish "
                f"within {timeout_s:g}s; it is abandoned and will not be listed (the checkpoints "
                "saved before it stay restorable)."
            )
    return lines


on_stall.register(finish_pending_saves)  # a step that stalls finishes the saves in flight first

_AT_EXIT = []


def _wait_at_exit() -> None:
    """Makes interpreter exit wait for pending saves.

    Registered on the first save with ``threading._register_atexit``: its hooks run (last
    registered first) before the thread pools that carry the async save are shut down.
    No public hook runs early enough: ``atexit`` hooks, and the joining of non-daemon
    threads, both come after ``concurrent.futures`` has stopped accepting work, and a save
    still being finalised then fails. ``concurrent.futures`` itself uses this hook; where
    it is missing, ``atexit`` is the fallback."""
    if not _AT_EXIT:
        register = getattr(threading, "_register_atexit", atexit.register)
        register(wait)
        _AT_EXIT.append(True)


def checkpoint_steps(directory: Directory) -> list[int]:
    """The complete checkpoints in ``directory``, oldest first. A save to it still in flight
    from this process is waited for first, so that a read right after
    ``save_checkpoint(...)`` sees that step, never the one before it."""
    wait(directory)
    if not isinstance(directory, ocp.CheckpointManager) and not os.path.isdir(directory):
        return []
    mngr = _manager(directory)
    mngr.reload()
    return sorted(mngr.all_steps())


def list_steps(directory: str | os.PathLike) -> list[int]:
    """:func:`checkpoint_steps` read by this process alone: making an orbax manager is a
    barrier across processes, which processes that see a new folder at different moments
    would reach at different points. The complete steps are the folders named by a number
    (orbax renames a step's folder to its number once every process has written it); a
    manager this process already has is reloaded, so that its next save sees the same."""
    wait(directory)
    path = os.path.abspath(os.fspath(directory))
    cached = _MANAGERS.get(path)
    if cached is not None:
        cached[0].reload()
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(path, n)))


def _check_params(meta: canonical.Meta, params: Any) -> None:
    """Every leaf whose path or shape differs from the checkpoint's, named in one error."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    mine = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in leaves}
    saved = {p: meta.layout(i).shape for i, p in enumerate(meta.paths)}
    if list(mine) != list(saved) or mine != saved:
        lines = [f"  {p}: checkpoint {saved[p]}, params {mine[p]}" for p in saved if p in mine and saved[p] != mine[p]]
        lines += [f"  {p}: in the checkpoint {saved[p]}, not in params" for p in saved if p not in mine]
        lines += [f"  {p}: in params {mine[p]}, not in the checkpoint" for p in mine if p not in saved]
        if not lines:
            lines = ["  the same leaves in another order: checkpoint " + ", ".join(list(saved)[:8])]
        more = f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""
        raise CheckpointMismatchError(
            f"params differ from the checkpoint's in {len(lines)} leaves:\n"
            + "\n".join(lines[:20])
            + more
            + "\nRestore into the model configuration that was saved."
        )


def restore_checkpoint(
    directory: Directory,
    target: Any,
    tx: optax.GradientTransformation | None = None,
    *,
    mesh: Mesh | None = None,
    config: ZeroConfig | None = None,
    step: int | None = None,
    trainable: Any = None,
    model_state: Any = None,
    tensor_specs: Any = None,
) -> ZeroState:
    """Restores checkpoint ``step`` (default: the latest) of ``directory`` (a path or an
    orbax ``CheckpointManager``).

    ``target`` says what to restore onto, either as orbax does, a state of the wanted
    layout (``zj.abstract_state(params, tx, mesh=..., config=...)``: shapes only), or as
    the parameter tree (arrays, ``jax.ShapeDtypeStruct`` or an ``init_fn``) with ``tx``,
    ``mesh`` and ``config`` (and ``trainable`` and a ``model_state`` of the right structure,
    arrays or shapes, when the run had them, and ``tensor_specs`` for a tensor-parallel
    model without annotations). The stage, the device count, the tensor-parallel degree and
    the precision may differ from the saved run's: the optimizer state, master weights, frozen weights,
    model state, key, loss scale and step counter carry over. Each process reads only the
    shards its devices hold.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, zerojax as zj
      >>> params, tx, d = {"w": jnp.ones((13, 7))}, optax.adam(1e-3), tempfile.mkdtemp()
      >>> st = zj.init_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> zj.save_checkpoint(d, st, step=4, wait=True)
      >>> target = zj.abstract_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2))
      >>> int(zj.restore_checkpoint(d, target).step)
      0
    """
    if isinstance(target, ZeroState):
        if any(v is not None for v in (tx, mesh, config, trainable, model_state, tensor_specs)):
            raise ValueError(
                "restore_checkpoint takes either a state target (zj.abstract_state(...)) alone, "
                "or params with tx, mesh and config; got a state and more."
            )
        plan = target.plan
        params = plan.unflatten(jax.ShapeDtypeStruct(l.shape, l.dtype) for l in plan.layouts)
        model_state = target.model_state
    else:
        missing = [n for n, v in (("tx", tx), ("mesh", mesh), ("config", config)) if v is None]
        if missing:
            raise TypeError(
                f"restoring onto a params tree needs tx, mesh and config (missing {missing}); "
                "or pass a state target built by zj.abstract_state(params, tx, mesh=..., config=...)."
            )
        params = jax.eval_shape(target) if is_init_fn(target) else target
    steps = checkpoint_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {_describe(directory)}: it has no complete saved step.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {_describe(directory)}; it has steps {steps}.")
    mngr = _manager(directory)
    meta = canonical.Meta.from_json(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    _check_params(meta, params)
    if not isinstance(target, ZeroState):
        check_optimizer(tx)
        plan = with_split(make_plan(params, mesh, config, tx, trainable, tensor_specs), tx)
    _check_extras(meta, plan, model_state)
    _check_optimizer(meta, plan)
    item, restore_args = _restore_items(meta, plan)
    arrays = mngr.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    )["state"]
    return canonical.from_canonical(arrays, meta, plan, jax.tree.structure(model_state))


def _restore_items(meta: canonical.Meta, plan) -> tuple[dict, dict]:
    """What to read each saved array into on ``plan``'s mesh, and orbax's restore arguments."""
    targets = canonical.restore_targets(meta, plan)
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False), targets
    )
    item = dict(targets)
    restore_args = dict(restore_args)
    scalar = lambda dtype: (
        jax.ShapeDtypeStruct((), dtype, sharding=plan.replicated),
        ocp.ArrayRestoreArgs(sharding=plan.replicated, global_shape=(), dtype=dtype),
    )
    for key in ("step", "skipped"):
        item[key], restore_args[key] = scalar(jnp.int32)
    if meta.scaled:
        names = {"scale": jnp.float32, "iteration": jnp.int32, "last_overflow": jnp.int32, "hysteresis": jnp.int32}
        item["loss_scale"] = {k: scalar(t)[0] for k, t in names.items()}
        restore_args["loss_scale"] = {k: scalar(t)[1] for k, t in names.items()}
    return item, restore_args


@dataclasses.dataclass(frozen=True)
class StepRead:
    """This process's shards of one checkpoint step, read; :meth:`state` lays them out."""

    arrays: dict
    meta: canonical.Meta
    plan: Any
    model_state_def: Any

    def state(self) -> ZeroState:
        """The restored state. It may run programs over the whole mesh: call it on every
        process, once every process has read its shards."""
        return canonical.from_canonical(self.arrays, self.meta, self.plan, self.model_state_def)


def read_step(directory: Directory, target: ZeroState, step: int) -> StepRead:
    """Reads the shards this process's devices hold of checkpoint ``step`` onto ``target``'s
    layout (a :func:`zerojax.abstract_state`), touching only this process's files and
    running no collective: one process's damaged file fails on that process alone, and the
    processes can then agree which step to take (:class:`zerojax.resume.Run` does) without
    one of them waiting inside a restore for the others. Raises
    :class:`CheckpointMismatchError` for another model or optimizer, anything else for a
    step that does not read."""
    if not isinstance(target, ZeroState):
        raise TypeError(f"read_step takes a zj.abstract_state target, got {type(target).__name__}.")
    meta_json = read_step_json(directory, step, "meta")
    if meta_json is None:
        raise FileNotFoundError(f"checkpoint step {step} in {_describe(directory)} has no metadata (meta/metadata).")
    meta = canonical.Meta.from_json(meta_json)
    plan = target.plan
    _check_params(meta, plan.unflatten(jax.ShapeDtypeStruct(l.shape, l.dtype) for l in plan.layouts))
    _check_extras(meta, plan, target.model_state)
    _check_optimizer(meta, plan)
    item, restore_args = _restore_items(meta, plan)
    # The handler itself, not a Checkpointer or a manager: they end every restore with a
    # barrier across processes, which a process whose read failed would never reach.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        arrays = handler.restore(
            epath.Path(_path(directory)) / str(step) / "state",
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args),
        )
    finally:
        handler.close()
    jax.block_until_ready(arrays)
    return StepRead(arrays, meta, plan, jax.tree.structure(target.model_state))


def _check_extras(meta: canonical.Meta, plan, model_state: Any) -> None:
    if tuple(meta.trainable) != tuple(plan.trainable):
        frozen = lambda mask: [p for i, p in enumerate(meta.paths) if mask and not mask[i]]
        raise CheckpointMismatchError(
            f"the checkpoint's frozen parameters are {frozen(meta.trainable)}; this restore freezes "
            f"{frozen(plan.trainable)}. Pass the trainable= mask the run was saved with."
        )
    if meta.model_state is None:
        if model_state is not None:
            raise CheckpointMismatchError("model_state was given, but the checkpoint holds no model state.")
        return
    if model_state is None:
        raise CheckpointMismatchError(
            "the checkpoint holds a model state: pass model_state= (arrays or jax.ShapeDtypeStruct "
            "of its structure), or a target built by zj.abstract_state(..., model_state=...)."
        )
    mine = tuple((tuple(int(d) for d in jnp.shape(x)), jnp.dtype(x.dtype).name) for x in jax.tree.leaves(model_state))
    if str(jax.tree.structure(model_state)) != meta.model_state_treedef or mine != meta.model_state:
        raise CheckpointMismatchError(
            f"model_state does not match the checkpoint's: it holds {meta.model_state_treedef} "
            f"{list(meta.model_state)}, model_state has {jax.tree.structure(model_state)} {list(mine)}."
        )


def _check_optimizer(meta: canonical.Meta, plan) -> None:
    saved = [(meta.opt_layout(k).shape, meta.opt_layout(k).dtype) for k in range(len(meta.opt_layouts))]
    mine = [(l.shape, l.dtype) for l in plan.opt_layouts]
    if str(plan.opt_treedef) != meta.opt_treedef or saved != mine:
        raise CheckpointMismatchError(
            "the optimizer does not match the checkpoint's: the checkpoint holds optimizer "
            f"state {meta.opt_treedef} ({len(saved)} arrays), this tx.init gives "
            f"{plan.opt_treedef} ({len(mine)} arrays). Restore with the optimizer that was saved."
        )
