"""The ``zerojax`` command line (launch, estimate, export, --version), loading exported
weights back (``zj.load_weights``) and the progress bars of long command-line work."""

import io
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from zerojax import cli, progress
from zerojax.report import estimate

SCRIPT = pathlib.Path(sys.executable).parent / "zerojax"  # the installed console script
GB = 1e9


# --- estimate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [
        ("7B", 7_000_000_000),
        ("1.5e9", 1_500_000_000),
        ("350M", 350_000_000),
        ("1.3b", 1_300_000_000),
        ("125k", 125_000),
        ("7.5e9", 7_500_000_000),
        ("7_000_000", 7_000_000),
        ("2T", 2 * 10**12),
        ("0.5K", 500),
    ],
)
def test_parameter_counts_parse(text, want):
    assert estimate.parse_count(text) == want


@pytest.mark.parametrize("bad", ["7X", "seven", "-5", "1.5", "0", "7__0", "1.2.3", "B"])
def test_a_bad_parameter_count_names_the_value_and_the_forms(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", "--params", bad, "--devices", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --params: {bad!r}" in err
    assert "7B" in err or "whole number" in err or "positive" in err


def table_rows(out: str) -> dict[int, list[str]]:
    """``{stage: [paper, deepspeed, zerojax]}`` cells of the printed table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if cells and cells[0].isdigit() and len(cells) == 4:
            rows[int(cells[0])] = cells[1:]
    return rows


def gb(b: float) -> str:
    return f"{b / GB:,.1f} GB"


@pytest.mark.parametrize(
    "dtype,optimizer,state_bytes",
    [("float32", "adam", 8), ("bfloat16", "adamw", 8), ("float16", "sgd", 0), ("float32", "adafactor", 0)],
)
def test_estimate_prints_zerojax_formula_beside_the_paper_and_deepspeed(dtype, optimizer, state_bytes, capsys):
    """The zerojax column is fp32 masters (4Ψ) + optimizer state (KΨ) + a replicated compute
    copy at stages 1-2 in bf16/fp16 (2Ψ), sharded as each stage shards; written out here."""
    psi, n = 7_500_000_000, 64
    assert (
        cli.main(["estimate", "--params", "7.5e9", "--devices", str(n), "--dtype", dtype, "--optimizer", optimizer])
        == 0
    )
    out = capsys.readouterr().out
    k = state_bytes
    if dtype == "float32":
        want = [(4 + k) * psi, 4 * psi + k * psi / n, 4 * psi + k * psi / n, (4 + k) * psi / n]
    else:
        want = [(4 + k) * psi, 2 * psi + (4 + k) * psi / n, 2 * psi + (4 + k) * psi / n, (4 + k) * psi / n]
    rows = table_rows(out)
    assert [rows[s][2] for s in range(4)] == [gb(b) for b in want]
    assert [rows[s][0] for s in range(4)] == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]  # the paper, unchanged
    assert [rows[s][1] for s in (2, 3)] == [gb(2 * psi + 18 * psi / n), gb(18 * psi / n)]  # DeepSpeed's formulas
    assert f"zerojax ({dtype}, {optimizer})" in out
    assert "ZeRO paper: mixed-precision Adam" in out and "K = 12" in out
    assert "DeepSpeed estimator: estimate_zero2/3_model_states_mem_needs" in out
    assert f"optimizer state {k} bytes per parameter" in out and "gradients are the step's temporaries" in out
    assert ("a replicated" in out) == (dtype != "float32")


def test_estimate_columns_agree_with_zero_formula_bytes():
    for stage in range(4):
        line = estimate.table(1e9, 16, compute_dtype="bfloat16").splitlines()[3 + stage]
        assert line.endswith(gb(zj.report.zero_formula_bytes(1e9, 16, stage, compute_dtype="bfloat16")))
    with pytest.raises(ValueError, match="optimizer must be one of adam, adamw, sgd, adafactor, got 'lion'"):
        estimate.table(1e9, 16, optimizer="lion")


# Published parameter counts (model cards / config.json of the released checkpoints).
PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_model_presets_give_the_published_parameter_counts(name):
    assert estimate.MODELS[name].num_params() == PUBLISHED[name]


def test_gpt_shapes_with_a_tied_head_give_gpt2s_published_counts():
    """GPT-2 small / XL as released (tied head): 124,439,808 and 1,557,611,200 parameters."""
    small = estimate.GPTShape(vocab=50257, seq_len=1024, d_model=768, n_layers=12, tied=True)
    xl = estimate.GPTShape(vocab=50257, seq_len=1024, d_model=1600, n_layers=48, tied=True)
    assert (small.num_params(), xl.num_params()) == (124_439_808, 1_557_611_200)
    assert estimate.MODELS["gpt3-175b"].num_params() / 1e9 == pytest.approx(175.0, abs=0.5)  # "175B"


def test_llama_shape_counts_a_real_llama_style_tree():
    """A small Llama-style parameter tree (GQA, SwiGLU, RMSNorm scales, untied head) built
    here, counted leaf by leaf, against LlamaShape's closed form."""
    V, d, L, H, KV, F = 97, 48, 3, 6, 2, 80
    hd = d // H
    layer = {
        "attn_norm": {"scale": (d,)},
        "q": {"kernel": (d, H * hd)},
        "k": {"kernel": (d, KV * hd)},
        "v": {"kernel": (d, KV * hd)},
        "o": {"kernel": (H * hd, d)},
        "mlp_norm": {"scale": (d,)},
        "gate": {"kernel": (d, F)},
        "up": {"kernel": (d, F)},
        "down": {"kernel": (F, d)},
    }
    tree = {"embed": {"embedding": (V, d)}, "layers": [layer] * L, "norm": {"scale": (d,)}, "head": {"kernel": (d, V)}}
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree, is_leaf=lambda x: isinstance(x, tuple))
    shape = estimate.LlamaShape(vocab=V, d_model=d, n_layers=L, n_heads=H, n_kv_heads=KV, d_ff=F)
    assert estimate.from_params(shapes) == (shape.num_params(), shape.largest_layer_params())
    with pytest.raises(ValueError, match="n_kv_heads 4 must divide n_heads 6"):
        estimate.LlamaShape(vocab=V, d_model=d, n_layers=L, n_heads=H, n_kv_heads=4, d_ff=F)


