"""Per-layer K-FAC curvature: rows of ā and δ, the factors A and G, and ∇W̄ ⇄ ``.grad``.

One code path serves A and G: a layer turns its captured tensor into rows
(``a_rows`` / ``g_rows``) and both factors are ``covariance(rows)`` (mean over rows of
the outer products). Subclasses only say how rows are formed.

Scaling conventions (DESIGN.md, "kfac — the math contract"), with ``b`` the local batch
size (``grad_output.shape[0]``: batch-first layout assumed) and ``L`` the local
**mean** loss, so that ``δ = b·∂L/∂y`` is the per-example loss gradient:

* Linear, input ``(b, in)``: one row per example, ``A = (1/b) Σ ā āᵀ``,
  ``G = (1/b) Σ δ δᵀ``.
* Linear, input ``(b, T₁, …, in)`` (sequences, K-FAC "expand"): the ``T = T₁·…``
  positions of every example are rows, ``ā`` and ``δ = b·∂L/∂y_{i,t}`` per position,
  and **both** factors are means over all ``b·T`` rows:
  ``A = (1/(bT)) Σ_{i,t} ā āᵀ``, ``G = (1/(bT)) Σ_{i,t} δ δᵀ``. This is exactly the
  Conv2d convention (positions ≙ patch locations). Since the expand approximation of
  the per-example Fisher is ``(1/b) Σ_{i,t} ā āᵀ ⊗ δ δᵀ ≈ T·(A ⊗ G)``, our ``A ⊗ G``
  is that Fisher divided by ``T``:
  ``(A⊗G + damping·I)⁻¹ = T·(F_expand + T·damping·I)⁻¹``, i.e. the same
  preconditioner up to the constant ``T`` and a damping measured in per-position units.
  The per-position loss normalisation inside ``l_i`` (sum or mean over ``T``) changes
  ``G`` by the constant ``T²`` in the same way.
* Conv2d (groups=1): rows are the ``b·T`` output positions, ``ā`` the unfolded input
  patch (``in_channels·kh·kw``, channel-major like ``weight.reshape(out, -1)``), ``δ``
  the output gradient at that position times ``b``; ``A``, ``G`` are means over the
  ``b·T`` rows.

With these conventions ``∇W̄ = (1/b) Σ_rows δ āᵀ`` for every supported layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.kfac.linalg import column_covariance, covariance

__all__ = [
    "Conv2dCurvature",
    "LayerCurvature",
    "LinearCurvature",
    "curvature_for",
    "register_layers",
    "unsupported_reason",
]


_WIDE = (torch.float32, torch.float64)  # dtypes of the per-sample (batched) factor path


def _cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` detached, in ``dtype`` if given (e.g. float32 statistics of fp16/bf16 AMP tensors)."""
    t = t.detach()
    return t if dtype is None else t.to(dtype)


