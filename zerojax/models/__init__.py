"""Reference models: the Llama family users fine-tune (Llama 3.x, Mistral, Qwen2 / Qwen2.5,
Qwen3, and with routed experts Qwen3-MoE, Qwen2-MoE, Mixtral) and the GPT of the demo and
the experiments, in Flax NNX, and the reading of Hugging Face checkpoints into them."""

from zerojax.models import gpt, hf_config, hf_map, llama, rope
from zerojax.models.hf import from_hf
from zerojax.models.hf_config import config_from_hf
from zerojax.models.llama import Llama, LlamaConfig
from zerojax.models.rope import RopeScaling

__all__ = [
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "config_from_hf",
    "from_hf",
    "gpt",
    "hf_config",
    "hf_map",
    "llama",
    "rope",
]