def test_estimate_model_preset(capsys):
    assert cli.main(["estimate", "--model", "llama3-8b", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    psi = PUBLISHED["llama3-8b"]
    assert "Ψ = 8,030,261,248 parameters" in out
    # DeepSpeed's ZeRO-3: 4 x largest layer (the 128256 x 4096 embedding) + 18Ψ/N.
    assert table_rows(out)[3][1] == gb(4 * 128256 * 4096 + 18 * psi / 8)
    assert table_rows(out)[3][2] == gb(12 * psi / 8)
    assert cli.main(["estimate", "--params", "1B", "--devices", "8", "--largest-layer", "50M"]) == 0
    assert table_rows(capsys.readouterr().out)[3][1] == gb(4 * 50e6 + 18e9 / 8)


def test_estimate_memory_tiers_follow_the_paper_split(capsys):
    """--offload ... --nvme: per device, bf16 Adam on llama3-8b over 8 devices: stages 1-2
    keep the 2Ψ compute copy on the device and the 4Ψ/N masters on the host, stage 3 its
    4Ψ/N masters on the device; the 8Ψ/N moments are on disk, twice while a step writes."""
    psi = PUBLISHED["llama3-8b"]
    assert (
        cli.main(
            ["estimate", "--model", "llama3-8b", "--devices", "8", "--dtype", "bfloat16"]
            + ["--offload", "optimizer", "--nvme", "--buffer-count", "3"]
        )
        == 0
    )
    out = capsys.readouterr().out.split("Memory tiers per device")[1]
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    rows = {int(c[0]): c[1:] for c in cells if c[0].isdigit()}
    assert (
        rows[1]
        == rows[2]
        == [gb(2 * psi), gb(4 * psi / 8), f"{gb(8 * psi / 8)} ({gb(16 * psi / 8)} while a step writes)"]
    )
    assert rows[3] == [gb(4 * psi / 8), gb(0), f"{gb(8 * psi / 8)} ({gb(16 * psi / 8)} while a step writes)"]
    assert "3 x 100,000,000 bytes = 0.3 GB per process" in out
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "1B", "--devices", "8", "--nvme"])
    assert "give --offload optimizer" in capsys.readouterr().err
    # --ratio r (a partial offload): r of what offloading moves (the masters kept apart and the
    # moments, 12Ψ/N at stages 1-2 in bf16; the 8Ψ/N moments at stage 3) stays in host memory.
    argv = ["estimate", "--model", "llama3-8b", "--devices", "8", "--dtype", "bfloat16", "--offload", "optimizer"]
    assert cli.main(argv + ["--ratio", "0.25"]) == 0
    out = capsys.readouterr().out.split("Memory tiers per device")[1]
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    rows = {int(c[0]): c[1:] for c in cells if c[0].isdigit()}
    assert rows[2] == [gb(2 * psi + 0.75 * 12 * psi / 8), gb(0.25 * 12 * psi / 8), gb(0)]
    assert rows[3] == [gb(4 * psi / 8 + 0.75 * 8 * psi / 8), gb(0.25 * 8 * psi / 8), gb(0)]
    assert cli.main(argv + ["--ratio", "0.25", "--nvme"]) == 0  # a quarter of the moments on disk
    out = capsys.readouterr().out.split("Memory tiers per device")[1]
    rows = {int(c[0]): c[1:] for c in (re.split(r"\s{2,}", x.strip()) for x in out.splitlines()) if c[0].isdigit()}
    assert rows[3][:2] == [gb(4 * psi / 8 + 0.75 * 8 * psi / 8), gb(0)] and rows[3][2].startswith(gb(2 * psi / 8))
    with pytest.raises(SystemExit):
        cli.main(argv[:-2] + ["--ratio", "0.5"])
    assert "--ratio must be in (0, 1], with --offload" in capsys.readouterr().err


