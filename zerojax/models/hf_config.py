"""A Hugging Face ``config.json`` of the Llama family read into a
:class:`~zerojax.models.llama.LlamaConfig`, against an explicit list of the fields zerojax
understands: nothing that changes the computation is ignored.

Every field of the file is one of:

- read (:data:`READ`): sizes, norms, RoPE and its scaling, sliding windows, biases, q/k
  norms, tied embeddings, with transformers' default (for the family, as of transformers
  5) where the file leaves it out;
- inert (:data:`INERT`): metadata that does not change what the model computes (token ids,
  dtypes, generation settings, ``transformers_version``, ...);
- required to hold its neutral value (``hidden_act: "silu"``, ``attention_dropout: 0``,
  ``use_mrope: false``, ``partial_rotary_factor: 1``): any other value is refused;
- anything else is refused with a ``ValueError`` naming the field and its value, as are
  the RoPE types not implemented (``dynamic``, ``longrope``, ...). A field a user knows to
  be inert for their checkpoint can be named in ``accept=``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from zerojax.models.llama import LlamaConfig
from zerojax.models.rope import RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe")

# transformers 5's defaults (its *Config classes) for fields a file may leave out; None:
# the field's own rule (head_dim: d_model // heads; num_key_value_heads: the query heads).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_key_value_heads=None,
        head_dim=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        num_key_value_heads=8, head_dim=None, rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096
    ),
    "qwen2": dict(
        num_key_value_heads=32,
        head_dim=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
    ),
    "qwen3": dict(
        num_key_value_heads=32,
        head_dim=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
    ),
    "mixtral": dict(
        num_key_value_heads=8,
        head_dim=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        num_experts_per_tok=2,
        num_local_experts=8,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
    ),
    "qwen3_moe": dict(
        num_key_value_heads=4,
        head_dim=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_local_experts=128,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        mlp_only_layers=None,
    ),
    "qwen2_moe": dict(
        num_key_value_heads=16,
        head_dim=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
        decoder_sparse_step=1,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts_per_tok=4,
        num_local_experts=60,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        mlp_only_layers=None,
        qkv_bias=True,
    ),
}
_MOE = {"num_experts_per_tok", "num_local_experts", "num_experts", "output_router_logits", "router_aux_loss_coef"}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COMMON = set(SIZES) | {
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "model_type",
}
# The fields each family reads (beside the neutral ones below).
READ: dict[str, frozenset[str]] = {
    "llama": frozenset(_COMMON | {"attention_bias", "mlp_bias"}),
    "mistral": frozenset(_COMMON | {"sliding_window"}),
    "qwen2": frozenset(_COMMON | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    "qwen3": frozenset(
        _COMMON | {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    ),
    "mixtral": frozenset(_COMMON | _MOE | {"sliding_window", "router_jitter_noise"}),
    "qwen3_moe": frozenset(
        _COMMON
        | _MOE
        | {
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
            "decoder_sparse_step",
            "moe_intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
        }
    ),
    "qwen2_moe": frozenset(
        _COMMON
        | _MOE
        | {
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
            "decoder_sparse_step",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
            "qkv_bias",
        }
    ),
}
# Fields that must hold the value that changes nothing (the value is the default).
NEUTRAL = {"hidden_act": "silu", "attention_dropout": 0.0, "use_mrope": False, "partial_rotary_factor": 1.0}
# Metadata: fields that do not change what the model computes.
INERT = frozenset(
    {
        "architectures",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "initializer_range",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "pruned_heads",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "pretraining_tp",
        "_attn_implementation_autoset",
        "_attn_implementation",
        "attn_implementation",
        # Generation settings older files carry (generation_config.json holds them today).
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)
# RoPE parameters each rope_type reads (beside rope_type / type / rope_theta).
_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_config(source: str | os.PathLike | Mapping) -> tuple[dict, str]:
    """``(fields, where)``: a ``config.json`` (a file, the folder holding it, or its dict)."""
    if isinstance(source, Mapping):
        return dict(source), "the config given"
    path = os.fspath(source)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"no config.json at {path!r}: give a Hugging Face checkpoint folder or its config.json."
        )
    with open(file) as f:
        try:
            fields = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file!r} is not JSON: {e}.") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{file!r} holds a {type(fields).__name__}, not a config (a JSON object).")
    return fields, repr(file)


def config_from_hf(source: str | os.PathLike | Mapping, *, accept: Iterable[str] = (), **overrides) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama, Mistral, Qwen2 / Qwen2.5, Qwen3,
    Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (its path, the checkpoint folder, or the parsed dict).

    Reads transformers 5's ``rope_parameters`` and earlier releases' ``rope_scaling`` /
    ``rope_theta`` alike. ``accept``: fields the file has that zerojax does not know, which
    you know do not change the computation (anything unknown is refused otherwise).
    ``overrides`` (``remat``, ``lora_rank``, ``attention``, ``dtype``, ...) replace the
    config's fields.

    Raises ``ValueError`` naming each field (and value) that changes the computation and is
    not implemented: a RoPE type other than ``linear`` / ``llama3`` / ``yarn``, partial
    rotary, an activation other than SiLU, attention dropout, fields of other families.

    Example:
      >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
      ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
      ...     "num_key_value_heads": 2, "tie_word_embeddings": True, "rope_parameters": {
      ...         "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
      ...         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
      >>> cfg.tie_embeddings, cfg.rope_scaling.kind, cfg.rope_scaling.factor
      (True, 'llama3', 32.0)
      >>> config_from_hf({"model_type": "llama", "hidden_act": "gelu"})
      Traceback (most recent call last):
      ...
      ValueError: the config given: hidden_act = 'gelu' changes the computation and zerojax's Llama does not implement it (it needs 'silu').
    """
    c, where = read_config(source)
    family = c.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"{where} is a {family!r} model; zerojax.models reads the Llama family {FAMILIES} (model_type)."
        )
    accept = frozenset(accept)
    for name, neutral in NEUTRAL.items():
        if name in c and c[name] not in (None, neutral):
            raise ValueError(
                f"{where}: {name} = {c[name]!r} changes the computation and zerojax's Llama does not "
                f"implement it (it needs {neutral!r})."
            )
    known = READ[family] | INERT | set(NEUTRAL)
    unknown = sorted(set(c) - known - accept)
    if unknown:
        raise ValueError(
            f"{where} ({family}) has field(s) zerojax does not know: "
            + ", ".join(f"{k} = {c[k]!r}" for k in unknown)
            + ". zerojax does not guess whether they change the model; if they do not, name them in "
            "from_hf(..., accept=[...])."
        )
    missing = [k for k in SIZES if k not in c]
    if missing:
        raise ValueError(f"{where} lacks {missing}: a checkpoint's config.json gives its sizes.")
    d = dict(_DEFAULTS[family])
    d.update({k: v for k, v in c.items() if k in READ[family]})
    heads = d["num_attention_heads"]
    kw = dict(
        vocab=d["vocab_size"],
        d_model=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=d["num_key_value_heads"] or heads,
        head_dim=d["head_dim"] or d["hidden_size"] // heads,
        d_ff=d["intermediate_size"],
        rms_eps=float(d["rms_norm_eps"]),
        seq_len=int(c.get("max_position_embeddings") or 64),
        tie_embeddings=bool(d["tie_word_embeddings"]),
    )
    kw.update(_rope(c, where))
    kw.update(_windows(family, d, where))
    if family == "qwen2":
        kw.update(qkv_bias=True)
    elif family == "qwen2_moe":
        kw.update(qkv_bias=bool(d["qkv_bias"]))
    elif family in ("llama", "qwen3"):
        kw.update(qkv_bias=bool(d["attention_bias"]), o_bias=bool(d["attention_bias"]))
    if family == "llama":
        kw.update(mlp_bias=bool(d["mlp_bias"]))
    if family in ("qwen3", "qwen3_moe"):
        kw.update(qk_norm=True)
    if family in ("mixtral", "qwen3_moe", "qwen2_moe"):
        kw.update(_experts(family, c, d, where))
    return LlamaConfig(**{**kw, **overrides})


