"""Low-precision optimizer state and masters (``ZeroConfig.state_dtypes``).

bf16 moments against plain single-device optax with the same casts done by hand; the bytes
from the arrays and from the compiled step; stochastic rounding's expectation against the
fp32 update; the masters' trajectory against fp32 masters; checkpoints across dtypes;
offload; and the refusals.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.deepspeed.mapping import translate
from zerojax.optim.rounding import stochastic_round
from zerojax.optim.update import update
from zerojax.stages.per_stage import stage_of

TX = optax.adam(5e-2)
BATCHES = [models.batch(16, s) for s in range(4)]
BF16_OPT = {"optimizer": "bfloat16"}


def narrow(tree):
    """The optax state as zerojax stores it with bf16 moments: float32 arrays (not scalars) in bf16."""
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 and x.ndim else x, tree)


def widen(tree, like):
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


@functools.cache
def reference(bf16_moments: bool):
    """Plain single-device optax, the moments cast down after and up before each update by hand."""
    params = models.mlp_params()
    opt = TX.init(params)
    store = narrow if bf16_moments else (lambda t: t)
    opt = store(opt)

    @jax.jit
    def step(params, opt, b):
        full = widen(opt, TX.init(params))
        loss, g = jax.value_and_grad(models.mlp_loss)(params, b)
        u, full = TX.update(g, full, params)
        return optax.apply_updates(params, u), store(full), loss

    for b in BATCHES:
        params, opt, _ = step(params, opt, b)
    return params, opt


@functools.cache
def trained(stage: int, state_dtypes: tuple = (), offload: bool = False):
    cfg = zj.ZeroConfig(stage=stage, state_dtypes=dict(state_dtypes), offload={"optimizer": offload})
    mesh = zj.make_mesh()
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=cfg)
    step = models.shared_step(models.mlp_loss, TX, mesh=mesh, config=cfg)
    for b in BATCHES:
        state, _ = step(state, b)
    return state, step


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_moments_match_optax_with_the_casts_by_hand(stage):
    state, _ = trained(stage, tuple(BF16_OPT.items()))
    ref, ref_opt = reference(True)
    fp32, _ = reference(False)
    err = models.abs_errors(zj.gather_params(state), ref)
    gap = models.abs_errors(fp32, ref)  # what the test must resolve: bf16 moments against fp32 ones
    # Sharded sums differ from one device's in the last fp32 bit (2e-7 here), which flips the
    # bf16 rounding of a rare moment: a handful of weights then differ by that flip's effect.
    assert (gap > 1e-6).mean() > 0.5
    assert (err > 1e-6).mean() < 0.01 and err.max() < gap.max() / 10, (np.sort(err)[-5:], gap.max())
    leaves = jax.tree.leaves(state.opt_state)
    assert [x.dtype for x in leaves] == [x.dtype for x in jax.tree.leaves(ref_opt)]
    assert {x.dtype for x in leaves if x.ndim} == {jnp.dtype(jnp.bfloat16)}
    # Scalars keep their dtype: Adam's count (int32) and the scalar parameter's moments (fp32).
    assert sorted(str(x.dtype) for x in leaves if not x.ndim) == ["float32", "float32", "int32"]
    for a, b in zip(jax.tree.leaves(ref_opt), jax.tree.leaves(_opt_whole(state))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-6)


def _opt_whole(state):
    """The optimizer state in each array's own shape (the storage padding sliced off)."""
    plan = state.plan
    return plan.unflatten_opt(
        [np.asarray(l.from_storage(x)) for l, x in zip(plan.opt_storage_layouts, jax.tree.leaves(state.opt_state))]
    )


def test_bf16_moments_halve_the_bytes_of_the_arrays_and_of_the_compiled_step():
    fp32, step32 = trained(3)
    bf16, step16 = trained(3, tuple(BF16_OPT.items()))
    shard = lambda x: x.addressable_shards[0].data.nbytes
    moments = [(a, b) for a, b in zip(jax.tree.leaves(fp32.opt_state), jax.tree.leaves(bf16.opt_state)) if a.ndim]
    assert moments and all(shard(b) * 2 == shard(a) for a, b in moments)
    saved = sum(shard(a) - shard(b) for a, b in moments)
    mem = lambda step, state: step.lower(state, BATCHES[0]).compile().memory_analysis()
    m32, m16 = mem(step32, fp32), mem(step16, bf16)
    # The step takes and returns the state: its arguments and outputs both shrink by the saving.
    assert m32.argument_size_in_bytes - m16.argument_size_in_bytes == saved
    assert m32.output_size_in_bytes - m16.output_size_in_bytes == saved
    report = zj.report.state_bytes_per_device
    assert report(bf16)["opt_state"] == report(fp32)["opt_state"] - saved


