"""The tests (conftest.py) and the autotuner compile CPU programs at
``xla_backend_optimization_level=0``. What the tests and the tuner read must be the same at
XLA's default level 3: the optimised HLO (collectives, fusion, loops), memory_analysis(),
cost_analysis(), the communication report; and results to rounding.

Where the jaxlib has it, the tests (not the tuner) also compile with XLA:CPU's older fusion
code generator (``--xla_cpu_use_fusion_emitters=false``). It forms other fusions, so less
stays equal, and the tests read nothing of what changes: the collectives,
memory_analysis(), flops and results to rounding stay; the HLO text and the bytes
cost_analysis() counts do not."""

import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import models
from zerojax.report import hlo
from zerojax.tuning import search
from zerojax.tuning.cost import step_cost

LEVELS = (0, 3)
EMITTERS = "xla_cpu_use_fusion_emitters"  # conftest.py sets it false where the jaxlib knows it
CASES = {
    "stage3-scan-accum2-adam": dict(stage=3, grad_accum_steps=2),
    "stage2-fp16-dynamic": dict(stage=2, compute_dtype="float16", loss_scaling={"initial_scale_power": 8}),
    "stage1-bf16": dict(stage=1, compute_dtype="bfloat16"),
}


# stage 1 bf16 in the slow set: the narrow compute copy compiles in the fp16 case too.
@pytest.fixture(scope="module", params=models.marked_slow(CASES, slow=["stage1-bf16"]))
def programs(request):
    """One step lowered once, compiled at both levels, run once from the same state; the
    lowered step, state and batch for compiling it otherwise."""
    mesh, tx = zj.make_mesh(), optax.adam(1e-3)
    cfg = zj.ZeroConfig(donate=False, **CASES[request.param])
    loss, params = (
        (models.stacked_loss, models.stacked_params())
        if "scan" in request.param
        else (models.mlp_loss, models.mlp_params())
    )
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    batch = models.batch(32, 0)
    lowered = zj.make_train_step(loss, tx, mesh=mesh, config=cfg).lower(state, batch)
    out = {}
    for level in LEVELS:
        compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": level})
        new_state, metrics = compiled(state, batch)
        out[level] = (compiled, zj.gather_params(new_state), metrics)
    return request.param, mesh, out, (lowered, state, batch)


def test_hlo_is_the_same(programs):
    _, _, out, _ = programs
    texts = [out[level][0].as_text() for level in LEVELS]
    assert texts[0] == texts[1]
    assert hlo.parse(texts[0]).runs  # a program the reader reads


def test_memory_cost_and_collectives_are_the_same(programs):
    _, mesh, out, _ = programs
    (a, *_), (b, *_) = out[0], out[3]
    assert zj.report.compiled_bytes(a) == zj.report.compiled_bytes(b)
    assert step_cost(a, mesh) == step_cost(b, mesh)
    assert zj.report.communication_report(a, mesh=mesh) == zj.report.communication_report(b, mesh=mesh)


def test_results_agree_to_rounding(programs):
    name, _, out, _ = programs
    (_, p0, m0), (_, p3, m3) = out[0], out[3]
    rtol = 1e-5 if "fp16" not in name else 1e-3  # float16 compute rounds to 2^-11
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p3)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * 1e-2)
    assert float(m0["loss"]) == pytest.approx(float(m3["loss"]), rel=rtol)
    assert int(m0["skipped"]) == int(m3["skipped"])


def test_the_older_fusion_emitter_keeps_what_the_tests_read(programs):
    name, mesh, _, (lowered, state, batch) = programs

    def compile_with(emitters: bool):
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0, EMITTERS: emitters})

    try:
        older = compile_with(False)
    except Exception as e:  # this jaxlib has no older emitter: conftest.py must not ask for it
        assert f"No such compile option: '{EMITTERS}'" in str(e)
        assert EMITTERS not in os.environ.get("XLA_FLAGS", "")
        return
    if os.environ.get("ZEROJAX_TEST_FULL_OPT") != "1":  # the jaxlib has it: conftest.py set it (or you did)
        assert EMITTERS in os.environ.get("XLA_FLAGS", "")
    newer = compile_with(True)
    assert zj.report.compiled_bytes(older) == zj.report.compiled_bytes(newer)
    assert zj.report.communication_report(older, mesh=mesh) == zj.report.communication_report(newer, mesh=mesh)
    a, b = step_cost(older, mesh), step_cost(newer, mesh)
    assert (a.flops, a.traffic, a.matmuls, a.matmul_shapes) == (b.flops, b.traffic, b.matmuls, b.matmul_shapes)
    (p_old, m_old), (p_new, m_new) = older(state, batch), newer(state, batch)
    rtol = 1e-5 if "fp16" not in name else 1e-3
    for x, y in zip(jax.tree.leaves(zj.gather_params(p_old)), jax.tree.leaves(zj.gather_params(p_new))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * 1e-2)
    assert float(m_old["loss"]) == pytest.approx(float(m_new["loss"]), rel=rtol)


def test_tuner_and_tests_compile_at_level_0():
    mesh = zj.make_mesh()
    assert search._compile_options(mesh) == {"compiler_options": {"xla_backend_optimization_level": 0}}
    full = os.environ.get("ZEROJAX_TEST_FULL_OPT") == "1"  # conftest.py's opt-out
    assert zj.compile_cache.optimization_level() == (3 if full else 0)
