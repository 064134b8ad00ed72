"""Closed-form memory estimates: the paper's table, DeepSpeed's formulas, the CLI."""

import pytest

from zerojax.models import gpt
from zerojax.report import estimate


def test_paper_table_7_5b_on_64_devices():
    got = [round(estimate.paper_bytes(7.5e9, 64, s) / 1e9, 1) for s in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_zero2_t5_3b_on_8_gpus():
    """DeepSpeed's current code gives 11.28 GiB per GPU for t5-3b (2,851,598,336 params)."""
    est = estimate.deepspeed_bytes(2_851_598_336, 8, 2)
    assert est.gpu / 2**30 == pytest.approx(11.28, abs=0.01)
    off = estimate.deepspeed_bytes(2_851_598_336, 8, 2, offload="optimizer")
    assert off.gpu == 2 * 2_851_598_336 and off.cpu == 2_851_598_336 * 32 * 1.5


def test_deepspeed_zero3_largest_layer():
    est = estimate.deepspeed_bytes(1e9, 16, 3, largest_layer=5e7)
    assert est.gpu == 4 * 5e7 + 18 * 1e9 / 16
    assert estimate.deepspeed_bytes(1e9, 16, 3, largest_layer=5e7, offload="optimizer+params").gpu == 2e8
    with pytest.raises(ValueError, match="ZeRO-2 and ZeRO-3 only"):
        estimate.deepspeed_bytes(1e9, 16, 1)


@pytest.mark.parametrize("vocab,d_model", [(256, 128), (1000, 32), (64, 64)])
def test_model_shapes_count_like_the_experiments_gpt(vocab, d_model):
    """The closed-form shapes agree with the real model's parameter tree, counted module by
    module as DeepSpeed's model_to_params does (embedding/head vs the MLP's first linear)."""
    s = estimate.GPTShape(vocab=vocab, seq_len=64, d_model=d_model, n_layers=3)
    cfg = gpt.GPTConfig(vocab=s.vocab, seq_len=s.seq_len, d_model=s.d_model, n_layers=s.n_layers, n_heads=1)
    _, params = gpt.init_abstract(cfg)  # the model's shapes: nothing to build for a count
    assert estimate.from_params(params, stacked=["blocks"]) == (s.num_params(), s.largest_layer_params())
    assert s.num_params() == cfg.num_params()
    # Without the layer axis declared, a stacked module counts all its layers.
    assert estimate.from_params(params)[1] >= 3 * (4 * d_model * d_model + 4 * d_model)


def test_cli_prints_the_paper_table(capsys):
    """``zerojax estimate``, run in this process (test_cli runs the console script)."""
    from zerojax import cli

    assert cli.main(["estimate", "--params", "7.5e9", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert figure in out
    assert cli.main(["estimate", "--model", "gpt2-small", "--devices", "8"]) == 0
    assert "4 x largest layer" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        cli.main(["estimate", "--model", "nope", "--devices", "8"])
    assert bad.value.code == 2 and "unknown --model 'nope'" in capsys.readouterr().err
