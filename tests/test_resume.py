"""Resumable runs in one process: exact resumes, damaged checkpoints, elastic device counts,
the data position, a preemption notice, and bad input."""

import glob
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.resume import IndexSampler, Preempted, Run, RunConfig

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
N_RECORDS, BATCH = 64, 16
DATA = models.batch(N_RECORDS, seed=3)  # {"x": [64, 12], "y": [64, 7]}
# fp16 with dynamic loss scaling: the loss-scale state must come back too.
CONFIG = zj.ZeroConfig(stage=2, compute_dtype="float16", loss_scaling={"loss_scale": "dynamic"})


@pytest.fixture(scope="module")
def step8():
    return zj.make_train_step(models.stacked_loss, TX, mesh=zj.make_mesh(), config=CONFIG)


def train(directory, until, step, *, save_every=2, mesh=None, config=CONFIG, keep_last=None):
    """One start of a run: resume (or start) in ``directory`` and train until step ``until``."""
    mesh = mesh or zj.make_mesh()
    run, data = (
        Run(RunConfig(directory, save_every=save_every, keep_last=keep_last)),
        IndexSampler(N_RECORDS, BATCH, seed=5),
    )
    config = run.micro_batches(config, mesh, BATCH)
    state = run.restore_or_init(models.stacked_params(), TX, mesh=mesh, config=config, data=data)
    if step is None:  # one step per (mesh, config): restarts on the same mesh reuse it
        step = models.shared_step(models.stacked_loss, TX, mesh=mesh, config=config)
    while run.step < until:
        idx = next(data)
        state, _ = step(state, jax.tree.map(lambda x: x[idx], DATA))
        run.completed(state)
    run.finish(state)
    return state, run, data


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((zj.gather_params(state), state.master, state.opt_state))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, step8):
    state, _, _ = train(tmp_path_factory.mktemp("ref"), 9, step8)
    return leaves(state), float(state.loss_scale.scale), int(state.step)


@pytest.mark.slow  # reason: five restarts (6 s); the damaged-checkpoint and the stage-3 hybrid tests resume bit-identically in the default set
def test_interrupted_any_number_of_times_ends_bit_identical(tmp_path, step8, uninterrupted, capsys):
    ref, scale, n = uninterrupted
    rng = np.random.default_rng(0)
    stops = sorted(rng.choice(np.arange(1, 9), size=3, replace=False).tolist()) + [9]
    ran = 0
    for until in stops:  # each start loses the steps since its last checkpoint (save_every=2)
        state, run, data = train(tmp_path, until, step8)
        ran += until
        del state
    state, _, _ = train(tmp_path, 9, step8)
    got = leaves(state)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref)), stops
    assert float(state.loss_scale.scale) == scale and int(state.step) == n
    out = capsys.readouterr().out
    assert out.count("resuming at step") == len(stops)


def test_data_position_and_extra_come_back(tmp_path, step8):
    _, run, data = train(tmp_path, 4, step8)
    assert data.position == 4
    extra = zj.checkpoint.checkpoint_extra(tmp_path, 4)
    assert extra["step"] == 4 and extra["data"]["position"] == 4 and extra["global_batch"] == BATCH
    assert extra["devices"] == 8 and extra["rows_per_micro_batch"] == 2


def test_a_damaged_latest_checkpoint_is_skipped_with_its_name(tmp_path, step8, uninterrupted, capsys):
    train(tmp_path, 6, step8)  # checkpoints 2, 4, 6
    files = [
        f
        for f in glob.glob(str(tmp_path / "6" / "state" / "**" / "*"), recursive=True)
        if os.path.isfile(f) and os.path.getsize(f) > 64
    ]
    assert files
    for f in files:  # every data file of step 6 cut short
        with open(f, "r+b") as fh:
            fh.truncate(16)
    capsys.readouterr()
    state, run, data = train(tmp_path, 6, step8)  # resumes from 4 and recomputes 5 and 6
    out = capsys.readouterr().out
    assert f"checkpoint {tmp_path / '6'} is damaged" in out, out
    assert f"moved the damaged checkpoint aside to {tmp_path / '6.damaged'}" in out
    assert "resuming at step 4" in out
    # The step is saved again (a save at or below a damaged step's number was skipped unreported).
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [2, 4, 6] and (tmp_path / "6.damaged").is_dir()
    assert zj.checkpoint.checkpoint_extra(tmp_path, 6)["data"]["position"] == 6
    state, _, _ = train(tmp_path, 9, step8)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state), uninterrupted[0]))


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, step8, capsys):
    train(tmp_path, 4, step8)
    # What a save killed before its rename leaves: orbax's temporary folder, never listed.
    os.makedirs(tmp_path / "6.orbax-checkpoint-tmp-1700000000000000" / "state")
    capsys.readouterr()
    train(tmp_path, 5, step8)
    assert "resuming at step 4" in capsys.readouterr().out
    assert zj.checkpoint.checkpoint_steps(tmp_path)[-1] == 5


