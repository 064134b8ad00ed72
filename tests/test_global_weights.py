"""zj.nn.global_weights: the masked mean over the global batch, from inside a step's loss
or from the data pipeline, against the masked mean on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj

T, D, LR = 6, 5, 0.1


def params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(D, D)), jnp.float32), "b": jnp.zeros((D,))}


def batch(seed, rows=16):
    """Masks with a different count on every device's rows (some rows all masked)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=rows)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    x = rng.normal(size=(rows, T, D)).astype(np.float32)
    return {"x": jnp.asarray(x), "mask": jnp.asarray(mask)}


def token_loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2, -1)


def masked_mean(p, b):  # the reference, on the whole global batch
    return jnp.sum(b["mask"] * token_loss(p, b["x"])) / jnp.sum(b["mask"])


def in_loss(p, b):
    return jnp.mean(zj.nn.global_weights(b["mask"]) * token_loss(p, b["x"]))


def from_pipeline(p, b):
    return jnp.mean(b["weights"] * token_loss(p, b["x"]))


@pytest.mark.parametrize("stage,devices,seed", [(0, 8, 0), (3, 8, 1), (2, 4, 2), (1, 2, 3)])
def test_in_the_loss_equals_the_global_masked_mean(stage, devices, seed):
    b, p = batch(seed), params()
    want_loss, want_grad = jax.value_and_grad(masked_mean)(p, b)
    mesh = zj.make_mesh(jax.devices()[:devices])
    cfg = zj.ZeroConfig(stage=stage)
    state = zj.init_state(p, optax.sgd(LR), mesh=mesh, config=cfg)
    state, m = zj.make_train_step(in_loss, optax.sgd(LR), mesh=mesh, config=cfg)(state, b)
    np.testing.assert_allclose(float(m["loss"]), float(want_loss), rtol=1e-5)
    got = zj.gather_params(state)
    jax.tree.map(lambda g, q, d: np.testing.assert_allclose(g, q - LR * d, rtol=1e-5, atol=1e-6), got, p, want_grad)
    # ... where the per-device masked mean is not: the devices count different tokens.
    local = zj.make_train_step(
        lambda p, b: jnp.sum(b["mask"] * token_loss(p, b["x"])) / jnp.maximum(jnp.sum(b["mask"]), 1),
        optax.sgd(LR),
        mesh=mesh,
        config=cfg,
    )
    _, m_local = local(zj.init_state(p, optax.sgd(LR), mesh=mesh, config=cfg), b)
    assert abs(float(m_local["loss"]) - float(want_loss)) > 1e-3


def test_with_accumulation_from_the_pipeline_and_refused_in_the_loss():
    b, p = batch(4), params()
    want_loss = float(masked_mean(p, b))
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, grad_accum_steps=2)
    state = zj.init_state(p, optax.sgd(LR), mesh=mesh, config=cfg)
    with pytest.raises(ValueError, match=r"grad_accum_steps=2.*batch\['weights'\] = zj.nn.global_weights\(mask\)"):
        zj.make_train_step(in_loss, optax.sgd(LR), mesh=mesh, config=cfg)(state, b)
    weighted = {**b, "weights": zj.nn.global_weights(b["mask"])}  # on the global batch
    _, m = zj.make_train_step(from_pipeline, optax.sgd(LR), mesh=mesh, config=cfg)(state, weighted)
    np.testing.assert_allclose(float(m["loss"]), want_loss, rtol=1e-5)


def test_in_an_eval_step_and_with_nothing_unmasked():
    b, p = batch(5), params()
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, grad_accum_steps=2)  # eval runs no micro-batches
    state = zj.init_state(p, optax.sgd(LR), mesh=mesh, config=cfg)
    out = zj.make_eval_step(in_loss, mesh=mesh, config=cfg)(state, b)
    np.testing.assert_allclose(float(out), float(masked_mean(p, b)), rtol=1e-5)
    assert float(jnp.sum(zj.nn.global_weights(jnp.zeros((4, 3))))) == 0.0
    with pytest.raises(TypeError, match="global_weights takes a mask"):
        zj.nn.global_weights(jnp.asarray(1.0))
