"""bf16/fp16 compute on fp32 masters, DeepSpeed loss scaling, clipping, accumulation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from tests.test_state import gpt_style_params

N = 8


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed: the independent reference."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise OverflowError("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def poisoned_loss(p, b):
    """The MLP loss, times a per-example factor: an inf factor overflows the gradients."""
    return models.mlp_loss(p, b) * jnp.mean(b["poison"])


def poison_batch(seed, bad_row=None, value=np.inf):
    b = models.batch(16, seed)
    poison = np.ones((16,), np.float32)
    if bad_row is not None:
        poison[bad_row] = value
    b["poison"] = jnp.asarray(poison)
    return b


# Backward runs at the full loss scale (DeepSpeed's semantics): DeepSpeed's default 2**16
# overflows the O(1) gradients of these small models in fp16, and the first steps would be
# skipped while the scale backs off; the tests start from a scale they fit under.
FP16_SCALE_POWER = 8


ADAMW = optax.adamw(1e-3)  # one object: make's steps of equal configs compile once (models.shared_step)


def make(stage, tx=None, loss_fn=models.mlp_loss, params=None, **cfg):
    tx = tx or ADAMW
    if cfg.get("compute_dtype") == "float16":
        cfg["loss_scaling"] = {"initial_scale_power": FP16_SCALE_POWER, **cfg.get("loss_scaling", {})}
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=stage, **cfg)
    state = zj.init_state(params if params is not None else models.mlp_params(), tx, mesh=mesh, config=zc)
    return state, models.shared_step(loss_fn, tx, mesh=mesh, config=zc)


def snapshot(state):
    return [np.asarray(x).copy() for x in jax.tree.leaves((state.params, state.master, state.opt_state))]


LOW_TX = optax.sgd(0.05, momentum=0.9)


@functools.cache
def low_precision_reference():
    """Single-device fp32 optax on the stacked model, 3 steps: (params, losses, batches)."""
    params = models.stacked_params()
    batches = [models.batch(16, s) for s in range(3)]
    ref, ref_losses = models.reference_run(models.stacked_loss, params, LOW_TX, batches)
    return params, ref, ref_losses, batches


def low_precision_run(stage, dtype, reduce_dtype="float32"):
    """The same 3 steps with zerojax in ``dtype`` compute (shared by the tests that read
    them): (params after, losses, skipped flags)."""
    return _low_precision_run(stage, dtype, reduce_dtype)  # one cache key with or without the default


@functools.cache
def _low_precision_run(stage, dtype, reduce_dtype):
    params, _, _, batches = low_precision_reference()
    state, step = make(
        stage, LOW_TX, models.stacked_loss, params, compute_dtype=dtype, collectives={"reduce_dtype": reduce_dtype}
    )
    losses, skipped = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        skipped.append(bool(m["skipped"]))
    return zj.gather_params(state), losses, skipped


# bf16 at stages 1 and 2 in the slow set: fp16 takes the same compute-dtype copy there (with a
# tighter tolerance); bf16 trains at stages 0 and 3 here and at stage 2 in
# test_narrow_reduce_dtype_trains_accurately. fp16 at stages 0 and 2 in the slow set too: each
# stage trains in the default set (bf16 at 0, 2 and 3, fp16 at 1 and 3, the narrow test's runs
# counted), and each dtype at stages 0-1 (whole gradients) and 2-3 (sharded ones).
@pytest.mark.parametrize(
    "dtype,rtol,stage",
    models.marked_slow(
        [(d, r, s) for d, r in (("bfloat16", 0.05), ("float16", 0.01)) for s in range(4)],
        slow=[("bfloat16", 0.05, 1), ("bfloat16", 0.05, 2), ("float16", 0.01, 0), ("float16", 0.01, 2)],
    ),
)
def test_low_precision_matches_fp32_reference(stage, dtype, rtol):
    params, ref, ref_losses, _ = low_precision_reference()
    got, losses, skipped = low_precision_run(stage, dtype)
    assert not any(skipped)
    moved = models.abs_errors(ref, params).max()
    err = models.abs_errors(got, ref).max()
    assert err <= rtol * moved, (err, moved)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.dtype == b.dtype == jnp.float32


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_per_device_bytes(stage):
    params = gpt_style_params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=stage, compute_dtype="bfloat16")
    state = zj.init_state(params, optax.adamw(1e-3), mesh=mesh, config=zc)
    got = zj.report.state_bytes_per_device(state)["total"]
    want = {0: 12 * psi, 1: 2 * psi + 12 * psi / N, 2: 2 * psi + 12 * psi / N, 3: 12 * psi / N}[stage]
    assert got == pytest.approx(want, rel=0.01), (got, want)
    assert got == pytest.approx(zj.report.zero_formula_bytes(psi, N, stage, compute_dtype="bfloat16"), rel=0.01)


def test_stage3_gathers_in_compute_dtype_and_reduces_in_reduce_dtype():
    """Read from the program JAX emits: XLA's CPU backend later upcasts bf16 collectives to
    f32 (GPU keeps them), so the dtypes are checked before XLA's CPU passes."""
    params = models.deep_params(4, 128, stacked=True)
    x = jnp.ones((64, 128))
    for reduce, rs_key in (("float32", "reduce-scatter:f32"), ("bfloat16", "reduce-scatter:bf16")):
        state, step = make(
            3, optax.sgd(0.1), models.deep_loss, params, compute_dtype="bfloat16", collectives={"reduce_dtype": reduce}
        )
        rep = zj.report.communication_report(step.lower(state, x).as_text(dialect="hlo"))
        gathers = {k for k in rep if k.startswith("all-gather")}
        scatters = {k for k in rep if k.startswith("reduce-scatter")}
        assert gathers == {"all-gather:bf16"}, rep
        assert scatters == {rs_key}, rep
    # Stages 1-2 gather the updated params in the compute dtype too.
    state, step = make(2, optax.sgd(0.1), models.deep_loss, params, compute_dtype="bfloat16")
    rep = zj.report.communication_report(step.lower(state, x).as_text(dialect="hlo"))
    assert {k for k in rep if k.startswith("all-gather")} == {"all-gather:bf16"}


