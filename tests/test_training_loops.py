"""Real training loops: dropout keys, model state (BatchNorm), frozen weights, init_fn."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from tests import models

N = 8
SGD = optax.sgd(0.1)


def small_params():
    p = models.mlp_params()
    return {"inp": p["inp"], "out": p["out"]}


# --- Dropout --------------------------------------------------------------------------------


def dropout_loss(p, b, rng):
    h = jnp.tanh(b["x"] @ p["inp"]["w"] + p["inp"]["b"])
    keep = jax.random.bernoulli(rng, 0.5, h.shape)
    pred = jnp.where(keep, h / 0.5, 0.0) @ p["out"]["w"] + p["out"]["b"]
    return jnp.mean((pred - b["y"]) ** 2), keep


def run_dropout(stage, k=1, steps=2, seed=7, replicas=1):
    mesh, cfg = zj.make_mesh(replicas=replicas), zj.ZeroConfig(stage=stage, grad_accum_steps=k)
    state = zj.init_state(small_params(), SGD, mesh=mesh, config=cfg, rng=jax.random.key(seed))
    step = zj.make_train_step(
        dropout_loss, SGD, mesh=mesh, config=cfg, has_aux=True, aux_reduce="concat", with_rng=True
    )
    masks = []
    for t in range(steps):
        state, m = step(state, models.batch(32, t))
        masks.append(np.asarray(m["aux"]))
    return state, masks


def expected_key(seed, step, device, micro):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), device), micro)


@pytest.mark.parametrize("stage", [0, 3])
def test_dropout_keys_per_step_device_and_micro_batch(stage):
    """Every (step, device, micro-batch) draws from its own key, folded from state.rng; the
    run equals SGD on the global loss with exactly those masks."""
    k, rows = 2, 32 // N
    state, masks = run_dropout(stage, k=k)
    for t, mask in enumerate(masks):
        for d in range(N):
            for j in range(k):  # micro-batch j: the device's rows j, j + k, ... (global rows g % k == j)
                want = jax.random.bernoulli(expected_key(7, t, d, j), 0.5, (rows // k, models.HID))
                np.testing.assert_array_equal(mask[d * rows + j : (d + 1) * rows : k], np.asarray(want))
    # Different steps, devices and micro-batches, different masks.
    assert (masks[0] != masks[1]).any()
    assert (masks[0][:rows] != masks[0][rows : 2 * rows]).any()
    assert (masks[0][:rows:k] != masks[0][1:rows:k]).any()

    # The independent reference: plain SGD on the mean of those per-(device, micro) losses.
    def global_loss(p, b, t):
        parts = []
        for d in range(N):
            for j in range(k):
                mb = jax.tree.map(lambda x: x[d * rows + j : (d + 1) * rows : k], b)
                parts.append(dropout_loss(p, mb, expected_key(7, t, d, j))[0])
        return jnp.mean(jnp.stack(parts))

    p = small_params()
    for t in range(2):
        g = jax.grad(global_loss)(p, models.batch(32, t), t)
        p = jax.tree.map(lambda x, y: x - 0.1 * y, p, g)
    assert models.abs_errors(zj.gather_params(state), p).max() <= 1e-5


@pytest.mark.slow  # reason: four step compiles (4 s); test_dropout_keys_per_step_device_and_micro_batch checks every mask against its key at stages 0 and 3, and stages 1 and 2 draw keys in the same code
def test_dropout_is_the_same_at_every_stage():
    ref_state, ref_masks = run_dropout(0)
    for stage in (1, 2, 3):
        state, masks = run_dropout(stage)
        for a, b in zip(masks, ref_masks):
            np.testing.assert_array_equal(a, b)
        assert models.abs_errors(zj.gather_params(state), zj.gather_params(ref_state)).max() <= 1e-6


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.5, deterministic=not train)(jnp.tanh(nn.Dense(models.HID)(x)))
        return nn.Dense(models.OUT)(x)


class NNXDropout(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(models.IN, models.HID, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(models.HID, models.OUT, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(jnp.tanh(self.inp(x)), rngs=rngs))


def linen_setup():
    net = LinenDropout()
    params = net.init(jax.random.key(0), jnp.ones((1, models.IN)), train=False)["params"]

    def loss(p, b, rng):
        pred = net.apply({"params": p}, b["x"], train=True, rngs={"dropout": rng})
        return jnp.mean((pred - b["y"]) ** 2)

    return params, loss


def nnx_setup():
    graphdef, params = nnx.split(NNXDropout(nnx.Rngs(0)), nnx.Param)

    def loss(p, b, rng):
        model = nnx.merge(graphdef, p)
        return jnp.mean((model(b["x"], rngs=rng) - b["y"]) ** 2)  # nnx.Dropout takes the key at call

    return params, loss


@pytest.mark.parametrize("setup", [linen_setup, nnx_setup], ids=["linen", "nnx"])
def test_flax_dropout_gets_its_key(setup):
    params, loss = setup()
    results = []
    for stage in (0, 3):
        mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
        state = zj.init_state(params, SGD, mesh=mesh, config=cfg, rng=jax.random.key(3))
        step = zj.make_train_step(loss, SGD, mesh=mesh, config=cfg, with_rng=True)
        losses = []
        for _ in range(3):
            state, m = step(state, models.batch(16, 0))  # the same batch: only the masks change
            losses.append(float(m["loss"]))
        assert len(set(losses)) == 3  # new masks every step
        results.append(zj.gather_params(state))
    assert models.abs_errors(results[0], results[1]).max() <= 1e-6


def test_rng_survives_a_checkpoint(tmp_path):
    state, _ = run_dropout(3, steps=1)
    zj.save_checkpoint(tmp_path, state, step=1, wait=True)
    target = zj.abstract_state(
        small_params(), SGD, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1), rng=jax.random.key(0)
    )
    restored = zj.restore_checkpoint(tmp_path, target)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(restored.rng)), np.asarray(jax.random.key_data(jax.random.key(7)))
    )
    assert int(restored.step) == 1


def test_with_rng_needs_a_key_in_the_state():
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(small_params(), SGD, mesh=mesh, config=cfg)
    step = zj.make_train_step(
        dropout_loss, SGD, mesh=mesh, config=cfg, has_aux=True, aux_reduce="concat", with_rng=True
    )
    with pytest.raises(ValueError, match=r"init_state\(\.\.\., rng=jax.random.key\(seed\)\)"):
        step(state, models.batch(16))
    with pytest.raises(TypeError, match="rng must be a key from jax.random.key"):
        zj.init_state(small_params(), SGD, mesh=mesh, config=cfg, rng=7)


# --- Model state (BatchNorm) ---------------------------------------------------------------


class BNNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(models.HID)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name, momentum=0.9)(x)
        return nn.Dense(models.OUT)(jnp.tanh(x))


@functools.cache  # op by op, the same for each test that compares with it (here and in test_hybrid)
def bn_reference(steps):
    """Single-device training on the global batch (BatchNorm sees the whole batch)."""
    net = BNNet()
    v = net.init(jax.random.key(0), jnp.ones((2, models.IN)))
    p, bs = v["params"], v["batch_stats"]
    for t in range(steps):
        b = models.batch(32, t)

        def loss(p):
            pred, new = net.apply({"params": p, "batch_stats": bs}, b["x"], mutable=["batch_stats"])
            return jnp.mean((pred - b["y"]) ** 2), new["batch_stats"]

        (_, bs), g = jax.value_and_grad(loss, has_aux=True)(p)
        p = jax.tree.map(lambda x, y: x - 0.1 * y, p, g)
    return p, bs


def bn_run(stage, axis_name, steps=2, replicas=1):
    net = BNNet(axis_name=axis_name)
    v = BNNet().init(jax.random.key(0), jnp.ones((2, models.IN)))

    def loss(p, b, model_state):
        pred, new = net.apply({"params": p, **model_state}, b["x"], mutable=["batch_stats"])
        return jnp.mean((pred - b["y"]) ** 2), new

    mesh, cfg = zj.make_mesh(replicas=replicas), zj.ZeroConfig(stage=stage)
    state = zj.init_state(v["params"], SGD, mesh=mesh, config=cfg, model_state={"batch_stats": v["batch_stats"]})
    step = zj.make_train_step(loss, SGD, mesh=mesh, config=cfg, with_model_state=True)
    for t in range(steps):
        state, _ = step(state, models.batch(32, t))
    return state


# Stages 1 and 2 in the slow set: model state takes the same path at every stage; stages 0
# and 3 cover both gradient paths.
@pytest.mark.parametrize("stage", models.marked_slow(range(4), slow=[1, 2]))
def test_synced_batchnorm_equals_single_device_on_the_global_batch(stage):
    ref_p, ref_bs = bn_reference(2)
    state = bn_run(stage, "data")
    assert models.abs_errors(zj.gather_params(state), ref_p).max() <= 1e-5
    assert models.abs_errors(state.model_state["batch_stats"], ref_bs).max() <= 1e-5
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.model_state))


def test_unsynced_batchnorm_state_is_the_mean_of_the_devices():
    """Without axis_name each device normalises by its own rows and updates its own
    statistics; the step keeps their mean over devices (documented)."""
    state = bn_run(3, None, steps=1)
    v = BNNet().init(jax.random.key(0), jnp.ones((2, models.IN)))
    b, rows = models.batch(32, 0), 32 // N
    per_device = []
    for d in range(N):
        x = b["x"][d * rows : (d + 1) * rows]
        _, new = BNNet().apply(v, x, mutable=["batch_stats"])
        per_device.append(new["batch_stats"])
    want = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *per_device)
    assert models.abs_errors(state.model_state["batch_stats"], want).max() <= 1e-6


def test_nnx_batchnorm_with_axis_name():
    class Net(nnx.Module):
        def __init__(self, axis_name, rngs):
            self.inp = nnx.Linear(models.IN, models.HID, rngs=rngs)
            self.bn = nnx.BatchNorm(models.HID, momentum=0.9, axis_name=axis_name, rngs=rngs)
            self.out = nnx.Linear(models.HID, models.OUT, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.bn(self.inp(x))))

    graphdef, params, stats = nnx.split(Net("data", nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def loss(p, b, model_state):
        model = nnx.merge(graphdef, p, model_state)
        err = jnp.mean((model(b["x"]) - b["y"]) ** 2)
        return err, nnx.state(model, nnx.BatchStat)

    ref_def, ref_p, ref_s = nnx.split(Net(None, nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    @jax.jit
    def ref_step(p, s, b):
        def ref_loss(p):
            model = nnx.merge(ref_def, p, jax.tree.map(lambda x: x, s))  # Variables of this trace
            return jnp.mean((model(b["x"]) - b["y"]) ** 2), nnx.state(model, nnx.BatchStat)

        (_, s), g = jax.value_and_grad(ref_loss, has_aux=True)(p)
        return jax.tree.map(lambda x, y: x - 0.1 * y, p, g), s

    for t in range(2):
        ref_p, ref_s = ref_step(ref_p, ref_s, models.batch(32, t))
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(params, SGD, mesh=mesh, config=cfg, model_state=stats)
    step = zj.make_train_step(loss, SGD, mesh=mesh, config=cfg, with_model_state=True)
    for t in range(2):
        state, _ = step(state, models.batch(32, t))
    assert models.abs_errors(zj.gather_params(state), ref_p).max() <= 1e-5
    assert models.abs_errors(state.model_state, ref_s).max() <= 1e-5


def test_integer_model_state_and_aux_and_a_checkpoint(tmp_path):
    """An integer counter rides along (taken from the first device); with has_aux the loss
    returns (loss, (model_state, aux)); the model state survives a checkpoint."""

    def loss(p, b, model_state):
        err = models.mlp_loss(p, b)
        new = {"calls": model_state["calls"] + 1, "ema": 0.5 * model_state["ema"] + 0.5 * err}
        return err, (new, {"err": err})

    ms = {"calls": jnp.zeros((), jnp.int32), "ema": jnp.zeros(())}
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=2, grad_accum_steps=2)
    state = zj.init_state(models.mlp_params(), SGD, mesh=mesh, config=cfg, model_state=ms)
    step = zj.make_train_step(loss, SGD, mesh=mesh, config=cfg, has_aux=True, with_model_state=True)
    state, m = step(state, models.batch(32, 0))
    state, m = step(state, models.batch(32, 1))
    assert state.model_state["calls"].dtype == jnp.int32 and int(state.model_state["calls"]) == 4  # 2 x 2 micro
    assert float(m["aux"]["err"]) > 0
    zj.save_checkpoint(tmp_path, state, step=2, wait=True)
    with pytest.raises(ValueError, match="the checkpoint holds a model state: pass model_state="):
        zj.restore_checkpoint(tmp_path, models.mlp_params(), SGD, mesh=mesh, config=cfg)
    got = zj.restore_checkpoint(
        tmp_path, models.mlp_params(), SGD, mesh=mesh, config=zj.ZeroConfig(stage=3), model_state=ms
    )
    assert int(got.model_state["calls"]) == 4
    np.testing.assert_array_equal(np.asarray(got.model_state["ema"]), np.asarray(state.model_state["ema"]))


def test_model_state_must_keep_its_structure():
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(models.mlp_params(), SGD, mesh=mesh, config=cfg, model_state={"c": jnp.zeros(())})
    bad = lambda p, b, model_state: (models.mlp_loss(p, b), {"c": jnp.zeros((2,))})
    step = zj.make_train_step(bad, SGD, mesh=mesh, config=cfg, with_model_state=True)
    with pytest.raises(ValueError, match=r"model_state\['c'\] came in as \(\) float32 and came back as \(2,\)"):
        step(state, models.batch(16))
    with pytest.raises(
        TypeError,
        match=r"loss_fn is called as loss_fn\(params, batch, model_state=...\) with "
        r"with_model_state=True, but its signature \(p, b\) does not take that",
    ):
        zj.make_train_step(models.mlp_loss, SGD, mesh=mesh, config=cfg, with_model_state=True)
    no_state = lambda p, b, model_state: models.mlp_loss(p, b)
    step = zj.make_train_step(no_state, SGD, mesh=mesh, config=cfg, with_model_state=True)
    with pytest.raises(ValueError, match=r"must return .*\(loss, new_model_state\)"):
        step(state, models.batch(16))


# --- Frozen weights --------------------------------------------------------------------------


def frozen_mask(params):
    """A LoRA-like split: the stacked layers' weights are the frozen base."""
    return jax.tree_util.tree_map_with_path(lambda path, x: "['layers']['w']" not in jax.tree_util.keystr(path), params)


