"""zj.data.Packer: documents packed into rows. Every pair of every document is placed once,
in order, with its positions; nothing crosses a document; padding weighs nothing; the
position checkpoints. A Llama trained on packed rows through a zerojax step (accumulation,
a context mesh) has the loss and gradient of each document run alone on one device."""

import collections
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from zerojax.models import llama


def documents(seed, n=60, longest=40, vocab=1 << 20):
    """Documents of 2..longest tokens whose ids are drawn from a large vocabulary, so that
    every piece of every document is told apart by its tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)) for k in rng.integers(2, longest + 1, size=n)]


def pieces(batches):
    """(tokens, first position) of every segment of every row, in emission order."""
    return [p for b in batches for row in rows(b) for p in row]


def rows(b):
    """Per row of batch ``b``, (tokens, first position) of each segment, checking the row's
    layout on the way: segments 1, 2, ... then padding (all zeros, weight 0), each
    segment's positions consecutive, the weights those of the real targets."""
    out = []
    assert set(b) == {"inputs", "targets", "positions", "segment_ids", "weights"}
    seg, w = b["segment_ids"], b["weights"]
    real = seg > 0
    np.testing.assert_allclose(w, real * (real.size / real.sum()), rtol=1e-6)
    for r in range(seg.shape[0]):
        ids = seg[r]
        k = int(ids.max())
        used = int((ids > 0).sum())
        assert (ids[used:] == 0).all() and (ids[:used] > 0).all(), ids  # padding only at the end
        for name in ("inputs", "targets", "positions"):
            assert (b[name][r, used:] == 0).all()
        row = []
        starts = np.flatnonzero(np.diff(ids[:used], prepend=0))
        assert ids[starts].tolist() == list(range(1, k + 1)), ids  # ids 1..k, each one run
        for a, e in zip(starts, list(starts[1:]) + [used]):
            x, y, pos = b["inputs"][r, a:e], b["targets"][r, a:e], b["positions"][r, a:e]
            assert (y[:-1] == x[1:]).all()  # within a segment the targets are the next inputs
            np.testing.assert_array_equal(pos, np.arange(pos[0], pos[0] + (e - a)))
            row.append((tuple(x.tolist()) + (int(y[-1]),), int(pos[0])))
        out.append(row)
    return out