class LayerCurvature(ABC):
    """Curvature handler of one K-FAC layer (abstract).

    Attributes: ``module``, ``has_bias``; ``a_dim`` = input features per row (+1 with
    bias), ``g_dim`` = output features. ``∇W̄`` has shape ``(g_dim, a_dim)``.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.has_bias: bool = getattr(module, "bias", None) is not None

    # ----- what a subclass provides ---------------------------------------------------
    @property
    @abstractmethod
    def weight_cols(self) -> int:
        """Columns of the weight part of ``∇W̄`` (``a_dim`` without the bias column)."""

    @property
    @abstractmethod
    def g_dim(self) -> int:
        """Output features (rows of ``∇W̄``)."""

    @abstractmethod
    def _input_rows(self, inputs: Tensor) -> Tensor:
        """``(rows, weight_cols)`` input rows, without the bias column."""

    @abstractmethod
    def _output_rows(self, grad_output: Tensor) -> tuple[Tensor, int]:
        """``(rows, g_dim)`` rows of ``∂L/∂y`` (unscaled) and the batch size ``b``."""

    # ----- shared path --------------------------------------------------------------------
    @property
    def a_dim(self) -> int:
        """Columns of ``∇W̄``: input features (+1 with bias)."""
        return self.weight_cols + int(self.has_bias)

    def a_rows(self, inputs: Tensor) -> Tensor:
        """Rows of ``ā`` (``(rows, a_dim)``), with a column of ones appended when biased."""
        return self._with_bias_column(self._input_rows(inputs.detach()))

    def _with_bias_column(self, rows: Tensor) -> Tensor:
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return rows

    def g_rows(self, grad_output: Tensor, grad_scale: float | Tensor = 1.0) -> Tensor:
        """Rows of ``δ = b·∂L/∂y / grad_scale`` (``(rows, g_dim)``).

        ``grad_scale`` is whatever factor the loss was multiplied by before backward (an
        AMP loss scale, or ``1/accumulation_steps``); dividing by it restores ``δ``. A
        0-dim tensor (the GradScaler's scale, on the device) is used without a host sync.
        """
        rows, b = self._output_rows(grad_output.detach())
        return rows * (b / grad_scale)

    def a_factor(self, inputs: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``A`` = mean over rows of ``ā āᵀ``, computed in ``dtype`` (default: inputs' dtype)."""
        return covariance(self.a_rows(_cast(inputs, dtype)))

    def g_factor(
        self, grad_output: Tensor, dtype: torch.dtype | None = None,
        grad_scale: float | Tensor = 1.0,
    ) -> Tensor:
        """``G`` = mean over rows of ``δ δᵀ`` with the loss scale removed, in ``dtype``."""
        return covariance(self.g_rows(_cast(grad_output, dtype), grad_scale))

    def grad_matrix(self, dtype: torch.dtype | None = None) -> Tensor:
        """``∇W̄ = [∇W reshaped to (g_dim, weight_cols), ∇b]`` from the ``.grad`` fields.

        A missing ``.grad`` reads as zeros. Dtype: ``dtype`` if given, else the weight's.
        """
        weight: Tensor = self.module.weight  # type: ignore[assignment]
        out_dtype = weight.dtype if dtype is None else dtype
        parts: list[Tensor] = []
        wg = weight.grad
        parts.append(
            weight.new_zeros(self.g_dim, self.weight_cols, dtype=out_dtype)
            if wg is None
            else wg.detach().reshape(self.g_dim, self.weight_cols).to(out_dtype)
        )
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            bg = bias.grad
            parts.append(
                weight.new_zeros(self.g_dim, 1, dtype=out_dtype)
                if bg is None
                else bg.detach().reshape(self.g_dim, 1).to(out_dtype)
            )
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def set_grad(self, matrix: Tensor) -> None:
        """Write ``matrix`` (``(g_dim, a_dim)``) into ``weight.grad`` and ``bias.grad``.

        Existing ``.grad`` tensors are updated in place (``copy_``, keeping their dtype);
        a missing one is created in the parameter's dtype.
        """
        if tuple(matrix.shape) != (self.g_dim, self.a_dim):
            raise ValueError(
                f"set_grad expects shape {(self.g_dim, self.a_dim)}, got {tuple(matrix.shape)}"
            )
        matrix = matrix.detach()
        weight: Tensor = self.module.weight  # type: ignore[assignment]
        _write_grad(weight, matrix[:, : self.weight_cols])
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            _write_grad(bias, matrix[:, self.weight_cols])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a_dim={self.a_dim}, g_dim={self.g_dim})"


def _write_grad(param: Tensor, value: Tensor) -> None:
    """Copy ``value`` into ``param.grad`` in place, or create it in ``param``'s dtype."""
    if param.grad is None:
        param.grad = value.reshape(param.shape).to(param.dtype, copy=True)
    else:
        param.grad.copy_(value.reshape(param.grad.shape))


class LinearCurvature(LayerCurvature):
    """``nn.Linear``: inputs ``(b, *, in)``; positions beyond the batch become rows."""

    module: nn.Linear

    @property
    def weight_cols(self) -> int:
        return int(self.module.in_features)

    @property
    def g_dim(self) -> int:
        return int(self.module.out_features)

    def _input_rows(self, inputs: Tensor) -> Tensor:
        return inputs.reshape(-1, self.weight_cols)

    def _output_rows(self, grad_output: Tensor) -> tuple[Tensor, int]:
        b = grad_output.shape[0] if grad_output.dim() > 1 else 1  # unbatched input: b = 1
        return grad_output.reshape(-1, self.g_dim), b


