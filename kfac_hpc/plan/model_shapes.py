"""Layer shapes of a real ``nn.Module``, as the K-FAC preconditioner will see them.

Layers are registered with the library's own rules (:func:`kfac_hpc.kfac.layers.curvature_for`,
:func:`~kfac_hpc.kfac.layers.unsupported_reason`, frozen weights and ``skip_layers`` skipped),
in ``named_modules()`` order, so the planner's placement is the preconditioner's placement.
Optionally one forward pass on a shape-only (``meta``) copy of the model gives the rows per
sample of every layer (output positions of a Conv2d, leading positions of a Linear), which
the compute terms need.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from kfac_hpc.kfac.layers import curvature_for, register_layers
from kfac_hpc.kfac.shapes import rows_per_sample

log = logging.getLogger("kfac_hpc")

__all__ = ["LayerSpec", "ModelSpec", "model_spec"]


@dataclass(frozen=True)
class LayerSpec:
    """One K-FAC layer: factor dimensions, weight columns and rows per sample."""

    name: str
    kind: str  # "Linear" | "Conv2d"
    a_dim: int  # input features per row (+1 with bias)
    g_dim: int  # output features
    weight_cols: int  # a_dim without the bias column
    rows_per_sample: int = 1  # output positions (Conv2d) / leading positions (Linear)

    @property
    def grad_numel(self) -> int:
        """Elements of the gradient matrix ``∇W̄`` (``g_dim · a_dim``)."""
        return self.g_dim * self.a_dim

    def dim(self, factor: str) -> int:
        """Return the dimension of factor ``"A"`` (``a_dim``) or ``"G"`` (``g_dim``)."""
        return self.a_dim if factor == "A" else self.g_dim


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model: its K-FAC layers and its parameters."""

    name: str
    layers: tuple[LayerSpec, ...]
    param_tensors: int  # len(list(model.parameters())): the replica check's message
    param_numel: int  # every parameter, frozen ones included
    weight_bytes: int  # every parameter in its own dtype, frozen ones included
    #: the trainable parameters' gradients in their own dtypes, one flag each: what
    #: gradient averaging sends per step
    gradient_average_bytes: int
    trained_bytes: int  # the trainable parameters (their gradients and momentum as many)
    input_shape: tuple[int, ...] | None = None  # per-sample input shape of the shape probe
    leaf_modules: int = 0  # modules without children (framework overhead per pass)

    @property
    def kfac_param_numel(self) -> int:
        """Elements of every K-FAC layer's gradient matrix together."""
        return sum(layer.grad_numel for layer in self.layers)


def _registered(model: nn.Module, skip: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the layers the preconditioner registers (same rule, same order)."""
    layers, _ = register_layers(model, skip)
    return [(name, curv.module) for name, curv in layers.items()]


def model_spec(model: nn.Module, *, input_shape: Sequence[int] | None = None,
               skip_layers: Sequence[str] = (), name: str | None = None) -> ModelSpec:
    """Describe the K-FAC layers of ``model`` (a DDP wrapper is looked through).

    Args:
        model: The model.
        input_shape: One sample's shape (e.g. ``(3, 224, 224)``), for a shape probe on
            the ``meta`` device; without it, or where the probe fails (a forward that
            reads values, as ``if x.max() > 1:``; a warning says so), every layer has one
            row per sample (enough for communication and memory, which do not depend on
            the batch).
        skip_layers: Names or types of layers left out of K-FAC, as the preconditioner's.
        name: The model's name in reports (default: its class name).

    Returns:
        The layers in registration order, with the parameter counts.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    layers = _registered(model, tuple(skip_layers))
    rows: dict[int, int] = {}
    if input_shape is not None:
        try:
            rows = rows_per_sample(model, [m for _, m in layers], input_shape)
        except Exception as exc:  # the forward reads values: no shapes without data
            log.warning("planner: the shape probe of %s with samples of shape %s failed "
                        "(%s: %s); every layer is planned with one row per sample",
                        type(model).__name__, tuple(input_shape), type(exc).__name__, exc)
    specs = []
    for layer_name, module in layers:
        curv = curvature_for(module)
        assert curv is not None
        specs.append(LayerSpec(layer_name, type(module).__name__, curv.a_dim, curv.g_dim,
                               curv.weight_cols, rows.get(id(module), 1)))
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    return ModelSpec(name or type(model).__name__, tuple(specs), len(params),
                     sum(p.numel() for p in params),
                     weight_bytes=sum(p.numel() * p.element_size() for p in params),
                     gradient_average_bytes=sum((p.numel() + 1) * p.element_size()
                                                for p in trained),
                     trained_bytes=sum(p.numel() * p.element_size() for p in trained),
                     input_shape=(None if input_shape is None
                                  else tuple(int(s) for s in input_shape)),
                     leaf_modules=sum(1 for m in model.modules()
                                      if not any(True for _ in m.children())))
