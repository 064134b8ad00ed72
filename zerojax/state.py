"""The train state pytree and how it is born sharded."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zerojax.config import ZeroConfig
from zerojax.optim import loss_scale as ls
from zerojax.optim.offload import with_split
from zerojax.optim.update import check_optimizer
from zerojax.sharding.plan import ZeroPlan, make_plan, master_dtype
from zerojax.stages.per_stage import stage_of
from zerojax.tensors.born import donated, loaded_storage


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """Train state: a pytree of arrays plus a static ``plan``. Each field means one thing at
    every stage; which fields a stage keeps is :mod:`zerojax.stages.per_stage`' business.
    Trees of parameters have the user's structure, with ``optax.MaskedNode()`` in the place
    of the parameters a field does not hold (frozen ones in ``params``/``master``, trainable
    ones in ``frozen``), as ``optax.masked`` does.

    Fields:
      step: int32[], train-step calls so far (skipped ones included).
      params: the full trainable parameters forward reads, replicated on every device:
        stage 0 (fp32, cast to the compute dtype in the step) and stages 1–2 (in the
        compute dtype). ``None`` at stage 3, where forward gathers each layer from ``master``.
      master: the fp32 master weights of the trainable parameters in sharded storage (laid
        out by ``plan.layouts``, see :mod:`zerojax.sharding.leaf_layout`); ``None`` where
        ``params`` are the masters themselves (stage 0, and stages 1–2 with fp32 compute).
      frozen: the frozen parameters (``init_state(..., trainable=...)``), in the compute
        dtype where it is narrower than theirs, or their own (``ZeroConfig.frozen_dtype``):
        replicated at stages 0–2, sharded at stage 3.
        They never change. ``None`` when every parameter trains.
      opt_state: the optax state of the trainable masters, in optax's own tree; each array
        stored by its own layout (``plan.opt_layouts``): sharded from stage 1 on, replicated
        at stage 0; scalars (step counts, injected hyperparameters) are plain scalars.
      model_state: non-trained model state (BatchNorm statistics, ...), replicated, or
        ``None``.
      rng: the run's base key (``jax.random.key``), or ``None``; each step, device and
        micro-batch folds its own key from it.
      loss_scale: the fp16 loss scaler's state, or ``None``.
      skipped: int32[], steps skipped for non-finite gradients so far.

    Use :func:`zerojax.gather_params` for the full parameter tree in any stage.
    """

    step: jax.Array
    params: Any
    master: Any
    frozen: Any
    opt_state: Any
    model_state: Any
    rng: Any
    loss_scale: ls.LossScaleState | None
    skipped: jax.Array
    plan: ZeroPlan = dataclasses.field(metadata=dict(static=True))


def check_alive(state: ZeroState, what: str) -> None:
    """Raises a clear error for a state whose arrays were donated to (consumed by) an
    earlier train step: running a program on deleted buffers crashes the interpreter."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"this state's array state{jax.tree_util.keystr(path)} has been deleted: the state was donated to "
                f"a train step, which consumed it (its buffers now hold the state that step returned). Pass "
                f"{what} the state the last step returned (state, metrics = train_step(state, batch)), or build "
                "the step and state with zj.ZeroConfig(donate=False) to keep every input state usable."
            )


def state_shardings(plan: ZeroPlan, scaler: Any, model_state: Any = None, rng: Any = None) -> ZeroState:
    """Where every field of a state of ``plan`` lives."""
    params, master = stage_of(plan).field_shardings(plan)
    rep = plan.replicated
    return ZeroState(
        step=rep,
        params=None if params is None else plan.unflatten_train(params),
        master=None if master is None else plan.unflatten_train(master),
        frozen=plan.unflatten_frozen(plan.shardings(plan.frozen_layouts)) if plan.has_frozen else None,
        opt_state=plan.unflatten_opt(plan.opt_shardings()),
        model_state=jax.tree.map(lambda _: rep, model_state),
        rng=None if rng is None else rep,
        loss_scale=jax.tree.map(lambda _: rep, scaler),
        skipped=rep,
        plan=plan,
    )


