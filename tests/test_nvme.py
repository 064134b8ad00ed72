"""The NVMe tier: the optimizer state on disk, versioned per step, read and written in
groups through a bounded set of buffers.

Each run is compared with the same run with the state in device memory: within 1e-6, as
tests/test_offload.py holds the streamed device update. The head of the step and each
group's update are separate programs here, which XLA:CPU fuses, and so rounds (FMA
contraction among other things), otherwise than the whole step: docs/offload.md,
"Exactness across program boundaries".

The default set trains one configuration (stage 2, fp16 dynamic scaling with a skipped
step, two micro-batches, global-norm clipping, a frozen leaf, two update groups) through
one train step shared by the module, so that its head, tail and group programs compile
once; the other stages and randomized cases are slow.
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax.nvme.driver
from tests import models
from zerojax.nvme import store as store_mod
from zerojax.nvme import stream as stream_mod
from zerojax.report import estimate

TX = optax.adamw(1e-2)
JOB = Path(__file__).resolve().parent / "workers" / "nvme_crash_job.py"
# Two update groups on models.stacked_params: the leaves up to layers/w, and the rest.
TWO_GROUPS = 1600
BASE = zj.ZeroConfig(
    stage=2, compute_dtype="float16", grad_accum_steps=2, grad_clip=0.5, loss_scaling={"initial_scale_power": 4}
)


def nvme_cfg(base, path, **offload):
    return dataclasses.replace(base, offload={"optimizer": True, "nvme": {"path": str(path)}, **offload})


def case(seed):
    """Randomized parameters and batches, the second batch non-finite (a skipped step), the
    leaf ``skip`` frozen."""
    rng = np.random.default_rng(seed)
    batches = [models.batch(16, int(s)) for s in rng.integers(0, 100, 3)]
    batches[1] = {"x": batches[1]["x"].at[0, 0].set(np.inf), "y": batches[1]["y"]}
    params = models.stacked_params(seed=seed)
    trainable = jax.tree.map(lambda _: True, params)
    trainable["skip"] = False
    return params, trainable, batches


def train(step, state, batches):
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return state, metrics


def assert_close_states(a, b, atol=1e-6):
    a, b = zj.nvme.materialize(a), zj.nvme.materialize(b)
    for x, y in zip(jax.tree.leaves(zj.gather_params(a)), jax.tree.leaves(zj.gather_params(b))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    for x, y in zip(jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    assert int(a.step) == int(b.step) and int(a.skipped) == int(b.skipped)


def opt_arrays(state):
    return [np.asarray(x) for x in jax.tree.leaves(zj.nvme.materialize(state).opt_state)]


@dataclasses.dataclass
class Shared:
    """The module's NVMe train step (its tier open on ``path``) and the in-memory reference run."""

    mesh: object
    step: object
    path: object
    params: dict
    trainable: dict
    batches: list
    ref_states: list  # the in-memory state after each step
    ref_metrics: list

    def init(self, config=None):
        return zj.init_state(
            self.params, TX, mesh=self.mesh, config=config or self.step.config, trainable=self.trainable
        )


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvme")
    mesh = zj.make_mesh()
    params, trainable, batches = case(0)
    ref_step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=BASE)
    state = zj.init_state(params, TX, mesh=mesh, config=BASE, trainable=trainable)
    ref_states, ref_metrics = [], []
    for b in batches:
        state, m = ref_step(state, b)
        ref_states.append(state)
        ref_metrics.append(m)
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=nvme_cfg(BASE, path, group_size=TWO_GROUPS))
    yield Shared(mesh, step, path, params, trainable, batches, ref_states, ref_metrics)
    step.close()


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


# -- the store: refusals, locks, versions ------------------------------------------------------