# --- version and launch ----------------------------------------------------------------------


def test_version_and_launch_help_from_the_console_script(capsys):
    """The installed script starts (one interpreter); the launch help it prints is
    cli.main's, read in this process."""
    r = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"zerojax {zj.__version__}", r.stderr
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith("usage: zerojax launch") and "--nprocs N" in out
    assert "-- command [args...]" in out.splitlines()[0]
    # Every file the help names is one pip installs or a link: no experiments/ or docs/ path.
    import re

    assert not re.search(r"(?<!main/)\b(experiments|docs|tests)/", out), out
    assert "https://github.com/zerojax/zerojax/blob/main/docs/fault_tolerance.md" in out


def test_launch_runs_the_command_in_each_process(capsys):
    assert cli.main(["launch", "--nprocs", "2", "--", sys.executable, "-c", "print('hello')"]) == 0
    out = capsys.readouterr().out
    assert sorted(l for l in out.splitlines() if "hello" in l) == ["[rank 0] hello", "[rank 1] hello"]
    assert cli.main(["launch", "--nprocs", "1", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--nprocs", "2", sys.executable, "x.py"])
    assert e.value.code == 2 and "the command to run goes after --" in capsys.readouterr().err


# --- export and load_weights -----------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(13, 24, rngs=rngs)
        self.l2 = nnx.Linear(24, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


BATCH = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(16, 13)), jnp.float32), "y": jnp.ones((16, 3))}


