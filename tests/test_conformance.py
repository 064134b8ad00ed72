"""Every stage, on 1/2/4/8 devices, matches plain single-device optax (every pair of settings)."""

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models

# Linear in the gradient: exposes wrong scaling or a per-device clipping norm.
SGD_FAMILY = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)),
}
# Adam-family: held on the mean error, with a looser max (reduction-order noise).
ADAM_FAMILY = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-2),  # moves every weight by 1e-2 a step: one sign flip breaks the bound
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}
MODELS = {"unrolled": (models.mlp_params, models.mlp_loss), "scan": (models.stacked_params, models.stacked_loss)}
# Stacked layers taken one by one by index in a Python loop (no scan).
ALL_MODELS = {**MODELS, "indexed": (models.stacked_params, models.indexed_loss)}
STEPS = 4


def check(name, got, ref, got_losses, ref_losses, got_norms=None, ref_norms=None):
    err = models.abs_errors(got, ref)
    if name in SGD_FAMILY:
        assert err.max() <= 1e-5, f"{name}: max abs error {err.max():.3g}"
    else:
        assert err.mean() <= 2e-6, f"{name}: mean abs error {err.mean():.3g}"
        assert err.max() <= 5e-4, f"{name}: max abs error {err.max():.3g}"
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    if ref_norms is not None:
        # The gradient itself, at every step: a wrong scale (which Adam's and Lion's
        # normalisation would hide from the weights) fails here.
        np.testing.assert_allclose(got_norms, ref_norms, rtol=1e-5)


@functools.cache
def _reference(model, opt):
    make_params, loss_fn = ALL_MODELS[model]
    tx = {**SGD_FAMILY, **ADAM_FAMILY}[opt]()
    norms = []
    params, losses = models.reference_run(loss_fn, make_params(), tx, _batches(), norms)
    return params, losses, norms


def _batches():
    return [models.batch(16, seed=s) for s in range(STEPS)]


def _case(model, opt, stage, n):
    make_params, loss_fn = ALL_MODELS[model]
    params = make_params()
    tx = {**SGD_FAMILY, **ADAM_FAMILY}[opt]()
    batches = _batches()
    ref, ref_losses, ref_norms = _reference(model, opt)
    norms = []
    got, losses = models.zero_run(loss_fn, params, tx, batches, stage, n, grad_norms=norms)
    check(opt, got, ref, losses, ref_losses, norms, ref_norms)
    # Same tree, shapes and dtypes as given.
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.shape == b.shape and a.dtype == b.dtype


# The matrices are covered pairwise (tests.models.pairwise): every pair of settings (model and
# optimizer, optimizer and stage, device count and stage, ...) meets in some case of the
# default and slow sets together (CI runs both); the full products repeated each pair two to
# four times over. The default set keeps a covering of every value of every setting:
# EIGHT_DEFAULT has each model, optimizer and stage on 8 devices, and the clipped SGD at
# stages 2 and 3 that it leaves to the slow set trains at 8 devices in
# test_layers_taken_by_index_match_optax and on 2 and 4 devices in FEWER_DEFAULT.
EIGHT_DEFAULT = [
    ("scan", "clip_sgd", 0),
    ("unrolled", "clip_adamw", 1),
    ("scan", "sgd_momentum", 2),
    ("unrolled", "sgd_momentum", 3),
]
EIGHT = models.pairwise(model=list(MODELS), opt=["sgd_momentum", "clip_sgd", "clip_adamw"], stage=[0, 1, 2, 3])
assert set(EIGHT_DEFAULT) <= set(EIGHT), "a default case must be one of the matrix's"


@pytest.mark.parametrize(
    "model,opt,stage",
    # reason (slow): the pairs EIGHT_DEFAULT leaves; each value they hold trains in the default set
    models.marked_slow(EIGHT, slow=[c for c in EIGHT if c not in EIGHT_DEFAULT])
    + [
        pytest.param(*row, marks=pytest.mark.slow)
        for row in models.pairwise(model=list(MODELS), opt=["adamw", "lion"], stage=[0, 1, 2, 3])
    ],
)
def test_eight_devices_match_optax(model, opt, stage):
    _case(model, opt, stage, 8)


