"""The map between :class:`zerojax.models.llama.Llama`'s parameters and Hugging Face's tensors
for the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` share one layout; ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` and
``MixtralForCausalLM`` add their routed experts, Qwen2-MoE its shared one): built from the model's config, so that the
biases, q/k norms and the head it has are the tensors the map names."""

from __future__ import annotations

from zerojax.models.llama import LlamaConfig
from zerojax.tensors.specs import stack, transpose
from zerojax.tensors.weight_map import WeightMap

# Block linear layers: the Flax module name -> the Hugging Face module under model.layers.{i}.
LINEARS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
PEFT_PREFIX = "base_model.model."
# Routed experts (LlamaConfig.n_experts > 0): each family's names for the router and its experts' gate, up
# and down under model.layers.{i}, expert {j}.
EXPERT_NAMES = {
    "qwen3_moe": {
        "router": "mlp.gate",
        "gate": "mlp.experts.{j}.gate_proj",
        "up": "mlp.experts.{j}.up_proj",
        "down": "mlp.experts.{j}.down_proj",
    },
    "mixtral": {
        "router": "block_sparse_moe.gate",
        "gate": "block_sparse_moe.experts.{j}.w1",
        "up": "block_sparse_moe.experts.{j}.w3",
        "down": "block_sparse_moe.experts.{j}.w2",
    },
}
EXPERT_NAMES["qwen2_moe"] = EXPERT_NAMES["qwen3_moe"]


def _biased(cfg: LlamaConfig, flax: str) -> bool:
    if flax in ("q", "k", "v"):
        return cfg.qkv_bias
    if flax == "o":
        return cfg.o_bias
    return cfg.mlp_bias


def llama_map(
    config: LlamaConfig | None = None, *, prefix: str = "model", biases: bool = False, experts: str = "qwen3_moe"
) -> WeightMap:
    """Hugging Face tensors for each parameter of a :class:`~zerojax.models.llama.Llama` with
    ``config``: kernels are the transposes of torch's ``[out, in]`` weights, ``blocks.*``
    stacks ``{prefix}.layers.{i}.*``; the biases and q/k norms the config turns on; the head
    ``lm_head.weight``, or none with ``tie_embeddings``. LoRA adapters (``blocks.X.lora.lora_a`` / ``lora_b``)
    are PEFT's ``lora_A`` / ``lora_B`` weights (``export_weights(..., lora="adapters")``
    writes them; PEFT's ``lora_alpha`` must equal the rank, as ``nnx.LoRA`` has no scaling).
    Without ``config``: the untied Llama, with q/k/v biases if ``biases`` (Qwen2). A mixture of
    experts (``config.n_experts > 0``) reads its router and its experts (stacked over
    ``{j}`` into the expert dimension) in the ``experts`` layout: ``"qwen3_moe"``
    (``mlp.gate``, ``mlp.experts.{j}.gate_proj``, ...) or ``"mixtral"``
    (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{j}.w1`` / ``w3`` / ``w2``).
    :func:`zerojax.models.from_hf` builds the map of a checkpoint from its ``config.json``.

    Example:
      >>> import zerojax as zj
      >>> m = zj.maps.llama_map()
      >>> m.spec_for("blocks.q.kernel")[0] == zj.maps.stack(zj.maps.transpose("model.layers.{i}.self_attn.q_proj.weight"))
      True
    """
    if config is None:
        config = LlamaConfig(qkv_bias=bool(biases))
    elif biases:
        raise ValueError("llama_map(config, biases=True): the config says which biases the model has; drop biases=.")
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"llama_map takes a zj.models.LlamaConfig, got {type(config).__name__}.")
    layer = f"{prefix}.layers.{{i}}"
    entries = {
        "embed.embedding": f"{prefix}.embed_tokens.weight",
        "blocks.attn_norm.scale": stack(f"{layer}.input_layernorm.weight"),
        "blocks.mlp_norm.scale": stack(f"{layer}.post_attention_layernorm.weight"),
        "norm.scale": f"{prefix}.norm.weight",
    }
    if not config.tie_embeddings:
        entries["head.kernel"] = transpose("lm_head.weight")
    if config.qk_norm:
        entries["blocks.q_norm.scale"] = stack(f"{layer}.self_attn.q_norm.weight")
        entries["blocks.k_norm.scale"] = stack(f"{layer}.self_attn.k_norm.weight")
    if experts not in EXPERT_NAMES:
        raise ValueError(f"llama_map(experts={experts!r}): the expert naming schemes are {sorted(EXPERT_NAMES)}.")
    linears = LINEARS
    if config.n_experts:
        names = EXPERT_NAMES[experts]
        linears = {k: v for k, v in LINEARS.items() if k not in ("gate", "up", "down")}
        entries["blocks.moe.router.kernel"] = stack(transpose(f"{layer}.{names['router']}.weight"))
        for flax in ("gate", "up", "down"):
            entries[f"blocks.moe.{flax}"] = stack(stack(transpose(f"{layer}.{names[flax]}.weight"), var="j"))
        if config.shared_d_ff:  # Qwen2-MoE's shared expert and its gate
            for flax in ("gate", "up", "down"):
                entries[f"blocks.moe.shared.{flax}.kernel"] = stack(
                    transpose(f"{layer}.mlp.shared_expert.{flax}_proj.weight")
                )
            if config.shared_gate:
                entries["blocks.moe.shared_gate.kernel"] = stack(transpose(f"{layer}.mlp.shared_expert_gate.weight"))
    for flax, hf in linears.items():
        entries[f"blocks.{flax}.kernel"] = stack(transpose(f"{layer}.{hf}.weight"))
        entries[f"blocks.{flax}.lora.lora_a"] = stack(transpose(f"{PEFT_PREFIX}{layer}.{hf}.lora_A.weight"))
        entries[f"blocks.{flax}.lora.lora_b"] = stack(transpose(f"{PEFT_PREFIX}{layer}.{hf}.lora_B.weight"))
        if _biased(config, flax):
            entries[f"blocks.{flax}.bias"] = stack(f"{layer}.{hf}.bias")
    # Older checkpoints store RoPE's inverse frequencies; they are computed, not loaded.
    return WeightMap(entries, ignore=(f"{prefix}.layers.*.self_attn.rotary_emb.inv_freq",))


