"""Make tiny random Hugging Face checkpoints of the Llama family, one per feature, with reference logits.

Every checkpoint is built by ``transformers``' own classes from a config (no download), with
``attn_implementation="eager"``, float32 weights drawn from normal(0, 0.2) (RMSNorm weights,
Qwen3's q/k norms included, 1 + normal(0, 0.1)), and saved with ``save_pretrained`` in the
*sharded* layout (``model.safetensors.index.json`` + at least two ``model-0000k-of-0000n``
files). All have vocabulary 97, hidden size 32, MLP width 12 and 2 layers. Under ``--out``
(``tests/data/hf``, about 950 KB), one folder per fixture:

- ``llama31``: ``LlamaForCausalLM``, untied, GQA 4/2, RoPE ``llama3`` with Llama 3.1's own values
  (factor 8, low/high frequency factors 1 and 4, original context 8192, theta 500000);
- ``llama32_tied``: the same in Llama 3.2's style: tied embeddings (no ``lm_head.weight`` in the
  files) and ``llama3`` factor 32;
- ``llama_bias``: ``attention_bias`` (q, k, v and o biases) and ``mlp_bias``, and an explicit
  ``head_dim`` 8 where hidden / heads is 16;
- ``llama_linear``: RoPE ``linear`` with factor 4;
- ``mistral_window``: ``MistralForCausalLM`` with one KV head and ``sliding_window`` 5 (every
  layer windowed);
- ``qwen2_window``: ``Qwen2ForCausalLM`` (q/k/v biases, tied) with ``use_sliding_window``,
  ``sliding_window`` 6 and ``max_window_layers`` 1, so layer 0 attends fully and layer 1 through
  the window, and RoPE ``yarn`` (factor 4, original context 4096, theta 1e6: a fractional ramp);
- ``qwen3``: ``Qwen3ForCausalLM`` (dense) with q/k RMSNorm, tied embeddings and an explicit
  ``head_dim`` 12 where hidden / heads is 8.

Each folder has ``reference.npz``: ``tokens`` int32 [2, 16]; ``mask`` int32 [2, 16] (row 0 all
ones, row 1 three right-padded positions, fewer than any window so every query sees a real
key); ``logits`` float32 [2, 16, vocab] of ``model(tokens)`` and ``logits_mask`` of
``model(tokens, attention_mask=mask)``, in float32; ``logits64`` and ``logits64_mask``, float64,
the same forwards with the model in float64. Positions are ``arange(16)`` (transformers' own
default without ``position_ids``) and ``use_cache=False``.

About ``logits64``: ``model.double()`` alone is not a float64 forward in transformers 5: RMSNorm
casts to float32 (``LlamaRMSNorm.forward``: ``hidden_states.to(torch.float32)``), the eager
softmax runs in float32 (``eager_attention_forward``: ``softmax(..., dtype=torch.float32)``), and
the rotary frequencies and angles are float32 (``ROPE_INIT_FUNCTIONS`` and
``LlamaRotaryEmbedding.forward`` use ``torch.float``). So the float64 forward runs transformers'
code unchanged with ``torch.float`` and ``torch.float32`` aliased to ``torch.float64`` (the rotary
module is rebuilt under the alias, so its ``inv_freq`` is transformers' formula in float64), and a
dispatch mode checks that no op then produces a float32 tensor other than integer-valued
positions. The plain ``model.double()`` logits are printed for comparison, not stored.

Checks made while writing (the run fails if one does not hold): each feature changes the logits
by at least 1e-3 against the same weights without it (``llama3``/``linear``/``yarn`` scaling
against default RoPE with the same theta, the windows against ``sliding_window=None``); float32
and float64 logits agree within 1e-4; the checkpoint is sharded; a tied checkpoint has no
``lm_head.weight``; reloading each folder with ``AutoModelForCausalLM.from_pretrained`` reports
no missing or unexpected key and gives the same logits.

It needs ``torch`` and ``transformers``, which are not dependencies of the project; run it in a
private virtual environment::

    python3 -m venv $HFVENV && $HFVENV/bin/pip install torch==2.13.0 transformers safetensors numpy
    $HFVENV/bin/python experiments/make_hf_fixtures.py --out tests/data/hf

Made with torch 2.13.0 and transformers 5.25.0; the same seed gives the same files.

Check an export (tests cannot run torch): load ``EXPORT_DIR`` with ``from_pretrained`` (its own
``config.json``, else the one under ``--config``), report missing/unexpected/mismatched keys and
the largest logit difference against the reference (or against logits in the npz given by
``--logits``: keys ``logits``/``logits_mask``, and ``logits64``/``logits64_mask`` with
``--float64``); the exit status is non-zero on any key problem or difference over ``--tol``::

    $HFVENV/bin/python experiments/make_hf_fixtures.py --check-export EXPORT_DIR \\
        --reference tests/data/hf/llama31/reference.npz [--config tests/data/hf/llama31] [--logits OURS.npz]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

transformers.utils.logging.disable_progress_bar()
F32, F64 = torch.float32, torch.float64  # the real dtypes, kept before any aliasing
T, PAD = 16, 3  # sequence length; right-padded positions of row 1
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=12, num_hidden_layers=2)


def _llama3(factor):
    return dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


# name: (config class, model class, config kwargs, {control name: kwargs replaced in the control config})
FIXTURES = {
    "llama31": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters=_llama3(8.0),
            tie_word_embeddings=False,
        ),
        {"default RoPE": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0))},
    ),
    "llama32_tied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters=_llama3(32.0),
            tie_word_embeddings=True,
        ),
        {"default RoPE": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0))},
    ),
    "llama_bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
        ),
        {},
    ),
    "llama_linear": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
            tie_word_embeddings=False,
        ),
        {"default RoPE": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))},
    ),
    "mistral_window": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            sliding_window=5,
            tie_word_embeddings=False,
        ),
        {"no window": dict(sliding_window=None)},
    ),
    "qwen2_window": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16384,
            rms_norm_eps=1e-6,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=4096
            ),
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        {
            "no window": dict(use_sliding_window=False),
            "default RoPE": dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        },
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=True,
        ),
        {},
    ),
    # Mixtures of experts, smaller (vocab 48, width 16) to keep the fixtures under their budget.
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            vocab_size=48,
            hidden_size=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            norm_topk_prob=True,
        ),
        {"top-1": dict(num_experts_per_tok=1)},
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            vocab_size=48,
            hidden_size=16,
            intermediate_size=8,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        {"top-1": dict(num_experts_per_tok=1)},
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            vocab_size=32,
            hidden_size=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            norm_topk_prob=False,
        ),
        {"top-1": dict(num_experts_per_tok=1)},
    ),
}


# The smaller fixtures need smaller shards to be sharded (the default is --max-shard-size).
SHARD_SIZE = {"qwen3_moe": "10KB", "mixtral": "10KB", "qwen2_moe": "10KB"}


def make_config(name: str, **replace):
    config_cls, _, kwargs, _ = FIXTURES[name]
    kwargs = copy.deepcopy({**BASE, **kwargs, **replace})
    moe = {"experts_implementation": "eager"} if name in SHARD_SIZE else {}  # the per-expert loop (float64 too)
    return config_cls(**kwargs, attn_implementation="eager", **moe)


def build(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FIXTURES[name][1](make_config(name)).to(F32).eval()
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):  # tied weights are listed once
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def batch(vocab: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(2, T)).astype(np.int32)
    mask = np.ones((2, T), np.int32)
    mask[1, T - PAD :] = 0  # right padding
    return tokens, mask


@contextlib.contextmanager
def _float_is_float64():
    """transformers' hard-coded float32 casts (``torch.float``/``torch.float32``, ``Tensor.float()``)
    become float64."""
    saved = torch.float, torch.float32, torch.Tensor.float
    torch.float = torch.float32 = F64
    torch.Tensor.float = lambda self, *a, **k: self.to(F64)  # Mixtral's router: router_logits.float()
    try:
        yield
    finally:
        torch.float, torch.float32, torch.Tensor.float = saved


class _Float32Watch(TorchDispatchMode):
    """Records every op output that is float32 and not integer-valued (positions cast by ``.float()`` are exact)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == F32 and not torch.equal(t, torch.round(t)):
                self.seen[str(func)] += 1
        return out