@pytest.fixture(scope="module")
def nnx_run(tmp_path_factory):
    """An NNX model trained a step with ZeRO-3 and saved: (graphdef, params, state, checkpoint dir)."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

    tx, mesh, cfg = optax.adamw(1e-2), zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    state, _ = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)(state, BATCH)
    ckpt = tmp_path_factory.mktemp("nnx") / "ckpt"
    zj.save_checkpoint(ckpt, state, step=1, wait=True)
    return graphdef, params, state, ckpt


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nnx_export_loads_back_exactly_and_updates_a_model(nnx_run, tmp_path):
    graphdef, params, state, ckpt = nnx_run
    out = tmp_path / "w.safetensors"
    zj.export_weights(ckpt, out)
    loaded = zj.load_weights(out, like=params)
    assert isinstance(loaded, nnx.State)
    trained = zj.gather_params(state)
    assert_trees_equal(loaded, trained)
    assert not np.array_equal(np.asarray(loaded["l1"]["kernel"][...]), np.asarray(params["l1"]["kernel"][...]))
    model = MLP(nnx.Rngs(7))  # other weights, then the exported ones
    nnx.update(model, loaded)
    assert_trees_equal(nnx.state(model, nnx.Param), trained)
    np.testing.assert_array_equal(np.asarray(model(BATCH["x"])), np.asarray(nnx.merge(graphdef, trained)(BATCH["x"])))
    # Abstract shapes work as `like` too (nnx.eval_shape: nothing allocated).
    abstract = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))), nnx.Param)[1]
    assert_trees_equal(zj.load_weights(out, like=abstract), trained)


def test_cli_exports_float16_and_it_loads_cast_to_like(nnx_run, tmp_path, capsys):
    _, params, state, ckpt = nnx_run
    out = tmp_path / "w16.safetensors"
    assert cli.main(["export", str(ckpt), str(out), "--dtype", "float16"]) == 0
    captured = capsys.readouterr()
    n = sum(x.size for x in jax.tree.leaves(params))
    assert f"wrote 4 tensors, {n:,} parameters (float16)" in captured.out
    assert captured.err == ""  # no progress bar off a terminal
    from safetensors.numpy import load_file

    raw = load_file(out)
    assert {k: v.dtype for k, v in raw.items()} == {
        k: np.dtype("float16") for k in ("l1.kernel", "l1.bias", "l2.kernel", "l2.bias")
    }
    loaded = zj.load_weights(out, like=params)  # float32 leaves: the float16 values, widened
    want = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32), zj.gather_params(state))
    assert_trees_equal(loaded, want)


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert cli.main(["export", str(missing), str(tmp_path / "w.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err == f"zerojax export: checkpoint directory {str(missing)!r} does not exist.\n"
    assert not missing.exists()  # not created by looking


def test_float16_export_refuses_values_beyond_its_range(tmp_path):
    params = {"big": jnp.full((4,), 1e5, jnp.float32), "ok": jnp.ones((3,))}
    state = zj.init_state(params, optax.sgd(0.1), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1))
    zj.save_checkpoint(tmp_path / "ck", state, step=0, wait=True)
    with pytest.raises(
        ValueError,
        match=r"parameter 'big' has values up to 1e\+05, beyond float16's range "
        r"\(65504\); export in bfloat16",
    ):
        zj.export_weights(tmp_path / "ck", tmp_path / "w.safetensors", dtype="float16")
    assert not list(tmp_path.glob("*.safetensors*")) and not list(tmp_path.glob(".*"))  # not a byte written
    zj.export_weights(tmp_path / "ck", tmp_path / "w.safetensors", dtype="bfloat16")


def test_linen_export_loads_back_exactly(tmp_path):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(24)(x)))

    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((1, 13)))["params"]

    def loss_fn(p, b):
        return jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    tx, mesh, cfg = optax.adam(1e-2), zj.make_mesh(), zj.ZeroConfig(stage=2, compute_dtype="bfloat16")
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    state, _ = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)(state, BATCH)
    zj.save_checkpoint(tmp_path / "ck", state, step=1, wait=True)
    zj.export_weights(tmp_path / "ck", tmp_path / "w.safetensors")
    loaded = zj.load_weights(tmp_path / "w.safetensors", like=params)
    assert_trees_equal(loaded, zj.gather_params(state))
    # bf16 leaves in `like`: the bf16 rounding of the fp32 masters.
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert_trees_equal(
        zj.load_weights(tmp_path / "w.safetensors", like=half),
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), zj.gather_params(state)),
    )


def test_load_weights_names_every_missing_extra_and_misshapen_tensor(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "w.safetensors"
    save_file(
        {
            "a.w": np.ones((2, 3), np.float32),
            "a.b": np.ones((3,), np.float32),
            "old.w": np.ones((1,), np.float32),
            "old.b": np.ones((1,), np.float32),
        },
        str(path),
    )
    like = {
        "a": {"w": np.zeros((3, 2), np.float32), "b": np.zeros((3,), np.float32)},
        "new": {"w": np.zeros((1,), np.float32)},
        "bias": np.zeros((1,), np.float32),
    }
    with pytest.raises(ValueError) as e:
        zj.load_weights(path, like=like)
    msg = str(e.value)
    assert "missing from the checkpoint (2): bias, new.w" in msg
    assert "in the checkpoint but read by no parameter (2): old.b, old.w" in msg
    assert "shapes differ (1): a.w [3, 2] in the model, [2, 3] from a.w [2, 3]" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zj.load_weights(tmp_path / "nope.safetensors", like=like)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        zj.load_weights(tmp_path / "junk.safetensors", like=like)
    ok = zj.load_weights(
        path,
        like={
            "a": {"w": np.zeros((2, 3), np.float16), "b": jnp.zeros((3,))},
            "old": {"w": jax.ShapeDtypeStruct((1,), jnp.bfloat16), "b": np.zeros(1)},
        },
    )
    assert isinstance(ok["a"]["w"], np.ndarray) and ok["a"]["w"].dtype == np.float16
    assert isinstance(ok["a"]["b"], jax.Array) and ok["a"]["b"].dtype == jnp.float32
    assert isinstance(ok["old"]["w"], jax.Array) and ok["old"]["w"].dtype == jnp.bfloat16
    assert ok["old"]["b"].dtype == np.float64 and float(ok["old"]["w"][0]) == 1.0


# --- progress ------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert progress.quiet()  # captured by pytest: not a terminal
    assert list(progress.progress(iter("abc"), "quiet", total=3)) == ["a", "b", "c"]
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert not progress.quiet()
    assert list(progress.progress(range(5), "work", unit="config")) == [0, 1, 2, 3, 4]
    assert "work" in term.getvalue() and "5/5" in term.getvalue()
    monkeypatch.setenv("CI", "true")
    assert progress.quiet()
    before = term.getvalue()
    assert list(progress.progress(range(2), "ci")) == [0, 1] and term.getvalue() == before
    monkeypatch.setenv("CI", "0")
    assert not progress.quiet()


# --- autotune's command line -----------------------------------------------------------------


def test_every_autotune_option_says_what_it_does():
    from zerojax.tuning.command import parser

    silent = [a.option_strings or a.dest for a in parser()._actions if not a.help]
    assert not silent, silent


@pytest.mark.parametrize("name", [k for k in estimate.MODELS if k.startswith(("llama", "mistral"))])
def test_autotune_builds_the_llama_presets_estimate_counts(name):
    """`zerojax autotune --model NAME` takes every Llama preset of `zerojax estimate` and
    builds zerojax.models' Llama with exactly the parameters the estimate counts."""
    import argparse

    import jax

    from zerojax.report.estimate import MODELS
    from zerojax.tuning.command import LLAMA_SEQ_LEN, _model, parser

    args = parser().parse_args(["--model", name, "--memory", "80GiB"])
    loss_fn, params, tx, batch, base, what = _model(args, argparse.ArgumentParser(), 8)
    assert sum(x.size for x in jax.tree.leaves(params)) == MODELS[name].num_params()
    assert batch["tokens"].shape == (8, LLAMA_SEQ_LEN + 1) and f"Llama ({name})" in what
    assert base == zj.ZeroConfig()


def test_autotune_tunes_a_llama_preset_from_the_command_line(capsys):
    argv = ["autotune", "--model", "llama3.2-1b", "--d-model", "64", "--layers", "2", "--vocab", "128"]
    argv += ["--heads", "8", "--seq-len", "16", "--memory", "1GiB", "--stages", "3", "--remat", "none"]
    argv += ["--offload", "none", "--prefetch", "0", "--accum", "1", "--device", "h100", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Llama (llama3.2-1b) d_model 64, 2 layers, 8 heads (8 key/value)" in out
    assert "best: zj.ZeroConfig(stage=3" in out
    with pytest.raises(SystemExit):
        cli.main(["autotune", "--model", "llama9-1t", "--memory", "1GiB"])
    assert "unknown --model 'llama9-1t'" in capsys.readouterr().err