@functools.cache
def _frozen_reference():
    """optax.multi_transform with the frozen leaf set to zero, on one device: one run for
    every stage's case below."""
    params = models.stacked_params()
    labels = jax.tree.map(lambda m: "train" if m else "freeze", frozen_mask(params))
    ref_tx = optax.multi_transform({"train": optax.adamw(1e-2), "freeze": optax.set_to_zero()}, labels)
    return models.reference_run(models.stacked_loss, params, ref_tx, [models.batch(16, s) for s in range(3)])[0]


# Stage 1 in the slow set: it differentiates as stage 0 does, and
# test_no_collective_moves_a_frozen_gradient covers its scatter.
@pytest.mark.parametrize("stage", models.marked_slow(range(4), slow=[1]))
def test_frozen_weights_equal_multi_transform_and_never_change(stage):
    params, tx = models.stacked_params(), optax.adamw(1e-2)
    mask = frozen_mask(params)
    batches = [models.batch(16, s) for s in range(3)]
    ref = _frozen_reference()
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg, trainable=mask)
    step = zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg)
    for b in batches:
        state, m = step(state, b)
    got = zj.gather_params(state)
    err = models.abs_errors(got, ref)
    assert err.max() <= 5e-4 and err.mean() <= 2e-6
    np.testing.assert_array_equal(np.asarray(got["layers"]["w"]), np.asarray(params["layers"]["w"]))
    assert models.abs_errors(got, params).max() > 1e-3  # the rest trained
    # No optimizer state for the frozen leaf: Adam's moments hold only the trainable ones.
    mu = state.opt_state[0].mu
    assert isinstance(mu["layers"]["w"], optax.MaskedNode) and mu["layers"]["b"].size > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_bytes_follow_the_formula(stage, dtype):
    """Persistent bytes: 12Ψ_t/N + c·Ψ_f/N at stage 3 (c = 2 for a bf16 run), c·Ψ_f
    replicated at stages 0–2; exactly, on widths that divide 8."""
    params = models.deep_params(4, 128, stacked=True)  # w: 4 x 128 x 128 frozen, b trains
    mask = {"w": False, "b": True}
    psi_t, psi_f = params["b"].size, params["w"].size
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    state = zj.init_state(params, optax.adam(1e-3), mesh=mesh, config=cfg, trainable=mask)
    got = zj.report.state_bytes_per_device(state)
    want = zj.report.zero_formula_bytes(psi_t, N, stage, compute_dtype=dtype, frozen_params=psi_f)
    assert got["total"] == want + 4 + 4 + 4  # + step, skipped, Adam's count
    c = 2 if dtype == "bfloat16" else 4
    assert got["frozen"] == c * psi_f // (N if stage == 3 else 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_collective_moves_a_frozen_gradient(stage):
    """From the compiled HLO: the gradient collectives carry the trainable biases only; at
    stage 3 the frozen weights are still gathered where used (forward and backward)."""
    layers, d = 4, 128
    params = models.deep_params(layers, d, stacked=True)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, SGD, mesh=mesh, config=cfg, trainable={"w": False, "b": True})
    compiled = (
        zj.make_train_step(models.deep_loss, SGD, mesh=mesh, config=cfg).lower(state, jnp.ones((64, d))).compile()
    )
    runs = zj.report.comm.collectives(compiled.as_text())
    grad_kinds = ("all-reduce",) if stage == 0 else ("reduce-scatter",)
    moved = sum(c.total_bytes for c in runs if c.kind in grad_kinds and c.bytes > 64)
    bias_grads = 4 * params["b"].size
    assert bias_grads <= moved <= bias_grads + 16, (moved, runs)  # XLA may fuse the loss's scalar in
    layer = d * d * 4
    gathered = sum(c.count for c in runs if c.kind == "all-gather" and c.bytes == layer)
    assert gathered == (2 * layers if stage == 3 else 0)


