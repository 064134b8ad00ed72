"""The experiment scripts run and their numbers agree with independent references."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import zerojax as zj
from zerojax.models import gpt

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: float = 600, full_opt: bool = False) -> subprocess.CompletedProcess:
    """Runs an experiment script. ``full_opt``: with XLA's default CPU code generation, for
    scripts that run hundreds of steps, where a step's speed outweighs its compile
    (conftest.py turns LLVM's optimisation off for the tests)."""
    env = dict(os.environ)
    if full_opt:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_flops_per_token_matches_the_compiled_program():
    """The MFU numerator against XLA's own count (one layer, so no loop is undercounted):
    the compiled step has the matmul FLOPs plus a little elementwise work."""
    for d, t, v in [(256, 128, 1024)]:
        cfg = gpt.GPTConfig(d_model=d, n_layers=1, n_heads=d // 64, seq_len=t, vocab=v)
        graphdef, params = gpt.init(cfg)
        tokens = np.zeros((4, t + 1), np.int32)
        compiled = jax.jit(jax.grad(gpt.make_loss(graphdef))).lower(params, {"tokens": tokens}).compile()
        ratio = compiled.cost_analysis()["flops"] / (4 * t) / cfg.flops_per_token()
        assert 1.0 < ratio < 1.03, (d, ratio)


@pytest.mark.slow  # reason: a script in a fresh process; test_state's test_bytes_match_formula
def test_memory_table_within_two_percent_and_draws_the_chart(tmp_path):
    png = tmp_path / "memory.png"
    out = run_script("memory_table.py", "--sizes", "64x2,128x3", "--png", str(png))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| d")]
    assert len(rows) == 8
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        arrays, compiled = float(cells[3].split()[0]), float(cells[4].split()[0])
        formula = float(cells[5].split("=")[1].split()[0])
        assert arrays == compiled  # the arrays and memory_analysis agree to the printed digit
        assert abs(arrays - formula) <= 0.02 * formula, line
    assert is_png(png)


@pytest.mark.slow  # reason: a script in a fresh process; test_compiled's test_collectives_match_zero_formulas
def test_comm_volumes_match_the_paper():
    out = run_script("comm.py", "--layers", "2", "--d-model", "64", "--dtypes", "float32,bfloat16")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.stdout.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
    assert len(rows) == 8
    cfg = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=1)
    graphdef, params = gpt.init(cfg)
    psi = cfg.num_params()
    # Stage 3's backward re-gathers only what backward needs: an embedding's or a bias's
    # gradient does not read the parameter's value, so those move twice, not three times.
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    unread = sum(
        x.size for path, x in flat if any(k in jax.tree_util.keystr(path) for k in ("bias", "embedding", "wpe"))
    )
    for stage, dtype, _, volume, paper, *_, asked, _ in rows:
        got = float(volume.rstrip("Ψ"))
        if stage == "3":
            assert got == pytest.approx((3 * psi - unread) / psi, abs=1e-3), (got, unread / psi)
            assert paper == "3Ψ"
        else:
            assert got == pytest.approx(2.0, abs=1e-3)
            assert paper == "2Ψ"
        if stage in ("1", "2", "3"):
            want = "all-gather bf16" if dtype == "bfloat16" else "all-gather f32"
            assert want in asked and "reduce-scatter f32" in asked, asked


@pytest.mark.slow  # reason: 16 s, a script in its own process; the step it drives is tested in the default set
def test_train_script_logs_json_lines_and_the_loss_falls(tmp_path):
    log, png = tmp_path / "run.jsonl", tmp_path / "run.png"
    out = run_script(
        "train.py",
        "--stage",
        "3",
        "--precision",
        "bf16",
        "--steps",
        "40",
        "--batch",
        "16",
        "--d-model",
        "64",
        "--layers",
        "2",
        "--heads",
        "2",
        "--eval-every",
        "20",
        "--dropout",
        "0.1",
        "--log",
        str(log),
        "--plot",
        str(png),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["kind"] == "config" and records[0]["stage"] == 3 and records[0]["n_devices"] == 8
    assert records[0]["dropout"] == 0.1
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 41))
    assert [r["step"] for r in evals] == [20, 40]
    first, last = np.mean([r["loss"] for r in train[:5]]), np.mean([r["loss"] for r in train[-5:]])
    assert last < first - 1.0, (first, last)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(r["tokens_per_s"] > 0 and "skipped_steps" not in r for r in train)  # bf16: no loss scaling
    assert train[0]["learning_rate"] == 0.0 and max(r["learning_rate"] for r in train) == pytest.approx(3e-3)
    assert "step/s" in out.stderr or "s/step" in out.stderr  # the progress bar
    assert is_png(png)


