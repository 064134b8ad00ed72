"""Checkpoints of every Llama-family feature, made by ``transformers`` itself
(tests/data/hf/*, from experiments/make_hf_fixtures.py): zerojax's Llama gives their logits,
the same math in float64 to 1e-9, loaded at ZeRO-3 on 8 devices; and config.json is read
against an explicit list of fields, refusing what it does not implement by name."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from zerojax.models import llama

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists())
# What each fixture is there for: the feature its config turns on.
FEATURES = {
    "llama31": lambda c: c.rope_scaling.kind == "llama3" and c.rope_scaling.factor == 8.0,
    "llama32_tied": lambda c: c.tie_embeddings and c.rope_scaling.factor == 32.0,
    "llama_bias": lambda c: c.qkv_bias and c.o_bias and c.mlp_bias and c.hd != c.d_model // c.n_heads,
    "llama_linear": lambda c: c.rope_scaling.kind == "linear",
    "mistral_window": lambda c: c.sliding_window == 5 and c.window_layers is None and c.kv_heads == 1,
    "qwen2_window": lambda c: (
        c.window_layers == (False, True)
        and c.rope_scaling.kind == "yarn"
        and c.qkv_bias
        and not c.o_bias
        and c.tie_embeddings
    ),
    "qwen3": lambda c: c.qk_norm and c.tie_embeddings and c.hd == 12,
    "qwen3_moe": lambda c: (
        c.n_experts == 4
        and c.top_k == 2
        and c.moe_d_ff == 8
        and c.norm_topk_prob
        and c.qk_norm
        and c.router_aux_loss_coef == 0.0
    ),
    "mixtral": lambda c: c.n_experts == 4 and c.top_k == 2 and c.expert_d_ff == 8 and c.norm_topk_prob,
    "qwen2_moe": lambda c: (
        c.n_experts == 4
        and c.shared_d_ff == 12
        and c.shared_gate
        and not c.norm_topk_prob
        and c.qkv_bias
        and not c.o_bias
    ),
}


def test_every_family_and_feature_has_a_fixture():
    assert sorted(FEATURES) == NAMES
    for name in NAMES:
        cfg, _ = zj.models.from_hf(FIXTURES / name)
        assert FEATURES[name](cfg), (name, cfg)


def _logits(cfg, params, tokens, mask=None):
    """The model's logits, in one compiled program (run eagerly, each operation compiles on
    its own)."""
    graphdef = llama.init_abstract(cfg)[0]
    run = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask=m))
    return np.asarray(run(params, jnp.asarray(tokens), None if mask is None else jnp.asarray(mask, bool)))


def _batches(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": jnp.asarray(rng.integers(0, cfg.vocab, (8, 17)), jnp.int32)} for _ in range(n)]


def _loaded(name):
    cfg, wmap = zj.models.from_hf(FIXTURES / name)
    tx, mesh, zc = optax.sgd(0.1), zj.make_mesh(), zj.ZeroConfig(stage=3)
    state = zj.init_state(
        llama.init_abstract(cfg)[1], tx, mesh=mesh, config=zc, weights=zj.Weights(FIXTURES / name, wmap)
    )
    return cfg, wmap, state, (tx, mesh, zc)


# In the slow set, fixtures whose tensors load as a default fixture's do (a step compile each):
# llama_linear and mistral_window change no tensor (their RoPE and window are compared with
# transformers' float64 math for every fixture in test_the_math_is_transformers_in_float64,
# and llama31 and qwen2_window load a RoPE variant and a window here), and llama32_tied's tied
# head loads as qwen2_window's and qwen3's.
LOADS_SLOW = ["llama32_tied", "llama_linear", "mistral_window"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in LOADS_SLOW else n for n in NAMES])
def test_each_checkpoint_loads_at_stage_3_with_transformers_logits(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, _, state, _ = _loaded(name)
    params = zj.gather_params(state)
    err = np.abs(_logits(cfg, params, ref["tokens"]) - ref["logits"]).max()
    assert err <= 2e-5, err  # float32 rounding (measured: at most 4.3e-6)
    keep = ref["mask"].astype(bool)  # padded queries see the same keys but are not compared
    err = np.abs(_logits(cfg, params, ref["tokens"], ref["mask"]) - ref["logits_mask"])[keep].max()
    assert err <= 2e-5, err


# A train step compiled per fixture (10-15 s each): the two that combine the most features
# run in the default set; the slow set adds the fixtures whose tensors export differently
# (every bias, a tied head). The RoPE variants and the window change no tensor: loaded above.
# qwen3 in the slow set too: its tensors are qwen3_moe's attention with q_norm and k_norm and
# qwen2_window's tied head, both exported in the default set.
EXPORTS = [
    pytest.param("llama_bias", marks=pytest.mark.slow),
    pytest.param("llama32_tied", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", marks=pytest.mark.slow),
    "qwen2_window",
    pytest.param("qwen3", marks=pytest.mark.slow),
    "qwen3_moe",
]


@pytest.mark.parametrize("name", EXPORTS)
def test_each_checkpoint_trains_at_stage_3_and_exports_in_its_layout(name, tmp_path):
    """Two SGD steps at ZeRO-3 on 8 devices, then exported in Hugging Face's format: the
    checkpoint's own tensor names, each in one file, the index's total_size true,
    config.json beside them; read back, the trained model's logits exactly. (transformers
    itself reads such exports with the same logits: ``make_hf_fixtures.py --check-export``.)"""
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, wmap, state, (tx, mesh, zc) = _loaded(name)
    graphdef, abstract = llama.init_abstract(cfg)
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc)
    for batch in _batches(cfg, 2):
        state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    tuned = _logits(cfg, zj.gather_params(state), ref["tokens"])
    assert np.abs(tuned - ref["logits"]).max() > 1e-4  # it trained

    out = tmp_path / "export"
    zj.export_weights(state, out, format="hf", map=wmap, max_shard_size="10KB" if cfg.n_experts else "40KB")
    source = json.loads((FIXTURES / name / "model.safetensors.index.json").read_text())["weight_map"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source)  # a tied head written once (the embedding), as saved
    from safetensors import safe_open

    seen, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), "np") as f:
            for key in f.keys():
                assert key not in seen, key  # every tensor in one file
                seen[key] = file
                total += f.get_tensor(key).nbytes
    assert seen == index["weight_map"] and total == index["metadata"]["total_size"]
    assert json.loads((out / "config.json").read_text()) == json.loads((FIXTURES / name / "config.json").read_text())
    again_cfg, again_map = zj.models.from_hf(out)
    assert again_cfg == cfg
    again = zj.load_weights(zj.Weights(out, again_map), like=abstract)
    np.testing.assert_array_equal(_logits(cfg, again, ref["tokens"]), tuned)


X64_SCRIPT = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
import zerojax as zj
assert jax.config.jax_enable_x64
out = {}
for name in sys.argv[2:]:
    d = os.path.join(sys.argv[1], name)
    ref = np.load(os.path.join(d, "reference.npz"))
    cfg, wmap = zj.models.from_hf(d, dtype="float64", param_dtype="float64")
    gd, abstract = zj.models.llama.init_abstract(cfg)
    params = zj.load_weights(zj.Weights(d, wmap), like=abstract)
    keep = ref["mask"].astype(bool)
    run = jax.jit(lambda p, t, m: nnx.merge(gd, p)(t, mask=m))
    a = np.asarray(run(params, jnp.asarray(ref["tokens"]), jnp.ones(keep.shape, bool)))
    b = np.asarray(run(params, jnp.asarray(ref["tokens"]), jnp.asarray(keep)))
    assert a.dtype == np.float64
    out[name] = [float(np.abs(a - ref["logits64"]).max()), float(np.abs(b - ref["logits64_mask"])[keep].max())]
print(json.dumps(out))
"""


