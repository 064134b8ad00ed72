"""Bad input is rejected before any compute, with a message naming the value and the fix."""

import dataclasses
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models

TX = optax.sgd(0.1)


@pytest.fixture
def setup():
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=cfg)
    return mesh, cfg, state


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "3"])
def test_stage_outside_range(stage):
    with pytest.raises(ValueError, match=r"ZeroConfig.stage must be one of \(0, 1, 2, 3\), got"):
        zj.ZeroConfig(stage=stage)


def test_batch_not_divisible_by_data_axis(setup):
    mesh, cfg, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    bad = models.batch(12)
    with pytest.raises(
        ValueError, match=r"\['x'\] has leading dimension 12.*8 devices.*multiple of 8 \(e.g. 8 or 16\)"
    ):
        step(state, bad)
    with pytest.raises(ValueError, match="leading dimension 12"):
        step.lower(state, bad)
    assert step.compile_count() == 0  # nothing was traced or compiled
    # The state is untouched (not donated) and still usable.
    state, m = step(state, models.batch(16))
    assert np.isfinite(float(m["loss"]))


def test_batch_leaf_without_leading_axis(setup):
    mesh, cfg, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"\['y'\] has no leading axis"):
        step(state, {"x": jnp.ones((16, models.IN)), "y": jnp.float32(1.0)})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_not_scalar(stage):
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=cfg)
    vector_loss = lambda p, b: (b["x"] @ p["inp"]["w"]).sum(axis=1)
    step = zj.make_train_step(vector_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"loss_fn must return a floating scalar loss, got .* shape \(2,\)"):
        step(state, models.batch(16))


def test_aux_without_has_aux(setup):
    mesh, cfg, state = setup
    fn = lambda p, b: (models.mlp_loss(p, b), {"n": 1.0})
    step = zj.make_train_step(fn, TX, mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match="pass has_aux=True"):
        step(state, models.batch(16))


@pytest.mark.parametrize("leaf", [jnp.arange(4), jnp.array([True, False]), "weights", 3.0])
def test_params_must_be_floating_arrays(leaf):
    params = {"w": jnp.ones((4, 4)), "bad": leaf}
    with pytest.raises(TypeError, match=r"params leaf \['bad'\]"):
        zj.init_state(params, TX, mesh=zj.make_mesh(), config=zj.ZeroConfig())


def test_mesh_without_configured_axis():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"mesh has axes \('batch',\) but the config names axis 'data'"):
        zj.init_state(models.mlp_params(), TX, mesh=mesh, config=zj.ZeroConfig())
    with pytest.raises(ValueError, match=r"ZeroConfig\(axes={'data': ...}\)"):
        zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=zj.ZeroConfig())
    # Naming the axis fixes it.
    zj.init_state(models.mlp_params(), TX, mesh=mesh, config=zj.ZeroConfig(axes={"data": "batch"}))


def test_state_and_step_must_agree(setup):
    mesh, _, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=zj.ZeroConfig(stage=1))
    with pytest.raises(ValueError, match=r"different settings \(state -> train step\): config: stage: 3 -> 1\. "):
        step(state, models.batch(16))


def test_not_an_optimizer():
    with pytest.raises(TypeError, match=r"tx must be an optax optimizer: an object with init\(params\) and update"):
        zj.init_state(models.mlp_params(), optax.sgd, mesh=zj.make_mesh(), config=zj.ZeroConfig())


def test_formula_refuses_an_unknown_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be 'float32', 'bfloat16' or 'float16', got 'fp16'"):
        zj.report.zero_formula_bytes(1e9, 8, 1, compute_dtype="fp16")


DONATED = r"""
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, optax, tempfile, zerojax as zj

mesh, tx = zj.make_mesh(), optax.adam(1e-3)
loss_fn = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
x = jnp.ones((8, 16))
for stage in (0, 3):
    cfg = zj.ZeroConfig(stage=stage)
    state = zj.init_state({"w": jnp.ones((16, 4))}, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
    new, _ = step(state, x)
    calls = {"train step": lambda: step(state, x),
             "eval step": lambda: zj.make_eval_step(loss_fn, mesh=mesh, config=cfg)(state, x),
             "gather_params": lambda: zj.gather_params(state),
             "save_checkpoint": lambda: zj.save_checkpoint(tempfile.mkdtemp(), state, step=0)}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            assert "donated" in str(e) and "ZeroConfig(donate=False)" in str(e), e
            print(stage, name, "refused")
        else:
            print(stage, name, "ran")
    print(stage, "new state", float(step(new, x)[1]["loss"]))
cfg = zj.ZeroConfig(stage=3, donate=False)
state = zj.init_state({"w": jnp.ones((16, 4))}, tx, mesh=mesh, config=cfg)
step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)
print("kept", float(step(state, x)[1]["loss"]), float(step(state, x)[1]["loss"]))
"""


