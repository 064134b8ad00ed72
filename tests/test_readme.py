"""The README's example code runs as written and its commands stay true."""

import pathlib
import re

import numpy as np

import zerojax as zj

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    # The NNX example trained and gathered full params in the original structure.
    import jax
    from flax import nnx

    assert namespace["optimizer"].step == 3 and np.isfinite(float(namespace["nnx_metrics"]["loss"]))
    assert isinstance(namespace["tagger"], nnx.Module)
    assert not np.allclose(np.asarray(namespace["tagger"].bn.mean[...]), 0.0)  # BatchNorm's statistics moved

    trained, params = namespace["trained"], namespace["params"]
    assert jax.tree.structure(trained) == jax.tree.structure(params)
    assert int(namespace["state"].step) == 3
    assert np.isfinite(float(namespace["metrics"]["loss"]))
    assert namespace["m"]["aux"]["mae"].shape == ()
    assert namespace["m"]["aux"]["pred"].shape == (32, 1) and namespace["m"]["aux"]["n_big"].dtype == np.int32
    # The eval step's per-example predictions are the trained model's own.
    out, model, batch = namespace["out"], namespace["model"], namespace["batch"]
    np.testing.assert_allclose(np.asarray(out["pred"]), np.asarray(model(batch["x"])), rtol=1e-5, atol=1e-6)
    want = np.mean((np.asarray(model(batch["x"])) - np.asarray(batch["y"])) ** 2)
    np.testing.assert_allclose(float(out["loss"]), want, rtol=1e-5)
    # Dropout, BatchNorm, frozen weights and init_fn, as the README shows them.
    assert np.isfinite(float(namespace["dm"]["loss"])) and namespace["dstate"].rng is not None
    stats = namespace["bstate"].model_state["batch_stats"]
    assert not np.allclose(np.asarray(jax.tree.leaves(stats)[0]), 0.0)  # the running mean moved
    frozen, params = zj.gather_params(namespace["fstate"]), namespace["params"]
    np.testing.assert_array_equal(np.asarray(frozen["l1"]["kernel"][...]), np.asarray(params["l1"]["kernel"][...]))
    assert not np.array_equal(np.asarray(frozen["l2"]["kernel"][...]), np.asarray(params["l2"]["kernel"][...]))
    assert zj.report.state_bytes_per_device(namespace["fstate"])["frozen"] == 4 * (13 * 64 + 64) // 8
    # The monitor example: one record per step, with the losses the step returned and adamw's rate.
    history = namespace["history"]
    assert [r["step"] for r in history.records if r["kind"] == "train"] == [1, 2, 3]
    assert history.values("learning_rate") == [np.float32(1e-3).item()] * 3
    assert history.values("loss")[-1] == float(namespace["wmetrics"]["loss"])
    # zj.fit: ten steps.
    assert int(namespace["fit_state"].step) == 10
    # The pipeline example: each device holds its stage's layers over its 4 data devices.
    piped = namespace["pstate"].master["layers"]
    assert {s.data.size for s in piped.addressable_shards} == {8 * 32 * 32 // (2 * 4)}
    assert np.isfinite(float(namespace["pmetrics"]["loss"]))
    # The MoE example: each device holds 8 / 4 experts (over 1/2 of the rest at stage 3).
    moe = namespace["moe_state"]
    held = moe.params if moe.params is not None else moe.master
    assert {s.data.size for s in held["up"].addressable_shards} == {8 * 16 * 32 // 4 // 2}
    assert np.isfinite(float(namespace["moe_metrics"]["loss"]))
    # Offload: everything but a step count in host memory, and the same first step.
    split = zj.report.state_bytes_per_device(namespace["state_off"])
    assert split["device"] <= 16 and split["host"] == split["total"] - split["device"] > 0
    assert namespace["step_off"].update_place(namespace["state_off"]) == "host"
    born = zj.gather_params(namespace["born_sharded"])
    assert models_equal(born, params)
    # Tensor parallelism: the annotated kernels and bias are split over "tensor", 1/8 per device.
    tp_plan = namespace["tp_optimizer"].state.plan
    assert [l.tdim for l in tp_plan.layouts] == [-1, 0, 0, 1] and np.isfinite(float(namespace["tp_metrics"]["loss"]))
    up = namespace["tp_optimizer"].state.master["up"]["kernel"][...]
    assert up.addressable_shards[0].data.size * 8 == 16 * 64
    # Long sequences: each sequence over 4 devices, the state over all 8.
    lc = namespace["lc_state"]
    assert lc.plan.context == 4 and lc.plan.shards == 8 and np.isfinite(float(namespace["lc_metrics"]["loss"]))
    # The Hugging Face fine-tune: one LoRA step from the transformers checkpoint, exported
    # merged in its layout under its own tensor names.
    import json

    assert int(namespace["ft_state"].step) == 1 and np.isfinite(float(namespace["ft_metrics"]["loss"]))
    ref_index = json.loads((ROOT / "tests/data/hf/llama32_tied/model.safetensors.index.json").read_text())
    from safetensors.numpy import load_file

    exported = load_file("/tmp/finetuned/model.safetensors")  # under 5GB: one file, as transformers writes it
    assert set(exported) == set(ref_index["weight_map"]) and "lm_head.weight" not in exported  # tied: saved once
    written = json.loads(pathlib.Path("/tmp/finetuned/config.json").read_text())
    assert written["tie_word_embeddings"] and written["dtype"] == "bfloat16"
    # The ahead-of-time figure is the compiled step's own, to the byte.
    compiled = namespace["train_step"].lower(namespace["state"], namespace["batch"]).compile()
    assert namespace["mem"].total == zj.report.compiled_bytes(compiled)["total"]
    assert namespace["mem"].state == zj.report.state_bytes_per_device(namespace["state"])["total"]


def test_readme_commands_match_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[1]
    assert "pip install -e '.[test]'" in test_cmd and "python -m pytest" in test_cmd
    assert "python -m pytest" in ci and ".[test]" in ci
    demo_cmd = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[0]
    script = demo_cmd.split("python ")[-1].strip()
    assert (ROOT / script).is_file()


def models_equal(a, b) -> bool:
    import jax

    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_readme_says_how_to_get_simulated_devices_and_what_the_report_total_is(tmp_path):
    """Snippets run on one CPU device unless the reader sets the device count: the README
    says how, and the way it gives works. Its communication_report line prints a number of
    bytes (the report's "total" is a dict of count, bytes and paper units)."""
    import subprocess
    import sys

    import jax.numpy as jnp
    import optax

    assert "JAX_NUM_CPU_DEVICES=8 python train.py" in README and 'jax_num_cpu_devices", 8' in README
    r = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.device_count())"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"},
    )
    assert r.stdout.strip() == "8", r.stderr[-2000:]
    (line,) = [
        l for l in README.splitlines() if "zj.report.communication_report(compiled)" in l and l.startswith("print(")
    ]
    expr = line[len("print(") : line.index("  #")].rstrip()[:-1]
    mesh, cfg, tx = zj.make_mesh(), zj.ZeroConfig(stage=2), optax.sgd(0.1)
    state = zj.init_state({"w": jnp.zeros((64, 64))}, tx, mesh=mesh, config=cfg)
    step = zj.make_train_step(lambda p, b: jnp.mean(jnp.tanh(b @ p["w"])), tx, mesh=mesh, config=cfg)
    compiled = step.lower(state, jnp.ones((8, 64))).compile()
    value = eval(expr, {"zj": zj, "compiled": compiled})
    assert isinstance(value, int) and value == zj.report.communication_report(compiled)["total"]["bytes"] > 0


def test_the_package_metadata_a_user_meets():
    """What an index page and pip show: a license file, links, the Python range that installs
    (Flax 0.12 needs 3.11), and a long description whose links work off GitHub too."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project["requires-python"] == ">=3.11"
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(project["urls"])
    assert project["readme"] == "README.md"
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    relative = [l for l in links if not l.startswith(("https://", "http://", "#"))]
    assert links and not relative, relative
    base = "https://github.com/zerojax/zerojax/blob/main/"
    for link in links:
        if link.startswith(base):  # each points at a file of the repository
            assert (ROOT / link[len(base) :].split("#")[0]).exists(), link


def test_readme_says_its_blocks_continue_one_script_and_where_the_fixture_is():
    assert "The Python blocks of this README continue one script" in README
    fixture = ROOT / "tests/data/hf/llama32_tied"
    shards = sorted(fixture.glob("model-*-of-*.safetensors"))
    (line,) = [l for l in README.splitlines() if l.startswith('hf_dir = "tests/data/hf/llama32_tied"')]
    assert f"{len(shards)} shards" in line and "from a checkout" in README
