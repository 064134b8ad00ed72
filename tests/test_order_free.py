"""The sequence-order check tells reductions that do not depend on the order of the sequence
(commutative and associative over it) from those that do.

A table of order-free losses (each must pass the check and give, on the permuted sequence,
the loss and gradients of the natural one) and a table of order-dependent ones (each must be
refused, and does change on the permuted sequence: no false alarm), on random inputs and on
the balanced layout's order and random permutations; then the classes end to end: a loss of
order-free reductions, the package's MoE Llama (dropless) and a learned position table indexed
by the layout's positions train in the balanced layout as on one device; capacity routing and
GPT's ``wpe[:T]`` are refused with their fix; a per-example leaf beside the sequences on a
contiguous mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import reference_run
from zerojax.context import Layout
from zerojax.context.batch import check_lengths, sequence_dims
from zerojax.context.sequence_order import check_sequence_order
from zerojax.models import gpt, llama
from zerojax.moe import routed_experts

B, T, D, S, C = 2, 16, 8, 3, 4  # S documents per row
ORDER = Layout("balanced", C).order(T)
LINE = r"test_order_free.py:\d+"


def _params(seed):
    k = jax.random.split(jax.random.key(100 + seed), 4)
    return {
        "w": jax.random.normal(k[0], (D, D)) / np.sqrt(D),
        "router": jax.random.normal(k[1], (D, 4)),
        "experts": jax.random.normal(k[2], (3, 4, D, D)) / np.sqrt(D),  # up, down, gate of 4 experts
        "table": jax.random.normal(k[3], (2 * T, D)),  # a learned position table, longer than T
    }


def _batch(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "x": jax.random.normal(k[0], (B, T, D)),
        "seg": jnp.sort(jax.random.randint(k[1], (B, T), 0, S), axis=1),  # documents, packed in order
        "w": jax.random.uniform(k[2], (B, T)),
    }


def _h(p, b):
    return jnp.tanh(b["x"] @ p["w"])  # [B, T, D]: what the parameters' gradients flow through


def _seq(h):
    return jnp.swapaxes(h, 0, 1)  # [T, B, D]: scanned over the sequence


def _zeros(p, b, fill=0.0):
    return jnp.full((b["x"].shape[0], D), fill)  # a scan's carry: one per row


def _doc_flat(p, b, pos, op=jax.ops.segment_sum):
    """Per-document means: rows flattened, each row's documents offset by row * S."""
    rows, t = b["seg"].shape
    ids = (b["seg"] + jnp.arange(rows)[:, None] * S).reshape(-1)
    h = _h(p, b).reshape(-1, D) * b["w"].reshape(-1, 1)
    tot = op(h, ids, num_segments=rows * S)
    n = jax.ops.segment_sum(jnp.ones(rows * t), ids, num_segments=rows * S)
    return (tot / jnp.maximum(n, 1)[:, None] ** 2).sum()


def _doc_vmap(p, b, pos):
    def row(h, s):
        n = jax.ops.segment_sum(jnp.ones(s.shape), s, S)
        return (jax.ops.segment_sum(h, s, S) / jnp.maximum(n, 1)[:, None]).sum()

    return jax.vmap(row)(_h(p, b), b["seg"]).sum()


def _experts(p, b, capacity_factor=None):
    h = _h(p, b)
    up, down, gate = p["experts"]
    y, stats = routed_experts(h, h @ p["router"], up, down, gate, top_k=2, capacity_factor=capacity_factor)
    return (y**2).mean() + 0.1 * stats.load_balancing_loss


