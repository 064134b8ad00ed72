"""The jaxpr interpreter behind per-use gathering: its JAX self-check and its warnings."""

import os
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.sharding import jax_compat


def test_missing_primitive_fails_naming_it_and_the_jax_version(monkeypatch):
    import jax.extend.core

    fake = types.SimpleNamespace(
        **{n: getattr(jax.extend.core.primitives, n) for n in jax_compat.NEEDED if n != "scan_p"}
    )
    monkeypatch.setattr(jax.extend.core, "primitives", fake)
    with pytest.raises(
        ImportError,
        match=rf"does not recognise its primitives in jax {jax.__version__}: "
        r"jax.extend.core.primitives does not export \['scan_p'\].*jax_compat.py",
    ):
        jax_compat._primitives()


def test_renamed_construct_fails_the_self_check(monkeypatch):
    """If jax.lax.scan stopped tracing to the primitive the interpreter dispatches on, the
    import-time check says so instead of gathering whole stacks silently."""
    other = jax.extend.core.Primitive("scan_renamed")
    monkeypatch.setattr(jax_compat.P, "scan_p", other)
    with pytest.raises(
        ImportError,
        match=rf"does not recognise jax.lax.scan in jax {jax.__version__}: it no "
        r"longer traces to the primitive 'scan_renamed'",
    ):
        jax_compat.self_check()


def test_moved_parameter_fails_the_self_check_naming_the_construct(monkeypatch):
    """A release whose scan parameters read differently (here: no operand split) fails at
    import, naming the construct, the parameters it has and the module to update."""
    real = jax_compat.scan
    monkeypatch.setattr(
        jax_compat,
        "scan",
        lambda e: real(
            types.SimpleNamespace(params={k: v for k, v in e.params.items() if k not in ("num_consts", "ft_in")})
        ),
    )
    with pytest.raises(
        ImportError,
        match=r"does not recognise jax.lax.scan in jax .*primitive 'scan' has "
        r"parameters \[.*'jaxpr'.*\], read as KeyError.*jax_compat.py",
    ):
        jax_compat.self_check()


def test_import_and_self_check_start_no_backend():
    """Importing zerojax (which runs the self-check) must leave JAX unstarted: a multi-host
    job calls jax.distributed.initialize after importing zerojax, and device settings are
    still free to change."""
    jax_compat.self_check()
    code = (
        "import jax, zerojax\n"
        "jax.config.update('jax_num_cpu_devices', 3)  # refused once a backend has started\n"
        "assert len(jax.devices()) == 3, jax.devices()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-2000:]


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
    s = jax_compat.scan(eqn)
    assert (s.n_consts, s.n_carry, s.length, s.reverse) == (2, 1, 4, False)
    assert len(s.body.invars) == 6 and len(s.body.outvars) == 2


def test_sub_program_forms_open_to_jaxpr_and_consts():
    c = jax.device_put(jnp.array([1.0, 2.0, 3.0]))  # a closed-over array: a const of the program
    closed = jax.make_jaxpr(lambda x: x * c)(jnp.ones(3))
    jaxpr, consts = jax_compat.open_jaxpr(closed)
    assert len(consts) == len(jaxpr.constvars) == 1
    assert (consts[0] == c).all()
    open_ = jax_compat.open_jaxpr(jaxpr)  # an open jaxpr (jax 0.10's remat body) has no consts of its own
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
