"""Context parallelism: the sequence split over a "context" axis beside ZeRO.

The kernels (Ulysses, ring) against ``jax.nn.dot_product_attention`` on the global arrays
(values and gradients, causal and padded, GQA, balanced layout); their collectives in the
compiled HLO against the formulas; and the experiments' Llama (RoPE, GQA, a padding mask)
trained on ``zj.make_mesh(context=C)`` against single-device optax, with attention written
in plain ops (partitioned by XLA) and with each kernel."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests.models import abs_errors, reference_run
from zerojax.context import Layout
from zerojax.models import llama
from zerojax.report.comm import collectives

B, H = 2, 8


def _mesh(c: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(8 // c, c), ("data", "context"), axis_types=(AxisType.Auto,) * 2)


def _qkv(t, n, k, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, t, n, H)),
        jax.random.normal(ks[1], (B, t, k, H)),
        jax.random.normal(ks[2], (B, t, k, H)),
    )


def _ours(c, method, layout, q, k, v, bias=None, mask=None, grad=False, **kw):
    """zj.nn.dot_product_attention on the layout-permuted arrays, split over the context
    axis, under jax.set_mesh; the result (or gradients) back in natural order."""
    t = q.shape[1]
    perm, inv = Layout(layout, c).order(t), Layout(layout, c).inverse(t)
    q, k, v = (x[:, perm] for x in (q, k, v))
    if mask is not None:
        mask = mask[:, :, perm][:, :, :, perm] if mask.shape[2] > 1 else mask[..., perm]
    if bias is not None:
        bias = bias[:, :, perm][:, :, :, perm]
    mesh = _mesh(c)
    sh = NamedSharding(mesh, P(None, "context"))
    attend = lambda q, k, v: zj.nn.dot_product_attention(q, k, v, bias, mask, method=method, layout=layout, **kw)
    fn = jax.grad(lambda q, k, v: (attend(q, k, v) ** 2).sum(), argnums=(0, 1, 2)) if grad else attend
    with jax.set_mesh(mesh):
        out = jax.jit(fn)(*(jax.device_put(x, sh) for x in (q, k, v)))
    return tuple(np.asarray(o)[:, inv] for o in out) if grad else np.asarray(out)[:, inv]


@pytest.mark.slow  # reason: 16 s; test_attention's causal-ring skipping tests cover both layouts
@pytest.mark.parametrize("c,layout", [(2, "contiguous"), (4, "balanced")])
def test_causal_ring_leaves_out_the_masked_chunks_exactly(c, layout):
    """Causal ring attention computes only what the mask keeps (a switch per ring step:
    nothing, a whole chunk, or half of one), and merges what it leaves out as what it is
    (every logit masked), so a row that sees no key (a sequence of no keys: JAX's mean of
    every value) is exact too; with a bias, values and gradients are JAX's. A mask keeps
    the skipping on."""
    q, k, v = _qkv(16, 4, 2)
    bias = jax.random.normal(jax.random.key(2), (B, 4, 16, 16))
    for lens in (jnp.array([16, 7]), jnp.array([16, 0])):
        kw = dict(is_causal=True, key_value_seq_lengths=lens)
        want = jax.nn.dot_product_attention(q, k, v, bias, **kw)
        np.testing.assert_allclose(_ours(c, "ring", layout, q, k, v, bias, **kw), want, atol=2e-6)
    want = jax.grad(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, bias, **kw) ** 2).sum(), argnums=(0, 1, 2))(
        q, k, v
    )
    for g, w in zip(_ours(c, "ring", layout, q, k, v, bias, grad=True, **kw), want):
        np.testing.assert_allclose(g, w, atol=1e-5)
    mesh, sh = _mesh(c), NamedSharding(_mesh(c), P(None, "context"))
    mask = jnp.ones((1, 1, 1, 16), bool)
    with jax.set_mesh(mesh):
        text = (
            jax.jit(
                lambda q, k, v: zj.nn.dot_product_attention(
                    q, k, v, mask=mask, is_causal=True, method="ring", layout=layout
                )
            )
            .lower(*(jax.device_put(x, sh) for x in (q, k, v)))
            .as_text()
        )
    assert "stablehlo.case" in text  # the ring steps branch on which chunk arrived


def test_off_a_context_mesh_it_is_jax_function():
    q, k, v = _qkv(16, 4, 2)
    np.testing.assert_array_equal(
        np.asarray(zj.nn.dot_product_attention(q, k, v, is_causal=True)),
        np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    )


def _forward_collectives(c, method, t=32, n=8, kh=8):
    mesh = _mesh(c)
    sh = NamedSharding(mesh, P(None, "context"))
    args = [jax.ShapeDtypeStruct((B, t, x, H), jnp.float32, sharding=sh) for x in (n, kh, kh)]
    fn = jax.jit(lambda q, k, v: zj.nn.dot_product_attention(q, k, v, is_causal=True, method=method))
    with jax.set_mesh(mesh):
        text = fn.lower(*args).compile().as_text()
    return collectives(text)


@pytest.mark.parametrize("c", [2, 4])
def test_collectives_are_the_formulas(c):
    """Ulysses: 4 all-to-alls (q, k, v, output) of B·S·N·H/C elements each; ring: C − 1
    collective-permutes of K and of V, B·S·K·H/C elements each; neither gathers the sequence."""
    t, n = 32, 8
    per = B * t * n * H // c * 4  # fp32 bytes of one device's chunk
    uly = _forward_collectives(c, "ulysses", t, n, n)
    assert {x.kind for x in uly} == {"all-to-all"} and sum(x.count for x in uly) == 4
    assert all(x.bytes == per for x in uly), [x.bytes for x in uly]
    ring = _forward_collectives(c, "ring", t, n, n)  # K and V permuted in a loop of C - 1 steps
    assert {x.kind for x in ring} == {"collective-permute"} and sum(x.count for x in ring) == 2 * (c - 1)
    assert all(x.bytes == per for x in ring)


def test_bad_lengths_and_heads_are_refused_with_the_fix():
    q, k, v = _qkv(12, 4, 2)
    mesh = _mesh(8)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            ValueError,
            match=r"12 does not split into 8 context devices: use a "
            r"multiple of 8 \(e.g. 8 or 16\)",
        ),
    ):
        zj.nn.dot_product_attention(q, k, v, method="ring")
    q, k, v = _qkv(8, 4, 2)  # 8 splits over 8 devices, not into the balanced layout's 16 chunks
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            ValueError,
            match=r"length 8 does not split into 2 x 8 chunks.*multiple "
            r"of 16 \(e.g. 16\)",
        ),
    ):
        zj.nn.dot_product_attention(q, k, v, method="ring", layout="balanced")
    q, k, v = _qkv(16, 4, 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"4 query heads over the 8 devices.*method='ring'"):
        zj.nn.dot_product_attention(q, k, v, method="ulysses")
    with pytest.raises(ValueError, match="attention dropout"):
        zj.nn.dot_product_attention(q, k, v, dropout_rate=0.1)


def test_make_mesh_with_a_context_axis():
    assert dict(zj.make_mesh(context=4).shape) == {"data": 2, "context": 4}
    assert dict(zj.make_mesh(context=2, tensor=2).shape) == {"data": 2, "context": 2, "tensor": 2}
    assert dict(zj.make_mesh(context=2, replicas=2).shape) == {"replica": 2, "data": 2, "context": 2}
    with pytest.raises(ValueError, match=r"context=3.*Use context in \[1, 2, 4, 8\]"):
        zj.make_mesh(context=3)


# Training: the experiments' Llama with GQA, RoPE from jnp.arange (or from the batch) and a
# padding mask, against single-device optax.
BASE = llama.LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16)


def _data(with_positions: bool = False):
    return _cached_data(with_positions)  # one cache key with or without the default


@functools.cache
def _cached_data(with_positions: bool):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        toks = jnp.asarray(rng.integers(0, 64, (8, 17)), jnp.int32)
        m = jnp.asarray(np.arange(17)[None] < rng.integers(9, 17, 8)[:, None])
        w = m[:, 1:].astype(jnp.float32)
        b = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": m[:, :-1], "weights": w * (w.size / w.sum())}
        if with_positions:
            b["positions"] = jnp.broadcast_to(jnp.arange(16) + 5, (8, 16))
        out.append(b)
    return tuple(out)


def _reference(with_positions: bool = False):
    return _cached_reference(with_positions)  # one cache key with or without the default


@functools.cache
def _cached_reference(with_positions: bool):
    graphdef, params = llama.init(BASE)
    return reference_run(
        llama.make_loss(graphdef), jax.tree.map(jnp.asarray, params), optax.sgd(0.3), list(_data(with_positions))
    )


@functools.cache  # (4, "ring", 3) trains for three tests: its step compiles once
def _train(c, attention, stage, tensor=1, with_positions=False, layout="contiguous"):
    """The trained state (read, never stepped again: a cached run is shared), the step and the losses."""
    cfg = llama.LlamaConfig(**{**BASE.__dict__, "attention": attention, "tensor_parallel": tensor > 1})
    graphdef, params = llama.init(cfg)
    tx, mesh = optax.sgd(0.3), zj.make_mesh(context=c, tensor=tensor)
    zc = zj.ZeroConfig(stage=stage, context={"layout": layout})
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc, with_layout=layout != "contiguous")
    losses = []
    for b in _data(with_positions):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, step, tuple(losses)


def _check(state, losses, with_positions=False):
    ref, ref_losses = _reference(with_positions)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
    for a, b in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize(
    "c,attention,stage",
    [
        # slow: 10 s; plain-ops attention on a context mesh trains in the stock linen test too
        pytest.param(4, "einsum", 3, marks=pytest.mark.slow),
        # slow: 11 s; Ulysses trains exactly beside a tensor axis and in the balanced layout
        # below, and its key/value head repeat (2 heads, C = 4) is test_attention's
        pytest.param(4, "ulysses", 3, marks=pytest.mark.slow),
        (4, "ring", 3),
        pytest.param(2, "ulysses", 0, marks=pytest.mark.slow),
        pytest.param(8, "ring", 1, marks=pytest.mark.slow),
        pytest.param(8, "auto", 2, marks=pytest.mark.slow),
        pytest.param(2, "einsum", 1, marks=pytest.mark.slow),
    ],
)  # slow: each further (C, attention, stage) compiles a step (about 4 s)
def test_llama_on_a_context_mesh_trains_as_on_one_device(c, attention, stage):
    state, step, losses = _train(c, attention, stage)
    _check(state, losses)
    # ZeRO shards over data x context: every device holds 1/8 of each stage-3 master.
    if stage == 3:
        for w in jax.tree.leaves(state.master):
            assert w.addressable_shards[0].data.size * 8 == w.size
        psi = sum(l.size for l in state.plan.layouts)
        assert zj.report.state_bytes_per_device(state)["total"] == pytest.approx(
            zj.report.zero_formula_bytes(psi, 8, 3, opt_bytes=0), abs=64
        )


@pytest.mark.slow  # reason: 6 s; the balanced Ulysses case below takes positions from the batch too
def test_positions_from_the_batch_are_split_with_it():
    state, _, losses = _train(4, "ring", 3, with_positions=True)
    _check(state, losses, with_positions=True)


@pytest.mark.parametrize(
    "c,attention,with_positions",
    [
        # slow: 5 s; ring in the balanced layout at stage 3 trains in the packed-sequence test too
        pytest.param(4, "ring", False, marks=pytest.mark.slow),
        (2, "ulysses", True),
    ],
)
def test_the_balanced_layout_trains_as_on_one_device(c, attention, with_positions):
    """context_layout="balanced": the step permutes inputs, targets, mask, weights (and
    positions from the batch) into the balanced order; the model's RoPE positions come from
    zj.nn.global_positions, the kernel takes the layout from the step. Single-device optax's
    losses and parameters, and the batch leaves arrive permuted (the ring's tokens in the
    HLO are the permutation's: no all-gather of the batch over "context")."""
    state, step, losses = _train(c, attention, 3, with_positions=with_positions, layout="balanced")
    _check(state, losses, with_positions)


def test_the_balanced_layout_refuses_plain_ops_attention():
    """Plain-ops causal attention would see the permuted sequence as if it were in order: its
    causal mask (an iota over the sequence) meets the permuted positions, refused before
    compiling at the model's line."""
    with pytest.raises(
        ValueError,
        match=r"(?s)context=\{'layout': 'balanced'\}.*llama.py:\d+ \(Block.attention\).*"
        r"index in natural order.*zj.nn.dot_product_attention",
    ):
        _train(2, "einsum", 1, layout="balanced")
    with pytest.raises(ValueError, match=r"ContextParallel.layout must be 'contiguous' or 'balanced'"):
        zj.ZeroConfig(context={"layout": "zigzag"})
    graphdef, params = llama.init(BASE)
    mesh, zc = zj.make_mesh(context=8), zj.ZeroConfig(stage=1, context={"layout": "balanced"})
    step = zj.make_train_step(llama.make_loss(graphdef), optax.sgd(0.1), mesh=mesh, config=zc)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=zc)
    b = {k: v[:, :8] for k, v in _data()[0].items()}  # 8 splits over 8 devices, not into 16 chunks
    with pytest.raises(ValueError, match=r"does not split into 2 x 8 chunks.*multiple of 16"):
        step(state, b)