def test_train_script_refuses_a_batch_that_does_not_divide():
    out = run_script("train.py", "--batch", "30", "--devices", "8", "--steps", "1")
    assert out.returncode == 2 and "--batch 30 must be a multiple of --devices x --accum = 8" in out.stderr


@pytest.mark.slow  # reason: a script in a fresh process; its property's only check: CI runs the slow set
def test_gpu_throughput_script_runs_on_cpu(tmp_path):
    out_json = tmp_path / "tp.json"
    out = run_script(
        "gpu_throughput.py",
        "--d-model",
        "64",
        "--layers",
        "2",
        "--heads",
        "1",
        "--seq-len",
        "32",
        "--vocab",
        "256",
        "--batch",
        "4",
        "--steps",
        "2",
        "--remat",
        "full",
        "--peak-tflops",
        "1",
        "--json",
        str(out_json),
        "--long-seqs",
        "128,256",
        "--long-heads",
        "2",
        "--long-block",
        "32",
        *("--attn-seq", "128", "--attn-d-model", "64", "--attn-layers", "1", "--attn-heads", "2"),
        *("--attn-d-ff", "96", "--attn-vocab", "128"),
        # The monitor-overhead table's three loops run two steps each: its timings are not
        # asserted here (20 steps per loop time them on a GPU); test_monitor tests the monitor.
        *("--monitor-steps", "2"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_json.read_text())
    # The pipeline table: P=2 beside P=1 on the simulated devices; P=4 does not divide 2 layers.
    got = [(r["P"], r["schedule"], r["M"], r["R"]) for r in result["pipeline"]]
    assert got == [(1, "gpipe", 1, 1), (2, "gpipe", 4, 1), (2, "circular", 2, 1)]  # 2 layers: one round
    assert all(r["tokens_per_s"] > 0 for r in result["pipeline"])
    assert "pipeline P=4: needs 4 devices dividing the host's" in out.stdout
    # The model-attention table: on the CPU the fused default is the einsum path, and the
    # compiled steps say so; the two steps compute the same loss.
    attn = {r["attention"]: r for r in result["model_attention"]}
    assert set(attn) == {"einsum", "fused"} and all(r["ran"] == ["einsum"] for r in attn.values()), attn
    assert attn["fused"]["loss"] == attn["einsum"]["loss"] and attn["fused"]["temp_bytes"] > 0
    # The long-context table: JAX's attention and the chunked one at each length (cuDNN is
    # not on the CPU backend, and says so); the chunked program holds one chunk's logits
    # (128 x 32 per head), XLA's the whole square.
    long = {(r["seq"], r["impl"]): r for r in result["long_context"]}
    assert set(long) == {(s, i) for s in (128, 256) for i in ("xla", "cudnn", "zerojax chunked")}
    assert "error" in long[(128, "cudnn")] and all(
        "error" not in long[(s, i)] for s in (128, 256) for i in ("xla", "zerojax chunked")
    )
    grow = lambda impl: long[(256, impl)]["temp_bytes"] / long[(128, impl)]["temp_bytes"]
    assert grow("zerojax chunked") < 2.3 < 3.0 < grow("xla"), (
        grow("zerojax chunked"),
        grow("xla"),
    )  # linear against quadratic
    rows = result["rows"]
    assert [(r["stage"], r["remat"], r["prefetch"], r["offload"]) for r in rows] == [
        (0, "full", 0, "none"),
        (3, "full", 0, "none"),
        (3, "full", 1, "none"),
        (3, "full", 0, "optimizer"),
        (3, "full", 0, "optimizer-device"),
        (3, "full", 0, "params"),
        (3, "full", 0, "ratio0.5"),
    ]
    # The offload rows: state bytes from the arrays, split as the formulas say.
    psi = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=1, seq_len=32, vocab=256).num_params()
    by = {r["offload"]: r for r in rows[1:] if r["prefetch"] == 0}
    assert [by[o]["update"] for o in ("optimizer", "optimizer-device", "params")] == ["host", "device", "host"]
    assert by["none"]["state_host"] == 0 and by["params"]["state_device"] < 64
    for o, kw in (("optimizer", {}), ("params", {"offload_params": True})):
        want = zj.report.zero_formula_bytes(psi, 1, 3, offload_optimizer=True, memory="host", **kw)
        assert want <= by[o]["state_host"] <= 1.03 * want + 64
        assert by[o]["state_device"] + by[o]["state_host"] == by["none"]["state_device"]
    # The partial offload's row: at least half of the optimizer state in host memory, the rest on the device.
    half = by["ratio0.5"]
    assert 0.5 * by["optimizer"]["state_host"] <= half["state_host"] < by["optimizer"]["state_host"]
    assert half["state_device"] + half["state_host"] == by["none"]["state_device"]
    assert "--xla_gpu_enable_pipelined_all_gather=true" in result["xla_flags"]
    # The offload check runs too; on the CPU backend it reports, as it must, no host bytes.
    assert set(result["remat_offload"]["rows"]) == {"none", "names", "offload_names", "dots_no_batch", "offload_dots"}
    failures = result["remat_offload"]["failures"]
    assert {
        "offload_names: no bytes in host memory (host temp 0)",
        "offload_dots: no bytes in host memory (host temp 0)",
    } <= set(failures), failures
    cfg = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=1, seq_len=32, vocab=256)
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_s"])
        assert r["mfu"] == pytest.approx(cfg.flops_per_token() * r["tokens_per_s"] / 1e12)
        assert np.isfinite(r["loss"])


