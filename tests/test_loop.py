"""zj.fit: the loop over a resumable run, prefetched data, the monitor, evaluation and the
export, against the same training written by hand and the loss computed on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests import models
from zerojax.resume import IndexSampler, Run, RunConfig

TX = optax.adam(optax.linear_schedule(1e-2, 1e-3, 6))
CFG = zj.ZeroConfig(stage=3)
N, GB = 64, 16
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, models.IN)).astype(np.float32)
Y = RNG.normal(size=(N, models.OUT)).astype(np.float32)
EVAL = [{"x": X[i : i + GB], "y": Y[i : i + GB]} for i in (0, GB)]


def load(idx):
    return {"x": X[idx], "y": Y[idx]}


def _parts():
    mesh = zj.make_mesh()
    step = models.shared_step(models.mlp_loss, TX, mesh=mesh, config=CFG)
    evaluate = zj.make_eval_step(models.mlp_loss, mesh=mesh, config=CFG)
    return mesh, step, evaluate


def test_a_fit_stopped_and_resumed_is_the_hand_written_loop(tmp_path):
    """fit to 3 steps, then a new process's fit to 6 from the checkpoint: the parameters
    of the plain loop over the same batches, bit for bit; one record per step, the eval
    records the held-out loss of the parameters at that step; the export is the state."""
    mesh, step, evaluate = _parts()
    sampler = IndexSampler(N, GB, seed=0)
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    held_out = []
    for k in range(6):
        state, _ = step(state, load(next(sampler)))
        if k + 1 in (2, 4, 6):
            p = zj.gather_params(state)
            held_out.append(np.mean([float(models.mlp_loss(p, b)) for b in EVAL]))
    want = jax.tree.map(np.asarray, zj.gather_params(state))

    histories = []
    for until in (3, 6):
        run = Run(RunConfig(tmp_path / "run", save_every=2, synchronous=True))
        data = zj.data.Prefetch(IndexSampler(N, GB, seed=0), mesh, config=CFG, load=load)
        state = run.restore_or_init(models.mlp_params(), TX, mesh=mesh, config=CFG, data=data)
        histories.append(zj.monitor.History())
        state = zj.fit(
            step,
            state,
            data,
            steps=until,
            run=run,
            monitor=zj.monitor.Monitor([histories[-1]]),
            eval_step=evaluate,
            eval_data=EVAL,
            eval_every=2,
            export=tmp_path / "w.safetensors" if until == 6 else None,
        )
        data.close()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, zj.gather_params(state)), want)
    first, second = ([(r["kind"], r["step"]) for r in h.records if r["kind"] != "compile"] for h in histories)
    assert first == [("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("eval", 3)]
    assert second == [("train", 4), ("eval", 4), ("train", 5), ("train", 6), ("eval", 6)]
    evals = {r["step"]: r["eval_loss"] for h in histories for r in h.records if r["kind"] == "eval"}
    np.testing.assert_allclose([evals[2], evals[4], evals[6]], held_out, rtol=1e-5)
    sched = optax.linear_schedule(1e-2, 1e-3, 6)
    rates = histories[0].values("learning_rate") + histories[1].values("learning_rate")
    np.testing.assert_allclose(rates, [float(sched(k)) for k in range(6)], rtol=1e-6)
    exported = zj.load_weights(tmp_path / "w.safetensors", like=models.mlp_params())
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, exported), want)


def test_fit_refuses_what_would_end_a_run_early_or_never_evaluate():
    mesh, step, evaluate = _parts()
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    quiet = lambda: zj.monitor.Monitor([])
    with pytest.raises(ValueError, match="ran out after step 2 of 5"):
        zj.fit(step, state, iter([load(np.arange(GB))] * 2), steps=5, monitor=quiet())
    state = zj.init_state(models.mlp_params(), TX, mesh=mesh, config=CFG)
    for kw, match in [
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(steps=2, eval_every=2), "needs eval_step"),
        (dict(steps=2, eval_step=evaluate), "give both"),
        (dict(steps=2, eval_every=-1), "eval_every must be"),
        (dict(steps=2, monitor=print), "zj.monitor.Monitor"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            zj.fit(step, state, iter([]), **kw)
    with pytest.raises(ValueError, match="records scalars"):
        zj.loop.evaluate(lambda s, b: jnp.ones(3), state, EVAL)


class _Tagger(nnx.Module):  # stock NNX layers, as a user writes them
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(models.IN, 16, rngs=rngs), nnx.Linear(16, models.OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_fit_trains_an_nnx_optimizer_in_place_as_optax_on_one_device():
    """zj.fit over zj.nnx's step and optimizer, watched with compiled FLOPs: the loss of every
    step and the held-out loss are plain optax's on one device over the same batches, the
    optimizer is the one trained in place, and the FLOPs cover the matmuls' 6 per weight
    and row (measured 1.12x on jax 0.10, 1.14x on 0.12: bias, ReLU and Adam)."""
    tx = optax.adam(1e-2)
    graphdef, ref_params = nnx.split(_Tagger(nnx.Rngs(0)))
    batches = [load(np.arange(k * GB, (k + 1) * GB)) for k in range(3)]
    ref_opt, ref_losses = tx.init(ref_params), []
    grad = jax.value_and_grad(lambda p, b: _nnx_loss(nnx.merge(graphdef, p), b))
    for b in batches:
        loss, g = grad(ref_params, b)
        updates, ref_opt = tx.update(g, ref_opt, ref_params)
        ref_params, _ = optax.apply_updates(ref_params, updates), ref_losses.append(float(loss))
    held_out = np.mean([float(_nnx_loss(nnx.merge(graphdef, ref_params), b)) for b in EVAL])

    optimizer = zj.nnx.Optimizer(_Tagger(nnx.Rngs(0)), tx, wrt=nnx.Param, mesh=zj.make_mesh(), config=CFG)
    history = zj.monitor.History()
    monitor = zj.monitor.Monitor([history], flops_per_step="compiled")
    got = zj.fit(
        zj.nnx.make_train_step(_nnx_loss),
        optimizer,
        iter(batches),
        steps=3,
        monitor=monitor,
        eval_step=zj.nnx.make_eval_step(_nnx_loss),
        eval_data=EVAL,
    )
    assert got is optimizer and optimizer.step == 3
    np.testing.assert_allclose(history.values("loss"), ref_losses, rtol=1e-5)
    evals = [r["eval_loss"] for r in history.records if r["kind"] == "eval"]
    np.testing.assert_allclose(evals, [held_out], rtol=1e-5)
    weights = models.IN * 16 + 16 * models.OUT
    assert 6 * weights * GB <= monitor.flops_per_step <= 1.5 * 6 * weights * GB, monitor.flops_per_step
