"""Per-layer K-FAC curvature: rows of ā and δ, the factors A and G, and ∇W̄ ⇄ ``.grad``.

One code path serves A and G: a layer turns its captured tensor into rows
(``a_rows`` / ``g_rows``) and both factors are ``covariance(rows)`` (mean over rows of
the outer products). Subclasses only say how rows are formed.

Scaling conventions (docs/design.md, "kfac — the math contract"), with ``b`` the local batch
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

K-FAC-reduce (``approx="reduce"``; Eschenhagen et al., NeurIPS 2023, arXiv 2311.00636)
replaces the ``T`` rows of an example by one: the **mean** input over its positions
``â_i = (1/T) Σ_t ā_{i,t}`` (the bias entry stays 1) and the **sum** of its output
gradients ``ĝ_i = Σ_t δ_{i,t}``. In the paper (per-example Fisher normalised by
``1/b``) ``F_reduce = A_red ⊗ B_red`` with ``A_red = (1/b) Σ_i â_i â_iᵀ`` and
``B_red = (1/b) Σ_i ĝ_i ĝ_iᵀ``; K-FAC-expand there is ``A_exp ⊗ B_exp`` with
``A_exp = (1/(bT)) Σ_{i,t} ā āᵀ`` = our ``A`` and ``B_exp = (1/b) Σ_{i,t} δ δᵀ = T·G``.
We keep **the same per-position units for both**: ``A = A_red``,
``G = B_red / T = (1/(bT)) Σ_i ĝ_i ĝ_iᵀ``, so for either approximation
``A ⊗ G = F_approx / T`` and ``(A⊗G + γI)⁻¹ = T·(F_approx + TγI)⁻¹``: one damping value
means the same for expand and reduce, and switching the option needs no retuning of
the damping's scale. Without positions (``T = 1``: Linear on ``(b, in)``) reduce and
expand coincide. For Conv2d, ``T = Ho·Wo`` and ``â_i`` is the averaged patch, computed
without the patch matrix (:func:`kfac_hpc.kfac.patches.averaged_patches`).

Embedding (``nn.Embedding``, dense gradients): a Linear layer on one-hot inputs,
``∇W̄ = (∇W)ᵀ`` of shape ``(embedding_dim, num_embeddings)``, ``A`` = diag(token
frequencies), ``G`` as Linear over positions (:class:`EmbeddingCurvature`).

**What K-FAC does not precondition** (the rule): only the weight (and bias) of
``nn.Linear``, ``nn.Conv2d`` (groups=1, zero padding) and ``nn.Embedding`` modules are
preconditioned. Every other parameter (LayerNorm/BatchNorm scales and shifts, positional
embeddings held as a bare ``nn.Parameter``, attention parameters that are not the
weight of an ``nn.Linear`` module, e.g. ``nn.MultiheadAttention.in_proj_weight``) keeps
its plain gradient and is left to the optimizer (SGD/AdamW) as is. A Linear module
whose forward is never called, because its owner uses its weight directly
(``nn.MultiheadAttention.out_proj``), is registered but its hooks never fire: it is
not preconditioned either, and the preconditioner warns once naming it (use
``skip_layers`` to silence). Write attention with ``nn.Linear`` q/k/v/out projections
(as :mod:`kfac_hpc.models`' ``gpt`` does) for K-FAC to see them.

Conv2d expand ``A`` is computed by :func:`kfac_hpc.kfac.patches.patch_covariance`
(channels-last rows in chunks, symmetric rank-k update) for float32/float64 inputs;
``Conv2dCurvature.a_factor_unfold`` keeps the ``F.unfold`` path (half precision, and
the reference the fast path is tested against).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.kfac import shifts
from kfac_hpc.kfac.linalg import column_covariance, covariance, inner64, uses_gpu_path
from kfac_hpc.kfac.patches import (
    averaged_patches,
    conv_output_size,
    patch_covariance,
    patch_rows,
    stacked_patch_rows,
)
from kfac_hpc.kfac.precision import MatmulPrecision

__all__ = [
    "APPROXIMATIONS",
    "COLUMN_MAJOR_ROWS_DEVICES",
    "Conv2dCurvature",
    "EmbeddingCurvature",
    "LayerCurvature",
    "LinearCurvature",
    "Stacking",
    "approx_for",
    "curvature_for",
    "keeps_bf16_rows",
    "register_layers",
    "unsupported_reason",
]


APPROXIMATIONS = ("expand", "reduce")
"""K-FAC approximations for layers with weight sharing (positions): see the module docstring."""

_WIDE = (torch.float32, torch.float64)  # dtypes of the per-sample (batched) factor path

COLUMN_MAJOR_ROWS_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types whose convolution rows (patches, output gradients) are built column-major.

There the copy from an NCHW tensor moves runs of output positions, and the factor's Gram
product reaches the GEMM as ``x·xᵀ`` of a row-major ``x`` (cuBLAS "tn") instead of
``yᵀ·y`` ("nt"). The same numbers either way (:func:`~kfac_hpc.kfac.patches.patch_rows`).
CUDA, measured on an NVIDIA H200 (``benchmarks/gram_layouts.py``; benchmarks/RESULTS.md,
GPU): ResNet-50's convolution statistics (``A`` and ``G``, batch 32) in TF32, the CUDA
default, 24.8 ms row-major against 22.1 column-major per factor update (in full fp32 47.0
against 48.7); the CPU keeps row-major.
"""
# Below this many input channels the fast conv A path copies too few contiguous values
# per kernel offset (measured: 0.5x the unfold path for ResNet's 3-channel stem).
_FAST_MIN_CHANNELS = 8


