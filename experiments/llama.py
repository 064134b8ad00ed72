"""The Llama family model the experiments train: :mod:`zerojax.models.llama` (installed with
zerojax), re-exported so that the scripts here read ``llama.LlamaConfig``, ``llama.init``,
``llama.make_loss``, ... as before."""

from zerojax.models.hf_config import config_from_hf  # noqa: F401
from zerojax.models.llama import Block, Llama, LlamaConfig, RMSNorm, init, init_abstract, is_lora, make_loss, rope  # noqa: F401