# bf16 at stages 1-3 in the slow set: fp16 there carries one device's inf into every shard
# through the same gradients (the sharded stages, each in the default set); bf16's
# skip_nonfinite flag is checked at stage 0. fp16 at stage 0 in the slow set: bf16 takes the
# whole-gradient path there. Each stage and each dtype runs once by default.
@pytest.mark.parametrize(
    "dtype,stage",
    models.marked_slow(
        [(d, s) for d in ("float16", "bfloat16") for s in range(4)],
        slow=[("float16", 0), ("bfloat16", 1), ("bfloat16", 2), ("bfloat16", 3)],
    ),
)
def test_overflow_on_one_device_skips_for_everyone(stage, dtype):
    extra = {} if dtype == "float16" else {"loss_scaling": {"skip_nonfinite": True}}
    state, step = make(stage, loss_fn=poisoned_loss, compute_dtype=dtype, **extra)
    state, m = step(state, poison_batch(0))
    assert not bool(m["skipped"])
    before, scale_before = snapshot(state), float(m["loss_scale"])
    count_before = int(jax.tree.leaves(state.opt_state)[0])  # adamw's step count
    assert count_before == 1
    # Row 13 lives on device 6 only.
    state, m = step(state, poison_batch(1, bad_row=13))
    assert bool(m["skipped"]) and int(m["skipped_steps"]) == 1 and int(state.skipped) == 1
    for a, b in zip(before, snapshot(state)):
        np.testing.assert_array_equal(a, b)  # params, masters, optimizer state: bit for bit
    assert int(jax.tree.leaves(state.opt_state)[0]) == count_before  # optax count did not advance
    assert int(state.step) == 2
    if dtype == "float16":  # hysteresis 2: the first overflow only uses it up
        assert float(m["loss_scale"]) == scale_before == 2.0**FP16_SCALE_POWER
    # NaN works the same, and a clean step afterwards trains again.
    state, m = step(state, poison_batch(2, bad_row=2, value=np.nan))
    assert bool(m["skipped"]) and int(state.skipped) == 2
    state, m = step(state, poison_batch(3))
    assert not bool(m["skipped"])
    assert any((a != b).any() for a, b in zip(before, snapshot(state)))