def float64_model(model: torch.nn.Module) -> torch.nn.Module:
    m64 = copy.deepcopy(model).to(F64)
    rotary = m64.model.rotary_emb
    with _float_is_float64():
        m64.model.rotary_emb = type(rotary)(m64.config)
    assert m64.model.rotary_emb.inv_freq.dtype == F64
    return m64


def forward(model, tokens, mask=None, float64=False) -> np.ndarray:
    ids = torch.from_numpy(np.asarray(tokens)).long()
    kw = {} if mask is None else dict(attention_mask=torch.from_numpy(np.asarray(mask)).long())
    with torch.no_grad():
        if not float64:
            return model(ids, use_cache=False, **kw).logits.numpy()
        watch = _Float32Watch()
        with _float_is_float64(), watch:
            logits = model(ids, use_cache=False, **kw).logits
        if watch.seen:
            raise SystemExit(f"float32 ops in the float64 forward: {dict(watch.seen)}")
        assert logits.dtype == F64
        return logits.numpy()


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _inv_freq(model) -> tuple[np.ndarray, float]:
    """The rotary module's inverse frequencies (in float64) and the factor on cos/sin."""
    with _float_is_float64():
        r = type(model.model.rotary_emb)(model.config)
    return r.inv_freq.numpy(), r.attention_scaling