def test_a_donated_state_is_refused_not_a_crash(tmp_path):
    """A train step consumes (donates) its input state; passing that state again used to
    crash the interpreter (segmentation fault). Every entry point refuses it with a
    Python error naming donation and the fix."""
    script = tmp_path / "donated.py"
    script.write_text(DONATED)
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    lines = r.stdout.splitlines()
    for stage in (0, 3):
        for name in ("train step", "eval step", "gather_params", "save_checkpoint"):
            assert f"{stage} {name} refused" in lines, r.stdout
        # The state the step returned is the one to use: Adam's first step moves w = 1 by 1e-3.
        loss = float(next(l for l in lines if l.startswith(f"{stage} new state")).split()[-1])
        np.testing.assert_allclose(loss, np.mean((np.ones((8, 16)) @ np.full((16, 4), 1 - 1e-3)) ** 2), rtol=1e-5)
    assert "kept 256.0 256.0" in r.stdout


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_only_settings_are_refused_alike_below_stage_3(stage):
    """prefetch and int8 gathers both act on stage 3's per-use weight gathers: below stage 3
    both are refused (prefetch used to be accepted and ignored), naming the stage."""
    with pytest.raises(
        ValueError,
        match=rf"ZeroConfig.prefetch=2 gathers stage 3's weights .* stage {stage} gathers "
        r"none per use. Use stage=3",
    ):
        zj.ZeroConfig(stage=stage, prefetch=2)
    with pytest.raises(
        ValueError,
        match=rf"gather_dtype='int8' quantizes stage 3's weight gathers; stage {stage} "
        r"gathers none per use. Use stage=3",
    ):
        zj.ZeroConfig(stage=stage, collectives={"gather_dtype": "int8"})
    assert zj.ZeroConfig(stage=3, prefetch=2).prefetch == 2


def test_a_config_prints_what_differs_from_the_defaults_as_code():
    """repr is code() (not every group's defaults), it evaluates, a named remat policy
    included, and differences() names only the fields that differ."""
    cfgs = [
        zj.ZeroConfig(),
        zj.ZeroConfig(stage=2, compute_dtype="bfloat16", grad_accum_steps=4),
        zj.ZeroConfig(remat=zj.remat.Remat("names", names=("attn_out",)), offload={"optimizer": True}),
        # a group inside a group: written as zj.config code too, its defaults left out
        zj.ZeroConfig(stage=2, offload={"optimizer": True, "nvme": {"path": "/nvme", "buffer_count": 3}}),
    ]
    for cfg in cfgs:
        assert repr(cfg) == cfg.code() and eval(repr(cfg), {"zj": zj}) == cfg
    assert "nvme=zj.config.NVMe(path='/nvme', buffer_count=3))" in cfgs[3].code()
    assert repr(cfgs[0]) == "zj.ZeroConfig(stage=3)"
    assert cfgs[1].differences(cfgs[2]) == (
        "stage: 2 -> 3; compute_dtype: 'bfloat16' -> 'float32'; grad_accum_steps: 4 -> 1; "
        "remat: Remat(kind='none', names=()) -> Remat(kind='names', names=('attn_out',)); "
        "offload.optimizer: False -> True"
    )
    assert cfgs[0].differences(zj.ZeroConfig()) == "none"


def test_batch_leaves_with_different_row_counts_name_both(setup):
    mesh, cfg, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    b = {"x": models.batch(16)["x"], "y": models.batch(32)["y"]}
    with pytest.raises(ValueError, match=r"\['x'\] has 16 and \['y'\] has 32"):
        step(state, b)


def test_a_batch_committed_to_one_device_is_placed_on_the_mesh(setup):
    """A single-device loader's habit (jax.device_put(x, jax.devices()[0])) is moved onto the
    mesh, giving the step of the uncommitted batch."""
    mesh, cfg, _ = setup
    cfg = dataclasses.replace(cfg, donate=False)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    b = models.batch(16)
    on_one = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[3]), b)
    assert all(x.committed for x in jax.tree.leaves(on_one))
    _, want = step(state, b)
    _, got = step(state, on_one)
    assert float(got["loss"]) == float(want["loss"]) and float(got["grad_norm"]) == float(want["grad_norm"])


def test_a_flax_style_call_names_the_zerojax_call(setup):
    from flax import nnx

    mesh, cfg, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    with pytest.raises(TypeError, match=r"called as step\(state, batch\) -> \(state, metrics\); it got 3"):
        step(state, state, models.batch(16))
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = zj.nnx.Optimizer(model, TX, mesh=mesh, config=cfg)
    train_step = zj.nnx.make_train_step(lambda m, b: jnp.mean(m(b) ** 2))
    with pytest.raises(TypeError, match=r"train_step\(optimizer, batch\), not as Flax's"):
        train_step(model, opt, jnp.ones((8, 3)))


def test_float16_scaling_knobs_without_float16_say_they_do_nothing(monkeypatch):
    from zerojax.config import zero as Z

    monkeypatch.setattr(Z, "_said_unused_scaling", False)
    with pytest.warns(
        UserWarning, match=r"sets initial_scale_power, loss_scale_window.*'bfloat16' runs no loss scaling"
    ):
        zj.ZeroConfig(compute_dtype="bfloat16", loss_scaling={"initial_scale_power": 12, "loss_scale_window": 10})
    monkeypatch.setattr(Z, "_said_unused_scaling", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zj.ZeroConfig(compute_dtype="float16", loss_scaling={"initial_scale_power": 12})  # used: no word
        zj.ZeroConfig(compute_dtype="bfloat16")


def test_initialize_after_jax_was_used_says_it_fails_under_a_launcher(monkeypatch):
    """In one process a late zj.distributed.initialize() works; it says that the same
    script fails under a launcher (the backends here are up: the fixtures made arrays)."""
    from zerojax.distributed import init

    monkeypatch.setattr(init, "_CALLED", False)
    with pytest.warns(UserWarning, match=r"called after JAX was used.*under a launcher the same script fails"):
        zj.distributed.initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zj.distributed.initialize()  # a second call is not a late first one
