"""Sharded orbax checkpoints: resume anywhere, reshard across stage and device count, export."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "workers" / "checkpoint_job.py"
TX = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))


def trained(stage, n, steps, tx=TX, cfg_kw=None, state=None, start=0):
    mesh = zj.make_mesh(jax.devices()[:n])
    cfg = zj.ZeroConfig(stage=stage, **(cfg_kw or {}))
    if state is None:
        state = zj.init_state(models.stacked_params(), tx, mesh=mesh, config=cfg)
    step = models.shared_step(models.stacked_loss, tx, mesh=mesh, config=cfg)
    for i in range(start, start + steps):
        state, _ = step(state, models.batch(16, seed=i))
    return state


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def restore(d, stage, n, tx=TX, cfg_kw=None, step=None):
    mesh = zj.make_mesh(jax.devices()[:n])
    return zj.restore_checkpoint(
        d, models.stacked_params(), tx, mesh=mesh, config=zj.ZeroConfig(stage=stage, **(cfg_kw or {})), step=step
    )


@pytest.mark.parametrize(
    "stage,n",
    [(0, 8), (2, 4), (3, 8), pytest.param(1, 8, marks=pytest.mark.slow), pytest.param(3, 2, marks=pytest.mark.slow)],
)
def test_resume_is_bit_for_bit(tmp_path, stage, n):
    """10 steps straight == 5, save, restore, 5 more (same stage and device count)."""
    straight = trained(stage, n, 10)
    half = trained(stage, n, 5)
    zj.save_checkpoint(tmp_path, half, step=5, wait=True)
    resumed = restore(tmp_path, stage, n)
    assert int(resumed.step) == 5
    for a, b in zip(leaves(half.opt_state), leaves(resumed.opt_state)):
        np.testing.assert_array_equal(a, b)
    resumed = trained(stage, n, 5, state=resumed, start=5)
    for a, b in zip(leaves(zj.gather_params(straight)), leaves(zj.gather_params(resumed))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(straight.opt_state), leaves(resumed.opt_state)):
        np.testing.assert_array_equal(a, b)


PAIRS = [((3, 8), (1, 4)), ((3, 8), (0, 1)), ((0, 1), (3, 8)), ((1, 4), (2, 2)), ((2, 2), (3, 1))]
ALL_PAIRS = [
    (s, d)
    for s in [(3, 8), (0, 1), (1, 4), (2, 2)]
    for d in [(3, 8), (1, 4), (0, 1), (2, 2), (3, 1)]
    if (s, d) not in PAIRS
]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_reshard_across_stage_and_device_count(tmp_path, src, dst):
    _reshard(tmp_path, src, dst)


@pytest.mark.slow  # reason: 15 more pairs, three trainings each; test_reshard_across_stage_and_device_count's five pairs
@pytest.mark.parametrize("src,dst", ALL_PAIRS)
def test_reshard_full_matrix(tmp_path, src, dst):
    _reshard(tmp_path, src, dst)


def _reshard(tmp_path, src, dst):
    straight = trained(dst[0], dst[1], 6)
    zj.save_checkpoint(tmp_path, trained(*src, 3), step=3, wait=True)
    resumed = trained(dst[0], dst[1], 3, state=restore(tmp_path, *dst), start=3)
    assert int(resumed.step) == 6
    err = max(
        np.abs(a - b).max() for a, b in zip(leaves(zj.gather_params(straight)), leaves(zj.gather_params(resumed)))
    )
    assert err <= 1e-5


def test_masters_loss_scale_and_counters_carry_over(tmp_path):
    """fp16 stage 1 (separate fp32 masters, dynamic scale) -> stage 3 on 4 devices -> stage 2."""
    kw = dict(compute_dtype="float16", loss_scaling={"loss_scale_window": 2, "initial_scale_power": 8})
    tx = optax.adamw(1e-3)
    src = trained(1, 8, 5, tx=tx, cfg_kw=kw)
    assert float(src.loss_scale.scale) > 2.0**8  # it grew: the state is not the initial one
    zj.save_checkpoint(tmp_path, src, step=5, wait=True)
    for stage, n in ((3, 4), (2, 8)):
        got = restore(tmp_path, stage, n, tx=tx, cfg_kw=kw)
        assert int(got.step) == 5 and int(got.skipped) == int(src.skipped)
        for a, b in zip(leaves(src.loss_scale), leaves(got.loss_scale)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(leaves(zj.gather_params(src)), leaves(zj.gather_params(got))):
            np.testing.assert_array_equal(a, b)  # the fp32 masters, not the fp16 copy
        count = lambda s: int(jax.tree.leaves(s.opt_state)[0])
        assert count(got) == count(src) == 5


# Another process start per case: 2 devices in the default set, 1 and 4 in the slow one (in
# this process, the 8-device stage-3 checkpoint restores onto 1 device at stage 0 in
# test_reshard_across_stage_and_device_count, stage 3 on 4 devices in
# test_masters_loss_scale_and_counters_carry_over).
@pytest.mark.parametrize(
    "devices,stage", [(2, 1), pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(4, 3, marks=pytest.mark.slow)]
)
def test_restore_in_a_process_with_another_device_count(tmp_path, devices, stage):
    straight = trained(stage, devices, 6)  # same math as the subprocess' mesh
    zj.save_checkpoint(tmp_path / "ck", trained(3, 8, 3), step=3, wait=True)
    out = tmp_path / "params.npz"
    r = subprocess.run(
        [
            sys.executable,
            str(JOB),
            "restore",
            str(tmp_path / "ck"),
            str(out),
            "--devices",
            str(devices),
            "--stage",
            str(stage),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    assert int(got["step"]) == 6
    ref = leaves(zj.gather_params(straight))
    assert max(np.abs(got[f"arr_{i}"] - x).max() for i, x in enumerate(ref)) <= 1e-5


def test_script_that_exits_normally_keeps_its_checkpoint(tmp_path):
    r = subprocess.run(
        [sys.executable, str(JOB), "save-and-exit", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [7]
    assert int(restore(tmp_path, 3, 8).step) == 0


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    r = subprocess.run(
        [sys.executable, str(JOB), "save-and-die", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    assert "killing myself mid-save" in r.stdout
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [1]  # step 2 is not complete
    params = {"w": jnp.ones((64, 64))}
    state = zj.restore_checkpoint(tmp_path, params, TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    np.testing.assert_array_equal(np.asarray(zj.gather_params(state)["w"]), np.ones((64, 64)))
    # The directory stays usable: a new step 2 saves and becomes the latest.
    zj.save_checkpoint(tmp_path, state, step=2, wait=True)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [1, 2]


def test_retention_and_latest(tmp_path):
    state = trained(3, 8, 1)
    for s in range(1, 10):
        zj.save_checkpoint(tmp_path, state, step=s, keep_last=2, keep_every=4)
    zj.checkpoint.wait(tmp_path)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [4, 8, 9]
    restored = restore(tmp_path, 3, 8)  # latest by default
    assert int(restored.step) == 1
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 .* steps \[4, 8, 9\]"):
        restore(tmp_path, 3, 8, step=5)


def test_bad_restores_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*no complete saved step"):
        restore(tmp_path / "empty", 3, 8)
    zj.save_checkpoint(tmp_path, trained(3, 8, 1), step=1, wait=True)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    wrong_shape = models.stacked_params()
    wrong_shape["out"]["w"] = jnp.zeros((20, 9))
    wrong_shape["out"]["b"] = jnp.zeros((9,))
    with pytest.raises(
        zj.checkpoint.CheckpointMismatchError,
        match=r"in 2 leaves:\n  \['out'\]\['b'\]: checkpoint \(7,\), params \(9,\)\n"
        r"  \['out'\]\['w'\]: checkpoint \(20, 7\), params \(20, 9\)",
    ):
        zj.restore_checkpoint(tmp_path, wrong_shape, TX, mesh=mesh, config=cfg)
    wrong_tree = models.stacked_params()
    wrong_tree["extra"] = jnp.zeros((3,))
    with pytest.raises(ValueError, match=r"\['extra'\]: in params \(3,\), not in the checkpoint"):
        zj.restore_checkpoint(tmp_path, wrong_tree, TX, mesh=mesh, config=cfg)
    with pytest.raises(
        ValueError, match=r"checkpoint holds optimizer state .*TraceState.*this tx.init gives .*ScaleByAdamState"
    ):
        zj.restore_checkpoint(tmp_path, models.stacked_params(), optax.adam(1e-3), mesh=mesh, config=cfg)


# bfloat16 in the slow set: the CLI's --dtype cast is test_cli's (float16, against a cast
# of gather_params) in the default set.
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_export_consolidated_weights_cli(tmp_path, dtype):
    from safetensors.numpy import load_file

    state = trained(3, 8, 2)
    zj.save_checkpoint(tmp_path / "ck", state, step=2, wait=True)
    out = tmp_path / "weights.safetensors"
    r = subprocess.run(
        [sys.executable, "-m", "zerojax.cli", "export", str(tmp_path / "ck"), str(out), "--dtype", dtype],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote 8 tensors" in r.stdout
    weights = load_file(out)  # no zerojax involved
    full = zj.gather_params(state)
    assert set(weights) == {"inp.w", "inp.b", "layers.w", "layers.b", "out.w", "out.b", "skip", "temp"}
    want = np.asarray(full["layers"]["w"])
    if dtype == "float32":
        np.testing.assert_array_equal(weights["layers.w"], want)
    else:
        import ml_dtypes

        np.testing.assert_array_equal(
            weights["layers.w"].astype(np.float32), want.astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    if dtype == "float32":  # a missing checkpoint (no --dtype to it: once, not once per dtype)
        r = subprocess.run(
            [sys.executable, "-m", "zerojax.cli", "export", str(tmp_path / "none"), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_export_refuses_colliding_names(tmp_path):
    params = {"a": {"b": jnp.ones((3,))}, "a.b": jnp.zeros((3,))}
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    zj.save_checkpoint(tmp_path / "ck", zj.init_state(params, TX, mesh=mesh, config=cfg), step=0, wait=True)
    out = tmp_path / "w.safetensors"
    with pytest.raises(
        ValueError, match=r"parameter paths \['a'\]\['b'\] and \['a.b'\] both become the tensor name 'a.b'"
    ):
        zj.export_weights(tmp_path / "ck", out)
    assert not out.exists() and not list(tmp_path.glob("w.safetensors*"))


def test_retention_is_each_calls_own_and_replaced_managers_are_closed(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    closed = []
    close = ocp.CheckpointManager.close
    monkeypatch.setattr(ocp.CheckpointManager, "close", lambda self: (closed.append(self), close(self))[1])
    state = trained(3, 8, 1)
    for s in range(1, 5):
        zj.save_checkpoint(tmp_path, state, step=s, keep_last=2)
    zj.checkpoint.wait(tmp_path)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [3, 4]
    for s in range(5, 8):  # no retention asked: every step is kept
        zj.save_checkpoint(tmp_path, state, step=s)
    zj.checkpoint.wait(tmp_path)
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [3, 4, 5, 6, 7]
    assert len(closed) == 1  # the keep_last=2 manager, replaced once


def test_your_own_checkpoint_manager(tmp_path):
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(max_to_keep=1))
    state = trained(2, 8, 2)
    zj.save_checkpoint(mngr, state, step=1)
    zj.save_checkpoint(mngr, state, step=2, wait=True)
    assert zj.checkpoint.checkpoint_steps(mngr) == [2] == sorted(mngr.all_steps())
    got = zj.restore_checkpoint(mngr, models.stacked_params(), TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    for a, b in zip(leaves(zj.gather_params(state)), leaves(zj.gather_params(got))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="with your own CheckpointManager set max_to_keep"):
        zj.save_checkpoint(mngr, state, step=3, keep_last=2)


def test_restore_onto_an_abstract_state(tmp_path):
    """As orbax does: the target's layout (stage, devices, precision) says what to build."""
    src = trained(3, 8, 3)
    zj.save_checkpoint(tmp_path, src, step=3, wait=True)
    mesh = zj.make_mesh(jax.devices()[:4])
    target = zj.abstract_state(
        models.stacked_params(), TX, mesh=mesh, config=zj.ZeroConfig(stage=1, compute_dtype="bfloat16")
    )
    got = zj.restore_checkpoint(tmp_path, target)
    assert int(got.step) == 3 and got.plan == target.plan
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
    for a, b in zip(leaves(zj.gather_params(src)), leaves(zj.gather_params(got))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"needs tx, mesh and config \(missing \['tx'\]\)"):
        zj.restore_checkpoint(tmp_path, models.stacked_params(), mesh=mesh, config=zj.ZeroConfig())
    with pytest.raises(ValueError, match="either a state target .* alone"):
        zj.restore_checkpoint(tmp_path, target, TX)


