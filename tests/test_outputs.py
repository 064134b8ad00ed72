"""How aux and eval outputs combine over devices and micro-batches; the forward-only eval step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models

TX = optax.sgd(0.1)


def forward(p, x):
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    for layer in p["layers"]:
        h = h + jnp.tanh(h @ layer["w"] + layer["b"])
    return (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]


def loss_with_aux(p, b):
    pred = forward(p, b["x"])
    err = (pred - b["y"]) ** 2
    aux = {"pred": pred, "big": jnp.sum(err > 1.0), "mae": jnp.mean(jnp.abs(pred - b["y"]))}
    return jnp.mean(err), aux


@pytest.mark.parametrize("stage,k", [(0, 2), (1, 1), (2, 2), (3, 1), (3, 2)])
def test_aux_rules_equal_single_device_values(stage, k):
    params, b = models.mlp_params(), models.batch(32, 1)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage, grad_accum_steps=k)
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)
    step = zj.make_train_step(
        loss_with_aux,
        TX,
        mesh=mesh,
        config=cfg,
        has_aux=True,
        aux_reduce={"pred": "concat", "big": "sum", "mae": "mean"},
    )
    _, m = step(state, b)
    _, want = loss_with_aux(params, b)
    np.testing.assert_allclose(np.asarray(m["aux"]["pred"]), np.asarray(want["pred"]), rtol=1e-5, atol=1e-6)
    assert m["aux"]["big"].dtype == want["big"].dtype and int(m["aux"]["big"]) == int(want["big"])
    assert 0 < int(want["big"]) < 32 * models.OUT  # the count is not trivially 0 or all
    np.testing.assert_allclose(float(m["aux"]["mae"]), float(want["mae"]), rtol=1e-5)


def test_a_single_rule_applies_to_every_leaf():
    params, b = models.mlp_params(), models.batch(16)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    fn = lambda p, b: (models.mlp_loss(p, b), (forward(p, b["x"]), b["y"]))
    step = zj.make_train_step(fn, TX, mesh=mesh, config=cfg, has_aux=True, aux_reduce="concat")
    _, m = step(zj.init_state(params, TX, mesh=mesh, config=cfg), b)
    np.testing.assert_allclose(np.asarray(m["aux"][0]), np.asarray(forward(params, b["x"])), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(m["aux"][1]), np.asarray(b["y"]))


@pytest.mark.parametrize(
    "aux,rule,match",
    [
        (
            lambda p, b: {"pred": forward(p, b["x"])},
            None,
            r"aux\['pred'\] has shape \(2, 7\) and dtype float32: say how it combines .*aux_reduce=.*'concat'",
        ),
        (lambda p, b: {"n": jnp.sum(b["x"] > 0)}, None, r"aux\['n'\] has shape \(\) and dtype int32.*'sum'"),
        (
            lambda p, b: {"n": jnp.sum(b["x"] > 0)},
            "mean",
            r"aux\['n'\] has dtype int32: its mean .* Use aux_reduce='sum'",
        ),
        (lambda p, b: {"m": jnp.mean(b["x"])}, "concat", r"aux\['m'\] is a scalar: 'concat' joins per-example rows"),
        (lambda p, b: {"m": jnp.mean(b["x"])}, "median", r"aux_reduce for aux\['m'\] must be one of"),
        (lambda p, b: {"m": jnp.mean(b["x"])}, {"other": "sum"}, r"aux_reduce must be one of .* or a tree"),
    ],
)
def test_ambiguous_or_wrong_aux_rules_are_refused(aux, rule, match):
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=2)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=cfg)
    fn = lambda p, b: (models.mlp_loss(p, b), aux(p, b))
    step = zj.make_train_step(fn, TX, mesh=mesh, config=cfg, has_aux=True, aux_reduce=rule)
    with pytest.raises(ValueError, match=match):
        step(state, models.batch(16))


def test_aux_reduce_needs_has_aux():
    with pytest.raises(ValueError, match="aux_reduce .* needs has_aux=True"):
        zj.make_train_step(models.mlp_loss, TX, mesh=zj.make_mesh(), config=zj.ZeroConfig(), aux_reduce="sum")


def test_masked_mean_with_global_weights_equals_the_global_masked_mean():
    """The README's recipe for losses normalised by a count that differs between devices:
    per-token weights normalised over the global batch, then a plain local mean."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
    mask = np.zeros((16, 3), np.float32)
    mask[:3] = 1.0  # all valid tokens sit on the first two devices
    mask[10, 1] = 1.0

    def token_loss(p, x):
        return (x @ p["w"]) ** 2

    def global_masked_mean(p):
        return jnp.sum(token_loss(p, x) * mask) / mask.sum()

    weights = mask * (mask.size / mask.sum())
    loss_fn = lambda p, b: jnp.mean(token_loss(p, b["x"]) * b["w"])
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, grad_accum_steps=2)
    state = zj.init_state(params, optax.sgd(1.0), mesh=mesh, config=cfg)
    step = zj.make_train_step(loss_fn, optax.sgd(1.0), mesh=mesh, config=cfg)
    state, m = step(state, {"x": x, "w": jnp.asarray(weights)})
    np.testing.assert_allclose(float(m["loss"]), float(global_masked_mean(params)), rtol=1e-5)
    want = params["w"] - jax.grad(global_masked_mean)(params)["w"]
    np.testing.assert_allclose(np.asarray(zj.gather_params(state)["w"]), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The naive local masked mean (normalised by each device's own count) is not the same.
    naive = lambda p, b: jnp.sum(token_loss(p, b["x"]) * b["m"]) / jnp.maximum(b["m"].sum(), 1.0)
    state = zj.init_state(params, optax.sgd(1.0), mesh=mesh, config=cfg)
    _, m = zj.make_train_step(naive, optax.sgd(1.0), mesh=mesh, config=cfg)(state, {"x": x, "m": jnp.asarray(mask)})
    assert abs(float(m["loss"]) - float(global_masked_mean(params))) > 0.05


# Stages 1 and 2 in the slow set: their forward is stage 0's.
@pytest.mark.parametrize("stage", models.marked_slow(range(4), slow=[1, 2]))
def test_eval_step_equals_single_device_forward(stage):
    params, b = models.stacked_params(), models.batch(32, 2)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype="float32")
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)

    def fn(p, b):
        return {"loss": models.stacked_loss(p, b), "pred": b["x"] @ p["inp"]["w"]}

    ev = zj.make_eval_step(fn, mesh=mesh, config=cfg, reduce={"loss": "mean", "pred": "concat"})
    out = ev(state, b)
    np.testing.assert_allclose(float(out["loss"]), float(models.stacked_loss(params, b)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["pred"]), np.asarray(b["x"] @ params["inp"]["w"]), rtol=1e-5, atol=1e-6)
    state, _ = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)(state, b)  # not donated
    assert ev.compile_count() == 1