# The scale's update runs after the gradients, whatever the stage: each stage and each
# hysteresis mode once in the default set.
@pytest.mark.parametrize(
    "stage,consecutive",
    models.marked_slow([(s, c) for s in (1, 3) for c in (False, True)], slow=[(1, False), (3, True)]),
)
def test_scale_sequence_matches_deepspeed(stage, consecutive):
    window, hyst, init_power, min_scale = 3, 2, 5, 4.0
    script = [False] * 4 + [True] + [False] * 2 + [True, False, True, True] + [False] * 7 + [True] * 3 + [False] * 4
    state, step = make(
        stage,
        tx=optax.sgd(1e-3),
        loss_fn=poisoned_loss,
        compute_dtype="float16",
        loss_scaling={
            "loss_scale_window": window,
            "hysteresis": hyst,
            "initial_scale_power": init_power,
            "min_loss_scale": min_scale,
            "consecutive_hysteresis": consecutive,
        },
    )
    ref = DeepSpeedScaler(2.0**init_power, window, min_scale, hyst, consecutive)
    got, want = [], []
    for i, overflow in enumerate(script):
        state, m = step(state, poison_batch(i, bad_row=5 if overflow else None))
        assert bool(m["skipped"]) == overflow
        got.append(float(m["loss_scale"]))
        want.append(ref.cur_scale)
        ref.update_scale(overflow)
    assert got == want
    assert float(state.loss_scale.scale) == ref.cur_scale
    assert len(set(got)) >= 3  # the script moved the scale both ways


def test_overflow_at_min_scale_raises_or_keeps_skipping():
    """The overflow-at-minimum flag is read one call later (no step waits for the host);
    the error carries the newest state, which holds only finite updates."""
    kw = dict(
        loss_fn=poisoned_loss,
        compute_dtype="float16",
        loss_scaling={"initial_scale_power": 1, "min_loss_scale": 1.0, "hysteresis": 1},
    )
    state, step = make(3, **kw)
    state, m = step(state, poison_batch(0, bad_row=0))  # 2 -> 1
    assert float(state.loss_scale.scale) == 1.0
    good = snapshot(state)
    state, m = step(state, poison_batch(1, bad_row=0))  # overflow at the minimum: flagged, not raised
    assert bool(m["overflow_at_min_scale"]) and bool(m["skipped"])
    for a, b in zip(good, snapshot(state)):  # the skipped step changed nothing
        np.testing.assert_array_equal(a, b)
    with pytest.raises(zj.LossScaleError, match=r"already at minimum \(1.0\).*overflowed again at step 1") as info:
        step(state, poison_batch(2))  # this call's own step is clean: it trains
    newest = info.value.state
    assert int(newest.step) == 3 and not bool(info.value.metrics["skipped"])
    assert any((a != b).any() for a, b in zip(good, snapshot(newest)))
    newest, m = step(newest, poison_batch(3))  # the carried state is alive (not donated away)
    assert np.isfinite(float(m["loss"]))
    # check_loss_scale reads the last step's flag right away.
    newest, m = step(newest, poison_batch(4, bad_row=0))
    with pytest.raises(zj.LossScaleError, match="overflowed again at step 4"):
        step.check_loss_scale(newest, m)

    state, step = make(3, **{**kw, "loss_scaling": {**kw["loss_scaling"], "raise_at_min_scale": False}})
    for i in range(3):
        state, m = step(state, poison_batch(i, bad_row=0))
    assert bool(m["overflow_at_min_scale"]) and int(m["skipped_steps"]) == 3


def test_static_loss_scale():
    state, step = make(2, loss_fn=poisoned_loss, compute_dtype="float16", loss_scaling={"loss_scale": 1024.0})
    for i, bad in enumerate([None, 3, None]):
        state, m = step(state, poison_batch(i, bad_row=bad))
        assert float(m["loss_scale"]) == 1024.0 and bool(m["skipped"]) == (bad is not None)