@pytest.mark.slow  # reason: a fresh process searching depths; its property's only check: CI runs the slow set
def test_scaling_stage3_trains_a_larger_model_within_the_budget(tmp_path):
    out = run_script(
        "scaling.py",
        # The smallest budget and cap at which every stage's depth differs as claimed (2, 4,
        # 7 and the cap of 10 layers): a deeper stage-3 model compiles and trains for nothing.
        "--budget-mib",
        "3",
        "--d-model",
        "64",
        "--steps",
        "2",
        "--time-steps",
        "2",
        "--max-layers",
        "10",
        "--json",
        str(tmp_path / "scaling.json"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "scaling.json").read_text())
    budget, largest = res["budget_bytes"], [res["largest"][str(s)] for s in range(4)]
    for r in largest:
        assert r["total"] <= budget  # fits
        assert r["next"] is None or r["next"] > budget  # one more layer would not
        assert all(np.isfinite(r["losses"])) and len(r["losses"]) == 2
    layers = [r["layers"] for r in largest]
    assert layers[3] > layers[1] >= layers[0] and layers[3] >= 2 * layers[0], layers
    # Stage 3 holds 12Ψ/N of state: the arrays say so for the largest model too.
    cfg = gpt.GPTConfig(d_model=64, n_layers=layers[3], n_heads=1)
    assert largest[3]["state_arrays"] == pytest.approx(12 * cfg.num_params() / 8, rel=0.01)
    assert res["times"]["0"] > 0 and len(res["times"]) == 4


@pytest.mark.slow  # a script's table: once per CI run (the engine it measures is tested on every JAX)
def test_fits_compiles_for_a_larger_mesh_than_the_tests_use():
    """16 simulated devices in a fresh process: the compiled state is the formula's, and the
    budget answer follows the compiled total."""
    out = run_script(
        "fits.py",
        "--model",
        "gpt-tiny",
        "--devices",
        "16",
        "--stages",
        "0,3",
        "--precision",
        "fp32",
        "--budget-gib",
        "0.01",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "N = 16 cpu devices" in out.stdout
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.stdout.splitlines()
        if line.startswith("| 0 ") or line.startswith("| 3 ")
    ]
    assert len(rows) == 2
    mib = lambda cell: float(cell.split()[0].replace(",", "")) * (1024 if cell.endswith("GiB") else 1)
    for _, _, formula, state, _, total, fits in rows:
        assert mib(state) == pytest.approx(mib(formula), rel=0.02)
        assert fits == ("yes" if mib(total) <= 0.01 * 1024 else "no")
    assert [r[-1] for r in rows] == ["no", "yes"]


