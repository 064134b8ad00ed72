"""Optimizers that read a parameter's shape train exactly as on one device, at every stage.

The model's leaves have no dimension divisible by 8 (13, 20, 7, 3, 6), a 3-D DenseGeneral
kernel, a 4-D einsum kernel, layers stacked on a leading axis and run with ``lax.scan``,
a leaf split along a dimension that divides 8 and a scalar. The transforms read shapes:
factored second moments, Newton–Schulz on matrices (and on 3-D/4-D kernels through
dimension numbers), weight-decay masks by ``ndim``, per-leaf trust ratios, multi-step
accumulation, schedule-free averaging, injected hyperparameters.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

import zerojax as zj
from tests import models

STEPS = 4
IN, HID, OUT = models.IN, models.HID, models.OUT


def awkward_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
    return {
        "inp": {"w": f(IN, HID), "b": jnp.asarray(rng.normal(size=(HID,)) * 0.1, jnp.float32)},
        "dense_general": {"kernel": f(HID, 3, 6)},  # (in, heads, head_dim)
        "einsum": {"kernel": f(2, 3, 6, HID)},  # (k, heads, head_dim, out)
        "layers": {"w": f(3, HID, HID), "b": jnp.asarray(rng.normal(size=(3, HID)) * 0.1, jnp.float32)},
        "wide": {"w": f(HID, 40)},  # 40 divides 8: split in its own shape
        "out": {"w": f(40, OUT), "b": jnp.zeros((OUT,))},
        "temp": jnp.asarray(1.3, jnp.float32),
    }


def awkward_loss(p, b):
    h = jnp.tanh(b["x"] @ p["inp"]["w"] + p["inp"]["b"])
    g = jnp.tanh(jnp.einsum("bi,ihd->bhd", h, p["dense_general"]["kernel"]))
    h = h + jnp.einsum("bhd,khdo->bo", g, p["einsum"]["kernel"]) / 4

    def layer(h, l):
        return h + jnp.tanh(h @ l["w"] + l["b"]), None

    h, _ = jax.lax.scan(layer, h, p["layers"])
    h = jnp.tanh(h @ p["wide"]["w"])
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


def muon_dims(params):
    """Newton–Schulz on every matrix: 2-D leaves, the 3-D and 4-D kernels (reduction axes
    first), each layer of the stack (axis 0 a batch axis); vectors and scalars on Adam."""
    dims = {(HID, 3, 6): MDN(0, (1, 2)), (2, 3, 6, HID): MDN((1, 2), 3), (3, HID, HID): MDN(1, 2)}
    return jax.tree.map(lambda x: MDN() if x.ndim == 2 else dims.get(x.shape), params)


TRANSFORMS = {
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "muon": lambda: optax.contrib.muon(1e-2),
    "muon_dims": lambda: optax.contrib.muon(1e-2, muon_weight_dimension_numbers=muon_dims),
    "adamw_ndim_mask": lambda: optax.adamw(
        1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
    "lamb": lambda: optax.lamb(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "sgd_nesterov": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
}
SGD_LIKE = {"sgd_nesterov"}


@functools.cache
def transform(name):
    """One object per transform: test_multisteps_accumulates_sharded and the stage-3 MultiSteps
    case train through one compiled step (models.shared_step, keyed by the object)."""
    return TRANSFORMS[name]()


def batches():
    return [models.batch(16, seed=s) for s in range(STEPS)]


_REF = {}


def reference(name):
    if name not in _REF:
        _REF[name] = models.reference_run(awkward_loss, awkward_params(), TRANSFORMS[name](), batches())
    return _REF[name]


@functools.cache
def errors(name, stage, n=8):
    ref, ref_losses = reference(name)
    got, losses = models.zero_run(awkward_loss, awkward_params(), transform(name), batches(), stage, n, shared=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(awkward_params())):
        assert a.shape == b.shape and a.dtype == b.dtype
    return models.abs_errors(got, ref)


def check(name, err, stage0=None):
    """The conformance suite's tolerances; for a transform that amplifies reduction-order
    noise, within 2x of plain data parallelism's own error (``stage0()``)."""
    if name in SGD_LIKE:
        assert err.max() <= 1e-5, (name, err.max())
        return
    if err.max() <= 5e-4 and err.mean() <= 2e-6:
        return
    base = stage0() if stage0 is not None else None
    assert base is not None and err.max() <= 2 * max(base.max(), 1e-7) and err.mean() <= 2 * max(base.mean(), 1e-9), (
        name,
        err.max(),
        err.mean(),
        None if base is None else (base.max(), base.mean()),
    )