# Clipping runs after the gradients, whatever the stage: stages 0 and 3 (both gradient paths)
# in the default set; test_conformance checks each stage's grad_norm against optax.
@pytest.mark.parametrize("stage", models.marked_slow(range(4), slow=[1, 2]))
def test_grad_clip_equals_unsharded_clipping(stage):
    tx = optax.sgd(0.1)
    ref_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    params, batches = models.stacked_params(), [models.batch(16, s) for s in range(3)]
    ref, _ = models.reference_run(models.stacked_loss, params, ref_tx, batches)
    state, step = make(stage, tx, models.stacked_loss, params, grad_clip=0.05)
    for b in batches:
        state, m = step(state, b)
        assert float(m["grad_norm"]) > 0.05  # clipping was active
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-5


def test_grad_clip_after_unscaling_fp16():
    """The norm is of the true gradient, not the scaled one: same result as fp32 clipping."""
    tx = optax.sgd(0.1)
    ref_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    params, b = models.stacked_params(), models.batch(16, 0)
    ref, _ = models.reference_run(models.stacked_loss, params, ref_tx, [b])
    state, step = make(3, tx, models.stacked_loss, params, grad_clip=0.05, compute_dtype="float16")
    state, m = step(state, b)
    true_norm = optax.tree.norm(jax.grad(models.stacked_loss)(params, b))
    assert float(m["grad_norm"]) == pytest.approx(float(true_norm), rel=1e-2)
    moved = models.abs_errors(ref, params).max()
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 0.01 * moved


# Stages 0-2 in the slow set: test_grad_accumulation_sgd_exact holds them exactly (every stage
# accumulates in the default set there); stage 3 here checks the adamw big-step equality.
@pytest.mark.parametrize("stage", models.marked_slow(range(4), slow=[0, 1, 2]))
def test_grad_accumulation_equals_one_big_step(stage):
    tx = optax.adamw(1e-3)
    params, big = models.stacked_params(), models.batch(64, 0)
    ref, ref_losses = models.reference_run(models.stacked_loss, params, tx, [big, models.batch(64, 1)])
    state, step = make(stage, tx, models.stacked_loss, params, grad_accum_steps=4)
    losses = []
    for b in [big, models.batch(64, 1)]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    err = models.abs_errors(zj.gather_params(state), ref)
    assert err.mean() <= 2e-6 and err.max() <= 1e-5 * 50
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@functools.cache
def _accumulation_reference():
    """Single-device optax on the whole batches: one run for every stage's case below."""
    tx = optax.sgd(0.1, momentum=0.9)
    return models.reference_run(models.mlp_loss, models.mlp_params(), tx, [models.batch(32, s) for s in range(2)])[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_accumulation_sgd_exact(stage):
    tx = optax.sgd(0.1, momentum=0.9)
    params, batches = models.mlp_params(), [models.batch(32, s) for s in range(2)]
    ref = _accumulation_reference()
    state, step = make(stage, tx, models.mlp_loss, params, grad_accum_steps=2)
    for b in batches:
        state, _ = step(state, b)
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-5


def test_accumulator_is_sharded_from_stage2():
    """k micro-batches: stage 2's transient memory stays below stage 1's by ~a gradient."""
    params = models.deep_params(8, 256, stacked=True)
    x = jnp.ones((128, 256))
    grad = 4 * sum(p.size for p in jax.tree.leaves(params))
    temps = {}
    for stage in (1, 2):
        state, step = make(stage, optax.sgd(0.1), models.deep_loss, params, grad_accum_steps=4)
        temps[stage] = zj.report.compiled_bytes(step.lower(state, x).compile())["temp"]
    assert temps[1] - temps[2] > 0.6 * grad, (temps, grad)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(compute_dtype="bfloat16", loss_scaling={"loss_scale": "dynamic"}),
            "cannot apply with compute_dtype='bfloat16'",
        ),
        (dict(loss_scaling={"loss_scale": 128.0}), "cannot apply with compute_dtype='float32'"),
        (dict(compute_dtype="float16", loss_scaling={"loss_scale_window": 0}), "loss_scale_window must be >= 1, got 0"),
        (dict(compute_dtype="float16", loss_scaling={"min_loss_scale": 0.0}), "min_loss_scale must be > 0, got 0.0"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be >= 1"),
        (dict(compute_dtype="int8"), "compute_dtype must be one of"),
        (dict(compute_dtype="float16", loss_scaling={"loss_scale": 0}), "'dynamic', a positive float or None"),
        (dict(grad_clip=-1.0), "grad_clip must be a positive number"),
    ],
)
def test_bad_precision_config(kw, match):
    with pytest.raises(ValueError, match=match):
        zj.ZeroConfig(**kw)


