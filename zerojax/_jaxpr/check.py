"""Whether zerojax reads JAX programs in this process, checked the first time one is read.

Several of zerojax's features read the jaxpr of the user's loss (or of an optimizer's
update): per-use gathering at stages 2 and 3, prefetch, the per-layer remat policy, the
sequence-order check of a layout that moves the sequence, a model's own sharding mapped
onto zerojax's mesh, the batched-gather rewrite of a tensor x context mesh, the pipeline's
layer scan, the offloaded
update's groups and the partial-collective warning. JAX changes its program form between
releases, patch releases included. So the first time a feature would read a program,
:func:`reading` traces each construct zerojax reads and reads it back through
:mod:`zerojax._jaxpr` (:func:`failures`). Where everything reads as expected, programs are
read. Where a construct does not (a JAX release zerojax does not know yet), or where
``ZEROJAX_NO_PROGRAM_READING=1`` is set, zerojax warns once (:class:`ProgramReadingOff`,
naming the JAX version, the constructs and the features affected) and every feature takes
a path that reads no program (:data:`WITHOUT_READING`): the same numbers, slower or with
more memory, or refused with the fix where no such path exists. Importing zerojax never
depends on it.

Example:
  >>> from zerojax._jaxpr import check
  >>> isinstance(check.reading(), bool)
  True
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import jax
import jax.numpy as jnp

from zerojax._jaxpr import constructs, form, rules, walk

ENV = "ZEROJAX_NO_PROGRAM_READING"

# What each feature does where no program is read: the warning and the README say it.
WITHOUT_READING: tuple[tuple[str, str], ...] = (
    (
        "stage 3",
        "gathers every parameter whole before each micro-batch's forward and again for its backward, instead "
        "of each layer where it runs: the same numbers, but the whole model's compute-dtype copy is on each "
        "device while a micro-batch runs",
    ),
    ("stage 2", "reduce-scatters every gradient once backward is done (as stage 1 does): the same numbers"),
    ("prefetch", "ZeroConfig(prefetch=...) is off"),
    (
        "remat",
        "ZeroConfig(remat=...) is not applied (it wraps each layer loop it finds in the program): the same "
        "numbers, more activation memory; remat written in the model (nnx.remat, nn.remat, jax.checkpoint) "
        "still applies",
    ),
    (
        "balanced context layout",
        "refused with the fix (ZeroConfig(context={'layout': 'contiguous'})): its sequence-order check reads the loss",
    ),
    (
        "a model's own mesh",
        "ZeroConfig(axes={'model_axes': ...}) is refused: mapping the model's constraints reads them",
    ),
    (
        "tensor x context mesh",
        "refused: the batched-gather rewrite that keeps XLA's partitioner from aborting reads the loss",
    ),
    (
        "pipeline",
        "a mesh with a pipeline axis is refused with the fix (a mesh without one): the pipeline finds the layer "
        "scan it splits in the loss's program",
    ),
    ("offloaded update", "runs as one group instead of groups of sub_group_size: the same numbers, more memory"),
    ("partial-batch collectives", "the warning about a collective over part of the batch is not given"),
)


class ProgramReadingOff(UserWarning):
    """zerojax reads no JAX program in this process; see :mod:`zerojax._jaxpr.check`."""


class ProgramReadingRequired(RuntimeError):
    """A feature that needs a program read, asked for where zerojax reads none."""


def _custom_vjp_example():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))
    return f


def _checks():
    """``(construct, function of an f32[3, 2], its primitive (or the primitive's name), check of
    the first such equation)``."""

    def scanned(x):
        w = x[1] * 2.0  # a loop constant computed in the trace (a concrete array would start a backend)
        return jax.lax.scan(lambda c, r: (c * w + r, jnp.sum(r)), x[0], x)[0]

    def scoped(x):
        with jax.named_scope("zerojax_check"):
            return jnp.sin(x)

    yield (
        "binding one equation again",
        jnp.sin,
        "sin",
        lambda e: (
            jax.eval_shape(lambda v: form.bind(e, [v])[0], jax.ShapeDtypeStruct((3, 2), jnp.float32)).shape == (3, 2)
        ),
    )
    yield ("jax.named_scope", scoped, "sin", lambda e: "zerojax_check" in form.scope(e))
    yield (
        "jax.jit",
        lambda x: jax.jit(jnp.sin)(x),
        form.P.jit_p,
        lambda e: (s := constructs.structure(e)).kind == "call" and s.body.eqns,
    )
    yield (
        "jax.lax.scan",
        scanned,
        form.P.scan_p,
        lambda e: (
            (s := constructs.scan(e))
            and (s.n_consts, s.n_carry, s.length) == (1, 1, 3)
            and len(s.body.invars) == 3
            and len(s.body.outvars) == 2
        ),
    )
    yield (
        "jax.checkpoint",
        lambda x: jax.checkpoint(jnp.sin)(x),
        form.P.remat_p,
        lambda e: (r := constructs.remat(e)) and r.body.eqns and isinstance(r.prevent_cse, bool),
    )
    yield (
        "slicing (x[0])",
        lambda x: x[0],
        form.P.slice_p,
        lambda e: constructs.static_slice(e).limit == (1, 2) and rules.dims(e).mixed == ((0, 0),),
    )
    yield (
        "jax.custom_jvp (jax.nn.relu)",
        jax.nn.relu,
        form.P.custom_jvp_call_p,
        lambda e: form.RULE_THUNKS[0] in e.params and constructs.structure(e).kind == "custom_jvp",
    )
    yield (
        "jax.custom_vjp",
        _custom_vjp_example(),
        form.P.custom_vjp_call_p,
        lambda e: form.RULE_THUNKS[1] in e.params and constructs.structure(e).kind == "custom_vjp",
    )
    looped = lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))
    yield (
        "jax.lax.while_loop",
        looped,
        form.P.while_p,
        lambda e: (s := constructs.structure(e)) and (s.n_cond, s.n_body) == (0, 0) and len(s.body.invars) == 2,
    )
    yield (
        "jax.lax.cond",
        lambda x: jax.lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x),
        form.P.cond_p,
        lambda e: len(constructs.structure(e).branches) == 2,
    )

    idx = lambda x: jnp.zeros((3, 1), jnp.int32)
    yield (
        "jnp.take_along_axis",
        lambda x: jnp.take_along_axis(x, idx(x), axis=-1, mode="fill"),
        form.P.gather_p,
        lambda e: (
            (t := constructs.take_along(e))
            and (t.dim, t.pairs, t.fill) == (1, ((0, 0),), True)
            and constructs.has_batching_dims(e)
            and rules.dims(e).mixed == ((0, 1),)
            and rules.dims(e).out[0][0] == ((1, 0), (0, 0))
        ),
    )
    yield (
        "jnp.einsum",
        lambda x: jnp.einsum("ab,cb->ac", x, x),
        form.P.dot_general_p,
        lambda e: rules.dims(e).contracted == (((0, 1), (1, 1)),) and rules.dims(e).out[0] == (((0, 0),), ((1, 0),)),
    )
    yield ("jnp.arange", lambda x: x + jnp.arange(2), form.P.iota_p, lambda e: rules.dims(e).iota == ((0, 0),))
    yield ("reshape", lambda x: x.reshape(6), form.P.reshape_p, lambda e: rules.dims(e).out[0] == (((0, 0), (0, 1)),))
    yield (
        "broadcasting",
        lambda x: jax.lax.broadcast_in_dim(x, (3, 4, 2), (0, 2)),
        form.P.broadcast_in_dim_p,
        lambda e: rules.dims(e).out[0] == (((0, 0),), (), ((0, 1),)),
    )
    yield (
        "jnp.concatenate",
        lambda x: jnp.concatenate([x, x]),
        form.P.concatenate_p,
        lambda e: rules.dims(e).mixed == ((0, 0), (1, 0)),
    )
    yield ("jnp.pad", lambda x: jnp.pad(x, ((0, 0), (1, 0))), form.P.pad_p, lambda e: rules.dims(e).mixed == ((0, 1),))
    yield ("jnp.sum", lambda x: jnp.sum(x, 0), form.P.reduce_sum_p, lambda e: rules.dims(e).reduced == ((0, 0),))
    yield "jnp.cumsum", lambda x: jnp.cumsum(x, 0), "cumsum", lambda e: rules.dims(e).mixed == ((0, 0),)
    from jax.sharding import AbstractMesh, AxisType

    mesh = AbstractMesh((1,), ("zerojax_check",), axis_types=(AxisType.Auto,))

    def traced_under(x):
        with jax.sharding.use_abstract_mesh(mesh):
            return jnp.sin(x)

    no_mesh = AbstractMesh((), ())
    yield (
        "the mesh an equation was traced under",
        traced_under,
        "sin",
        lambda e: form.traced_mesh(e) == mesh and form.traced_mesh(form.under_mesh(e, no_mesh)) == no_mesh,
    )

    gathered = lambda x: jax.lax.all_gather(x, "zerojax_check", axis=0, tiled=True) * 2
    yield (
        "jax.shard_map",
        jax.shard_map(gathered, mesh=mesh, in_specs=jax.P("zerojax_check"), out_specs=jax.P("zerojax_check")),
        "shard_map",
        lambda e: (
            (r := constructs.structure(e)).kind == "shard_map"
            and r.in_specs == ((("zerojax_check",), ()),)
            and r.axes == {"zerojax_check"}
            and r.source
            and r.source.endswith("check.py")
        ),
    )
    yield (
        "jax.lax.all_gather",
        jax.shard_map(gathered, mesh=mesh, in_specs=jax.P("zerojax_check"), out_specs=jax.P("zerojax_check")),
        "all_gather",
        lambda e: rules.dims(e).collective.joins == ((0, 0),) and constructs.collective_axes(e) == ("zerojax_check",),
    )


def _run_checks() -> list[tuple[str, str]]:
    """``(construct, what went wrong)`` for each construct that does not read as expected."""
    found = []
    if form.P.missing:
        found.append(("its primitives", f"jax.extend.core.primitives does not export {list(form.P.missing)}"))
    x = jax.ShapeDtypeStruct((3, 2), jnp.float32)  # abstract: checking must not start a backend
    for what, fn, prim, ok in _checks():
        try:
            eqns = walk.equations(jax.make_jaxpr(fn)(x).jaxpr)  # nested calls too: jnp runs jitted programs
            match = (lambda e: form.name(e) == prim) if isinstance(prim, str) else (lambda e: e.primitive is prim)
            eqn = next((e for e in eqns if match(e)), None)
        except Exception as e:  # noqa: BLE001 - a probe: any failure means the form is not the one known
            found.append((what, f"tracing it failed with {type(e).__name__}: {e}"))
            continue
        if eqn is None:
            found.append((what, f"it no longer traces to the primitive {getattr(prim, 'name', prim)!r}"))
            continue
        try:
            good = bool(ok(eqn))
        except Exception as e:  # noqa: BLE001
            found.append(
                (
                    what,
                    f"primitive {form.name(eqn)!r} has parameters {sorted(eqn.params)}, read as {type(e).__name__}: {e}",
                )
            )
            continue
        if not good:
            found.append(
                (
                    what,
                    f"primitive {form.name(eqn)!r} has parameters {sorted(eqn.params)} that read differently than expected",
                )
            )
    return found


@functools.cache
def failures() -> tuple[tuple[str, str], ...]:
    """``(construct, what went wrong)`` of every construct zerojax reads that this JAX
    release does not trace or read as zerojax expects; () where all read as expected.
    Checked once per process, in a thread of its own (a clean tracing context: the first
    read may happen while a step is being traced)."""
    out: list = []

    def run():
        try:
            out.extend(_run_checks())
        except Exception as e:  # noqa: BLE001 - never let the probe fail its caller
            out.append(("the check itself", f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, name="zerojax-program-check")
    t.start()
    t.join()
    return tuple(out)


def _switched_off() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 1 to read no JAX program, or to 0 (or unset it) to read them.")
    return value == "1"


_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(reason: str) -> None:
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    affected = "".join(f"\n  - {feature}: {how}" for feature, how in WITHOUT_READING)
    warnings.warn(
        f"zerojax reads no JAX program in this process, jax {jax.__version__}: {reason}. Every feature gives the "
        f"same numbers through a path that reads none, or refuses with the fix:{affected}\n"
        "The README's 'JAX versions' section says how to report a JAX release zerojax does not read.",
        ProgramReadingOff,
        stacklevel=3,
    )


def reading() -> bool:
    """Whether zerojax reads JAX programs in this process: not where ``ZEROJAX_NO_PROGRAM_READING=1``
    is set, nor where this JAX release's program form fails the check (:func:`failures`);
    each says so once with a :class:`ProgramReadingOff` warning. Asked by every feature that
    reads a program, when a step is traced."""
    if _switched_off():
        _warn_once(f"{ENV}=1 is set")
        return False
    found = failures()
    if found:
        _warn_once("it does not read " + "; ".join(f"{what} ({detail})" for what, detail in found))
        return False
    return True


def require(feature: str, fix: str) -> None:
    """Refuses ``feature`` (:class:`ProgramReadingRequired`, naming ``fix``) where no program is read."""
    if reading():
        return
    if _switched_off():
        why, other = f"{ENV}=1 is set", f"or unset {ENV}"
    else:
        why = f"jax {jax.__version__}: it does not read " + ", ".join(what for what, _ in failures())
        other = "or use a JAX release whose program form zerojax reads (the README's 'JAX versions')"
    raise ProgramReadingRequired(
        f"{feature} needs zerojax to read the loss's JAX program, and it reads none in this process ({why}). "
        f"{fix.rstrip('.')}, {other}."
    )