def _experts(family: str, c: dict, d: dict, where: str) -> dict:
    """The routed experts of Mixtral and Qwen3-MoE: every layer's MLP (layers of dense MLP
    among them are refused: the layers are scanned alike)."""
    if "num_experts" in c and "num_local_experts" in c and c["num_experts"] != c["num_local_experts"]:
        raise ValueError(
            f"{where}: num_experts = {c['num_experts']!r} and num_local_experts = "
            f"{c['num_local_experts']!r} disagree (transformers reads them as one field)."
        )
    n = c.get("num_experts", d["num_local_experts"])
    kw = dict(
        n_experts=n,
        top_k=d["num_experts_per_tok"],
        # transformers adds the load-balancing loss only with output_router_logits
        router_aux_loss_coef=float(d["router_aux_loss_coef"]) if d["output_router_logits"] else 0.0,
    )
    if family == "mixtral":
        if d["router_jitter_noise"]:
            raise ValueError(
                f"{where}: router_jitter_noise = {d['router_jitter_noise']!r} (random noise on the "
                f"router's input in training) is not implemented by zerojax's Llama."
            )
        return dict(kw, norm_topk_prob=True)
    if d["decoder_sparse_step"] != 1 or d["mlp_only_layers"]:
        raise ValueError(
            f"{where}: decoder_sparse_step = {d['decoder_sparse_step']!r}, mlp_only_layers = "
            f"{d['mlp_only_layers']!r}: layers of dense MLP among the expert layers are not implemented "
            f"by zerojax's Llama (its layers are scanned alike)."
        )
    kw.update(moe_d_ff=d["moe_intermediate_size"], norm_topk_prob=bool(d["norm_topk_prob"]))
    if family == "qwen2_moe" and d["shared_expert_intermediate_size"]:
        kw.update(shared_d_ff=d["shared_expert_intermediate_size"], shared_gate=True)
    return kw