ORDER_FREE = {
    "a scan sum over the sequence": lambda p, b, pos: jax.lax.scan(
        lambda c, h: (c + h, None), _zeros(p, b), _seq(_h(p, b))
    )[0].sum(),
    "a reversed scan max, a sum and a counter": lambda p, b, pos: sum(
        c.sum()
        for c in jax.lax.scan(
            lambda c, h: ((jnp.maximum(c[0], h), c[1] + 2.0 * h, c[2] + 1), None),
            (_zeros(p, b, -jnp.inf), _zeros(p, b), 0),
            _seq(_h(p, b)),
            reverse=True,
        )[0]
    ),
    "a scan with a constant carry read by its outputs": lambda p, b, pos: jax.lax.scan(
        lambda c, h: ((c[0], c[1] + h), h * c[0]), (jnp.full((B, D), 2.0), jnp.zeros((B, D))), _seq(_h(p, b))
    )[1].sum(),
    "segment_sum means, rows flattened with offsets": _doc_flat,
    "segment_max per document": functools.partial(_doc_flat, op=jax.ops.segment_max),
    "segment_sum means, vmapped per row": _doc_vmap,
    "a histogram of documents (scatter-add of ones)": lambda p, b, pos: (
        jnp.zeros((B, S)).at[jnp.arange(B)[:, None], b["seg"]].add(1.0) * _h(p, b).sum(1)[:, :S]
    ).sum(),
    "a one-hot per-document mean": lambda p, b, pos: jnp.einsum(
        "bts,btd->bsd", jax.nn.one_hot(b["seg"], S), _h(p, b)
    ).sum(),
    "dropless routed experts": lambda p, b, pos: _experts(p, b),
    "a position table indexed by the layout's positions": lambda p, b, pos: ((_h(p, b) + p["table"][pos]) ** 2).sum(),
}

ORDER_DEPENDENT = {
    "a cumsum": (lambda p, b, pos: (jnp.cumsum(_h(p, b), axis=1) ** 2).sum(), r"'cumsum' sums cumulatively"),
    "a running max, then used": (
        lambda p, b, pos: jax.lax.scan(lambda c, h: (jnp.maximum(c, h), h - c), jnp.zeros((B, D)), _seq(_h(p, b)))[
            1
        ].sum(),
        r"'scan' loops over dimension 0 .*an output it stacks reads its carry",
    ),
    "a decaying carry": (
        lambda p, b, pos: jax.lax.scan(lambda c, h: (0.9 * c + h, None), jnp.zeros((B, D)), _seq(_h(p, b)))[0].sum(),
        r"'scan' loops over dimension 0 .*carry 0 mixes 'add' and 'mul'",
    ),
    "a carry that reads another": (
        lambda p, b, pos: jax.lax.scan(
            lambda c, h: ((c[0] + h, c[1] + c[0] * h**2), None), (jnp.zeros((B, D)),) * 2, _seq(_h(p, b))
        )[0][1].sum(),
        r"'scan' loops over dimension 0 .*carry 1 is combined with a value that reads a carry",
    ),
    "position-dependent indexing": (lambda p, b, pos: (_h(p, b)[:, 3] ** 3).sum(), r"'slice' slices dimension 1"),
    "segment_sum told its indices are sorted": (
        lambda p, b, pos: jax.vmap(lambda h, s: jax.ops.segment_sum(h, s, S, indices_are_sorted=True))(
            _h(p, b), b["seg"]
        )[:, 1].sum(),
        r"'scatter-add' scatters \(writes by index\) along dimension 1",
        "a promise to XLA the permuted indices break (CPU ignores it; a GPU may not)",
    ),
    "a scatter that overwrites": (
        lambda p, b, pos: (jax.vmap(lambda h, s: jnp.zeros((S, D)).at[s].set(h))(_h(p, b), b["seg"]) ** 2).sum(),
        r"'scatter' scatters \(writes by index\) along dimension 1",
    ),
    "a learned position table sliced table[:T]": (
        lambda p, b, pos: ((_h(p, b) + p["table"][:T]) ** 2).sum(),
        r"'add' combines the permuted sequence with values in natural order along it.*"
        r"table\[zj.nn.global_positions\(T, layout\)\]",
    ),
    "weights in natural order, made by a cumsum": (
        lambda p, b, pos: (_h(p, b) * jnp.cumsum(jnp.ones(T))[None, :, None]).sum(),
        r"'mul' combines the permuted sequence with values in natural order",
    ),
    "a scatter-add to natural positions": (
        lambda p, b, pos: (jnp.zeros((T,)).at[jnp.arange(T)].add(_h(p, b)[0, :, 0]) * jnp.arange(T)).sum(),
        r"'scatter-add' sums the permuted sequence by an index in natural order",
    ),
    "routed experts with a capacity": (
        lambda p, b, pos: _experts(p, b, capacity_factor=1.0),
        r"routed_experts with a capacity_factor\) depends on the order of its rows.*Route dropless",
    ),
}


def _permute(b, perm):
    return {k: (jnp.take(v, perm, axis=1) if v.ndim >= 2 else v) for k, v in b.items()}


def _check(loss, params, batch):
    closed = jax.make_jaxpr(functools.partial(loss, pos=ORDER))(params, batch)
    n = len(jax.tree.leaves(params))
    check_sequence_order(closed, [frozenset()] * n + [frozenset({1})] * len(batch), what="loss_fn")