def _bf16_rows_source(t: Tensor, dtype: torch.dtype | None, precision: MatmulPrecision
                      ) -> Tensor | None:
    """The bf16 tensor a factor's rows are built from, or None where they are not bf16.

    On the GPU path with reduced-precision statistics (TF32 or bf16 operands) and float32
    factors, the rows are built in bf16 (half the bytes copied) and the GEMM accumulates
    in float32 (:func:`~kfac_hpc.kfac.linalg.covariance`'s ``out_dtype``):
    * bf16 (AMP) activations or output gradients as they are: TF32 or bf16 rounding of
      bf16 values changes nothing, so the factor is the one of the widened rows up to
      the summation order;
    * float32 ones with ``stats_precision="bf16"``, cast once: the GEMM rounds every
      operand to bf16 anyway, and rounding commutes with building the rows (copies of
      the same values), so the operands are the same; the cast reads a tensor that is,
      for a k×k convolution, k² times smaller than its rows, instead of float32 rows
      cast twice more (once per operand).
    """
    if dtype != torch.float32 or precision == "full" or not uses_gpu_path(t.device):
        return None
    if t.dtype == torch.bfloat16:
        return t
    if t.dtype == torch.float32 and precision == "bf16":
        return _detached(t).to(torch.bfloat16)
    return None


def keeps_bf16_rows(t: Tensor, dtype: torch.dtype | None, precision: MatmulPrecision) -> bool:
    """Say whether bf16 ``t`` (AMP) keeps its rows in bf16 (:func:`_bf16_rows_source`).

    The rule of each layer's path, which the stacked statistics follow too
    (:mod:`kfac_hpc.kfac.statistics_groups`).
    """
    return t.dtype == torch.bfloat16 and _bf16_rows_source(t, dtype, precision) is not None


def _is_column_major(rows: Tensor) -> bool:
    """Say whether 2-D ``rows`` (of more than one column) are a row-major tensor's transpose."""
    return rows.dim() == 2 and rows.shape[1] > 1 and rows.stride(0) == 1


