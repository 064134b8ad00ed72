"""Mixture-of-experts: routers (:mod:`zerojax.moe.routing`), their auxiliary losses
(:mod:`zerojax.moe.losses`) and the routed experts, on one device or over an expert axis
(:mod:`zerojax.moe.experts`, also ``zj.nn.routed_experts``)."""

from zerojax.moe import experts, losses, routing
from zerojax.moe.experts import METHODS, MoEStats, capacity, expert_size, routed_experts
from zerojax.moe.losses import load_balancing_loss, z_loss
from zerojax.moe.routing import Routing, route

__all__ = [
    "METHODS",
    "MoEStats",
    "Routing",
    "capacity",
    "expert_size",
    "experts",
    "load_balancing_loss",
    "losses",
    "route",
    "routed_experts",
    "routing",
    "z_loss",
]