def test_batch_must_split_into_micro_batches():
    state, step = make(3, grad_accum_steps=3)
    with pytest.raises(
        ValueError, match=r"2 rows per device, which do not split into grad_accum_steps=3.*multiple of 24"
    ):
        step(state, models.batch(16))
    assert step.compile_count() == 0


@pytest.mark.slow  # reason: 3 x 30 GPT steps; test_low_precision_matches_fp32_reference (bf16 and fp16)
def test_gpt_low_precision_loss_curves_track_fp32():
    from experiments import precision_curves

    r = precision_curves.main(["--steps", "30", "--layers", "2", "--d-model", "64"])
    ref = np.mean(r["fp32"]["loss"][-10:])
    assert ref < r["fp32"]["loss"][0] - 1.0  # it trains
    for name in ("bf16", "fp16"):
        last = np.mean(r[name]["loss"][-10:])
        assert abs(last / ref - 1) < 0.03, (name, last, ref)
        # Step by step until the first skipped step (after it, the run is a step behind).
        skipped = list(r[name]["skipped"]) + [True]
        same = skipped.index(True)
        assert same >= 15 and sum(r[name]["skipped"]) <= 3, (name, r[name]["skipped"])
        np.testing.assert_allclose(r[name]["loss"][:same], r["fp32"]["loss"][:same], rtol=0.05)


@pytest.mark.parametrize("stage,k", [(0, 2), (3, 1)])
def test_backward_runs_at_the_full_loss_scale(monkeypatch, stage, k):
    """Each device's gradient enters the reduction at scale / k (DeepSpeed's semantics),
    not scale / (N k): recorded on every device inside the compiled step."""
    from zerojax.sharding import collectives

    seen = []
    reduce_grad = collectives.reduce_grad

    def spy(g, axis, n, reduce_dtype, layout=None, replica=None, block=None):
        jax.debug.callback(lambda i, x: seen.append((int(i), np.asarray(x, np.float32))), jax.lax.axis_index(axis), g)
        return reduce_grad(g, axis, n, reduce_dtype, layout, replica, block)

    monkeypatch.setattr(collectives, "reduce_grad", spy)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(13, 7)), jnp.float32), "b": jnp.zeros((7,))}
    b = models.batch(32, 0)
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
    power = 10
    state, step = make(
        stage,
        optax.sgd(0.1),
        loss_fn,
        params,
        compute_dtype="float16",
        loss_scaling={"initial_scale_power": power},
        grad_accum_steps=k,
    )
    state, m = step(state, b)
    jax.effects_barrier()
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**power
    assert sorted({i for i, _ in seen}) == list(range(N))
    # The reference: device d's rows, in fp16 on one device, loss times scale / k.
    p16 = jax.tree.map(lambda x: x.astype(jnp.float16), params)
    rows = 32 // N
    for d in range(N):
        want = jax.tree.map(jnp.zeros_like, p16)
        for j in range(k):  # micro-batch j: the device's rows j, j + k, ...
            mb = jax.tree.map(lambda x: x[d * rows + j : (d + 1) * rows : k].astype(jnp.float16), b)
            g = jax.grad(lambda p: loss_fn(p, mb).astype(jnp.float32) * 2.0**power / k)(p16)
            want = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), want, g)
        got = {x.shape: x for i, x in seen if i == d}
        # fp16 sums over a device's rows round in an order XLA chooses (it differs between
        # jax versions and runs): a few fp16 ulps of the largest summand, which cancellation
        # can leave beside a small entry, so the bound is relative to the leaf's largest
        # entry. A wrong scale would be off by N = 8 times everywhere.
        for name in ("w", "b"):
            g, w = got[params[name].shape], np.asarray(want[name])
            np.testing.assert_allclose(g, w, rtol=0, atol=2e-3 * np.abs(w).max() + 1e-2)
            assert abs(np.linalg.norm(g) / np.linalg.norm(w) - 1) < 2e-3, name