def make(name: str, out: pathlib.Path, seed: int, max_shard_size: str) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = build(name, seed)
    config = model.config
    model.save_pretrained(out, safe_serialization=True, max_shard_size=SHARD_SIZE.get(name, max_shard_size))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    if len(shards) < 2:
        raise SystemExit(f"{name}: expected a sharded checkpoint, got {shards}: lower --max-shard-size")
    names = set(index["weight_map"])
    if config.tie_word_embeddings == ("lm_head.weight" in names):
        raise SystemExit(
            f"{name}: tie_word_embeddings={config.tie_word_embeddings} but lm_head.weight "
            f"{'is' if 'lm_head.weight' in names else 'is not'} in the files"
        )

    tokens, mask = batch(config.vocab_size)
    logits, logits_mask = forward(model, tokens), forward(model, tokens, mask)
    m64 = float64_model(model)
    logits64, logits64_mask = forward(m64, tokens, float64=True), forward(m64, tokens, mask, float64=True)
    plain64 = copy.deepcopy(model).to(F64)
    with torch.no_grad():
        hf_double = plain64(torch.from_numpy(tokens).long(), use_cache=False).logits.numpy()
    err32 = max(_max_diff(logits, logits64), _max_diff(logits_mask, logits64_mask))
    if err32 > 1e-4:
        raise SystemExit(f"{name}: float32 and float64 logits differ by {err32:.2e}")
    # Same call as the model's own default (a DynamicCache when use_cache is on): the same logits.
    with torch.no_grad():
        cached = model(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long()).logits.numpy()
    assert _max_diff(cached, logits_mask) == 0.0, name

    report = dict(
        name=name,
        shards=len(shards),
        tensors=len(names),
        float32_vs_64=err32,
        hf_double_vs_64=_max_diff(hf_double, logits64),
        controls={},
    )
    state = model.state_dict()
    for control, replace in FIXTURES[name][3].items():
        other = FIXTURES[name][1](make_config(name, **replace)).to(F32).eval()
        other.load_state_dict(state, strict=True)
        diff = max(_max_diff(forward(other, tokens), logits), _max_diff(forward(other, tokens, mask), logits_mask))
        if diff < 1e-3:
            raise SystemExit(f"{name}: logits against {control} differ by {diff:.2e} only (< 1e-3)")
        report["controls"][control] = diff
        if "RoPE" in control:
            report["inv_freq"], report["attention_scaling"] = _inv_freq(model)
            report["inv_freq_default"] = _inv_freq(other)[0]

    np.savez(
        out / "reference.npz",
        tokens=tokens,
        mask=mask,
        logits=logits.astype(np.float32),
        logits_mask=logits_mask.astype(np.float32),
        logits64=logits64.astype(np.float64),
        logits64_mask=logits64_mask.astype(np.float64),
    )

    # Read back as a user would: no missing or unexpected key, the same logits.
    moe = {"experts_implementation": "eager"} if name in SHARD_SIZE else {}
    loaded, info = AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=F32, output_loading_info=True, **moe
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{name}: reloading reports {bad}")
    if _max_diff(forward(loaded.eval(), tokens, mask), logits_mask) != 0.0:
        raise SystemExit(f"{name}: reloaded logits differ")
    return report


def make_all(args) -> None:
    root = pathlib.Path(args.out)
    names = args.only or list(FIXTURES)
    for name in names:
        r = make(name, root / name, args.seed, args.max_shard_size)
        size = sum(f.stat().st_size for f in (root / name).iterdir())
        controls = ", ".join(f"vs {k} {v:.2e}" for k, v in r["controls"].items())
        print(
            f"{name}: {r['shards']} shards, {r['tensors']} tensors, {size} bytes; float32 vs float64 "
            f"{r['float32_vs_64']:.1e}, plain model.double() vs float64 {r['hf_double_vs_64']:.1e}; {controls}"
        )
        if "inv_freq" in r:
            print(
                f"    inv_freq {np.array2string(r['inv_freq'], precision=6)} (default "
                f"{np.array2string(r['inv_freq_default'], precision=6)}), attention_scaling "
                f"{r['attention_scaling']!r}"
            )
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: {total} bytes in {root}")
    if total > 1_250_000:  # 1 MB for the seven dense fixtures, and room for the three mixtures of experts
        raise SystemExit(f"{root} is {total} bytes, over 1.25 MB")