def expected(docs, seq_len):
    """Each document's pieces of at most seq_len pairs, positions continuing."""
    out = []
    for d in docs:
        n = len(d) - 1
        out += [(tuple(d[a : min(a + seq_len, n) + 1].tolist()), a) for a in range(0, n, seq_len)]
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [1, 5, 64])
def test_every_pair_is_placed_once_with_its_positions(seed, window):
    rng = np.random.default_rng(100 + seed)
    seq_len, batch_size = int(rng.integers(8, 33)), int(rng.integers(1, 6))
    docs = documents(seed, longest=3 * seq_len)
    packer = zj.data.Packer(docs, batch_size, seq_len, window=window, long="split")
    batches = list(packer)
    got, want = pieces(batches), expected(docs, seq_len)
    assert collections.Counter(got) == collections.Counter(want)  # each piece once, whole
    if window == 1:
        assert got == want  # in the documents' order
    # The batches emitted are as few as the pairs allow, but for rows that did not fill.
    pairs = sum(len(d) - 1 for d in docs)
    assert packer.targets == pairs and packer.slots == len(batches) * batch_size * seq_len
    assert len(batches) >= -(-pairs // (batch_size * seq_len))
    assert all(b[k].dtype == np.int32 for b in batches for k in ("inputs", "targets", "positions", "segment_ids"))


def test_each_row_starts_with_the_oldest_document_and_best_fit_fills_rows():
    """Each row starts with the oldest document not yet placed (so none waits more than
    `window` rows), and on lengths that fit together (pairs 3 + 5 and 1 + 7, in an order
    that next fit wastes) best fit fills every row where next fit pads a third."""
    docs = [np.arange(n + 1) for n in (3, 1, 5, 7) * 6]
    nf, bf = zj.data.Packer(docs, 2, 8, window=1), zj.data.Packer(docs, 2, 8, window=4)
    list(nf), list(bf)
    assert bf.efficiency == 1.0 and nf.efficiency == pytest.approx(2 / 3)
    docs = documents(7, n=200, longest=17)
    index = {tuple(d.tolist()): i for i, d in enumerate(docs)}
    placed = set()
    for b in zj.data.Packer(docs, 4, 16, window=6):
        for row in rows(b):
            row = [index[t] for t, _ in row]
            if row:
                assert row[0] == min(set(range(len(docs))) - placed), row
            placed.update(row)
    assert placed == set(range(len(docs)))


def _resumed(make, k):
    """The batches after k, from a packer set to the saved position (through JSON)."""
    first = make()
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    again = make()
    again.set_state(state)
    return list(again), state


@pytest.mark.parametrize("source", ["list", "generator"])
def test_the_position_checkpoints(source):
    docs = documents(3, n=80, longest=50)

    def fresh():
        src = docs if source == "list" else (d for d in docs)
        return zj.data.Packer(src, 3, 16, window=8, long="split")

    whole = list(fresh())
    for k in (1, 4, len(whole) - 1):
        rest, state = _resumed(fresh, k)
        assert state["batches"] == k and state["pending"]  # pieces read ahead are part of it
        assert len(rest) == len(whole) - k
        for a, b in zip(rest, whole[k:]):
            for name in a:
                np.testing.assert_array_equal(a[name], b[name])
    saved = _resumed(fresh, 2)[1]
    with pytest.raises(ValueError, match=r"window: saved 8, this packer 4.*Build the Packer"):
        zj.data.Packer(docs, 3, 16, window=4, long="split").set_state(saved)
    other = [d.copy() for d in docs]
    i, a, _ = saved["pending"][-1]
    other[i][a] += 1  # a token read ahead, not yet placed
    with pytest.raises(ValueError, match="differ from the ones it was saved with"):
        zj.data.Packer(other if source == "list" else iter(other), 3, 16, window=8, long="split").set_state(saved)
    if source == "generator":
        used = fresh()
        next(used)
        with pytest.raises(ValueError, match="build a fresh Packer over the same documents"):
            used.set_state(saved)


@pytest.mark.parametrize(
    "docs,kwargs,error,match",
    [
        ([np.arange(5)], {"seq_len": 1}, ValueError, r"seq_len must be >= 2"),
        ([np.arange(5)], {"seq_len": 0}, ValueError, r"seq_len must be a positive int, got 0"),
        ([np.arange(5), np.arange(0)], {}, ValueError, r"document 1 has 0 token\(s\).*leave such documents out"),
        ([np.array([3])], {}, ValueError, r"document 0 has 1 token\(s\)"),
        ([np.array([1.0, 2.0])], {}, TypeError, r"document 0 has dtype float64.*astype\(np.int32\)"),
        ([np.arange(18)], {}, ValueError, r"document 0 has 18 tokens.*seq_len=16.*long='split'"),
        ([np.arange(4).reshape(2, 2)], {}, ValueError, r"document 0 has shape \(2, 2\)"),
        ([np.array([0, 64])], {"vocab": 64}, ValueError, r"token ids in \[0, 64\], outside \[0, 64\)"),
        ([np.array([-1, 2])], {}, ValueError, r"outside \[0, vocab\)"),
        ([np.arange(5)], {"long": "truncate"}, ValueError, r"long must be one of \('refuse', 'split'\)"),
        (np.arange(5), {}, TypeError, r"one array of shape \(5,\).*\[tokens\] for a single document"),
    ],
)
def test_bad_input_is_refused_with_the_fix(docs, kwargs, error, match):
    with pytest.raises(error, match=match):
        next(zj.data.Packer(docs, **{"batch_size": 2, "seq_len": 16, **kwargs}))


# -- a Llama trained on packed rows ------------------------------------------------------------

CFG = llama.LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16)
T, ROWS, LR = 16, 16, 0.5


@functools.cache
def packed_case():
    """Documents of 2..T+1 tokens that fill one global batch of ROWS x T, the batch, and
    the reference: each document alone (one per row, padded at its end, positions from 0,
    no segment ids; causal, so the padding after a document changes none of its logits),
    the loss the mean over every target of every document, and its gradient."""
    rng = np.random.default_rng(11)
    docs = []
    while sum(len(d) - 1 for d in docs) < 0.8 * ROWS * T:
        docs.append(rng.integers(0, CFG.vocab, int(rng.integers(2, T + 2))))
    batches = list(zj.data.Packer(docs, ROWS, T, window=16, vocab=CFG.vocab))
    assert len(batches) == 1, "the documents must fit one batch"
    graphdef, params = llama.init(llama.LlamaConfig(**{**CFG.__dict__, "attention": "einsum"}))
    alone = np.zeros((len(docs), T + 1), np.int32)
    mask = np.zeros((len(docs), T), np.float32)
    for i, d in enumerate(docs):
        alone[i, : len(d)], mask[i, : len(d) - 1] = d, 1

    def reference(p):
        logits = nnx.merge(graphdef, p)(jnp.asarray(alone[:, :-1]))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(alone[:, 1:]))
        return jnp.sum(losses * mask) / mask.sum()  # per-document sums, token-weighted

    loss, grad = jax.jit(jax.value_and_grad(reference))(params)
    return batches[0], params, float(loss), grad


