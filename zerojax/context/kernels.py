"""The context kernels: attention over a sequence split across the context axis, run manual
over that axis. Ulysses trades the sequence split for a head split with two all-to-alls;
the ring passes key/value chunks round the axis. Both compute locally with
:mod:`zerojax.context.flash`; :func:`zerojax.context.attention.dot_product_attention`
chooses and checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._jaxpr import settings
from zerojax.context import flash
from zerojax.context.kernel_spec import KernelSpec


def _run(spec: KernelSpec, body, args: tuple, in_specs: tuple, out_specs, whole: tuple[int, ...] = ()):
    """``body(*args)`` manual over the context axis, each argument split by its spec. Inside a
    ``shard_map`` already manual over it the arguments are this device's already, but for
    those given whole (the indices ``whole``: a mask, a bias), cut here as their spec says."""
    if spec.local:
        return body(*(_part(x, p, spec) if i in whole else x for i, (x, p) in enumerate(zip(args, in_specs))))
    kw = {} if spec.mesh is None else {"mesh": spec.mesh}
    run = jax.shard_map(
        body, in_specs=in_specs, out_specs=out_specs, axis_names={spec.layout.axis}, check_vma=False, **kw
    )
    args = [_wide(x, p, spec.layout.axis) for x, p in zip(args, in_specs)]
    if not any(settings.is_tracer(x) for x in args):
        # Called eagerly: jax 0.10 refuses an eager shard_map manual over some of the mesh's
        # axes ("out_specs refers to 'data'"); compiled, it runs.
        run = jax.jit(run)
    return run(*args)


def _wide(x, pspec, axis: str):
    """A float input narrower than float32 that the context axis does not split (a bias that
    broadcasts over the split dimension), as float32. Its gradient is summed over the axis
    by ``shard_map``'s transpose, and XLA's CPU compiler aborts on a bfloat16 all-reduce in a
    ``shard_map`` manual over some of the mesh's axes (``Invalid binary instruction opcode
    copy`` in its all-reduce promotion: the reducer ends in a sharding constraint; jax 0.10
    and 0.12). The kernels add a bias to float32 logits, so the value is the same."""
    if x is None or axis in tuple(pspec) or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
        return x
    return x.astype(jnp.float32)


def _part(x, pspec, spec: KernelSpec):
    """This device's part of ``x``, as ``pspec`` splits it over the context axis."""
    if x is None:
        return None
    for d, name in enumerate(pspec):
        if name == spec.layout.axis:
            size = x.shape[d] // spec.layout.c
            return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(spec.layout.axis) * size, size, axis=d)
    return x


def _gathered(x, axis: str):
    """Segment ids ``[B, L/C]`` -> the whole sequence's ``[B, L]`` (in the layout's order)."""
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _seq_spec(x, axis: str):
    return None if x is None else P(None, axis)


# ----------------------------------------------------------------------------------------------
# Ulysses: all-to-all from sequence-split to head-split and back.