def test_the_math_is_transformers_in_float64():
    """The same computation, not merely close: zerojax's model in float64 (JAX's x64 mode)
    against transformers' own code run in float64 (every float32 upcast of its RMSNorm,
    RoPE and softmax made float64: see make_hf_fixtures.py), to 1e-9."""
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    r = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT, str(FIXTURES), *NAMES],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(errors) == NAMES
    for name, (plain, masked) in errors.items():
        assert plain <= 1e-9 and masked <= 1e-9, (name, plain, masked)  # measured: at most 5.4e-15


def test_a_tied_embedding_gets_the_gradient_of_both_uses():
    """One parameter used twice: its gradient is the sum of the lookup's and the head's,
    what an untied twin with the head set to the embedding's transpose gets in two parts."""
    tied = llama.LlamaConfig(vocab=24, d_model=16, n_layers=1, n_heads=2, d_ff=24, tie_embeddings=True)
    untied = llama.LlamaConfig(vocab=24, d_model=16, n_layers=1, n_heads=2, d_ff=24)
    gt, pt = llama.init(tied)
    gu = llama.init_abstract(untied)[0]  # its params are the tied ones with the head added
    pu = nnx.State({**{k: v for k, v in pt.items()}, "head": {"kernel": nnx.Param(pt["embed"]["embedding"][...].T)}})
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 24, (2, 9)), jnp.int32)}
    g_tied = jax.jit(jax.grad(llama.make_loss(gt)))(pt, batch)
    g_untied = jax.jit(jax.grad(llama.make_loss(gu)))(pu, batch)
    both = np.asarray(g_untied["embed"]["embedding"][...]) + np.asarray(g_untied["head"]["kernel"][...]).T
    np.testing.assert_allclose(np.asarray(g_tied["embed"]["embedding"][...]), both, rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(g_untied["head"]["kernel"][...])).max() > 1e-3  # the head's share is not nothing