def _check_step(step_cfg, mesh, zc, **options):
    batch, params, want_loss, want_grad = packed_case()
    graphdef = llama.init_abstract(step_cfg)[0]
    tx = optax.sgd(LR)
    state = zj.init_state(params, tx, mesh=mesh, config=zc)
    step = zj.make_train_step(llama.make_loss(graphdef), tx, mesh=mesh, config=zc, **options)
    state, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    jax.tree.map(
        lambda got, p, g: np.testing.assert_allclose(got, p - LR * g, rtol=1e-4, atol=1e-6),
        zj.gather_params(state),
        params,
        want_grad,
    )


@pytest.mark.parametrize("accum,stage", [(1, 3), (2, 1)])
def test_llama_on_packed_rows_trains_as_each_document_alone(accum, stage):
    _check_step(CFG, zj.make_mesh(), zj.ZeroConfig(stage=stage, grad_accum_steps=accum))


def test_every_leaf_is_a_sequence_the_balanced_layout_takes():
    """What the step reads of a batch on a context mesh: every leaf of a packed batch is a
    sequence on dimension 1 (split over the context axis, permuted in the balanced layout),
    with no ``context_dims`` to give; a row length the layout cannot split is refused."""
    batch = next(zj.data.Packer(documents(0), ROWS, T, long="split"))
    zc = zj.ZeroConfig(stage=3, context={"layout": "balanced"})
    assert zj.context.batch.sequence_dims(zc, batch) == [(1,)] * 5
    zj.context.batch.check_lengths(zc, batch, 2)  # 16 = 2 x 2 chunks of 4
    with pytest.raises(ValueError, match=r"does not split into 2 x 3 chunks"):
        zj.context.batch.check_lengths(zc, batch, 3)


@pytest.mark.slow  # reason: 6 s on jax 0.10, 12 s on 0.12 (a ring step compiled); the batch's layout: the test above
def test_packed_rows_feed_a_context_mesh_in_the_balanced_layout():
    """Data x context = 4 x 2, ring attention, the balanced layout (the step permutes every
    leaf of the batch, all [B, T]): the same loss and gradient as each document alone."""
    ring = llama.LlamaConfig(**{**CFG.__dict__, "attention": "ring"})
    zc = zj.ZeroConfig(stage=3, context={"layout": "balanced"})
    _check_step(ring, zj.make_mesh(context=2), zc, with_layout=True)


def test_a_resumed_run_continues_the_packing_where_it_stopped(tmp_path):
    """zerojax.resume.Run saves the packer's position with the state: a run stopped after
    3 steps (saved at 2 and 3) and resumed goes on with the batches of an uninterrupted
    packer, none repeated or skipped, and its state equals the uninterrupted run's."""
    from zerojax.resume import Run, RunConfig

    docs = documents(5, n=120, longest=40, vocab=97)
    tx, mesh, cfg = optax.sgd(0.01), zj.make_mesh(), zj.ZeroConfig(stage=1)

    def loss(p, b):  # every leaf of the batch reaches the loss
        x = (b["inputs"] * p["a"] + b["targets"] + b["positions"] * b["segment_ids"]) % 7
        return jnp.mean(b["weights"] * jnp.sin(x * p["w"]))

    step = zj.make_train_step(loss, tx, mesh=mesh, config=cfg)
    params = {"w": jnp.float32(0.3), "a": jnp.float32(1.1)}

    def train(until, directory):
        packer = zj.data.Packer(docs, 8, 16, window=8, long="split")
        run = Run(RunConfig(str(directory), save_every=2))
        state = run.restore_or_init(params, tx, mesh=mesh, config=cfg, data=packer)
        start = run.step
        while run.step < until:
            state, _ = step(state, next(packer))
            run.completed(state)
        run.finish(state)
        return start, state, packer

    assert train(3, tmp_path / "a")[0] == 0
    start, resumed, packer = train(6, tmp_path / "a")
    _, whole, uninterrupted = train(6, tmp_path / "b")
    assert start == 3 and packer.get_state() == uninterrupted.get_state() and packer.batches == 6
    jax.tree.map(np.testing.assert_array_equal, zj.gather_params(resumed), zj.gather_params(whole))
