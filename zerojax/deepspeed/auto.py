"""The Hugging Face Trainer's ``"auto"`` values, filled in as the Trainer fills them:
from values given by key, else from the ``TrainingArguments`` field the Trainer maps to
the key (given, else its default, :data:`HF_DEFAULTS`), each with its source."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from zerojax.deepspeed.reasons import REASONS

# The Hugging Face Trainer writes its TrainingArguments into a DeepSpeed config's "auto"
# values (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_
# process and trainer_config_finalize). translate(..., auto=...) fills them the same way:
# from a value given by its key, else from the TrainingArguments field the Trainer maps to
# it (given, else the field's default).

# TrainingArguments' defaults, for the fields the Trainer writes into "auto" values.
HF_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "warmup_steps": 0,
    "fp16": False,
    "bf16": False,
}
# Names without a default the Trainer knows: world_size (devices), hidden_size (the model
# config's), max_steps (num_training_steps when > 0), warmup_ratio (of num_training_steps).
HF_NAMES = frozenset(HF_DEFAULTS) | {"world_size", "hidden_size", "max_steps", "warmup_ratio"}

# DeepSpeed keys the Trainer fills from one TrainingArguments field (and checks against it
# when the key is not "auto": the Trainer refuses a mismatch).
_HF_FIELD = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}
# Keys the Trainer derives from the model's hidden_size (trainer_config_finalize).
_HIDDEN = {
    "zero_optimization.reduce_bucket_size": ("hidden_size * hidden_size", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "int(0.9 * hidden_size * hidden_size)",
        lambda h: int(0.9 * h * h),
    ),
    "zero_optimization.stage3_param_persistence_threshold": ("10 * hidden_size", lambda h: 10 * h),
}
_TOTAL_STEPS = "scheduler.params.total_num_steps"
_MISSING = object()


class _NoValue(Exception):
    """An "auto" value with no default: ``how`` says where the Trainer gets it."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


