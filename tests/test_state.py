"""Per-device state bytes from the arrays themselves, against the ZeRO formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models

N = 8


def gpt_style_params(vocab=50257, d=64, layers=2, seq=128):
    """GPT-2-like shapes with an odd vocabulary: 50257 does not divide 8."""
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32)
    return {
        "wte": f(vocab, d),
        "wpe": f(seq, d),
        "blocks": {
            "ln1": {"scale": jnp.ones((layers, d)), "bias": jnp.zeros((layers, d))},
            "qkv": {"w": f(layers, d, 3 * d), "b": jnp.zeros((layers, 3 * d))},
            "proj": {"w": f(layers, d, d), "b": jnp.zeros((layers, d))},
            "fc": {"w": f(layers, d, 4 * d), "b": jnp.zeros((layers, 4 * d))},
            "out": {"w": f(layers, 4 * d, d), "b": jnp.zeros((layers, d))},
        },
        "ln_f": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
        "head": {"w": f(d, vocab), "b": jnp.zeros((vocab,))},
    }


@pytest.fixture(scope="module")
def gpt():
    params = gpt_style_params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    states = {
        s: zj.init_state(params, optax.adamw(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=s))
        for s in range(4)
    }
    return params, psi, states


def test_bytes_match_formula(gpt):
    """Exactly: the formula's bytes, plus the zero padding each stored leaf carries (read
    from the layouts), plus the int32 counters (step, skipped, Adam's count)."""
    _, psi, states = gpt
    counters = 4 + 4 + 4
    for s, state in states.items():
        got = zj.report.state_bytes_per_device(state)
        padded = sum(math.prod(l.storage_shape) for l in state.plan.layouts)  # stored elements
        exact = {0: 12 * psi, 1: 4 * psi + 8 * padded // N, 2: 4 * psi + 8 * padded // N, 3: 12 * padded // N}[s]
        assert got["total"] == exact + counters, (s, got, exact)
        assert padded - psi < 0.01 * psi  # and the padding is small: the formula holds to 1%
        assert got["total"] == pytest.approx(zj.report.zero_formula_bytes(psi, N, s), rel=0.01)
    s3 = zj.report.state_bytes_per_device(states[3])
    assert s3["replicated"] == counters


def test_every_leaf_is_partitioned_in_stage3(gpt):
    _, _, states = gpt
    state = states[3]
    assert state.params is None  # stage 3 keeps only the sharded masters
    for path, x in jax.tree_util.tree_flatten_with_path((state.master, state.opt_state))[0]:
        if x.ndim == 0:  # step counters
            continue
        shard_sizes = {s.data.size for s in x.addressable_shards}
        assert shard_sizes == {x.size // N}, (jax.tree_util.keystr(path), x.shape)
        assert not x.sharding.is_fully_replicated


def test_padding_under_one_percent(gpt):
    params, psi, states = gpt
    st = states[3]
    pad = sum(l.padding for l in st.plan.layouts)
    assert 0 < pad < 0.01 * psi
    # Stored three times (master, Adam's two moments: their layouts are the parameters').
    assert zj.report.state_bytes_per_device(st)["padding"] == pad * 12 // N


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_opt_state_sharded_params_replicated(gpt, stage):
    _, psi, states = gpt
    st = states[stage]
    for x in jax.tree.leaves(st.params):
        assert x.sharding.is_fully_replicated
    for x in jax.tree.leaves(st.opt_state):
        assert x.ndim == 0 or {s.data.size for s in x.addressable_shards} == {x.size // N}


def test_state_is_born_sharded():
    """The compiled init never holds the full optimizer state on a device."""
    params = gpt_style_params(d=128, layers=4)
    tx = optax.adam(1e-3)
    lowered = zj.state.lower_init(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
    mem = zj.report.compiled_bytes(lowered.compile())
    full_opt = 8 * sum(x.size for x in jax.tree.leaves(params))
    # Output is 12Ψ/N; temporaries far below one full moment (4Ψ).
    assert mem["output"] <= 1.01 * 1.5 * full_opt / N + 64
    assert mem["temp"] < 0.25 * full_opt / 2


def test_gather_params_roundtrip_any_stage():
    params = models.mlp_params()
    for s in range(4):
        st = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=s))
        full = zj.gather_params(st)
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.dtype == b.dtype and a.shape == b.shape


# Stage 2 in float32 in the slow set: its params are stored as stage 1's (float32, default)
# and stage 2 runs in the default set in bf16.
@pytest.mark.parametrize(
    "stage,dtype",
    models.marked_slow(
        [(0, "float32"), (1, "float32"), (2, "float32"), (2, "bfloat16"), (3, "float32")], slow=[(2, "float32")]
    ),
)
def test_gathered_params_survive_the_next_step(stage, dtype):
    """gather_params returns new arrays: the next (donating) step does not delete them."""
    params = models.mlp_params()
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=cfg)
    step = zj.make_train_step(models.mlp_loss, optax.sgd(0.1), mesh=mesh, config=cfg)
    trained = zj.gather_params(state)
    state, _ = step(state, models.batch(16))
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # readable, and the old values
    assert any(
        (np.asarray(a) != np.asarray(b)).any()
        for a, b in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(params))
    )
