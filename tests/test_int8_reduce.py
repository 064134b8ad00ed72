"""Gradient reductions as blockwise int8 plus scales (ZeRO++'s qgZ): ZeroConfig(collectives={"reduce_dtype": "int8"})."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests import models
from tests.test_precision import poison_batch, poisoned_loss
from zerojax.sharding import collectives
from zerojax.sharding.int8_reduce import pack, unpack
from zerojax.sharding.leaf_layout import layout_for
from zerojax.sharding.quantize import quantize

N = 8


def _piece_peaks(x: np.ndarray, n: int, block: int) -> np.ndarray:
    """For a flat array split into n equal pieces: each element's block peak (its piece
    quantized in blocks of ``block``)."""
    pieces = x.reshape(n, -1)
    out = np.empty_like(pieces)
    for j in range(n):
        for s in range(0, pieces.shape[1], block):
            out[j, s : s + block] = np.abs(pieces[j, s : s + block]).max()
    return out.reshape(-1)


@pytest.mark.parametrize("shape,block", [((20, 20), 16), ((1001, 7), 64), ((3, 20, 24), 5), ((13,), 4096)])
def test_one_reduce_scatter_errs_at_most_half_a_scale_per_device(shape, block):
    """The mean of 8 devices' gradients, reduced as int8: each element is within
    (sum over devices of its block's peak / 254) / 8 of the exact fp32 mean, and each
    device holds exactly its shard of the layout's storage."""
    layout = layout_for(shape, "float32", N)
    rng = np.random.default_rng(1)
    g = (rng.normal(size=(N, *shape)) * np.exp(rng.normal(size=(N, *shape)))).astype(np.float32)
    mesh = zj.make_mesh()
    spec = layout.partition_spec("data")

    def reduce(x):
        r = collectives.reduce_grad(x[0], "data", N, "int8", layout, None, block)
        return r[None] if layout.kind == "replicated" else r

    out_spec = P("data") if layout.kind == "replicated" else spec
    got = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("data"), out_specs=out_spec, check_vma=False))(g)
    if layout.kind == "replicated":  # every device holds the whole mean, the same one
        got = np.asarray(got).reshape(N, *shape)
        assert all(np.array_equal(got[0], got[d]) for d in range(N))
        got = got[0]
        # Two roundings: the pieces (one per device) and the gathered sums.
        flat = lambda a: np.pad(a.reshape(-1), (0, -a.size % N))
        peaks = sum(_piece_peaks(flat(g[d]), N, block) for d in range(N))
        peaks = peaks + N * _piece_peaks(flat(g.mean(0)), N, block)
        bound = (peaks / 254 / N)[: g[0].size].reshape(shape)
    else:
        got = np.asarray(layout.from_storage(got))
        storage = lambda a: np.moveaxis(np.asarray(layout.to_storage(jnp.asarray(a))), layout.split_axis, 0)
        peaks = sum(_piece_peaks(storage(g[d]).reshape(-1), N, block) for d in range(N))
        bound_storage = (peaks / 254 / N).reshape(storage(g[0]).shape)
        bound = np.asarray(layout.from_storage(jnp.asarray(np.moveaxis(bound_storage, 0, layout.split_axis))))
    want = g.astype(np.float64).mean(0)
    err = np.abs(got - want)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7), (err - bound).max()
    assert err.max() > 0  # it did quantize


def test_pack_round_trips_values_and_scales_bit_for_bit():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 100)), jnp.float32)
    q, s = jax.vmap(lambda r: quantize(r, 16))(x)
    buf = pack(q, s)
    assert buf.dtype == jnp.int8 and buf.shape == (3, 100 + 4 * 7)
    q2, s2 = unpack(buf, 100)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(s2, s)


