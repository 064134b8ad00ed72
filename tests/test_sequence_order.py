"""zerojax.context.sequence_order: a loss that would be silently wrong on a sequence the
balanced layout permutes is refused before compiling, naming the op, its line and the fix;
an exact one passes. Each small loss is also evaluated on the permuted sequence: the ones
refused change value there, the ones passed do not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.context import Layout
from zerojax.context.sequence_order import check_sequence_order
from zerojax.models import llama

B, T, V, D, C = 2, 16, 12, 8, 4
ORDER = Layout("balanced", C).order(T)
LINE = r"test_sequence_order.py:\d+"
FIX = r"Give shifted targets in the batch.*zj.nn.global_positions.*zj.nn.dot_product_attention"
SCAN_FIX = r"Reduce over the sequence with an order-free op.*let the scan only accumulate into its carry"


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "logits": jax.random.normal(k[0], (B, T, V)),
        "tokens": jax.random.randint(k[1], (B, T), 0, V),
        "x": jax.random.normal(k[2], (B, T, D)),
        "weights": (jax.random.uniform(k[3], (B, T)) > 0.3) * 1.0,
    }


def _permuted(batch):
    return {k: jnp.take(v, ORDER, axis=1) for k, v in batch.items()}


def _check(loss, batch, what="loss_fn"):
    """The check on ``loss(batch)``, every leaf's dimension 1 permuted."""
    closed = jax.make_jaxpr(loss)(batch)
    check_sequence_order(closed, [frozenset({1})] * len(jax.tree.leaves(batch)), what=what)


def _exact_on_the_permuted_sequence(loss, batch) -> bool:
    return bool(np.allclose(loss(batch), loss(_permuted(batch)), rtol=1e-5, atol=1e-5))


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def _rope(x, positions):
    inv = 1.0 / (10000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    f = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([f, f], axis=-1)
    return x * jnp.cos(emb) + jnp.roll(x, D // 2, axis=-1) * jnp.sin(emb)  # a roll over features: exact


def _attention(x, causal):
    s = jnp.einsum("bqd,bkd->bqk", x, x) / np.sqrt(D)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s, -1e9)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), x)


