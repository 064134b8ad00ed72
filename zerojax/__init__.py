"""zerojax: ZeRO (stages 0-3) for JAX and Flax over a jax.sharding mesh.

The top level holds what a training loop calls: the mesh, the config, the state, the
steps, gathering, checkpoints and weights, the autotuner; everything else lives in the
subpackage that owns it (``zj.config``, ``zj.report``, ``zj.maps``, ``zj.nn``, ``zj.nnx``, ``zj.moe``,
``zj.distributed``, ``zj.resume``, ``zj.models``, ``zj.context``, ``zj.remat``, ``zj.data``,
``zj.monitor``).
"""

from zerojax import (
    checkpoint,
    config,
    context,
    data,
    distributed,
    maps,
    models,
    moe,
    monitor,
    nn,
    nnx,
    remat,
    report,
    resume,
)
from zerojax._surface import module_dir, module_getattr
from zerojax.checkpoint import export_weights, load_weights, restore_checkpoint, save_checkpoint
from zerojax.config import ZeroConfig
from zerojax.deepspeed import from_deepspeed
from zerojax.evaluate import EvalStep, make_eval_step
from zerojax.loop import fit
from zerojax.params import gather_params
from zerojax.sharding.mesh import make_mesh
from zerojax.state import ZeroState, abstract_state, init_state
from zerojax.step import LossScaleError, TrainStep, make_train_step
from zerojax.tensors.weights import Weights
from zerojax.tuning import autotune

__all__ = [
    "EvalStep",
    "LossScaleError",
    "TrainStep",
    "Weights",
    "ZeroConfig",
    "ZeroState",
    "abstract_state",
    "autotune",
    "checkpoint",
    "config",
    "context",
    "data",
    "distributed",
    "export_weights",
    "fit",
    "from_deepspeed",
    "gather_params",
    "init_state",
    "load_weights",
    "make_eval_step",
    "make_mesh",
    "make_train_step",
    "maps",
    "models",
    "moe",
    "monitor",
    "nn",
    "nnx",
    "remat",
    "report",
    "restore_checkpoint",
    "resume",
    "save_checkpoint",
]
__version__ = "0.1.0"
__getattr__ = module_getattr


def __dir__() -> list[str]:
    return module_dir(__all__)