def test_missing_directory_full_disk_and_second_run_are_refused(tmp_path):
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
    mesh = zj.make_mesh()
    base = zj.ZeroConfig(stage=2)
    params, batch = models.stacked_params(), models.batch(16)
    cfg = nvme_cfg(base, tmp_path / "absent")
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match="absent' is not an existing directory"):
        step(state, batch)
    assert step.compile_count() == 0
    cfg = nvme_cfg(base, tmp_path)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: store_mod.shutil._ntuple_diskusage(10, 10, 0))
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"has 0 bytes free, but the optimizer state needs [\d,]+ bytes"):
        step(zj.init_state(params, TX, mesh=mesh, config=cfg), batch)
    assert step.compile_count() == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_streamer_reads_back_what_it_wrote_through_fewer_buffers_than_chunks(tmp_path, seed):
    """Leaves of random shapes and dtypes, sharded over the 8 devices and replicated, go
    through two buffers (each reused many times): every shard reads back bit for bit, in
    buffers of exactly a shard's size and in larger ones."""
    rng = np.random.default_rng(seed)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    specs = [jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()]
    leaves = []
    for j in range(4):
        shape = (8 * int(rng.integers(1, 40)), int(rng.integers(1, 300)))
        dtype = [np.float32, np.int32, np.float16][j % 3]
        x = rng.standard_normal(shape).astype(dtype) if dtype != np.int32 else rng.integers(-9, 9, shape, dtype)
        leaves.append(jax.device_put(x, jax.sharding.NamedSharding(mesh, specs[j % 2])))
    largest = max(s.data.nbytes for x in leaves for s in x.addressable_shards)
    for size in (largest, 10 * largest):
        d = tmp_path / str(size)
        d.mkdir()
        streamer = stream_mod.Streamer(2, size)
        for f in [f for j, x in enumerate(leaves) for f in streamer.write(str(d), j, x)]:
            f.result()
        futures = [streamer.read(str(d), j, x.shape, x.dtype, x.sharding) for j, x in enumerate(leaves)]
        back = [stream_mod.assemble(x.shape, x.sharding, fs) for x, fs in zip(leaves, futures)]
        streamer.close()
        for x, y in zip(leaves, back):
            assert y.sharding == x.sharding
            for a, b in zip(x.addressable_shards, y.addressable_shards):
                np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


# -- exactness -------------------------------------------------------------------------------


def test_trains_as_in_memory(shared):
    """fp16 dynamic scaling with a skipped step (a non-finite batch), two micro-batches,
    global-norm clipping and a frozen leaf, in two groups (the second read while the first
    updates): the same metrics, parameters and optimizer state as the run in device memory."""
    step = shared.step
    state, metrics = train(step, shared.init(), shared.batches)
    assert len(step.nvme_tier(state).groups.groups) == 2
    assert [bool(m["skipped"]) for m in metrics] == [False, True, False]
    for key in ("skipped", "loss_scale"):
        assert [float(m[key]) for m in metrics] == [float(m[key]) for m in shared.ref_metrics]
    for key in ("loss", "grad_norm"):
        got, want = [float(m[key]) for m in metrics], [float(m[key]) for m in shared.ref_metrics]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert_close_states(state, shared.ref_states[-1])
    assert all(isinstance(x, zj.nvme.OnDisk) for x in jax.tree.leaves(state.opt_state) if x.ndim)  # no arrays posing
    # Each tier's bytes per device, as `zerojax estimate --offload optimizer --nvme` gives
    # them: masters and optimizer state in their stored (padded) shape, the fp16 copy
    # forward reads in its own. A 0-d parameter (held whole by every device) keeps its
    # master and moments in memory: the formula's Ψ/N counts the split ones.
    plan, d0 = state.plan, jax.devices()[0]
    split = [l for l in plan.master_layouts if l.kind != "replicated"]
    whole = len(plan.master_layouts) - len(split)
    stored = sum(math.prod(l.storage_shape) for l in split)
    own = sum(math.prod(l.shape) for l in plan.master_layouts)
    tiers = lambda psi: estimate.tier_bytes(psi, 8, 2, offload="optimizer", nvme=True, compute_dtype="float16")
    per_device = lambda tree: sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == d0
    )
    store = step.nvme_tier(state).store
    version = store.version_dir(store.manifest()["version"])
    assert sum(os.path.getsize(os.path.join(version, f)) for f in os.listdir(version)) == 8 * tiers(stored)["disk"]
    assert per_device(state.master) == tiers(stored)["host"] + 4 * whole
    assert per_device(state.params) == tiers(own)["device"]


def test_the_update_runs_in_host_memory_where_the_config_says(shared, tmp_path, monkeypatch):
    """Offload(update="host") with the tier: each group read from disk updates inside
    compute_on("device_host") (DeepSpeed's CPU Adam on swapped state), and the run equals the
    in-memory one as the device update's does."""
    calls = []
    original = zerojax.nvme.driver.on_host
    monkeypatch.setattr(zerojax.nvme.driver, "on_host", lambda *a: calls.append(1) or original(*a))
    config = nvme_cfg(BASE, tmp_path, group_size=TWO_GROUPS, update="host")
    step = zj.make_train_step(models.stacked_loss, TX, mesh=shared.mesh, config=config)
    state, _ = train(step, shared.init(config), shared.batches)
    assert step.update_place(state) == "host" and shared.step.update_place(state) == "device"
    assert len(calls) == len(step.nvme_tier(state).groups.groups)  # each group's program traced on the host
    assert_close_states(state, shared.ref_states[-1])
    step.close()