# What a family's checkpoints can hold beyond the plain Llama: biases, q/k norms.
FAMILY_TENSORS = {
    "llama": dict(qkv_bias=True, o_bias=True, mlp_bias=True),  # attention_bias, mlp_bias
    "mistral": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qkv_bias=True, o_bias=True, qk_norm=True),  # attention_bias
    "mixtral": dict(n_experts=1, top_k=1),  # the experts' count comes from the shapes
    "qwen3_moe": dict(qkv_bias=True, o_bias=True, qk_norm=True, n_experts=1, top_k=1),
    "qwen2_moe": dict(qkv_bias=True, n_experts=1, top_k=1, shared_d_ff=1, shared_gate=True),
}


def family_map(family: str, *, prefix: str = "model") -> WeightMap:
    """The map of every tensor a ``family`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``)
    checkpoint can hold: the biases and q/k norms its config may turn on, and an untied
    head. A parameter the model does not have reads and writes nothing, so one map serves
    every variant of the family (``zerojax export --map qwen3``); the map of one checkpoint
    comes from its config: :func:`zerojax.models.from_hf`.

    Example:
      >>> import zerojax as zj
      >>> m = zj.maps.family_map("qwen3")
      >>> m.spec_for("blocks.q_norm.scale") is not None, m.spec_for("blocks.gate.bias") is None
      (True, True)
    """
    if family not in FAMILY_TENSORS:
        raise ValueError(f"no map for the family {family!r}; the families are {sorted(FAMILY_TENSORS)}.")
    return llama_map(
        LlamaConfig(**FAMILY_TENSORS[family]), prefix=prefix, experts=family if family in EXPERT_NAMES else "qwen3_moe"
    )
