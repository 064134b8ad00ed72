"""An NNX module as zerojax's pieces: the graph, the parameters, the rng streams and the
rest of its state, and back.

``nnx.split(model, params, nnx.RngState, ...)`` gives four parts:

* the graph (static: the module's structure and attributes such as ``deterministic``);
* the parameters: every ``nnx.Param`` (``nnx.LoRAParam`` included) and whatever else the
  optimizer's ``wrt`` filter selects; those ``wrt`` selects train, the other ones are
  frozen (no optimizer state, stored in the compute dtype: ``ZeroConfig.frozen_dtype``);
* the rng streams (``nnx.RngKey`` / ``nnx.RngCount`` of every ``nnx.Rngs`` the module keeps,
  ``nnx.Dropout`` 's and attention's included);
* the rest: ``nnx.BatchStat`` and any other Variable, which the step updates as
  ``make_train_step(..., with_model_state=True)`` does.

The rng streams and the rest travel as zerojax's model state, keys as their raw
``uint32`` data (a model-state leaf is averaged over devices when floating and taken from
device 0 otherwise; a typed key is neither). In a train step every stream's key is
salted with the step's key for this device and micro-batch, so each step, device and
micro-batch draws its own masks, the same at every stage; the streams' counters advance
as NNX's do, once per draw and micro-batch, and their keys stay the module's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.remat import Remat, nnx_module
from zerojax.sharding.filters import describe, is_filter, is_variable, path_keys, select


def _params_filter(wrt: Any) -> Any:
    """What the parameter part holds: every Param, and what ``wrt`` selects beyond it,
    never an rng stream."""
    return nnx.All(nnx.Any(nnx.Param, wrt), nnx.Not(nnx.RngState))


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", jnp.float32), jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class Parts:
    """How one module splits. ``trainable`` is the per-parameter-leaf mask of ``wrt``;
    ``key_impls`` the key implementation of each rng key leaf, in order."""

    graphdef: Any
    wrt: Any
    trainable: tuple[bool, ...]
    key_impls: tuple[Any, ...]

    @property
    def has_rngs(self) -> bool:
        """Whether the module keeps rng streams (each has a key)."""
        return bool(self.key_impls)

    @classmethod
    def of(cls, model: nnx.Module, wrt: Any) -> Parts:
        """The parts of ``model`` (concrete or from ``nnx.eval_shape``), checking ``wrt``."""
        if not is_filter(wrt):
            raise TypeError(
                f"wrt must be an NNX filter (a Variable type such as nnx.Param or nnx.LoRAParam, nnx.All/Any/Not, "
                f"a path predicate fn(path, variable)), got {wrt!r}."
            )
        graphdef, params, rngs, _ = nnx.split(model, _params_filter(wrt), nnx.RngState, ...)
        trainable = select(wrt, params, name="wrt")
        pred = nnx.filterlib.to_predicate(wrt)
        for path, v in jax.tree_util.tree_flatten_with_path(rngs, is_leaf=is_variable)[0]:
            if pred(path_keys(path), v):
                raise TypeError(
                    f"wrt={describe(wrt)} selects the rng stream variable {type(v).__name__} "
                    f"{jax.tree_util.keystr(path)}, which cannot train. Narrow the filter, e.g. nnx.All(wrt, nnx.Param)."
                )
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
        leaves = [(p, v) for p, v in flat for _ in jax.tree.leaves(v)]
        for (path, v), on in zip(leaves, trainable):
            dtype = getattr(v.get_value() if is_variable(v) else v, "dtype", None)
            if on and dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"wrt={describe(wrt)} selects {type(v).__name__} {jax.tree_util.keystr(path)} of dtype {dtype}, "
                    "which cannot train (not floating). Narrow the filter, e.g. nnx.All(wrt, nnx.Param)."
                )
        impls = tuple(_key_impl(x) for x in jax.tree.leaves(rngs) if _is_key(x))
        return cls(graphdef, wrt, trainable, impls)

    def split(self, model: nnx.Module) -> tuple[nnx.State, dict]:
        """``model`` -> (parameters, model state ``{"rngs": ..., "rest": ...}``)."""
        _, params, rngs, rest = nnx.split(model, _params_filter(self.wrt), nnx.RngState, ...)
        return params, {"rngs": _pack(rngs), "rest": rest}

    def merge(self, params: Any, model_state: dict, *, salt: jax.Array | None = None) -> nnx.Module:
        """A module from parameters and model state; ``salt`` (a key) is folded into every
        rng stream's key."""
        rngs = self.unpack(model_state["rngs"])
        if salt is not None:
            bits = jax.random.bits(salt, (), jnp.uint32)
            rngs = jax.tree.map(lambda x: jax.random.fold_in(x, bits) if _is_key(x) else x, rngs)
        return nnx.merge(self.graphdef, params, rngs, model_state["rest"])

    def unpack(self, rngs: Any) -> Any:
        """Rng streams with their keys typed again."""
        impls = iter(self.key_impls)
        return _map_variables(
            lambda v: (
                v.replace(jax.random.wrap_key_data(v.get_value(), impl=next(impls))) if isinstance(v, nnx.RngKey) else v
            ),
            rngs,
        )

    def new_model_state(self, model: nnx.Module, given: dict) -> dict:
        """The model state after ``model`` ran: new counters, the given keys (not the salted
        ones), the rest as the module left it, cast back to the dtypes it came in."""
        _, _, rngs, rest = nnx.split(model, _params_filter(self.wrt), nnx.RngState, ...)
        new, treedef = jax.tree_util.tree_flatten(_pack(rngs), is_leaf=is_variable)
        old = jax.tree.leaves(given["rngs"], is_leaf=is_variable)
        rngs = jax.tree_util.tree_unflatten(treedef, [o if isinstance(n, nnx.RngKey) else n for n, o in zip(new, old)])
        cast = lambda new, old: jnp.asarray(new).astype(old.dtype)
        return {"rngs": rngs, "rest": jax.tree.map(cast, rest, given["rest"])}


