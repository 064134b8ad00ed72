"""A JAX release zerojax does not know costs speed at most: never the import, never a number.

zerojax reads JAX's program form (zerojax/_jaxpr/), which JAX changes in patch releases.
The first time a feature would read a program, every construct it reads is traced and read
back (``check.failures``). Where one does not read as expected, or where
``ZEROJAX_NO_PROGRAM_READING=1`` is set, zerojax warns once and every feature takes a path
that reads no program. These tests:

- assert that the JAX this suite runs on reads every construct (the next release that
  moves one fails here, in CI, while users keep training);
- move each construct in turn, as a release might (a primitive no longer exported, a reader
  that fails, a parameter read differently), and check that the check names it, programs
  are no longer read and the warning comes once;
- import zerojax in a fresh interpreter on a JAX whose program form was changed under it,
  and train stage 3 there equal to single-device optax;
- train through the no-reading path, pairwise over stage x model x accumulation x option
  (each value once in the default set, every pair with the slow set), equal to
  single-device optax (1e-5 after 3 AdamW steps); in bf16 and fp16 equal to the
  reading path; a checkpoint, the NNX API and the eval step; and the features that need a
  program refused with the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests import models, test_nnx
from zerojax._jaxpr import check, constructs, form, rules, walk
from zerojax._jaxpr.check import ProgramReadingOff, ProgramReadingRequired

TX = optax.adamw(1e-2)
BATCHES = [models.batch(16, s) for s in range(3)]


@pytest.fixture
def fresh_check(monkeypatch):
    """The check's cached result and its once-per-process warning, cleared before and after."""
    check.failures.cache_clear()
    monkeypatch.setattr(check, "_warned", set())
    yield
    check.failures.cache_clear()


@pytest.fixture
def no_reading(monkeypatch, fresh_check):
    """``ZEROJAX_NO_PROGRAM_READING=1`` for one test, in which any walk over a program fails
    the test; yields the ProgramReadingOff warnings seen."""
    monkeypatch.setenv(check.ENV, "1")

    def read(*args, **kwargs):
        raise AssertionError("a program was read with ZEROJAX_NO_PROGRAM_READING=1")

    monkeypatch.setattr(walk, "equations", read)
    monkeypatch.setattr(walk.Walk, "run", read)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def _off_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, ProgramReadingOff)]


# ----------------------------------------------------------------------------------------
# The check.


def test_this_jax_reads_every_construct(fresh_check):
    """The JAX the suite runs on is one whose program form zerojax reads: a release that
    moves a construct fails here (and only here and in the tests of what it moved)."""
    assert check.failures() == ()
    assert check.reading()


def _missing_primitive(monkeypatch, name):
    monkeypatch.setattr(form.P, name, form._Absent(name))
    monkeypatch.setattr(form.P, "missing", (name,))


def _failing(module, attr, error):
    def install(monkeypatch):
        def broken(*args, **kwargs):
            raise error(f"{attr} moved")

        monkeypatch.setattr(module, attr, broken)

    return install


def _renamed_cumsum(monkeypatch):
    monkeypatch.setitem(rules._DIMS, "cumsum", rules._elementwise)


def _no_operand_split(monkeypatch):
    real = constructs.scan
    monkeypatch.setattr(
        constructs,
        "scan",
        lambda e: real(
            types.SimpleNamespace(params={k: v for k, v in e.params.items() if k not in ("num_consts", "ft_in")})
        ),
    )


# (how a release moves it, the construct the check must name)
MOVES = [
    *[(lambda mp, n=n: _missing_primitive(mp, n), "its primitives") for n in form.NEEDED],
    (_failing(form, "traced_mesh", AttributeError), "the mesh an equation was traced under"),
    (_failing(form, "bind", TypeError), "binding one equation again"),
    (_failing(form, "scope", AttributeError), "jax.named_scope"),
    (_failing(constructs, "remat", KeyError), "jax.checkpoint"),
    (_failing(constructs, "static_slice", KeyError), "slicing (x[0])"),
    (_failing(constructs, "take_along", KeyError), "jnp.take_along_axis"),
    (_failing(constructs, "manual_region", KeyError), "jax.shard_map"),
    (_failing(constructs, "collective_axes", AttributeError), "jax.lax.all_gather"),
    (_renamed_cumsum, "jnp.cumsum"),
    (_no_operand_split, "jax.lax.scan"),
]