def test_step_timeout_finishes_the_save_in_flight_and_says_so(tmp_path):
    """The watchdog ends the process with os._exit, which skips exit hooks: the save in
    flight is finished first, explicitly, and the message says so."""
    r = subprocess.run(
        [sys.executable, str(JOB), "save-then-time-out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "did not finish within timeout_s=0.001s" in r.stderr
    in_flight = f"an asynchronous checkpoint save to {tmp_path} was in progress; it completed (latest step 5)"
    from zerojax.checkpoint import io

    if io._EXIT_CANNOT_FINISH_SAVES:  # CPython 3.12.0-3.12.1: the save completed before it returned
        assert in_flight not in r.stderr and "save_checkpoint waits for each save to complete" in r.stderr
    else:
        assert in_flight in r.stderr
    assert zj.checkpoint.checkpoint_steps(tmp_path) == [5]


def test_a_checkpoint_of_the_old_format_is_refused_clearly(tmp_path):
    import json

    zj.save_checkpoint(tmp_path, trained(3, 8, 1), step=1, wait=True)
    meta_file = tmp_path / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["format"] == 2
    meta["format"] = 1
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format 1; this zerojax reads format 2 .* restore them with that version"):
        restore(tmp_path, 3, 8)
    with pytest.raises(ValueError, match="format 1"):
        zj.export_weights(tmp_path, tmp_path / "w.safetensors")


def test_layouts_that_change_with_the_device_count_restore_exactly(tmp_path):
    """A (24, 40) leaf is split along dim 1 on 8 devices and along dim 0 on 3 (40 does not
    divide 3 within 2%): restoring moves it between the two layouts, values unchanged."""
    params = {"w": jnp.asarray(np.arange(960.0).reshape(24, 40) / 960, jnp.float32), "b": jnp.ones((40,))}
    tx = optax.adam(1e-3)
    src = zj.init_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    assert src.plan.layouts[1].describe() == "split along dim 1"
    zj.save_checkpoint(tmp_path, src, step=0, wait=True)
    mesh3 = zj.make_mesh(jax.devices()[:3])
    for stage in (3, 1):
        got = zj.restore_checkpoint(tmp_path, params, tx, mesh=mesh3, config=zj.ZeroConfig(stage=stage))
        assert got.plan.layouts[1].describe() == "split along dim 0"
        np.testing.assert_array_equal(np.asarray(zj.gather_params(got)["w"]), np.asarray(params["w"]))


def test_export_keeps_a_parameter_whose_dict_key_is_value(tmp_path):
    """Only a flax.nnx Variable's ``.value`` attribute is dropped from a tensor name; a dict
    key named "value" (attention's query/key/value) is a parameter of its own."""
    from safetensors.numpy import load_file

    from zerojax.tensors.names import leaf_name

    rng = np.random.default_rng(0)
    params = {
        "attn": {k: jnp.asarray(rng.normal(size=(8, 4)), jnp.float32) for k in ("query", "key", "value")},
        "out": {"value": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
    }
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    zj.save_checkpoint(tmp_path / "ck", zj.init_state(params, TX, mesh=mesh, config=cfg), step=0, wait=True)
    zj.export_weights(tmp_path / "ck", tmp_path / "w.safetensors")
    weights = load_file(tmp_path / "w.safetensors")
    assert sorted(weights) == ["attn.key", "attn.query", "attn.value", "out.value"]
    for k in ("query", "key", "value"):
        np.testing.assert_array_equal(weights[f"attn.{k}"], np.asarray(params["attn"][k]))
    np.testing.assert_array_equal(weights["out.value"], np.asarray(params["out"]["value"]))
    assert leaf_name("['blocks']['linear']['kernel'].value") == "blocks.linear.kernel"
    assert leaf_name("['attn']['value'].value") == "attn.value"


# Stage 3 in float32: slow (each stage and each dtype is in the default set, stage 3 in
# bfloat16, where the exported weights are the fp32 masters, not the compute copy).
@pytest.mark.parametrize(
    "stage,compute",
    [(0, "float32"), (1, "bfloat16"), pytest.param(3, "float32", marks=pytest.mark.slow), (3, "bfloat16")],
)
def test_export_with_frozen_weights_writes_every_tensor(tmp_path, stage, compute):
    """LoRA-style runs: frozen weights are exported too (as the run stores them), and the
    file loads with safetensors, every tensor equal to gather_params'."""
    from safetensors.numpy import load_file

    params = models.stacked_params()
    mask = jax.tree.map(lambda _: True, params)
    mask["inp"] = mask["layers"] = {"w": False, "b": False}
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype=compute)
    state = zj.init_state(params, TX, mesh=mesh, config=cfg, trainable=mask)
    state, _ = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)(state, models.batch(16))
    want = {
        k: np.asarray(v)
        for k, v in zip(
            ["inp.b", "inp.w", "layers.b", "layers.w", "out.b", "out.w", "skip", "temp"],
            jax.tree.leaves(zj.gather_params(state)),
        )
    }
    zj.save_checkpoint(tmp_path / "ck", state, step=1, wait=True)
    shapes = zj.export_weights(tmp_path / "ck", tmp_path / "w.safetensors")
    weights = load_file(tmp_path / "w.safetensors")  # refused a file not fully covered
    assert set(weights) == set(shapes) == set(want)
    for name, x in want.items():
        np.testing.assert_array_equal(weights[name], x, err_msg=name)


def test_safetensors_header_writer_and_checker_agree_with_safetensors(tmp_path):
    """The one header writer lays a file out that safetensors reads (a scalar, an int and a
    bf16 tensor among them); the one checker refuses a file whose header or size differs."""
    import ml_dtypes
    from safetensors.numpy import load_file

    from zerojax.tensors.safetensors_files import StoredTensor, TensorWriter, check_file, header, stored_dtypes

    tensors = {"a": ((2, 3), np.float32), "b": ((4,), np.int32), "c": ((), ml_dtypes.bfloat16)}
    values = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.int32),
        "c": np.asarray(2.5, ml_dtypes.bfloat16),
    }
    names = ["a", "b", "c"]
    head, offsets = header(names, tensors, {"stored_dtypes": '{"a": "float32"}'})
    path = str(tmp_path / "w.safetensors")
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + 6 * 4 + 4 * 4 + 2)
    places = {n: StoredTensor(n, path, np.dtype(d), s, offsets[n]) for n, (s, d) in tensors.items()}
    with TensorWriter(places) as w:
        for n in names:
            w.write_box(n, tuple((0, d) for d in tensors[n][0]), values[n])
        with pytest.raises(ValueError, match=r"writing tensor 'a' \(float32\): values float64\[2, 3\]"):
            w.write_box("a", ((0, 2), (0, 3)), values["a"].astype(np.float64))  # casts are the caller's
    check_file(path, names, tensors)
    back = load_file(path)
    for n in names:
        np.testing.assert_array_equal(back[n], values[n])
    assert back["c"].shape == () and stored_dtypes(path) == {"a": "float32"}
    with pytest.raises(ValueError, match=r"lists tensors \['a', 'b', 'c'\], expected \['a', 'c'\]"):
        check_file(path, ["a", "c"], tensors)
    with pytest.raises(ValueError, match=r"tensor 'b' is int32\[4\] at byte \d+; expected int32\[5\]"):
        check_file(path, names, {**tensors, "b": ((5,), np.int32)})
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=r"has \d+ bytes; its header describes \d+"):
        check_file(path, names, tensors)