@pytest.mark.slow  # a script's table: once per CI run (the engine it measures is tested on every JAX)
def test_stage_table_numbers(capsys):
    """The table of docs/stages.md: state = formula (byte-level vocabulary and widths that
    divide 8: no padding), the traffic of each stage, the collectives that carry it, and
    stage 2's temporaries below stage 1's by most of a gradient."""
    from experiments import stage_table

    rows = {r["stage"]: r for r in stage_table.main(["--layers", "2", "--d-model", "64", "--batch", "8"])}
    out = capsys.readouterr().out
    assert out.count("\n| ") == 5  # header + 4 stages
    psi = rows[0]["psi"]
    for r in rows.values():
        assert r["state"] == r["formula"] + 12  # + step, skipped, Adam's count
    assert [round(rows[s]["traffic"], 3) for s in (0, 1, 2)] == [2.0, 2.0, 2.0]
    # Stage 3: 3Ψ less what backward does not re-gather (embedding, position table and
    # biases: their gradients do not read the parameter).
    _, params = gpt.init(gpt.GPTConfig(d_model=64, n_layers=2, n_heads=1))
    unread = sum(
        x.size
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if any(k in jax.tree_util.keystr(path) for k in ("bias", "embedding", "wpe"))
    )
    assert rows[3]["traffic"] == pytest.approx((3 * psi - unread) / psi, abs=1e-3)
    kinds = {
        s: {k.split(":")[0] for k, v in rows[s]["report"].items() if k != "total" and v["bytes"] > 4e-3 * psi}
        for s in rows
    }
    assert kinds == {
        0: {"all-reduce"},
        1: {"reduce-scatter", "all-gather"},
        2: {"reduce-scatter", "all-gather"},
        3: {"reduce-scatter", "all-gather"},
    }
    assert rows[1]["temp"] - rows[2]["temp"] > 0.6 * 4 * psi


@pytest.mark.slow  # a script's table: once per CI run (the engine it measures is tested on every JAX)
def test_optimizer_view_costs(capsys):
    """The exact path's cost, measured against a twin of a width that divides 8: a leaf
    split in its own shape costs only its padding; a flat one is all-gathered for the
    update (master, gradient, two Adam moments: 4Ψ of it at stage 3, 3Ψ at stage 1, where
    the gathered update doubles as the new replicated copy) and holds at most about 3 full
    copies of itself in temporaries (3.2 with jax 0.10's CPU buffer assignment, 3.4 with
    jax 0.12's: the bound is the larger)."""
    from experiments import optimizer_view

    rows = {(r["stage"], r["width"]): r for r in optimizer_view.main(["--widths", "120,121,400,401", "--layers", "2"])}
    assert rows[(3, 121)]["kind"] == "flat" and rows[(3, 401)]["kind"] == "dim" and rows[(3, 120)]["kind"] == "dim"
    for r in rows.values():
        assert 1.0 <= r["state"] / r["formula"] <= 1.03, r
        if r["width"] % 8 == 0:
            assert r["state"] == r["formula"]
    for stage, extra in ((1, 3.0), (3, 4.0)):
        div, flat, padded = rows[(stage, 120)], rows[(stage, 121)], rows[(stage, 401)]
        assert flat["all_gather"] == pytest.approx(div["all_gather"] + extra, abs=0.02)
        assert padded["all_gather"] == pytest.approx(rows[(stage, 400)]["all_gather"], rel=0.02)
        full = 4 * flat["psi"]
        assert flat["temp"] - div["temp"] * flat["psi"] / div["psi"] <= 3.5 * full
    assert "| 3 | 121 | flattened, padded by 7 |" in capsys.readouterr().out