def _rope(c: dict, where: str) -> dict:
    """``rope_theta`` and ``rope_scaling`` from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` and a top-level ``rope_theta`` (earlier releases)."""
    given = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"{where}: rope_parameters = {given!r} is not a JSON object.")
    p = dict(given)
    if any(isinstance(v, Mapping) for v in p.values()):
        raise ValueError(
            f"{where}: rope_parameters per layer type ({sorted(p)}) are not implemented by zerojax's Llama."
        )
    theta = float(p.pop("rope_theta", c.get("rope_theta", 10000.0)))
    kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    prf = p.pop("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise ValueError(
            f"{where}: partial_rotary_factor = {prf!r} (RoPE on part of each head) is not implemented "
            f"by zerojax's Llama."
        )
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"{where}: rope_type = {kind!r} is not implemented by zerojax's Llama (it implements "
            f"{sorted(_ROPE_KEYS)}); it changes the positions' frequencies, so it is not ignored."
        )
    extra = sorted(set(p) - _ROPE_KEYS[kind])
    if extra:
        raise ValueError(
            f"{where}: rope_parameters of rope_type {kind!r} has field(s) zerojax does not know: "
            + ", ".join(f"{k} = {p[k]!r}" for k in extra)
            + "."
        )
    if kind == "default":
        return dict(rope_theta=theta, rope_scaling=None)
    omp = p.get("original_max_position_embeddings") or c.get("max_position_embeddings")
    factor = p.get("factor")
    if factor is None and kind == "yarn" and omp:  # transformers: the ratio of the two lengths
        factor = c.get("max_position_embeddings", omp) / omp
    if factor is None:
        raise ValueError(f"{where}: rope_type {kind!r} needs a factor.")
    kw: dict[str, Any] = dict(factor=float(factor))
    if kind in ("llama3", "yarn"):
        kw["original_max_position_embeddings"] = int(omp) if omp else None
    if kind == "llama3":
        kw.update(low_freq_factor=p.get("low_freq_factor"), high_freq_factor=p.get("high_freq_factor"))
    if kind == "yarn":
        kw.update(
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            attention_factor=p.get("attention_factor"),
            truncate=bool(p.get("truncate", True)),
        )
    try:
        return dict(rope_theta=theta, rope_scaling=RopeScaling(kind, **kw))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _windows(family: str, d: dict, where: str) -> dict:
    """``sliding_window`` and ``window_layers``: Mistral windows every layer; Qwen2 / Qwen3
    the layers ``layer_types`` names, by default those from ``max_window_layers`` on, when
    ``use_sliding_window``."""
    if family == "llama":
        return {}
    if family in ("qwen3_moe", "qwen2_moe") and d.get("use_sliding_window"):
        raise ValueError(
            f"{where}: use_sliding_window = true in a {family} model is not implemented by zerojax's Llama."
        )
    family = "mistral" if family == "mixtral" else "qwen3" if family in ("qwen3_moe", "qwen2_moe") else family
    window = d.get("sliding_window")
    if family != "mistral" and not d.get("use_sliding_window"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window = {window!r} is not a positive number of keys.")
    if family == "mistral":
        return dict(sliding_window=window or 0)
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        types = [
            "sliding_attention" if window is not None and i >= d["max_window_layers"] else "full_attention"
            for i in range(n)
        ]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{where}: layer_types = {types!r} must list {n} of {LAYER_TYPES}.")
    windowed = tuple(t == "sliding_attention" for t in types)
    if any(windowed) and window is None:
        raise ValueError(
            f"{where}: layer_types has sliding_attention layers but no sliding_window (use_sliding_window "
            f"= {d.get('use_sliding_window')!r}, sliding_window = {d.get('sliding_window')!r})."
        )
    if window is None or not any(windowed):
        return dict(sliding_window=0)
    return dict(sliding_window=window, window_layers=windowed)