def test_the_step_hands_the_loss_its_layout_as_a_value():
    """with_layout=True: the loss gets the step's zj.context.Layout (no ambient state), and
    zj.nn.global_positions(T, layout) gives its positions."""
    seen = []

    def loss(p, b, layout):
        seen.append(layout)
        return (
            jnp.mean((b["x"] * p["w"]) ** 2)
            + 0.0 * zj.nn.dot_product_attention(b["q"], b["q"], b["q"], is_causal=True, layout=layout).sum()
        )

    mesh = zj.make_mesh(context=2)
    for kind in ("contiguous", "balanced"):
        zc = zj.ZeroConfig(stage=0, context={"layout": kind})
        st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
        zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=zc, with_layout=True).lower(
            st, {"x": jnp.ones((4, 8)), "q": jnp.ones((4, 8, 2, 4))}
        )
        assert set(seen) == {zj.context.Layout(kind, 2)}
        seen.clear()
        with jax.set_mesh(mesh):
            np.testing.assert_array_equal(
                np.asarray(zj.nn.global_positions(8, zj.context.Layout(kind, 2))), Layout(kind, 2).order(8)
            )
    np.testing.assert_array_equal(np.asarray(zj.nn.global_positions(8)), np.arange(8))
    with pytest.raises(TypeError, match=r"loss_fn\(params, batch, layout=...\) with with_layout=True"):
        zj.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh=mesh, config=zc, with_layout=True)


