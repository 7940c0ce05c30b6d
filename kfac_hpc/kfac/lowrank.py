"""Low-rank decompositions of Kronecker factors and the preconditioning that uses them.

After Puiu, "Randomized K-FACs" (arXiv 2206.15397): the spectra of exponentially
averaged K-FAC factors decay fast, so the leading ``k`` eigenpairs of a ``d×d`` factor
from a randomized range finder (Halko, Martinsson, Tropp 2011, Alg. 4.4/5.3: Gaussian
sketch, power iterations with re-orthonormalisation, Rayleigh–Ritz) cost ``O(d²k)``
instead of the ``O(d³)`` of a full ``eigh``. Pure tensor functions, no communication.

The approximation (one factor ``F``, ``d×d``, symmetric PSD)::

    F ≈ F̃ = Q Λ Qᵀ + ρ (I − Q Qᵀ)

``Q`` (``d×k``, orthonormal columns) and ``Λ`` (``k``, descending, clamped at 0) are the
leading eigenpairs; the remainder ``ρ ≥ 0`` is the one eigenvalue given to the whole
orthogonal complement: ``remainder="mean"`` (default) uses the mean of the discarded
eigenvalues, ``ρ = (tr F − Σ Λ)/(d − k)``, known exactly from the trace without
computing them (so ``tr F̃ = tr F``); ``remainder="zero"`` drops the tail (``ρ = 0``:
the complement is left to the damping alone).

Preconditioning (:func:`precondition_lowrank`), for ``∇W̄ = X`` (``g×a``), factors
``Ã = Q_A Λ_A Q_Aᵀ + ρ_A P_A`` and ``G̃ = Q_G Λ_G Q_Gᵀ + ρ_G P_G`` (``P = I − QQᵀ``) and
damping ``γ``, computes **exactly** ``V = (Ã ⊗ G̃ + γI)⁻¹ vec(X)`` (column-major vec,
as in :mod:`kfac_hpc.kfac.linalg`). ``[Q_G, Q_G⊥] ⊗ [Q_A, Q_A⊥]`` is an eigenbasis of
``Ã⊗G̃`` whose four blocks have the eigenvalues ``λ_Gi λ_Aj``, ``λ_Gi ρ_A``,
``ρ_G λ_Aj`` and ``ρ_G ρ_A``. With ``s = 1/(ρ_G ρ_A + γ)``,
``u_i = 1/(λ_Gi ρ_A + γ)``, ``v_j = 1/(ρ_G λ_Aj + γ)``, ``W_ij = 1/(λ_Gi λ_Aj + γ)`` and
the projections ``GX = Q_Gᵀ X``, ``XA = X Q_A``, ``C = Q_Gᵀ X Q_A``::

    V = s·X + Q_G [ (u − s) ⊙_rows GX + K Q_Aᵀ ] + [ (v − s) ⊙_cols XA ] Q_Aᵀ
    K_ij = C_ij (W_ij − u_i − v_j + s)

(expand ``X`` into the four projected blocks ``Q_G Q_Gᵀ X Q_A Q_Aᵀ``,
``Q_G Q_Gᵀ X P_A``, ``P_G X Q_A Q_Aᵀ``, ``P_G X P_A``, scale each by its inverse
eigenvalue and collect the terms.) Cost ``O(g·a·(k_G + k_A))`` instead of the
``O(g·a·(g + a))`` of :func:`~kfac_hpc.kfac.linalg.precondition_eigen`. With full rank
(``k = d``, the exact fallback) the projections onto the complements vanish and this
is ``precondition_eigen`` up to rounding.

Everything but the gradient's products depends only on the decompositions and ``γ``:
:func:`lowrank_solve` computes it once (``s``, ``W − u − v + s``, the scaled bases
``Q_G diag(u − s)`` and ``Q_A diag(v − s)``) and returns a solve that a step applies
with GEMMs and products only, in one of four forms by which decompositions are complete
(``k = d``: an empty complement). Two-sided (8 kernels)::

    V = s·X + (Q_G D_u) GX + (X (Q_A D_v) + Q_G K) Q_Aᵀ,   K = C ⊙ (W − u − v + s)

``G`` complete (``Q_G Q_Gᵀ = I``, so ``s·X = Q_G (s·GX)`` and the ``v`` terms cancel;
6 kernels): ``V = Q_G [u ⊙_rows GX + (C ⊙ (W − u 1ᵀ)) Q_Aᵀ]``; ``A`` complete
likewise: ``V = [XA ⊙_cols v + Q_G (C ⊙ (W − 1 vᵀ))] Q_Aᵀ``; both: ``Q_G (C ⊙ W)
Q_Aᵀ`` (5). They equal the formula above in exact arithmetic. In floating point the
complete forms avoid its cancellation of ``s·X`` (``s = 1/γ`` there) against the
complement terms, which cost up to ``1e-3`` relative error in float32 at ``γ = 1e-5``
(now ``≤ 3e-6``; ``tests/test_kfac_lowrank_solves.py``); the two-sided form sums the
same products in another order (GEMM rounding, ``O((k_G + k_A)·ε·s·‖X‖)``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.kfac.precision import user_setting_matmul, user_setting_qr

__all__ = [
    "CompleteASolve",
    "CompleteGSolve",
    "CompleteSolve",
    "LowRankFactor",
    "LowRankSolve",
    "TwoSidedSolve",
    "lowrank_solve",
    "precondition_lowrank",
    "randomized_eigh",
    "sketch_generator",
    "sketches",
]

REMAINDERS = ("mean", "zero")
OVERSAMPLE = 10  # randomized_eigh's defaults (the planner prices the same sketch)
EXACT_FRACTION = 0.5


def sketches(d: int, rank: int, oversample: int = OVERSAMPLE,
             exact_fraction: float = EXACT_FRACTION) -> bool:
    """Say whether :func:`randomized_eigh` sketches a ``d x d`` factor.

    Whether :func:`randomized_eigh` with ``rank`` alone sketches a ``d x d`` factor
    (``False``: its exact ``eigh`` fallback).
    """
    return min(d, rank + oversample) < exact_fraction * d


def sketch_generator(name: str, step: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from a factor's name and the K-FAC step alone.

    A stable hash (BLAKE2b, not Python's salted ``hash``): the sketch of a factor is the
    same whichever rank decomposes it, in every process, so results do not depend on the
    world size or the placement, and a rerun reproduces them.
    """
    digest = hashlib.blake2b(f"{name}@{step}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator


@dataclass(frozen=True)
class LowRankFactor:
    """``F̃ = Q diag(lam) Qᵀ + rho·(I − Q Qᵀ)`` (see the module docstring).

    ``q``: ``(d, k)``; ``lam``: ``(k,)`` descending, ``≥ 0``; ``rho``: 0-dim tensor (on
    the factor's device: reading it needs no host sync); ``exact``: computed by the full
    ``eigh`` fallback rather than the randomized sketch.
    """

    q: Tensor
    lam: Tensor
    rho: Tensor
    exact: bool

    @property
    def dim(self) -> int:
        """Return the factor dimension ``d``."""
        return int(self.q.shape[0])

    @property
    def rank(self) -> int:
        """Return the number ``k`` of kept eigenpairs."""
        return int(self.q.shape[1])

    def dense(self) -> Tensor:
        """``F̃`` as a dense ``d×d`` matrix (tests and error measurements)."""
        q = self.q
        proj = q @ q.t()
        eye = torch.eye(self.dim, dtype=q.dtype, device=q.device)
        return (q * self.lam) @ q.t() + self.rho * (eye - proj)


def _top(evals: Tensor, evecs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of ascending ``(evals, evecs)``, descending."""
    return evals[-k:].flip(0) if k else evals[:0], evecs[:, -k:].flip(1) if k else evecs[:, :0]


def _energy_rank(evals_desc: Tensor, trace: float, energy: float) -> int:
    """Smallest ``k`` with ``Σ_{i<k} λ_i ≥ energy · tr F`` (``len`` if never reached)."""
    if trace <= 0.0:
        return 1
    cum = torch.cumsum(evals_desc.clamp(min=0), 0)
    hit = (cum >= energy * trace).nonzero()
    return int(hit[0, 0]) + 1 if hit.numel() else int(evals_desc.numel())


def _sketched_eigh(F: Tensor, sketch: int, power_iters: int,
                   generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Return ascending Ritz pairs of ``F`` on a randomized range.

    Ascending Ritz pairs of ``F`` on a ``sketch``-column randomized range (Halko et al.
    Alg. 4.4 with QR after every product, then Rayleigh–Ritz).
    """
    d = F.shape[0]
    mm = user_setting_matmul  # may run on the background decompositions' thread
    omega = torch.randn(d, sketch, dtype=F.dtype, device=F.device, generator=generator)
    q = user_setting_qr(mm(F, omega))
    for _ in range(power_iters):
        q = user_setting_qr(mm(F, q))
    b = mm(q.t(), mm(F, q))
    evals, u = torch.linalg.eigh((b + b.t()) / 2)
    return evals, mm(q, u)


def randomized_eigh(
    F: Tensor,
    rank: int | None = None,
    energy: float | None = None,
    *,
    oversample: int = OVERSAMPLE,
    power_iters: int = 2,
    exact_fraction: float = EXACT_FRACTION,
    remainder: str = "mean",
    generator: torch.Generator | None = None,
) -> LowRankFactor:
    """Leading eigenpairs of a symmetric PSD factor ``F`` and the remainder ``ρ``.

    Exactly one of ``rank`` (keep ``k`` pairs) and ``energy`` (keep the fewest pairs whose
    eigenvalues sum to at least ``energy·tr F``, ``0 < energy ≤ 1``) is required; with
    ``energy``, ``rank`` may be given too as the cap (default ``d // 4``): never more
    than ``rank`` pairs are kept, even when they hold less than the energy.

    The sketch has ``k + oversample`` columns and ``power_iters`` power iterations
    (each re-orthonormalised by QR); with ``energy``, ``k`` starts at 32 and doubles
    until the energy is held or the cap is reached (about twice the cost of one sketch
    of the final size). When the sketch would have at least ``exact_fraction·d``
    columns, the exact ``torch.linalg.eigh`` is used instead (``exact`` is then
    ``True``) and truncated the same way. Computed in ``F``'s dtype (float32
    for half inputs); ``generator`` makes the sketch reproducible (identical on every
    rank with the same seed: :func:`sketch_generator`). With ``rank`` alone the rule reads
    nothing back, but the small ``eigh`` of the sketch checks its solver's status, one host
    read on CUDA per factor; the energy rule also reads the trace and the kept sums.
    """
    if F.dim() != 2 or F.shape[0] != F.shape[1]:
        raise ValueError(f"randomized_eigh expects a square matrix, got {tuple(F.shape)}")
    if rank is None and energy is None:
        raise ValueError("give rank or energy (energy may take rank as its cap)")
    if energy is not None and not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    d = int(F.shape[0])
    if rank is not None and not 1 <= rank <= d:
        raise ValueError(f"rank must be in [1, {d}], got {rank}")
    dtype = F.dtype if F.dtype in (torch.float32, torch.float64) else torch.float32
    F = F.to(dtype)
    trace_t = F.diagonal().sum()  # stays on the device: rank alone reads nothing back
    trace = float(trace_t) if energy is not None else 0.0  # the energy rule needs it here
    cap = rank if rank is not None else max(1, d // 4)
    # with energy: sketches of 32, 64, ... pairs (doubling, at most the cap) until the
    # kept eigenvalues hold the energy; with a rank alone: one sketch of that rank
    target = cap if energy is None else min(cap, 32)
    evals = evecs = F.new_empty(0)
    k = cap
    with torch.autocast(device_type=F.device.type, enabled=False):
        exact = False
        while True:
            sketch = min(d, target + oversample)
            if sketch >= exact_fraction * d:
                exact = True
                break
            evals, evecs = _sketched_eigh(F, sketch, power_iters, generator)
            if energy is None:
                k = target
                break
            k = _energy_rank(evals.flip(0), trace, energy)
            if k <= target and float(evals[-k:].sum()) >= energy * trace * (1 - 1e-6):
                break
            if target >= cap:
                k = cap  # the cap binds: the energy is not held by `cap` pairs
                break
            target = min(cap, 2 * target)
        if exact:
            evals, evecs = torch.linalg.eigh(F)
            k = cap if energy is None else min(cap, _energy_rank(evals.flip(0), trace, energy))
        lam, q = _top(evals, evecs, k)
        lam = lam.clamp(min=0.0)
        if remainder == "zero" or k == d:
            rho = lam.new_zeros(())
        else:
            rho = ((trace_t - lam.sum()) / (d - k)).clamp(min=0.0)
    return LowRankFactor(q=q.contiguous(), lam=lam.contiguous(), rho=rho, exact=exact)


def _coefficients(a: LowRankFactor, g: LowRankFactor, damping: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``s``, ``u`` (``k_G``), ``v`` (``k_A``) and ``W`` (``k_G x k_A``) of the module docstring."""
    s = 1.0 / (g.rho * a.rho + damping)
    u = 1.0 / (g.lam * a.rho + damping)
    v = 1.0 / (g.rho * a.lam + damping)
    w = 1.0 / (torch.outer(g.lam, a.lam) + damping)
    return s, u, v, w


def _cast(grad: Tensor, dtype: torch.dtype) -> Tensor:
    return grad if grad.dtype == dtype else grad.to(dtype)


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class TwoSidedSolve:
    """``(Ã ⊗ G̃ + γI)⁻¹`` when both factors have a complement (``k < d``): 8 kernels.

    ``V = s·X + (Q_G D_u) GX + (X (Q_A D_v) + Q_G K) Q_Aᵀ`` with ``K = C ⊙ core``,
    ``core = W − u − v + s``, ``D_u = diag(u − s)``, ``D_v = diag(v − s)`` (module
    docstring). Holds ``Q_G``, ``Q_A`` (the decompositions' own tensors), the scaled bases
    ``Q_G D_u``, ``Q_A D_v``, ``core`` and ``s`` (0-dim, on the device).
    """

    qg: Tensor
    qa: Tensor
    qg_u: Tensor
    qa_v: Tensor
    core: Tensor
    s: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the decompositions (the scaled bases, ``core``, ``s``)."""
        return _nbytes(self.qg_u, self.qa_v, self.core, self.s)

    def __call__(self, grad: Tensor) -> Tensor:
        """``V`` for ``grad`` (``g x a``): four GEMMs, two fused GEMM-adds, two products."""
        with torch.autocast(device_type=grad.device.type, enabled=False):
            x = _cast(grad, self.qa.dtype)
            gx = self.qg.t() @ x  # (k_G, a)
            k = (gx @ self.qa).mul_(self.core)  # K = C ⊙ core  (k_G, k_A)
            t = (x @ self.qa_v).addmm_(self.qg, k)  # (g, k_A)
            out = (x * self.s).addmm_(self.qg_u, gx).addmm_(t, self.qa.t())
        return _cast(out, grad.dtype)


@dataclass(frozen=True)
class CompleteGSolve:
    """``(Ã ⊗ G̃ + γI)⁻¹`` when ``G``'s decomposition is complete (``k_G = g``): 6 kernels.

    ``Q_G Q_Gᵀ = I`` folds ``s·X`` and the ``v`` terms into the ``G`` eigenbasis:
    ``V = Q_G [u ⊙_rows GX + (C ⊙ (W − u 1ᵀ)) Q_Aᵀ]`` (``ρ_G`` drops out). Holds
    ``Q_G``, ``Q_A``, ``u`` (a ``(g, 1)`` column) and ``core = W − u 1ᵀ``.
    """

    qg: Tensor
    qa: Tensor
    u: Tensor
    core: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the decompositions (``u``, ``core``)."""
        return _nbytes(self.u, self.core)

    def __call__(self, grad: Tensor) -> Tensor:
        """``V`` for ``grad`` (``g x a``): three GEMMs, one fused GEMM-add, two products."""
        with torch.autocast(device_type=grad.device.type, enabled=False):
            x = _cast(grad, self.qa.dtype)
            y = self.qg.t() @ x  # (g, a)
            k = (y @ self.qa).mul_(self.core)  # (g, k_A)
            out = self.qg @ (y * self.u).addmm_(k, self.qa.t())
        return _cast(out, grad.dtype)


@dataclass(frozen=True)
class CompleteASolve:
    """``(Ã ⊗ G̃ + γI)⁻¹`` when ``A``'s decomposition is complete (``k_A = a``): 6 kernels.

    The mirror image of :class:`CompleteGSolve`: ``V = (Ã ⊗ G̃ + γI)⁻¹ vec(X)`` is the
    transpose of ``(G̃ ⊗ Ã + γI)⁻¹ vec(Xᵀ)``, whose second factor is the complete one.
    So ``V = [XA ⊙_cols v + Q_G (C ⊙ (W − 1 vᵀ))] Q_Aᵀ`` (``ρ_A`` drops out) is
    :class:`CompleteGSolve` with the roles of the factors swapped, applied to ``Xᵀ``
    and transposed back (views: the same GEMMs and products).
    """

    swapped: CompleteGSolve

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the decompositions (``v``, ``core``)."""
        return self.swapped.nbytes

    def __call__(self, grad: Tensor) -> Tensor:
        """``V`` for ``grad`` (``g x a``): three GEMMs, one fused GEMM-add, two products."""
        return self.swapped(grad.mT).mT


@dataclass(frozen=True)
class CompleteSolve:
    """``(Ã ⊗ G̃ + γI)⁻¹`` when both decompositions are complete: 5 kernels.

    The eigen preconditioner ``V = Q_G (C ⊙ W) Q_Aᵀ`` with ``W`` held.
    """

    qg: Tensor
    qa: Tensor
    w: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the decompositions (``W``)."""
        return _nbytes(self.w)

    def __call__(self, grad: Tensor) -> Tensor:
        """``V`` for ``grad`` (``g x a``): four GEMMs and one product."""
        with torch.autocast(device_type=grad.device.type, enabled=False):
            x = _cast(grad, self.qa.dtype)
            out = self.qg @ ((self.qg.t() @ x @ self.qa).mul_(self.w)) @ self.qa.t()
        return _cast(out, grad.dtype)


LowRankSolve = TwoSidedSolve | CompleteGSolve | CompleteASolve | CompleteSolve


def lowrank_solve(a: LowRankFactor, g: LowRankFactor, damping: float) -> LowRankSolve:
    """Everything of ``(Ã ⊗ G̃ + γI)⁻¹`` that does not depend on the gradient.

    Computed once per pair of decompositions and damping (the preconditioner keeps it
    until either changes); applying it to a gradient is then only its GEMMs and
    products. The form follows which decompositions are complete (``k = d``: no
    complement): :class:`CompleteSolve` (both), :class:`CompleteGSolve`,
    :class:`CompleteASolve` (one), :class:`TwoSidedSolve` (neither). All give
    ``V`` of the module docstring; they differ from its one-shot evaluation only in
    rounding (where the products are scaled and summed).

    Args:
        a: ``A``'s decomposition.
        g: ``G``'s decomposition (same dtype and device).
        damping: ``γ``, finite and ``>= 0`` (``> 0`` where a factor has a complement with
            ``ρ = 0``).

    Returns:
        The solve; call it with a ``g x a`` gradient.

    Raises:
        ValueError: ``damping`` negative or not finite, or 0 with a remainder of 0.
    """
    if damping < 0 or not math.isfinite(damping):
        raise ValueError(f"damping must be finite and >= 0, got {damping}")
    if damping == 0 and any(f.rank < f.dim and bool(f.rho == 0) for f in (a, g)):
        raise ValueError("damping 0 with a remainder rho of 0 (remainder='zero', or a factor "
                         "of rank k exactly) leaves directions of zero curvature: 1/0; give "
                         "damping > 0")
    with torch.autocast(device_type=a.q.device.type, enabled=False):
        s, u, v, w = _coefficients(a, g, damping)
        if g.rank == g.dim and a.rank == a.dim:
            return CompleteSolve(qg=g.q, qa=a.q, w=w)
        if g.rank == g.dim:
            return CompleteGSolve(qg=g.q, qa=a.q, u=u[:, None], core=w - u[:, None])
        if a.rank == a.dim:
            return CompleteASolve(CompleteGSolve(qg=a.q, qa=g.q, u=v[:, None],
                                                 core=(w - v[None, :]).mT))
        return TwoSidedSolve(qg=g.q, qa=a.q, qg_u=g.q * (u - s), qa_v=a.q * (v - s),
                             core=w - u[:, None] - v[None, :] + s, s=s)


def precondition_lowrank(grad: Tensor, a: LowRankFactor, g: LowRankFactor,
                         damping: float) -> Tensor:
    """Precondition exactly for low-rank-plus-remainder factors.

    ``V = (Ã ⊗ G̃ + damping·I)⁻¹ vec(∇W̄)`` exactly, for low-rank-plus-remainder
    factors (formula in the module docstring): :func:`lowrank_solve` applied once.
    ``grad`` is ``(g_dim, a_dim)``; computed in the factors' dtype, returned in
    ``grad``'s.
    """
    if damping < 0 or not math.isfinite(damping):
        raise ValueError(f"damping must be finite and >= 0, got {damping}")
    if tuple(grad.shape) != (g.dim, a.dim):
        raise ValueError(f"grad shape {tuple(grad.shape)} != {(g.dim, a.dim)}")
    return lowrank_solve(a, g, damping)(grad)
