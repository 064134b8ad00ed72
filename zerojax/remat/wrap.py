"""Applying a remat policy to a function, an NNX module class or a linen module class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn
from flax import nnx

from zerojax.remat.policy import Remat, resolve


def checkpoint(fn: Callable, spec: str | Remat | None, *, prevent_cse: bool = True) -> Callable:
    """``jax.checkpoint(fn)`` with the policy (``fn`` itself for ``"none"``).

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> layer = zj.remat.checkpoint(lambda x: jnp.tanh(x) * 2.0, "full")
      >>> float(jax.grad(layer)(0.0))
      2.0
    """
    r = resolve(spec)
    if not r.active:
        return fn
    return jax.checkpoint(fn, policy=r.jax_policy(), prevent_cse=prevent_cse)


def nnx_module(cls: type[nnx.Module], spec: str | Remat | None) -> type[nnx.Module]:
    """A subclass of the NNX module ``cls`` whose ``__call__`` is rematerialized.

    Use it where the layer class is instantiated: ``Block = zj.remat.nnx_module(Block, "full")``.
    Inside ``nnx.scan`` over a stack of such blocks, each iteration (one layer) is one
    remat region.
    """
    r = resolve(spec)
    if not r.active:
        return cls
    call = nnx.remat(cls.__call__, policy=r.jax_policy())
    return type(f"Remat{cls.__name__}", (cls,), {"__call__": call, "__module__": cls.__module__, "zerojax_remat": r})


def linen_module(cls: type[nn.Module], spec: str | Remat | None, **kwargs: Any) -> type[nn.Module]:
    """``nn.remat(cls, policy=...)`` (``cls`` itself for ``"none"``); works under ``nn.scan``."""
    r = resolve(spec)
    if not r.active:
        return cls
    return nn.remat(cls, policy=r.jax_policy(), **kwargs)
