"""The JAX settings zerojax reads outside programs: whether a value is traced, a mesh's
manual axes, the coordination service's client, and the compilation cache's write
threshold.

These are not part of the program form, so no program-reading fallback covers them. Each
read is strict: where a JAX release moved what it reads, it raises
:class:`zerojax._jaxpr.form.Unsupported` naming it (never a silent default that would
change what zerojax computes), or, for the compilation cache, uses JAX's public option
instead of its per-thread one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax

from zerojax._jaxpr.form import Unsupported


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a value being traced (not a concrete array)."""
    return isinstance(x, jax.core.Tracer)


def manual_axes(mesh: Any) -> frozenset[str]:
    """The axes of ``mesh`` (an abstract mesh, as ``jax.sharding.get_abstract_mesh()``
    returns, or a concrete one) that are manual where it is read: inside a ``shard_map``
    over them; none for ``None``."""
    if mesh is None:
        return frozenset()
    if not hasattr(mesh, "manual_axes"):
        raise Unsupported("a mesh's manual axes", f"{type(mesh).__name__} has no attribute 'manual_axes'")
    return frozenset(mesh.manual_axes or ())


def backends_initialized() -> bool | None:
    """Whether JAX has started its backends (made devices, run or placed an array); None
    where this JAX release does not say (the callers only advise on it)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return None


def distributed_client() -> Any:
    """The coordination service client ``jax.distributed.initialize`` starts (its key-value
    store: ``key_value_set``, ``key_value_dir_get``, ...), or None on one process without
    one. (JAX keeps it in ``jax._src.distributed``, the same on 0.10 and 0.12.)"""
    try:
        from jax._src import distributed
    except ImportError as e:
        raise Unsupported("its coordination service client", f"jax._src.distributed: {e}") from None
    state = getattr(distributed, "global_state", None)
    if state is None or not hasattr(state, "client"):
        raise Unsupported("its coordination service client", "jax._src.distributed.global_state.client")
    return state.client


def _per_thread_threshold() -> Any:
    """JAX's per-thread context for the minimum compile time of a cache write, or None."""
    try:
        from jax._src.config import persistent_cache_min_compile_time_secs as setting
    except ImportError:
        return None
    return setting if callable(setting) else None


@contextlib.contextmanager
def _global_threshold(value: float):
    """The public option, set for the block and restored after (process-wide, not per thread)."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


def no_cache_writes():
    """A context in which compiles on this thread write nothing to JAX's persistent
    compilation cache (its minimum compile time for a write, set to infinity). Where JAX
    no longer has the per-thread setting, the public option is set for the block."""
    setting = _per_thread_threshold()
    return setting(math.inf) if setting is not None else _global_threshold(math.inf)
