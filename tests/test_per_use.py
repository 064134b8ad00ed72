"""The jaxpr interpreter behind per-use gathering: its JAX self-check and its warnings."""

import types
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.sharding import per_use


def test_missing_primitive_fails_naming_it_and_the_jax_version(monkeypatch):
    import jax.extend.core

    fake = types.SimpleNamespace(**{n: getattr(jax.extend.core.primitives, n) for n in per_use._NEEDED
                                    if n != "scan_p"})
    monkeypatch.setattr(jax.extend.core, "primitives", fake)
    with pytest.raises(ImportError, match=rf"needs the JAX primitives \['scan_p'\], which jax {jax.__version__} "):
        per_use._primitives()


def test_renamed_construct_fails_the_self_check(monkeypatch):
    """If jax.lax.scan stopped tracing to the primitive the interpreter dispatches on, the
    import-time check says so instead of gathering whole stacks silently."""
    other = jax.extend.core.Primitive("scan_renamed")
    monkeypatch.setattr(per_use._P, "scan_p", other)
    with pytest.raises(ImportError, match=rf"does not recognise jax.lax.scan in jax {jax.__version__}: it no "
                                          r"longer traces to the primitive 'scan_renamed'"):
        per_use._self_check()


def test_self_check_passes_and_starts_no_backend():
    per_use._self_check()


def fori_loss(p, b):
    """Stacked layers run by fori_loop (a scan with the stack as a loop constant): the
    interpreter cannot slice them per layer."""
    x = b["x"] * p["skip"]
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    h = jax.lax.fori_loop(0, models.LAYERS,
                          lambda i, h: h + jnp.tanh(h @ p["layers"]["w"][i] + p["layers"]["b"][i]), h)
    pred = (h @ p["out"]["w"] + p["out"]["b"]) * p["temp"]
    return jnp.mean((pred - b["y"]) ** 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_stack_gathered_whole_warns_and_stays_exact(stage):
    params, tx, b = models.stacked_params(), optax.sgd(0.1), models.batch(16)
    mesh, cfg = zj.make_mesh(), zj.ZeroConfig(stage=stage)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(fori_loss, tx, mesh=mesh, config=cfg)
    with pytest.warns(UserWarning, match=r"stacked parameter \['layers'\]\['w'\] of shape \(3, 20, 20\) enters "
                                         r"a 'scan' as a loop constant or carry \(not scanned over\) whole.*jax.lax.scan"):
        state, _ = step(state, b)
    ref, _ = models.reference_run(fori_loss, params, tx, [b])
    assert models.abs_errors(zj.gather_params(state), ref).max() <= 1e-5
    with warnings.catch_warnings():  # scan over the stack: no warning
        warnings.simplefilter("error")
        state = zj.init_state(params, tx, mesh=mesh, config=cfg)
        zj.make_train_step(models.stacked_loss, tx, mesh=mesh, config=cfg)(state, b)