def _cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` detached, in ``dtype`` if given (e.g. float32 statistics of fp16/bf16 AMP tensors)."""
    t = _detached(t)
    return t if dtype is None else t.to(dtype)


class Stacking(NamedTuple):
    """How one layer's factor statistics stack with other layers' (the GPU path).

    Layers whose tensors give the same ``key`` have rows of one shape, computed by the
    same function of the tensor: their factors can be one batched product
    (:meth:`LayerCurvature.stacked_rows`, :mod:`kfac_hpc.kfac.statistics_groups`).
    ``row_bytes``: the bytes of one layer's rows (what a stack of them copies).
    """

    key: tuple[object, ...]
    row_bytes: int


class LayerCurvature(ABC):
    """Curvature handler of one K-FAC layer (abstract).

    Attributes: ``module``, ``has_bias``, ``approx`` (``"expand"`` or ``"reduce"``, see
    the module docstring; only the factors depend on it); ``a_dim`` = input features per
    row (+1 with bias), ``g_dim`` = output features. ``∇W̄`` has shape ``(g_dim, a_dim)``.
    """

    def __init__(self, module: nn.Module, approx: str = "expand") -> None:
        """Take the layer ``module`` with the approximation ``approx``.

        Args:
            module: The layer.
            approx: ``"expand"`` or ``"reduce"`` (layers with positions).
        """
        if approx not in APPROXIMATIONS:
            raise ValueError(f"approx must be one of {APPROXIMATIONS}, got {approx!r}")
        self.module = module
        self.approx = approx
        # a frozen bias (requires_grad False when the layer is registered) is no part of
        # the layer's curvature: no bias column in A, no .grad written for it
        bias = getattr(module, "bias", None)
        self.has_bias: bool = bias is not None and bool(bias.requires_grad)

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

    @abstractmethod
    def _reduced_inputs(self, inputs: Tensor) -> Tensor:
        """``(b, weight_cols)``: each example's input rows averaged over its positions."""

    @abstractmethod
    def _reduced_outputs(self, grad_output: Tensor) -> tuple[Tensor, int, int]:
        """``(b, g_dim)`` sums of ``∂L/∂y`` over each example's positions, ``b`` and ``T``."""

    # ----- shared path --------------------------------------------------------------------
    @property
    def a_dim(self) -> int:
        """Columns of ``∇W̄``: input features (+1 with bias)."""
        return self.weight_cols + int(self.has_bias)

    def a_rows(self, inputs: Tensor) -> Tensor:
        """Rows of ``ā`` (``(rows, a_dim)``), with a column of ones appended when biased.

        Always the expand rows (one per position), whatever ``approx``: with
        :meth:`g_rows` they give ``∇W̄ = (1/b) Σ_rows δ āᵀ``.
        """
        return self._with_bias_column(self._input_rows(_detached(inputs)))

    def _with_bias_column(self, rows: Tensor) -> Tensor:
        if not self.has_bias:
            return rows
        if _is_column_major(rows):  # keep the layout: one more row of the transposed copy
            return torch.cat([rows.t(), rows.new_ones(1, rows.shape[0])]).t()
        return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)

    def g_rows(self, grad_output: Tensor, grad_scale: float | Tensor = 1.0) -> Tensor:
        """Rows of ``δ = b·∂L/∂y / grad_scale`` (``(rows, g_dim)``).

        ``grad_scale`` is whatever factor the loss was multiplied by before backward (an
        AMP loss scale, or ``1/accumulation_steps``); dividing by it restores ``δ``. A
        0-dim tensor (the GradScaler's scale, on the device) is used without a host sync.
        """
        rows, b = self._output_rows(_detached(grad_output))
        return rows * (b / grad_scale)

    def a_factor(self, inputs: Tensor, dtype: torch.dtype | None = None,
                 precision: MatmulPrecision = "full") -> Tensor:
        """Return the factor ``A``: the mean over rows of ``ā āᵀ``.

        ``A`` = mean over rows of ``ā āᵀ``, computed in ``dtype`` (default: inputs' dtype),
        its GEMM in ``precision`` (:mod:`kfac_hpc.kfac.precision`).

        Reduce: mean over examples of ``â âᵀ`` (``â`` = the example's mean row).
        """
        if self.approx == "reduce":
            return self._reduce_a(_cast(inputs, dtype), precision)
        source = _bf16_rows_source(inputs, dtype, precision)
        if source is not None:
            return covariance(self.a_rows(source), precision=precision, out_dtype=dtype)
        return covariance(self.a_rows(_cast(inputs, dtype)), precision=precision)

    def g_factor(
        self, grad_output: Tensor, dtype: torch.dtype | None = None,
        grad_scale: float | Tensor = 1.0, precision: MatmulPrecision = "full",
    ) -> Tensor:
        """Return the factor ``G``: the mean over rows of ``δ δᵀ``.

        ``G`` = mean over rows of ``δ δᵀ`` with the loss scale removed, in ``dtype``,
        its GEMM in ``precision``.

        Reduce: ``(1/(bT)) Σ_i ĝ_i ĝ_iᵀ`` with ``ĝ_i = Σ_t δ_{i,t}``.
        """
        if self.approx == "expand" and not isinstance(grad_scale, Tensor):
            source = _bf16_rows_source(grad_output, dtype, precision)
            if source is not None:
                # bf16 rows, float32 product; the scale applied to the small float32 result
                rows, b = self._output_rows(_detached(source))
                scale = b / grad_scale
                return covariance(rows, scale * scale, precision=precision, out_dtype=dtype)
        g = _cast(grad_output, dtype)
        if self.approx == "reduce":
            return self._reduce_g(g, grad_scale, precision)
        if isinstance(grad_scale, Tensor) or g.dtype not in _WIDE:
            # half precision, or a device-side loss scale: scale the rows
            return covariance(self.g_rows(g, grad_scale), precision=precision)
        rows, b = self._output_rows(g)
        scale = b / grad_scale  # δ = b·∂L/∂y / grad_scale, applied inside the Gram product
        return covariance(rows, scale * scale, precision=precision)

    def _reduce_a(self, inputs: Tensor, precision: MatmulPrecision) -> Tensor:
        return covariance(self._with_bias_column(self._reduced_inputs(inputs)),
                          precision=precision)

    def _reduce_g(self, grad_output: Tensor, grad_scale: float | Tensor,
                  precision: MatmulPrecision) -> Tensor:
        sums, b, positions = self._reduced_outputs(grad_output)
        scale = b / grad_scale  # δ = b·∂L/∂y / grad_scale, applied to the small result
        if isinstance(scale, Tensor):
            return covariance(sums, precision=precision).mul_(scale * scale / positions)
        return covariance(sums, scale * scale / positions, precision=precision)

    # ----- stacked statistics (layers of one shape, the GPU path) -------------------
    def stacking(self, factor: str, t: Tensor) -> Stacking | None:
        """How ``factor``'s statistics of ``t`` stack with other layers' (``None``: not).

        ``t`` is the input (``"A"``) or the output gradient (``"G"``). Only expand
        statistics stack, of the tensors and at the precisions the caller allows
        (:mod:`kfac_hpc.kfac.statistics_groups`); then :meth:`stacked_rows` of
        same-keyed tensors gives each layer's rows as :meth:`a_factor` and
        :meth:`g_factor` build them on the GPU path.
        """
        if self.approx != "expand" or not t.is_floating_point():
            return None
        return self._stacking(factor, t)

    def _stacking(self, factor: str, t: Tensor) -> Stacking | None:
        """:meth:`stacking` past the common conditions (none by default)."""
        return None

    def stacked_rows(self, factor: str, tensors: Sequence[Tensor]) -> tuple[Tensor, int]:
        """The ``(L, n, d)`` rows of same-keyed ``tensors`` (:meth:`stacking`), and ``b``.

        ``[l]`` holds the rows :meth:`a_factor` (with the bias column) or
        :meth:`g_factor` (unscaled: ``∂L/∂y``) would build from ``tensors[l]`` on the
        GPU path, in the same layout; ``b`` is the batch size that scales ``G``'s rows
        (1 for ``A``).
        """
        detached = [_detached(t) for t in tensors]
        if factor == "A":
            return self._with_stacked_bias_column(self._stacked_input_rows(detached)), 1
        return self._stacked_output_rows(detached)

    def _stacked_input_rows(self, inputs: Sequence[Tensor]) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not stack its statistics")

    def _stacked_output_rows(self, grads: Sequence[Tensor]) -> tuple[Tensor, int]:
        raise NotImplementedError(f"{type(self).__name__} does not stack its statistics")

    def _with_stacked_bias_column(self, rows: Tensor) -> Tensor:
        """``(L, n, d)`` rows with a column of ones appended when biased, layout kept."""
        if not self.has_bias:
            return rows
        count, n, _ = rows.shape
        if rows.shape[2] > 1 and rows.stride(1) == 1:  # column-major: one more row of mT
            return torch.cat([rows.mT, rows.new_ones(count, 1, n)], dim=1).mT
        return torch.cat([rows, rows.new_ones(count, n, 1)], dim=2)

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
            else _as(_detached(wg).reshape(self.g_dim, self.weight_cols), out_dtype)
        )
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            bg = bias.grad
            parts.append(
                weight.new_zeros(self.g_dim, 1, dtype=out_dtype)
                if bg is None
                else _as(_detached(bg).reshape(self.g_dim, 1), out_dtype)
            )
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def grad_dot(self, matrix: Tensor) -> Tensor | None:
        """Return ``⟨matrix, ∇W̄⟩`` in float64, read from the ``.grad`` fields.

        ``⟨matrix, ∇W̄⟩`` in float64 (0-dim; ``None`` without any ``.grad``), read from
        the ``.grad`` fields without building ``∇W̄``. Equals
        ``inner64(matrix, grad_matrix(matrix.dtype))`` up to the summation order.
        """
        weight: Tensor = self.module.weight  # type: ignore[assignment]
        total: Tensor | None = None
        wg = weight.grad
        if wg is not None:
            total = inner64(matrix[:, : self.weight_cols],
                            _as(_detached(wg).reshape(self.g_dim, self.weight_cols), matrix.dtype))
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            bg = bias.grad
            if bg is not None:
                term = inner64(matrix[:, self.weight_cols],
                               _as(_detached(bg).reshape(self.g_dim), matrix.dtype))
                total = term if total is None else total + term
        return total

    def set_grad(self, matrix: Tensor) -> None:
        """Write ``matrix`` (``(g_dim, a_dim)``) into ``weight.grad`` and ``bias.grad``.

        Existing ``.grad`` tensors are updated in place (``copy_``, keeping their dtype);
        a missing one is created in the parameter's dtype.
        """
        for param, value in self.grad_targets(matrix):
            _write_grad(param, value)

    def grad_targets(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The parameters ``matrix`` (``(g_dim, a_dim)``) is written to, each with its part.

        Each part is a view of ``matrix``, reshaped to the parameter's shape, so
        ``param.grad.copy_(part)`` is :meth:`set_grad` (several layers' writes can be one
        multi-tensor copy).

        Args:
            matrix: A preconditioned gradient of this layer.

        Returns:
            ``[(weight, part), (bias, part)]`` (without bias: the weight's only). A
            parameter frozen since the layer was registered (``requires_grad`` False) is
            left out: a new ``.grad`` would have the optimizer move it.
        """
        if tuple(matrix.shape) != (self.g_dim, self.a_dim):
            raise ValueError(
                f"set_grad expects shape {(self.g_dim, self.a_dim)}, got {tuple(matrix.shape)}"
            )
        matrix = _detached(matrix)
        weight: Tensor = self.module.weight  # type: ignore[assignment]
        out = [(weight, matrix[:, : self.weight_cols].reshape(weight.shape))]
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            out.append((bias, matrix[:, self.weight_cols]))
        return [(p, part) for p, part in out if p.requires_grad]

    def grad_blocks(self) -> list[Tensor | None]:
        """``∇W̄``'s column blocks as the ``.grad`` fields hold them (views, no copy).

        ``torch.cat(blocks, dim=1)`` is :meth:`grad_matrix` in the weight's dtype; a
        missing ``.grad`` is ``None`` (zeros in ``∇W̄``). Blocks of layers with the same
        :meth:`grad_layout` stack.

        Returns:
            The weight's ``(g_dim, weight_cols)`` and, with bias, the bias's ``(g_dim, 1)``.
        """
        weight: Tensor = self.module.weight  # type: ignore[assignment]
        wg = weight.grad
        out = [None if wg is None else _detached(wg).reshape(self.g_dim, self.weight_cols)]
        if self.has_bias:
            bias: Tensor = self.module.bias  # type: ignore[assignment]
            bg = bias.grad
            out.append(None if bg is None else _detached(bg).reshape(self.g_dim, 1))
        return out

    @property
    def block_widths(self) -> tuple[int, ...]:
        """The widths of :meth:`grad_blocks` (weight, bias)."""
        return (self.weight_cols, 1) if self.has_bias else (self.weight_cols,)

    def grad_layout(self) -> tuple[object, ...]:
        """What :meth:`grad_blocks` look like: equal for layers whose gradients stack.

        Returns:
            ``g_dim``, ``a_dim``, each block's width, and the weight's dtype.
        """
        return (self.g_dim, self.a_dim, self.block_widths, self.module.weight.dtype)

    def __repr__(self) -> str:
        """Show the class, the factor dimensions and the approximation."""
        return (f"{type(self).__name__}(a_dim={self.a_dim}, g_dim={self.g_dim}, "
                f"approx={self.approx!r})")

def _detached(t: Tensor) -> Tensor:
    """``t`` without autograd history: itself where nothing would record one.

    A detach is one more dispatched operator (host time on a GPU); under ``no_grad``
    (the step, backward's hooks) or for a tensor that requires no gradient, reading
    ``t`` records nothing anyway.
    """
    return t.detach() if t.requires_grad and torch.is_grad_enabled() else t


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (itself when it already is: no dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


def _write_grad(param: Tensor, value: Tensor) -> None:
    """Copy ``value`` into ``param.grad`` in place, or create it in ``param``'s dtype."""
    if param.grad is None:
        param.grad = value.reshape(param.shape).to(param.dtype, copy=True)
    else:
        param.grad.copy_(value.reshape(param.grad.shape))


class _OutputsOverPositions(LayerCurvature):
    """Output side of a layer whose output is ``(b, *positions, g_dim)``.

    Every position is a row (expand), or sums over positions (reduce).
    """

    def _output_rows(self, grad_output: Tensor) -> tuple[Tensor, int]:
        b = grad_output.shape[0] if grad_output.dim() > 1 else 1  # unbatched input: b = 1
        return grad_output.reshape(-1, self.g_dim), b

    def _reduced_outputs(self, grad_output: Tensor) -> tuple[Tensor, int, int]:
        if grad_output.dim() <= 2:
            rows, b = self._output_rows(grad_output)
            return rows, b, 1
        g = grad_output.reshape(grad_output.shape[0], -1, self.g_dim)
        return g.sum(dim=1), g.shape[0], g.shape[1]


class LinearCurvature(_OutputsOverPositions):
    """``nn.Linear``: inputs ``(b, *, in)``; positions beyond the batch become rows."""

    module: nn.Linear

    @property
    def weight_cols(self) -> int:
        """Return the columns of the weight matrix (``a_dim`` without bias)."""
        return int(self.module.in_features)

    @property
    def g_dim(self) -> int:
        """Return the dimension of ``G`` (output features)."""
        return int(self.module.out_features)

    def _input_rows(self, inputs: Tensor) -> Tensor:
        return inputs.reshape(-1, self.weight_cols)

    def _stacking(self, factor: str, t: Tensor) -> Stacking | None:
        key = ("Linear", factor, tuple(t.shape), t.dtype, t.device,
               self.has_bias if factor == "A" else None)
        return Stacking(key, t.numel() * t.element_size())

    def _stacked_input_rows(self, inputs: Sequence[Tensor]) -> Tensor:
        return torch.stack(list(inputs)).reshape(len(inputs), -1, self.weight_cols)

    def _stacked_output_rows(self, grads: Sequence[Tensor]) -> tuple[Tensor, int]:
        b = grads[0].shape[0] if grads[0].dim() > 1 else 1  # as _output_rows
        return torch.stack(list(grads)).reshape(len(grads), -1, self.g_dim), b

    def _reduced_inputs(self, inputs: Tensor) -> Tensor:
        if inputs.dim() <= 2:  # no positions: reduce = expand
            return inputs.reshape(-1, self.weight_cols)
        return inputs.reshape(inputs.shape[0], -1, self.weight_cols).mean(dim=1)


class Conv2dCurvature(LayerCurvature):
    """``nn.Conv2d`` with ``groups=1`` and zero padding (any stride, padding, dilation)."""

    module: nn.Conv2d

    @property
    def weight_cols(self) -> int:
        """Return the columns of the weight matrix (``a_dim`` without bias)."""
        kh, kw = self.module.kernel_size
        return int(self.module.in_channels) * kh * kw

    @property
    def g_dim(self) -> int:
        """Return the dimension of ``G`` (output features)."""
        return int(self.module.out_channels)

    def pads(self) -> tuple[int, int, int, int]:
        """``(top, bottom, left, right)`` zero padding of the input."""
        p = self._explicit_padding()
        if len(p) == 4:
            return (p[2], p[3], p[0], p[1])
        return (p[0], p[0], p[1], p[1])

    def _conv_geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        m = self.module
        return (cast(tuple[int, int], tuple(m.kernel_size)),
                cast(tuple[int, int], tuple(m.stride)),
                cast(tuple[int, int], tuple(m.dilation)))

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
        x = inputs if inputs.dim() == 4 else inputs.unsqueeze(0)
        return patch_rows(x, *self._conv_geometry(), self.pads(),
                          column_major=x.device.type in COLUMN_MAJOR_ROWS_DEVICES)

    def _output_rows(self, grad_output: Tensor) -> tuple[Tensor, int]:
        g = grad_output if grad_output.dim() == 4 else grad_output.unsqueeze(0)
        if g.device.type in COLUMN_MAJOR_ROWS_DEVICES:
            return g.transpose(0, 1).reshape(self.g_dim, -1).t(), g.shape[0]
        return g.permute(0, 2, 3, 1).reshape(-1, self.g_dim), g.shape[0]

    def _stacking(self, factor: str, t: Tensor) -> Stacking | None:
        if t.dim() != 4:  # unbatched: one layer at a time
            return None
        if factor == "G":
            return Stacking(("Conv2d", "G", tuple(t.shape), t.dtype, t.device),
                            t.numel() * t.element_size())
        kernel_size, stride, dilation = self._conv_geometry()
        pads = self.pads()
        path = "gpu" if uses_gpu_path(t.device) else "cpu"
        if self.module.in_channels >= _FAST_MIN_CHANNELS and shifts.pays(
                t, kernel_size, stride, dilation, pads, path):
            return None  # a_factor takes the shifted products
        ho, wo = conv_output_size(t.shape[2], t.shape[3], kernel_size, stride, dilation, pads)
        key = ("Conv2d", "A", tuple(t.shape), t.dtype, t.device, kernel_size, stride, dilation,
               pads, self.has_bias)
        return Stacking(key, t.shape[0] * ho * wo * self.a_dim * t.element_size())

    def _stacked_input_rows(self, inputs: Sequence[Tensor]) -> Tensor:
        return stacked_patch_rows(inputs, *self._conv_geometry(), self.pads(),
                                  column_major=inputs[0].device.type in COLUMN_MAJOR_ROWS_DEVICES)

    def _stacked_output_rows(self, grads: Sequence[Tensor]) -> tuple[Tensor, int]:
        count, b = len(grads), grads[0].shape[0]
        if grads[0].device.type in COLUMN_MAJOR_ROWS_DEVICES:
            return torch.stack([g.transpose(0, 1) for g in grads]).view(
                count, self.g_dim, -1).mT, b
        return torch.stack([g.permute(0, 2, 3, 1) for g in grads]).view(
            count, -1, self.g_dim), b

    def _reduced_inputs(self, inputs: Tensor) -> Tensor:
        x = inputs if inputs.dim() == 4 else inputs.unsqueeze(0)
        return averaged_patches(x, *self._conv_geometry(), self.pads())

    def _reduced_outputs(self, grad_output: Tensor) -> tuple[Tensor, int, int]:
        g = grad_output if grad_output.dim() == 4 else grad_output.unsqueeze(0)
        return g.sum(dim=(2, 3)), g.shape[0], g.shape[2] * g.shape[3]

    def a_factor(self, inputs: Tensor, dtype: torch.dtype | None = None,
                 precision: MatmulPrecision = "full") -> Tensor:
        """Return the factor ``A`` of a convolution.

        Expand (float32/64, at least 8 input channels) from shifted products of the
        input where :func:`~kfac_hpc.kfac.shifts.pays` on this device's statistics path
        (stride 1; the CPU's); else on the CPU at full precision by
        :func:`~kfac_hpc.kfac.patches.patch_covariance`; otherwise :meth:`a_factor_unfold`
        (the GPU path: one unfold, one GEMM). Or reduce.
        """
        source = _bf16_rows_source(inputs, dtype, precision) if self.approx == "expand" else None
        if source is not None:
            return self.a_factor_unfold(source, dtype, precision)
        x = _cast(inputs, dtype)
        if self.approx == "reduce":
            return self._reduce_a(x, precision)
        x = x if x.dim() == 4 else x.unsqueeze(0)
        kernel_size, stride, dilation = self._conv_geometry()
        pads = self.pads()
        path = "gpu" if uses_gpu_path(x.device) else "cpu"
        fast = x.dtype in _WIDE and self.module.in_channels >= _FAST_MIN_CHANNELS
        if fast and shifts.pays(x, kernel_size, stride, dilation, pads, path):
            return shifts.shifted_covariance(x, kernel_size, dilation, pads,
                                             append_one=self.has_bias, precision=precision)
        if not fast or precision != "full" or path == "gpu":
            return self.a_factor_unfold(x, precision=precision)
        return patch_covariance(x, kernel_size, stride, dilation, pads,
                                append_one=self.has_bias)

    # On the CPU, with more output positions than features, the factors are summed per
    # sample from the (b, features, positions) layout F.unfold and the gradient already
    # have: no transposed copy of the rows (2.3x faster for ResNet-20's first stage).
    # The GPU path, half precision and rounded products take the row path: the patch
    # rows in one strided copy (patches.patch_rows), one GEMM (per-sample partial sums
    # cost b·d² memory and b small products).
    def a_factor_unfold(self, inputs: Tensor, dtype: torch.dtype | None = None,
                        precision: MatmulPrecision = "full") -> Tensor:
        """Return the expand ``A`` from patch rows or per-sample patch sums.

        Expand ``A`` from the patch rows (the GPU path) or from ``F.unfold`` patches
        summed per sample (the CPU path with many positions; the reference).
        """
        if keeps_bf16_rows(inputs, dtype, precision):  # bf16 rows, float32 product
            return covariance(self._with_bias_column(self._input_rows(_detached(inputs))),
                              precision=precision, out_dtype=dtype)
        x = _cast(inputs, dtype)
        x = x if x.dim() == 4 else x.unsqueeze(0)
        ho, wo = conv_output_size(x.shape[2], x.shape[3], *self._conv_geometry(), self.pads())
        if self._row_path(self.weight_cols, ho * wo, x, precision):
            return covariance(self._with_bias_column(self._input_rows(x)), precision=precision)
        return column_covariance(self._patches(x), append_one=self.has_bias)

    @staticmethod
    def _row_path(features: int, positions: int, t: Tensor, precision: MatmulPrecision
                  ) -> bool:
        """Say whether statistics take the row path rather than per-sample parts.

        Whether statistics of ``features`` per row at ``positions`` per sample take
        the row path (one copy, one GEMM) rather than per-sample partial sums.
        """
        return (features >= positions or t.dtype not in _WIDE
                or precision != "full" or uses_gpu_path(t.device))

    def g_factor(
        self, grad_output: Tensor, dtype: torch.dtype | None = None,
        grad_scale: float | Tensor = 1.0, precision: MatmulPrecision = "full",
    ) -> Tensor:
        """Return the factor ``G`` from the output gradients."""
        if self.approx == "reduce" or keeps_bf16_rows(grad_output, dtype, precision):
            return super().g_factor(grad_output, dtype, grad_scale, precision)
        g = _cast(grad_output, dtype)
        g = g if g.dim() == 4 else g.unsqueeze(0)
        b, positions = g.shape[0], g.shape[2] * g.shape[3]
        if self._row_path(self.g_dim, positions, g, precision):
            return super().g_factor(grad_output, dtype, grad_scale, precision)
        scale = b / grad_scale  # δ = b·∂L/∂y / grad_scale, applied to the small result
        return column_covariance(g.reshape(b, self.g_dim, positions)).mul_(scale * scale)


class EmbeddingCurvature(_OutputsOverPositions):
    """``nn.Embedding``: a Linear layer on one-hot inputs, ``y = Wᵀ e_x``.

    Inputs are token indices ``(b, *)``; every index is a row (positions beyond the batch
    as for Linear on sequences). The one-hot row ``e_x`` has ``a_dim = num_embeddings``
    entries, so ``A = mean over rows of e_x e_xᵀ = diag(token frequencies)``: diagonal.
    ``G`` is the Linear one over positions (``δ = b·∂L/∂y`` per row). The gradient matrix
    is the weight gradient **transposed**: ``∇W̄`` has shape
    ``(g_dim, a_dim) = (embedding_dim, num_embeddings)``; :meth:`grad_matrix` and
    :meth:`set_grad` transpose. No bias.

    ``A`` is stored as a dense ``a×a`` matrix (the :class:`LayerCurvature` path, so
    exchange, placement, checkpoints and the planner work unchanged): fine for a byte
    vocabulary (256² = 65,536 numbers), wasteful for large ones. A diagonal
    representation would store, reduce and "decompose" ``a`` numbers instead of ``a²``
    (and skip the ``O(a³)`` eigendecomposition: ``Q_A = I``, ``λ_A`` = the frequencies);
    for a 50,257-token vocabulary that is 2.5e9 → 5e4 numbers per factor.
    Reduce (``approx="reduce"``): ``â_i`` is the example's token histogram divided by
    ``T`` (not diagonal: a dense ``A``), ``ĝ_i`` the sum of its ``δ``.
    """

    module: nn.Embedding

    def __init__(self, module: nn.Module, approx: str = "expand") -> None:
        """Take the layer ``module`` with the approximation ``approx``.

        Args:
            module: The layer.
            approx: ``"expand"`` or ``"reduce"`` (layers with positions).
        """
        super().__init__(module, approx)
        self.has_bias = False

    @property
    def weight_cols(self) -> int:
        """Return the columns of the weight matrix (``a_dim`` without bias)."""
        return int(self.module.num_embeddings)

    @property
    def g_dim(self) -> int:
        """Return the dimension of ``G`` (output features)."""
        return int(self.module.embedding_dim)

    def _indices(self, inputs: Tensor) -> Tensor:
        return _detached(inputs).reshape(-1).long()

    def _input_rows(self, inputs: Tensor) -> Tensor:
        dtype = inputs.dtype if inputs.is_floating_point() else self.module.weight.dtype
        return F.one_hot(self._indices(inputs), self.weight_cols).to(dtype)


    def _reduced_inputs(self, inputs: Tensor) -> Tensor:
        x = _detached(inputs).long()
        x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(-1, 1)
        dtype = inputs.dtype if inputs.is_floating_point() else self.module.weight.dtype
        return F.one_hot(x, self.weight_cols).to(dtype).mean(dim=1)

    def a_factor(self, inputs: Tensor, dtype: torch.dtype | None = None,
                 precision: MatmulPrecision = "full") -> Tensor:
        """Return ``A = diag(counts / rows)`` as a dense matrix.

        ``A = diag(counts / rows)`` (expand) as a dense matrix in ``dtype`` (default:
        the weight's dtype); the indices are never cast to floating point. Reduce: the
        histograms' covariance, its GEMM in ``precision``.
        """
        dtype = self.module.weight.dtype if dtype is None else dtype
        idx = self._indices(inputs)
        if self.approx == "reduce":
            rows = self._reduced_inputs(inputs).to(dtype)
            return covariance(rows, precision=precision)
        counts = torch.bincount(idx, minlength=self.weight_cols).to(dtype)
        return torch.diag(counts / max(1, idx.numel()))

    def grad_matrix(self, dtype: torch.dtype | None = None) -> Tensor:
        """``∇W̄ = (∇W)ᵀ``, shape ``(embedding_dim, num_embeddings)``; zeros without ``.grad``."""
        weight = self.module.weight
        out_dtype = weight.dtype if dtype is None else dtype
        wg = weight.grad
        if wg is None:
            return weight.new_zeros(self.g_dim, self.a_dim, dtype=out_dtype)
        if wg.is_sparse:
            raise ValueError("K-FAC needs dense Embedding gradients (sparse=False)")
        return _as(_detached(wg).t(), out_dtype)

    def grad_dot(self, matrix: Tensor) -> Tensor | None:
        """``⟨matrix, (∇W)ᵀ⟩`` in float64 (``None`` without ``.grad``)."""
        wg = self.module.weight.grad
        if wg is None:
            return None
        if wg.is_sparse:
            raise ValueError("K-FAC needs dense Embedding gradients (sparse=False)")
        return inner64(matrix, _as(_detached(wg).t(), matrix.dtype))

    def grad_targets(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``[(weight, matrixᵀ)]``: ``set_grad`` writes ``matrixᵀ`` to ``weight.grad``."""
        if tuple(matrix.shape) != (self.g_dim, self.a_dim):
            raise ValueError(
                f"set_grad expects shape {(self.g_dim, self.a_dim)}, got {tuple(matrix.shape)}"
            )
        return [(self.module.weight, _detached(matrix).t())]

    def grad_blocks(self) -> list[Tensor | None]:
        """``[(∇W)ᵀ]`` (a view; ``None`` without ``.grad``)."""
        wg = self.module.weight.grad
        if wg is not None and wg.is_sparse:
            raise ValueError("K-FAC needs dense Embedding gradients (sparse=False)")
        return [None if wg is None else _detached(wg).t()]

    def grad_layout(self) -> tuple[object, ...]:
        """``g_dim``, ``a_dim``, one block, the weight's dtype (and: transposed)."""
        return (*super().grad_layout(), "transposed")


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a layer that K-FAC could in principle precondition is skipped, else ``None``.

    ``None`` for supported layers (Linear; Conv2d with groups=1 and zero padding; dense
    Embedding) and for
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
    if isinstance(module, nn.EmbeddingBag):
        return f"{name} is not supported (only Embedding)"
    if isinstance(module, nn.Embedding) and module.sparse:
        return f"{name} with sparse=True is not supported (K-FAC needs dense gradients)"
    return None


def curvature_for(module: nn.Module, approx: str = "expand") -> LayerCurvature | None:
    """The curvature handler for a supported layer, ``None`` for anything else."""
    if isinstance(module, nn.Linear):
        return LinearCurvature(module, approx)
    if isinstance(module, nn.Conv2d) and unsupported_reason(module) is None:
        return Conv2dCurvature(module, approx)
    if isinstance(module, nn.Embedding) and unsupported_reason(module) is None:
        return EmbeddingCurvature(module, approx)
    return None


ApproxOption = str | Mapping[str, str]
"""``"expand"``/``"reduce"`` for every layer, or a mapping from module names or class
names (``"Conv2d"``, ``"Linear"``) to one; layers it does not name get ``"expand"``."""


def approx_for(name: str, module: nn.Module, approx: ApproxOption) -> str:
    """Return the approximation ``approx`` selects for the layer ``name``.

    The approximation ``approx`` selects for the layer ``name`` (module name first,
    then class name, else ``"expand"``); raises ``ValueError`` for unknown values.
    """
    if isinstance(approx, str):
        chosen = approx
    else:
        chosen = approx.get(name, approx.get(type(module).__name__, "expand"))
    if chosen not in APPROXIMATIONS:
        raise ValueError(f"approx must be one of {APPROXIMATIONS}, got {chosen!r} for {name!r}")
    return chosen


#: The reason given for layers left out because they share a parameter with another.
TIED = "tied weights: a parameter shared"


def register_layers(model: nn.Module, skip: Sequence[str] = (),
                    approx: ApproxOption = "expand",
                    ) -> tuple[dict[str, LayerCurvature], list[str]]:
    """The layers K-FAC preconditions, by name in model order, and why others are skipped.

    ``skip`` matches module names or class names: each entry is an exact name or a
    regular expression that must match the whole name (``re.fullmatch``), e.g.
    ``"blocks[.][0-9]+[.]attn[.].*"`` or ``"Embedding"``. Unsupported modules (grouped
    convolutions, ...) and frozen layers (weight without grad) are skipped with a reason,
    and so are layers that share a parameter with another layer (tied weights, e.g. a
    language model's embedding and output layer: :data:`TIED`): the shared gradient is
    the sum of both layers' contributions, whose curvature is not one Kronecker product,
    and each layer would overwrite the other's preconditioned gradient; the base
    optimizer updates them as they are. ``approx`` picks expand or reduce per layer
    (:func:`approx_for`). The preconditioner and the planner both use this rule.
    """
    layers: dict[str, LayerCurvature] = {}
    skipped: list[str] = []
    patterns = [_skip_pattern(s) for s in skip]
    for name, module in model.named_modules():
        if any(s == name or s == type(module).__name__
               or (p is not None and (p.fullmatch(name) or p.fullmatch(type(module).__name__)))
               for s, p in zip(skip, patterns)):
            skipped.append(f"{name or '<model>'} ({type(module).__name__}: skip_layers)")
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            skipped.append(f"{name} ({reason})")
            continue
        curv = curvature_for(module, approx_for(name or type(module).__name__, module, approx))
        if curv is None:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or not weight.requires_grad:
            skipped.append(f"{name} (frozen)")
            continue
        layers[name or type(module).__name__] = curv
    sharing: dict[int, list[str]] = {}
    for name, curv in layers.items():
        for param in curv.module.parameters(recurse=False):
            sharing.setdefault(id(param), []).append(name)
    tied = {name: [n for n in names if n != name] for names in sharing.values()
            if len(names) > 1 for name in names}
    for name, others in tied.items():
        del layers[name]
        skipped.append(f"{name} ({TIED} with {', '.join(dict.fromkeys(others))})")
    return layers, skipped


def _skip_pattern(entry: str) -> re.Pattern[str] | None:
    """Compile ``entry`` as a regular expression (``None`` if it is not one).

    ``entry`` compiled as a regular expression (``None`` if it is not one: then it
    only matches exactly).
    """
    try:
        return re.compile(entry)
    except re.error:
        return None
