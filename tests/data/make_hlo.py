"""Writes the compiled HLO text that tests/test_hlo.py reads, for the installed JAX version.

    python tests/data/make_hlo.py     # -> tests/data/loops_jax<major.minor>.hlo

The program (4 CPU devices, a 1-D mesh "data"): an outer ``fori_loop`` of 3 iterations
around a ``scan`` over 5 layers; each layer all-gathers its weight shard (d x d/4 floats
per device, d = 32) and applies it; after the loops a reduce-scatter of the activations
(8 x d per device), an all-reduce of their sum, and a ``cond`` whose first branch
all-reduces the 2 x d result.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

OUTER, LAYERS, D, DEVICES = 3, 5, 32, 4


def program():
    """The compiled program, on the first 4 devices."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

    def body(ws, x):  # per device: ws [LAYERS, D, D/4], x [8, D]
        def layer(h, w):
            full = jax.lax.all_gather(w, "data", axis=1, tiled=True)
            return jnp.tanh(h @ full), None

        h = jax.lax.fori_loop(0, OUTER, lambda i, h: jax.lax.scan(layer, h, ws)[0], x)
        part = jax.lax.psum_scatter(h, "data", scatter_dimension=0, tiled=True)  # [2, D]
        total = jax.lax.psum(part.sum(), "data")
        return jax.lax.cond(total > 0, lambda p: p + jax.lax.psum(p, "data"), lambda p: p * 2.0, part)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "data"), P("data")), out_specs=P("data"))
    ws = jax.device_put(jnp.ones((LAYERS, D, D)) / D, NamedSharding(mesh, P(None, None, "data")))
    x = jax.device_put(jnp.ones((8 * DEVICES, D)), NamedSharding(mesh, P("data")))
    return jax.jit(f).lower(ws, x).compile()


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", DEVICES)
    version = ".".join(jax.__version__.split(".")[:2])
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"loops_jax{version}.hlo")
    with open(path, "w") as f:
        f.write(program().as_text())
    print(path, file=sys.stderr)
