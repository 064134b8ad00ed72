"""zerojax.resume.Run with a zj.nnx.Optimizer: restored in place, saved each step, resumed
bit-identically (dropout's keys included)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from zerojax.resume import IndexSampler, Run, RunConfig

N, BATCH = 32, 8
XS = jax.random.normal(jax.random.key(0), (N, 6))
YS = jax.random.normal(jax.random.key(1), (N, 2))
TX = optax.adamw(1e-2)
CONFIG = zj.ZeroConfig(stage=3)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.b = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jax.nn.relu(self.a(x))))


@pytest.fixture(scope="module")
def train_step():
    return zj.nnx.make_train_step(lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2))


def start(directory, until, train_step):
    """One start: a fresh module and optimizer, restored (or not) by the run, trained to ``until``."""
    model = Net(nnx.Rngs(0, dropout=1))
    opt = zj.nnx.Optimizer(model, TX, mesh=zj.make_mesh(), config=CONFIG)
    run, data = Run(RunConfig(directory, save_every=2)), IndexSampler(N, BATCH, seed=3)
    assert run.restore_or_init(opt, data=data) is opt
    # The module given holds what was restored, as it holds what a step trains.
    held, restored = nnx.state(model, nnx.Param), nnx.state(opt.gathered_model(), nnx.Param)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(restored)))
    while run.step < until:
        idx = next(data)
        train_step(opt, {"x": XS[idx], "y": YS[idx]})
        run.completed(opt)
    run.finish(opt)
    return opt, run


def leaves(opt):
    s = opt.state
    return [np.asarray(x) for x in jax.tree.leaves((zj.gather_params(s), s.master, s.opt_state, s.model_state))] + [
        np.asarray(jax.random.key_data(s.rng))
    ]


def test_an_nnx_optimizer_resumes_bit_identically(tmp_path, train_step, capsys):
    ref, _ = start(tmp_path / "ref", 5, train_step)
    for until in (3, 5):  # stopped after 3 (checkpoints 2 and 3), resumed by a new optimizer to 5
        got, run = start(tmp_path / "run", until, train_step)
    assert "resuming at step 3" in capsys.readouterr().out and run.step == got.step == 5
    ours, theirs = leaves(got), leaves(ref)
    assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    # The resumed run trained: its parameters moved from the initial ones.
    fresh = leaves(zj.nnx.Optimizer(Net(nnx.Rngs(0, dropout=1)), TX, mesh=zj.make_mesh(), config=CONFIG))
    assert not np.array_equal(ours[0], fresh[0])


def test_an_optimizer_is_taken_alone(tmp_path):
    opt = zj.nnx.Optimizer(Net(nnx.Rngs(0, dropout=1)), TX, mesh=zj.make_mesh(), config=CONFIG)
    with pytest.raises(ValueError, match=r"takes the optimizer alone .*got also \['mesh'\]"):
        Run(RunConfig(tmp_path, save_every=2)).restore_or_init(opt, mesh=zj.make_mesh())
    with pytest.raises(TypeError, match="completed takes the ZeroState the step returned, or the zj.nnx.Optimizer"):
        Run(RunConfig(tmp_path, save_every=2)).completed(opt.gathered_model())
