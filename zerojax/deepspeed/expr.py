"""Calls of optax and zerojax described once, as the code a translation prints and as
the object that code builds."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import optax


@dataclasses.dataclass(frozen=True)
class _Expr:
    """A call of optax or zerojax, as the code the translation prints and as the object
    that code builds: one description for both, so they cannot differ."""

    func: Any  # a dotted name ("optax.adamw", "zj.optim.schedules.warmup_lr") or an _Expr
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    call: bool = True

    def code(self) -> str:
        head = self.func if isinstance(self.func, str) else self.func.code()
        if not self.call:
            return head
        parts = [_code(a) for a in self.args] + [f"{k}={_code(v)}" for k, v in self.kwargs]
        return f"{head}({', '.join(parts)})"

    def build(self) -> Any:
        fn = _lookup(self.func) if isinstance(self.func, str) else self.func.build()
        if not self.call:
            return fn
        return fn(*(_built(a) for a in self.args), **{k: _built(v) for k, v in self.kwargs})


def _call(func: Any, *args: Any, **kwargs: Any) -> _Expr:
    return _Expr(func, args, tuple(kwargs.items()))


def _code(value: Any) -> str:
    return value.code() if isinstance(value, _Expr) else repr(value)


def _built(value: Any) -> Any:
    return value.build() if isinstance(value, _Expr) else value


def _lookup(name: str) -> Any:
    root, *rest = name.split(".")
    found = {"optax": optax, "zj": importlib.import_module("zerojax")}[root]
    for part in rest:
        found = getattr(found, part)
    return found