# ------------------------------------------------------------------------------------------
# config.json: what the published checkpoints' files hold, and what is refused.

# The config.json of checkpoints people fine-tune, as their authors published them (the
# fields that matter here, with their values; transcribed from the model repositories).
PUBLISHED = {
    "Llama-3.1-8B": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        },
        dict(
            n_kv_heads=8, hd=128, tie_embeddings=False, rope_theta=500000.0, kind="llama3", factor=8.0, window=(0,) * 32
        ),
    ),
    "Llama-3.2-1B": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        },
        dict(
            n_kv_heads=8, hd=64, tie_embeddings=True, rope_theta=500000.0, kind="llama3", factor=32.0, window=(0,) * 16
        ),
    ),
    "Mistral-7B-v0.1": (
        {
            "architectures": ["MistralForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.34.0.dev0",
            "use_cache": True,
            "vocab_size": 32000,
        },
        dict(n_kv_heads=8, hd=128, tie_embeddings=False, rope_theta=10000.0, kind=None, window=(4096,) * 32),
    ),
    "Mistral-7B-Instruct-v0.3": (
        {
            "architectures": ["MistralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.42.0.dev0",
            "use_cache": True,
            "vocab_size": 32768,
        },
        dict(n_kv_heads=8, hd=128, tie_embeddings=False, rope_theta=1e6, kind=None, window=(0,) * 32),
    ),
    "Qwen2.5-0.5B": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 896,
            "initializer_range": 0.02,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1",
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        dict(n_kv_heads=2, hd=64, tie_embeddings=True, rope_theta=1e6, kind=None, window=(0,) * 24),
    ),
    # Qwen2.5's model card: add this rope_scaling for contexts past 32,768 tokens.
    "Qwen2.5-7B-Instruct+yarn": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "hidden_size": 3584,
            "initializer_range": 0.02,
            "intermediate_size": 18944,
            "max_position_embeddings": 32768,
            "max_window_layers": 28,
            "model_type": "qwen2",
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.1",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 152064,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        },
        dict(n_kv_heads=4, hd=128, tie_embeddings=False, rope_theta=1e6, kind="yarn", factor=4.0, window=(0,) * 28),
    ),
    "Qwen3-0.6B": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "initializer_range": 0.02,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        dict(n_kv_heads=8, hd=128, tie_embeddings=True, rope_theta=1e6, kind=None, window=(0,) * 28),
    ),
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_published_configs_read_into_the_model_they_describe(model):
    fields, want = PUBLISHED[model]
    cfg = zj.models.config_from_hf(fields)
    assert cfg.kv_heads == want["n_kv_heads"] and cfg.hd == want["hd"]
    assert cfg.tie_embeddings == want["tie_embeddings"] and cfg.rope_theta == want["rope_theta"]
    assert cfg.layer_windows() == want["window"]
    if want["kind"] is None:
        assert cfg.rope_scaling is None
    else:
        assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (want["kind"], want["factor"])
    assert cfg.qk_norm == (fields["model_type"] == "qwen3")
    assert cfg.qkv_bias == (fields["model_type"] == "qwen2") and not cfg.o_bias and not cfg.mlp_bias


def test_the_llama3_frequencies_are_the_published_formula():
    """Llama 3.1's own values: frequencies of wavelength under 8192/4 kept, over 8192
    divided by 8, and the band between interpolated (continuous at both edges)."""
    cfg = zj.models.config_from_hf(PUBLISHED["Llama-3.1-8B"][0])
    base = zj.models.rope.inv_freq(128, 500000.0)
    scaled = zj.models.rope.inv_freq(128, 500000.0, cfg.rope_scaling)
    wavelen = 2 * np.pi / base
    np.testing.assert_array_equal(scaled[wavelen < 2048], base[wavelen < 2048])
    np.testing.assert_allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-15)
    band = (wavelen >= 2048) & (wavelen <= 8192)
    assert band.any() and np.all(scaled[band] < base[band]) and np.all(scaled[band] > base[band] / 8)


BASE = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type = 'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "'longrope'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "rope_theta": 5e5,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "smooth": 2,
                }
            },
            "smooth = 2",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}, "partial_rotary_factor = 0.25"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act = 'gelu_pytorch_tanh'"),
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
        ({"sliding_window": 4096}, "sliding_window = 4096"),  # a Llama has no window: transformers ignores it
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"use_mrope": True}, "use_mrope = True"),
        (
            {"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}},
            "per layer type",
        ),
    ],
)
def test_a_field_that_changes_the_math_is_refused_by_name(extra, needle):
    with pytest.raises(ValueError) as e:
        zj.models.config_from_hf({**BASE, **extra})
    assert needle in str(e.value)


