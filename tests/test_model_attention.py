"""The package models' attention="fused" default: which attention it takes from the static
facts of a trace (zerojax.models.attention_choice.choose), that on a CPU it is the exact einsum
path (bit for bit), that the compiled program names what ran, and that the cuDNN branch's
arguments (causal, window, GQA, scale) mean what the einsum path computes."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax as zj
from tests import models
from zerojax.models import attention_choice as zattn
from zerojax.models import gpt, llama

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# (platform, dtype, head_dim, mask, segments, window, context, capability) -> what runs.
# window: 0 none, an int shared by every layer, None when the layers' windows differ.
TABLE = [
    ("cuda", BF16, 128, False, False, 0, False, None, "cudnn"),
    ("cuda", F16, 64, False, False, 0, False, (8, 0), "cudnn"),
    ("cuda", BF16, 128, False, False, 4096, False, (9, 0), "cudnn"),  # Mistral's one window
    ("cuda", BF16, 8, False, False, 0, False, None, "cudnn"),
    ("cuda", BF16, 256, False, False, 0, False, (9, 0), "cudnn"),  # Hopper takes 256
    ("cuda", BF16, 256, False, False, 0, False, (8, 0), "einsum"),  # an A100 does not
    ("cuda", BF16, 256, False, False, 0, False, None, "einsum"),  # unknown: 128 at most
    ("cuda", BF16, 264, False, False, 0, False, (10, 0), "einsum"),
    ("cuda", BF16, 100, False, False, 0, False, (9, 0), "einsum"),  # not a multiple of 8
    ("cuda", F32, 128, False, False, 0, False, (9, 0), "einsum"),
    ("cuda", jnp.float64, 128, False, False, 0, False, (9, 0), "einsum"),
    ("cuda", BF16, 128, True, False, 0, False, (9, 0), "einsum"),  # a key mask
    ("cuda", BF16, 128, False, True, 0, False, (9, 0), "einsum"),  # packed sequences
    ("cuda", BF16, 128, True, True, 4096, False, (9, 0), "einsum"),
    ("cuda", BF16, 128, False, False, None, False, (9, 0), "einsum"),  # per-layer windows
    ("cpu", BF16, 128, False, False, 0, False, None, "einsum"),
    ("cpu", F32, 64, True, True, None, False, None, "einsum"),
    ("tpu", BF16, 128, False, False, 0, False, None, "einsum"),
    ("rocm", BF16, 128, False, False, 0, False, None, "einsum"),
    ("cuda", BF16, 128, False, False, 0, True, (9, 0), "auto"),  # a context mesh: zj.nn's kernels
    ("cpu", F32, 100, True, True, 4096, True, None, "auto"),
    ("cuda", BF16, 128, False, False, None, True, (9, 0), "einsum"),  # the kernels take one window
]


@pytest.mark.parametrize("plat,dtype,hd,mask,segments,window,context,cc,expected", TABLE)
def test_the_choice_from_the_static_facts(plat, dtype, hd, mask, segments, window, context, cc, expected):
    choice = zattn.choose(plat, dtype, hd, mask=mask, segments=segments, window=window, context=context, capability=cc)
    assert choice.kind == expected, choice
    assert choice.reason  # always says why


def test_every_fallback_names_its_reason():
    """Where the fused default falls back on a CUDA GPU, the reason names the fact."""
    why = lambda **kw: zattn.choose(**{"platform": "cuda", "dtype": BF16, "head_dim": 128, **kw}).reason
    assert "float32" in why(dtype=F32)
    assert "head_dim 100" in why(head_dim=100) and "multiple of 8 up to 128" in why(head_dim=100)
    assert "key mask" in why(mask=True)
    assert "segment ids" in why(segments=True)
    assert "per-layer windows" in why(window=None)
    assert "'cpu'" in zattn.choose("cpu", BF16, 128).reason


CFG = dict(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16)
B, T = 2, 16


def _batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [11]]))  # the second row right-padded
    segments = jnp.asarray(np.repeat([[0] * 6 + [1] * 10], B, 0), jnp.int32)
    return tokens, mask, segments


@functools.cache
def _compiled(attention: str, window: int = 0, per_layer: bool = False):
    """A compiled forward and gradient of the Llama (GQA, one window or per-layer windows),
    with its params, for the keyword set (mask, segments) given at call time."""
    extra = dict(sliding_window=window, window_layers=(True, False) if per_layer else None)
    cfg = llama.LlamaConfig(**CFG, attention=attention, **extra)
    graphdef, params = llama.init(cfg)

    def loss(p, tokens, mask, segments):
        logits = nnx.merge(graphdef, p)(tokens, mask=mask, segment_ids=segments)
        return (logits.astype(jnp.float32) ** 2).mean(), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), params


# One window on every layer in the slow set: the per-layer case's first layer has that window
# (and its second none), on the same path.
@pytest.mark.parametrize("window,per_layer", models.marked_slow([(0, False), (5, False), (5, True)], slow=[(5, False)]))
def test_the_default_on_a_cpu_is_the_einsum_path_bit_for_bit(window, per_layer):
    """attention="fused" on a CPU runs the einsum attention: logits and gradients equal to the
    last bit, with and without a key mask and segment ids; the compiled programs name it."""
    tokens, mask, segments = _batch()
    fused, params = _compiled("fused", window, per_layer)
    einsum, params_e = _compiled("einsum", window, per_layer)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_e)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for m, s in [(None, None), (mask, segments)]:
        (l1, x1), g1 = fused(params, tokens, m, s)
        (l2, x2), g2 = einsum(params, tokens, m, s)
        np.testing.assert_array_equal(np.asarray(x1), np.asarray(x2))
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for f in (fused, einsum):
        compiled = f.lower(params, tokens, mask, segments).compile()
        assert zattn.ran(compiled) == ("einsum",)
        assert "attention_einsum" in compiled.as_text()


def test_the_cudnn_branch_computes_the_einsum_attention(monkeypatch):
    """The model's cuDNN call (causal, the window as (w - 1, 0), GQA's heads, JAX's default
    scale), run through JAX's XLA implementation on a CPU in float32: the einsum path's
    logits. The platform and the choice are made to say "cudnn"; the call must ask JAX for
    implementation="cudnn"."""
    calls = []
    jax_attention = jax.nn.dot_product_attention

    def as_xla(*args, implementation=None, **kw):
        calls.append(implementation)
        return jax_attention(*args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
    monkeypatch.setattr(zattn, "choose", lambda *a, **k: zattn.Choice("cudnn", "forced"))
    tokens, _, _ = _batch()
    for window in (0, 5):
        cfg = dict(CFG, sliding_window=window)
        graphdef, params = llama.init(llama.LlamaConfig(**cfg, attention="fused"))
        ref_def = llama.init_abstract(llama.LlamaConfig(**cfg, attention="einsum"))[0]
        run = lambda d: jax.jit(lambda p, x: nnx.merge(d, p)(x))
        compiled = run(graphdef).lower(params, tokens).compile()
        assert zattn.ran(compiled) == () and "attention_cudnn" in compiled.as_text()
        np.testing.assert_allclose(
            np.asarray(compiled(params, tokens)), np.asarray(run(ref_def)(params, tokens)), atol=2e-5
        )
    assert calls and set(calls) == {"cudnn"}
    # GPT's cuDNN call too
    cfg = gpt.GPTConfig(vocab=64, seq_len=T, d_model=32, n_layers=2, n_heads=4)
    graphdef, params = gpt.init(cfg)
    ref_def = gpt.init_abstract(gpt.GPTConfig(**{**cfg.__dict__, "attention": "einsum"}))[0]
    fwd = lambda d: jax.jit(lambda p, x: nnx.merge(d, p)(x))(params, tokens)
    np.testing.assert_allclose(np.asarray(fwd(graphdef)), np.asarray(fwd(ref_def)), atol=2e-5)


def test_a_gpu_fallback_says_so_once(monkeypatch):
    """On a (pretended) CUDA GPU a float32 Llama cannot take cuDNN: it runs the einsum path
    and warns, naming the reason and the scores' size, once per reason."""
    monkeypatch.setattr(zattn, "platform", lambda: "cuda")
    monkeypatch.setattr(zattn, "_WARNED", set())
    tokens, _, _ = _batch()
    graphdef, params = llama.init(llama.LlamaConfig(**CFG))
    with pytest.warns(UserWarning, match=r"float32 attention: cuDNN.*bfloat16.*0\.0 MiB of scores per layer"):
        jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).lower(params, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda p, x: nnx.merge(graphdef, p)(x) + 1).lower(params, tokens)