def test_bf16_moments_offloaded_train_as_on_the_device():
    on_device, _ = trained(3, tuple(BF16_OPT.items()))
    offloaded, _ = trained(3, tuple(BF16_OPT.items()), offload=True)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.opt_state)} == {"pinned_host"}
    assert {x.dtype for x in jax.tree.leaves(offloaded.opt_state) if x.ndim} == {jnp.dtype(jnp.bfloat16)}
    for a, b in zip(jax.tree.leaves(on_device), jax.tree.leaves(offloaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stochastic_rounding_is_unbiased(seed):
    """Randomized values: the mean over many keys of the rounded value is the fp32 value,
    within the statistics (each rounding errs by less than one ulp: std <= ulp / 2)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=512) * 10.0 ** rng.integers(-3, 3, size=512), jnp.float32)
    keys = jax.random.split(jax.random.key(seed), 4000)
    rounded = jax.vmap(lambda k: stochastic_round(x, k).astype(jnp.float32))(keys)
    below = x.astype(jnp.bfloat16).astype(jnp.float32)
    ulp = np.abs(np.asarray(jnp.nextafter(below.astype(jnp.bfloat16), jnp.bfloat16(np.inf)), np.float32) - below)
    ulp = np.maximum(ulp, np.abs(below - np.asarray(jnp.nextafter(below.astype(jnp.bfloat16), jnp.bfloat16(0)))))
    sigma = ulp / (2 * np.sqrt(len(keys)))
    z = np.abs(np.asarray(rounded.mean(0)) - np.asarray(x)) / sigma
    assert z.max() < 6, z.max()
    # Every draw is one of the two bf16 neighbours of x.
    lo = np.minimum(rounded.min(0), rounded.max(0))
    assert np.all((np.asarray(rounded) == lo) | (np.asarray(rounded) == np.asarray(rounded.max(0))))
    # Round to nearest is biased wherever x is not half-way: the test could fail.
    assert np.abs(np.asarray(below) - np.asarray(x)).max() / sigma.max() > 6


def test_a_bf16_master_update_rounds_to_the_fp32_update_on_average():
    """The library's update at bf16 masters: the mean over step keys of the stored master is
    optax's fp32 update of the same (widened) masters, within the statistics."""
    cfg = zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", state_dtypes={"masters": "bfloat16", "rounding": "stochastic"}
    )
    tx = optax.sgd(1e-3)  # steps well under one bf16 ulp: round to nearest loses them
    state = zj.init_state(models.mlp_params(), tx, mesh=zj.make_mesh(), config=cfg)
    plan = state.plan
    masters, opt = jax.tree.leaves(state.master), jax.tree.leaves(state.opt_state)
    rng = np.random.default_rng(3)
    grads = [jnp.asarray(rng.normal(size=m.shape), jnp.float32) * (m != 0) for m in masters]
    grads = [jax.device_put(g, m.sharding) for g, m in zip(grads, masters)]
    one = jax.jit(lambda s: update(plan, tx, grads, opt, masters, step=s)[0])
    draws = np.stack([np.concatenate([np.asarray(x, np.float32).ravel() for x in one(s)]) for s in range(600)])
    want = np.concatenate([(np.asarray(m, np.float32) - 1e-3 * np.asarray(g)).ravel() for m, g in zip(masters, grads)])
    base = np.concatenate([np.asarray(m, np.float32).ravel() for m in masters])
    moved = np.abs(want - base) > 0
    ulp = np.maximum(np.abs(base) * 2.0**-7, 2.0**-133)
    z = np.abs(draws.mean(0) - want)[moved] / (ulp[moved] / (2 * np.sqrt(len(draws))))
    assert z.max() < 6, z.max()
    assert int(jnp.asarray(draws.std(0) > 0).sum()) > moved.sum() // 2  # the keys differ per step


@functools.cache
def master_run(masters: str, rounding: str, steps: int = 40):
    tx = optax.adam(2e-4)  # steps well under half a bf16 ulp of most weights
    cfg = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", state_dtypes={"masters": masters, "rounding": rounding})
    mesh = zj.make_mesh()
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.mlp_loss, tx, mesh=mesh, config=cfg)
    for s in range(steps):
        state, _ = step(state, BATCHES[s % len(BATCHES)])
    return jax.tree.map(lambda x: np.asarray(x, np.float32), zj.gather_params(state))


def test_stochastic_rounding_keeps_bf16_masters_near_fp32_where_nearest_stalls():
    fp32 = master_run("float32", "nearest")
    start = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float32), models.mlp_params())
    nearest = master_run("bfloat16", "nearest")
    sr = master_run("bfloat16", "stochastic")
    moved = lambda a: models.abs_errors(a, start).mean()
    dist = lambda a: models.abs_errors(a, fp32).mean()
    # Round to nearest drops every step under half an ulp: most weights never leave their start.
    assert moved(nearest) < 0.5 * moved(fp32)
    # Stochastic rounding moves them as far as fp32 does, on average, and ends closer to it.
    assert 0.7 < moved(sr) / moved(fp32) < 1.3
    assert dist(sr) < 0.5 * dist(nearest), (dist(sr), dist(nearest))


