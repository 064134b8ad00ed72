"""A DeepSpeed ``scheduler`` section as an optax schedule of
:mod:`zerojax.optim.schedules` (the optimizer's learning rate, and OneCycle's momentum),
refused where DeepSpeed refuses it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zerojax.deepspeed.expr import _call, _Expr
from zerojax.deepspeed.values import _flag, _number
from zerojax.optim import schedules

_REQUIRED = object()
# DeepSpeed's schedulers: their constructors' keywords and defaults (deepspeed/runtime/
# lr_schedules.py), which the config's params are passed to; last_batch_iteration aside.
_SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": _REQUIRED,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": _REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": _REQUIRED,
        "cycle_max_lr": _REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
}
# torch.optim.lr_scheduler classes DeepSpeed builds by their exact names, with the optax
# schedule to write instead. torch's schedulers step once in their constructor, so the
# optimizer step with count k runs at their step k: an optax schedule of the count.
_TORCH_SCHEDULERS = {
    "StepLR": "optax.exponential_decay(lr, transition_steps=step_size, decay_rate=gamma, staircase=True)",
    "MultiStepLR": "optax.piecewise_constant_schedule(lr, {m: gamma for m in milestones})",
    "ExponentialLR": "optax.exponential_decay(lr, transition_steps=1, decay_rate=gamma)",
    "CosineAnnealingLR": "optax.cosine_decay_schedule(lr, decay_steps=T_max, alpha=eta_min / lr)",
    "LinearLR": "optax.linear_schedule(lr * start_factor, lr * end_factor, transition_steps=total_iters)",
    "ConstantLR": "optax.piecewise_constant_schedule(lr * factor, {total_iters: 1 / factor})",
    "PolynomialLR": "optax.polynomial_schedule(lr, 0.0, power, transition_steps=total_iters)",
    "OneCycleLR": "optax.cosine_onecycle_schedule(total_steps, max_lr, pct_start, div_factor, final_div_factor)",
    "CosineAnnealingWarmRestarts": "optax.sgdr_schedule([...]) or optax.join_schedules",
    "CyclicLR": "optax.join_schedules of optax.linear_schedule pieces",
    "LambdaLR": "the lambda times lr, as a function of the step count",
    "MultiplicativeLR": "optax.join_schedules, or a function of the step count",
    "SequentialLR": "optax.join_schedules",
    "ChainedScheduler": "a function of the step count multiplying the schedules",
    "ReduceLROnPlateau": "optax.contrib.reduce_on_plateau (a transformation, not a schedule)",
}


@dataclasses.dataclass(frozen=True)
class _Schedule:
    lr: _Expr | None = None  # the learning-rate schedule
    momentum: _Expr | None = None  # OneCycle's first beta
    why: str | None = None  # why it is not translated (lr is None)


def _scheduler(section: Any, opt_lr: float | None, has_betas: bool | None, notes: list[str]) -> _Schedule:
    """The ``scheduler`` section as an optax schedule of :mod:`zerojax.optim.schedules`,
    or why not. ``opt_lr`` is the optimizer section's ``lr`` (None without one) and
    ``has_betas`` whether its optimizer has betas (None: unknown). Raises for what
    DeepSpeed refuses: an unknown type, params its constructor does not take, required
    params left out."""
    if not isinstance(section, Mapping) or "type" not in section:
        raise ValueError(
            f"DeepSpeed key 'scheduler' needs a 'type' (e.g. {', '.join(_SCHEDULER_PARAMS)}), got {section!r}."
        )
    name, params = section["type"], section.get("params", {})
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed key 'scheduler.params' must be an object, got {params!r}.")
    if name not in _SCHEDULER_PARAMS:
        if name in _TORCH_SCHEDULERS:
            return _Schedule(
                why=f"torch.optim.lr_scheduler.{name} is not translated: write it with optax, "
                f"{_TORCH_SCHEDULERS[name]}, as the optimizer's learning_rate (optimizer step k "
                f"runs at its step k)"
            )
        raise ValueError(
            f"DeepSpeed key 'scheduler.type' is {name!r}, which DeepSpeed refuses: it takes "
            f"{', '.join(_SCHEDULER_PARAMS)} or a torch.optim.lr_scheduler class by its exact name."
        )
    keywords = _SCHEDULER_PARAMS[name]
    unknown = sorted(set(params) - set(keywords) - {"last_batch_iteration"})
    if unknown:
        raise ValueError(
            f"DeepSpeed key 'scheduler.params' has {unknown}, which {name} does not take (DeepSpeed "
            f"passes the params to its constructor, which refuses them); it takes "
            f"{', '.join(keywords)}."
        )
    absent = [k for k, v in keywords.items() if v is _REQUIRED and k not in params]
    if absent:
        raise ValueError(
            f"DeepSpeed scheduler {name} needs {', '.join(f'scheduler.params.{k}' for k in absent)} "
            f"(its constructor has no default for it; DeepSpeed refuses the config too)."
        )
    p = {**{k: v for k, v in keywords.items() if v is not _REQUIRED}, **params}
    function = schedules.DEEPSPEED_SCHEDULERS[name].__name__
    if p.pop("last_batch_iteration", -1) != -1:
        return _Schedule(
            why=f"last_batch_iteration {params['last_batch_iteration']!r} resumes the schedule part-way: "
            f"not translated. The optax schedule follows the optimizer step count, which "
            f"zj.restore_checkpoint restores: write zj.optim.schedules.{function}(...) with the "
            f"other params"
        )
    per_group = sorted(k for k, v in p.items() if isinstance(v, (list, tuple)))
    if per_group:
        return _Schedule(
            why=f"{', '.join(per_group)} give one value per parameter group: not translated; build one "
            f"zj.optim.schedules.{function}(...) per group and combine the optimizers with "
            f"optax.multi_transform"
        )
    if name in ("WarmupLR", "WarmupCosineLR") and opt_lr is None and p.get("warmup_max_lr") is None:
        what = "warms up to" if name == "WarmupLR" else "scales"
        return _Schedule(
            why=f"{name} {what} the optimizer's lr, and the config has no optimizer section: write "
            f"zj.optim.schedules.{function}(...) with your learning rate"
        )
    kw = _schedule_kwargs(name, p, opt_lr, notes)
    lr = _call(f"zj.optim.schedules.{function}", **kw)
    momentum = _one_cycle_momentum(p, kw, has_betas, notes) if name == "OneCycle" else None
    notes.append(
        f"scheduler {name} is zj.optim.schedules.{function}, the learning rate of the printed optimizer "
        f"(Translation.tx): DeepSpeed's rate at every optimizer step, the first steps included"
        + (
            ""
            if has_betas is not None
            else "; with no optax optimizer here, pass Translation.schedule as your optimizer's learning_rate"
        )
    )
    return _Schedule(lr, momentum)


def _schedule_kwargs(name: str, p: dict[str, Any], opt_lr: float | None, notes: list[str]) -> dict[str, Any]:
    """The keywords of the schedule function for scheduler ``name`` with params ``p``
    (DeepSpeed's defaults filled in), checked."""

    def number(key: str, **kw: Any) -> Any:
        return _number(p[key], f"scheduler.params.{key}", **kw)

    if name == "LRRangeTest":
        return {
            "lr_range_test_min_lr": number("lr_range_test_min_lr", minimum=0),
            "lr_range_test_step_size": number("lr_range_test_step_size", integer=True, minimum=1),
            "lr_range_test_step_rate": number("lr_range_test_step_rate"),
            "lr_range_test_staircase": _flag(p["lr_range_test_staircase"], "scheduler.params.lr_range_test_staircase"),
        }
    if name == "OneCycle":
        return {
            "cycle_min_lr": number("cycle_min_lr", minimum=0),
            "cycle_max_lr": number("cycle_max_lr", minimum=0),
            "decay_lr_rate": number("decay_lr_rate"),
            **_cycle_shape(p),
        }
    warm = {
        "warmup_num_steps": _warmup_steps(p["warmup_num_steps"], notes),
        "warmup_type": _warmup_type(p["warmup_type"], notes),
    }
    if name == "WarmupCosineLR":
        return {
            "total_num_steps": number("total_num_steps", minimum=0),
            "learning_rate": opt_lr,
            "warmup_min_ratio": number("warmup_min_ratio"),
            "warmup_num_steps": warm["warmup_num_steps"],
            "cos_min_ratio": number("cos_min_ratio"),
            "warmup_type": warm["warmup_type"],
        }
    if p["warmup_max_lr"] is None:  # WarmupLR: DeepSpeed takes the optimizer's lr
        p = {**p, "warmup_max_lr": opt_lr}
        notes.append(
            f"scheduler.params.warmup_max_lr is absent: DeepSpeed (0.17.2 and later) warms up to the "
            f"optimizer's lr, {opt_lr!r}, and so does the schedule; earlier versions warm up to 0.001."
        )
    bounds = {"warmup_min_lr": number("warmup_min_lr", minimum=0), "warmup_max_lr": number("warmup_max_lr", minimum=0)}
    if name == "WarmupLR":
        return {"warmup_max_lr": bounds["warmup_max_lr"], "warmup_min_lr": bounds["warmup_min_lr"], **warm}
    return {"total_num_steps": number("total_num_steps", minimum=0), **bounds, **warm}


def _warmup_steps(value: Any, notes: list[str]) -> int:
    steps = _number(value, "scheduler.params.warmup_num_steps", integer=True, minimum=0)
    if steps == 0:
        notes.append(
            "scheduler.params.warmup_num_steps is 0 (the HF Trainer's default warmup): DeepSpeed 0.19.3 and "
            "later refuse it; earlier versions warm up over max(2, 0) = 2 steps, and so does the schedule."
        )
    return steps


def _warmup_type(value: Any, notes: list[str]) -> str:
    if value in schedules.WARMUP_TYPES:
        return value
    notes.append(
        f"scheduler.params.warmup_type {value!r} is neither 'log' nor 'linear': DeepSpeed warns and warms "
        "up logarithmically, and so does the schedule."
    )
    return "log"


def _cycle_shape(p: dict[str, Any]) -> dict[str, Any]:
    """OneCycle's cycle keywords, shared by its learning rate and its momentum."""

    def count(key: str) -> Any:
        return None if p[key] is None else _number(p[key], f"scheduler.params.{key}", integer=True, minimum=0)

    return {
        "cycle_first_step_size": _number(
            p["cycle_first_step_size"], "scheduler.params.cycle_first_step_size", minimum=0, strict=True
        ),
        "cycle_second_step_size": None
        if p["cycle_second_step_size"] is None
        else _number(p["cycle_second_step_size"], "scheduler.params.cycle_second_step_size", minimum=0),
        "cycle_first_stair_count": count("cycle_first_stair_count"),
        "cycle_second_stair_count": count("cycle_second_stair_count"),
        "decay_step_size": _number(p["decay_step_size"], "scheduler.params.decay_step_size", minimum=0),
    }


def _one_cycle_momentum(
    p: dict[str, Any], kw: dict[str, Any], has_betas: bool | None, notes: list[str]
) -> _Expr | None:
    """OneCycle's momentum schedule when DeepSpeed applies it: ``cycle_momentum`` on (its
    default) and an optimizer with betas, whose first beta it sets at every step (and the
    second to 0.99)."""
    if not _flag(p["cycle_momentum"], "scheduler.params.cycle_momentum"):
        return None
    mom = _call(
        "zj.optim.schedules.one_cycle_momentum",
        cycle_min_mom=_number(p["cycle_min_mom"], "scheduler.params.cycle_min_mom", minimum=0),
        cycle_max_mom=_number(p["cycle_max_mom"], "scheduler.params.cycle_max_mom", minimum=0),
        decay_mom_rate=_number(p["decay_mom_rate"], "scheduler.params.decay_mom_rate"),
        **{k: v for k, v in kw.items() if k.startswith(("cycle_first", "cycle_second", "decay_step"))},
    )
    if has_betas is False:
        notes.append(
            "OneCycle's cycle_momentum applies to optimizers with betas; DeepSpeed turns it off for SGD, "
            "and so does the translation."
        )
        return None
    if has_betas is None:
        notes.append(
            f"OneCycle's cycle_momentum sets an optimizer's betas to (momentum, 0.99) at every step: with "
            f"an optax optimizer that has betas, pass b1={mom.code()}, b2=0.99 through "
            f"optax.inject_hyperparams."
        )
        return None
    notes.append(
        "OneCycle's cycle_momentum (on by default) sets the optimizer's betas to (momentum, 0.99) at every "
        "step, in place of optimizer.params.betas: the printed optimizer does the same, through "
        "optax.inject_hyperparams."
    )
    return mom
