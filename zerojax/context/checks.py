"""Before a step compiles: the loss it traced agrees with the step's sequence layout.

On a context mesh the train and eval steps trace the loss once (for its output shapes) and
check the program:

- every ``zj.nn.dot_product_attention`` kernel in it was traced with the step's layout (the
  kernel records it in its ``jax.named_scope``): a kernel traced for another layout (a
  ``layout=`` not passed on, or a jitted function first traced in another step) would read
  the sequence in the wrong order;
- in a layout that moves the sequence, nothing mixes positions along a permuted dimension
  of a batch leaf (:func:`zerojax.context.sequence_order.check_sequence_order`).

Both refuse with a ``ValueError`` naming the line and the fix.
"""

from __future__ import annotations

from typing import Any

import jax

from zerojax._jaxpr import check as program_check
from zerojax._jaxpr import form, lines, walk
from zerojax.context.batch import layout_of, permuted_dims
from zerojax.context.layout import KERNEL_SCOPE
from zerojax.context.sequence_order import check_sequence_order


def kernel_layouts(jaxpr: Any) -> list[tuple[str, Any]]:
    """``(layout kind, equation)`` of each equation an attention kernel traced into
    ``jaxpr`` (the kernel's ``jax.named_scope`` names its layout)."""
    found = []
    for eqn in walk.equations(form.open_jaxpr(jaxpr)[0]):
        name = form.scope(eqn)
        if KERNEL_SCOPE in name:
            found.append((name.split(KERNEL_SCOPE, 1)[1].split("/", 1)[0], eqn))
    return found


def check(plan: Any, closed: Any, args: tuple, batch_at: int) -> None:
    """Refuses a traced loss (``closed``, traced on ``args``, whose ``args[batch_at]`` is the
    batch) that does not agree with the step's layout. Where zerojax reads no program, a
    layout that moves the sequence is refused (its check reads the program) and a
    contiguous one needs none (every kernel is refused a moving layout there:
    :func:`zerojax.context.attention.dot_product_attention`)."""
    layout = layout_of(plan)
    if layout.moves:
        program_check.require(
            f"ZeroConfig(context={{'layout': {layout.kind!r}}})",
            "Use ZeroConfig(context={'layout': 'contiguous'}): the same results, with the causal work less balanced "
            "over the context devices.",
        )
    elif not program_check.reading():
        return
    for kind, eqn in kernel_layouts(closed):
        if kind != layout.kind:
            how = (
                "make_train_step(..., with_layout=True) hands the loss the step's layout: pass it on as "
                "zj.nn.dot_product_attention(..., layout=layout) and zj.nn.global_positions(T, layout)"
            )
            raise ValueError(
                f"zj.nn.dot_product_attention at {lines.where(eqn)} was traced for the {kind!r} layout, but "
                f"this step lays its sequences out {layout.kind!r} (ZeroConfig.context.layout). {how}; a function "
                f"jitted once and used by steps of two layouts must take the layout as a static argument."
            )
    if not layout.moves:
        return
    dims = []
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        dims += permuted_dims(plan, arg) if i == batch_at else [frozenset()] * n
    check_sequence_order(closed, dims, what="the loss")
