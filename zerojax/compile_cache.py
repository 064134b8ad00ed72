"""zerojax's steps and JAX's persistent compilation cache on the CPU backend.

An executable that XLA:CPU loads back from the persistent compilation cache
(``jax_compilation_cache_dir``) can deadlock when it runs collectives inside loops or
calls: the loaded program's loop bodies are rebuilt with collective state of their own,
so the devices' threads can meet the collectives in different orders and wait on each
other forever. A freshly compiled executable of the same HLO runs fine. It is XLA's
(``experiments/xla_cpu_cache_deadlock.py`` reproduces it in plain JAX; see "Executables
loaded from the compilation cache on the CPU" in docs/design.md), and every ZeRO step
has such collectives: a stage-3 scan all-gathers in its loop body, gradient accumulation
reduce-scatters in its micro-batch loop.

So where the cache is on and a step runs over several CPU devices, zerojax's train and
eval steps are compiled without writing to the cache, under a key no earlier entry has
(the optimisation level in effect, stated as a compiler option: the same program, a
different key). Nothing else changes: other programs still use the cache, and GPU and TPU
executables, which load back whole, keep using it.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import jax

from zerojax._jaxpr import settings

DEFAULT_BACKEND_OPTIMIZATION_LEVEL = 3  # XLA's default for xla_backend_optimization_level
_LEVEL = re.compile(r"--xla_backend_optimization_level=(\d+)")


def applies(mesh) -> bool:
    """Whether steps over ``mesh`` bypass the cache: it is on and they run collectives on
    several CPU devices.

    Example:
      >>> import zerojax as zj
      >>> zj.compile_cache.applies(zj.make_mesh()) == bool(jax.config.jax_compilation_cache_dir)
      True
    """
    devices = list(mesh.devices.flat)
    return bool(jax.config.jax_compilation_cache_dir) and len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def optimization_level() -> int:
    """The ``xla_backend_optimization_level`` in effect (``XLA_FLAGS``' last, else XLA's default)."""
    found = _LEVEL.findall(os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else DEFAULT_BACKEND_OPTIMIZATION_LEVEL


def jit_options(mesh) -> dict[str, Any]:
    """Extra ``jax.jit`` options of a step over ``mesh``: a compiler option that states the
    level already in effect, so the cache key differs from entries written without it."""
    if not applies(mesh):
        return {}
    return {"compiler_options": {"xla_backend_optimization_level": optimization_level()}}


@contextlib.contextmanager
def compiling(mesh):
    """Context for compiling a step over ``mesh``: no cache write where :func:`applies`."""
    if applies(mesh):
        with settings.no_cache_writes():
            yield
    else:
        yield


class GuardedLowered:
    """A ``jax.stages.Lowered`` whose ``compile()`` runs under :func:`compiling`; every
    other attribute is the lowered program's own."""

    def __init__(self, lowered, mesh):
        self._lowered, self._mesh = lowered, mesh

    def compile(self, *args, **kwargs):
        with compiling(self._mesh):
            return self._lowered.compile(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lowered, name)
