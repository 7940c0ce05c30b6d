"""How a factor is decomposed, sent, kept, stored and used: one object per compute method.

A :class:`Decomposer` owns everything that depends on K-FAC's ``compute_method`` (and
``low_rank``): the parts of a decomposition and their sizes in a message (which the
exchanges and the planner both lay out from :meth:`Decomposer.parts`), computing them
for a set of factors (batched where the method allows), what a rank keeps of a received
message, what preconditions a layer's gradient given its two factors' decompositions
and the damping (a :class:`LayerSolve`, built once and kept by
:class:`~kfac_hpc.kfac.decompositions.Decompositions` until either changes), the form
``state_dict()`` stores and the check that a stored form can be restored.
:func:`make_decomposer` chooses the implementation once:

* :class:`EigenDecomposer` — ``F = Q diag(λ) Qᵀ`` (``eigh``, batched by size; or a
  subspace refresh from the previous eigenbasis, ``eigen_refresh="subspace"``);
* :class:`InverseDecomposer` — the damped inverse ``(F + √γ·I)⁻¹``;
* :class:`LowRankDecomposer` — eigen, except factors with a low-rank cap, which get a
  randomized decomposition (:mod:`kfac_hpc.kfac.lowrank`).

A decomposition that fails (a solver error) is recorded and sent as invalid (zeros,
``valid = 0``): the other ranks must not be left waiting in the broadcast; every rank
raises after the agreement (:func:`kfac_hpc.kfac.agree.raise_failed_decompositions`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import Tensor

from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.exchange import Part, Piece, PieceKey, own_copy
from kfac_hpc.kfac.factor_store import FactorState
from kfac_hpc.kfac.hyperparams import Schedule, positive
from kfac_hpc.kfac.lowrank import (
    LowRankFactor,
    lowrank_solve,
    randomized_eigh,
    sketch_generator,
)
from kfac_hpc.kfac.options import (
    EigenRefresh,
    LowRankRemainder,
    MatmulPrecision,
    low_rank_cap,
)
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.solves import DEFAULT_PLACEMENT, SolvePlacement

log = logging.getLogger("kfac_hpc")

__all__ = ["Decomposer", "EigenDecomposer", "EigenSolve", "Failures", "Held",
           "InverseDecomposer", "InverseSolve", "LayerSolve", "LowRankDecomposer",
           "StackedEigenSolve", "StackedSolve", "make_decomposer", "message_numel"]

Held = dict[str, Tensor]  # a kept decomposition by part name: {"Q", "lambda"}, {"inv"}, ...
Failures = dict[FactorKey, BaseException]


class LayerSolve(Protocol):
    """A layer's preconditioning for fixed decompositions and damping: ``solve(grad)``.

    What does not depend on the gradient is computed when it is built; calling it does
    the gradient's GEMMs and element-wise products only.
    """

    @property
    def nbytes(self) -> int:
        """Bytes it holds beyond the decompositions themselves."""
        ...

    def __call__(self, grad: Tensor) -> Tensor:
        """The preconditioned gradient of ``grad`` (``g_dim x a_dim``)."""
        ...


class StackedSolve(Protocol):
    """The preconditioning of a stack of same-shape layers: ``solve(grads)``.

    Built from the layers' decompositions and the damping; calling it does the
    gradients' batched GEMMs and element-wise products only.
    """

    @property
    def damping(self) -> float:
        """The damping it was built with."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes it holds (its stacked operands: copies of the decompositions)."""
        ...

    def __call__(self, grads: Tensor) -> Tensor:
        """The preconditioned gradients of ``grads`` (``n x g_dim x a_dim``)."""
        ...

    def redamped(self, damping: float) -> StackedSolve:
        """The same stack with another damping (what depends on the damping rebuilt)."""
        ...


