"""Ahead-of-time memory: the abstract state and the compiled step, before any array exists."""

import jax
import optax
import pytest

import zerojax as zj
from zerojax import data
from zerojax.models import gpt


@pytest.mark.parametrize(
    "stage,dtype",
    [
        (0, "float32"),
        pytest.param(3, "float32", marks=pytest.mark.slow),
        (3, "bfloat16"),
        pytest.param(1, "float16", marks=pytest.mark.slow),
        pytest.param(1, "float32", marks=pytest.mark.slow),
        pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_abstract_step_memory_equals_the_real_one(stage, dtype):
    """step_memory from shapes alone = memory_analysis of the step compiled on real arrays,
    and its state figure = the bytes the real state's shards hold."""
    cfg = gpt.GPTConfig(n_layers=2, d_model=64, n_heads=2)
    graphdef, params = gpt.init(cfg)
    loss_fn, tx, mesh = gpt.make_loss(graphdef), optax.adamw(1e-3), zj.make_mesh()
    zc = zj.ZeroConfig(stage=stage, compute_dtype=dtype)
    batch = next(data.windows(data.stdlib_bytes(1 << 16), 16, cfg.seq_len))

    _, abstract_params = gpt.init_abstract(cfg)
    tokens = jax.ShapeDtypeStruct(batch["tokens"].shape, batch["tokens"].dtype)
    mem = zj.report.step_memory(loss_fn, abstract_params, tx, {"tokens": tokens}, mesh=mesh, config=zc)

    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    real = zj.report.compiled_bytes(zj.make_train_step(loss_fn, tx, mesh=mesh, config=zc).lower(state, batch).compile())
    assert mem.state == zj.report.state_bytes_per_device(state)["total"]
    assert mem.batch == batch["tokens"].nbytes // 8
    for key in ("argument", "output", "alias", "temp", "total"):
        assert getattr(mem, key) == real[key], key
    assert mem.argument == mem.state + mem.batch
    assert zj.report.state_bytes_per_device(
        zj.abstract_state(abstract_params, tx, mesh=mesh, config=zc)
    ) == zj.report.state_bytes_per_device(state)


def test_plans_a_model_larger_than_this_machine():
    """A 4.3B-parameter GPT (51 GiB of fp32 Adam state at stage 0, more than the machine's
    RAM) is compiled for stage 3 on 8 devices without allocating it: its state is 12Ψ/N."""
    cfg = gpt.GPTConfig(vocab=50304, seq_len=256, d_model=3072, n_layers=36, n_heads=24)
    psi = cfg.num_params()
    assert psi > 4e9
    graphdef, abstract_params = gpt.init_abstract(cfg)
    tokens = jax.ShapeDtypeStruct((8, cfg.seq_len + 1), "int32")
    mem = zj.report.step_memory(
        gpt.make_loss(graphdef),
        abstract_params,
        optax.adamw(1e-4),
        {"tokens": tokens},
        mesh=zj.make_mesh(),
        config=zj.ZeroConfig(stage=3, compute_dtype="bfloat16"),
    )
    assert mem.state == pytest.approx(zj.report.zero_formula_bytes(psi, 8, 3), rel=1e-4)
    # Stage 3 gathers a layer at a time: a device needs less than the fp32 params alone.
    assert mem.total < 4 * psi
    assert not mem.fits(mem.total - 1) and mem.fits(mem.total)


def test_batch_that_does_not_divide_is_refused_before_compiling():
    params = {"w": jax.ShapeDtypeStruct((64, 64), "float32")}
    with pytest.raises(ValueError, match="leading dimension 12"):
        zj.report.step_memory(
            lambda p, x: (x @ p["w"]).mean(),
            params,
            optax.sgd(0.1),
            jax.ShapeDtypeStruct((12, 64), "float32"),
            mesh=zj.make_mesh(),
            config=zj.ZeroConfig(stage=3),
        )