@pytest.mark.parametrize("move,construct", MOVES, ids=[f"{i}-{c}" for i, (_, c) in enumerate(MOVES)])
def test_a_moved_construct_turns_reading_off_with_one_warning(monkeypatch, fresh_check, move, construct):
    """Every way a release can move a construct, one at a time: the check names it, no
    program is read, and one warning names the JAX version, the construct and the
    features affected; a feature that needs a program says so with the fix."""
    move(monkeypatch)
    found = check.failures()
    assert construct in [what for what, _ in found], found
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not check.reading()
        assert not check.reading()  # asked again: no second warning
    (text,) = _off_warnings(seen)
    assert f"jax {jax.__version__}" in text and construct in text
    for feature, _ in check.WITHOUT_READING:
        assert f"- {feature}:" in text
    with pytest.raises(
        ProgramReadingRequired,
        match=r"does not read .*Use ZeroConfig\(context=\{'layout': 'contiguous'\}\), or use a JAX release",
    ):
        check.require("ZeroConfig(context={'layout': 'balanced'})", "Use ZeroConfig(context={'layout': 'contiguous'}).")


def test_a_primitive_jax_no_longer_exports_is_a_placeholder_not_an_import_error(monkeypatch):
    import jax.extend.core

    fake = types.SimpleNamespace(**{n: getattr(jax.extend.core.primitives, n) for n in form.NEEDED if n != "scan_p"})
    monkeypatch.setattr(jax.extend.core, "primitives", fake)
    prims = form._Primitives()
    assert prims.missing == ("scan_p",)
    assert isinstance(prims.scan_p, form._Absent) and prims.jit_p is jax.extend.core.primitives.jit_p


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_an_unclear_switch_is_refused(monkeypatch, value):
    monkeypatch.setenv(check.ENV, value)
    with pytest.raises(ValueError, match=rf"ZEROJAX_NO_PROGRAM_READING={value!r}: set it to 1"):
        check.reading()


def test_the_check_runs_inside_a_trace(fresh_check):
    """The first read may come while a step is being traced (under a mesh, inside a
    shard_map): the check runs in a thread of its own and reads the same."""
    mesh = zj.make_mesh()
    seen = []

    def body(x):
        seen.append(check.reading())
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data")))(jnp.ones(8))
    assert seen == [True] and check.failures() == ()


_FUTURE_JAX = r"""
import os, warnings
warnings.simplefilter("always")
# A JAX whose program form moved under zerojax: scan and checkpoint are no longer exported
# where zerojax looks, nor the debug information it builds one-equation programs with (JAX's
# own code, which reads its private modules, runs as before).
import jax.extend.core as jcore
import jax.extend.core.primitives as prims
del prims.scan_p, prims.remat_p
del jcore.DebugInfo

with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import zerojax as zj
assert not [w for w in at_import if "reads no JAX program" in str(w.message)], at_import
jax_ = __import__("jax")
jax_.config.update("jax_num_cpu_devices", 8)  # refused once a backend has started: importing started none

import optax
import numpy as np
from tests import models, test_nnx

params, tx = models.stacked_params(), optax.adamw(1e-2)
batches = [models.batch(16, s) for s in range(3)]
ref, ref_losses = models.reference_run(models.stacked_loss, params, tx, batches)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got, losses = models.zero_run(models.stacked_loss, params, tx, batches, stage=3)
off = [str(w.message) for w in seen if type(w.message).__name__ == "ProgramReadingOff"]
assert len(off) == 1, off
assert "jax.extend.core.primitives does not export ['scan_p', 'remat_p']" in off[0], off[0]
assert "binding one equation again" in off[0], off[0]
err = models.abs_errors(got, ref).max()
assert err <= 1e-5, err
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
print("trained", err)
"""


