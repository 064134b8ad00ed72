"""zerojax: ZeRO (stages 0-3) for JAX and Flax over a jax.sharding mesh."""

from zerojax import (
    checkpoint,
    compile_cache,
    context,
    distributed,
    maps,
    models,
    moe,
    nn,
    nnx,
    remat,
    resume,
    xla_flags,
)
from zerojax.checkpoint import export_weights, load_weights, restore_checkpoint, save_checkpoint
from zerojax.checkpoint.tensor_map import WeightMap
from zerojax.checkpoint.weights import Weights
from zerojax.config import ZeroConfig
from zerojax.deepspeed import from_deepspeed
from zerojax.evaluate import EvalStep, make_eval_step
from zerojax.params import gather_params
from zerojax.report.comm import communication_report
from zerojax.report.memory import (
    StepMemory,
    compiled_bytes,
    state_bytes_per_device,
    step_memory,
    zero_formula_bytes,
)
from zerojax.sharding.mesh import make_mesh
from zerojax.state import ZeroState, abstract_state, init_state
from zerojax.step import LossScaleError, TrainStep, make_train_step
from zerojax.tuning import autotune

__all__ = [
    "EvalStep",
    "LossScaleError",
    "StepMemory",
    "TrainStep",
    "ZeroConfig",
    "ZeroState",
    "abstract_state",
    "autotune",
    "distributed",
    "WeightMap",
    "Weights",
    "export_weights",
    "from_deepspeed",
    "load_weights",
    "maps",
    "models",
    "moe",
    "remat",
    "restore_checkpoint",
    "resume",
    "save_checkpoint",
    "checkpoint",
    "communication_report",
    "compile_cache",
    "compiled_bytes",
    "context",
    "gather_params",
    "init_state",
    "make_eval_step",
    "make_mesh",
    "make_train_step",
    "nn",
    "nnx",
    "state_bytes_per_device",
    "step_memory",
    "xla_flags",
    "zero_formula_bytes",
]
__version__ = "0.1.0"