def step_for(stage, replicas=1, **kw):
    params = models.deep_params(4, 64, stacked=True)
    mesh, tx = zj.make_mesh(replicas=replicas), optax.adam(1e-3)
    cfg = zj.ZeroConfig(stage=stage, **kw)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.deep_loss, tx, mesh=mesh, config=cfg)
    return mesh, zj.report.communication_report(step.lower(state, jnp.ones((16, 64))).compile(), mesh=mesh)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_move_as_int8_at_a_quarter_of_the_fp32_bytes(stage):
    """The compiled step: the gradient exchange is an all-to-all of s8 (values and scales
    in one buffer), no fp32 reduce-scatter is left, and its bytes are the formula:
    Ψ int8 values plus 4 bytes per block of each device's piece (0.25× fp32 plus scales)."""
    block = 256
    _, fp32 = step_for(stage)
    _, q = step_for(stage, collectives={"reduce_dtype": "int8", "reduce_block_size": block})
    assert not any(k.startswith("reduce-scatter") for k in q), q
    assert q["all-to-all:s8"]["count"] == fp32["reduce-scatter:f32"]["count"]
    # 4 layers, each a 64x64 kernel and a 64 bias, stacked; each device owns 1/8 of each
    # layer's rows (kernel: 8 x 64 = 512 elements, 2 blocks; bias: 8 elements, 1 block).
    psi = 4 * (64 * 64 + 64)
    scales = 4 * N * 4 * (2 + 1)
    assert q["all-to-all:s8"]["bytes"] == psi + scales or stage == 1
    ratio = q["all-to-all:s8"]["bytes"] / fp32["reduce-scatter:f32"]["bytes"]
    assert 0.25 < ratio < 0.26, ratio
    assert q["total"]["bytes"] < fp32["total"]["bytes"]


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # 2 reduces through 3's code
def test_on_a_hybrid_mesh_each_hop_is_int8(stage):
    """ZeRO++'s hierarchical exchange: inside a group, then the shard across groups,
    both int8; no fp32 gradient bytes cross groups (only the scalar loss and counters)."""
    mesh, fp32 = step_for(stage, replicas=2)
    _, q = step_for(stage, replicas=2, collectives={"reduce_dtype": "int8", "reduce_block_size": 256})
    assert fp32["by_axis"]["replica"]["bytes"] == 4 * 4 * (64 * 64 + 64) // 4  # Ψ/(N/R) fp32
    across = q["by_axis"]["replica"]
    # int8 all-to-all of the shard plus the int8 all-gather of the sums: ~2 x 1/4 of one fp32
    # all-reduce's payload, which is 2Ψ/(N/R) in the paper's units.
    assert 0.25 < across["zero_bytes"] / fp32["by_axis"]["replica"]["zero_bytes"] < 0.27
    assert "all-to-all:s8" in q and "all-gather:s8" in q
    assert q["all-reduce:f32"]["bytes"] <= 12


def grad_bound(params_seq, batches, lr, rounds=3):
    """An upper bound on an int8-reduced SGD run's distance from the exact one: per step,
    lr x ``rounds`` roundings of at most the largest per-device gradient entry / 254."""
    total = 0.0
    for p, b in zip(params_seq, batches):
        rows = jax.tree.map(lambda x: x.reshape(N, -1, *x.shape[1:]), b)
        per_device = jax.vmap(lambda r: jax.grad(models.stacked_loss)(p, r))(rows)
        total += lr * rounds * max(float(jnp.abs(g).max()) for g in jax.tree.leaves(per_device)) / 254
    return total


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "stage,replicas,kw",
    [
        (1, 1, {}),
        # stage 2 reduces through stage 3's code; its int8 exchange is read from its compiled
        # step in test_gradients_move_as_int8_at_a_quarter_of_the_fp32_bytes
        pytest.param(2, 1, {}, marks=SLOW),
        (3, 1, {}),
        pytest.param(3, 2, {}, marks=SLOW),
        pytest.param(2, 1, {"grad_accum_steps": 2}, marks=SLOW),
        pytest.param(3, 1, {"collectives": {"gather_dtype": "int8"}}, marks=SLOW),
        pytest.param(3, 1, {"prefetch": 1}, marks=SLOW),
        pytest.param(3, 1, {"offload": {"params": True, "optimizer": True}}, marks=SLOW),
        pytest.param(1, 2, {"offload": {"optimizer": True}}, marks=SLOW),
    ],
    ids=[
        "s1",
        "s2",
        "s3",
        "s3-hybrid",
        "s2-accum",
        "s3-int8-weights",
        "s3-prefetch",
        "s3-offload",
        "s1-hybrid-offload",
    ],
)
def test_sgd_stays_within_the_quantization_bound_of_single_device_optax(stage, replicas, kw):
    lr, steps = 0.1, 3
    batches = [models.batch(16, s) for s in range(steps)]
    tx = optax.sgd(lr)
    trajectory = [models.stacked_params()]
    for b in batches[:-1]:
        g = jax.grad(models.stacked_loss)(trajectory[-1], b)
        trajectory.append(jax.tree.map(lambda p, g: p - lr * g, trajectory[-1], g))
    ref, ref_losses = models.reference_run(models.stacked_loss, models.stacked_params(), tx, batches)
    got, losses = models.zero_run(
        models.stacked_loss,
        models.stacked_params(),
        tx,
        batches,
        stage,
        replicas=replicas,
        **{**kw, "collectives": {"reduce_dtype": "int8", "reduce_block_size": 64, **kw.get("collectives", {})}},
    )
    err = models.abs_errors(got, ref)
    bound = grad_bound(trajectory, batches, lr)
    if "gather_dtype" in kw.get("collectives", {}):  # int8 weights too: the loss itself moves by the weights' rounding
        bound *= 10
    assert 0 < err.max() <= bound, (err.max(), bound)
    np.testing.assert_allclose(losses, ref_losses, rtol=0.01)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # 2 reduces through 3's code