def test_a_partial_tier_keeps_the_rest_on_the_device(shared, tmp_path):
    """Offload(ratio=0.5) with the NVMe tier: the split's offloaded leaves are on disk (whole
    groups from the last parameter back), the rest arrays in device memory updated there; the
    run equals the in-memory one (fp16 skip, accumulation, clipping, a frozen leaf), and the
    disk holds what `zerojax estimate --offload optimizer --nvme --ratio <share>` says."""
    config = nvme_cfg(BASE, tmp_path, group_size=TWO_GROUPS, ratio=0.5)
    step = zj.make_train_step(models.stacked_loss, TX, mesh=shared.mesh, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the share taken is above 0.5: said in a warning
        state, _ = train(step, shared.init(config), shared.batches)
    assert_close_states(state, shared.ref_states[-1])
    plan = state.plan
    split = plan.offload_split
    assert 0.5 <= split.share < 1
    for j, x in enumerate(jax.tree.leaves(state.opt_state)):
        if len(x.shape):  # arrays of a parameter's shape: on disk where the split says, on the device if not
            assert isinstance(x, zj.nvme.OnDisk) == split.opt[j], j
            assert isinstance(x, zj.nvme.OnDisk) or x.sharding.memory_kind == "device"
    host = [l for l, h in zip(plan.master_layouts, split.masters) if h and l.kind != "replicated"]
    stored = sum(math.prod(l.storage_shape) for l in plan.master_layouts if l.kind != "replicated")
    share = sum(math.prod(l.storage_shape) for l in host) / stored
    tiers = estimate.tier_bytes(stored, 8, 2, offload="optimizer", nvme=True, compute_dtype="float16", ratio=share)
    store = step.nvme_tier(state).store
    version = store.version_dir(store.manifest()["version"])
    assert sum(os.path.getsize(os.path.join(version, f)) for f in os.listdir(version)) == pytest.approx(
        8 * tiers["disk"]
    )
    step.close()


# reason: test_trains_as_in_memory covers stage 2 with fp16 scaling, a skipped step,
# accumulation, clipping, a frozen leaf and two groups; these add stages 1 and 3, one group
# and a group per leaf, on other randomized parameters and batches.
@pytest.mark.slow
@pytest.mark.parametrize("stage,group_size,seed", [(1, 10**9, 1), (2, 1, 2), (3, 300, 3)])
def test_trains_as_in_memory_at_each_stage(tmp_path, stage, group_size, seed):
    base = dataclasses.replace(BASE, stage=stage)
    params, trainable, batches = case(seed)
    mesh = zj.make_mesh()
    results = []
    for cfg in (base, nvme_cfg(base, tmp_path, group_size=group_size)):
        step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)
        state = zj.init_state(params, TX, mesh=mesh, config=cfg, trainable=trainable)
        results.append(train(step, state, batches))
    (ref, ref_m), (state, m) = results
    assert [float(x["loss_scale"]) for x in m] == [float(x["loss_scale"]) for x in ref_m]
    np.testing.assert_allclose([float(x["loss"]) for x in m], [float(x["loss"]) for x in ref_m], rtol=0, atol=1e-6)
    assert_close_states(state, ref)
    step.close()


# -- crash safety -----------------------------------------------------------------------------


def test_failed_write_leaves_the_last_version_and_stale_states_are_refused(shared, monkeypatch):
    """A writer that fails in the middle of a step's writes leaves the version before it
    committed and readable, bit for bit; the next step over the same state then succeeds,
    and the state it consumed is refused from then on."""
    step, batches = shared.step, shared.batches
    state, _ = step(shared.init(), batches[0])
    before = opt_arrays(state)
    real, calls = stream_mod.write_chunk, []

    def failing(path, data):
        calls.append(path)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(stream_mod, "write_chunk", failing)
    with pytest.raises(OSError, match="No space left"):
        step(state, batches[1])
    for a, b in zip(before, opt_arrays(state)):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(stream_mod, "write_chunk", real)
    newer, _ = step(state, batches[1])
    version = step.nvme_tier(newer).store.manifest()["version"]
    assert sorted(os.listdir(step.nvme_tier(newer).store.dir)) == ["LOCK", "MANIFEST.json", f"v{version}"]
    with pytest.raises(ValueError, match="a later .*step"):
        zj.nvme.materialize(state)
    with pytest.raises(ValueError, match="a later step consumed it"):
        step(state, batches[2])