def init_state(
    params: Any,
    tx: Any,
    *,
    mesh: Mesh,
    config: ZeroConfig,
    rng: Any = None,
    model_state: Any = None,
    trainable: Any = None,
    tensor_specs: Any = None,
    weights: Any = None,
) -> ZeroState:
    """Builds a sharded train state.

    Args:
      params: the initial parameters (a tree of arrays), or a function of no arguments
        that returns them (``init_fn``): it is traced under ``jax.jit`` with the sharded
        storage as outputs, so each device creates only its own shards and a model larger
        than one device is never built whole.
      tx: any optax optimizer (an object with ``init`` and ``update``).
      rng: a key (``jax.random.key(seed)``) for stochastic layers; ``make_train_step(...,
        with_rng=True)`` hands the loss a key of its own per step, device and micro-batch.
      model_state: state the model updates but does not train (BatchNorm statistics), a
        tree of arrays or a function returning one; kept replicated.
      trainable: which parameters train: a tree of bools shaped like ``params``, a
        callable on ``params`` returning one, or an NNX filter (``nnx.LoRAParam``,
        ``nnx.Not(...)``, a path predicate ``fn(path, variable)``) applied to the
        ``nnx.State`` given as ``params`` (default: all). Frozen parameters get no
        optimizer state and no gradient, and are stored in the compute dtype where it is
        narrower, or in their own with ``ZeroConfig(frozen_dtype="param")`` (see
        :class:`ZeroState`).
      tensor_specs: with a tensor axis in the mesh (``zj.make_mesh(tensor=T)``), a tree of
        ``PartitionSpec`` (or None) shaped like ``params`` naming the dimension of each
        parameter split over it, for parameters without Flax annotations (annotated NNX
        Variables and linen's ``nn.Partitioned`` boxes are read without it; see
        :mod:`zerojax.sharding.annotations`).
      weights: pretrained weights, a :class:`zerojax.Weights` (a safetensors file or
        Hugging Face sharded checkpoint and the map from parameter names to its tensors)
        or a path (tensors named as ``zerojax export`` names them). ``params`` then gives
        only the structure, shapes and dtypes (abstract leaves from ``jax.eval_shape`` /
        ``nnx.eval_shape`` are enough); every process reads only the bytes of the shards
        its devices hold, straight into the masters' (and frozen weights') ZeRO layout
        (see :mod:`zerojax.tensors.weights`). Every parameter must be in the checkpoint,
        except those ``zj.Weights(path, map, optional=patterns)`` names (new LoRA adapters,
        a new head), which ``params`` (an ``init_fn`` or concrete arrays) then provides.

    The optimizer state and masters are created directly in their sharded layout (``jax.jit``
    with ``out_shardings``): no device ever holds more than its share of them.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax as zj
      >>> params = {"w": jnp.ones((13, 7)), "b": jnp.zeros((7,))}
      >>> state = zj.init_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> int(state.step), zj.gather_params(state)["w"].shape
      (0, (13, 7))
      >>> init_fn = lambda: {"w": jax.random.normal(jax.random.key(0), (4096, 512))}
      >>> big = zj.init_state(init_fn, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> big.master["w"].addressable_shards[0].data.shape   # born sharded
      (4096, 64)
    """
    build, args, plan, out = _init_program(
        params,
        tx,
        mesh=mesh,
        config=config,
        model_state=model_state,
        trainable=trainable,
        rng=rng,
        tensor_specs=tensor_specs,
    )
    if weights is not None:
        loaded_train, loaded_frozen, given = loaded_storage(weights, params, plan, init=is_init_fn(params))
        args = (args[0] if given else [], args[1], loaded_train, loaded_frozen)
        # The loaded shards are the masters' storage itself: donated, so never held twice.
        p, master, frozen, opt_state, ms = jax.jit(build, out_shardings=out, donate_argnames=donated(plan))(*args)
    else:
        if not is_init_fn(params):
            _refuse_abstract(params)
        p, master, frozen, opt_state, ms = jax.jit(build, out_shardings=out)(*args)
    rep = plan.replicated
    return ZeroState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep),
        params=p,
        master=master,
        frozen=frozen,
        opt_state=opt_state,
        model_state=ms,
        rng=None if rng is None else _replicated_key(_key(rng), rep),
        loss_scale=jax.device_put(ls.init(config), rep),
        skipped=jax.device_put(jnp.zeros((), jnp.int32), rep),
        plan=plan,
    )