@pytest.mark.parametrize(
    "c,attention,stage",
    [
        # slow: 5 s; Ulysses trains exactly on a context mesh above, and C = 4 ring beside
        # the tensor axis stays here
        pytest.param(2, "ulysses", 3, marks=pytest.mark.slow),
        (4, "ring", 2),  # data x context x tensor = 1 x 4 x 2
        pytest.param(2, "einsum", 0, marks=pytest.mark.slow),
        pytest.param(2, "ring", 1, marks=pytest.mark.slow),
    ],
)
def test_a_tensor_axis_beside_the_context_axis_trains_as_on_one_device(c, attention, stage):
    """T = 2 beside C: the Llama's weights split over "tensor" (heads, MLP features), its
    sequences over "context", the state over data x context; 3 SGD steps within 1e-5 of
    single-device optax. Its loss picks each target's logit with optax's
    take_along_axis, a gather XLA's partitioner aborts on when the logits are split over
    both axes: zerojax rewrites it (zerojax.sharding.gathers). At C = 4 the data axis has
    one device."""
    ref, ref_losses = _reference()
    state, step, losses = _train(c, attention, stage, tensor=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert abs_errors(zj.gather_params(state), ref).max() <= 1e-5
    assert dict(state.plan.mesh.shape) == {"data": 8 // (2 * c), "context": c, "tensor": 2}


def test_a_sequence_the_context_axis_does_not_divide_is_refused_before_compiling():
    cfg = llama.LlamaConfig(**BASE.__dict__)
    graphdef, params = llama.init(cfg)
    mesh, zc = zj.make_mesh(context=4), zj.ZeroConfig(stage=3)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=zc)
    step = zj.make_train_step(llama.make_loss(graphdef), optax.sgd(0.1), mesh=mesh, config=zc)
    toks = jnp.zeros((8, 18), jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"\['inputs'\]'s sequence length \(dimension 1\) 17 does not split into 4 "
        r"context devices: use a multiple of 4 \(e.g. 16 or 20\)",
    ):
        step(state, {"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    assert step._compiles == 0


@pytest.mark.slow  # eleven more compiled steps (about 50 s)
@pytest.mark.parametrize(
    "name,kw,attention,tol",
    [
        ("remat full", dict(remat="full"), "ring", 1e-5),
        ("prefetch", dict(prefetch=1), "ring", 1e-5),
        ("offload", dict(offload={"optimizer": True, "params": True}), "ring", 1e-5),
        ("accumulation", dict(grad_accum_steps=2), "ulysses", 1e-5),  # 2 micro-batches of 2 rows per data group
        # Narrow precisions against the fp32 reference (measured: bf16 6.5e-3, fp16 1.3e-3, int8
        # gathers 1.7e-3, int8 gradients 2.5e-4 of the loss, jax 0.10).
        ("bf16", dict(compute_dtype="bfloat16"), "ulysses", 2e-2),
        ("fp16", dict(compute_dtype="float16"), "ring", 5e-3),
        ("int8 gathers", dict(collectives={"gather_dtype": "int8"}), "ring", 5e-3),
        ("int8 gradients", dict(collectives={"reduce_dtype": "int8"}), "ring", 1e-3),
        ("hybrid", dict(replicas=2), "ring", 1e-5),
        # The balanced layout with several features at once (its chunks of 16 / 4 = 4 tokens).
        (
            "balanced + remat + prefetch + accumulation + hybrid",
            dict(context={"layout": "balanced"}, remat="full", prefetch=1, grad_accum_steps=2, replicas=2),
            "ring",
            1e-5,
        ),
        ("balanced + fp16", dict(context={"layout": "balanced"}, compute_dtype="float16"), "ring", 5e-3),
    ],
)
def test_context_parallelism_with_the_other_features(name, kw, attention, tol):
    cfg = llama.LlamaConfig(**{**BASE.__dict__, "attention": attention})
    graphdef, params = llama.init(cfg)
    kw = dict(kw)
    mesh = zj.make_mesh(context=2, replicas=kw.pop("replicas", 1))
    tx, zc = optax.sgd(0.3), zj.ZeroConfig(stage=3, **kw)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(
        llama.make_loss(graphdef), tx, mesh=mesh, config=zc, with_layout=zc.context.layout == "balanced"
    )
    losses = []
    for b in _data():
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, _reference()[1], atol=tol)
    if tol <= 1e-5:
        _check(state, losses)


def test_a_checkpoint_saved_at_one_context_size_restores_at_another(tmp_path):
    state, step, _ = _train(4, "ring", 3)
    zj.save_checkpoint(tmp_path / "ck", state, 3)
    graphdef, params = llama.init(BASE)
    for mesh, context in ((zj.make_mesh(context=2), 2), (zj.make_mesh(), 1)):
        again = zj.restore_checkpoint(tmp_path / "ck", params, optax.sgd(0.3), mesh=mesh, config=zj.ZeroConfig(stage=1))
        for a, b in zip(jax.tree.leaves(zj.gather_params(again)), jax.tree.leaves(zj.gather_params(state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert again.plan.shards == 8 and again.plan.context == context


class _TinyLM(nnx.Module):
    """NNX's own MultiHeadAttention, causal, with ``attention_fn``."""

    def __init__(self, attention_fn, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 16, decode=False, attention_fn=attention_fn, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.attn(x, is_causal=True))


@pytest.mark.slow  # reason: 16 s; linen's attention layer with the kernel stays in the default set
def test_nnx_multi_head_attention_with_the_kernel_on_a_context_mesh():
    """zj.nnx.Optimizer on a context mesh, NNX's MultiHeadAttention calling
    zj.nn.dot_product_attention (Ulysses), against plain nnx.Optimizer with NNX's attention."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, 17)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss_fn(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b["inputs"]), b["targets"]).mean()

    ref = _TinyLM(nnx.dot_product_attention, nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.sgd(0.5), wrt=nnx.Param)
    ref_losses = []
    for _ in range(3):
        loss, grads = nnx.value_and_grad(loss_fn)(ref, batch)
        opt.update(ref, grads)
        ref_losses.append(float(loss))
    model = _TinyLM(functools.partial(zj.nn.dot_product_attention, method="ulysses"), nnx.Rngs(0))
    zopt = zj.nnx.Optimizer(model, optax.sgd(0.5), mesh=zj.make_mesh(context=4), config=zj.ZeroConfig(stage=3))
    step = zj.nnx.make_train_step(loss_fn)
    np.testing.assert_allclose([float(step(zopt, batch)["loss"]) for _ in range(3)], ref_losses, atol=1e-5)


@pytest.mark.slow  # four processes start JAX (about 15 s)
def test_each_process_loads_only_its_rows_and_sequence_chunks(tmp_path):
    """4 processes x 2 devices on data 2 x context 4: process p holds data group p // 2 and
    context positions 2(p % 2), 2(p % 2) + 1, so it loads those rows and that half of each
    sequence, and training equals single-device optax."""
    import io
    import json
    import pathlib
    import sys

    from zerojax import launch

    root = pathlib.Path(__file__).resolve().parents[1]
    # The launcher in this process (its processes are real ones): a launcher process of its
    # own would import JAX for nothing.
    out = io.StringIO()
    code = launch.launch(
        [sys.executable, str(root / "tests" / "workers" / "context_job.py"), str(tmp_path)],
        4,
        2,
        timeout_s=400,
        out=out,
    )
    assert code == 0, out.getvalue()[-6000:]
    ref_params, ref_losses = _reference()
    for p in range(4):
        r = json.loads((tmp_path / f"losses_rank{p}.json").read_text())
        assert r["rows"] == [4 * (p // 2), 4 * (p // 2) + 4] and r["cols"] == [8 * (p % 2), 8 * (p % 2) + 8]
        np.testing.assert_allclose(r["losses"], ref_losses, atol=1e-5)
    got = np.load(tmp_path / "params.npz")
    for i, want in enumerate(jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got[f"arr_{i}"], np.asarray(want), atol=1e-5)


@pytest.mark.slow  # reason: 12 s, an eval and a train step compiled on a context mesh beside a reference
def test_the_eval_step_splits_the_sequence_too():
    """make_eval_step on a context mesh: the loss and per-token logits of the trained state,
    as the model computes them on one device."""
    state, _, _ = _train(4, "ring", 3)
    graphdef = llama.init(llama.LlamaConfig(**{**BASE.__dict__, "attention": "ring"}))[0]
    loss_fn = llama.make_loss(graphdef)
    b = _data()[0]
    fn = lambda p, b: {"loss": loss_fn(p, b), "logits": nnx.merge(graphdef, p)(b["inputs"], mask=b["mask"])}
    ev = zj.make_eval_step(
        fn, mesh=state.plan.mesh, config=state.plan.config, reduce={"loss": "mean", "logits": "concat"}
    )
    out = ev(state, b)
    want_loss = loss_fn(zj.gather_params(state), b)
    np.testing.assert_allclose(float(out["loss"]), float(want_loss), atol=1e-5)
    want = nnx.merge(graphdef, zj.gather_params(state))(b["inputs"], mask=b["mask"])
    np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(want), atol=1e-5)
    with pytest.raises(ValueError, match="does not split into 4 context devices"):
        ev(state, {k: v[:, :15] for k, v in b.items()})


def test_linen_attention_with_the_kernel_on_a_context_mesh():
    """linen's MultiHeadDotProductAttention (it passes an attention_fn only the keywords the
    function names) with a causal mask, the kernel as its attention_fn, on a context mesh,
    against the same module with Flax's attention on one device; its dropout is refused,
    never silently left out."""
    from flax import linen as nn

    class LM(nn.Module):
        attention_fn: Any = nn.dot_product_attention
        dropout: float = 0.0

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(32, 16)(tokens)
            mask = nn.make_causal_mask(tokens)
            x = x + nn.MultiHeadDotProductAttention(
                4, qkv_features=16, attention_fn=self.attention_fn, dropout_rate=self.dropout, deterministic=False
            )(x, mask=mask)
            return nn.Dense(32)(x)

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (4, 17)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = jax.jit(LM().init)(jax.random.key(0), batch["inputs"])["params"]  # one compile, not one per operation
    loss = lambda model: (
        lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": p}, b["inputs"]), b["targets"]
        ).mean()
    )
    tx = optax.sgd(0.5)
    ref, ref_losses = reference_run(loss(LM()), params, tx, [batch] * 3)
    kernel = LM(functools.partial(zj.nn.dot_product_attention, method="ring"))
    mesh, zc = zj.make_mesh(context=4), zj.ZeroConfig(stage=2)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(loss(kernel), tx, mesh=mesh, config=zc)
    losses = []
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
    with pytest.raises(ValueError, match="attention dropout"):
        LM(zj.nn.dot_product_attention, dropout=0.1).init(
            {"params": jax.random.key(0), "dropout": jax.random.key(1)}, batch["inputs"]
        )


@pytest.mark.slow  # reason: 10 s; the tensor axis beside the context axis trains exactly in the default set (Llama)
def test_a_stock_linen_model_on_tensor_and_context_axes():
    """A linen model of stock layers (Embed, MultiHeadDotProductAttention with a causal mask,
    Dense with logical axes: the head's vocabulary over "tensor") and optax's integer-label
    cross-entropy, on data x context x tensor = 2 x 2 x 2 at stage 3: the train step within
    1e-5 of single-device optax (SGD, 3 steps) and the eval step's loss the reference's."""
    from flax import linen as nn

    axes = lambda *names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(32, 16)(tok)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x, mask=nn.make_causal_mask(tok))
            hidden = nn.gelu(nn.Dense(32, kernel_init=axes("embed", "mlp"))(x))
            x = x + nn.Dense(16, kernel_init=axes("mlp", "embed"))(hidden)
            return nn.Dense(32, kernel_init=axes("embed", "vocab"))(x)

    model = LM()
    boxed = model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
    loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, b["inputs"]), b["targets"]
    ).mean()
    rng = np.random.default_rng(0)
    data = [{k: jnp.asarray(rng.integers(0, 32, (8, 8)), jnp.int32) for k in ("inputs", "targets")} for _ in range(3)]
    tx = optax.sgd(0.5)
    ref, ref_losses = reference_run(loss_fn, nn.unbox(boxed), tx, data)
    mesh = zj.make_mesh(context=2, tensor=2)
    zc = zj.ZeroConfig(stage=3, axes={"rules": (("vocab", "tensor"), ("mlp", "tensor"), ("embed", None))})
    state = zj.init_state(boxed, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=zc)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert abs_errors(zj.gather_params(state), ref).max() <= 1e-5
    assert state.master["Dense_2"]["kernel"].sharding.spec == P(("data", "context"), "tensor")
    got = zj.make_eval_step(loss_fn, mesh=mesh, config=zc)(state, data[0])
    np.testing.assert_allclose(float(got), float(loss_fn(zj.gather_params(state), data[0])), rtol=1e-5)


def test_sequence_and_tensor_marks_keep_the_context_split():
    """On data x context x tensor = 2 x 2 x 2, zj.nn.sequence_parallel splits the sequence over
    context x tensor (a quarter per device, not the half the tensor axis alone would leave),
    and zj.nn.tensor_parallel keeps the batch and the sequence where they were; the values
    are untouched."""
    mesh = zj.make_mesh(context=2, tensor=2)
    x = jax.device_put(jnp.arange(4 * 16 * 8.0).reshape(4, 16, 8), NamedSharding(mesh, P("data", "context")))
    with jax.set_mesh(mesh):
        for mark, shard in ((zj.nn.sequence_parallel, (2, 4, 8)), (zj.nn.tensor_parallel, (2, 8, 4))):
            out = jax.jit(lambda x: mark(x) * 2)(x)
            assert out.sharding.shard_shape(out.shape) == shard, (mark, out.sharding)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
        with pytest.raises(ValueError, match=r"mesh axis 'context x tensor' \(4 devices\) does not divide.*8 or 12"):
            jax.jit(zj.nn.sequence_parallel)(jnp.ones((4, 10, 8)))


def test_global_batch_takes_the_axis_names_of_the_step():
    """A mesh whose tensor axis is named "model": the rows split over the data axis only (the
    tensor devices share them), the sequence over context, as the step splits them."""
    mesh = zj.make_mesh(context=2, tensor=2, tensor_axis="model")
    zc = zj.ZeroConfig(axes={"tensor": "model"})
    local = {"tokens": np.arange(4 * 8).reshape(4, 8), "label": np.arange(4)}
    for b in (
        zj.distributed.global_batch(local, mesh, config=zc),
        zj.distributed.global_batch(local, mesh, tensor_axis="model"),
    ):
        assert b["tokens"].sharding.spec == P(("data",), "context") and b["label"].sharding.spec == P(("data",))
        np.testing.assert_array_equal(np.asarray(b["tokens"]), local["tokens"])
    assert zj.distributed.process_slices(4, 8, mesh, config=zc) == (slice(0, 4), slice(0, 8))


# The balanced layout cannot be silently wrong: a loss that mixes positions along a
# permuted sequence is refused before compiling, naming its line; what is exact trains as
# on one device.


def _balanced_step(loss, c=4, dims=None):
    mesh, zc = zj.make_mesh(context=c), zj.ZeroConfig(stage=1, context={"layout": "balanced", "dims": dims})
    return mesh, zc, zj.make_train_step(loss, optax.sgd(0.1), mesh=mesh, config=zc, with_layout=True)


def test_a_loss_that_shifts_its_own_targets_is_refused_on_the_balanced_layout():
    graphdef, params = llama.init(llama.LlamaConfig(**{**BASE.__dict__, "attention": "ring"}))
    loss = llama.make_loss(graphdef)  # {"tokens"}: logits[:, :-1] against tokens[:, 1:]
    mesh, zc, step = _balanced_step(loss)
    state = zj.init_state(params, optax.sgd(0.1), mesh=mesh, config=zc)
    tokens = jnp.zeros((8, 16), jnp.int32)  # the model then sees 15 positions, which do not split either
    with pytest.raises(
        ValueError,
        match=r"sequence length 15 does not split.*slices the batch's sequence.*give the "
        r"shifted targets in the batch",
    ):
        step(state, {"tokens": tokens})

    def shifted(p, b, layout):  # where the lengths do split, the slices themselves are refused
        x = b["x"] * p["w"]
        return jnp.mean((x[:, :-8] - x[:, 8:]) ** 2)

    mesh, zc, step = _balanced_step(shifted)
    st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    with pytest.raises(
        ValueError,
        match=r"(?s)permuted.*test_context.py:\d+ \(.*shifted\).*'slice'.*shifted "
        r"targets in the batch",
    ):
        step(st, {"x": jnp.ones((8, 16))})

    def rolled(p, b, layout):  # a roll along the sequence is as wrong
        x = b["x"] * p["w"]
        return jnp.mean((x - jnp.roll(x, 1, axis=1)) ** 2)

    mesh, zc, step = _balanced_step(rolled)
    st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    with pytest.raises(ValueError, match=r"(?s)permuted.*test_context.py"):
        step(st, {"x": jnp.ones((8, 16))})


def test_positions_from_arange_are_refused_on_the_balanced_layout():
    """Positions built with jnp.arange(T) meet the permuted sequence: refused (the fix:
    zj.nn.global_positions(T, layout)); the same loss with global_positions trains."""

    def loss(p, b, layout, positions):
        angle = positions(b["x"].shape[1], layout)[None] * p["w"]
        return (
            jnp.mean(jnp.cos(angle) * b["x"])
            + 0.0 * zj.nn.dot_product_attention(b["q"], b["q"], b["q"], is_causal=True, layout=layout).sum()
        )

    batch = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32), "q": jnp.ones((8, 16, 4, 4))}
    arange = lambda t, layout: jnp.arange(t)
    mesh, zc, step = _balanced_step(lambda p, b, layout: loss(p, b, layout, arange))
    st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    with pytest.raises(ValueError, match=r"(?s)global_positions"):
        step(st, batch)
    mesh, zc, step = _balanced_step(lambda p, b, layout: loss(p, b, layout, zj.nn.global_positions))
    st, m = step(zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc), batch)
    want = jax.jit(lambda w: jnp.mean(jnp.cos(jnp.arange(16)[None] * w) * batch["x"]))(1.0)
    np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-6)


def test_which_leaves_are_sequences_is_explicit_on_the_balanced_layout():
    """A [B, T, T] mask is permuted on its rows and its columns when context_dims says so
    (exact, against one device); left to the default it is refused, as is a batch whose
    leaves disagree on the sequence length (a [B, 8] per-example leaf beside [B, 16])."""

    def loss(p, b, layout):
        q = b["q"] * p["w"]
        out = zj.nn.dot_product_attention(q, q, q, mask=b["mask"][:, None], layout=layout, method="ring")
        return jnp.mean(out**2)

    rng = np.random.default_rng(0)
    mask = rng.random((8, 16, 16)) < 0.7
    mask |= np.eye(16, dtype=bool)[None]
    batch = {"q": jnp.asarray(rng.normal(size=(8, 16, 2, 4)), jnp.float32), "mask": jnp.asarray(mask)}
    mesh, zc, step = _balanced_step(loss)
    st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    with pytest.raises(
        ValueError,
        match=r"\['mask'\] \[8, 16, 16\] has the sequence length 16 on dimension\(s\) "
        r"\[1, 2\].*context=\{'dims'",
    ):
        step(st, batch)
    mesh, zc, step = _balanced_step(loss, dims={"['q']": 1, "['mask']": (1, 2)})
    st, m = step(zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc), batch)
    want = jax.jit(
        lambda b: jnp.mean(jax.nn.dot_product_attention(b["q"], b["q"], b["q"], mask=b["mask"][:, None]) ** 2)
    )(batch)
    np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-5)

    def per_example(p, b, layout):
        return loss(p, b, layout) + jnp.mean(b["label"] * p["w"])

    mesh, zc, step = _balanced_step(per_example)
    st = zj.init_state({"w": jnp.ones(())}, optax.sgd(0.1), mesh=mesh, config=zc)
    with pytest.raises(ValueError, match=r"different lengths on dimension 1.*\['label'\] \[8, 8\].*context=\{'dims'"):
        step(st, {**batch, "label": jnp.ones((8, 8))})


@pytest.mark.slow  # reason: 12 s; each layout trains exactly against one device in the default set
def test_one_jitted_apply_serves_a_balanced_and_a_contiguous_step():
    """The layout is a static argument of the user's jitted function: each step traces it
    for its own layout, both exact. Without it (the layout not passed on), the balanced
    step refuses the kernel traced for the contiguous layout instead of training wrong."""
    cfg = llama.LlamaConfig(**{**BASE.__dict__, "attention": "ring"})
    graphdef, params = llama.init(cfg)
    apply = jax.jit(lambda p, x, layout: nnx.merge(graphdef, p)(x, layout=layout), static_argnums=2)

    def loss(p, b, layout):
        logits = apply(p, b["inputs"], layout)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    data = [{k: b[k] for k in ("inputs", "targets")} for b in _data()[:1]]
    ref_params, ref_losses = reference_run(
        lambda p, b: loss(p, b, None), jax.tree.map(jnp.asarray, params), optax.sgd(0.3), data
    )
    tx = optax.sgd(0.3)
    for kind in ("balanced", "contiguous"):
        mesh, zc = zj.make_mesh(context=4), zj.ZeroConfig(stage=1, context={"layout": kind})
        step = zj.make_train_step(loss, tx, mesh=mesh, config=zc, with_layout=True)
        state, losses = zj.init_state(params, tx, mesh=mesh, config=zc), []
        for b in data:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
        for a, b in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

    forgot = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))  # the kernel traced contiguous, once
    mesh, zc = zj.make_mesh(context=4), zj.ZeroConfig(stage=1, context={"layout": "balanced"})
    step = zj.make_train_step(
        lambda p, b: optax.softmax_cross_entropy_with_integer_labels(forgot(p, b["inputs"]), b["targets"]).mean(),
        tx,
        mesh=mesh,
        config=zc,
    )
    with pytest.raises(
        ValueError,
        match=r"traced for the 'contiguous' layout, but this step lays its sequences out "
        r"'balanced'",
    ):
        step(zj.init_state(params, tx, mesh=mesh, config=zc), data[0])


@pytest.mark.slow  # reason: 12 s, the doc's whole packed step; packed attention is test_attention's and test_combinations' packed rows
def test_packed_sequences_train_as_their_documents_alone():
    """docs/long_context.md's packed fine-tuning step, run as written (the Llama with ring
    attention in the balanced layout at ZeRO-3 on data x context = 4 x 2, segment ids and
    per-document positions): each document's logits in the packed row are its logits alone
    (plain-ops attention, one device), and the step's loss and parameters are single-device
    optax's on the same packed batch."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "long_context.md").read_text()
    section = text[text.index("### A packed fine-tuning step") :]
    ns: dict = {}
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "docs/long_context.md", "exec"), ns)
    batch, params, docs = ns["batch"], ns["params"], ns["docs"]
    plain = llama.LlamaConfig(**{**ns["cfg"].__dict__, "attention": "einsum"})
    plain_def = llama.init_abstract(plain)[0]
    run = jax.jit(lambda p, x, pos, seg: nnx.merge(plain_def, p)(x, positions=pos, segment_ids=seg))
    packed = np.asarray(run(params, batch["inputs"], batch["positions"], batch["segment_ids"]))
    for r, row in enumerate(docs):
        a = 0
        for doc in row:
            x = jnp.asarray(doc[None, :-1])
            alone = np.asarray(run(params, x, jnp.arange(x.shape[1])[None], jnp.zeros_like(x)))
            np.testing.assert_allclose(packed[r, a : a + x.shape[1]], alone[0], atol=1e-5)
            a += x.shape[1]
    ref, ref_losses = reference_run(
        llama.make_loss(plain_def), jax.tree.map(jnp.asarray, params), optax.adamw(1e-3), [batch]
    )
    np.testing.assert_allclose(float(ns["metrics"]["loss"]), ref_losses[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(zj.gather_params(ns["state"])), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
