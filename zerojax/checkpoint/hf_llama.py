"""The map between a Llama in Flax NNX (``experiments/llama.py``'s parameter names) and
Hugging Face's ``LlamaForCausalLM`` layout, which Mistral and Qwen2 share (Qwen2 adds q/k/v
biases: ``biases=True``)."""

from __future__ import annotations

from zerojax.checkpoint.tensor_map import WeightMap, stack, transpose

# Block linear layers: the Flax module name -> the Hugging Face module under model.layers.{i}.
LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model."


def llama_map(*, prefix: str = "model", biases: bool = False) -> WeightMap:
    """Hugging Face Llama tensors for each parameter: kernels are the transposes of torch's
    ``[out, in]`` weights, ``blocks.*`` stacks ``{prefix}.layers.{i}.*``; LoRA adapters
    (``blocks.X.lora.lora_a`` / ``lora_b``) are PEFT's ``lora_A`` / ``lora_B`` weights
    (``export_weights(..., lora="adapters")`` writes them; PEFT's ``lora_alpha`` must equal
    the rank, as ``nnx.LoRA`` has no scaling).

    Example:
      >>> import zerojax as zj
      >>> m = zj.maps.llama_map()
      >>> m.spec_for("blocks.q.kernel")[0] == zj.maps.stack(zj.maps.transpose("model.layers.{i}.self_attn.q_proj.weight"))
      True
    """
    layer = f"{prefix}.layers.{{i}}"
    entries = {
        "embed.embedding": f"{prefix}.embed_tokens.weight",
        "blocks.attn_norm.scale": stack(f"{layer}.input_layernorm.weight"),
        "blocks.mlp_norm.scale": stack(f"{layer}.post_attention_layernorm.weight"),
        "norm.scale": f"{prefix}.norm.weight",
        "head.kernel": transpose("lm_head.weight"),
    }
    for flax, hf in LINEARS.items():
        entries[f"blocks.{flax}.kernel"] = stack(transpose(f"{layer}.{hf}.weight"))
        entries[f"blocks.{flax}.lora.lora_a"] = stack(transpose(f"{PEFT_PREFIX}{layer}.{hf}.lora_A.weight"))
        entries[f"blocks.{flax}.lora.lora_b"] = stack(transpose(f"{PEFT_PREFIX}{layer}.{hf}.lora_B.weight"))
        if biases and flax in ("q", "k", "v"):
            entries[f"blocks.{flax}.bias"] = stack(f"{layer}.{hf}.bias")
    # Older checkpoints store RoPE's inverse frequencies; they are computed, not loaded.
    return WeightMap(entries, ignore=(f"{prefix}.layers.*.self_attn.rotary_emb.inv_freq",))