class Conv2dCurvature(LayerCurvature):
    """``nn.Conv2d`` with ``groups=1`` and zero padding (any stride, padding, dilation)."""

    module: nn.Conv2d

    @property
    def weight_cols(self) -> int:
        kh, kw = self.module.kernel_size
        return int(self.module.in_channels) * kh * kw

    @property
    def g_dim(self) -> int:
        return int(self.module.out_channels)

    def _explicit_padding(self) -> tuple[int, int, int, int] | tuple[int, int]:
        """``(h, w)`` symmetric padding, or ``(left, right, top, bottom)`` for F.pad.

        ``"same"`` pads each dim by ``total = dilation·(k-1)``, ``left = total//2``,
        ``right = total - left`` (PyTorch's rule; asymmetric for even effective kernels).
        """
        m = self.module
        if m.padding == "valid":
            return (0, 0)
        if m.padding == "same":
            pads: list[int] = []
            for d, k in ((m.dilation[1], m.kernel_size[1]), (m.dilation[0], m.kernel_size[0])):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return (pads[0], pads[1], pads[2], pads[3])
        ph, pw = cast(tuple[int, int], m.padding)
        return (int(ph), int(pw))

    def _patches(self, inputs: Tensor) -> Tensor:
        """``(b, C·kh·kw, T)``: one column per output position (``F.unfold``)."""
        m = self.module
        x = inputs if inputs.dim() == 4 else inputs.unsqueeze(0)  # unbatched (C, H, W)
        pad = self._explicit_padding()
        if len(pad) == 4:
            x = F.pad(x, pad)
            pad = (0, 0)
        return F.unfold(x, m.kernel_size, dilation=m.dilation, padding=pad, stride=m.stride)

    def _input_rows(self, inputs: Tensor) -> Tensor:
        return self._patches(inputs).transpose(1, 2).reshape(-1, self.weight_cols)

    def _output_rows(self, grad_output: Tensor) -> tuple[Tensor, int]:
        g = grad_output if grad_output.dim() == 4 else grad_output.unsqueeze(0)
        return g.permute(0, 2, 3, 1).reshape(-1, self.g_dim), g.shape[0]

    # With more output positions than features, the factors are summed per sample from
    # the (b, features, positions) layout F.unfold and the gradient already have:
    # no transposed copy of the rows (2.3x faster for ResNet-20's first stage). Half
    # precision keeps the row path (its scaling happens before the products).
    def a_factor(self, inputs: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        patches = self._patches(_cast(inputs, dtype))
        if patches.shape[1] >= patches.shape[2] or patches.dtype not in _WIDE:
            rows = patches.transpose(1, 2).reshape(-1, self.weight_cols)
            return covariance(self._with_bias_column(rows))
        return column_covariance(patches, append_one=self.has_bias)

    def g_factor(
        self, grad_output: Tensor, dtype: torch.dtype | None = None,
        grad_scale: float | Tensor = 1.0,
    ) -> Tensor:
        g = _cast(grad_output, dtype)
        g = g if g.dim() == 4 else g.unsqueeze(0)
        b, positions = g.shape[0], g.shape[2] * g.shape[3]
        if self.g_dim >= positions or g.dtype not in _WIDE:
            return super().g_factor(grad_output, dtype, grad_scale)
        scale = b / grad_scale  # δ = b·∂L/∂y / grad_scale, applied to the small result
        return column_covariance(g.reshape(b, self.g_dim, positions)).mul_(scale * scale)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a layer that K-FAC could in principle precondition is skipped, else ``None``.

    ``None`` for supported layers (Linear; Conv2d with groups=1 and zero padding) and for
    modules that are not K-FAC layer types at all (activations, norms, containers, …).
    """
    name = type(module).__name__
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            return f"grouped convolution (groups={module.groups}) is not supported"
        if module.padding_mode != "zeros":
            return f"Conv2d padding_mode={module.padding_mode!r} is not supported (only 'zeros')"
        return None
    if isinstance(module, (nn.Conv1d, nn.Conv3d)):
        return f"{name} is not supported (only Linear and Conv2d)"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return f"transposed convolution ({name}) is not supported"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return f"{name} is not supported"
    return None


def curvature_for(module: nn.Module) -> LayerCurvature | None:
    """The curvature handler for a supported layer, ``None`` for anything else."""
    if isinstance(module, nn.Linear):
        return LinearCurvature(module)
    if isinstance(module, nn.Conv2d) and unsupported_reason(module) is None:
        return Conv2dCurvature(module)
    return None


def register_layers(model: nn.Module,
                    skip: Sequence[str] = ()) -> tuple[dict[str, LayerCurvature], list[str]]:
    """The layers K-FAC preconditions, by name in model order, and why others are skipped.

    ``skip`` matches module names or class names. Unsupported modules (grouped
    convolutions, ...) and frozen layers (weight without grad) are skipped with a reason.
    The preconditioner and the planner both use this rule.
    """
    layers: dict[str, LayerCurvature] = {}
    skipped: list[str] = []
    for name, module in model.named_modules():
        if any(s == name or s == type(module).__name__ for s in skip):
            skipped.append(f"{name or '<model>'} ({type(module).__name__}: skip_layers)")
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            skipped.append(f"{name} ({reason})")
            continue
        curv = curvature_for(module)
        if curv is None:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or not weight.requires_grad:
            skipped.append(f"{name} (frozen)")
            continue
        layers[name or type(module).__name__] = curv
    return layers, skipped