def _save_and_restore(tmp_path, src_cfg, dst_cfg, tx=TX):
    mesh = zj.make_mesh()
    state = zj.init_state(models.mlp_params(), tx, mesh=mesh, config=src_cfg)
    step = models.shared_step(models.mlp_loss, tx, mesh=mesh, config=src_cfg)
    state, _ = step(state, BATCHES[0])
    zj.save_checkpoint(tmp_path, state, step=1, wait=True)
    return state, zj.restore_checkpoint(tmp_path, models.mlp_params(), tx, mesh=mesh, config=dst_cfg)


def test_checkpoint_of_bf16_state_restores_into_fp32_exactly(tmp_path):
    """bf16 moments and masters widen exactly: the fp32 run starts from the same values."""
    src = zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", state_dtypes={"optimizer": "bfloat16", "masters": "bfloat16"}
    )
    dst = zj.ZeroConfig(stage=1, compute_dtype="bfloat16")
    state, restored = _save_and_restore(tmp_path, src, dst)
    assert {x.dtype for x in jax.tree.leaves(restored.master)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(restored.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree.leaves(_opt_whole(state)), jax.tree.leaves(_opt_whole(restored))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), b)
    for a, b in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(zj.gather_params(restored))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_checkpoint_of_fp32_state_restores_into_bf16_rounded_to_nearest(tmp_path):
    src = zj.ZeroConfig(stage=1, compute_dtype="bfloat16")
    dst = zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", state_dtypes={"optimizer": "bfloat16", "masters": "bfloat16"}
    )
    state, restored = _save_and_restore(tmp_path, src, dst)
    assert {x.dtype for x in jax.tree.leaves(restored.master)} == {jnp.dtype(jnp.bfloat16)}
    for a, b in zip(jax.tree.leaves(_opt_whole(state)), jax.tree.leaves(_opt_whole(restored))):
        want = np.asarray(jnp.asarray(a).astype(jnp.bfloat16)) if a.ndim else a
        np.testing.assert_array_equal(want, b)
    rounded = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), _masters_whole(state))
    for a, b in zip(jax.tree.leaves(rounded), jax.tree.leaves(_masters_whole(restored))):
        np.testing.assert_array_equal(a, np.asarray(b))


def _masters_whole(state):
    plan = state.plan
    leaves = stage_of(plan).masters(
        plan, None if state.params is None else jax.tree.leaves(state.params), jax.tree.leaves(state.master)
    )
    return [np.asarray(l.from_storage(x)) for l, x in zip(plan.master_layouts, leaves)]


@pytest.mark.parametrize(
    "group, match",
    [
        ({"optimizer": "int8"}, "StateDtypes.optimizer must be one of"),
        ({"optimizer": "float16"}, "StateDtypes.optimizer must be one of"),
        ({"masters": jnp.int32}, "StateDtypes.masters must be one of"),
        ({"rounding": "up"}, "'nearest' or 'stochastic'"),
        ({"rounding": "stochastic"}, "masters='float32' rounds nothing"),
    ],
)
def test_bad_state_dtypes_are_refused(group, match):
    with pytest.raises(ValueError, match=match):
        zj.ZeroConfig(stage=3, compute_dtype="bfloat16", state_dtypes=group)


def test_bf16_masters_need_sharded_masters_and_bf16_compute():
    with pytest.raises(ValueError, match="stage 0's masters are the replicated parameters"):
        zj.ZeroConfig(stage=0, compute_dtype="bfloat16", state_dtypes={"masters": "bfloat16"})
    with pytest.raises(ValueError, match="needs compute_dtype='bfloat16'"):
        zj.ZeroConfig(stage=3, state_dtypes={"masters": "bfloat16"})
    with pytest.raises(TypeError, match="StateDtypes.seed must be an int"):
        zj.config.StateDtypes(masters="bfloat16", rounding="stochastic", seed=1.5)
    # bf16 moments alone work at every stage, stage 0 included.
    assert zj.ZeroConfig(stage=0, state_dtypes=BF16_OPT).state_dtypes.optimizer == "bfloat16"


def test_deepspeed_bf16_state_keys_map():
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "communication_data_type": "fp32"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unmapped
        t = translate(
            {**ds, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
        )
    assert t.config.state_dtypes == zj.config.StateDtypes(optimizer="bfloat16", masters="bfloat16")
    assert not t.unmapped and any("round to nearest" in n for n in t.notes)
    t = translate({**ds, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert t.config.state_dtypes == zj.config.StateDtypes(masters="bfloat16")
    with pytest.raises(ValueError, match="which DeepSpeed refuses"):
        translate({**ds, "bf16": {"enabled": True, "bf16_optimizer_states": True}})
    off = translate({**ds, "bf16": {"enabled": False, "bf16_optimizer_states": True}})
    assert off.config.state_dtypes == zj.config.StateDtypes() and "bf16.bf16_optimizer_states" in off.unmapped