@dataclass(frozen=True)
class EigenSolve:
    """:func:`~kfac_hpc.kfac.linalg.precondition_eigen` (four GEMMs) with its operands."""

    qa: Tensor
    la: Tensor
    qg: Tensor
    lg: Tensor
    damping: float
    precision: MatmulPrecision

    nbytes = 0  # the decompositions' own tensors only

    def __call__(self, grad: Tensor) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``."""
        return linalg.precondition_eigen(grad, self.qa, self.la, self.qg, self.lg,
                                         self.damping, self.precision)


@dataclass(frozen=True)
class StackedEigenSolve:
    """:func:`~kfac_hpc.kfac.linalg.precondition_eigen_stacked` with its stacked operands.

    The eigenbases of ``n`` layers of one shape stacked (``qa``: ``n x a x a``, ``qg``:
    ``n x g x g``), their eigenvalues (``la``: ``n x a``, ``lg``: ``n x g``) and the
    denominators ``λ_G λ_Aᵀ + γ`` (``n x g x a``): four batched GEMMs and one division
    per call. :meth:`build` makes the held decompositions views of the stacks, so only
    the denominators are held beyond them.
    """

    qa: Tensor
    la: Tensor
    qg: Tensor
    lg: Tensor
    denominators: Tensor
    damping: float
    precision: MatmulPrecision

    @classmethod
    def build(cls, pairs: Sequence[tuple[Held, Held]], damping: float,
              precision: MatmulPrecision) -> StackedEigenSolve:
        """Stack the full eigendecompositions of ``pairs`` (``(A, G)`` per layer).

        Each held ``Q`` and ``lambda`` of ``pairs`` is replaced by its view of the
        stack (the same values: one copy of the eigenbases is kept, not two).

        Args:
            pairs: Each layer's held decompositions of ``A`` and ``G`` (one shape).
            damping: The damping ``γ``.
            precision: The operand precision of the GEMMs.

        Returns:
            The stacked solve.
        """
        parts = (Part.Q.value, Part.LAMBDA.value)
        qa, la, qg, lg = (torch.stack([pair[side][part] for pair in pairs])
                          for side in (0, 1) for part in parts)
        for i, (a, g) in enumerate(pairs):
            a.update(zip(parts, (qa[i], la[i])))
            g.update(zip(parts, (qg[i], lg[i])))
        return cls(qa, la, qg, lg, linalg.eigen_denominators(lg, la, damping), damping,
                   precision)

    @property
    def nbytes(self) -> int:
        """The denominators (the stacked bases and eigenvalues are the decompositions)."""
        return self.denominators.numel() * self.denominators.element_size()

    def __call__(self, grads: Tensor) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ`` of every layer of the stack."""
        return linalg.precondition_eigen_stacked(grads, self.qa, self.qg, self.denominators,
                                                 self.precision)

    def redamped(self, damping: float) -> StackedEigenSolve:
        """The same bases with the denominators of ``damping``."""
        return StackedEigenSolve(self.qa, self.la, self.qg, self.lg,
                                 linalg.eigen_denominators(self.lg, self.la, damping),
                                 damping, self.precision)


@dataclass(frozen=True)
class InverseSolve:
    """:func:`~kfac_hpc.kfac.linalg.precondition_inverse` (two GEMMs) with its operands."""

    a_inv: Tensor
    g_inv: Tensor
    precision: MatmulPrecision

    nbytes = 0  # the decompositions' own tensors only

    def __call__(self, grad: Tensor) -> Tensor:
        """``(G + √γI)⁻¹ ∇W̄ (A + √γI)⁻¹``."""
        return linalg.precondition_inverse(grad, self.a_inv, self.g_inv, self.precision)