LAYOUTS = {  # golden: a change of the layout rules shows here
    "['dense_general']['kernel']": "flattened, padded by 0",
    "['einsum']['kernel']": "flattened row by row, padded by 0",
    "['inp']['b']": "split along dim 0, padded 20->24",
    "['inp']['w']": "flattened, padded by 4",
    "['layers']['b']": "flattened, padded by 4",
    "['layers']['w']": "flattened row by row, padded by 0",
    "['out']['b']": "split along dim 0, padded 7->8",
    "['out']['w']": "split along dim 0",
    "['temp']": "replicated",
    "['wide']['w']": "split along dim 1",
}


def test_the_model_has_every_layout():
    """The test model exercises each storage layout; Adafactor's factored moments (rows and
    columns of the 3-D and 4-D kernels) get layouts of their own shapes."""
    state = zj.init_state(
        awkward_params(), TRANSFORMS["adafactor"](), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3)
    )
    assert dict(zip(state.plan.paths, (l.describe() for l in state.plan.layouts))) == LAYOUTS
    shapes = {l.shape for l in state.plan.opt_layouts}
    assert {(HID, 3), (3, 6), (2, 3, 6), (2, 3, HID)} <= shapes, shapes
    for l, x in zip(state.plan.opt_storage_layouts, jax.tree.leaves(state.opt_state)):
        assert x.shape == l.storage_shape and (l.kind == "replicated" or not x.sharding.is_fully_replicated)


# The default run: stage 3 for every transform but three whose property another default case
# holds: muon (Newton-Schulz on the 2-D leaves, which muon_dims does on every matrix, Adam on
# the rest as adamw_ndim_mask), clip_adam (test_conformance's clip_sgd and clip_adamw clip at
# stage 3) and sgd_nesterov (test_conformance's sgd_momentum at stage 3: an elementwise
# formula of the same state). Stage 1 once (adamw_ndim_mask): the optimizer's update is the
# same code at stages 1-3 (the same stored layouts), and this case runs stage 1's gradients and
# copy on the awkward layouts. Everything else in the slow set.
DEFAULT = {(name, 3) for name in TRANSFORMS if name not in ("muon", "clip_adam", "sgd_nesterov")} | {
    ("adamw_ndim_mask", 1)
}


@pytest.mark.parametrize(
    "stage,name",
    [
        (stage, name) if (name, stage) in DEFAULT else pytest.param(stage, name, marks=pytest.mark.slow)
        for stage in range(4)
        for name in TRANSFORMS
    ],
)
def test_shape_aware_transforms_match_single_device_optax(name, stage):
    check(name, errors(name, stage), (lambda: errors(name, 0)) if stage else None)


# adafactor at n = 2 in the default set (its factored moments get layouts that depend on n);
# muon_dims and the other device counts in the slow set.
FEWER = [(name, n) for n in (1, 2, 4) for name in ("adafactor", "muon_dims")]


@pytest.mark.parametrize("name,n", models.marked_slow(FEWER, slow=[c for c in FEWER if c != ("adafactor", 2)]))
def test_fewer_devices(name, n):
    check(name, errors(name, 3, n), lambda: errors(name, 0, n))


def test_injected_learning_rate_is_readable_from_the_state():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    ref, _ = models.reference_run(awkward_loss, awkward_params(), tx, batches())
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(awkward_params(), tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(awkward_loss, tx, mesh=mesh, config=cfg)
    for b in batches():
        state, _ = step(state, b)
    lr = state.opt_state.hyperparams["learning_rate"]
    assert lr.shape == () and float(lr) == pytest.approx(1e-2)
    check("inject", models.abs_errors(zj.gather_params(state), ref))
    # Changing it between steps (a manual schedule) takes effect without recompiling.
    hyper = dict(state.opt_state.hyperparams, learning_rate=jax.device_put(jnp.zeros((), lr.dtype), lr.sharding))
    frozen = zj.gather_params(state)
    state = dataclasses.replace(state, opt_state=state.opt_state._replace(hyperparams=hyper))
    state, _ = step(state, batches()[0])
    assert step.compile_count() == 1
    decay_only = models.abs_errors(zj.gather_params(state), frozen).max()
    assert decay_only == 0.0


def test_multisteps_accumulates_sharded():
    """optax.MultiSteps (not a GradientTransformation) is accepted; its accumulator is
    stored sharded like the parameters, and the update lands every second step."""
    tx = transform("multisteps_adam")  # optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    assert isinstance(tx, optax.MultiSteps)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=3)
    params = awkward_params()
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    acc = state.opt_state.acc_grads["layers"]["w"]
    assert {s.data.size for s in acc.addressable_shards} == {acc.size // 8}
    step = models.shared_step(awkward_loss, tx, mesh=mesh, config=cfg)
    state, _ = step(state, batches()[0])
    assert models.abs_errors(zj.gather_params(state), params).max() == 0.0  # accumulated only
    state, _ = step(state, batches()[1])
    assert models.abs_errors(zj.gather_params(state), params).max() > 1e-3