@pytest.mark.slow  # reason: four GPT trainings in-process; test_training_loops' test_frozen_bytes_follow_the_formula
def test_lora_fine_tune_memory_follows_the_formula():
    from experiments import lora

    rows = lora.main(["--d-model", "64", "--layers", "2", "--rank", "4", "--steps", "6", "--stages", "0,3"])
    by = {(r["stage"], r["run"]): r for r in rows}
    for r in rows:
        assert r["state"] == pytest.approx(r["formula"] + 12, abs=64)  # + the int32 counters
        assert r["loss_last"] < r["loss_first"]
    assert by[(3, "LoRA")]["state"] < by[(3, "full")]["state"] / 3
    assert by[(0, "LoRA")]["psi_t"] < 0.1 * by[(0, "LoRA")]["psi_f"]


@pytest.mark.slow  # a script's table: once per CI run (the engine it measures is tested on every JAX)
def test_prefetch_script_structure(capsys):
    """The script's compiled-program columns: with prefetch every gather in the layer loops
    is independent of the loops' matmuls, without it they are not; each layer is gathered
    once per direction, as with full remat."""
    from experiments import prefetch

    rows = {
        (r["run"], r["remat"]): r
        for r in prefetch.main(["--d-model", "64", "--layers", "6", "--batch", "8", "--repeats", "1"])
    }
    for key in (("3, prefetch 1", "none"), ("3, prefetch 2", "none")):
        assert rows[key]["independent"] == rows[key]["pairs"] > 0
        assert rows[key]["gathers"] == rows[("3", "full")]["gathers"]
    assert rows[("3", "none")]["independent"] < rows[("3", "none")]["pairs"]
    assert all(r["vs_stage0"] > 0 for r in rows.values())
    assert "| 3, prefetch 1 | none |" in capsys.readouterr().out


@pytest.mark.slow  # reason: six GPT steps compiled (about 20 s); the no-reading path trains in test_jax_releases
def test_program_reading_script_agrees_and_shows_the_memory_cost(capsys):
    """Each step gives the same loss with and without reading the program; stage 3 without
    it holds more per device than with it (the whole model gathered), and gathers each
    parameter once instead of once per use."""
    from experiments import program_reading

    rows = program_reading.main(["--d-model", "64", "--layers", "2", "--batch", "8", "--repeats", "1"])
    by = {(r["stage"], r["remat"], r["read"]): r for r in rows}
    for stage, remat, _ in by:
        assert by[(stage, remat, "yes")]["loss"] == pytest.approx(by[(stage, remat, "no")]["loss"], rel=1e-6)
    assert by[(3, "none", "no")]["total_mib"] > by[(3, "none", "yes")]["total_mib"]
    assert by[(3, "full", "no")]["total_mib"] > by[(3, "full", "yes")]["total_mib"]
    assert by[(3, "none", "no")]["gathers"] < by[(3, "none", "yes")]["gathers"]
    assert "| 3 | full | no |" in capsys.readouterr().out


# reason: the script's GPT runs in-process; test_offload's test_state_bytes_split_device_and_host_as_the_formulas and test_offload_trains_exactly_as_without
@pytest.mark.slow
def test_offload_script_matches_the_formulas_and_the_run_without():
    from experiments import offload

    rows = offload.main(["--d-model", "32", "--layers", "1", "--steps", "3", "--runs", "1,4,6"])
    psi, n = gpt.GPTConfig(vocab=256, seq_len=64, d_model=32, n_layers=1, n_heads=1).num_params(), 8
    for r in rows[:2]:  # offloaded rows: bytes as the formulas, training bit for bit
        for memory in ("device", "host"):
            want = zj.report.zero_formula_bytes(
                psi,
                n,
                r["stage"],
                compute_dtype=r["dtype"],
                offload_optimizer=True,
                offload_params=r["offload_params"],
                memory=memory,
            )
            assert want <= r[memory] <= 1.03 * want + 64
        assert r["max_abs_diff"] == 0.0 and r["max_loss_diff"] == 0.0
        assert r["place"] == "host" and r["step_device_total"] < r["plain_step_total"]
    assert rows[2]["host"] == 0 and rows[2]["place"] == "stage 2"