def _get(ds: Mapping, path: str, default: Any = _MISSING) -> Any:
    node: Any = ds
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _set(ds: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = ds
    for part in parents:
        node = node[part]
    node[last] = value


def _auto_paths(node: Mapping, prefix: str = "") -> list[str]:
    """Every key whose value is "auto", as a dotted path, in the config's order."""
    found = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += _auto_paths(value, f"{prefix}{key}.")
        elif isinstance(value, str) and value == "auto":
            found.append(f"{prefix}{key}")
    return found


def _unused(path: str) -> bool:
    """True for a key zerojax does not read (it, or a section above it, has a reason)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in REASONS for i in range(1, len(parts) + 1))


class _Trainer:
    """The values the Hugging Face Trainer writes into "auto" keys, from the given
    TrainingArguments fields (``given``), else their defaults."""

    def __init__(self, ds: Mapping, given: Mapping[str, Any], paths: Mapping[str, Any]):
        self.ds, self.given, self.paths = ds, given, paths

    def arg(self, name: str) -> tuple[Any, str]:
        if name in self.given:
            return self.given[name], f"given (TrainingArguments.{name})"
        if name in HF_DEFAULTS:
            return HF_DEFAULTS[name], f"HF Trainer default (TrainingArguments.{name} = {HF_DEFAULTS[name]!r})"
        raise _NoValue(f"the HF Trainer takes it from TrainingArguments.{name}, which has no default")

    def fill(self, path: str) -> tuple[Any, str]:
        if path in _HF_FIELD:
            return self.arg(_HF_FIELD[path])
        if path == "optimizer.params.betas":
            (b1, s1), (b2, s2) = self.arg("adam_beta1"), self.arg("adam_beta2")
            if s1.startswith("given") and s2.startswith("given"):
                return [b1, b2], "given (TrainingArguments.adam_beta1, adam_beta2)"
            if not (s1.startswith("given") or s2.startswith("given")):
                return [b1, b2], f"HF Trainer default (TrainingArguments.adam_beta1 = {b1!r}, adam_beta2 = {b2!r})"
            return [b1, b2], f"adam_beta1: {s1}; adam_beta2: {s2}"
        if path == "scheduler.params.warmup_min_lr":
            return 0, "HF Trainer fills 0 (not a TrainingArguments field)"
        if path in _HIDDEN:
            formula, fn = _HIDDEN[path]
            if "hidden_size" not in self.given:
                raise _NoValue(
                    "the HF Trainer derives it from the model config's hidden_size: give "
                    "auto={'hidden_size': H} or the value"
                )
            return fn(self.given["hidden_size"]), f"HF Trainer: {formula} (hidden_size = {self.given['hidden_size']!r})"
        if path == "train_batch_size":
            return self._train_batch_size()
        if path == _TOTAL_STEPS:
            return self._total_steps()
        if path == "scheduler.params.warmup_num_steps":
            return self._warmup_steps()
        raise _NoValue("the HF Trainer does not fill this key either: give its value")

    def _explicit(self, path: str, name: str) -> tuple[Any, str]:
        """The config's value for ``path``, else the one given for it, else the Trainer's."""
        value = self.paths.get(path, _get(self.ds, path))
        if value is _MISSING or value == "auto":
            return self.arg(name)
        return value, path

    def _train_batch_size(self) -> tuple[Any, str]:
        if "world_size" not in self.given:
            raise _NoValue(
                "the HF Trainer computes world_size x per_device_train_batch_size x "
                "gradient_accumulation_steps: give auto={'world_size': N} or the value"
            )
        micro, _ = self._explicit("train_micro_batch_size_per_gpu", "per_device_train_batch_size")
        accum, _ = self._explicit("gradient_accumulation_steps", "gradient_accumulation_steps")
        world = self.given["world_size"]
        return world * micro * accum, (
            f"HF Trainer: world_size x per_device_train_batch_size x "
            f"gradient_accumulation_steps = {world!r} x {micro!r} x {accum!r}"
        )

    def _total_steps(self) -> tuple[Any, str]:
        if _positive(self.given.get("max_steps")):
            return self.given["max_steps"], "given (TrainingArguments.max_steps)"
        raise _NoValue(
            "the HF Trainer computes it from the dataset size, epochs and batch size "
            "(num_training_steps): give auto={'scheduler.params.total_num_steps': N} or "
            "auto={'max_steps': N}"
        )

    def _warmup_steps(self) -> tuple[Any, str]:
        # TrainingArguments.get_warmup_steps: warmup_steps if > 0, else ceil(warmup_ratio x num_training_steps)
        # (a warmup_steps below 1 is a ratio in recent versions).
        steps = self.given.get("warmup_steps", 0)
        ratio = self.given.get("warmup_ratio", 0)
        if isinstance(steps, float) and 0 < steps < 1:
            ratio, steps = steps, 0
        if steps or not ratio:
            return self.arg("warmup_steps")
        total = self.paths.get(_TOTAL_STEPS, _get(self.ds, _TOTAL_STEPS))
        if total is _MISSING or total == "auto":
            try:
                total, _ = self._total_steps()
            except _NoValue:
                raise _NoValue(
                    f"the HF Trainer computes ceil(warmup_ratio {ratio!r} x num_training_steps): give "
                    "auto={'scheduler.params.total_num_steps': N} or auto={'max_steps': N} too"
                ) from None
        return math.ceil(ratio * total), f"HF Trainer: ceil(warmup_ratio {ratio!r} x total_num_steps {total!r})"


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _resolve_auto(
    ds: dict, auto: Mapping[str, Any] | None, notes: list[str]
) -> tuple[dict, tuple[tuple[str, Any, str], ...]]:
    """``ds`` with its "auto" values filled in, and what was filled (key, value, source).
    Every "auto" key zerojax reads that has no value, every ``auto`` entry that applies to
    nothing and every mismatch the Trainer would refuse are named in one ``ValueError``."""
    if auto is None:
        auto = {}
    if not isinstance(auto, Mapping):
        raise TypeError(
            f"auto takes a dict of values by key, e.g. {{'optimizer.params.lr': 3e-4}}, got {type(auto).__name__}."
        )
    paths = _auto_paths(ds)
    given_paths = {k: v for k, v in auto.items() if k in paths}
    given_args = {k: v for k, v in auto.items() if k not in paths and k in HF_NAMES}
    problems = [_misplaced(ds, key, paths) for key in auto if key not in paths and key not in HF_NAMES]
    problems += _mismatches(ds, given_args)
    trainer = _Trainer(ds, given_args, given_paths)
    out, resolved, missing, unresolved = copy.deepcopy(ds), [], {}, []
    for path in paths:
        try:
            value, source = (given_paths[path], "given") if path in given_paths else trainer.fill(path)
        except _NoValue as e:
            if _unused(path):
                unresolved.append((path, e.how))
            else:
                missing[path] = e.how
            continue
        _set(out, path, value)
        resolved.append((path, value, source))
    if missing or problems:
        raise ValueError(_auto_error(missing, problems))
    for how in dict.fromkeys(how for _, how in unresolved):
        keys = [path for path, h in unresolved if h == how]
        notes.append(
            f'{", ".join(keys)} {"is" if len(keys) == 1 else "are"} "auto" and left so, as zerojax does not '
            f"use {'it' if len(keys) == 1 else 'them'}: {how}"
        )
    return out, tuple(resolved)


def _misplaced(ds: Mapping, key: str, paths: list[str]) -> str:
    value = _get(ds, key)
    if value is not _MISSING:
        return (
            f'{key}: the config sets it to {value!r}, not "auto"; auto fills "auto" values only (edit the '
            "config to change it)"
        )
    return (
        f'{key}: neither an "auto" key of this config ({", ".join(paths) or "it has none"}) nor a '
        f"TrainingArguments field the HF Trainer maps ({', '.join(sorted(HF_NAMES))})"
    )


def _mismatches(ds: Mapping, given: Mapping[str, Any]) -> list[str]:
    """Given TrainingArguments that contradict a value the config sets: the Trainer refuses
    them ("DeepSpeed config values that mismatch TrainingArguments values")."""
    pairs = [(path, name, given[name]) for path, name in _HF_FIELD.items() if name in given]
    if "adam_beta1" in given or "adam_beta2" in given:
        pairs.append(
            (
                "optimizer.params.betas",
                "adam_beta1+adam_beta2",
                [
                    given.get("adam_beta1", HF_DEFAULTS["adam_beta1"]),
                    given.get("adam_beta2", HF_DEFAULTS["adam_beta2"]),
                ],
            )
        )
    if _positive(given.get("max_steps")):  # max_steps <= 0 (the default -1): the Trainer counts the epochs
        pairs.append((_TOTAL_STEPS, "max_steps", given["max_steps"]))
    if _positive(given.get("warmup_steps")) and given["warmup_steps"] >= 1:  # below 1 it is a ratio
        pairs.append(("scheduler.params.warmup_num_steps", "warmup_steps", given["warmup_steps"]))
    found = []
    for path, name, value in pairs:
        current = _get(ds, path)
        if current is not _MISSING and current != "auto" and current != value:
            found.append(
                f"{path}: the config sets {current!r}, the given {name} is {value!r}; the HF Trainer "
                f'refuses the mismatch too (set the key to "auto" or give the same value)'
            )
    return found


def _auto_error(missing: Mapping[str, str], problems: list[str]) -> str:
    parts = []
    if missing:
        parts.append(
            f'DeepSpeed config: {len(missing)} "auto" value(s) have no default; give each one:\n'
            + "\n".join(f"  {k}: {how}" for k, how in missing.items())
        )
        example = ", ".join(f"{k!r}: ..." for k in missing)
        cli = " ".join(f"--set {k}=..." for k in missing)
        parts.append(
            f"In Python: translate(config, auto={{{example}}}); on the command line: "
            f"zerojax from-deepspeed CONFIG {cli}"
        )
    if problems:
        parts.append(f"{len(problems)} given value(s) do not apply:\n" + "\n".join(f"  {p}" for p in problems))
    return "\n".join(parts)
