"""Meshes, leaf layouts, collectives and the per-use gathers the stages build on."""

from zerojax.sharding.leaf_layout import LeafLayout, layout_for
from zerojax.sharding.mesh import make_mesh
from zerojax.sharding.plan import ZeroPlan

__all__ = ["LeafLayout", "ZeroPlan", "layout_for", "make_mesh"]
