"""Stage 3 weight gathers as blockwise int8 plus scales (ZeRO++'s qwZ)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests import models
from zerojax.sharding.leaf_layout import layout_for
from zerojax.sharding.quantize import gather_int8

N = 8


@pytest.mark.parametrize("shape,block", [((20, 20), 16), ((1001, 7), 64), ((3, 20, 24), 5), ((13,), 4096), ((7, 5), 3)])
def test_one_gather_errs_at_most_the_block_maximum_over_127(shape, block):
    """Each element of the gathered array is within its block's largest magnitude / 127
    of the exact value (it is within half that: one rounding step of the block's scale)."""
    layout = layout_for(shape, "float32", N)
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape) * np.exp(rng.normal(size=shape) * 2)  # magnitudes over decades
    storage = np.asarray(layout.to_storage(jnp.asarray(x, jnp.float32)))
    mesh = zj.make_mesh()
    spec = layout.partition_spec("data")
    arr = jax.device_put(storage, NamedSharding(mesh, spec))
    got = jax.jit(
        jax.shard_map(
            lambda s: gather_int8(layout, s, "data", block, jnp.float32),
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
            check_vma=False,
        )
    )(arr)
    got = np.asarray(got)
    assert got.shape == shape
    # The bound, block by block: each device's shard, flattened, in blocks of `block`.
    err = np.asarray(layout.to_storage(jnp.asarray(np.abs(got - x), jnp.float32)))
    for err_shard, x_shard in zip(
        np.split(err, N, axis=layout.split_axis), np.split(storage, N, axis=layout.split_axis)
    ):
        e, v = err_shard.reshape(-1), np.abs(x_shard.reshape(-1))
        for start in range(0, e.size, block):
            peak = v[start : start + block].max(initial=0.0)
            assert np.all(e[start : start + block] <= peak / 127 * (1 + 1e-6)), (start, peak)
            assert np.all(e[start : start + block] <= peak / 254 * (1 + 1e-5) + 1e-30)
    assert np.abs(got - x).max() > 0  # it did quantize


def test_a_non_finite_weight_is_not_hidden():
    """A NaN in a block makes its block NaN (as an exact gather would carry it), not 0."""
    from zerojax.sharding.quantize import dequantize, quantize

    x = jnp.asarray([3.0, np.nan, 1.0, 2.0, 0.5, 0.25])
    q, scale = quantize(x, 2)
    out = np.asarray(dequantize(q, scale, 2, jnp.float32))
    assert np.all(np.isnan(out[:2])) and np.all(np.isfinite(out[2:]))
    np.testing.assert_allclose(out[2:], [1.0, 2.0, 0.5, 0.25], rtol=1 / 127)


def step_for(cfg, params=None):
    params = params if params is not None else models.deep_params(4, 64, stacked=True)
    mesh, tx = zj.make_mesh(), optax.adamw(1e-3)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    return state, zj.make_train_step(models.deep_loss, tx, mesh=mesh, config=cfg)


def test_the_program_gathers_int8_and_moves_a_quarter_of_the_fp32_bytes():
    x = jnp.ones((16, 64))
    state, step = step_for(zj.ZeroConfig(stage=3, collectives={"gather_dtype": "int8", "gather_block_size": 256}))
    lowered = step.lower(state, x)
    s8 = [l for l in lowered.as_text().splitlines() if "all_gather" in l and "xi8>" in l]
    assert s8, "no int8 all-gather in the lowered program"
    q = zj.report.communication_report(lowered.compile())
    state32, step32 = step_for(zj.ZeroConfig(stage=3))
    ref = zj.report.communication_report(step32.lower(state32, x).compile())
    fp32 = ref["all-gather:f32"]["bytes"]
    assert "all-gather:s8" in q and q["all-gather:s8"]["count"] == ref["all-gather:f32"]["count"]
    assert q["all-gather:s8"]["bytes"] * 4 == fp32  # one byte per element instead of four
    # Scales: 4 bytes per block of each device's shard of one layer. A layer's kernel shard is
    # 64 x 8 = 512 elements (2 blocks of 256), gathered in forward and again in backward; its
    # bias shard is 8 elements (1 block), gathered in forward only (a bias's gradient does
    # not read it). 4 layers, 8 devices.
    layers = 4
    assert q["all-gather:f32"]["bytes"] == 4 * N * (2 * layers * 2 + layers * 1)
    ratio = (q["all-gather:s8"]["bytes"] + q["all-gather:f32"]["bytes"]) / fp32
    assert 0.25 < ratio < 0.27


@functools.cache
def _adam_run(**config):
    """Four Adam steps of the stacked model at stage 3 with ``config``: (params, losses), once
    per worker (the exact and the plain int8 runs are every case's references)."""
    batches = [models.batch(16, s) for s in range(4)]
    return models.zero_run(models.stacked_loss, models.stacked_params(), optax.adam(1e-2), batches, 3, **config)


@pytest.mark.parametrize(
    "kw",
    [{}, {"prefetch": 1}, {"compute_dtype": "bfloat16"}, {"offload": zj.config.Offload(optimizer=True, params=True)}],
)
def test_training_with_int8_gathers_stays_near_exact_gathers(kw):
    """Same runs, exact and int8 gathers: the losses agree to the quantization's size, and
    int8 runs agree with each other whatever the path (prefetch, offload)."""
    base = dict(compute_dtype=kw.get("compute_dtype", "float32"))
    exact, exact_losses = _adam_run(**base)
    got, losses = _adam_run(collectives=zj.config.Collectives(gather_dtype="int8"), **{**base, **kw})
    np.testing.assert_allclose(losses, exact_losses, rtol=0.03)
    assert losses[-1] < losses[0]
    if kw and "compute_dtype" not in kw:  # the same int8 gathers by another path: the same run
        plain, _ = _adam_run(collectives=zj.config.Collectives(gather_dtype="int8"), compute_dtype="float32")
        assert models.abs_errors(got, plain).max() <= 1e-5


def test_eval_step_gathers_int8_too():
    cfg = zj.ZeroConfig(stage=3, collectives={"gather_dtype": "int8"})
    state, _ = step_for(cfg, models.stacked_params())
    mesh, b = zj.make_mesh(), models.batch(16)
    got = float(zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg)(state, b))
    exact = float(models.stacked_loss(models.stacked_params(), b))
    assert got != exact and got == pytest.approx(exact, rel=0.02)
    text = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg).lower(state, b).as_text()
    assert any("all_gather" in l and "xi8>" in l for l in text.splitlines())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=3, collectives={"gather_dtype": "int4"}), "Collectives.gather_dtype must be None"),
        (dict(stage=2, collectives={"gather_dtype": "int8"}), "quantizes stage 3's weight gathers"),
        (
            dict(stage=3, collectives={"gather_dtype": "int8", "gather_block_size": 0}),
            "Collectives.gather_block_size must be a positive int",
        ),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zj.ZeroConfig(**kwargs)


def test_quant_block_is_only_set_for_int8():
    assert zj.ZeroConfig(stage=3).quant_block is None
    assert dataclasses.replace(zj.ZeroConfig(stage=3), collectives={"gather_dtype": "int8"}).quant_block == 4096