WRONG = {
    "shifted targets": (lambda b: _xent(b["logits"][:, :-1], b["tokens"][:, 1:]).mean(), r"'slice' slices dimension 1"),
    "jnp.roll": (
        lambda b: _xent(b["logits"], jnp.roll(b["tokens"], -1, axis=1)).mean(),
        r"inside '_roll_static'\) 'slice' slices dimension 1",
    ),
    "jnp.arange positions into RoPE": (
        lambda b: _rope(b["x"], jnp.arange(T)[None]).sum(),
        r"'mul' combines the permuted sequence with an index in natural order",
    ),
    "causal attention with jnp.tril": (
        lambda b: _attention(b["x"], causal=True).sum(),
        r"'select_n' combines the permuted sequence with an index in natural order",
    ),
    "cumsum": (lambda b: (jnp.cumsum(b["x"], axis=1) ** 2).mean(), r"'cumsum' sums cumulatively along dimension 1"),
    "argmax over the sequence": (
        lambda b: jnp.argmax(b["x"][..., 0], axis=1).astype(jnp.float32).mean(),
        r"'argmax' returns the index of its pick along dimension 1",
    ),
    "a token-mixing matmul": (
        lambda b: jnp.einsum("btd,ts->bsd", b["x"], jnp.tri(T) + 1.0).sum(),
        r"'dot_general' contracts dimension 1 of a float32\[2,16,8\] value",
    ),
    "a pad (a causal shift)": (
        lambda b: (jnp.pad(b["x"], ((0, 0), (1, 0), (0, 0)))[:, :T] * b["x"]).sum(),
        r"'pad' pads dimension 1",
    ),
    "a reverse": (lambda b: (jnp.flip(b["x"], 1) * b["x"]).sum(), r"'rev' reverses dimension 1"),
    "a sort": (lambda b: (jnp.sort(b["x"], axis=1) * b["x"]).sum(), r"'sort' sorts along dimension 1"),
    "a convolution over the sequence": (
        lambda b: (
            jax.lax.conv_general_dilated(
                b["x"], jnp.ones((3, D, D)), (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC")
            ).sum()
            * b["x"][0, 0, 0]
        ),
        r"'conv_general_dilated' convolves along dimension 1",
    ),
    "a scan carrying state along the sequence": (
        lambda b: jax.lax.scan(lambda c, x: (0.9 * c + x, c * x), jnp.zeros((B, D)), jnp.swapaxes(b["x"], 0, 1))[
            1
        ].sum(),
        r"'scan' loops over dimension 0 of a float32\[16,2,8\] value.*an output it stacks reads its carry",
        SCAN_FIX,
    ),
    "a dynamic slice of the sequence": (
        lambda b: (jax.lax.dynamic_slice_in_dim(b["x"], b["tokens"].sum() % 8, 4, axis=1) ** 3).sum(),
        r"'dynamic_slice' slices \(a dynamic slice\) along dimension 1",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_wrong_loss_is_refused_naming_the_op_its_line_and_the_fix(case):
    loss, message, *fix = WRONG[case]
    fix = fix[0] if fix else FIX
    batch = _inputs()
    assert not _exact_on_the_permuted_sequence(loss, batch)  # the refusal is no false alarm
    with pytest.raises(
        ValueError,
        match=rf"loss_fn would be silently wrong with ZeroConfig\(context=\{{'layout': "
        rf"'balanced'\}}\).* at .*{LINE}.*{message}.*{fix}",
    ):
        _check(loss, batch)


EXACT = {
    "optax's integer-label cross-entropy": lambda b: _xent(b["logits"], b["tokens"]).mean(),
    "a masked mean with weights": lambda b: (
        (_xent(b["logits"], b["tokens"]) * b["weights"]).sum() / jnp.maximum(b["weights"].sum(), 1.0)
    ),
    "one-hot over the vocabulary": lambda b: (
        -(jax.nn.one_hot(b["tokens"], V) * jax.nn.log_softmax(b["logits"])).sum(-1).mean()
    ),
    "attention without a mask": lambda b: _attention(b["x"], causal=False).sum(),
    "a mean and a max over the sequence": lambda b: b["x"].mean(1).sum() + b["x"].max(axis=1).sum(),
    "the cross-entropy on merged batch and sequence": lambda b: _xent(
        b["logits"].reshape(B * T, V), b["tokens"].reshape(B * T)
    ).mean(),
    "an embedding lookup": lambda b: (
        jnp.take(jnp.arange(V * D, dtype=jnp.float32).reshape(V, D), b["tokens"], axis=0) * b["x"]
    ).sum(),
    "a map over sequence chunks (no carry)": lambda b: jax.lax.map(
        lambda c: jnp.tanh(c).sum(), jnp.moveaxis(b["x"].reshape(B, 4, T // 4, D), 1, 0)
    ).sum(),
    "a loop over layers with the sequence in its carry": lambda b: jax.lax.fori_loop(
        0, 3, lambda i, h: jnp.tanh(h @ jnp.eye(D)), b["x"]
    ).sum(),
    "a cond and a while loop": lambda b: jax.lax.cond(
        b["weights"].sum() > 0,
        lambda x: x * 2,
        lambda x: -x,
        jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 0.5), (0, b["x"]))[1],
    ).sum(),
    "a roll over features": lambda b: (jnp.roll(b["x"], 1, axis=-1) * b["x"]).sum(),
}


@pytest.mark.parametrize("case", sorted(EXACT))
def test_an_exact_loss_passes(case):
    loss, batch = EXACT[case], _inputs()
    assert _exact_on_the_permuted_sequence(loss, batch)
    _check(loss, batch)


def test_dropout_on_the_permuted_sequence_passes():
    """Random bits are drawn per index, not per position: no order to keep."""

    def loss(b):
        keep = jax.random.bernoulli(jax.random.key(1), 0.9, b["x"].shape)
        return (jnp.where(keep, b["x"], 0.0) / 0.9).mean()

    _check(loss, _inputs())


def test_positions_from_global_positions_pass():
    """zj.nn.global_positions is a constant of the layout's order: its RoPE is right."""
    batch = _inputs()
    with jax.set_mesh(zj.make_mesh(context=C)):
        _check(lambda b: _rope(b["x"], zj.nn.global_positions(T, Layout("balanced", C))[None]).sum(), batch)
    natural = _rope(batch["x"], jnp.arange(T)[None]).sum()
    assert np.allclose(_rope(_permuted(batch)["x"], jnp.asarray(ORDER)[None]).sum(), natural, rtol=1e-5)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("extras", [(), ("weights", "mask"), ("positions",)])
def test_the_llama_with_the_context_kernels_passes(attention, extras):
    """zerojax.models.llama with zj.nn.dot_product_attention on a context mesh, its loss
    traced as the step traces it: the kernels' regions know the layout; everything around
    them (RoPE from global_positions or from the batch, GQA reshapes, the layer scan with
    remat, optax's cross-entropy, weights, key masks) is exact."""
    cfg = llama.LlamaConfig(
        vocab=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=T, attention=attention, remat="full"
    )
    graphdef, params = llama.init_abstract(cfg)
    batch = {"inputs": jax.ShapeDtypeStruct((B, T), jnp.int32), "targets": jax.ShapeDtypeStruct((B, T), jnp.int32)}
    kinds = {"weights": jnp.float32, "mask": jnp.bool_, "positions": jnp.int32}
    batch.update({k: jax.ShapeDtypeStruct((B, T), kinds[k]) for k in extras})
    with jax.set_mesh(zj.make_mesh(context=C)):
        closed = jax.make_jaxpr(functools.partial(llama.make_loss(graphdef), layout=Layout("balanced", C)))(
            params, batch
        )
    dims = [frozenset()] * len(jax.tree.leaves(params)) + [frozenset({1})] * len(batch)
    check_sequence_order(closed, dims, what="loss_fn")


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_a_natural_order_mask_handed_to_the_kernels_is_refused(method):
    """The kernels know the layout, but read a mask by the loss's indices: Flax's causal
    mask (an iota over the sequence) would mask the wrong keys. is_causal=True is right."""
    import flax.linen as nn

    def loss(b, causal_mask, boolean=False):
        q = b["x"].reshape(B, T, 2, D // 2)
        mask = nn.make_causal_mask(b["tokens"], dtype=bool if boolean else jnp.float32) if causal_mask else None
        return zj.nn.dot_product_attention(
            q, q, q, mask=mask, is_causal=not causal_mask, method=method, layout="balanced"
        ).sum()

    batch = {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32), "x": jax.ShapeDtypeStruct((B, T, D), jnp.float32)}
    with jax.set_mesh(zj.make_mesh(context=2)):
        _check(lambda b: loss(b, False), batch)
        # Flax's float 0/1 mask is refused where it first meets the permuted queries (a
        # boolean one where the kernel is handed it).
        with pytest.raises(ValueError, match=rf"{LINE}.*index in natural order"):
            _check(lambda b: loss(b, True), batch)
        with pytest.raises(
            ValueError,
            match=rf"{LINE}.*'shard_map' \(zj.nn.dot_product_attention's kernel\) is "
            r"given a bool\[2,1,16,16\] mask or bias whose dimension 2 was built "
            r"over the sequence in natural order.*Pass is_causal=True instead",
        ):
            _check(lambda b: loss(b, True, boolean=True), batch)


def test_the_llama_with_plain_attention_is_refused():
    cfg = llama.LlamaConfig(
        vocab=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=T, attention="einsum"
    )
    graphdef, params = llama.init_abstract(cfg)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("inputs", "targets")}
    with jax.set_mesh(zj.make_mesh(context=C)):
        closed = jax.make_jaxpr(functools.partial(llama.make_loss(graphdef), layout=Layout("balanced", C)))(
            params, batch
        )
    dims = [frozenset()] * len(jax.tree.leaves(params)) + [frozenset({1})] * len(batch)
    with pytest.raises(
        ValueError,
        match=r"llama.py:\d+ \(Block.attention\).*'select_n' combines the permuted "
        r"sequence with an index in natural order",
    ):
        check_sequence_order(closed, dims, what="loss_fn")


def test_sequence_parallel_matmuls_beside_ring_attention_pass():
    """On data x context x tensor: zj.nn.column_parallel gathers the sequence over "tensor"
    in device order and zj.nn.row_parallel reduce-scatters onto it, both exact on the
    permuted sequence; the ring kernel sits between them."""

    def loss(p, b):
        x = zj.nn.sequence_parallel(p["emb"][b["inputs"]])
        q, k, v = (y.reshape(B, T, 2, D // 2) for y in zj.nn.column_parallel(x, (p["q"], p["k"], p["v"])))
        x = x + zj.nn.row_parallel(
            zj.nn.dot_product_attention(q, k, v, is_causal=True, method="ring", layout="balanced").reshape(B, T, D),
            p["o"],
        )
        return _xent(zj.nn.column_parallel(x, p["head"]), b["targets"]).mean()

    p = {"emb": (V, D), "q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "head": (D, V)}
    p = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in p.items()}
    b = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("inputs", "targets")}
    with jax.set_mesh(zj.make_mesh(context=2, tensor=2)):
        closed = jax.make_jaxpr(loss)(p, b)
    check_sequence_order(closed, [frozenset()] * len(p) + [frozenset({1})] * 2, what="loss_fn")


@pytest.mark.parametrize(
    "collective,refused", [("ppermute", True), ("psum", True), ("sum then psum", False), ("all_gather", False)]
)
def test_a_users_shard_map_over_the_sequence(collective, refused):
    """In a region of the user's own, a collective that moves or sums blocks of the sequence
    across devices is refused; one that gathers them in order, or reduces after the
    sequence is summed away, is not."""

    def body(x):
        if collective == "ppermute":
            return jax.lax.ppermute(x, "context", [(i, (i + 1) % C) for i in range(C)]).sum()
        if collective == "psum":
            return jax.lax.psum(x, "context").sum()
        if collective == "all_gather":
            return (jax.lax.all_gather(x, "context", axis=1, tiled=True) ** 2).sum()
        return jax.lax.psum(x.sum(1), "context").sum()

    def loss(b):
        return jax.shard_map(body, in_specs=P(None, "context"), out_specs=P(), axis_names={"context"}, check_vma=False)(
            b["x"]
        )

    with jax.set_mesh(zj.make_mesh(context=C)):
        if refused:
            with pytest.raises(
                ValueError,
                match=rf"{LINE}.*'{collective}' .* blocks of dimension 1 .* split over "
                r"\('context',\): it mixes different positions",
            ):
                _check(loss, {"x": _inputs()["x"]})
        else:
            _check(loss, {"x": _inputs()["x"]})


def test_an_unknown_primitive_on_the_sequence_is_refused_naming_it():
    def loss(b):
        y = jax.pure_callback(lambda x: np.asarray(x), jax.ShapeDtypeStruct(b["x"].shape, b["x"].dtype), b["x"])
        return y.sum()

    with pytest.raises(
        ValueError,
        match=rf"{LINE}.*'pure_callback' is an operation zerojax does not know the "
        r"dimensions of, applied to dimension 1",
    ):
        _check(loss, {"x": _inputs()["x"]})
    # the same loss where no dimension is permuted: not refused
    closed = jax.make_jaxpr(loss)({"x": _inputs()["x"]})
    check_sequence_order(closed, [frozenset()], what="loss_fn")


def test_arguments_are_checked():
    closed = jax.make_jaxpr(lambda x, y: x.sum() + y.sum())(jnp.ones((2, 4)), jnp.ones(3))
    with pytest.raises(ValueError, match="1 sets of permuted dimensions for a program of 2 inputs"):
        check_sequence_order(closed, [frozenset({1})])
    with pytest.raises(ValueError, match=r"input 1 has shape \(3,\), no dimension \[1\]"):
        check_sequence_order(closed, [frozenset({1}), frozenset({1})])
    check_sequence_order(closed, [frozenset({-1}), frozenset()])