@pytest.mark.parametrize("case", sorted(ORDER_FREE))
def test_an_order_free_loss_passes_and_is_exact_on_any_order(case):
    loss = ORDER_FREE[case]
    params, batch = _params(0), _batch(0)
    _check(loss, params, batch)
    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one compile, not one per operation
    for seed in range(3):
        params, batch = _params(seed), _batch(seed)
        want = value_and_grad(params, batch, jnp.arange(T))
        perms = [ORDER, np.random.default_rng(seed).permutation(T)]
        for perm in perms:
            got = value_and_grad(params, _permute(batch, perm), jnp.asarray(perm))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", sorted(ORDER_DEPENDENT))
def test_an_order_dependent_loss_is_refused(case):
    loss, message, *broken_promise = ORDER_DEPENDENT[case]
    params, batch = _params(0), _batch(0)
    value = jax.jit(loss)  # one compile, not one per operation
    natural = value(params, batch, jnp.arange(T))
    if not broken_promise:  # no false alarm: the value changes on the permuted sequence
        assert not np.allclose(value(params, _permute(batch, ORDER), jnp.asarray(ORDER)), natural, rtol=1e-4)
    with pytest.raises(ValueError, match=rf"(?s)loss_fn would be silently wrong.* at .*{LINE}.*{message}"):
        _check(loss, params, batch)


# ----------------------------------------------------------------------------------------
# End to end: the step in the balanced layout against single-device optax.


def _train(loss_fn, params, data, layout="balanced", c=2):
    tx, mesh = optax.sgd(0.3), zj.make_mesh(context=c)
    zc = zj.ZeroConfig(stage=1, context={"layout": layout})
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(loss_fn, tx, mesh=mesh, config=zc, with_layout=True)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    ref, ref_losses = reference_run(
        functools.partial(loss_fn, layout=None), jax.tree.map(jnp.asarray, params), tx, list(data)
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for a, r in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)


def test_order_free_reductions_and_a_position_table_train_in_the_balanced_layout():
    """Per-document means by segment_sum (flattened and vmapped), a scan sum, dropless routed
    experts and a learned position table indexed by zj.nn.global_positions, in one loss: the
    step permutes the batch, the check passes it, and it trains as on one device."""
    t = 8 * 2  # the batch's sequence: 2C chunks at C = 2
    free = ["segment_sum means, rows flattened with offsets", "segment_sum means, vmapped per row"]
    free += ["a scan sum over the sequence"]  # sums over rows; routed experts' loss: a mean

    def loss_fn(params, batch, layout=None):
        pos = zj.nn.global_positions(t, layout)
        b = {**batch, "x": batch["x"] + params["table"][pos]}
        rows = b["x"].shape[0]
        return sum(ORDER_FREE[name](params, b, pos) for name in free) / rows + _experts(params, b)

    data = [{**_batch(s), "x": _batch(s)["x"][:, :t], "seg": _batch(s)["seg"][:, :t]} for s in range(2)]
    data = [{k: jnp.concatenate([v] * 4) for k, v in b.items()} for b in data]  # 8 rows: one per data group
    _train(loss_fn, _params(0), data)


@functools.cache
def _moe_llama(capacity_factor):
    cfg = llama.LlamaConfig(
        vocab=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, seq_len=16, n_experts=4, top_k=2,
        moe_d_ff=16, attention="ring", capacity_factor=capacity_factor,
    )  # fmt: skip
    return llama.init(cfg)


def _tokens(n=2, t=16, vocab=32):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        toks = jnp.asarray(rng.integers(0, vocab, (8, t + 1)), jnp.int32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    return out


@pytest.mark.slow  # reason: trains the MoE Llama twice (11 s); dropless routed experts pass the check and equal any order in the default set
def test_the_moe_llama_trains_dropless_in_the_balanced_layout():
    """The package's MoE Llama (ring attention, RoPE from global_positions, dropless routed
    experts and their load-balancing counts' scatter-add) trains in the balanced layout as on
    one device."""
    graphdef, params = _moe_llama(None)
    _train(llama.make_loss(graphdef), params, _tokens(1))


def _traced_check(model, cfg, layout=True):
    """The step's check on ``model``'s loss, traced as the step traces it (nothing compiled)."""
    graphdef, params = model.init_abstract(cfg)
    batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.int32) for k in ("inputs", "targets")}
    loss = model.make_loss(graphdef)
    if layout:
        loss = functools.partial(loss, layout=Layout("balanced", 2))
    with jax.set_mesh(zj.make_mesh(context=2)):
        closed = jax.make_jaxpr(loss)(params, batch)
    dims = [frozenset()] * len(jax.tree.leaves(params)) + [frozenset({1})] * 2
    check_sequence_order(closed, dims, what="loss_fn")


