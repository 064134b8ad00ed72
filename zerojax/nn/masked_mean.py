"""Per-element weights for a masked mean over the global batch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zerojax.sharding import in_step


def global_weights(mask: Any) -> jax.Array:
    """Weights that make ``jnp.mean(global_weights(mask) * token_loss)`` the masked mean
    over the **global** batch, ``sum(mask * token_loss) / sum(mask)`` over every row.

    Why: the step's loss is the mean over devices (and micro-batches) of each device's
    loss. ``sum(mask * l) / sum(mask)`` on each device's rows weighs every device alike,
    however many of its tokens are masked, so it is not the global masked mean (nor its
    gradient) unless every device counts the same tokens. These weights are
    ``mask * size / count`` with the count over the global batch.

    Where to call it:

    * inside a zerojax step's loss: the count is summed over the devices of the batch
      (one collective of a scalar). With ``grad_accum_steps > 1`` a micro-batch cannot see
      the others' masks, so it is refused: compute the weights on the global batch in the
      data pipeline instead and pass them as a batch leaf;
    * anywhere else (the data pipeline, on the global batch; a single-device loss): the
      count is the mask's own.

    A mask with no token gives zero weights (a zero loss), not NaN.

    Example:
      >>> import jax.numpy as jnp, zerojax as zj
      >>> mask = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0]])
      >>> zj.nn.global_weights(mask).tolist()
      [[2.6666667461395264, 2.6666667461395264, 0.0, 0.0], [2.6666667461395264, 0.0, 0.0, 0.0]]
    """
    mask = jnp.asarray(mask)
    if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.number)) or mask.ndim == 0:
        raise TypeError(
            f"global_weights takes a mask of 0/1 (or bool) per element, with a leading row axis; got "
            f"{mask.dtype} of shape {mask.shape}."
        )
    m = mask.astype(jnp.float32)
    step = in_step.current()
    size, count = m.size, jnp.sum(m)
    if step is not None:
        plan, k = step
        if k > 1:
            raise ValueError(
                f"zj.nn.global_weights inside the loss with grad_accum_steps={k}: a micro-batch cannot see the "
                "other micro-batches' masks, so the count would not be the global batch's. Compute the weights "
                "on the global batch where the data is made (batch['weights'] = zj.nn.global_weights(mask)) "
                "and use jnp.mean(batch['weights'] * token_loss) in the loss."
            )
        if plan.config.axes.model_axes is None:  # inside the step's shard_map: this device's rows
            axes = plan.batch_axes
            count = jax.lax.psum(count, axes)
            size = size * jax.lax.psum(1, axes)
    return jnp.where(count > 0, m * (size / jnp.maximum(count, 1e-30)), 0.0)