def test_other_refusals_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="'gemma2' model"):
        zj.models.config_from_hf({**BASE, "model_type": "gemma2"})
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
        zj.models.config_from_hf({k: v for k, v in BASE.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="layer_types has sliding_attention layers but no sliding_window"):
        zj.models.config_from_hf(
            {**BASE, "model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}
        )
    with pytest.raises(ValueError, match="must list 2 of"):
        zj.models.config_from_hf({**BASE, "model_type": "qwen3", "layer_types": ["full_attention"]})
    # A field zerojax does not know, which the user says is inert, is accepted.
    cfg = zj.models.config_from_hf({**BASE, "my_note": "x"}, accept=["my_note"])
    assert cfg.d_model == 32
    with pytest.raises(FileNotFoundError, match="no config.json"):
        zj.models.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a config"):
        zj.models.from_hf(tmp_path)
    # Per-layer windows need the plain-ops attention (the kernel's window is one static value).
    with pytest.raises(ValueError, match="windows differ"):
        zj.models.from_hf(FIXTURES / "qwen2_window", attention="ring")


def test_transformers_defaults_fill_what_a_file_leaves_out():
    """A Mistral config without sliding_window gets transformers' 4096; a Qwen3 one without
    head_dim gets 128 (not hidden / heads); a Qwen2 one windows the layers from
    max_window_layers on only when use_sliding_window."""
    mistral = zj.models.config_from_hf({**BASE, "model_type": "mistral", "num_attention_heads": 16, "hidden_size": 64})
    assert mistral.kv_heads == 8 and mistral.layer_windows() == (4096, 4096)
    assert zj.models.config_from_hf({**BASE, "model_type": "qwen3", "num_key_value_heads": 2}).hd == 128
    qwen2 = {
        **BASE,
        "model_type": "qwen2",
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "sliding_window": 7,
        "max_window_layers": 1,
    }
    assert zj.models.config_from_hf(qwen2).layer_windows() == (0, 0, 0)
    assert zj.models.config_from_hf({**qwen2, "use_sliding_window": True}).layer_windows() == (0, 7, 7)


def test_a_tied_checkpoint_that_stores_its_head_too_is_refused_until_said(tmp_path):
    """transformers ties ``lm_head.weight`` to the embedding only when they are equal: the
    user says which they mean, and each choice loads what it says."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "llama32_tied"
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    embed = load_file(str(src / index["weight_map"]["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
    head = embed * 2.0  # different from the embedding
    save_file({"lm_head.weight": head}, str(tmp_path / "head.safetensors"))
    index["weight_map"]["lm_head.weight"] = "head.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="stores lm_head.weight too.*tie_embeddings=True.*tie_embeddings=False"):
        zj.models.from_hf(tmp_path)
    ref = np.load(src / "reference.npz")
    cfg, wmap = zj.models.from_hf(tmp_path, tie_embeddings=True)  # the stored head ignored
    params = zj.load_weights(zj.Weights(tmp_path, wmap), like=llama.init_abstract(cfg)[1])
    assert np.abs(_logits(cfg, params, ref["tokens"]) - ref["logits"]).max() <= 2e-5
    cfg, wmap = zj.models.from_hf(tmp_path, tie_embeddings=False)  # the head apart, as stored
    params = zj.load_weights(zj.Weights(tmp_path, wmap), like=llama.init_abstract(cfg)[1])
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"][...]), head.T)


def test_the_export_command_takes_the_family_map_or_the_source_config(tmp_path, capsys):
    """``zerojax export CKPT OUT --format hf`` with ``--hf-config`` alone (the map read from
    the source's config.json) and with ``--map qwen3`` (the family's map) writes the
    checkpoint's own tensors, the same bytes."""
    from zerojax import cli

    _, _, state, _ = _loaded("qwen3")
    zj.save_checkpoint(tmp_path / "ck", state, 0)
    zj.checkpoint.wait()
    source = json.loads((FIXTURES / "qwen3" / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors.numpy import load_file

    got = {}
    for how, extra in (("config", []), ("family", ["--map", "qwen3"])):
        out = tmp_path / how
        rc = cli.main(
            ["export", str(tmp_path / "ck"), str(out), "--format", "hf", "--hf-config", str(FIXTURES / "qwen3"), *extra]
        )
        assert rc == 0, capsys.readouterr().err
        got[how] = load_file(str(out / "model.safetensors"))
        assert set(got[how]) == set(source)
    for k in source:
        np.testing.assert_array_equal(got["config"][k], got["family"][k])
