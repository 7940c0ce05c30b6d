"""Statistics of same-shaped layers as one batched product (the GPU path).

On a GPU the factor statistics of a ResNet-50 step are host-bound: each layer's ``A``
and ``G`` cost a dozen small operator dispatches (casts, views, a copy, a GEMM, the sum),
and the host issues them more slowly than the device runs them. Layers whose rows have
one shape (a ResNet stage's repeated blocks, a transformer's identical projections) are
computed together here: their tensors are held, stacked in one copy, and multiplied in
one batched GEMM (:func:`~kfac_hpc.kfac.linalg.stacked_covariance`); each layer gets its
slice. The numbers are each layer's own, up to the summation order of the product.

When a group is computed is fixed by the pass itself, never by an earlier one, so a
resumed run groups its first step as the uninterrupted run does:

* ``A`` (inputs): held until the pass's first output gradient arrives (backward has
  begun), then every group at once;
* ``G`` (output gradients): the forward registers which layers' gradients to expect
  under each key; a group is computed when the last of them arrives;
* the next forward (after a gradient) first computes everything held and forgets what
  was expected (an output backward never reached);
* when the rows held for one factor would pass :data:`GROUP_ROW_BYTES` (what the stacks
  copy; it also bounds the inputs and gradients kept alive: inputs that activation
  checkpointing would have freed, the gradients of a group that waits for a layer whose
  forward ran twice without a backward between), every group of that factor is
  computed first;
* whatever is still held when the sums are read (:meth:`StatisticsGroups.flush`) is
  computed then.

Only expand statistics with a host-side loss scale stack: of float32/float64 tensors in
their own dtype at operand precision ``"full"`` or ``"tf32"``, and of bf16 (AMP) tensors
as the bf16 rows of float32 factors at ``"tf32"`` (one bf16 product accumulating in
float32, as each layer's path computes them); they stack
(:meth:`~kfac_hpc.kfac.layers.LayerCurvature.stacking`), and not on the devices that
sum long products over chunks of rows (:data:`~kfac_hpc.kfac.linalg.SPLIT_ROWS_DEVICES`,
none: that is one layer's product); everything else takes the layer's own path at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.layers import LayerCurvature, Stacking, keeps_bf16_rows
from kfac_hpc.kfac.linalg import uses_gpu_path
from kfac_hpc.kfac.precision import MatmulPrecision

__all__ = ["GROUP_ROW_BYTES", "MAX_DECISIONS", "STACKED_PRECISIONS", "Group", "StatisticsGroups"]

#: The most bytes of rows held for one factor (``A`` or ``G``) across all groups.
#: ResNet-50 at batch 32 (224x224) computes its 108 factors in 44 products with it (58
#: at 256 MiB, 37 at 1 GiB, 33 unbounded; 108 layer by layer): its first stages' rows
#: (231 MB of patch rows for a stage-1 3x3 layer's ``A``) fill it with few layers.
GROUP_ROW_BYTES = 512 << 20
#: The most stacking decisions kept (by layer, factor and tensor shape); all are dropped
#: when one more would pass it (inputs whose shapes change with every batch, e.g.
#: sequences padded to each batch's longest).
MAX_DECISIONS = 4096
#: The operand precisions whose statistics stack (bf16 ones build bf16 rows per layer).
STACKED_PRECISIONS: frozenset[str] = frozenset({"full", "tf32"})

_WIDE = (torch.float32, torch.float64)


#: ``add(factor, value)`` of one layer's statistics (a LayerStatistics).
Adder = Callable[[str, Tensor], None]


@dataclass
class Group:
    """Tensors of one factor of same-keyed layers, held until they are computed."""

    curvature: LayerCurvature  # the first member's: the key fixes what the rows are
    factor: str  # "A" or "G"
    scale: float = 1.0  # G: the loss scale removed (every member's the same)
    out_dtype: torch.dtype | None = None  # float32 for bf16 rows (AMP)
    adders: list[Adder] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    row_bytes: int = 0


# (work reading these tensors) -> None: where a group's product runs (the capture's stream)
Runner = Callable[[list[Tensor], Callable[[], None]], None]


class StatisticsGroups:
    """Held statistics of one capture, by factor and key (module docstring).

    ``run(reads, work)`` runs a group's product (on the capture's statistics stream);
    ``precision`` is the operand precision of every product.
    """

    def __init__(self, run: Runner, precision: MatmulPrecision) -> None:
        """Hold nothing yet.

        Args:
            run: Runs a group's work, given the tensors it reads.
            precision: The operand precision of the products.
        """
        self._run = run
        self._precision = precision
        self._a: dict[tuple[object, ...], Group] = {}
        self._g: dict[tuple[object, ...], Group] = {}
        self._expected_g: dict[tuple[object, ...], int] = {}  # G arrivals still to come
        self._backward_seen = False  # a gradient arrived since the last forward began
        # how a layer's factor of a tensor stacks, by (layer, factor, shape, dtype,
        # device, factor dtype): decided at the first such tensor (a dozen checks and a
        # key built three times per layer and factor update otherwise)
        self._decisions: dict[tuple[object, ...], Stacking | None] = {}

    @staticmethod
    def _stacks(t: Tensor, dtype: torch.dtype | None, precision: MatmulPrecision) -> bool:
        # a device that sums long products over chunks of rows keeps one product per layer
        if not uses_gpu_path(t.device) or t.device.type in linalg.SPLIT_ROWS_DEVICES:
            return False
        if t.dtype in _WIDE:
            return (dtype is None or dtype == t.dtype) and precision in STACKED_PRECISIONS
        # bf16 (AMP) tensors as the bf16 rows of float32 factors, as each layer's path
        return keeps_bf16_rows(t, dtype, precision) and precision in STACKED_PRECISIONS

    def _stacking(self, curvature: LayerCurvature, factor: str, t: Tensor,
                  dtype: torch.dtype | None) -> Stacking | None:
        """How ``factor``'s statistics of ``t`` stack (``None``: computed by the layer).

        :meth:`_stacks` and :meth:`~kfac_hpc.kfac.layers.LayerCurvature.stacking` depend
        on the layer and on ``t``'s shape, dtype and device only: decided once for each.
        """
        key = (id(curvature), factor, t.shape, t.dtype, t.device, dtype)
        try:
            return self._decisions[key]
        except KeyError:
            how = curvature.stacking(factor, t) if self._stacks(
                t, dtype, self._precision) else None
            if len(self._decisions) >= MAX_DECISIONS:  # shapes that change every pass
                self._decisions.clear()
            self._decisions[key] = how
            return how

    def hold_a(self, curvature: LayerCurvature, add: Adder, inputs: Tensor, output: Tensor,
               dtype: torch.dtype | None) -> bool:
        """Hold a layer's ``A`` input for its group; expect its output's gradient.

        Returns:
            Whether ``A`` is held (else the caller computes it now).
        """
        if self._backward_seen:  # a new forward: the last pass's gradients are all in
            self.flush()
        out = self._stacking(curvature, "G", output, dtype)
        if out is not None:
            self._expected_g[out.key] = self._expected_g.get(out.key, 0) + 1
        how = self._stacking(curvature, "A", inputs, dtype)
        if how is None:
            return False
        self._hold(self._a, "A", how.row_bytes, how.key, curvature, add, inputs, 1.0)
        return True

    def hold_g(self, curvature: LayerCurvature, add: Adder, grad: Tensor,
               dtype: torch.dtype | None, grad_scale: float | Tensor) -> bool:
        """Hold a layer's output gradient for its group (the forward expected it).

        The first gradient of a pass computes every held ``A`` (backward has begun).
        A group is computed when its last expected gradient arrives.

        Returns:
            Whether the gradient is held or computed here (else the caller computes ``G``).
        """
        self._backward_seen = True
        self._compute_all(self._a)
        if isinstance(grad_scale, Tensor):
            return False
        how = self._stacking(curvature, "G", grad, dtype)
        if how is None or self._expected_g.get(how.key, 0) == 0:
            return False
        self._hold(self._g, "G", how.row_bytes, how.key, curvature, add, grad, float(grad_scale))
        self._expected_g[how.key] -= 1
        if self._expected_g[how.key] == 0:
            del self._expected_g[how.key]
            self._compute(self._g, how.key)
        return True

    def flush(self) -> None:
        """Compute everything held (before the sums are read); expect nothing more."""
        self._compute_all(self._a)
        self._compute_all(self._g)
        self.drop()

    def drop(self) -> None:
        """Forget everything held and expected, uncomputed (a discarded step)."""
        self._a.clear()
        self._g.clear()
        self._expected_g.clear()
        self._backward_seen = False

    def _hold(self, groups: dict[tuple[object, ...], Group], factor: str, row_bytes: int,
              key: tuple[object, ...], curvature: LayerCurvature, add: Adder, t: Tensor,
              scale: float) -> None:
        held = sum(group.row_bytes for group in groups.values())
        if held and held + row_bytes > GROUP_ROW_BYTES:
            self._compute_all(groups)
        group = groups.get(key)
        if group is not None and group.scale != scale:
            self._compute(groups, key)
            group = None
        if group is None:
            group = groups[key] = Group(curvature, factor, scale,
                                        torch.float32 if t.dtype == torch.bfloat16 else None)
        group.adders.append(add)
        group.tensors.append(t)
        group.row_bytes += row_bytes

    def _compute_all(self, groups: dict[tuple[object, ...], Group]) -> None:
        for key in list(groups):
            self._compute(groups, key)

    def _compute(self, groups: dict[tuple[object, ...], Group], key: tuple[object, ...]) -> None:
        group = groups.pop(key)

        def work() -> None:
            rows, b = group.curvature.stacked_rows(group.factor, group.tensors)
            root = b / group.scale  # G: δ = b·∂L/∂y / grad_scale, as g_factor applies it
            scale = 1.0 if group.factor == "A" else root * root
            products = linalg.stacked_covariance(rows, scale, precision=self._precision,
                                                 out_dtype=group.out_dtype)
            for i, add in enumerate(group.adders):
                add(group.factor, products[i])

        self._run(group.tensors, work)