def test_trainable_mask_errors():
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    with pytest.raises(ValueError, match="trainable must be a tree of bools with the structure of params"):
        zj.init_state(models.mlp_params(), SGD, mesh=mesh, config=cfg, trainable={"inp": True})
    with pytest.raises(ValueError, match="every parameter frozen"):
        zj.init_state({"w": jnp.ones(3)}, SGD, mesh=mesh, config=cfg, trainable={"w": False})
    with pytest.raises(TypeError, match=r"trainable\['w'\] must be a bool"):
        zj.init_state({"w": jnp.ones(3)}, SGD, mesh=mesh, config=cfg, trainable={"w": "yes"})


def test_frozen_weights_survive_a_checkpoint(tmp_path):
    params, tx = models.stacked_params(), optax.adam(1e-2)
    mask = frozen_mask(params)
    mesh = zj.make_mesh()
    state = zj.init_state(
        params, tx, mesh=mesh, config=zj.ZeroConfig(stage=3, compute_dtype="bfloat16"), trainable=mask
    )
    state, _ = zj.make_train_step(
        models.stacked_loss, tx, mesh=mesh, config=zj.ZeroConfig(stage=3, compute_dtype="bfloat16")
    )(state, models.batch(16))
    zj.save_checkpoint(tmp_path, state, step=1, wait=True)
    for stage in (1, 3):
        got = zj.restore_checkpoint(
            tmp_path,
            params,
            tx,
            mesh=zj.make_mesh(jax.devices()[:4]),
            config=zj.ZeroConfig(stage=stage, compute_dtype="bfloat16"),
            trainable=mask,
        )
        assert models.abs_errors(zj.gather_params(got), zj.gather_params(state)).max() == 0.0
    with pytest.raises(
        ValueError, match=r"frozen parameters are \[\"\['layers'\]\['w'\]\"\]; this restore freezes \[\]"
    ):
        zj.restore_checkpoint(tmp_path, params, tx, mesh=mesh, config=zj.ZeroConfig(stage=3))


