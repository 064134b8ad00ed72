"""Tensors by name, in files and in a plan's storage: what a train state is born from.

Safetensors files (:mod:`~zerojax.tensors.safetensors_files`), boxes of tensor metadata
(:mod:`~zerojax.tensors.boxes`), tensor names (:mod:`~zerojax.tensors.names`), the checked
cast (:mod:`~zerojax.tensors.casts`), weight maps (:mod:`~zerojax.tensors.weight_map`, built of
:mod:`~zerojax.tensors.specs` into :mod:`~zerojax.tensors.expressions`, an export's
:mod:`~zerojax.tensors.coverage`),
reading pretrained weights into the storage a plan lays out
(:mod:`~zerojax.tensors.weights`, :mod:`~zerojax.tensors.born`) and the processes' agreement
on a collective read (:mod:`~zerojax.tensors.processes`).

This package sits below :mod:`zerojax.state` (``init_state(..., weights=...)`` reads through
it) and :mod:`zerojax.checkpoint` (checkpoints and exports of states), and imports neither.
"""