def sync_batch_norms(model: nnx.Module, axes: str | tuple[str, ...]) -> None:
    """Binds every ``nnx.BatchNorm`` of ``model`` that has no ``axis_name`` to the batch
    axes, so that its batch statistics are those of the global batch, as on one device."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            module.axis_name = axes


def remat_listed_blocks(model: nnx.Module, spec: Any) -> int:
    """Makes each call of a block held in a list (``nnx.List`` or a Python list or tuple of
    two or more modules of one class: the usual way to write unrolled layers in NNX) one
    remat region with the policy ``spec`` (:func:`zerojax.remat.nnx_module`), in place;
    blocks whose class already rematerializes are left as they are. ``model`` is the
    step's own copy, made for this trace. Returns how many blocks it changed."""
    changed = 0
    for _, module in nnx.iter_modules(model):
        for value in vars(module).values():
            if not isinstance(value, _SEQUENCES):
                continue
            blocks = [v for v in value if isinstance(v, nnx.Module)]
            if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
                continue
            cls = type(blocks[0])
            if isinstance(getattr(cls, "zerojax_remat", None), Remat):
                continue
            remat_cls = _remat_class(cls, spec)
            for b in blocks:
                b.__class__ = remat_cls
                changed += 1
    return changed


_SEQUENCES = (list, tuple) + ((nnx.List,) if hasattr(nnx, "List") else ())
_REMAT_CLASSES: dict = {}  # (block class, policy) -> its remat subclass: one per pair


def _remat_class(cls: type, spec: Any) -> type:
    key = (cls, spec)
    if key not in _REMAT_CLASSES:
        _REMAT_CLASSES[key] = nnx_module(cls, spec)
    return _REMAT_CLASSES[key]


def _key_impl(key: Any) -> Any:
    """The implementation of a key array, or of an abstract one (from ``nnx.eval_shape``)."""
    if isinstance(key, jax.Array):
        return jax.random.key_impl(key)
    found: list = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), key)
    return found[0]


def _map_variables(fn: Callable[[nnx.Variable], nnx.Variable], state: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=is_variable)
    return jax.tree_util.tree_unflatten(treedef, [fn(v) if is_variable(v) else v for v in leaves])


def _pack(rngs: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, rngs)


def build(model: nnx.Module | Callable[[], nnx.Module]) -> tuple[nnx.Module, Callable[[], nnx.Module] | None]:
    """``(module, init_fn)``: a concrete module and ``None``, or for a function that builds
    one, the abstract module (``nnx.eval_shape``: nothing allocated) and the function."""
    if isinstance(model, nnx.Module):
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model))):
            raise TypeError(
                f"model is an abstract {type(model).__name__} (from nnx.eval_shape: shapes, no values). Pass the "
                "function that builds it instead, e.g. zj.nnx.Optimizer(lambda: Model(...), tx, ...): zerojax "
                "plans it with nnx.eval_shape and each device builds only its own shards."
            )
        return model, None
    if callable(model):
        abstract = nnx.eval_shape(model)
        if not isinstance(abstract, nnx.Module):
            raise TypeError(f"model() must return an NNX module, got {type(abstract).__name__}.")
        return abstract, model
    raise TypeError(f"model must be an NNX module or a function of no arguments that builds one, got {model!r}.")