def test_fp16_overflow_is_seen_through_int8_and_the_step_skipped(stage):
    """A non-finite gradient on one device makes its blocks' scales non-finite: every
    owner's sum is non-finite, and dynamic loss scaling skips the step everywhere."""
    cfg = dict(compute_dtype="float16", collectives={"reduce_dtype": "int8"}, loss_scaling={"initial_scale_power": 8})
    mesh = zj.make_mesh()
    tx = optax.adamw(1e-3)
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=zj.ZeroConfig(stage=stage, **cfg))
    step = zj.make_train_step(poisoned_loss, tx, mesh=mesh, config=zj.ZeroConfig(stage=stage, **cfg))
    state, m = step(state, poison_batch(0))
    assert not bool(m["skipped"])
    before = [np.asarray(x).copy() for x in jax.tree.leaves(state.master)]
    state, m = step(state, poison_batch(1, bad_row=13))
    assert bool(m["skipped"])
    for a, b in zip(before, jax.tree.leaves(state.master)):
        np.testing.assert_array_equal(a, b)
    state, m = step(state, poison_batch(2))
    assert not bool(m["skipped"]) and np.isfinite(float(m["loss"]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=0, collectives={"reduce_dtype": "int8"}), "stage 0 all-reduces full gradients"),
        (dict(stage=2, collectives={"reduce_dtype": "int4"}), "reduce_dtype must be one of"),
        (
            dict(stage=2, collectives={"reduce_dtype": "int8", "reduce_block_size": 0}),
            "Collectives.reduce_block_size must be a positive",
        ),
        (
            dict(stage=2, collectives={"reduce_dtype": "int8", "reduce_block_size": True}),
            "Collectives.reduce_block_size must be a positive",
        ),
        (
            dict(stage=2, collectives={"reduce_dtype": "int8", "reduce_block_size": 64.0}),
            "Collectives.reduce_block_size must be a positive",
        ),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zj.ZeroConfig(**kwargs)


def test_reduce_block_is_only_set_for_int8():
    assert zj.ZeroConfig(stage=2).reduce_block is None
    assert zj.ZeroConfig(stage=2, collectives={"reduce_dtype": "int8"}).reduce_block == 4096
    assert zj.ZeroConfig(stage=2, collectives={"reduce_dtype": "int8", "reduce_block_size": 512}).reduce_block == 512


def test_deepspeed_zero_quantized_gradients_maps_to_int8():
    from zerojax.deepspeed import translate

    ds = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zero_quantized_weights": True},
    }
    t = translate(ds)
    assert t.config == zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", grad_clip=1.0, collectives={"gather_dtype": "int8", "reduce_dtype": "int8"}
    )
    assert not any("quantized_gradients" in k for k in t.unmapped)
    t = translate({**ds, "communication_data_type": "bf16"})
    assert t.config.collectives.reduce_dtype == "int8"
    assert any("communication_data_type='bf16' does not apply" in n for n in t.notes)
    # DeepSpeed quantizes gradients at stage 3 only: at stages 0-2 its gradients stay as
    # they are, and so do zerojax's (the reason says how to ask for int8 anyway).
    for stage in (0, 1, 2):
        t = translate({"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}})
        assert t.config.collectives.reduce_dtype == "float32"
        why = t.unmapped["zero_optimization.zero_quantized_gradients"]
        assert f"ignores it at stage {stage}" in why and "reduce_dtype='int8'" in why