def test_reads_right_after_an_async_save_see_that_step(tmp_path):
    """save_checkpoint returns while the save is in flight; restore_checkpoint and
    export_weights on the same directory wait for it: they read the step just saved."""
    from safetensors.numpy import load_file

    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(256, 512)), jnp.float32)}
    mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=3), optax.sgd(0.1)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, mesh=mesh, config=cfg)
    x = jnp.ones((8, 256))
    for i in range(3):
        state, _ = step(state, x)
        zj.save_checkpoint(tmp_path / "ck", state, step=10 * (i + 1))
        out = tmp_path / f"w{i}.safetensors"
        zj.export_weights(tmp_path / "ck", out)
        restored = zj.restore_checkpoint(tmp_path / "ck", params, tx, mesh=mesh, config=cfg)
        assert int(restored.step) == i + 1
        want = np.asarray(zj.gather_params(state)["w"])
        np.testing.assert_array_equal(load_file(out)["w"], want)
        np.testing.assert_array_equal(np.asarray(zj.gather_params(restored)["w"]), want)


# --- the package's import structure ------------------------------------------------------------

_ISOLATED = r"""
import importlib, json, pkgutil, sys, types
root, out = sys.argv[1], {}
names = ["zerojax.state", "zerojax.checkpoint", "zerojax.tensors"] + sorted(
    f"zerojax.{pkg}." + m.name for pkg in ("checkpoint", "tensors")
    for m in pkgutil.iter_modules([f"{root}/zerojax/{pkg}"]))
for name in names:
    for m in [m for m in sys.modules if m == "zerojax" or m.startswith("zerojax.")]:
        del sys.modules[m]
    top = types.ModuleType("zerojax")  # without zerojax/__init__.py, which imports everything
    top.__path__ = [root + "/zerojax"]
    sys.modules["zerojax"] = top
    try:
        importlib.import_module(name)
        out[name] = sorted(m for m in sys.modules if m.startswith("zerojax."))
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _import_graph(lazy: bool, parents) -> dict[str, set[str]]:
    """zerojax's modules -> the zerojax modules they import (``lazy``: inside functions too;
    ``if TYPE_CHECKING:`` blocks aside), plus the package ``__init__`` that importing a
    submodule runs, for the packages ``parents`` accepts."""
    import ast

    mods = {}
    for p in (ROOT / "zerojax").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def imported(tree):
        class Visit(ast.NodeVisitor):
            found: list[str] = []

            def visit_FunctionDef(self, node):
                if lazy:
                    self.generic_visit(node)

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_If(self, node):
                if getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
                    for n in node.orelse:
                        self.visit(n)
                else:
                    self.generic_visit(node)

            def visit_Import(self, node):
                self.found += [a.name for a in node.names if a.name.startswith("zerojax")]

            def visit_ImportFrom(self, node):
                if not node.level and (node.module or "").startswith("zerojax"):
                    self.found += [
                        f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                        for a in node.names
                    ]

        v = Visit()
        v.found = []
        v.visit(tree)
        return v.found

    graph = {}
    for m, p in mods.items():
        deps = set()
        for name in imported(ast.parse(p.read_text())):
            while name not in mods and "." in name:
                name = name.rsplit(".", 1)[0]
            deps.add(name)
        parts = m.split(".")
        deps |= {".".join(parts[:i]) for i in range(2, len(parts)) if parents(".".join(parts[:i]))}
        graph[m] = deps - {m, "zerojax"}
    return graph


def _cycle_through(graph, start):
    """The shortest import cycle through ``start``, or None."""
    prev, queue = {start: None}, [start]
    while queue:
        u = queue.pop(0)
        for w in sorted(graph.get(u, ())):
            if w == start:
                path = [u]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in graph and w not in prev:
                prev[w] = u
                queue.append(w)
    return None


@pytest.mark.slow  # reason: a fresh interpreter per module (4 s); test_layering finds import cycles from the source in the default set
def test_the_checkpoint_package_imports_without_a_cycle():
    """Each module of zerojax.checkpoint and zerojax.tensors, and zerojax.state, imports on its own in a fresh
    interpreter (zerojax's own __init__, which imports everything, aside), and the modules
    below the state (maps, reading, loading, born) import neither the state nor the modules
    that take states (orbax checkpoints, the export pipeline). No cycle runs through the
    package or the state: neither in the imports that run at import time (with every package
    __init__ a submodule import runs), nor counting imports inside functions too."""
    r = subprocess.run(
        [sys.executable, "-c", _ISOLATED, str(ROOT)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout)
    failed = {k: v for k, v in loaded.items() if isinstance(v, str)}
    assert not failed, failed
    upper = {
        "zerojax.state",
        "zerojax.checkpoint.io",
        "zerojax.checkpoint.canonical",
        "zerojax.checkpoint.export",
        "zerojax.checkpoint.export_sources",
    }
    # zerojax.tensors (files, names, casts, maps, weights, born) is below the state: it imports
    # neither the state nor any of zerojax.checkpoint; the checkpoint modules that read and load
    # files take no state either.
    tensors = sorted(m for m in loaded if m.startswith("zerojax.tensors."))
    assert len(tensors) >= 8, tensors
    for name in tensors:
        above = {m for m in loaded[name] if m == "zerojax.state" or m.startswith("zerojax.checkpoint")}
        assert not above, (name, above)
    for name in ("load", "configs", "lora", "sinks"):
        name = f"zerojax.checkpoint.{name}"
        above = upper & set(loaded[name])
        assert not above, (name, above)
    assert loaded["zerojax.checkpoint"] == ["zerojax.checkpoint"]  # the package itself imports nothing
    ours = lambda m: m == "zerojax.state" or m.startswith(("zerojax.checkpoint", "zerojax.tensors"))
    for lazy, parents in (
        (False, lambda pkg: True),
        (True, lambda pkg: pkg in ("zerojax.checkpoint", "zerojax.tensors")),
    ):
        graph = _import_graph(lazy, parents)
        cycles = {m: _cycle_through(graph, m) for m in graph if ours(m)}
        assert not {m: c for m, c in cycles.items() if c}, cycles
