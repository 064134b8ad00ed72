"""The NVMe tier: the optimizer state on disk, versioned per step, read and written in
groups through a bounded set of buffers.

Each run is compared with the same run with the state in device memory: within 1e-6, as
tests/test_offload.py holds the streamed device update (the head of the step and each
group's update are separate programs here, which XLA:CPU may round a last bit apart).
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.nvme import store as store_mod
from zerojax.nvme import stream as stream_mod

BATCHES = [models.batch(16, s) for s in range(3)]
TX = optax.adamw(1e-2)


def run(cfg, tx=TX, batches=BATCHES, params=None, trainable=None, state=None):
    mesh = zj.make_mesh()
    if state is None:
        state = zj.init_state(params or models.stacked_params(), tx, mesh=mesh, config=cfg, trainable=trainable)
    step = zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg)
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return state, step, metrics


def nvme_cfg(base, path, **offload):
    return dataclasses.replace(base, offload={"optimizer": True, "nvme": {"path": str(path)}, **offload})


@functools.cache
def reference(base, tx=TX, trainable=None):
    state, _, metrics = run(base, tx=tx, trainable=trainable)
    return state, [float(m["loss"]) for m in metrics]


def assert_close_states(a, b, atol=1e-6):
    a, b = zj.nvme.materialize(a), zj.nvme.materialize(b)
    for x, y in zip(jax.tree.leaves(zj.gather_params(a)), jax.tree.leaves(zj.gather_params(b))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    for x, y in zip(jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    assert int(a.step) == int(b.step) and int(a.skipped) == int(b.skipped)


# -- the configuration -------------------------------------------------------------------------


def test_config_validates_and_reads_a_dict(tmp_path):
    cfg = zj.ZeroConfig(stage=2, offload={"optimizer": True, "nvme": {"path": tmp_path, "buffer_count": 3}})
    assert cfg.offload.nvme == zj.config.NVMe(str(tmp_path), buffer_count=3)
    with pytest.raises(ValueError, match="buffer_count must be at least 2"):
        zj.config.NVMe(tmp_path, buffer_count=1)
    with pytest.raises(TypeError, match="NVMe.path must be a directory path"):
        zj.config.NVMe(3)
    with pytest.raises(ValueError, match="set Offload\\(optimizer=True\\)"):
        zj.config.Offload(nvme={"path": tmp_path})
    with pytest.raises(ValueError, match=r"Offload\(update='host'\) with nvme is not supported"):
        zj.config.Offload(optimizer=True, update="host", nvme={"path": tmp_path})


# -- the store: refusals, locks, versions ------------------------------------------------------


def test_missing_directory_full_disk_and_second_run_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not an existing directory"):
        store_mod.Store(str(tmp_path / "absent"), 0)
    s = store_mod.Store(str(tmp_path), 0)
    with pytest.raises(ValueError, match=rf"in use by another run \(pid {os.getpid()}\)"):
        store_mod.Store(str(tmp_path), 0)
    free = store_mod.shutil.disk_usage(s.dir).free
    with pytest.raises(
        ValueError, match=f"has {free // 10**9}.* bytes free, but the optimizer state needs {free + 1:,}"
    ):
        s.check_room(free + 1)
    s.close()
    store_mod.Store(str(tmp_path), 0).close()  # released: a later run may open it


def test_step_refuses_before_running(tmp_path, monkeypatch):
    """A missing directory and a disk without room are refused at the first call, before any step runs."""
    base = zj.ZeroConfig(stage=2)
    mesh = zj.make_mesh()
    cfg = nvme_cfg(base, tmp_path / "absent")
    state = zj.init_state(models.stacked_params(), TX, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match="absent' is not an existing directory"):
        step(state, BATCHES[0])
    assert step.compile_count() == 0
    cfg = nvme_cfg(base, tmp_path)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: store_mod.shutil._ntuple_diskusage(10, 10, 0))
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"has 0 bytes free, but the optimizer state needs [\d,]+ bytes"):
        step(zj.init_state(models.stacked_params(), TX, mesh=mesh, config=cfg), BATCHES[0])
    assert step.compile_count() == 0


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage,group_size", [(1, 1_000_000_000), (2, 200), (3, 300)])
def test_trains_as_in_memory(tmp_path, stage, group_size):
    """Stages 1-3, one group or several (reads of the next overlapping the update): the same
    losses, parameters and optimizer state as the run with the state on the device."""
    base = zj.ZeroConfig(stage=stage)
    ref, ref_losses = reference(base)
    state, step, metrics = run(nvme_cfg(base, tmp_path, group_size=group_size))
    if group_size < 1000:
        assert len(step.nvme_tier(state).groups.groups) > 1
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=0, atol=1e-6)
    assert_close_states(state, ref)
    leaves = jax.tree.leaves(state.opt_state)
    assert all(isinstance(x, zj.nvme.OnDisk) for x in leaves if x.ndim)  # no arrays posing as the state
    step.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_fp16_skip_accumulation_clip_and_frozen(tmp_path, seed):
    """fp16 dynamic scaling with a skipped step (a non-finite batch), two micro-batches,
    global-norm clipping and a frozen leaf, on randomized parameters and batches."""
    base = zj.ZeroConfig(
        stage=2, compute_dtype="float16", grad_accum_steps=2, grad_clip=0.5, loss_scaling={"initial_scale_power": 4}
    )
    rng = np.random.default_rng(seed)
    batches = [models.batch(16, int(s)) for s in rng.integers(0, 100, 3)]
    batches[1] = {"x": batches[1]["x"].at[0, 0].set(np.inf), "y": batches[1]["y"]}
    params = models.stacked_params(seed=seed)
    trainable = jax.tree.map(lambda _: True, params)
    trainable["skip"] = False
    ref, _, ref_m = run(base, batches=batches, params=params, trainable=trainable)
    state, step, m = run(nvme_cfg(base, tmp_path, group_size=300), batches=batches, params=params, trainable=trainable)
    assert [bool(x["skipped"]) for x in m] == [False, True, False] == [bool(x["skipped"]) for x in ref_m]
    assert [float(x["loss_scale"]) for x in m] == [float(x["loss_scale"]) for x in ref_m]
    assert_close_states(state, ref)
    step.close()


# -- crash safety -----------------------------------------------------------------------------


def test_failed_write_leaves_the_last_version(tmp_path, monkeypatch):
    """A writer that fails in the middle of a step's writes leaves the version before it
    committed and readable, bit for bit; the next step over the same state then succeeds."""
    cfg = nvme_cfg(zj.ZeroConfig(stage=2), tmp_path, group_size=200)
    state, step, _ = run(cfg, batches=BATCHES[:1])
    before = [np.asarray(x) for x in jax.tree.leaves(zj.nvme.materialize(state).opt_state)]
    real, calls = stream_mod.write_chunk, []

    def failing(path, data):
        calls.append(path)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(stream_mod, "write_chunk", failing)
    with pytest.raises(OSError, match="No space left"):
        step(state, BATCHES[1])
    after = [np.asarray(x) for x in jax.tree.leaves(zj.nvme.materialize(state).opt_state)]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(stream_mod, "write_chunk", real)
    state, _ = step(state, BATCHES[1])
    assert sorted(os.listdir(step.nvme_tier(state).store.dir)) == ["LOCK", "MANIFEST.json", f"v{2}"]
    step.close()


def test_stale_state_is_refused(tmp_path):
    cfg = nvme_cfg(zj.ZeroConfig(stage=2), tmp_path)
    state, step, _ = run(cfg, batches=BATCHES[:1])
    newer, _ = step(state, BATCHES[1])
    with pytest.raises(ValueError, match="a later .*step"):
        zj.nvme.materialize(state)
    with pytest.raises(ValueError, match="a later step consumed it"):
        step(state, BATCHES[2])
    step.close()


# -- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_is_ordinary_and_restores_on_any_tier(tmp_path):
    """An NVMe run's checkpoint restores into memory (another stage) and into the NVMe tier,
    bit for bit, and training on continues as the uninterrupted run."""
    base = zj.ZeroConfig(stage=2)
    cfg = nvme_cfg(base, tmp_path / "a")
    os.makedirs(tmp_path / "a")
    state, step, _ = run(cfg, batches=BATCHES[:2])
    zj.save_checkpoint(tmp_path / "ck", state, step=2, wait=True)
    mesh = zj.make_mesh()
    mem = zj.restore_checkpoint(tmp_path / "ck", models.stacked_params(), TX, mesh=mesh, config=zj.ZeroConfig(stage=3))
    full = zj.nvme.materialize(state)
    for x, y in zip(jax.tree.leaves(mem.opt_state), jax.tree.leaves(full.opt_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(zj.gather_params(mem)), jax.tree.leaves(zj.gather_params(full))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    os.makedirs(tmp_path / "b")
    cfg_b = nvme_cfg(base, tmp_path / "b")
    back = zj.restore_checkpoint(tmp_path / "ck", models.stacked_params(), TX, mesh=mesh, config=cfg_b)
    resumed, step_b, _ = run(cfg_b, batches=BATCHES[2:], state=back)
    ref, _ = reference(base)
    assert_close_states(resumed, ref)
    step.close()
    step_b.close()