def test_gpt_default_on_a_cpu_is_the_einsum_path_bit_for_bit():
    cfg = gpt.GPTConfig(vocab=64, seq_len=T, d_model=32, n_layers=2, n_heads=4)
    graphdef, params = gpt.init(cfg)
    ref_def = gpt.init_abstract(gpt.GPTConfig(**{**cfg.__dict__, "attention": "einsum"}))[0]
    tokens, _, _ = _batch()
    grads = lambda d: jax.jit(jax.grad(lambda p: (nnx.merge(d, p)(tokens) ** 2).mean()))
    compiled = grads(graphdef).lower(params).compile()
    assert zattn.ran(compiled) == ("einsum",)
    for a, b in zip(jax.tree.leaves(compiled(params)), jax.tree.leaves(grads(ref_def)(params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_on_a_context_mesh_the_default_takes_the_context_kernels():
    """With a layout of 2 devices handed in (the step's), "fused" runs zj.nn.dot_product_attention
    (method "auto"), equal to one device's einsum; the compiled program names it."""
    tokens, _, _ = _batch()
    graphdef, params = llama.init(llama.LlamaConfig(**CFG))
    ref_def = llama.init_abstract(llama.LlamaConfig(**CFG, attention="einsum"))[0]
    want = jax.jit(lambda p, x: nnx.merge(ref_def, p)(x))(params, tokens)
    mesh = zj.make_mesh(context=2)
    with jax.set_mesh(mesh):
        lay = zj.context.Layout("contiguous", 2)
        f = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, layout=lay))
        compiled = f.lower(params, tokens).compile()
        assert zattn.ran(compiled) == ("auto",)
        np.testing.assert_allclose(np.asarray(compiled(params, tokens)), np.asarray(want), atol=2e-5)


def test_config_values():
    assert llama.LlamaConfig().attention == "fused" and gpt.GPTConfig().attention == "fused"
    with pytest.raises(ValueError, match=r"LlamaConfig.attention must be one of \('fused', 'einsum', 'auto'"):
        llama.LlamaConfig(attention="cudnn")
    with pytest.raises(ValueError, match=r"GPTConfig.attention must be one of \('fused', 'einsum'\)"):
        gpt.GPTConfig(attention="ring")
    # per-layer windows: the default and "einsum" take them, a zj.nn method refuses them
    llama.LlamaConfig(**CFG, sliding_window=4, window_layers=(True, False))
    with pytest.raises(ValueError, match="takes one window for every layer"):
        llama.LlamaConfig(**CFG, sliding_window=4, window_layers=(True, False), attention="ring")