@pytest.mark.slow  # reason: 300 GPT steps in a fresh process; test_training_with_int8_gathers_stays_near_exact_gathers
def test_int8_gathers_train_the_gpt_within_one_percent_of_bf16_gathers(tmp_path):
    """The issue's bar: 300 steps of the GPT with int8 weight gathers end within 1% of the
    loss with bf16 gathers; the traffic is a quarter of fp32's plus the scales."""
    out = tmp_path / "int8_gathers.json"
    run = run_script(
        "int8_gathers.py", "--steps", "300", "--d-model", "64", "--layers", "2", "--json", str(out), full_opt=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert abs(res["relative"]) < 0.01
    assert res["last"]["int8"] < 0.6 * res["losses"]["int8"][0]  # it trained
    fp32, int8 = res["traffic"]["fp32"]["f32"], res["traffic"]["int8"]
    assert int8["s8"] * 4 == fp32 and 0.25 < (int8["s8"] + int8["f32"]) / fp32 < 0.27


# reason: 50-step GPT runs in a fresh process; test_int8_reduce's test_sgd_stays_within_the_quantization_bound_of_single_device_optax
@pytest.mark.slow
def test_int8_gradients_train_the_gpt_within_one_percent_of_fp32_gradients(tmp_path):
    """qgZ's bar: the GPT with int8 gradient exchange ends within 1% of the same run with
    fp32 gradients, at stage 3 and at stage 2; the exchange moves at most 0.3x the bytes
    of the fp32 reduce-scatter (a quarter plus the scales) and bf16's is half of fp32's."""
    out = tmp_path / "zeropp.json"
    # 50 steps: the int8 runs end within 2e-4 of their fp32 twins (the bar is 1e-2) at 0.45 of
    # the first loss (the bar is 0.7); more steps show the same at twice the time.
    run = run_script(
        "zeropp.py",
        "--steps",
        "50",
        "--d-model",
        "64",
        "--layers",
        "2",
        "--weights",
        "bf16",
        "--json",
        str(out),
        full_opt=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    runs, rel = res["runs"], res["relative"]
    for stage in (2, 3):
        assert abs(rel[f"{stage}/bf16/int8"]) < 0.01, rel
        int8, fp32 = runs[f"{stage}/bf16/int8"], runs[f"{stage}/bf16/fp32"]
        assert 0.25 < int8["bytes"]["grads"] / fp32["bytes"]["grads"] <= 0.3
        assert int8["bytes"]["gathers"] == fp32["bytes"]["gathers"]  # weights move as before
        assert int8["last"] < 0.7 * int8["losses"][0]  # it trained
    assert runs["3/bf16/bf16"]["bytes"]["grads"] * 2 == runs["3/bf16/fp32"]["bytes"]["grads"]


@pytest.mark.slow  # reason: the script's GPT compiles in-process; test_hybrid's test_only_gradient_shards_cross_groups
def test_hybrid_traffic_table_per_mesh_axis():
    """Across groups only the gradient shards' all-reduce: Ψ/(N/R) fp32 elements, whatever
    the gather dtype; inside a group the traffic of the 1-D mesh (up to padding)."""
    from experiments import hybrid

    rows = hybrid.main(["--d-model", "32", "--layers", "1", "--replicas", "1,2"])
    psi = gpt.GPTConfig(vocab=256, seq_len=64, d_model=32, n_layers=1, n_heads=1).num_params()
    by = {(r["replicas"], r["gathers"]): r for r in rows}
    for g in ("fp32", "bf16", "int8"):
        assert by[(1, g)]["replica"] == 0
        # The same collectives inside a group; a leaf padded to 8 shards pads less for 4.
        inside = by[(2, g)]["data"] + by[(2, g)]["all"]
        assert 0.99 * by[(1, g)]["total"] <= inside <= by[(1, g)]["total"]
        assert 4 * psi // 4 <= by[(2, g)]["replica"] <= 1.01 * 4 * psi // 4 + 64  # padded shards
        assert by[(2, g)]["spans_nodes"] < 0.2 * by[(1, g)]["spans_nodes"]
    assert by[(1, "int8")]["data"] < by[(1, "bf16")]["data"] < by[(1, "fp32")]["data"]


def test_the_experiments_page_lists_every_script():
    """docs/experiments.md's index names each script in experiments/ once, with a command
    that runs that script (or says what it needs), and no script that is gone."""
    page = (ROOT / "docs" / "experiments.md").read_text()
    index = page[page.index("## Every script") : page.index("## 1.")]
    listed = [line.split("`")[1] for line in index.splitlines() if line.startswith("| `")]
    helpers = {"__init__.py", "harness.py", "data.py", "progress.py"}
    scripts = sorted(p.name for p in (ROOT / "experiments").glob("*.py") if p.name not in helpers)
    assert sorted(listed) == scripts
    for line in index.splitlines():
        if line.startswith("| `"):
            assert f"experiments/{line.split('`')[1]}" in line, line


def test_harness_table_and_side_by_side():
    from experiments import harness

    rows = [{"a": 1, "b": 2.5}, {"a": 10, "b": 0.25}]
    text = harness.table(rows, {"a": "{a:,}", "b x2": lambda r: f"{2 * r['b']:.1f}"})
    assert text.splitlines() == ["| a | b x2 |", "|---|---|", "| 1 | 5.0 |", "| 10 | 0.5 |"]
    calls = []
    times = harness.side_by_side({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, 3, warmup=1)
    assert calls == ["x", "y"] * 4  # turns taken, the warm-up round untimed
    assert [len(t) for t in times.values()] == [3, 3] and all(s >= 0 for t in times.values() for s in t)


def test_harness_traffic_matches_the_communication_report():
    """The collective bytes by mesh axes add up to the communication report's total, and a
    hybrid mesh's replica axis carries the gradient shards' all-reduce."""
    import argparse

    from experiments import harness

    args = harness.add_gpt_args(argparse.ArgumentParser(), d_model=32, layers=1, batch=8).parse_args([])
    cfg = harness.gpt_config(args, head_dim=32)
    mesh = zj.make_mesh(replicas=2)
    _, _, compiled = harness.compile_step(cfg, mesh, zj.ZeroConfig(stage=3), batch=args.batch)
    by_axes = harness.traffic(compiled, mesh)
    report = zj.report.communication_report(compiled, mesh=mesh)
    assert by_axes == {k: v["bytes"] for k, v in report["by_axis"].items()}
    assert sum(by_axes.values()) == report["total"]["bytes"]
    assert by_axes["replica"] > 0 and by_axes["data"] > by_axes["replica"]


@pytest.mark.slow  # reason: compiles three GPT steps and a fresh process per tier; tests/test_nvme.py covers the tier
def test_nvme_script_streams_bit_for_bit_and_measures_each_part(tmp_path):
    from experiments import nvme

    out = nvme.main(
        ["--dir", str(tmp_path), "--io-mb", "8", "--repeats", "1", "--sizes", "32x1", "--time-size", "32x1"]
        + ["--steps", "3"]
    )
    assert [r["what"] for r in out["io"]] == ["write", "read"]  # read back bit for bit, or it raises
    for r in out["io"]:
        assert r["tier"] > 0 and r["dd"] > 0 and r["ratio"] == pytest.approx(r["tier"] / r["dd"])
    (rss,) = out["rss"]
    psi = gpt.GPTConfig(vocab=256, seq_len=64, d_model=32, n_layers=1).num_params()
    assert 8 * psi <= rss["opt_bytes"] <= 12 * psi  # Adam's two float32 moments, storage padded to the 8 devices
    assert rss["peak"] >= rss["before"] > 0 and rss["groups"] >= 1
    assert [r["run"] for r in out["time"]] == ["in memory", "host offload", "NVMe"]
    assert out["time"][0]["ratio"] == 1.0 and all(r["ms"] > 0 for r in out["time"])
    assert [r["run"] for r in out["exactness"]][:2] == ["host offload", "NVMe"]
    assert out["exactness"][0]["params"] <= 1e-6  # the host update, inside the step's program
    for r in out["exactness"]:  # last bits of the moments; AdamW may turn a last-bit gradient into a step of
        assert r["opt"] <= 1e-6 and r["params"] <= 2 * 2 * 1e-2  # lr's size (docs/offload.md): 2 steps, lr 1e-2
    assert os.listdir(tmp_path) == []  # the script's directory is removed