def lower_init(params: Any, tx: Any, *, mesh: Mesh, config: ZeroConfig, **kwargs):
    """The lowered program ``init_state`` runs, to inspect its memory before running it."""
    build, args, _, out = _init_program(params, tx, mesh=mesh, config=config, **kwargs)
    return jax.jit(build, out_shardings=out).lower(*args)


def abstract_state(
    params: Any,
    tx: Any,
    *,
    mesh: Mesh,
    config: ZeroConfig,
    rng: Any = None,
    model_state: Any = None,
    trainable: Any = None,
    tensor_specs: Any = None,
) -> ZeroState:
    """The state ``init_state`` would build, as ``jax.ShapeDtypeStruct`` leaves with shardings.

    Nothing is allocated: ``params`` may itself be abstract (``jax.eval_shape`` /
    ``nnx.eval_shape``) or an ``init_fn``, so a model far larger than the machine can be
    planned. ``train_step.lower(abstract, batch).compile()`` then gives the compiled step
    and its ``memory_analysis()`` before any array exists (see :func:`zerojax.report.step_memory`).

    Example:
      >>> import jax, optax, zerojax as zj
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), "float32")}
      >>> st = zj.abstract_state(params, optax.adam(1e-3), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=3))
      >>> st.master["w"].shape, st.master["w"].sharding.shard_shape(st.master["w"].shape)
      ((4096, 4096), (4096, 512))
    """
    build, args, plan, out = _init_program(
        params,
        tx,
        mesh=mesh,
        config=config,
        model_state=model_state,
        trainable=trainable,
        rng=rng,
        tensor_specs=tensor_specs,
    )
    shapes = jax.eval_shape(build, *args)
    abstract = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    p, master, frozen, opt_state, ms = jax.tree.map(abstract, shapes, out)
    rep = plan.replicated
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    key = None if rng is None else jax.ShapeDtypeStruct((), _key(rng).dtype, sharding=rep)
    return ZeroState(
        step=scalar,
        params=p,
        master=master,
        frozen=frozen,
        opt_state=opt_state,
        model_state=ms,
        rng=key,
        loss_scale=jax.tree.map(lambda x: abstract(x, rep), ls.init(config)),
        skipped=scalar,
        plan=plan,
    )


def _refuse_abstract(params: Any) -> None:
    """Abstract leaves (``jax.ShapeDtypeStruct``) have no values to train from."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is abstract (jax.ShapeDtypeStruct): it has no "
                "values. Pass arrays, an init function, or weights=zj.Weights(path, map) to read them "
                "from a checkpoint."
            )


def is_init_fn(x: Any) -> bool:
    """Whether ``x`` is a function that builds a tree (rather than the tree itself)."""
    return callable(x) and not hasattr(x, "shape") and not isinstance(x, (dict, list, tuple))


def _replicated_key(key: jax.Array, sharding: Any) -> jax.Array:
    """``key`` on every device of ``sharding``: built by a program of its own, since
    ``device_put`` of a key onto devices of other processes is refused."""
    data, impl = np.asarray(jax.random.key_data(key)), jax.random.key_impl(key)
    return jax.jit(lambda: jax.random.wrap_key_data(data, impl=impl), out_shardings=sharding)()


def _key(rng: Any) -> jax.Array:
    """A typed key from ``jax.random.key(...)`` or a raw ``jax.random.PRNGKey(...)``."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return rng
    if dtype == jnp.uint32 and jnp.shape(rng) == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"rng must be a key from jax.random.key(seed) (or jax.random.PRNGKey(seed)), got {rng!r}.")


