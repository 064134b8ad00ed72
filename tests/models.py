"""Small models with awkward shapes, shared by the tests, and a plain optax reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

IN, HID, OUT, LAYERS = 13, 20, 7, 3


def batch(n: int = 16, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, IN)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, OUT)), jnp.float32),
    }


def mlp_params(seed: int = 0, layers: int = LAYERS) -> dict:
    """Unrolled layers with dims that do not divide 8 (13, 20, 7), a scalar and a bias of 13."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0] if s else 1), jnp.float32)
    return {
        "inp": {"w": f(IN, HID), "b": jnp.zeros((HID,))},
        "layers": [
            {"w": f(HID, HID), "b": jnp.asarray(rng.normal(size=(HID,)) * 0.1, jnp.float32)} for _ in range(layers)
        ],
        "out": {"w": f(HID, OUT), "b": jnp.zeros((OUT,))},
        "skip": f(IN),
        "temp": jnp.asarray(1.3, jnp.float32),
    }


def mlp_loss(p, b):
    x = b["x"] * p["skip"]
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    for layer in p["layers"]:
        h = h + jnp.tanh(h @ layer["w"] + layer["b"])
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


def stacked_params(seed: int = 0, layers: int = LAYERS) -> dict:
    """Layers stacked on a leading axis, run with lax.scan."""
    p = mlp_params(seed, layers)
    layers = p.pop("layers")
    p["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return p


def stacked_loss(p, b):
    x = b["x"] * p["skip"]
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])

    def body(h, layer):
        return h + jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(body, h, p["layers"])
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


# Flax NNX: a stack of blocks built with nnx.vmap and run with nnx.scan.
class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d, d, rngs=rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(self.norm(x)))


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(IN, HID, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(HID, rngs)

        self.blocks = blocks(rngs)
        self.out = nnx.Linear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.out(run(self.inp(x), self.blocks))


# Flax linen: layer submodules and nn.scan.
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(HID)(nn.LayerNorm()(x))), None


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(HID)(x)
        Stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = Stack()(x, None)
        x = nn.Dense(HID)(x)  # an unrolled submodule too
        return nn.Dense(OUT)(jnp.tanh(x))


def reference_run(loss_fn, params, tx, batches, grad_norms=None):
    """Plain single-device optax: the independent reference. Appends each step's global
    gradient norm to ``grad_norms`` when given."""
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, b):
        loss, g = jax.value_and_grad(loss_fn)(params, b)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss, optax.tree.norm(g)

    losses = []
    for b in batches:
        params, opt, loss, norm = step(params, opt, b)
        losses.append(float(loss))
        if grad_norms is not None:
            grad_norms.append(float(norm))
    return params, losses


_STEPS: dict = {}


def shared_step(loss_fn, tx, *, mesh, config, **options):
    """One ``zj.make_train_step`` per (loss, optimizer, mesh, config, options) for the tests
    that train the same step from different states: the step compiles once, not once per
    test (zerojax keeps multi-device CPU steps out of the compilation cache). Don't use it
    where a test counts its step's compiles."""
    import zerojax as zj

    key = (loss_fn, tx, mesh, config, tuple(sorted(options.items())))
    step = _STEPS.get(key)
    if step is None:
        step = _STEPS[key] = zj.make_train_step(loss_fn, tx, mesh=mesh, config=config, **options)
    step._unchecked = None  # a loss-scale flag of another test's state is not this one's
    return step


def lower_as_called(step, state, batch):
    """``step.lower(state, batch)`` with the batch placed as ``step(state, batch)`` places it
    (its rows split over the step's batch axes): the program the call runs. Lowered and
    called, it compiles once (JAX keeps the executable by program); a batch lowered as given
    is a replicated input, another program and a second compile. ``step`` is a
    ``zj.make_train_step`` or ``zj.make_eval_step`` step, or a ``zj.nnx`` train step with
    ``state`` its optimizer."""
    from zerojax.step import place_batch, row_split

    if hasattr(step, "step_for"):  # zj.nnx.make_train_step: the zerojax step of this optimizer
        step, state = step.step_for(state), state.state
    return step.lower(state, place_batch(batch, step.mesh, row_split(step.mesh, step.config)[1]))


