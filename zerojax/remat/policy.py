"""Rematerialization policies: one typed source of truth compiled to ``jax.checkpoint_policies``.

A policy decides which values computed in forward are kept for backward; everything else
is recomputed. Names:

=================  ===============================================================
``none``           save everything (no rematerialization)
``full``           save nothing: recompute the whole layer in backward
``dots``           save matmul outputs, recompute the rest (``dots_saveable``)
``dots_no_batch``  save matmuls without batch dims (weights-only contractions)
``names``          save only the values tagged with ``checkpoint_name`` in ``names``
``offload_names``  move the named values to host memory (``pinned_host``) instead of
                   keeping them on the device; recompute the rest
``offload_dots``   move matmul outputs without batch dims to host memory
=================  ===============================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax

KINDS = ("none", "full", "dots", "dots_no_batch", "names", "offload_names", "offload_dots")
_NEEDS_NAMES = ("names", "offload_names")


@dataclasses.dataclass(frozen=True)
class Remat:
    """A rematerialization policy.

    Example:
      >>> import zerojax as zj
      >>> zj.remat.Remat("names", names=("attn_out",)).kind
      'names'
      >>> zj.remat.Remat("everything")
      Traceback (most recent call last):
      ...
      ValueError: unknown remat policy 'everything'; valid: none, full, dots, dots_no_batch, names, offload_names, offload_dots
    """

    kind: str = "none"
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown remat policy {self.kind!r}; valid: {', '.join(KINDS)}")
        if isinstance(self.names, str):
            raise TypeError(f"Remat.names must be a sequence of names, got the string {self.names!r}.")
        object.__setattr__(self, "names", tuple(self.names))
        if self.kind in _NEEDS_NAMES and not self.names:
            raise ValueError(
                f"remat policy {self.kind!r} needs the checkpoint_name tags to keep, e.g. "
                f"Remat({self.kind!r}, names=('attn_out', 'mlp_out'))."
            )
        if self.kind not in _NEEDS_NAMES and self.names:
            raise ValueError(f"remat policy {self.kind!r} takes no names (got {self.names}).")

    @property
    def active(self) -> bool:
        """Whether anything is rematerialized (``none`` saves everything)."""
        return self.kind != "none"

    @property
    def offloads(self) -> bool:
        return self.kind.startswith("offload")

    def jax_policy(self) -> Callable | None:
        """The ``jax.checkpoint`` policy (``None`` for ``full``: JAX's save-nothing default)."""
        cp = jax.checkpoint_policies
        return {
            "none": lambda: cp.everything_saveable,
            "full": lambda: cp.nothing_saveable,
            "dots": lambda: cp.dots_saveable,
            "dots_no_batch": lambda: cp.dots_with_no_batch_dims_saveable,
            "names": lambda: cp.save_only_these_names(*self.names),
            "offload_names": lambda: cp.save_and_offload_only_these_names(
                names_which_can_be_saved=(),
                names_which_can_be_offloaded=self.names,
                offload_src="device",
                offload_dst="pinned_host",
            ),
            "offload_dots": lambda: cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host"),
        }[self.kind]()


def resolve(spec: str | Remat | None) -> Remat:
    """A :class:`Remat` from a name, a ``Remat`` or ``None`` (= ``"none"``)."""
    if spec is None:
        return Remat("none")
    if isinstance(spec, Remat):
        return spec
    if isinstance(spec, str):
        return Remat(spec)
    raise TypeError(f"a remat policy is a name ({', '.join(KINDS)}) or a zj.remat.Remat, got {spec!r}.")


def policy(name: str | Remat, names: Sequence[str] = ()) -> Callable:
    """The JAX policy for ``name``, for ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat``.

    Example:
      >>> import jax, jax.numpy as jnp, zerojax as zj
      >>> f = jax.checkpoint(jnp.sin, policy=zj.remat.policy("dots"))
      >>> float(jax.grad(f)(0.0))
      1.0
    """
    r = Remat(name, names=tuple(names)) if isinstance(name, str) else name
    return r.jax_policy()