class Decomposer(Protocol):
    """What the preconditioner needs of a compute method (see the module docstring)."""

    #: Whether :meth:`decompose` starts from the decompositions held (a subspace
    #: refresh): after a load, an inverse step must first restore the stored ones.
    reads_previous: bool

    def parts(self, n: int) -> tuple[tuple[Part, int], ...]:
        """The parts of an ``n x n`` factor's decomposition in a message, with sizes."""
        ...

    def held_numel(self, n: int) -> int:
        """Elements a rank keeps of one decomposition (low rank: at its cap)."""
        ...

    def is_approximate(self, n: int) -> bool:
        """Whether an ``n x n`` factor gets an approximate (low-rank) decomposition."""
        ...

    def decompose(self, states: Mapping[FactorKey, FactorState], step: int,
                  previous: Mapping[FactorKey, Held], failures: Failures
                  ) -> dict[PieceKey, Piece]:
        """Every factor of ``states`` decomposed, as message pieces (valid flags included).

        Args:
            states: The factors to decompose (``average is None``: sent as invalid).
            step: The inverse step they belong to (seeds sketches, picks the damping).
            previous: The decompositions held now (a subspace refresh starts from them).
            failures: Where a failed factor's exception is recorded.

        Returns:
            The pieces of :meth:`parts` and ``VALID`` of every factor.
        """
        ...

    def readback(self, key: FactorKey, n: int) -> tuple[PieceKey, ...]:
        """Scalar pieces besides ``VALID`` to read back from a received message."""
        ...

    def keep(self, key: FactorKey, n: int, pieces: Mapping[PieceKey, Tensor],
             scalars: Mapping[PieceKey, float]) -> Held:
        """What a rank keeps of a received valid decomposition (each part its own copy)."""
        ...

    def solve(self, a: Held, g: Held, damping: float) -> LayerSolve:
        """What preconditions a layer's gradient, from its factors' decompositions.

        Args:
            a: The held decomposition of the layer's ``A``.
            g: The held decomposition of its ``G``.
            damping: The damping ``γ``.

        Returns:
            The solve (everything that does not depend on the gradient done).
        """
        ...

    def solve_stack(self, pairs: Sequence[tuple[Held, Held]], damping: float
                    ) -> StackedSolve | None:
        """What preconditions several layers of one shape together, if this method can.

        Args:
            pairs: Each layer's held decompositions ``(A, G)``; the layers share
                ``g_dim``, ``a_dim`` and dtype.
            damping: The damping ``γ``.

        Returns:
            The stacked solve, or ``None`` where these decompositions are not stacked
            (the layers are then preconditioned one by one). Where it stacks parts of
            the decompositions it may replace them in ``pairs`` by views of the stack
            (the same values, held once).
        """
        ...

    def stored(self, held: Held) -> dict[str, Tensor]:
        """A kept decomposition as ``state_dict()`` stores it."""
        ...

    def restorable(self, key: FactorKey, n: int, stored: Mapping[str, Tensor]
                   ) -> dict[PieceKey, Tensor] | None:
        """A stored decomposition as message pieces, or ``None`` when it does not fit."""
        ...


def message_numel(decomposer: Decomposer, n: int) -> int:
    """Elements of one factor's decomposition in a message, its ``VALID`` flag included.

    Args:
        decomposer: The compute method.
        n: The factor's dimension.

    Returns:
        The sum of its parts' sizes plus one.
    """
    return sum(size for _, size in decomposer.parts(n)) + 1


