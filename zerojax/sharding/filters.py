"""NNX filters (``nnx.Param``, ``nnx.LoRAParam``, ``nnx.All/Any/Not``, path predicates) as
zerojax's per-parameter masks.

A filter selects :class:`flax.nnx.Variable` s by type, tag or path, as ``nnx.split`` and
``nnx.Optimizer(..., wrt=...)`` do. zerojax turns one into the tuple of bools its plan
keeps per parameter leaf (``init_state(..., trainable=filter)``), and refuses a filter that
selects nothing, or one that names Variable types on a tree that has lost them (a pure
dict from ``state.to_pure_dict()``), where it would silently select all or nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
from flax import nnx
from flax.nnx import filterlib


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _takes_path_and_value(fn: Any) -> bool:
    """Whether ``fn`` is an NNX path predicate ``fn(path, value) -> bool`` (two required
    positional parameters), rather than zerojax's ``fn(params) -> tree of bools``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(positional) == 2


def is_filter(x: Any) -> bool:
    """Whether ``x`` is an NNX filter (and not a tree of bools or a function of the params).

    Example:
      >>> from flax import nnx
      >>> from zerojax.sharding.filters import is_filter
      >>> is_filter(nnx.LoRAParam), is_filter(nnx.Not(nnx.LoRAParam)), is_filter({"w": True})
      (True, True, False)
    """
    if isinstance(x, type):
        return issubclass(x, nnx.Variable)
    if isinstance(x, str) or x is Ellipsis:
        return True
    if type(x).__module__ == filterlib.__name__:
        return True
    if isinstance(x, (list, tuple)):
        return bool(x) and all(not isinstance(e, bool) and is_filter(e) for e in x)
    return callable(x) and _takes_path_and_value(x)


def describe(f: Any) -> str:
    """A filter as the user wrote it: ``nnx.LoRAParam``, ``Not(OfType(...))``, ``'dropout'``."""
    if isinstance(f, type):
        return f"nnx.{f.__name__}" if f.__module__.startswith("flax.") else f.__qualname__
    if callable(f) and getattr(f, "__name__", None) and type(f).__module__ != filterlib.__name__:
        return f.__name__
    return repr(f)


def path_keys(path: tuple) -> tuple:
    """A JAX key path as NNX's predicates see it: a tuple of dict keys, indices and names."""
    out = []
    for entry in path:
        attr = next((a for a in ("key", "idx", "name") if hasattr(entry, a)), None)
        out.append(getattr(entry, attr) if attr else str(entry))
    return tuple(out)


def _names_types(f: Any) -> bool:
    """Whether the filter selects by Variable type anywhere (so it needs Variables to see)."""
    if isinstance(f, type):
        return True
    if isinstance(f, (list, tuple)):
        return any(_names_types(e) for e in f)
    if isinstance(f, filterlib.OfType):
        return True
    inner = getattr(f, "predicates", None) or getattr(f, "filters", None)
    if isinstance(inner, (list, tuple)):
        return any(_names_types(e) for e in inner)
    one = getattr(f, "predicate", None)
    return one is not None and _names_types(one)


def _names_a_subset(pred: Any) -> bool:
    """Whether a predicate leaves a plain ``nnx.Param`` at an ordinary path unselected (so
    that selecting every parameter of a model is a surprise, not the intent)."""
    try:
        return not pred(("zerojax_probe",), nnx.Param(0.0))
    except Exception:  # a path predicate that expects the model's own paths: no opinion
        return False


def select(f: Any, tree: Any, *, name: str) -> tuple[bool, ...]:
    """One bool per array leaf of ``tree``: whether filter ``f`` selects the Variable (or
    array) holding it. ``tree`` is an ``nnx.State`` (leaves are ``nnx.Variable`` s) or any
    tree of arrays (then only path predicates can tell leaves apart). ``name`` is how the
    errors call the filter's argument (``"wrt"``, ``"trainable"``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from zerojax.sharding.filters import select
      >>> lora = nnx.LoRA(4, 2, 4, base_module=nnx.Linear(4, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
      >>> params = nnx.state(lora, nnx.Param)     # base bias and kernel, then LoRA's a and b
      >>> select(nnx.LoRAParam, params, name="wrt")
      (False, False, True, True)
    """
    pred = filterlib.to_predicate(f)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    out: list[bool] = []
    for path, leaf in flat:
        hit = bool(pred(path_keys(path), leaf))
        out.extend([hit] * len(jax.tree.leaves(leaf)))
    has_variables = any(is_variable(leaf) for _, leaf in flat)
    if not has_variables and _names_types(f):
        raise TypeError(
            f"{name}={describe(f)} selects nnx.Variable types, but the tree it is applied to holds plain arrays "
            "(no nnx.Variable), so it cannot tell them apart. Pass the nnx.State that nnx.split(model, nnx.Param) "
            "returns (not state.to_pure_dict()), or a path predicate such as lambda path, x: 'lora' in path."
        )
    if all(out) and len(out) > 1 and _names_a_subset(pred):
        raise ValueError(
            f"{name}={describe(f)} selects a subset of parameters (it does not select a plain nnx.Param), yet it "
            f"selects all {len(out)} parameter arrays of this model: nothing would be frozen. If every parameter "
            f"should train, pass {name}=nnx.Param; otherwise check the filter's types and paths."
        )
    if not any(out):
        kinds = sorted({type(leaf).__name__ for _, leaf in flat})
        raise ValueError(
            f"{name}={describe(f)} selects none of the {len(out)} parameter arrays (their types: "
            f"{', '.join(kinds)}): nothing would train. Name a type the model has (nnx.Param trains every "
            "parameter), or check the filter's paths and tags."
        )
    return tuple(out)