def test_capacity_routing_and_gpts_position_table_are_refused_with_their_fix():
    """Capacity routing keeps an expert's first assignments, so it depends on the tokens'
    order; GPT adds wpe[:T], a table in natural order: both are refused, naming the line and
    the fix."""
    cfg = dict(vocab=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, seq_len=16, n_experts=4)
    cfg.update(top_k=2, moe_d_ff=16, attention="ring")
    _traced_check(llama, llama.LlamaConfig(**cfg))  # dropless: passes
    with pytest.raises(
        ValueError,
        match=r"(?s)llama.py:\d+ \(MoE.__call__\).*routed_experts with a capacity_factor\) depends on the "
        r"order of its rows.*Route dropless \(capacity_factor=None",
    ):
        _traced_check(llama, llama.LlamaConfig(**cfg, capacity_factor=1.25))
    with pytest.raises(
        ValueError,
        match=r"(?s)gpt.py:\d+ \(GPT.__call__\).*'add' combines the permuted sequence with values in natural "
        r"order.*table\[zj.nn.global_positions\(T, layout\)\]",
    ):
        _traced_check(gpt, gpt.GPTConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, seq_len=16), layout=False)


# ----------------------------------------------------------------------------------------
# A per-example leaf beside the sequences (contiguous layout).


def test_a_per_example_leaf_beside_the_sequences_is_not_split():
    """[B, 3] beside [B, T] inputs and targets: the most common length is the sequence's, so
    the [B, 3] leaf is not split (and trains as on one device); with nothing to tell them
    apart ([B, 3] beside one [B, T]) it is refused, naming the dims that would say so."""
    cfg = zj.ZeroConfig(stage=1)
    leaf = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    assert sequence_dims(cfg, {"inputs": leaf(8, 16), "targets": leaf(8, 16), "feat": leaf(8, 3)}) == [(), (1,), (1,)]
    assert sequence_dims(cfg, {"inputs": leaf(8, 16), "feat": leaf(8, 3)}) == [(1,), (1,)]  # a tie: no guess
    with pytest.raises(
        ValueError,
        match=r"batch leaf \['feat'\]'s sequence length \(dimension 1\) 3 does not split into 4 context devices.*"
        r"If \['feat'\] \[8, 3\] is not a sequence \(a per-example value\), say which leaves are: "
        r"ZeroConfig\(context=\{'dims': \{\"\['feat'\]\": None, \"\['inputs'\]\": 1\}\}\)",
    ):
        check_lengths(cfg, {"inputs": leaf(8, 16), "feat": leaf(8, 3)}, 4)
    # the fix it names is taken
    check_lengths(
        zj.ZeroConfig(stage=1, context={"dims": {"['feat']": None, "['inputs']": 1}}),
        {"inputs": leaf(8, 16), "feat": leaf(8, 3)},
        4,
    )

    def loss_fn(params, batch):
        h = jnp.tanh(batch["inputs"] @ params["w"])  # [B, T, D]
        return ((h * batch["targets"]).mean(1) @ params["v"] * batch["feat"]).mean()

    k = jax.random.split(jax.random.key(0), 5)
    params = {"w": jax.random.normal(k[0], (4, 4)), "v": jax.random.normal(k[1], (4, 3))}
    data = [{"inputs": jax.random.normal(k[2], (8, 16, 4)), "targets": jax.random.normal(k[3], (8, 16, 4)),
             "feat": jax.random.normal(k[4], (8, 3))}]  # fmt: skip
    tx, mesh = optax.sgd(0.3), zj.make_mesh(context=4)
    state = zj.init_state(params, tx, mesh=mesh, config=cfg)
    state, m = zj.make_train_step(loss_fn, tx, mesh=mesh, config=cfg)(state, data[0])
    ref, ref_losses = reference_run(loss_fn, params, tx, data)
    np.testing.assert_allclose(float(m["loss"]), ref_losses[0], rtol=1e-5)
    for a, r in zip(jax.tree.leaves(zj.gather_params(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)