def refuse_module(params: Any) -> None:
    """Raises a clear error for a Flax module passed where its parameters are wanted (a
    module is callable, and would otherwise be taken for an init function)."""
    from flax import linen, nnx

    if isinstance(params, nnx.Module):
        raise TypeError(
            f"params is an NNX module ({type(params).__name__}), not its parameters. Pass them: "
            "graphdef, params, rest = nnx.split(model, nnx.Param, ...) and zj.init_state(params, ...); "
            "or let zerojax split the module: zj.nnx.Optimizer(model, tx, mesh=mesh, config=config)."
        )
    if isinstance(params, linen.Module):
        raise TypeError(
            f"params is a linen module ({type(params).__name__}), not its parameters. Pass "
            "model.init(key, x)['params'], or an init function: lambda: model.init(key, x)['params']."
        )


def _init_program(params, tx, *, mesh, config, model_state=None, trainable=None, rng=None, tensor_specs=None):
    refuse_module(params)
    check_optimizer(tx)
    if rng is not None:
        _key(rng)
    make = params if is_init_fn(params) else None
    make_ms = model_state if is_init_fn(model_state) else None
    shapes = jax.eval_shape(make) if make is not None else params
    plan = with_split(make_plan(shapes, mesh, config, tx, trainable, tensor_specs), tx)
    stage = stage_of(plan)

    def build(leaves, ms, loaded_train=None, loaded_frozen=None):
        # loaded_*: storage arrays read from pretrained weights (None where a leaf is not).
        n_train, n_frozen = len(plan.train_layouts), len(plan.frozen_layouts)
        loaded_train = loaded_train or [None] * n_train
        loaded_frozen = loaded_frozen or [None] * n_frozen
        if make is not None:
            leaves = jax.tree.leaves(make())
        if not leaves:  # every leaf loaded
            leaves = [None] * len(plan.layouts)
        if make_ms is not None:
            ms = make_ms()
        ms = jax.tree.map(jnp.asarray, ms)
        train, frozen = plan.split(leaves)
        master_ls, shardings = plan.master_layouts, plan.shardings(plan.master_layouts)
        masters = [
            jnp.asarray(x).astype(master_dtype(x.dtype)) if s_in is None else l.from_storage(s_in)
            for l, x, s_in in zip(master_ls, train, loaded_train)
        ]
        opt = jax.tree.leaves(tx.init(plan.unflatten_train(masters)))
        # Stored in their storage dtypes (ZeroConfig.state_dtypes: bf16 rounds to nearest).
        storage = [
            jax.lax.with_sharding_constraint(l.to_storage(x.astype(plan.master_storage_dtype(l))), s)
            if s_in is None
            else s_in.astype(plan.master_storage_dtype(l))
            for l, x, s, s_in in zip(master_ls, masters, shardings, loaded_train)
        ]
        p, m = stage.fields(plan, storage)
        frozen = [
            f_in if f_in is not None else l.to_storage(jnp.asarray(x).astype(l.dtype))
            for l, x, f_in in zip(plan.frozen_layouts, frozen, loaded_frozen)
        ]
        opt = [l.to_storage(x.astype(l.dtype)) for l, x in zip(plan.opt_storage_layouts, opt)]
        return (
            None if p is None else plan.unflatten_train(p),
            None if m is None else plan.unflatten_train(m),
            plan.unflatten_frozen(frozen) if plan.has_frozen else None,
            plan.unflatten_opt(opt),
            ms,
        )

    ms_shapes = jax.eval_shape(make_ms) if make_ms is not None else model_state
    sh = state_shardings(plan, ls.init(config), ms_shapes, rng)
    args = ([] if make is not None else jax.tree.leaves(params), None if make_ms is not None else model_state)
    return build, args, plan, (sh.params, sh.master, sh.frozen, sh.opt_state, sh.model_state)
