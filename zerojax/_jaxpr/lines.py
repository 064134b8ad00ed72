"""Where an equation came from, for messages: the user's source lines of a traced equation.

JAX keeps a traceback with every equation; :func:`where` names the user's lines in it
(zerojax's, Flax's and optax's own frames left out), so that an error points at the model
line that did it. The traceback's frames are JAX-internal: where a release moves them,
these helpers answer with JAX's public one-line summary, or nothing, and never fail the
error they decorate.
"""

from __future__ import annotations

from zerojax._jaxpr.form import Equation


def _library_file(path: str) -> bool:
    """Whether ``path`` is zerojax's, Flax's or optax's own code (not the user's). The
    reference models (``zerojax/models``) count as the user's: a message points at the
    model line that did it."""
    import os

    import flax
    import optax

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zerojax/
    roots = [package] + [os.path.dirname(m.__file__) for m in (flax, optax)]
    path = os.path.abspath(path)
    if path.startswith(os.path.join(package, "models") + os.sep):
        return False
    return any(path.startswith(r + os.sep) for r in roots)


def user_line(eqn: Equation, frames: int = 4) -> str | None:
    """The user's source lines of an equation, for messages: the innermost user frame and
    the ones that called it (a helper, then the layer that called the helper), as a
    traceback would show them, up to ``frames``. JAX's own frames are left out by JAX,
    zerojax's, Flax's and optax's here. None where no frame is the user's (an equation
    inside a ``jit`` of a library function is traced without its callers' frames).
    (``user_frames`` is JAX-internal: where it moves, this is None.)"""
    try:
        from jax._src import source_info_util as internal

        chain = [f for f in internal.user_frames(eqn.source_info.traceback) if not _library_file(f.file_name)]
        if chain:
            return ", called from ".join(f"{f.file_name}:{f.start_line} ({f.function_name})" for f in chain[:frames])
    except Exception:  # noqa: BLE001 - a message helper: never fail the error it decorates
        pass
    return None


def where(eqn: Equation, frames: int = 4) -> str:
    """:func:`user_line`, or where there is none, JAX's public one-line summary."""
    line = user_line(eqn, frames)
    if line:
        return line
    from jax.extend import source_info_util

    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001
        return "unknown source line"
