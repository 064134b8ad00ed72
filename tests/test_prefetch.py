"""Stage 3 that gathers ahead of use, and ordering that cannot change values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.report import hlo

N = 8


def masked_loss(p, b):
    """A masked first key (-inf) clamped at a learned floor: the first element of the
    layer's input is -inf."""
    return jnp.mean((jax.nn.softmax(jnp.maximum(b["x"], p["floor"]), -1) @ p["w"]) ** 2)


@functools.cache
def non_finite_case():
    """Params, batches whose first input column is -inf, and single-device SGD on them
    (params, losses): the same for every stage."""
    rng = np.random.default_rng(0)
    params = {"floor": jnp.asarray(-3.0), "w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
    x = rng.normal(size=(16, 6)).astype(np.float32)
    x[:, 0] = -np.inf
    batches = [{"x": jnp.asarray(x)}] * 3
    return params, batches, models.reference_run(masked_loss, params, optax.sgd(0.1), batches)


@pytest.mark.parametrize("stage,prefetch", [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)])  # prefetch: stage 3 only
def test_a_non_finite_activation_does_not_reach_the_parameters(stage, prefetch):
    """Ordering the gathers used to add input[0] * 0 to the shard: -inf * 0 made every
    stage-3 parameter NaN. Now the run equals single-device training at every stage."""
    params, batches, (ref, ref_losses) = non_finite_case()
    got, losses = models.zero_run(masked_loss, params, optax.sgd(0.1), batches, stage, prefetch=prefetch)
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert models.abs_errors(got, ref).max() <= 1e-6


MODELS = {"scan": (models.stacked_params, models.stacked_loss), "unrolled": (models.mlp_params, models.mlp_loss)}


@functools.cache
def momentum_reference(model):
    """Single-device SGD with momentum on ``model``, three batches: (params, losses)."""
    make, loss = MODELS[model]
    return models.reference_run(loss, make(), optax.sgd(0.1, momentum=0.9), [models.batch(16, s) for s in range(3)])


# Full remat on unrolled layers with prefetch 1: slow (each value stays in the default set, and
# prefetch 1 also in test_prefetch_trains_flax_models_like_optax).
@pytest.mark.parametrize(
    "remat,model,prefetch",
    models.marked_slow(
        models.pairwise(remat=["none", "full"], model=["scan", "unrolled"], prefetch=[1, 2]),
        slow=[("full", "unrolled", 1)],
    ),
)
def test_prefetch_trains_like_optax(model, prefetch, remat):
    make, loss = MODELS[model]
    tx, batches = optax.sgd(0.1, momentum=0.9), [models.batch(16, s) for s in range(3)]
    ref, ref_losses = momentum_reference(model)
    got, losses = models.zero_run(loss, make(), tx, batches, 3, prefetch=prefetch, remat=remat)
    assert models.abs_errors(got, ref).max() <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_prefetch_trains_flax_models_like_optax():
    """nnx.scan and nn.scan stacks, frozen layers among them, bf16 compute."""
    from flax import nnx

    graphdef, params = nnx.split(models.NNXModel(nnx.Rngs(0)), nnx.Param)
    loss = lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)
    tx, batches = optax.adam(1e-2), [models.batch(16, s) for s in range(3)]
    ref, _ = models.reference_run(loss, params, tx, batches)
    got, _ = models.zero_run(loss, params, tx, batches, 3, prefetch=1)
    err = models.abs_errors(got, ref)
    assert err.max() <= 5e-4 and err.mean() <= 2e-6
    # A frozen stack is gathered ahead too, and gets no gradient.
    mask = jax.tree_util.tree_map_with_path(lambda path, _: "linear" not in jax.tree_util.keystr(path), params)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, prefetch=1, compute_dtype="bfloat16")
    state = zj.init_state(params, tx, mesh=mesh, config=cfg, trainable=mask)
    state, m = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)(state, batches[0])
    assert np.isfinite(float(m["loss"]))
    blocks = zj.gather_params(state)["blocks"]["linear"]
    stored = np.asarray(params["blocks"]["linear"]["kernel"][...].astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(blocks["kernel"][...]), stored)  # as stored: bf16, unchanged


def compiled(params, loss, x, **cfg):
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=3, **cfg)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=zc)
    return zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=zc).lower(state, x).compile()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_layer_loops_gather_independently_of_their_matmul(prefetch):
    """From the compiled HLO of a scanned stack: with prefetch, in the forward layer loop and
    in the backward one, no all-gather depends on that iteration's matmul or the other way
    round, so a backend that runs collectives asynchronously can overlap them. Without it,
    each iteration's matmul waits for its gather (the check can fail)."""
    params = models.deep_params(4, 128, stacked=True)
    text = compiled(params, models.deep_loss, jnp.ones((64, 128)), prefetch=prefetch).as_text()
    prog = hlo.parse(text)
    bodies = [b for b in prog.loop_bodies() if prog.gathers(b) and prog.matmuls(b)]
    assert len(bodies) == 2  # forward and backward
    pairs = [prog.independent(b, g, m) for b in bodies for g in prog.gathers(b) for m in prog.matmuls(b)]
    assert all(pairs) if prefetch else not any(pairs[:1]), pairs