# --- Models built already sharded ------------------------------------------------------------


def gpt_init_fn():
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(vocab=256, seq_len=16, d_model=64, n_layers=2, n_heads=2)
    return lambda: gpt.init(cfg)[1]


@pytest.mark.parametrize("stage", models.marked_slow([0, 1, 3], slow=[1]))  # 1: replicated as 0, sharded as 3
def test_init_fn_values_equal_jit_of_it(stage):
    init_fn = gpt_init_fn()
    state = zj.init_state(init_fn, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage))
    want = jax.jit(init_fn)()
    assert models.abs_errors(zj.gather_params(state), want).max() == 0.0


def test_init_fn_builds_each_shard_where_it_lives():
    """The compiled init of the experiments' GPT from an init_fn takes no argument and needs
    at most the sharded state plus its largest leaf: the full model exists nowhere, not
    even on the host, where concrete params must first be built whole."""
    from zerojax.models import gpt

    cfg = gpt.GPTConfig(vocab=256, seq_len=64, d_model=256, n_layers=4, n_heads=4)
    init_fn = lambda: gpt.init(cfg)[1]
    shapes = jax.eval_shape(init_fn)
    psi = sum(x.size for x in jax.tree.leaves(shapes))
    largest = 4 * max(x.size for x in jax.tree.leaves(shapes))
    tx, mesh, zc = optax.adamw(1e-3), zj.make_mesh(), zj.ZeroConfig(stage=3)
    lazy = zj.report.compiled_bytes(zj.state.lower_init(init_fn, tx, mesh=mesh, config=zc).compile())
    eager = zj.report.compiled_bytes(zj.state.lower_init(jax.device_get(init_fn()), tx, mesh=mesh, config=zc).compile())
    sharded = zj.report.state_bytes_per_device(zj.abstract_state(init_fn, tx, mesh=mesh, config=zc))["total"]
    assert sharded == pytest.approx(12 * psi / N, abs=64)
    assert lazy["argument"] == 0 and eager["argument"] == 4 * psi // N
    assert lazy["output"] - sharded < 1024  # + the output tuple's pointers
    assert lazy["total"] <= sharded + largest + 1024, (lazy, sharded, largest)