def ulysses(spec: KernelSpec, q, k, v, mask, bias, scale, lengths, segments):
    c, axis = spec.layout.c, spec.layout.axis
    if spec.kh % c:  # GQA with fewer key/value heads than devices: repeat them up to the query heads
        rep = spec.n // spec.kh
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    pos = jnp.asarray(spec.layout.order(spec.t))
    kpos = jnp.asarray(spec.layout.order(spec.s))

    def heads_spec(x):  # a mask or bias: its head dimension split with the heads, else whole
        return None if x is None else (P(None, axis) if x.shape[1] > 1 else P())

    def body(q, k, v, mask, bias, scale, qlen, kvlen, qseg, kseg):
        q, k, v = (jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
        rows, cols = flash.Side(pos, qlen, _gathered(qseg, axis)), flash.Side(kpos, kvlen, _gathered(kseg, axis))
        out = flash.finish(spec, flash.attend(spec, q, rows, k, v, cols, mask, bias, scale), rows, q.dtype)
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

    seq = P(None, axis)
    in_specs = (seq, seq, seq, heads_spec(mask), heads_spec(bias), P(), P(), P()) + tuple(
        _seq_spec(x, axis) for x in segments
    )
    return _run(spec, body, (q, k, v, mask, bias, scale, *lengths, *segments), in_specs, seq, whole=(3, 4))


# ----------------------------------------------------------------------------------------------
# Ring: key/value chunks passed round the context axis, merged with an online softmax.


def ring(spec: KernelSpec, q, k, v, mask, bias, scale, lengths, segments):
    c, axis = spec.layout.c, spec.layout.axis
    qpos_all = jnp.asarray(spec.layout.device_positions(spec.t))
    kpos_all = jnp.asarray(spec.layout.device_positions(spec.s))
    sc = spec.s // c
    perm = [(j, (j + 1) % c) for j in range(c)]

    def rows_spec(x):  # a mask or bias: its query rows split with the queries, key columns whole
        return None if x is None else P(None, None, axis if x.shape[2] > 1 else None)

    def body(q, k, v, mask, bias, scale, qlen, kvlen, qseg, kseg):
        i = jax.lax.axis_index(axis)
        rows = flash.Side(qpos_all[i], qlen, qseg)
        kseg_all = _gathered(kseg, axis)

        def cols(src):  # the keys of device ``src``
            seg = None if kseg_all is None else jax.lax.dynamic_slice_in_dim(kseg_all, src * sc, sc, axis=1)
            return flash.Side(kpos_all[src], kvlen, seg)

        def attend(k, v, src):  # over the chunk of the device ``src`` (this device's at step 0)
            return flash.attend(
                spec,
                q,
                rows,
                k,
                v,
                cols(src),
                flash.columns(mask, src * sc, sc),
                flash.columns(bias, src * sc, sc),
                scale,
            )

        def update(out, k, v, src):
            return flash.merge(out, attend(k, v, src))

        if spec.causal:
            # Rematerialised: otherwise the switch hands each branch's residuals (the queries
            # among them) out per ring step, and the scan stacks them C times.
            update = jax.checkpoint(functools.partial(_causal_update, spec, q, rows, cols, mask, bias, scale, i))

        def step(carry, s):  # a scan, not a Python loop: backward then runs the steps in turn
            out, k, v = carry
            k, v = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
            return (update(out, k, v, (i - s) % c), k, v), None

        (out, _, _), _ = jax.lax.scan(step, (attend(k, v, i), k, v), jnp.arange(1, c))
        return flash.finish(spec, out, rows, q.dtype)

    seq = P(None, axis)
    in_specs = (seq, seq, seq, rows_spec(mask), rows_spec(bias), P(), P(), P()) + tuple(
        _seq_spec(x, axis) for x in segments
    )
    return _run(spec, body, (q, k, v, mask, bias, scale, *lengths, *segments), in_specs, seq, whole=(3, 4))


def _causal_update(spec: KernelSpec, q, rows: flash.Side, cols, mask, bias, scale, i, out, k, v, src):
    """A ring step of causal attention from device ``i`` over the keys of device ``src``
    (``src != i``), computing only the logits the causal mask does not hide from every row.

    Contiguous layout: every key of ``src`` precedes every query of ``i`` when ``src < i``
    (the whole chunk), and follows it when ``src > i`` (no logit): device ``C - 1`` works on
    every step, device 0 on none. Balanced layout (device ``i`` holds chunks ``i`` and
    ``2C - 1 - i``): when ``src < i`` every query sees the early half of ``src``'s keys and none
    of its late half; when ``src > i`` the late half of the queries sees all of them and the
    early half none. Either way half a chunk's logits, on every device and every step.

    What the causal mask hides from every row is merged as :func:`flash.unseen` (its logits are
    all the fill), so a row that sees no key at all, for whatever reason, still gets the
    mean of every value, as JAX's. Each branch returns the chunk's partial attention,
    merged into ``out`` after the switch.
    """
    sc, t = k.shape[1], q.shape[1]
    g = q.shape[2] // k.shape[2]
    keys = cols(src)
    cut = lambda x, size: flash.columns(x, src * sc, size)  # a mask's or bias's first ``size`` columns of the chunk
    if spec.layout.kind == "contiguous":

        def seen(k, v):
            return flash.attend(spec, q, rows, k, v, keys, cut(mask, sc), cut(bias, sc), scale)

        branches = [seen, lambda k, v: flash.unseen(v, t, g)]
        branch = jnp.where(src > i, 1, 0)
    else:
        th, sh = t // 2, sc // 2

        def early(k, v):
            part = flash.attend(
                spec, q, rows, k[:, :sh], v[:, :sh], keys.part(0, sh), cut(mask, sh), cut(bias, sh), scale
            )
            return flash.merge(part, flash.unseen(v[:, sh:], t, g))

        def late(k, v):
            part = flash.attend(
                spec,
                q[:, th:],
                rows.part(th, t - th),
                k,
                v,
                keys,
                cut(flash.rows_of(mask, th, t - th), sc),
                cut(flash.rows_of(bias, th, t - th), sc),
                scale,
            )
            return flash.stack_rows(flash.unseen(v, th, g), part)

        branches = [early, late]
        branch = jnp.where(src < i, 0, 1)
    return flash.merge(out, jax.lax.switch(branch, branches, k, v))
