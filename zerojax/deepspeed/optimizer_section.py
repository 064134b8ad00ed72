"""A DeepSpeed ``optimizer`` section as its optax equivalent: read and checked as
DeepSpeed reads it, then written as code and built (:func:`optax_code`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zerojax.deepspeed.expr import _call, _Expr
from zerojax.deepspeed.values import _number

# DeepSpeed's own optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS, compared lower-cased).
_DS_OPTIMIZERS = frozenset(
    {
        "adam",
        "adamw",
        "lamb",
        "lion",
        "adagrad",
        "onebitadam",
        "onebitlamb",
        "zerooneadam",
        "muadam",
        "muadamw",
        "musgd",
        "muon",
    }
)
# torch.optim classes DeepSpeed builds by their exact names when the type is none of its own.
_TORCH_OPTIMIZERS = frozenset(
    {"SGD", "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SparseAdam"}
)


@dataclasses.dataclass(frozen=True)
class _Optimizer:
    """A DeepSpeed ``optimizer`` section, read into what its optax equivalent takes."""

    family: str  # "adamw", "adam" (L2 weight decay: adam_w_mode false), "lamb", "lion" or "sgd"
    lr: float
    b1: float
    b2: float
    eps: float
    wd: float
    momentum: float | None = None
    nesterov: bool = False

    @property
    def has_betas(self) -> bool:
        return self.family != "sgd"

    def expr(self, learning_rate: Any = None, b1: Any = None) -> _Expr:
        """The optax optimizer at ``learning_rate`` (a number or a schedule; default: the
        section's ``lr``). ``b1``, a schedule of the first beta (OneCycle's momentum), comes
        with DeepSpeed's second beta of 0.99, through ``optax.inject_hyperparams``."""
        lr = self.lr if learning_rate is None else learning_rate
        if self.family == "sgd":
            sgd = _call("optax.sgd", learning_rate=lr, momentum=self.momentum, nesterov=self.nesterov)
            return _call("optax.chain", _call("optax.add_decayed_weights", self.wd), sgd) if self.wd else sgd
        kw: dict[str, Any] = (
            {"learning_rate": lr, "b1": self.b1, "b2": self.b2}
            if b1 is None
            else {"learning_rate": lr, "b1": b1, "b2": 0.99}
        )
        if self.family != "lion":
            kw["eps"] = self.eps
        if self.family != "adam":
            kw["weight_decay"] = self.wd
        factory = f"optax.{self.family}"
        head = factory if b1 is None else _call("optax.inject_hyperparams", _Expr(factory, call=False))
        opt = _Expr(head, (), tuple(kw.items()))
        if self.family == "adam":  # DeepSpeed's Adam with adam_w_mode false adds the decay to the gradient
            return _call("optax.chain", _call("optax.add_decayed_weights", self.wd), opt)
        return opt