def test_linen_init_fn_and_model_state_fn():
    net = BNNet()
    x = jnp.ones((2, models.IN))
    init_fn = lambda: net.init(jax.random.key(0), x)["params"]
    stats_fn = lambda: {"batch_stats": net.init(jax.random.key(0), x)["batch_stats"]}
    state = zj.init_state(init_fn, SGD, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3), model_state=stats_fn)
    want = net.init(jax.random.key(0), x)
    # The same values to the rounding of one fused multiply-add: the tests compile without
    # LLVM's optimisation (conftest.py), where the sharded init program and Flax's eager
    # init contract a multiply-add differently (1e-7 of an O(1) weight, 2 ulps); a wrong
    # key or shard is off by O(1).
    for got, ref in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(want["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-7)
    assert models.abs_errors(state.model_state["batch_stats"], want["batch_stats"]).max() == 0.0
    abstract = zj.abstract_state(init_fn, SGD, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    assert (
        zj.report.state_bytes_per_device(abstract)["total"]
        == zj.report.state_bytes_per_device(dataclasses.replace(state, model_state=None))["total"]
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_dtype_is_a_visible_choice(tmp_path, stage):
    """A frozen fp32 base in a bf16 run: stored as its bf16 rounding by default, and
    gather_params and the export say so by their dtype; frozen_dtype="param" keeps it
    exact. The step computes the same in both (the base is read in bf16 either way)."""
    from safetensors.numpy import load_file

    from zerojax.tensors.safetensors_files import stored_dtypes

    params = models.deep_params(4, 128, stacked=True)
    base = np.asarray(params["w"])
    mask, x, mesh = {"w": False, "b": True}, jnp.ones((16, 128)), zj.make_mesh()
    losses, bytes_ = {}, {}
    for frozen_dtype, want_dtype in (("compute", jnp.bfloat16), ("param", jnp.float32)):
        cfg = zj.ZeroConfig(stage=stage, compute_dtype="bfloat16", frozen_dtype=frozen_dtype)
        state = zj.init_state(params, optax.adam(1e-3), mesh=mesh, config=cfg, trainable=mask)
        got = zj.gather_params(state)["w"]
        assert got.dtype == want_dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), base.astype(want_dtype).astype(np.float32))
        d = tmp_path / frozen_dtype
        zj.save_checkpoint(d, state, step=0, wait=True)
        zj.export_weights(d, d / "w.safetensors")
        assert stored_dtypes(d / "w.safetensors") == {"w": jnp.dtype(want_dtype).name, "b": "float32"}
        np.testing.assert_array_equal(load_file(d / "w.safetensors")["w"], base.astype(want_dtype).astype(np.float32))
        bytes_[frozen_dtype] = zj.report.state_bytes_per_device(state)["frozen"]
        assert bytes_[frozen_dtype] == (
            zj.report.zero_formula_bytes(
                params["b"].size, N, stage, compute_dtype="bfloat16", frozen_params=base.size, frozen_dtype=frozen_dtype
            )
            - zj.report.zero_formula_bytes(params["b"].size, N, stage, compute_dtype="bfloat16")
        )
        step = zj.make_train_step(models.deep_loss, optax.adam(1e-3), mesh=mesh, config=cfg)
        _, m = step(state, x)
        losses[frozen_dtype] = float(m["loss"])
    assert np.abs(base - base.astype(jnp.bfloat16).astype(np.float32)).max() > 1e-4  # rounding is visible
    assert bytes_["param"] == 2 * bytes_["compute"]
    assert losses["param"] == losses["compute"]
    with pytest.raises(ValueError, match=r"ZeroConfig.frozen_dtype must be 'compute' .* or 'param' .* got 'bf16'"):
        zj.ZeroConfig(frozen_dtype="bf16")
