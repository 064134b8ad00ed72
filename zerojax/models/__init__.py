"""Reference models users fine-tune: the Llama family (Llama 3.x, Mistral, Qwen2 / Qwen2.5,
Qwen3) in Flax NNX, and the reading of Hugging Face checkpoints into them."""

from zerojax.models import hf_config, hf_map, llama, rope
from zerojax.models.hf import from_hf
from zerojax.models.hf_config import config_from_hf
from zerojax.models.llama import Llama, LlamaConfig
from zerojax.models.rope import RopeScaling

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "config_from_hf", "from_hf", "hf_config", "hf_map", "llama",
           "rope"]