def _parse_optimizer(section: Any) -> tuple[_Optimizer | None, str | None]:
    """The optimizer section read, or None and why it has no optax equivalent here; the
    second item also names what the equivalent leaves out. Raises for names DeepSpeed
    refuses and for bad values."""
    if not isinstance(section, Mapping) or "type" not in section:
        return None, "the optimizer section needs a 'type'"
    name, p = section["type"], dict(section.get("params", {}))
    kind = str(name).lower()
    known = {
        "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad"},
        "lamb": {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff"},
        "lion": {"lr", "betas", "weight_decay"},
        "sgd": {"lr", "momentum", "nesterov", "weight_decay"},
    }
    # DeepSpeed reads its own optimizers' names in any case, and otherwise a torch.optim
    # class by its exact name ("SGD"); it refuses anything else ("sgd", "FusedAdam", "CPUAdam").
    if kind in _DS_OPTIMIZERS:
        family = "adam" if kind in ("adam", "adamw") else kind
    elif name in _TORCH_OPTIMIZERS:
        family = "sgd" if name == "SGD" else name
    else:
        raise ValueError(
            f"DeepSpeed key 'optimizer.type' is {name!r}, which DeepSpeed refuses: it takes its own optimizers "
            f"({', '.join(sorted(_DS_OPTIMIZERS))}, in any case) or a torch.optim class by its exact name (e.g. "
            f"'SGD'). FusedAdam and CPUAdam are what 'Adam' runs as (with or without offload): write 'Adam'."
        )
    if family not in known:
        return None, (
            f"optimizer type {name!r} has no optax equivalent written here: build the optax "
            "transformation yourself (any works)"
        )
    for key, value in p.items():
        if value == "auto":
            raise ValueError(
                f"DeepSpeed key 'optimizer.params.{key}' is 'auto', a placeholder the Hugging Face "
                "Trainer fills in; give its value (translate(..., auto={...}) fills it)."
            )
    betas = p.get("betas", (0.9, 0.999))  # DeepSpeed's default for Adam, Lamb and Lion alike
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"DeepSpeed key 'optimizer.params.betas' must be two numbers, got {betas!r}.")
    lr = _number(p.get("lr", 1e-3), "optimizer.params.lr", minimum=0)
    b1, b2 = (_number(b, "optimizer.params.betas", minimum=0) for b in betas)
    eps = _number(p.get("eps", 1e-8), "optimizer.params.eps", minimum=0)
    wd = _number(p.get("weight_decay", 0.0), "optimizer.params.weight_decay", minimum=0)
    momentum, nesterov, notes = None, False, []
    if family == "adam":
        if p.get("amsgrad"):
            return None, "AMSGrad: build optax.amsgrad yourself (with optax.add_decayed_weights for weight decay)"
        decoupled = kind != "adam" or p.get("adam_w_mode", True)  # DeepSpeed's Adam is AdamW by default
        family = "adamw" if decoupled else "adam"
    elif family == "lamb":
        bounds = (
            _number(p.get("min_coeff", 0.01), "optimizer.params.min_coeff", minimum=0),
            _number(p.get("max_coeff", 10.0), "optimizer.params.max_coeff", minimum=0),
        )
        notes.append(
            f"DeepSpeed's Lamb (FusedLamb) clips each layer's trust ratio to [min_coeff, max_coeff] = "
            f"[{bounds[0]!r}, {bounds[1]!r}]; optax.lamb does not clip it, so layers whose ratio falls "
            f"outside step differently: check it"
        )
    elif family == "sgd":
        momentum = _number(p.get("momentum", 0.0), "optimizer.params.momentum", minimum=0) or None
        nesterov = bool(p.get("nesterov", False))
    left = sorted(set(p) - known["sgd" if family == "sgd" else family.replace("adamw", "adam")])
    if left:
        notes.insert(
            0,
            f"params {left} have no counterpart in the printed optax optimizer (e.g. bias_correction, "
            "torch_adam): check it",
        )
    return _Optimizer(family, lr, b1, b2, eps, wd, momentum, nesterov), "; ".join(notes) or None


def optax_code(section: Any) -> tuple[str | None, str | None]:
    """The optax equivalent of a DeepSpeed ``optimizer`` section, as code, or None and the
    reason. Weight decay is always written out: DeepSpeed's Adam/AdamW default to 0.0,
    ``optax.adamw`` to 1e-4.

    Example:
      >>> from zerojax.deepspeed import optax_code
      >>> optax_code({"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}})
      ('optax.adamw(learning_rate=0.0003, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.1)', None)
    """
    opt, why = _parse_optimizer(section)
    return (None if opt is None else opt.expr().code()), why


def _optimizer_lr(section: Any) -> float | None:
    """The ``lr`` of an optimizer section (DeepSpeed's default 1e-3), or None without one."""
    if not isinstance(section, Mapping) or not isinstance(section.get("params", {}), Mapping):
        return None
    return _number(section.get("params", {}).get("lr", 1e-3), "optimizer.params.lr", minimum=0)
