"""Bad input is rejected before any compute, with a message naming the value and the fix."""

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
    with pytest.raises(ValueError, match=r"\['x'\] has leading dimension 12.*8 devices.*multiple of 8 \(e.g. 8 or 16\)"):
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
    with pytest.raises(ValueError, match="ZeroConfig\\(axis=...\\)"):
        zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=zj.ZeroConfig())
    # Naming the axis fixes it.
    zj.init_state(models.mlp_params(), TX, mesh=mesh, config=zj.ZeroConfig(axis="batch"))


def test_state_and_step_must_agree(setup):
    mesh, _, state = setup
    step = zj.make_train_step(models.mlp_loss, TX, mesh=mesh, config=zj.ZeroConfig(stage=1))
    with pytest.raises(ValueError, match="state was built for .*stage=3.*this train step uses .*stage=1"):
        step(state, models.batch(16))


def test_not_an_optimizer():
    with pytest.raises(TypeError, match=r"tx must be an optax optimizer: an object with init\(params\) and update"):
        zj.init_state(models.mlp_params(), optax.sgd, mesh=zj.make_mesh(), config=zj.ZeroConfig())


def test_formula_refuses_an_unknown_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be 'float32', 'bfloat16' or 'float16', got 'fp16'"):
        zj.zero_formula_bytes(1e9, 8, 1, compute_dtype="fp16")