class _Full:
    """What the full (eigen and inverse) decompositions share.

    ``dtype`` and ``device`` of the pieces, zeros for invalid factors, the full kept and stored
    forms.
    """

    def __init__(self, *, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.reads_previous = False

    def parts(self, n: int) -> tuple[tuple[Part, int], ...]:
        raise NotImplementedError

    def is_approximate(self, n: int) -> bool:
        """Full decompositions are exact."""
        return False

    def held_numel(self, n: int) -> int:
        """Elements of the kept parts (the message parts)."""
        return sum(size for _, size in self.parts(n))

    def invalid(self, key: FactorKey, n: int) -> dict[PieceKey, Piece]:
        """Zeros for every piece, ``VALID`` included: a factor without a decomposition."""
        return {PieceKey(key, part): torch.zeros(size, dtype=self.dtype, device=self.device)
                for part, size in (*self.parts(n), (Part.VALID, 1))}

    def decompose(self, states: Mapping[FactorKey, FactorState], step: int,
                  previous: Mapping[FactorKey, Held], failures: Failures
                  ) -> dict[PieceKey, Piece]:
        """See :meth:`Decomposer.decompose`.

        A batched computation that raises as a whole (out of memory stacking a size's
        factors, say) leaves every factor to be decomposed alone: a factor that fails
        then is invalid on its own, and this rank still sends its pieces, so the other
        ranks never wait on it.
        """
        try:
            batched = self._batched(states, previous, step)
        except Exception as exc:  # one by one below, each with its own fallbacks
            log.warning("K-FAC: the batched decompositions of step %d failed (%s: %s); "
                        "decomposing the factors one by one", step, type(exc).__name__, exc)
            batched = {}
        out: dict[PieceKey, Piece] = {}
        for key, state in states.items():
            if state.average is None:  # never saw statistics: invalid, not preconditioned
                out.update(self.invalid(key, state.dim))
                continue
            try:
                result = batched.get(key)
                if isinstance(result, Exception):
                    raise result
                out.update(self._one(key, state.average, step, result))
            except Exception as exc:
                failures[key] = exc
                out.update(self.invalid(key, state.dim))
        return out

    def _batched(self, states: Mapping[FactorKey, FactorState],
                 previous: Mapping[FactorKey, Held], step: int
                 ) -> dict[FactorKey, tuple[Tensor, ...] | Exception]:
        return {}

    def _one(self, key: FactorKey, average: Tensor, step: int,
             batched: tuple[Tensor, ...] | None) -> dict[PieceKey, Piece]:
        raise NotImplementedError

    def readback(self, key: FactorKey, n: int) -> tuple[PieceKey, ...]:
        """Nothing besides ``VALID``."""
        return ()

    def keep(self, key: FactorKey, n: int, pieces: Mapping[PieceKey, Tensor],
             scalars: Mapping[PieceKey, float]) -> Held:
        """Keep a received full decomposition: each part in its own copy.

        Laid out alike whether computed, received or restored.
        """
        return {part.value: own_copy(pieces[PieceKey(key, part)].view(
            (n,) if part is Part.LAMBDA else (n, n))) for part, _ in self.parts(n)}

    def solve_stack(self, pairs: Sequence[tuple[Held, Held]], damping: float
                    ) -> StackedSolve | None:
        """Not stacked (eigen stacks full eigendecompositions, :class:`EigenDecomposer`)."""
        return None

    def stored(self, held: Held) -> dict[str, Tensor]:
        """The kept parts, each in its own bytes.

        A part that is a view of a stack (:class:`StackedEigenSolve`) is copied out, so
        that a saved state holds the bytes of its own factors only.
        """
        return {name: t if t.untyped_storage().nbytes() == t.numel() * t.element_size()
                else t.clone() for name, t in held.items()}

    def restorable(self, key: FactorKey, n: int, stored: Mapping[str, Tensor]
                   ) -> dict[PieceKey, Tensor] | None:
        """The stored parts, flat, when every one is there with its shape."""
        wanted = [part.value for part, _ in self.parts(n)]
        if any(name not in stored for name in wanted):
            return None
        lam = stored.get(Part.LAMBDA.value)
        if (tuple(lam.shape) if lam is not None else (n,)) != (n,) \
                or stored[wanted[0]].shape != (n, n):
            return None
        return {PieceKey(key, Part(name)): self._piece(stored[name]).reshape(-1)
                for name in wanted}

    def _piece(self, value: Tensor) -> Tensor:
        return value.detach().to(device=self.device, dtype=self.dtype, copy=True)


class EigenDecomposer(_Full):
    """``F = Q diag(λ) Qᵀ``, λ clamped at 0.

    ``eigh`` batched by size, or refreshed from the previous eigenbasis (``refresh="subspace"``: two
    GEMMs and a QR).
    """

    def __init__(self, *, dtype: torch.dtype, device: torch.device,
                 precision: MatmulPrecision = "full", refresh: EigenRefresh = "eigh",
                 placement: SolvePlacement = DEFAULT_PLACEMENT) -> None:
        """Decompose into ``dtype`` on ``device``.

        Args:
            dtype: The dtype of decompositions.
            device: Where they live.
            precision: The operand precision of preconditioning's GEMMs.
            refresh: How an eigenbasis is renewed (``"eigh"``, ``"subspace"``).
            placement: Which CUDA batches the host and the device's streams decompose.
        """
        super().__init__(dtype=dtype, device=device)
        self.precision, self.refresh, self.placement = precision, refresh, placement
        self.reads_previous = refresh == "subspace"

    def parts(self, n: int) -> tuple[tuple[Part, int], ...]:
        """``Q`` (``n x n``) and ``λ`` (``n``)."""
        return ((Part.Q, n * n), (Part.LAMBDA, n))

    def _full_keys(self, states: Mapping[FactorKey, FactorState]) -> list[FactorKey]:
        return [key for key, state in states.items() if state.average is not None]

    def _batched(self, states: Mapping[FactorKey, FactorState],
                 previous: Mapping[FactorKey, Held], step: int
                 ) -> dict[FactorKey, tuple[Tensor, ...] | Exception]:
        """Compute the full eigendecompositions of ``states``, batched by size.

        Full eigendecompositions, batched by size
        (:func:`~kfac_hpc.kfac.linalg.eigh_clamped_many`: one solver call, and one host
        sync, per distinct size); with ``refresh="subspace"`` a factor whose previous
        eigenbasis this rank holds is refreshed from it instead
        (:func:`~kfac_hpc.kfac.linalg.refresh_eigenbases`).
        """
        keys = self._full_keys(states)
        bases = {key: previous[key]["Q"] for key in keys
                 if self.refresh == "subspace" and key in previous}
        fresh = [key for key in keys if key not in bases]
        out: dict[FactorKey, tuple[Tensor, ...] | Exception] = dict(zip(
            fresh, linalg.eigh_clamped_many(
                [cast(Tensor, states[key].average) for key in fresh], dtype=self.dtype,
                placement=self.placement)))
        refreshed = list(bases)
        out.update(zip(refreshed, linalg.refresh_eigenbases(
            [cast(Tensor, states[key].average) for key in refreshed],
            [bases[key] for key in refreshed], dtype=self.dtype)))
        return out

    def _one(self, key: FactorKey, average: Tensor, step: int,
             batched: tuple[Tensor, ...] | None) -> dict[PieceKey, Piece]:
        q, lam = batched if batched is not None else linalg.eigh_clamped(average,
                                                                         dtype=self.dtype)
        return {PieceKey(key, Part.Q): q, PieceKey(key, Part.LAMBDA): lam,
                PieceKey(key, Part.VALID): 1.0}

    def solve(self, a: Held, g: Held, damping: float) -> LayerSolve:
        """:class:`EigenSolve` (nothing to compute ahead)."""
        return EigenSolve(a["Q"], a["lambda"], g["Q"], g["lambda"], damping, self.precision)

    def solve_stack(self, pairs: Sequence[tuple[Held, Held]], damping: float
                    ) -> StackedSolve | None:
        """:class:`StackedEigenSolve` of full eigendecompositions of one shape and dtype.

        ``None`` where a decomposition is not a full one (``{"Q", "lambda"}`` with a
        square ``Q``: a low-rank factor) or the layers' shapes or dtypes differ.
        """
        for side in (0, 1):
            helds = [pair[side] for pair in pairs]
            if any(set(held) != {Part.Q.value, Part.LAMBDA.value} for held in helds):
                return None
            forms = {(tuple(held[Part.Q.value].shape), held[Part.Q.value].dtype)
                     for held in helds}
            if len(forms) != 1 or len(set(next(iter(forms))[0])) != 1:
                return None  # shapes or dtypes differ, or Q is not square
        return StackedEigenSolve.build(pairs, damping, self.precision)


class InverseDecomposer(_Full):
    """The damped inverse ``(F + √γ·I)⁻¹`` (``damping`` of the inverse step)."""

    def __init__(self, *, dtype: torch.dtype, device: torch.device, damping: Schedule,
                 precision: MatmulPrecision = "full",
                 placement: SolvePlacement = DEFAULT_PLACEMENT) -> None:
        """Invert into ``dtype`` on ``device``.

        Args:
            dtype: The dtype of decompositions.
            device: Where they live.
            damping: The damping schedule (the inverse step's value is used).
            precision: The operand precision of preconditioning's GEMMs.
            placement: Which CUDA batches the host and the device's streams invert.
        """
        super().__init__(dtype=dtype, device=device)
        self.damping, self.precision, self.placement = damping, precision, placement

    def parts(self, n: int) -> tuple[tuple[Part, int], ...]:
        """The inverse (``n x n``)."""
        return ((Part.INV, n * n),)

    def _batched(self, states: Mapping[FactorKey, FactorState],
                 previous: Mapping[FactorKey, Held], step: int
                 ) -> dict[FactorKey, tuple[Tensor, ...] | Exception]:
        """Invert every factor, batched by size on the GPU path.

        :func:`~kfac_hpc.kfac.linalg.damped_inverse_many`: one Cholesky per distinct
        size, the small CUDA ones on the host beside the device's.
        """
        keys = [key for key, state in states.items() if state.average is not None]
        inverses = linalg.damped_inverse_many(
            [cast(Tensor, states[key].average) for key in keys], self.damping(step),
            dtype=self.dtype, placement=self.placement)
        return {key: inv if isinstance(inv, Exception) else (inv,)
                for key, inv in zip(keys, inverses)}

    def _one(self, key: FactorKey, average: Tensor, step: int,
             batched: tuple[Tensor, ...] | None) -> dict[PieceKey, Piece]:
        inv = batched[0] if batched is not None else linalg.damped_inverse(
            average, self.damping(step), dtype=self.dtype)
        return {PieceKey(key, Part.INV): inv, PieceKey(key, Part.VALID): 1.0}

    def solve(self, a: Held, g: Held, damping: float) -> LayerSolve:
        """:class:`InverseSolve` (the damping is in the inverses already)."""
        return InverseSolve(a["inv"], g["inv"], self.precision)


class LowRankDecomposer(EigenDecomposer):
    """Eigen, with low-rank decompositions of the factors that have a cap.

    Eigen, except that a factor with a cap ``c`` (``dim >= min_dim`` and ``dim >
    low_rank``) keeps its leading eigenpairs from a randomized decomposition plus one
    remainder eigenvalue ``ρ`` (:func:`~kfac_hpc.kfac.lowrank.randomized_eigh`).

    In a message its ``Q`` is ``c x d`` (its columns one after another, so the first
    ``k`` are a prefix), ``λ`` has ``c`` entries (zero-padded), then ``ρ`` and the
    rank ``k`` (read back only with the energy rule; otherwise ``k = c``).
    """

    def __init__(self, *, dtype: torch.dtype, device: torch.device, low_rank: int,
                 min_dim: int, energy: float | None = None,
                 remainder: LowRankRemainder = "mean", precision: MatmulPrecision = "full",
                 refresh: EigenRefresh = "eigh",
                 placement: SolvePlacement = DEFAULT_PLACEMENT) -> None:
        """Decompose into ``dtype`` on ``device``, low rank above the cap.

        Args:
            dtype: The dtype of decompositions.
            device: Where they live.
            low_rank: The most eigenpairs kept of a large factor.
            min_dim: Factors at least this large get the low-rank form.
            energy: Keep the fewest pairs holding this share of the trace, or ``None``.
            remainder: The remainder eigenvalue's rule (``"mean"``, ``"zero"``).
            precision: The operand precision of preconditioning's GEMMs.
            refresh: How full eigenbases are renewed.
            placement: Which CUDA batches of full factors the host and the device's
                streams decompose.
        """
        super().__init__(dtype=dtype, device=device, precision=precision, refresh=refresh,
                         placement=placement)
        self.low_rank, self.min_dim = low_rank, min_dim
        self.energy, self.remainder = energy, remainder

    def cap(self, n: int) -> int | None:
        """The most eigenpairs an ``n x n`` factor keeps (``None``: full eigen)."""
        return low_rank_cap(n, self.low_rank, self.min_dim)

    def is_approximate(self, n: int) -> bool:
        """Whether the factor has a cap."""
        return self.cap(n) is not None

    def parts(self, n: int) -> tuple[tuple[Part, int], ...]:
        """Eigen's parts, or ``Q`` (``c·n``), ``λ`` (``c``), ``ρ``, the rank."""
        cap = self.cap(n)
        if cap is None:
            return super().parts(n)
        return ((Part.Q, cap * n), (Part.LAMBDA, cap), (Part.RHO, 1), (Part.RANK, 1))

    def held_numel(self, n: int) -> int:
        """``Q`` (``n x c``), ``λ`` and ``ρ`` at the cap."""
        cap = self.cap(n)
        return super().held_numel(n) if cap is None else cap * n + cap + 1

    def _full_keys(self, states: Mapping[FactorKey, FactorState]) -> list[FactorKey]:
        return [key for key in super()._full_keys(states) if self.cap(states[key].dim) is None]

    def _one(self, key: FactorKey, average: Tensor, step: int,
             batched: tuple[Tensor, ...] | None) -> dict[PieceKey, Piece]:
        cap = self.cap(average.shape[0])
        if cap is None:
            return super()._one(key, average, step, batched)
        return self._randomized(key, average, step, cap)

    def _randomized(self, key: FactorKey, average: Tensor, step: int,
                    cap: int) -> dict[PieceKey, Piece]:
        """Decompose one factor with a randomized low-rank decomposition.

        Randomized decomposition (sketch seeded by factor and ``step``, so the same on
        any rank), zero-padded to the cap; float64 retry on failure.
        """
        def attempt(factor: Tensor) -> LowRankFactor:
            return randomized_eigh(factor, rank=cap, energy=self.energy,
                                   remainder=self.remainder,
                                   generator=sketch_generator(key.name, step, self.device))

        try:
            low = attempt(average)
        except torch.linalg.LinAlgError:
            low = attempt(average.to(torch.float64))
        k, n = low.rank, low.dim
        q = torch.zeros(cap, n, dtype=self.dtype, device=self.device)
        q[:k] = low.q.t()
        lam = torch.zeros(cap, dtype=self.dtype, device=self.device)
        lam[:k] = low.lam
        return {PieceKey(key, Part.Q): q, PieceKey(key, Part.LAMBDA): lam,
                PieceKey(key, Part.RHO): low.rho.to(self.dtype).reshape(1),
                PieceKey(key, Part.RANK): float(k), PieceKey(key, Part.VALID): 1.0}

    def readback(self, key: FactorKey, n: int) -> tuple[PieceKey, ...]:
        """The rank, when the energy rule chooses it (else it is the cap)."""
        if self.energy is not None and self.cap(n) is not None:
            return (PieceKey(key, Part.RANK),)
        return ()

    def keep(self, key: FactorKey, n: int, pieces: Mapping[PieceKey, Tensor],
             scalars: Mapping[PieceKey, float]) -> Held:
        """Keep a received decomposition; a low-rank one cut to its rank ``k``.

        ``Q`` (``d x k``, column-major: the transpose of a copy of the message's first ``k`` rows),
        ``lambda`` (``k``), ``rho`` (``1``), each in its own allocation.
        """
        cap = self.cap(n)
        if cap is None:
            return super().keep(key, n, pieces, scalars)
        k = round(scalars[PieceKey(key, Part.RANK)]) if self.energy is not None else cap
        return {Part.Q.value: own_copy(pieces[PieceKey(key, Part.Q)].view(cap, n)[:k]).t(),
                Part.LAMBDA.value: own_copy(pieces[PieceKey(key, Part.LAMBDA)][:k]),
                Part.RHO.value: own_copy(pieces[PieceKey(key, Part.RHO)])}

    def solve(self, a: Held, g: Held, damping: float) -> LayerSolve:
        """Precondition a layer exactly for the approximated factors.

        When either factor is low rank, :func:`~kfac_hpc.kfac.lowrank.lowrank_solve`
        (its coefficients, scaled bases and core computed here, once); else eigen's.
        """
        a_dim, g_dim = (int(parts[Part.Q.value].shape[0]) for parts in (a, g))
        if self.cap(a_dim) is None and self.cap(g_dim) is None:
            return super().solve(a, g, damping)
        return lowrank_solve(_low_rank_factor(a), _low_rank_factor(g), damping)

    def stored(self, held: Held) -> dict[str, Tensor]:
        """Low rank: ``{"Q" (d x k), "lambda" (k), "rho" (1), "rank" (1)}``; else eigen's."""
        if Part.RHO.value not in held:
            return super().stored(held)
        parts = dict(held)
        q = parts[Part.Q.value]
        parts[Part.Q.value] = q.contiguous()
        parts[Part.RANK.value] = torch.tensor([q.shape[1]], dtype=torch.int64,
                                              device=self.device)
        return parts

    def restorable(self, key: FactorKey, n: int, stored: Mapping[str, Tensor]
                   ) -> dict[PieceKey, Tensor] | None:
        """Return a stored decomposition as message pieces, low rank padded to the cap.

        The stored ``Q`` (``d x k``, ``1 <= k <= cap``) zero-padded back to the message's ``c x d``.
        Without the energy rule ``k`` must be the cap (a decomposition stored under another
        ``low_rank`` is recomputed: zero columns would pass for eigenvectors).
        """
        cap = self.cap(n)
        if cap is None:
            return super().restorable(key, n, stored)
        if any(part.value not in stored for part in (Part.Q, Part.LAMBDA, Part.RHO)):
            return None
        q = stored[Part.Q.value]
        k = int(q.shape[1]) if q.dim() == 2 else -1
        stored_rank = stored.get(Part.RANK.value)
        if (q.dim() != 2 or q.shape[0] != n or not 1 <= k <= cap
                or (self.energy is None and k != cap)
                or tuple(stored[Part.LAMBDA.value].shape) != (k,)
                or stored[Part.RHO.value].numel() != 1
                or (stored_rank is not None and int(stored_rank.reshape(-1)[0]) != k)):
            return None
        wire_q = torch.zeros(cap, n, dtype=self.dtype, device=self.device)
        wire_q[:k] = self._piece(stored[Part.Q.value]).t()
        lam = torch.zeros(cap, dtype=self.dtype, device=self.device)
        lam[:k] = self._piece(stored[Part.LAMBDA.value])
        return {PieceKey(key, Part.Q): wire_q.reshape(-1), PieceKey(key, Part.LAMBDA): lam,
                PieceKey(key, Part.RHO): self._piece(stored[Part.RHO.value]).reshape(1),
                PieceKey(key, Part.RANK): torch.full((1,), float(k), dtype=self.dtype,
                                                     device=self.device)}


def _low_rank_factor(parts: Mapping[str, Tensor]) -> LowRankFactor:
    """Return a layer's decomposition in the form :func:`lowrank_solve` takes.

    A full one is the low-rank form with ``k = d`` and ``ρ = 0``.
    """
    q, lam = parts[Part.Q.value], parts[Part.LAMBDA.value]
    rho = parts.get(Part.RHO.value)
    return LowRankFactor(q=q, lam=lam, rho=(rho if rho is not None else lam.new_zeros(1)
                                            ).reshape(()), exact=rho is None)


def make_decomposer(*, compute_method: str, low_rank: int | None = None,
                    low_rank_min_dim: int = 0, low_rank_energy: float | None = None,
                    low_rank_remainder: LowRankRemainder = "mean",
                    eigen_refresh: EigenRefresh = "eigh", damping: Schedule | None = None,
                    dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None,
                    precision: MatmulPrecision = "full",
                    placement: SolvePlacement = DEFAULT_PLACEMENT) -> Decomposer:
    """The decomposer of a compute method (the one place that chooses it).

    Args:
        compute_method: ``"eigen"`` or ``"inverse"``.
        low_rank: The most eigenpairs kept of a large factor (eigen only), or ``None``.
        low_rank_min_dim: Factors at least this large get the low-rank form.
        low_rank_energy: Keep the fewest pairs holding this share of the trace.
        low_rank_remainder: The remainder eigenvalue's rule (``"mean"``, ``"zero"``).
        eigen_refresh: How an eigenbasis is renewed (``"eigh"``, ``"subspace"``).
        damping: The damping schedule (the inverse method's decompositions use it).
        dtype: The dtype of decompositions (``inv_dtype``).
        device: Where they live (default: the CPU).
        precision: The operand precision of preconditioning's GEMMs.
        placement: Which CUDA batches the host and the device's streams solve.

    Returns:
        The decomposer (sizes alone need no ``damping`` nor ``device``).
    """
    where = device if device is not None else torch.device("cpu")
    match compute_method, low_rank:
        case "inverse", _:
            return InverseDecomposer(dtype=dtype, device=where, precision=precision,
                                     damping=damping or positive("damping", 0.001),
                                     placement=placement)
        case "eigen", None:
            return EigenDecomposer(dtype=dtype, device=where, precision=precision,
                                   refresh=eigen_refresh,
                                   placement=placement)
        case "eigen", int():
            return LowRankDecomposer(dtype=dtype, device=where, low_rank=low_rank,
                                     min_dim=low_rank_min_dim, energy=low_rank_energy,
                                     remainder=low_rank_remainder, precision=precision,
                                     refresh=eigen_refresh,
                                     placement=placement)
    raise ValueError(f"compute_method must be one of ('eigen', 'inverse'), "
                     f"got {compute_method!r}")