def test_import_never_fails_on_a_jax_whose_program_form_moved():
    """In a fresh interpreter, JAX's program form is changed before zerojax is imported (two
    primitives and a class gone from where zerojax reads them): the import works and starts
    no backend, and stage 3 trains equal to single-device optax with one warning naming
    what moved."""
    env = {k: v for k, v in os.environ.items() if k != check.ENV}
    run = subprocess.run(
        [sys.executable, "-c", _FUTURE_JAX],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "JAX_PLATFORMS": "cpu"},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained" in run.stdout


# ----------------------------------------------------------------------------------------
# Training through the path that reads no program.

LOSSES = {
    "mlp": (models.mlp_loss, models.mlp_params),  # unrolled layers
    "scan": (models.stacked_loss, models.stacked_params),  # a lax.scan over a stack
    "indexed": (models.indexed_loss, models.stacked_params),  # a stack taken layer by layer
}
OPTIONS = {
    "plain": {},
    "remat": {"remat": "full"},
    "prefetch": {"prefetch": 1},
    "clip": {"grad_clip": 0.05},  # below these models' gradient norms: clipping is active
    "offload": {"offload": {"optimizer": True, "update": "device", "group_size": 100}},
}
CASES = [
    c
    for c in models.pairwise(stage=[0, 1, 2, 3], model=list(LOSSES), accum=[1, 2], option=list(OPTIONS))
    if not (c[3] == "prefetch" and c[0] != 3)  # prefetch is a stage-3 option
    and not (c[3] == "offload" and c[0] == 0)  # offload shards state: stages 1-3
]
# The default set: every stage, model, accumulation and option once, each case one that
# takes the path without reading (stage 2 or 3, remat or offload). The cases that complete
# the pairs are slow (among them those at stage 0 or 1 without remat or offload, which read
# no program with reading on either: test_conformance trains those).
DEFAULT_CASES = [(3, "scan", 1, "prefetch"), (1, "indexed", 2, "offload"), (0, "scan", 2, "remat")]
DEFAULT_CASES += [(2, "mlp", 2, "clip"), (3, "indexed", 2, "plain")]
assert set(DEFAULT_CASES) <= set(CASES), "each default case must be one of the pairwise cases"


@pytest.mark.parametrize(
    "stage,model,accum,option", models.marked_slow(CASES, [c for c in CASES if c not in DEFAULT_CASES])
)
def test_without_reading_trains_as_single_device_optax(no_reading, stage, model, accum, option):
    loss_fn, make = LOSSES[model]
    params = make()
    clip = OPTIONS[option].get("grad_clip")
    ref_tx = TX if clip is None else optax.chain(optax.clip_by_global_norm(clip), TX)
    ref, ref_losses = models.reference_run(loss_fn, params, ref_tx, BATCHES)
    got, losses = models.zero_run(loss_fn, params, TX, BATCHES, stage, grad_accum_steps=accum, **OPTIONS[option])
    assert models.abs_errors(got, ref).max() <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert len(_off_warnings(no_reading)) == (1 if stage >= 2 or option in ("remat", "offload") else 0)


def _run(stage, dtype, batches):
    cfg = {"compute_dtype": dtype, **({"loss_scaling": {"initial_scale_power": 8}} if dtype == "float16" else {})}
    return models.zero_run(models.stacked_loss, models.stacked_params(), TX, batches, stage, **cfg)


# Stages 1 and 0 in the slow set: they read no program with or without the switch (no
# warning in test_without_reading_trains_as_single_device_optax), so both runs there take the
# same path; stages 3 and 2 keep both dtypes in the default set.
@pytest.mark.parametrize(
    "stage,dtype",
    models.marked_slow(
        [(3, "bfloat16"), (2, "float16"), (1, "bfloat16"), (0, "float16")], slow=[(1, "bfloat16"), (0, "float16")]
    ),
)
def test_without_reading_mixed_precision_equals_the_reading_path(monkeypatch, fresh_check, stage, dtype):
    """bf16/fp16 compute on fp32 masters (fp16 with dynamic loss scaling): the same numbers
    as where the program is read (the forward and backward arithmetic is the same)."""
    read, read_losses = _run(stage, dtype, BATCHES)
    monkeypatch.setenv(check.ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProgramReadingOff)
        got, losses = _run(stage, dtype, BATCHES)
    assert models.abs_errors(got, read).max() <= 1e-6
    np.testing.assert_allclose(losses, read_losses, rtol=1e-6)


