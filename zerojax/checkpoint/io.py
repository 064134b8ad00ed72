"""Saving and restoring ZeRO states with orbax-checkpoint.

Each process writes only the shards it holds; orbax writes a step into a temporary
directory and renames it when complete, so a save killed half-way is never listed as a
checkpoint and the previous one stays restorable. Saves are asynchronous: training goes
on while the arrays are written; :func:`wait` (also run at interpreter exit) blocks until
they are on disk.
"""

from __future__ import annotations

import atexit
import threading
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from zerojax.checkpoint import canonical
from zerojax.config import ZeroConfig
from zerojax.sharding.plan import make_plan
from zerojax.state import ZeroState

_MANAGERS: dict[str, ocp.CheckpointManager] = {}


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which checkpoints to keep: the last ``keep_last`` (None: all), plus every step that
    is a multiple of ``keep_every`` (None: none extra)."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}.")


def _manager(directory: str | os.PathLike, retention: Retention | None = None,
             create: bool = True) -> ocp.CheckpointManager:
    path = os.path.abspath(os.fspath(directory))
    mngr = _MANAGERS.get(path)
    if mngr is None or (retention is not None and getattr(mngr, "_zj_retention", None) != retention):
        if mngr is not None:
            mngr.wait_until_finished()
        r = retention or Retention()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=r.keep_last, keep_period=r.keep_every, create=create,
            enable_async_checkpointing=True,
        )
        mngr = ocp.CheckpointManager(path, options=options)
        mngr._zj_retention = retention
        _MANAGERS[path] = mngr
    return mngr


def save_checkpoint(directory: str | os.PathLike, state: ZeroState, step: int, *,
                    keep_last: int | None = None, keep_every: int | None = None,
                    wait: bool = False) -> None:
    """Saves ``state`` as checkpoint ``step`` under ``directory``, asynchronously.

    Only each process's own shards are written. ``keep_last`` / ``keep_every`` set the
    retention policy of the directory. ``wait=True`` blocks until the checkpoint is
    complete; otherwise it completes in the background, and at the latest when the
    interpreter exits.

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
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}.")
    retention = Retention(keep_last, keep_every) if (keep_last or keep_every) else None
    mngr = _manager(directory, retention)
    _wait_at_exit()
    arrays, meta = canonical.to_canonical(state)
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta.to_json())))
    if wait:
        mngr.wait_until_finished()


def wait(directory: str | os.PathLike | None = None) -> None:
    """Blocks until pending saves (of ``directory``, or all) are complete on disk."""
    if directory is None:
        for m in list(_MANAGERS.values()):
            m.wait_until_finished()
        return
    m = _MANAGERS.get(os.path.abspath(os.fspath(directory)))
    if m is not None:
        m.wait_until_finished()


_AT_EXIT = []


def _wait_at_exit() -> None:
    """Makes interpreter exit wait for pending saves.

    Registered on the first save, as a threading exit hook: those run (last registered
    first) before the thread pools that carry the async save are shut down, and before
    ``atexit`` hooks such as JAX's backend clean-up."""
    if not _AT_EXIT:
        register = getattr(threading, "_register_atexit", atexit.register)
        register(wait)
        _AT_EXIT.append(True)


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    mngr = _manager(directory, create=False)
    mngr.reload()
    return sorted(mngr.all_steps())


def _check_params(meta: canonical.Meta, params: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    saved = list(meta.paths)
    for i in range(max(len(paths), len(saved))):
        mine = paths[i] if i < len(paths) else None
        theirs = saved[i] if i < len(saved) else None
        if mine != theirs:
            raise ValueError(
                f"params tree differs from the checkpoint's at leaf {i}: checkpoint has "
                f"{theirs!r}, params have {mine!r}. Restore into the model that was saved.")
        shape = tuple(leaves[i][1].shape)
        want = meta.layout(i).shape
        if shape != want:
            raise ValueError(
                f"params leaf {mine} has shape {shape} but the checkpoint holds shape {want}. "
                "Restore into the model configuration that was saved.")


def restore_checkpoint(directory: str | os.PathLike, params: Any, tx: optax.GradientTransformation, *,
                       mesh: Mesh, config: ZeroConfig, step: int | None = None) -> ZeroState:
    """Restores checkpoint ``step`` (default: the latest) laid out for ``mesh`` and ``config``.

    ``params`` gives the parameter tree (arrays or ``jax.ShapeDtypeStruct``). The stage,
    the device count and the precision may differ from the saved run's: the optimizer
    state, master weights, loss scale and step counter carry over. Each process reads
    only the shards its devices hold.
    """
    steps = checkpoint_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {os.fspath(directory)!r}: it has no complete saved step.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {os.fspath(directory)!r}; it has steps {steps}.")
    mngr = _manager(directory, create=False)
    meta = canonical.Meta.from_json(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    _check_params(meta, params)
    plan = make_plan(params, mesh, config)
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
    opt_template = _opt_template(plan, tx)
    _check_optimizer(meta, plan, opt_template)
    targets = canonical.restore_targets(meta, plan)
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False),
        targets)
    item = dict(targets)
    restore_args = dict(restore_args)
    scalar = lambda dtype: (jax.ShapeDtypeStruct((), dtype, sharding=plan.replicated),
                            ocp.ArrayRestoreArgs(sharding=plan.replicated, global_shape=(), dtype=dtype))
    for key in ("step", "skipped"):
        item[key], restore_args[key] = scalar(jnp.int32)
    if meta.scaled:
        names = {"scale": jnp.float32, "iteration": jnp.int32, "last_overflow": jnp.int32, "hysteresis": jnp.int32}
        item["loss_scale"] = {k: scalar(t)[0] for k, t in names.items()}
        restore_args["loss_scale"] = {k: scalar(t)[1] for k, t in names.items()}
    arrays = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)))["state"]
    return canonical.from_canonical(arrays, meta, plan, opt_template, config.scaling)


def _opt_template(plan, tx):
    sds = [jax.ShapeDtypeStruct(l.shape if plan.stage == 0 else l.storage_shape,
                                jnp.promote_types(jnp.dtype(l.dtype), jnp.float32)) for l in plan.layouts]
    return jax.eval_shape(tx.init, jax.tree.unflatten(plan.treedef, sds))


def _check_optimizer(meta, plan, opt_template) -> None:
    leaves, treedef = jax.tree.flatten(opt_template)
    index = canonical.opt_layout_index(plan, opt_template)
    if str(treedef) != meta.opt_treedef or list(index) != list(meta.opt_layout):
        raise ValueError(
            "the optimizer does not match the checkpoint's: the checkpoint holds optimizer "
            f"state {meta.opt_treedef} ({len(meta.opt_layout)} arrays), this tx.init gives "
            f"{treedef} ({len(leaves)} arrays). Restore with the optimizer that was saved.")