def zero_run(loss_fn, params, tx, batches, stage, n_devices=8, grad_norms=None, replicas=1, shared=False, **config):
    """The same training with zerojax: full params after it, and the losses (and each
    step's ``grad_norm`` metric appended to ``grad_norms``). The step must compile once and
    count every call; with ``shared`` it is ``shared_step``'s (a test that trains the same
    loss, ``tx`` object, mesh and config takes it too), compiled once across those tests."""
    import zerojax as zj

    mesh = zj.make_mesh(jax.devices()[:n_devices], replicas=replicas)
    cfg = zj.ZeroConfig(stage=stage, **config)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    make = shared_step if shared else zj.make_train_step
    step = make(loss_fn, tx, mesh=mesh, config=cfg)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    assert step.compile_count() == 1, "the step recompiled after the first call"
    assert int(state.step) == len(batches)
    return zj.gather_params(state), losses


def abs_errors(a, b) -> np.ndarray:
    return np.concatenate(
        [
            np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).ravel()
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
        ]
    )


# Deep, wide enough that memory effects dwarf bookkeeping: used by compiled-program tests.
def deep_params(layers: int, d: int, stacked: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    ws = [jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32) for _ in range(layers)]
    bs = [jnp.zeros((d,), jnp.float32) for _ in range(layers)]
    if stacked:
        return {"w": jnp.stack(ws), "b": jnp.stack(bs)}
    return [{"w": w, "b": b} for w, b in zip(ws, bs)]


def indexed_loss(p, b):
    """``stacked_params`` run by taking each layer by index in a Python loop (no scan)."""
    x = b["x"] * p["skip"]
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    for i in range(p["layers"]["w"].shape[0]):
        h = h + jnp.tanh(h @ p["layers"]["w"][i] + p["layers"]["b"][i])
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


def deep_indexed_loss(p, x):
    """``deep_params(stacked=True)`` taken layer by layer by index."""
    for i in range(p["w"].shape[0]):
        x = jnp.tanh(x @ p["w"][i] + p["b"][i])
    return jnp.mean(x**2)


def deep_loss(p, x):
    if isinstance(p, dict):
        x, _ = jax.lax.scan(lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), x, p)
    else:
        for l in p:
            x = jnp.tanh(x @ l["w"] + l["b"])
    return jnp.mean(x**2)


class DeepNNX(nnx.Module):
    """Layers as a list of submodules (no scan): per-layer gathering must still happen."""

    def __init__(self, layers: int, d: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def pairwise(**factors: list) -> list[tuple]:
    """Rows of the factors' values (in the order given) in which every pair of values of any
    two factors appears together at least once: a covering array of strength 2, for matrices
    whose bugs come from two settings meeting. Greedy and deterministic: each row is the first
    combination, in product order, that covers the most pairs not yet covered.

    >>> len(pairwise(opt=["a", "b"], n=[1, 2, 4], stage=[0, 1, 2, 3]))  # 24 combinations
    12
    """
    import itertools

    names = list(factors)
    values = [list(factors[k]) for k in names]
    pairs = lambda row: {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}
    todo = set().union(*(pairs(r) for r in itertools.product(*values)))
    rows: list[tuple] = []
    candidates = list(itertools.product(*values))
    while todo:
        best = max(candidates, key=lambda r: len(pairs(r) & todo))  # max keeps the first of ties
        rows.append(best)
        todo -= pairs(best)
    return rows


def marked_slow(cases, slow) -> list:
    """``cases`` (a test's argument values, or tuples of them) as pytest parameters, those in
    ``slow`` marked slow: the default set keeps the others. Each of ``slow`` must be a case.

    >>> [type(c).__name__ for c in marked_slow(range(3), slow=[1])]
    ['int', 'ParameterSet', 'int']
    """
    import pytest

    cases = list(cases)
    missing = [c for c in slow if c not in cases]
    if missing:
        raise ValueError(f"marked_slow: {missing} are not among the cases {cases}")
    return [
        pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow) if c in slow else c for c in cases
    ]