def test_elastic_eight_four_eight_devices_follows_the_trajectory(tmp_path, capsys):
    # fp32: an fp16 step's rounding differs with the micro-batch split, and with it the loss scale's path.
    config, devices = zj.ZeroConfig(stage=3), jax.devices()
    ref, _, _ = train(tmp_path / "ref", 9, None, config=config)
    train(tmp_path / "run", 3, None, config=config)
    capsys.readouterr()
    state, run, _ = train(tmp_path / "run", 6, None, mesh=zj.make_mesh(devices[:4]), config=config)
    out = capsys.readouterr().out
    assert "on 4 devices grad_accum_steps becomes 2 (2 rows per device per micro-batch)" in out, out
    assert "A loss not linear in its rows (a MoE load-balancing loss" in out and "now sees 2 micro-batches" in out
    assert "randomness drawn from the step's key" not in out  # the state carries no key
    assert zj.checkpoint.checkpoint_extra(tmp_path / "run", 6)["grad_accum_steps"] == 2
    state, _, _ = train(tmp_path / "run", 9, None, config=config)
    assert "on 8 devices grad_accum_steps becomes 1" in capsys.readouterr().out
    for a, b in zip(leaves(state), leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_sigterm_saves_at_the_next_boundary_and_exits_resumable(tmp_path, step8):
    mesh = zj.make_mesh()
    run, data = Run(RunConfig(tmp_path, save_every=100)), IndexSampler(N_RECORDS, BATCH)
    state = run.restore_or_init(models.stacked_params(), TX, mesh=mesh, config=CONFIG, data=data)
    idx = next(data)
    state, _ = step8(state, jax.tree.map(lambda x: x[idx], DATA))
    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag: the step ends normally
    with pytest.raises(Preempted) as e:
        run.completed(state)
    assert e.value.code == zj.resume.RESUMABLE_EXIT == 75
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [1]
    assert signal.getsignal(signal.SIGTERM) is not run._watch._on_sigterm  # the previous handler is back


def test_resuming_another_model_names_the_leaves_before_any_step(tmp_path, step8):
    train(tmp_path, 2, step8)
    wrong = models.stacked_params()
    wrong["out"]["w"] = jnp.zeros((20, 9))
    run = Run(RunConfig(tmp_path, save_every=2))
    with pytest.raises(
        zj.checkpoint.CheckpointMismatchError, match=r"\['out'\]\['w'\]: checkpoint \(20, 7\), params \(20, 9\)"
    ):
        run.restore_or_init(wrong, TX, mesh=zj.make_mesh(), config=CONFIG, data=IndexSampler(N_RECORDS, BATCH, seed=5))


def test_bad_input_is_refused_with_the_fix(tmp_path, step8):
    for kwargs, err, match in [
        (dict(save_every=0), ValueError, "save_every must be a positive int, got 0"),
        (dict(save_every=2, keep_last=0), ValueError, "keep_last must be a positive int or None"),
        (dict(save_every=2, synchronous="yes"), TypeError, "synchronous must be a bool"),
    ]:
        with pytest.raises(err, match=match):
            RunConfig(tmp_path, **kwargs)
    train(tmp_path, 2, step8)
    run = Run(RunConfig(tmp_path, save_every=2))
    with pytest.raises(ValueError, match="saved .step 2. with a global batch of 16 rows; this start asks for 32"):
        run.micro_batches(CONFIG, zj.make_mesh(), 32)
    with pytest.raises(ValueError, match="another sampler .seed: saved 5, this sampler 6"):
        run.restore_or_init(
            models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG, data=IndexSampler(N_RECORDS, BATCH, seed=6)
        )
    with pytest.raises(ValueError, match="saved with a data position and this restore passes none"):
        Run(RunConfig(tmp_path, save_every=2)).restore_or_init(
            models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG
        )
    with pytest.raises(TypeError, match="data must have get_state"):
        Run(RunConfig(tmp_path, save_every=2)).restore_or_init(
            models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG, data=iter(range(3))
        )
    plain = tmp_path / "plain"
    zj.save_checkpoint(
        plain, zj.init_state(models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG), step=1, wait=True
    )
    with pytest.raises(
        zj.resume.NotARunError, match=r"holds checkpoints \(steps \[1\]\) but none was saved by a zerojax.resume.Run"
    ):
        Run(RunConfig(plain, save_every=2)).restore_or_init(
            models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG
        )


class BytesPosition:
    """A data iterator whose state is bytes, as grain's DataLoader iterators give."""

    def __init__(self):
        self.sampler = IndexSampler(N_RECORDS, BATCH, seed=5)

    def __next__(self):
        return next(self.sampler)

    def get_state(self):
        return json.dumps(self.sampler.get_state()).encode()

    def set_state(self, state):
        assert isinstance(state, bytes)
        self.sampler.set_state(json.loads(state))


def test_a_data_position_in_bytes_comes_back(tmp_path, step8):
    mesh = zj.make_mesh()
    for until in (2, 3):
        run, data = Run(RunConfig(tmp_path, save_every=2)), BytesPosition()
        state = run.restore_or_init(models.stacked_params(), TX, mesh=mesh, config=CONFIG, data=data)
        while run.step < until:
            idx = next(data)
            state, _ = step8(state, jax.tree.map(lambda x: x[idx], DATA))
            run.completed(state)
        run.finish(state)
    assert data.sampler.position == 3
    assert isinstance(zj.checkpoint.checkpoint_extra(tmp_path, 3)["data"]["bytes_base64"], str)


@pytest.mark.parametrize("seed", range(4))
def test_sampler_is_a_pure_function_of_its_position(seed):
    rng = np.random.default_rng(seed)
    n, b = int(rng.integers(5, 60)), None
    b = int(rng.integers(1, n + 1))
    s = IndexSampler(n, b, seed=seed)
    drawn = [next(s) for _ in range(int(rng.integers(1, 4 * (n // b) + 2)))]
    for batch in drawn:  # each epoch: distinct records, a permutation's blocks
        assert batch.shape == (b,) and len(set(batch.tolist())) == b and batch.max() < n
    per_epoch = n // b
    for e in range(len(drawn) // per_epoch):
        epoch = np.concatenate(drawn[e * per_epoch : (e + 1) * per_epoch])
        assert len(set(epoch.tolist())) == per_epoch * b
    k = int(rng.integers(0, len(drawn)))
    t = IndexSampler(n, b, seed=seed)
    t.set_state({**s.get_state(), "position": k})
    assert all(np.array_equal(next(t), d) for d in drawn[k:])
    with pytest.raises(ValueError, match="global_batch=.* is larger than num_records"):
        IndexSampler(n, n + 1)


def test_stage3_hybrid_fp16_frozen_resume_is_bit_identical(tmp_path):
    # Features together: ZeRO-3 on a hybrid mesh (2 replica groups), fp16 with loss scaling,
    # a frozen leaf, and two interruptions.
    mesh, config = (
        zj.make_mesh(replicas=2),
        zj.ZeroConfig(stage=3, compute_dtype="float16", loss_scaling={"loss_scale": "dynamic"}),
    )
    trainable = jax.tree_util.tree_map_with_path(
        lambda p, _: "inp" not in jax.tree_util.keystr(p), models.stacked_params()
    )
    step = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=config)

    def start(directory, until):
        run, data = Run(RunConfig(directory, save_every=2)), IndexSampler(N_RECORDS, BATCH, seed=5)
        state = run.restore_or_init(
            models.stacked_params(), TX, mesh=mesh, config=config, data=data, trainable=trainable
        )
        while run.step < until:
            idx = next(data)
            state, _ = step(state, jax.tree.map(lambda x: x[idx], DATA))
            run.completed(state)
        run.finish(state)
        return state

    ref = start(tmp_path / "ref", 6)
    for until in (3, 5, 6):
        got = start(tmp_path / "run", until)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(got), leaves(ref)))
    assert float(got.loss_scale.scale) == float(ref.loss_scale.scale)
    frozen = zj.gather_params(got)["inp"]["w"]  # in the compute dtype, and never updated
    assert np.array_equal(np.asarray(frozen), np.asarray(models.stacked_params()["inp"]["w"]).astype(np.float16))


# -- damage and misuse ----------------------------------------------------------------------


def test_a_lost_run_record_and_a_stray_folder_are_damage_skipped_by_name(tmp_path, step8, uninterrupted, capsys):
    train(tmp_path, 6, step8)  # checkpoints 2, 4, 6
    shutil.rmtree(tmp_path / "6" / "extra")  # step 6's run record lost
    os.makedirs(tmp_path / "99")  # a stray folder named like a step
    capsys.readouterr()
    train(tmp_path, 6, step8)
    out = capsys.readouterr().out
    for s in (99, 6):
        assert f"checkpoint {tmp_path / str(s)} is damaged (it has no run record" in out, out
        assert f"moved the damaged checkpoint aside to {tmp_path / f'{s}.damaged'}" in out
    assert "resuming at step 4" in out
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [2, 4, 6]  # 6 saved again; 99 no longer blocks saves
    state, _, _ = train(tmp_path, 9, step8)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state), uninterrupted[0]))


def test_a_save_orbax_declines_raises_instead_of_passing_for_saved(tmp_path):
    state = zj.init_state({"w": jnp.ones((8, 4))}, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig())
    zj.save_checkpoint(tmp_path, state, step=4, wait=True)
    for step in (4, 3):
        with pytest.raises(
            zj.checkpoint.io.CheckpointNotSavedError, match=f"step {step} was not saved .* already holds step 4"
        ):
            zj.save_checkpoint(tmp_path, state, step=step, wait=True)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [4]


def _start(directory, step8, until, run=None):
    run = run or Run(RunConfig(directory, save_every=2))
    data = IndexSampler(N_RECORDS, BATCH, seed=5)
    state = run.restore_or_init(models.stacked_params(), TX, mesh=zj.make_mesh(), config=CONFIG, data=data)
    while run.step < until:
        state, _ = step8(state, jax.tree.map(lambda x: x[next(data)], DATA))
        run.completed(state)
    return run, state


def test_a_second_job_on_the_folder_is_refused_and_a_taken_folder_stops_the_saves(tmp_path, step8, monkeypatch):
    monkeypatch.setenv("ZEROJAX_JOB_ID", "job A")
    run_a, state_a = _start(tmp_path, step8, 2)  # saves step 2; job A owns the folder
    monkeypatch.setenv("ZEROJAX_JOB_ID", "job B")
    host = socket.gethostname()
    with pytest.raises(
        zj.resume.RunOwnedError, match=f"being written by another job, job A \\(process 0: pid {os.getpid()} on {host},"
    ):
        _start(tmp_path, step8, 4)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [2]
    # Job A's claim is taken over (as by a job that found A's host gone): A stops before its next save.
    record = json.loads((tmp_path / "zerojax-run-owner.json").read_text())
    (tmp_path / "zerojax-run-owner.json").write_text(json.dumps({**record, "job": "job C", "pid": 1}))
    monkeypatch.setenv("ZEROJAX_JOB_ID", "job A")
    state_a, _ = step8(state_a, jax.tree.map(lambda x: x[:BATCH], DATA))
    run_a.completed(state_a)  # step 3: no save due
    with pytest.raises(zj.resume.RunOwnedError, match="now written by another job, job C .*stops before saving"):
        run_a.completed(state_a)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [2]
    # A job whose process 0 is gone from this host, or whose run finished, gives the folder up at once.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "zerojax-run-owner.json").write_text(json.dumps({**record, "job": "job C", "pid": int(gone.stdout)}))
    monkeypatch.setenv("ZEROJAX_JOB_ID", "job D")
    run_d, state_d = _start(tmp_path, step8, 4)
    run_d.finish(state_d)
    assert json.loads((tmp_path / "zerojax-run-owner.json").read_text())["released"] is True
    monkeypatch.setenv("ZEROJAX_JOB_ID", "job E")
    assert _start(tmp_path, step8, 4)[0].step == 4


def test_a_folder_that_takes_no_writes_is_refused_before_step_1(tmp_path, step8):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        zj.resume.RunFolderError, match=r"ckpt is not writable from process \d+ on .*NotADirectoryError"
    ):
        _start(tmp_path / "file" / "ckpt", step8, 1)
    # A folder without write permission (checked as an unprivileged user: root writes anywhere).
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    tmp_path.chmod(0o755)
    script = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("owner", {str(pathlib.Path(zj.resume.owner.__file__))!r})
owner = importlib.util.module_from_spec(spec); spec.loader.exec_module(owner)
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter's files need not be readable to nobody
try:
    owner.check_writable({str(ro)!r})
except owner.RunFolderError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert f"folder {ro} is not writable from process" in out.stdout and "PermissionError" in out.stdout, out


def test_a_resume_on_another_device_count_says_a_keyed_state_leaves_the_trajectory(tmp_path, capsys):
    """A state with a key (dropout's randomness is drawn per device and micro-batch): the
    resume message says so when the data-parallel degree changes, and not when it stays."""
    config = zj.ZeroConfig(stage=1)
    for devices, says in ((8, False), (8, False), (4, True)):
        mesh = zj.make_mesh(jax.devices()[:devices])
        run = Run(RunConfig(tmp_path, save_every=1))
        state = run.restore_or_init(models.mlp_params(), TX, mesh=mesh, config=config, rng=jax.random.key(0))
        run.completed(state)
        run.finish(state)
        out = capsys.readouterr().out
        assert ("randomness drawn from the step's key (dropout) is drawn per device" in out) == says, out