def test_without_reading_a_checkpoint_restores_across_stages_and_evaluates(no_reading, tmp_path):
    """Saved at stage 3 without reading, restored at stage 1 (reading or not, a checkpoint
    is the same), trained on, and evaluated at stage 3, equal to single-device optax."""
    params = models.stacked_params()
    ref, _ = models.reference_run(models.stacked_loss, params, TX, BATCHES)
    mesh = zj.make_mesh()
    cfg3, cfg1 = zj.ZeroConfig(stage=3), zj.ZeroConfig(stage=1)
    state = zj.init_state(params, TX, mesh=mesh, config=cfg3)
    state, _ = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg3)(state, BATCHES[0])
    zj.save_checkpoint(tmp_path, state, step=1, wait=True)
    again = zj.restore_checkpoint(tmp_path, params, TX, mesh=mesh, config=cfg1)
    step1 = zj.make_train_step(models.stacked_loss, TX, mesh=mesh, config=cfg1)
    for b in BATCHES[1:]:
        again, _ = step1(again, b)
    assert models.abs_errors(zj.gather_params(again), ref).max() <= 1e-5
    back = zj.restore_checkpoint(tmp_path, params, TX, mesh=mesh, config=cfg3)
    ev = zj.make_eval_step(models.stacked_loss, mesh=mesh, config=cfg3)
    after_one = models.reference_run(models.stacked_loss, params, TX, BATCHES[:1])[0]
    np.testing.assert_allclose(
        float(ev(back, BATCHES[1])), float(models.stacked_loss(after_one, BATCHES[1])), rtol=1e-5
    )


def test_without_reading_the_nnx_optimizer_trains_as_nnx_on_one_device(no_reading):
    """zj.nnx at stage 3 (LoRA, BatchNorm statistics and all), equal to nnx.Optimizer on one
    device (with momentum SGD: the bias before the BatchNorm has a gradient of rounding noise,
    which Adam would scale up to a step of the learning rate)."""
    data, tx = test_nnx.batches(), optax.sgd(0.1, momentum=0.9)
    ref, ref_losses = test_nnx.reference(test_nnx.Net(nnx.Rngs(0)), tx, nnx.Param, data)
    opt = zj.nnx.Optimizer(
        test_nnx.Net(nnx.Rngs(0)), tx, wrt=nnx.Param, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3)
    )
    step = zj.nnx.make_train_step(test_nnx.loss_fn)
    np.testing.assert_allclose([float(step(opt, b)["loss"]) for b in data], ref_losses, rtol=2e-5)
    assert test_nnx.max_diff(opt.gathered_model(), ref) <= 1e-5
    assert len(_off_warnings(no_reading)) == 1


def test_without_reading_what_needs_a_program_is_refused_with_the_fix(no_reading):
    from zerojax.models import llama

    cfg = llama.LlamaConfig(vocab=16, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8)
    graphdef, params = llama.init(cfg)
    tokens = jnp.zeros((8, 8), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    cases = [
        (zj.make_mesh(context=2), {"context": {"layout": "balanced"}}, r"context=\{'layout': 'contiguous'\}"),
        (zj.make_mesh(context=2, tensor=2), {}, r"tensor \(2\) and a context \(2\) axis.*one of the two"),
        (zj.make_mesh(), {"axes": {"model_axes": {"fsdp": "data"}}}, r"model_axes.*Remove the model's own sharding"),
    ]
    for mesh, extra, fix in cases:
        zc = zj.ZeroConfig(stage=3, **extra)
        state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=zc)
        step = zj.make_train_step(llama.make_loss(graphdef), optax.sgd(0.1), mesh=mesh, config=zc, with_layout=True)
        with pytest.raises(
            ProgramReadingRequired,
            match=rf"(?s)(?=.*needs zerojax to read)(?=.*ZEROJAX_NO_PROGRAM_READING=1 is set)(?=.*{fix})(?=.*or unset)",
        ):
            step(state, batch)
    layout = zj.context.Layout("balanced", 2)
    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ProgramReadingRequired, match=r"'balanced' layout.*contiguous layout"):
        zj.nn.dot_product_attention(q, q, q, layout=layout, mesh=zj.make_mesh(context=2))