def read_version(directory, version):
    """Every leaf of a committed version, reassembled from its chunk files by their names
    and the manifest alone (no zerojax code reads them)."""
    with open(os.path.join(directory, "MANIFEST.json")) as f:
        manifest = json.load(f)
    assert manifest["version"] == version
    leaves = {int(j): np.full(c["shape"], np.nan, c["dtype"]) for j, c in manifest["chunks"].items()}
    for name in os.listdir(os.path.join(directory, f"v{version}")):
        leaf, key = name.removesuffix(".bin").split(".")
        x = leaves[int(leaf)]
        index = () if key == "all" else tuple(slice(*map(int, r.split("-"))) for r in key.split("_"))
        raw = np.fromfile(os.path.join(directory, f"v{version}", name), x.dtype)
        x[index] = raw.reshape(x[index].shape)
    return leaves


# reason: two fresh processes (about 15 s); in the default set,
# test_failed_write_leaves_the_last_version_and_stale_states_are_refused fails a writer
# mid-step in-process and checks the same committed version.
@pytest.mark.slow
@pytest.mark.parametrize("at", ["chunk", "manifest"])
def test_killed_mid_write_leaves_the_last_version_and_a_new_run_continues(tmp_path, at):
    """A process SIGKILLed while its writer threads write a step's chunks (halfway through
    one), or with every chunk written and the new manifest not yet switched in, leaves the
    version before that step committed, bit for bit; a new process takes the directory
    over (the lock died with the old one), clears the half-written version, and its step
    from that version equals its step from the checkpoint saved at the same point."""
    path, work = tmp_path / "nvme", tmp_path / "work"
    path.mkdir()
    work.mkdir()
    job = subprocess.Popen(
        [sys.executable, str(JOB), "crash", str(path), str(work), "--at", at],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (work / "ready").exists():
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the worker never reached the write it stops in"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    assert job.wait(60) == -signal.SIGKILL
    d = path / "process_0"
    listing = sorted(os.listdir(d))
    assert listing == ["LOCK", "MANIFEST.json"] + (["MANIFEST.json.tmp"] if at == "manifest" else []) + ["v2", "v3"]
    committed = np.load(work / "committed.npz")
    got = read_version(d, 2)
    assert sorted(got) == [j for j in range(len(committed)) if committed[f"opt{j}"].ndim]
    for j, x in got.items():
        np.testing.assert_array_equal(x[tuple(slice(0, n) for n in committed[f"opt{j}"].shape)], committed[f"opt{j}"])
    if at == "chunk":  # the half-written version really is half written
        assert any(os.path.getsize(d / "v3" / n) < os.path.getsize(d / "v2" / n) for n in os.listdir(d / "v3"))

    r = subprocess.run(
        [sys.executable, str(JOB), "resume", str(path), str(work)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(work / "resumed.npz")
    assert list(out["a_listing"]) == ["LOCK", "MANIFEST.json", "v3"]
    a = sorted(k[2:] for k in out.files if k.startswith("a_") and k != "a_listing")
    assert a == sorted(k[2:] for k in out.files if k.startswith("b_")) and len(a) > 2
    for k in a:
        np.testing.assert_array_equal(out["a_" + k], out["b_" + k])


# -- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_is_ordinary_and_restores_on_any_tier(shared, tmp_path):
    """An NVMe run's checkpoint restores into memory (another stage) and into the NVMe tier,
    bit for bit, and training on continues as the uninterrupted run."""
    step, batches = shared.step, shared.batches
    state, _ = train(step, shared.init(), batches[:2])
    zj.save_checkpoint(tmp_path / "ck", state, step=2, wait=True)
    full = zj.nvme.materialize(state)
    mem = zj.restore_checkpoint(
        tmp_path / "ck",
        shared.params,
        TX,
        mesh=shared.mesh,
        config=dataclasses.replace(BASE, stage=3),
        trainable=shared.trainable,
    )
    for x, y in zip(jax.tree.leaves(mem.opt_state), jax.tree.leaves(full.opt_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(zj.gather_params(mem)), jax.tree.leaves(zj.gather_params(full))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    back = zj.restore_checkpoint(
        tmp_path / "ck", shared.params, TX, mesh=shared.mesh, config=step.config, trainable=shared.trainable
    )
    assert not zj.nvme.on_disk(back)
    resumed, _ = train(step, back, batches[2:])
    assert_close_states(resumed, shared.ref_states[-1])