def test_unrolled_layers_gather_one_layer_ahead():
    """Layers as separate leaves (forward only, an eval step): with prefetch=1 the gather of
    layer k+1's weights waits for layer k's input, not for its matmul."""
    layers, d = 5, 128
    params = models.deep_params(layers, d, stacked=False)
    waits = {}
    for prefetch in (0, 1):
        mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3, prefetch=prefetch)
        state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
        text = (
            zj.make_eval_step(models.deep_loss, mesh=mesh, config=cfg)
            .lower(state, jnp.ones((64, d)))
            .compile()
            .as_text()
        )
        prog = hlo.parse(text)
        entry = prog.entry
        matmuls = prog.matmuls(entry)
        weights = prog.gathers(entry, f"f32[{d},{d}]")
        assert len(weights) == layers
        # For each weight gather: how many matmuls it waits for.
        waits[prefetch] = sorted(sum(prog.reaches(entry, m, g) for m in matmuls) for g in weights)
    assert waits[0] == list(range(layers)), waits
    assert waits[1] == [0] + list(range(layers - 1)), waits


@pytest.mark.parametrize("stacked", [True, False], ids=["scan", "unrolled"])
def test_prefetch_memory_stays_bounded(stacked):
    """Temporaries do not grow with depth beyond the saved activations, and prefetch keeps
    at most about two more gathered layers live than full remat without it (forward:
    this layer and the next; backward: this one, the one before and the weight's
    cotangent)."""
    d = 256
    layer = (d * d + d) * 4
    temp = {}
    for layers in (8, 16):
        params = models.deep_params(layers, d, stacked)
        for prefetch in (0, 1):
            c = compiled(params, models.deep_loss, jnp.ones((64, d)), prefetch=prefetch, remat="full")
            temp[(layers, prefetch)] = zj.report.compiled_bytes(c)["temp"]
    assert (temp[(16, 1)] - temp[(8, 1)]) / 8 < 0.3 * layer, temp
    assert temp[(16, 1)] - temp[(16, 0)] <= 2.5 * layer, temp


def test_prefetch_gathers_each_layer_once_per_direction():
    layers, d = 6, 128
    params = models.deep_params(layers, d, stacked=True)
    runs = zj.report.comm.collectives(compiled(params, models.deep_loss, jnp.ones((64, d)), prefetch=2).as_text())
    w = d * d * 4
    assert sum(c.count for c in runs if c.kind == "all-gather" and c.bytes == w) == 2 * layers
    assert sum(c.count for c in runs if c.kind == "reduce-scatter" and c.bytes == w) == layers


def test_prefetch_config():
    assert zj.ZeroConfig().prefetch == 0
    with pytest.raises(ValueError, match="ZeroConfig.prefetch must be >= 0"):
        zj.ZeroConfig(prefetch=-1)
    with pytest.raises(TypeError, match="ZeroConfig.prefetch must be an int"):
        zj.ZeroConfig(prefetch=1.5)


def test_gpu_overlap_flags_are_known_to_this_jaxlib(tmp_path):
    """XLA refuses an unknown flag in XLA_FLAGS at startup: each flag starts a process."""
    import subprocess
    import sys

    env = dict(__import__("os").environ, XLA_FLAGS=zj.xla_flags.with_gpu_overlap_flags(""), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", "import jax; print(float(jax.jit(lambda x: x + 1)(1.0)))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr[-2000:]
    # A value the user set wins; nothing is duplicated.
    merged = zj.xla_flags.with_gpu_overlap_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1")
    assert merged.split().count("--xla_gpu_enable_latency_hiding_scheduler=false") == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged and "--foo=1" in merged
    assert all(f in merged for f in zj.xla_flags.gpu_overlap_flags()[1:])
    env = {}
    zj.xla_flags.apply_gpu_overlap_flags(env)
    assert env["XLA_FLAGS"].split() == zj.xla_flags.gpu_overlap_flags()


def test_launcher_passes_the_overlap_flags(tmp_path):
    import io

    from zerojax.launch import launch

    out = io.StringIO()
    code = launch(
        [__import__("sys").executable, "-c", "import os; print(os.environ['XLA_FLAGS'])"], 2, gpu_overlap=True, out=out
    )
    assert code == 0
    lines = [l for l in out.getvalue().splitlines() if l.startswith("[rank")]
    assert len(lines) == 2 and all("--xla_gpu_enable_pipelined_all_gather=true" in l for l in lines)