# One stage per reduce dtype in the default set: stages 2 and 3 reduce through the same code.
@pytest.mark.parametrize(
    "dtype,stage",
    models.marked_slow(
        [(d, s) for d in ("bfloat16", "float16") for s in (2, 3)], slow=[("bfloat16", 3), ("float16", 2)]
    ),
)
def test_narrow_reduce_dtype_trains_accurately(stage, dtype):
    """Gradients reduced in bf16/fp16 (half the bytes): the trained weights stay within the
    same bound as fp32 reductions of the same compute dtype."""
    params, ref, _, _ = low_precision_reference()
    moved = models.abs_errors(ref, params).max()
    errs = {}
    for reduce in ("float32", dtype):
        got, _, skipped = low_precision_run(stage, dtype, reduce)
        assert not any(skipped)
        errs[reduce] = models.abs_errors(got, ref).max()
    rtol = 0.05 if dtype == "bfloat16" else 0.01
    assert errs[dtype] <= rtol * moved, (errs, moved)
    assert errs[dtype] <= 3 * errs["float32"] + 1e-6, errs


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_fp16_reduction_cannot_overflow_where_each_device_does_not(stage):
    """Every device's scaled gradient is 20000 (finite in fp16); their sum over 8 devices is
    not. The fp16 reduction divides by N before summing, as DeepSpeed's reduce-scatter does."""
    params = {"w": jnp.ones((16,))}
    loss_fn = lambda p, b: jnp.mean(b["x"] @ p["w"])  # d loss / d w = 1 per element
    state, step = make(
        stage,
        optax.sgd(0.5),
        loss_fn,
        params,
        compute_dtype="float16",
        collectives={"reduce_dtype": "float16"},
        loss_scaling={"loss_scale": 20000.0},
    )
    state, m = step(state, {"x": jnp.ones((8, 16))})
    assert not bool(m["skipped"])
    np.testing.assert_allclose(np.asarray(zj.gather_params(state)["w"]), 0.5, rtol=1e-3)


def test_replacing_the_compute_dtype_keeps_the_loss_scale_default():
    """'auto' is resolved where it is read: dataclasses.replace gives the right scaling."""
    import dataclasses

    fp16 = dataclasses.replace(zj.ZeroConfig(stage=2), compute_dtype="float16")
    assert fp16.resolved_loss_scale == "dynamic" and fp16.dynamic_scaling
    assert fp16 == zj.ZeroConfig(stage=2, compute_dtype="float16")
    bf16 = dataclasses.replace(fp16, compute_dtype="bfloat16")  # used to raise
    assert bf16.resolved_loss_scale is None and not bf16.scaling
    static = dataclasses.replace(zj.ZeroConfig(compute_dtype="float16", loss_scaling={"loss_scale": 128}), stage=1)
    assert static.resolved_loss_scale == 128.0
    with pytest.raises(ValueError, match="cannot apply with compute_dtype='bfloat16'"):
        dataclasses.replace(static, compute_dtype="bfloat16")
    # The train step scales by it: a replaced fp16 config skips an overflowing step.
    state, step = make(
        2,
        loss_fn=poisoned_loss,
        params=models.mlp_params(),
        compute_dtype=fp16.compute_dtype,
        loss_scaling={"loss_scale": fp16.loss_scaling.loss_scale},
    )
    state, m = step(state, poison_batch(0, bad_row=3))
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**FP16_SCALE_POWER