def _tensor_names(folder: pathlib.Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "np") as st:
            names |= set(st.keys())
    return names


def check_export(args) -> int:
    export = pathlib.Path(args.check_export)
    ref = np.load(args.reference)
    with tempfile.TemporaryDirectory() as staged:
        if not (export / "config.json").exists():
            if not args.config:
                print(f"{export} has no config.json: give --config")
                return 2
            # from_pretrained wants config.json beside the weights (without one it also fails to make a
            # generation config), so the export's files are linked into a folder with --config's config.json.
            for f in export.iterdir():
                (pathlib.Path(staged) / f.name).symlink_to(f.resolve())
            shutil.copy(pathlib.Path(args.config) / "config.json", staged)
            print(f"config.json from {args.config}")
            export = pathlib.Path(staged)
        try:
            config = AutoConfig.from_pretrained(export, attn_implementation="eager")
            model, info = AutoModelForCausalLM.from_pretrained(
                export, config=config, dtype=F32, output_loading_info=True
            )
        except Exception as e:  # a shape mismatch or an unreadable file
            print(f"FAIL: from_pretrained raised {type(e).__name__}: {e}")
            return 1
    model.eval()
    failed = False
    for key, value in info.items():
        if value:
            print(f"FAIL: {key}: {sorted(value) if isinstance(value, (set, list)) else value}")
            failed = True
    if not failed:
        print("keys: none missing, unexpected or mismatched")
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in _tensor_names(export):
        # transformers' save_pretrained leaves lm_head.weight out of a tied checkpoint; from_pretrained ties
        # one that holds it only when it equals the embedding, and otherwise loads the two untied.
        if model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():
            print(
                "note: the config ties the embeddings and the files hold lm_head.weight; transformers loaded it "
                "tied to model.embed_tokens.weight (one tensor)"
            )
        else:
            print(
                "FAIL: the config ties the embeddings but the files hold a different lm_head.weight "
                "(transformers loads them untied)"
            )
            failed = True
    want = np.load(args.logits) if args.logits else ref
    tokens = want["tokens"] if "tokens" in want else ref["tokens"]
    mask = want["mask"] if "mask" in want else ref["mask"]
    runs = [("logits", None, False), ("logits_mask", mask, False)]
    if args.float64:
        runs += [("logits64", None, True), ("logits64_mask", mask, True)]
    m64 = float64_model(model) if args.float64 else None
    compared = 0
    for key, m, f64 in runs:
        if key not in want:
            continue
        got = forward(m64 if f64 else model, tokens, m, float64=f64)
        err = _max_diff(got, want[key])
        tol = args.tol64 if f64 else args.tol
        ok = err <= tol
        failed |= not ok
        compared += 1
        print(f"{'ok' if ok else 'FAIL'}: {key}: max abs difference {err:.3e} (tolerance {tol:.0e})")
    if not args.float64 and any(k in want for k in ("logits64", "logits64_mask")):
        print("note: logits64 and logits64_mask not compared (give --float64)")
    if not compared:
        print(f"FAIL: no logits to compare in {args.logits or args.reference}")
        failed = True
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/hf")
    parser.add_argument("--only", nargs="*", choices=list(FIXTURES), help="make only these fixtures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="30KB")
    parser.add_argument("--check-export", metavar="EXPORT_DIR", help="check an exported checkpoint instead")
    parser.add_argument("--reference", help="reference.npz of the fixture the export came from")
    parser.add_argument("--config", help="folder with the config.json to use when the export has none")
    parser.add_argument("--logits", help="npz with the logits to expect instead of the reference's")
    parser.add_argument("--float64", action="store_true", help="also compare float64 forwards (logits64*)")
    parser.add_argument("--tol", type=float, default=1e-4, help="float32 tolerance (default 1e-4)")
    parser.add_argument("--tol64", type=float, default=1e-9, help="float64 tolerance (default 1e-9)")
    args = parser.parse_args()
    if args.check_export:
        if not args.reference:
            parser.error("--check-export needs --reference")
        sys.exit(check_export(args))
    make_all(args)


if __name__ == "__main__":
    main()
