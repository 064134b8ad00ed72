"""A Hugging Face Llama checkpoint, made by ``transformers`` itself (tests/data/hf_llama_tiny,
from experiments/make_hf_llama.py), loaded into the experiments' Llama at stage 3 gives
transformers' logits; fine-tuned (LoRA and full), exported in the same layout and read back,
it gives zerojax's logits and resumes the same loss at another stage and device count."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import zerojax as zj
from zerojax.models import llama
from zerojax.models.hf_config import config_from_hf

FIXTURE = pathlib.Path(__file__).resolve().parent / "data" / "hf_llama_tiny"
REF = np.load(FIXTURE / "reference.npz")


def _logits(cfg, params, tokens, mask=None, positions=None):
    graphdef = llama.init_abstract(cfg)[0]
    model = nnx.merge(graphdef, params)
    return np.asarray(
        model(jnp.asarray(tokens), positions=positions, mask=None if mask is None else jnp.asarray(mask, bool))
    )


def _batches(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": jnp.asarray(rng.integers(0, cfg.vocab, (8, 12)), jnp.int32)} for _ in range(n)]


@functools.cache
def _loaded(stage: int):
    cfg = config_from_hf(str(FIXTURE))
    abstract = llama.init_abstract(cfg)[1]
    state = zj.init_state(
        abstract,
        optax.sgd(0.1),
        mesh=zj.make_mesh(),
        config=zj.ZeroConfig(stage=stage),
        weights=zj.Weights(FIXTURE, zj.maps.llama_map()),
    )
    return cfg, state


def test_the_transformers_checkpoint_loads_into_stage_3_and_gives_its_logits():
    cfg, state = _loaded(3)
    params = zj.gather_params(state)
    for mask, key in ((None, "logits_nomask"), (REF["mask"], "logits")):
        err = np.abs(_logits(cfg, params, REF["tokens"], mask) - REF[key]).max()
        assert err <= 1e-5, (key, err)
    err = np.abs(
        _logits(cfg, params, REF["tokens"], REF["mask"], jnp.asarray(REF["positions"])) - REF["logits_positions"]
    ).max()
    assert err <= 1e-5
    # The same weights read with load_weights into the model's abstract tree.
    direct = zj.load_weights(zj.Weights(FIXTURE, zj.maps.llama_map()), like=llama.init_abstract(cfg)[1])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), direct, params)


@pytest.mark.slow  # reason: 12 s, a LoRA fine-tune, its checkpoint and two exports
def test_lora_finetune_at_stage_3_exports_merged_and_as_adapters(tmp_path):
    """10 LoRA steps on 8 devices (base from the checkpoint, adapters from the init function,
    said explicitly), exported: merged into a plain Llama checkpoint (the default), and as
    base + adapters."""
    cfg = config_from_hf(str(FIXTURE), lora_rank=4)
    graphdef, _ = llama.init_abstract(cfg)
    tx = optax.adamw(1e-2)
    mesh, zc = zj.make_mesh(), zj.ZeroConfig(stage=3)
    init_fn = lambda: nnx.split(llama.Llama(cfg, nnx.Rngs(0)), nnx.Param)[1]
    wmap = zj.maps.llama_map()
    # The map names PEFT's adapter tensors, which a base checkpoint lacks: without optional=,
    # the adapters are an error, not silently left at their initial values.
    with pytest.raises(ValueError, match=r"missing from the checkpoint \(42\): base_model\.model\..*lora_A"):
        zj.init_state(init_fn, tx, mesh=mesh, config=zc, trainable=llama.is_lora, weights=zj.Weights(FIXTURE, wmap))
    state = zj.init_state(
        init_fn,
        tx,
        mesh=mesh,
        config=zc,
        trainable=llama.is_lora,
        weights=zj.Weights(FIXTURE, wmap, optional=("*.lora.*",)),
    )
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
    losses = []
    for batch in _batches(cfg, 1) * 10:  # one batch, learnt
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.1
    tuned = zj.gather_params(state)
    want = _logits(cfg, tuned, REF["tokens"])

    zj.export_weights(state, tmp_path / "merged", map=wmap, format="hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(
        json.loads((FIXTURE / "model.safetensors.index.json").read_text())["weight_map"]
    )  # the transformers checkpoint's tensors, no adapter among them
    plain = config_from_hf(str(FIXTURE))
    merged = zj.load_weights(zj.Weights(tmp_path / "merged", wmap), like=llama.init_abstract(plain)[1])
    err = np.abs(_logits(plain, merged, REF["tokens"]) - want).max()
    assert err <= 1e-5, err  # kernel + a @ b summed once in the file, twice in the model

    zj.export_weights(state, tmp_path / "adapters.safetensors", map=wmap, lora="adapters")
    adapters = load_file(str(tmp_path / "adapters.safetensors"))
    assert len(adapters) == 2 * 7 * cfg.n_layers  # PEFT's names: lora_A [r, in], lora_B [out, r]
    q = tuned["blocks"]["q"]["lora"]
    for i in range(cfg.n_layers):
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        np.testing.assert_array_equal(adapters[f"{name}.lora_A.weight"], np.asarray(q["lora_a"][i]).T)
        np.testing.assert_array_equal(adapters[f"{name}.lora_B.weight"], np.asarray(q["lora_b"][i]).T)

    # Base and adapters kept apart in one checkpoint read back into the LoRA model: exact.
    zj.export_weights(state, tmp_path / "kept", map=wmap, format="hf", lora="keep")
    kept = zj.load_weights(zj.Weights(tmp_path / "kept", wmap), like=llama.init_abstract(cfg)[1])
    assert np.abs(_logits(cfg, kept, REF["tokens"]) - want).max() == 0.0


def test_full_finetune_exported_resumes_at_another_stage_and_device_count(tmp_path):
    cfg, _ = _loaded(3)
    graphdef = llama.init_abstract(cfg)[0]
    batches = _batches(cfg, 5, seed=1)
    tx = optax.sgd(0.05)
    wmap = zj.maps.llama_map()
    mesh8, zc3 = zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(llama.init_abstract(cfg)[1], tx, mesh=mesh8, config=zc3, weights=zj.Weights(FIXTURE, wmap))
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh8, config=zc3)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    zj.export_weights(state, tmp_path / "hf", map=wmap, format="hf", max_shard_size="40KB")
    _, m4 = step(state, batches[3])

    mesh4, zc1 = zj.make_mesh(jax.devices()[:4]), zj.ZeroConfig(stage=1)
    again = zj.init_state(
        llama.init_abstract(cfg)[1], tx, mesh=mesh4, config=zc1, weights=zj.Weights(tmp_path / "hf", wmap)
    )
    step4 = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh4, config=zc1)
    again, n4 = step4(again, batches[3])
    assert abs(float(m4["loss"]) - float(n4["loss"])) <= 1e-6