def test_stage3_eval_gathers_one_layer_at_a_time():
    """The compiled eval program never holds the whole model: its temporaries stay below
    two layers plus the activations, far below the full parameters (which a jit of fn on
    zj.gather_params would take as its argument)."""
    layers, d = 16, 256
    params = models.deep_params(layers, d, stacked=True)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)
    x = jnp.ones((64, d))
    ev = zj.make_eval_step(models.deep_loss, mesh=mesh, config=cfg)
    compiled = models.lower_as_called(ev, state, x).compile()  # the program ev(state, x) runs below
    full = sum(p.size * 4 for p in jax.tree.leaves(params))
    mem = zj.report.compiled_bytes(compiled)
    assert mem["argument"] < 1.01 * full / 8 + x.nbytes
    assert mem["temp"] < 3 * full / layers + x.nbytes, (mem, full)
    gathers = [c for c in zj.report.comm.collectives(compiled.as_text()) if c.kind == "all-gather"]
    assert sum(c.count for c in gathers if c.bytes == d * d * 4) == layers  # once per layer, forward only
    np.testing.assert_allclose(float(ev(state, x)), float(models.deep_loss(params, x)), rtol=1e-5)


def _big_batch(rows=32):
    """Rows whose per-device mean is about 10,000: exact in fp16, but eight of them sum to
    80,000, past fp16's largest value."""
    x = 10_000.0 + 16.0 * (np.arange(rows, dtype=np.float32) % 4 >= 2)  # each device's mean: 10,008
    return {
        "x": jnp.asarray(x[:, None]),
        "y": jnp.ones((rows, 1), jnp.float32),
        "c": jnp.full((rows,), 257.25, jnp.float32),
    }


@pytest.mark.parametrize("replicas", [1, 2])
def test_fp16_eval_outputs_combine_in_fp32(replicas):
    """Per-device means of 10,008 averaged over 8 devices: 10,008, not inf; a "sum" of
    floats is exact past fp16's 2,048 (each device's 1,029 is exact, 3,087 is not);
    floating results come back as float32."""
    b = _big_batch()
    mesh, cfg = zj.make_mesh(replicas=replicas), zj.ZeroConfig(stage=3, compute_dtype="float16")
    state = zj.init_state({"w": jnp.ones((1, 1))}, TX, mesh=mesh, config=cfg)
    fn = lambda p, b: {"loss": jnp.mean(b["x"] * p["w"][0, 0]), "n": jnp.sum(b["c"]), "rows": b["x"][:, 0]}
    out = zj.make_eval_step(fn, mesh=mesh, config=cfg, reduce={"loss": "mean", "n": "sum", "rows": "concat"})(state, b)
    assert float(out["loss"]) == float(np.mean(np.asarray(b["x"], np.float64))) == 10008.0
    assert float(out["n"]) == 32 * 257.25
    assert out["loss"].dtype == jnp.float32 and out["n"].dtype == jnp.float32
    assert out["rows"].dtype == jnp.float16  # concatenated rows keep their dtype


@pytest.mark.parametrize("replicas,k", [(1, 1), (2, 2)])
def test_fp16_train_aux_combines_in_fp32(replicas, k):
    b = _big_batch()
    mesh = zj.make_mesh(replicas=replicas)
    cfg = zj.ZeroConfig(stage=2, compute_dtype="float16", grad_accum_steps=k)
    state = zj.init_state({"w": jnp.ones((1, 1))}, TX, mesh=mesh, config=cfg)
    loss_fn = lambda p, b: (jnp.mean((p["w"][0, 0] - b["y"]) ** 2), {"mse": jnp.mean(b["x"]), "n": jnp.sum(b["y"])})
    step = zj.make_train_step(loss_fn, TX, mesh=mesh, config=cfg, has_aux=True, aux_reduce={"mse": "mean", "n": "sum"})
    _, m = step(state, b)
    assert float(m["loss"]) == 0.0
    assert float(m["aux"]["mse"]) == 10008.0 and float(m["aux"]["n"]) == 32.0
    assert m["aux"]["mse"].dtype == jnp.float32


def test_bf16_eval_loss_equals_the_train_steps_loss():
    """The same parameters and batch give the same loss from the eval step as from the train
    step (both combine per-device values in fp32; in bf16 they differed by one ulp)."""
    params, b = models.stacked_params(), models.batch(32, 2)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, compute_dtype="bfloat16", donate=False)
    state = zj.init_state(params, TX, mesh=mesh, config=cfg)
    want = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg)(state, b)
    _, m = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg)(state, b)
    assert float(want) == float(m["loss"])
    assert want.dtype == jnp.float32