# Stage 1 in the slow set: it differentiates the replicated params whole, so indexing never
# reaches a per-use path (stages 2 and 3 take it).
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
@pytest.mark.parametrize("opt", ["clip_sgd", pytest.param("clip_adamw", marks=pytest.mark.slow)])
def test_layers_taken_by_index_match_optax(opt, stage):
    _case("indexed", opt, stage, 8)


# Every optimizer, device count and stage in the default set: stage 3 on 2 and 4 devices,
# stage 2 on 4, stages 1 and 0 on 1 and 2.
FEWER_DEFAULT = [
    ("clip_adamw", 4, 3),
    ("clip_sgd", 2, 3),
    ("clip_sgd", 4, 2),
    ("clip_adamw", 1, 1),
    ("clip_adamw", 2, 0),
]
FEWER = models.pairwise(opt=["clip_sgd", "clip_adamw"], n=[1, 2, 4], stage=[0, 1, 2, 3])
assert set(FEWER_DEFAULT) <= set(FEWER), "a default case must be one of the matrix's"


# reason (slow): the pairs FEWER_DEFAULT leaves; each value they hold trains in the default set
@pytest.mark.parametrize("opt,n,stage", models.marked_slow(FEWER, slow=[c for c in FEWER if c not in FEWER_DEFAULT]))
def test_fewer_devices_match_optax(opt, n, stage):
    _case("scan", opt, stage, n)


@pytest.mark.slow  # reason: 12 more trainings (SGD momentum, Lion); test_fewer_devices_match_optax on 1, 2, 4 devices
@pytest.mark.parametrize(
    "model,opt,n,stage",
    models.pairwise(model=list(MODELS), opt=["sgd_momentum", "lion"], n=[1, 2, 4], stage=[0, 1, 2, 3]),
)
def test_full_matrix_fewer_devices(model, opt, n, stage):
    _case(model, opt, stage, n)


@pytest.mark.slow  # reason: 8 more 8-device trainings; test_eight_devices_match_optax's clipped-AdamW cases
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model", list(MODELS))
def test_adam_eight_devices(model, stage):
    _case(model, "adam", stage, 8)


def test_mesh_with_explicit_axes():
    """``jax.make_mesh``'s default (Explicit axes) works like zj.make_mesh()."""
    mesh = jax.make_mesh((8,), ("data",))
    tx = SGD_FAMILY["clip_sgd"]()
    ref, _, _ = _reference("scan", "clip_sgd")
    cfg = zj.ZeroConfig(stage=3)
    state = zj.init_state(models.stacked_params(), tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg)
    for b in _batches():
        state, _ = step(state, b)
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-5


@pytest.mark.parametrize("seed", range(20))
def test_pairwise_covers_every_pair_of_settings(seed):
    """The covering the matrices above use: random factors, every pair of values of every two
    factors in some row, each row a combination of the factors, and fewer rows than the product
    once three factors or more have two values or more."""
    import itertools
    import random

    rng = random.Random(seed)
    factors = {f"f{i}": list(range(rng.randint(1, 4))) for i in range(rng.randint(2, 5))}
    rows = models.pairwise(**factors)
    values = list(factors.values())
    assert all(len(r) == len(values) and all(v in vals for v, vals in zip(r, values)) for r in rows)
    for (i, a), (j, b) in itertools.combinations(enumerate(values), 2):
        assert {(x, y) for x in a for y in b} == {(r[i], r[j]) for r in rows}
    assert models.pairwise(**factors) == rows  # deterministic: the same cases on every worker
    product = 1
    for v in values:
        product *= len(v)
    assert len(rows) <= product
    if sum(len(v) >= 2 for v in values) >= 3:
        assert len(rows) < product
