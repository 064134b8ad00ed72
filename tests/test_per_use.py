"""The jaxpr interpreter behind per-use gathering: its reads of JAX's forms and its warnings."""

import types
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax._jaxpr import constructs, form


class _FlatTrees:
    """jax >= 0.11's ``ft_in``: flat trees of (consts, carry, xs), unpacked into sized parts."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def unpack(self):
        return tuple(range(n) for n in self.sizes)


@pytest.mark.parametrize(
    "split",
    [
        {"num_consts": 2, "num_carry": 1},  # jax 0.10
        {"ft_in": _FlatTrees(2, 1, 3)},
    ],
)  # jax 0.11 - 0.12
def test_scan_operand_split_reads_every_supported_form(split):
    """The one function that reads a scan's operands gives the same split for both forms,
    whichever JAX runs the test."""
    body = jax.make_jaxpr(lambda a, b, c, x, y, z: (c, x))(*[1.0] * 6)
    eqn = types.SimpleNamespace(params={"jaxpr": body, "length": 4, "reverse": False, "unroll": 1, **split})
    s = constructs.scan(eqn)
    assert (s.n_consts, s.n_carry, s.length, s.reverse) == (2, 1, 4, False)
    assert len(s.body.invars) == 6 and len(s.body.outvars) == 2


def test_sub_program_forms_open_to_jaxpr_and_consts():
    c = jax.device_put(jnp.array([1.0, 2.0, 3.0]))  # a closed-over array: a const of the program
    closed = jax.make_jaxpr(lambda x: x * c)(jnp.ones(3))
    jaxpr, consts = form.open_jaxpr(closed)
    assert len(consts) == len(jaxpr.constvars) == 1
    assert (consts[0] == c).all()
    open_ = form.open_jaxpr(jaxpr)  # an open jaxpr (jax 0.10's remat body) has no consts of its own
    assert open_[0] is jaxpr


def fori_loss(p, b):
    """Stacked layers run by fori_loop (a scan with the stack as a loop constant): the
    interpreter cannot slice them per layer."""
    x = b["x"] * p["skip"]
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    h = jax.lax.fori_loop(0, models.LAYERS, lambda i, h: h + jnp.tanh(h @ p["layers"]["w"][i] + p["layers"]["b"][i]), h)
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_stack_gathered_whole_warns_and_stays_exact(stage):
    params, tx, b = models.stacked_params(), optax.sgd(0.1), models.batch(16)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(fori_loss, tx, mesh=mesh, config=cfg)
    with pytest.warns(
        UserWarning,
        match=r"stacked parameter \['layers'\]\['w'\] of shape \(3, 20, 20\) enters "
        r"a 'scan' as a loop constant or carry \(not scanned over\) whole.*jax.lax.scan",
    ):
        state, _ = step(state, b)
    ref, _ = models.reference_run(fori_loss, params, tx, [b])
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-5
    with warnings.catch_warnings():  # scan over the stack: no warning
        warnings.simplefilter("error")
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg)(state, b)
