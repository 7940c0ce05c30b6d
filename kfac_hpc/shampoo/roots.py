"""Inverse p-th roots of symmetric positive semi-definite factors by eigendecomposition.

``inverse_root(F, p, eps) = Q diag((max(λ, 0) + eps)^(-1/p)) Qᵀ`` for ``F = Q diag(λ) Qᵀ``,
i.e. ``(F + eps·I)^(-1/p)`` for a PSD ``F`` (the clamp removes the tiny negative
eigenvalues rounding produces). A failed decomposition (LAPACK/cuSOLVER error or a
non-finite result) is retried in float64; if that fails too
:class:`RootComputationError` is raised and the caller keeps its previous root.

:func:`inverse_roots` does the same for many batches of matrices at once: all the
matrices of one size and dtype go through one batched ``torch.linalg.eigh`` (on a
GPU the eigensolver synchronises with the host once per call, so the number of
synchronisations follows the number of distinct sizes, not of blocks), and the
finiteness of every result is read on the host once (the small CUDA matrices are
decomposed on the host, beside the device's: :mod:`kfac_hpc.solves`). Matrices that
fail there take the one-matrix path (:func:`inverse_root`, float64 retry included), so
results are those of :func:`inverse_root` matrix by matrix: bit for bit on the CPU, where
LAPACK decomposes a batch one matrix at a time; on CUDA torch picks cuSOLVER's routine by
size and batch count (a batched Jacobi solver for many matrices of at most 32 rows), so a
matrix's bits there may depend on the batch it is in, and the GPU tests compare to a
tolerance.

Every result of the eigen path carries the eigenvectors too (the factors' eigenbases,
ascending). With ``method=SubspaceRoots(...)`` a request that carries its factors'
previous bases is computed from one subspace-iteration step of them instead
(:func:`kfac_hpc.kfac.linalg.subspace_step`), batched by size; those whose refreshed
basis leaves more than the method's tolerance of the factor off the diagonal, or whose
result is not finite, take the eigen path with the requests that carry no basis, in
one batch per size after one host read.

With ``method=NewtonRoots(...)`` (:mod:`.root_methods`) :func:`inverse_roots` runs the
coupled inverse Newton iteration instead (:mod:`.newton`), one batched iteration per
(size, dtype, device, p) over all requests; the matrices it does not converge on (and
requests whose ``p`` is not a positive integer) take the eigen path above, so every
root is either Newton's, within its tolerance, or :func:`inverse_root`'s. float32
factors whose ``rank_bound`` is below their size take the eigen path directly: with an
ε below float32's resolution of the factor (1e-12, the default, is) their null
eigenvalues are rounding noise of either sign, the iteration would diverge on the
negative ones and hand them over ~20 iterations later (Shampoo's 1-D blocks before ``d``
steps, and blocks wider than tall at their first root steps).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.kfac.linalg import subspace_step
from kfac_hpc.kfac.precision import full_precision_products, user_setting_matmul
from kfac_hpc.shampoo.errors import nonfinite_marks
from kfac_hpc.shampoo.newton import NewtonBatch, NewtonRun, device_index, newton_roots
from kfac_hpc.shampoo.powers import pow_per_value
from kfac_hpc.shampoo.root_methods import (
    DEFAULT_ROOT_METHOD,
    NewtonRoots,
    RootMethod,
    SubspaceRoots,
)
from kfac_hpc.solves import DEFAULT_PLACEMENT, EighResult, SolvePlacement, eigh_batches

__all__ = ["RootComputationError", "RootRequest", "RootResult", "inverse_root", "inverse_roots",
           "newton_inverse_roots"]


class RootComputationError(RuntimeError):
    """The eigendecomposition failed in the factor's dtype and in float64."""


def _scales(eigenvalues: Tensor, p: float, epsilon: float) -> Tensor:
    """``(max(λ, 0) + ε)^(-1/p)``, each value's bits its own (:mod:`.powers`)."""
    return pow_per_value(eigenvalues.clamp(min=0) + epsilon, -1.0 / p)


def _root_product(eigenvectors: Tensor, scales: Tensor) -> Tensor:
    """``Q diag(s) Qᵀ`` (batched over leading dimensions) at the dtype's full precision.

    Whatever the user's TF32 setting (:func:`~kfac_hpc.kfac.precision.full_precision_products`):
    an inverse root magnifies the directions of the smallest eigenvalues, and TF32 operands
    (10 mantissa bits) would mix them into the largest ones' (a float32 factor of 256 rows
    with eigenvalues from 1e-8 to 1, ε = 1e-12: along its top eigenvector the square
    root's error against float64 was 0.71 with TF32 operands and 1.9e-3 in float32, the
    fourth root's 7.9e-3 and 1.8e-5).
    """
    with full_precision_products():
        return user_setting_matmul(eigenvectors * scales.unsqueeze(-2), eigenvectors.mT)


def _root_from(eigenvalues: Tensor, eigenvectors: Tensor, p: float, epsilon: float) -> Tensor:
    """``Q diag((max(λ, 0) + ε)^(-1/p)) Qᵀ`` (batched over leading dimensions)."""
    return _root_product(eigenvectors, _scales(eigenvalues, p, epsilon))


def _finite(eigenvalues: Tensor, root: Tensor) -> Tensor:
    """Mark per matrix whether both its eigenvalues and its root are finite.

    Non-finite eigenvectors make the root non-finite (the scale is finite and positive),
    a +Inf eigenvalue would not (its scale is 0), so check both.
    """
    return eigenvalues.isfinite().all(dim=-1) & root.isfinite().flatten(-2).all(dim=-1)


def _eigh_root(matrix: Tensor, p: float, epsilon: float) -> tuple[Tensor, Tensor] | None:
    """The root and the eigenvectors of one matrix, or None where ``eigh`` fails."""
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError and backend errors
        return None
    root = _root_from(eigenvalues, eigenvectors, p, epsilon)
    if not bool(_finite(eigenvalues, root)):  # one host read (a failure path or one matrix)
        return None
    return root, eigenvectors


def _root_and_basis(matrix: Tensor, p: float, epsilon: float) -> tuple[Tensor, Tensor]:
    """:func:`inverse_root` and the eigenvectors it came from, both in ``matrix``'s dtype."""
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"inverse_root needs a square matrix, got shape {tuple(matrix.shape)}")
    with torch.autocast(device_type=matrix.device.type, enabled=False):
        found = _eigh_root(matrix, p, epsilon)
        if found is None and matrix.dtype != torch.float64:
            found = _eigh_root(matrix.double(), p, epsilon)
        if found is None:
            raise RootComputationError(
                f"eigendecomposition of a {tuple(matrix.shape)} {matrix.dtype} factor failed "
                "(also in float64)")
        root, basis = found
        return root.to(matrix.dtype), basis.to(matrix.dtype)


def inverse_root(matrix: Tensor, p: float, epsilon: float) -> Tensor:
    """Compute ``(matrix + epsilon·I)^(-1/p)`` of a symmetric PSD matrix, in ``matrix``'s dtype.

    Only the lower triangle is read. Tries ``matrix``'s dtype, then float64.

    Args:
        matrix: A square matrix.
        p: The root's order (the result is the ``-1/p`` power).
        epsilon: Added to the eigenvalues.

    Returns:
        The inverse root, a new matrix.

    Raises:
        ValueError: The matrix is not square.
        RootComputationError: The eigendecomposition failed in both dtypes.
    """
    return _root_and_basis(matrix, p, epsilon)[0]


@dataclass(frozen=True)
class RootRequest:
    """Stacked factors ``(n, d, d)`` whose roots ``(F / correction + εI)^(-1/p)`` are wanted.

    Non-finite entries count as 0 (their statistics are reported failed).

    Attributes:
        factors: The stacked factors.
        correction: They are divided by it (bias correction).
        p: The root's order.
        epsilon: Added to the eigenvalues.
        rank_bound: An upper bound of every factor's rank known from shapes (a sum of
            ``t`` products ``X Xᵀ`` with ``k`` columns has rank at most ``t·k``), or None.
            Below ``d`` a float32 factor skips the Newton iteration (module docstring).
        bases: The factors' previous eigenbases ``(n, d, d)`` (columns in ascending order
            of eigenvalue) to refresh under ``SubspaceRoots``; None: a fresh ``eigh``.
    """

    factors: Tensor
    correction: float
    p: float
    epsilon: float
    rank_bound: int | None = None
    bases: Tensor | None = None


@dataclass(frozen=True)
class RootResult:
    """The roots ``(n, d, d)`` of a request and, per matrix, whether it failed.

    A failed matrix's root (and basis) is meaningless. ``bases``: the eigenbases the
    roots were computed from (ascending; the eigen and subspace paths), None from the
    Newton iteration. ``refreshed``: for a request that carried bases, per matrix,
    whether its refresh was kept (False: recomputed by the eigen path); else None.
    """

    roots: Tensor
    failed: list[bool]
    bases: Tensor | None = None
    refreshed: list[bool] | None = None


def _cat(tensors: list[Tensor]) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _segments(requests: Sequence[RootRequest], key: Callable[[RootRequest], Hashable]
              ) -> list[tuple[slice, list[RootRequest]]]:
    """Consecutive requests with equal ``key``, with the rows they fill once stacked."""
    out: list[tuple[slice, list[RootRequest]]] = []
    row = 0
    for request in requests:
        n = request.factors.shape[0]
        if out and key(out[-1][1][0]) == key(request):
            rows, members = out[-1]
            out[-1] = (slice(rows.start, row + n), [*members, request])
        else:
            out.append((slice(row, row + n), [request]))
        row += n
    return out


def _prepared(requests: Sequence[RootRequest]) -> Tensor:
    """Stack the requests' factors, divided by their corrections, non-finite entries zeroed.

    The eigensolver must not see them; a new tensor.
    """
    pieces = []
    for _, members in _segments(requests, lambda r: r.correction):
        joined = _cat([r.factors for r in members])
        correction = members[0].correction
        pieces.append(joined / correction if correction != 1.0 else joined)
    return torch.nan_to_num(_cat(pieces), nan=0.0, posinf=0.0, neginf=0.0)


def _roots_from(eigenvalues: Tensor, eigenvectors: Tensor, requests: Sequence[RootRequest]
                ) -> Tensor:
    """The roots of stacked matrices from their eigenpairs, with each request's ``p`` and ``ε``."""
    scales = [_scales(eigenvalues[rows], members[0].p, members[0].epsilon)
              for rows, members in _segments(requests, lambda r: (r.p, r.epsilon))]
    return _root_product(eigenvectors, _cat(scales))


class _SizeGroup:
    """The requests of one size, dtype and device: decomposed by one ``eigh``."""

    def __init__(self, requests: list[RootRequest]) -> None:
        self.requests = requests
        self.matrices = _prepared(requests)
        self.roots: Tensor | None = None
        self.bases: Tensor | None = None
        self.marks: Tensor | None = None

    def install(self, decomposed: EighResult) -> None:
        """Compute the roots of every matrix and their finiteness marks from its ``eigh``.

        The marks are 0 where eigenvalues and root are finite, else NaN (on the device);
        none where the eigensolver raised (any matrix failing fails the batch).
        """
        if isinstance(decomposed, Exception):
            return
        eigenvalues, self.bases = decomposed
        self.roots = _roots_from(eigenvalues, self.bases, self.requests)
        self.marks = nonfinite_marks(eigenvalues) + nonfinite_marks(self.roots.flatten(1))

    def results(self, finite: list[bool]) -> list[RootResult]:
        """Return per request its roots and bases, redoing one by one the matrices not ``finite``.

        All of them where the eigensolver raised.
        """
        roots = self.roots if self.roots is not None else torch.empty_like(self.matrices)
        bases = self.bases if self.bases is not None else torch.empty_like(self.matrices)
        failed: set[int] = set()
        out = []
        for rows, (request,) in _segments(self.requests, id):
            for j in range(rows.start, rows.stop):
                if self.roots is not None and finite[j]:
                    continue
                try:
                    root, basis = _root_and_basis(self.matrices[j], request.p, request.epsilon)
                except RootComputationError:
                    failed.add(j)
                    continue
                roots[j].copy_(root)
                bases[j].copy_(basis)
            out.append(RootResult(roots[rows], [j in failed for j in range(rows.start, rows.stop)],
                                  bases[rows]))
        return out


def inverse_roots(requests: Sequence[RootRequest], *,
                  placement: SolvePlacement = DEFAULT_PLACEMENT,
                  method: RootMethod = DEFAULT_ROOT_METHOD) -> list[RootResult]:
    """Compute :func:`inverse_root` of every matrix of every request, batched by size and dtype.

    With :class:`~kfac_hpc.shampoo.root_methods.EigenRoots` (the default): one
    ``torch.linalg.eigh`` per distinct (size, dtype, device) over all requests (those
    of CUDA matrices up to ``placement.host_max_dim`` rows on the host, beside the device's:
    :func:`kfac_hpc.solves.eigh_batches`), one host read for the finiteness of all
    results; matrices that failed (and all those of an eigensolver call that raised) are
    redone one by one. With :class:`~kfac_hpc.shampoo.root_methods.SubspaceRoots`: the
    requests that carry bases refreshed from them, the others (and the refreshed
    matrices that drifted or failed) by the eigen path. With
    :class:`~kfac_hpc.shampoo.root_methods.NewtonRoots`: the coupled Newton iteration
    per (size, dtype, device, p), the matrices it gives up on by the eigen path (module
    docstring).

    Args:
        requests: the batches of factors.
        placement: Which CUDA batches the host and the device's streams decompose.
        method: How the roots are computed.

    Returns:
        One result per request, in order.
    """
    if isinstance(method, NewtonRoots):
        return newton_inverse_roots(requests, method, placement=placement)[0]
    if isinstance(method, SubspaceRoots):
        return _subspace_inverse_roots(requests, method, placement)
    return _eigen_inverse_roots(requests, placement)


def _kinds(requests: Sequence[RootRequest], chosen: Sequence[int]
           ) -> dict[tuple[int, torch.dtype, torch.device], list[int]]:
    """The ``chosen`` requests' positions by (size, dtype, device), in order."""
    by_kind: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for k in chosen:
        f = requests[k].factors
        by_kind.setdefault((f.shape[-1], f.dtype, f.device), []).append(k)
    return by_kind


@dataclass
class _Redo:
    """Rows of a refreshed request that the eigen path recomputes (they drifted or failed)."""

    position: int  # the request's position in the call
    rows: list[int]  # its rows to replace
    request: RootRequest  # their prepared matrices, for the eigen path


def _redo(position: int, matrices: Tensor, kept: list[bool], request: RootRequest
          ) -> _Redo | None:
    """The rows of a request's prepared ``matrices`` not ``kept``, for the eigen path."""
    lost = [j for j, ok in enumerate(kept) if not ok]
    if not lost:
        return None
    return _Redo(position, lost, RootRequest(matrices[device_index(lost, matrices.device)],
                                             1.0, request.p, request.epsilon))


def _finish_on_eigen_path(results: dict[int, RootResult], requests: Sequence[RootRequest],
                          plain: list[int], redos: list[_Redo], placement: SolvePlacement
                          ) -> list[RootResult]:
    """Compute the ``plain`` requests and the ``redos``' rows by the eigen path, in one call.

    Fills ``results`` with the plain requests' results and puts the redone rows in their
    place; returns the results in request order.
    """
    redone = _eigen_inverse_roots([requests[k] for k in plain] + [r.request for r in redos],
                                  placement)
    for k, result in zip(plain, redone):
        results[k] = result
    for redo, result in zip(redos, redone[len(plain):]):
        _replace_rows(results[redo.position], redo.rows, result)
    return [results[k] for k in range(len(requests))]


class _RefreshGroup:
    """Requests of one size, dtype and device that carry bases: one subspace step for all."""

    def __init__(self, requests: list[RootRequest], tolerance: float) -> None:
        self.requests = requests
        self.matrices = _prepared(requests)
        bases = _cat([r.bases for r in requests if r.bases is not None])
        with full_precision_products():
            self.bases, quotients = subspace_step(self.matrices, bases.to(self.matrices.dtype))
        self.roots = _roots_from(quotients, self.bases, requests)
        # ‖F − Q diag(λ) Qᵀ‖²_F = ‖F‖²_F − ‖λ‖² (the norm is orthogonally invariant)
        total = torch.linalg.vector_norm(self.matrices, dim=(-2, -1), dtype=torch.float64)
        kept = torch.linalg.vector_norm(quotients, dim=-1, dtype=torch.float64)
        drifted = (total.square() - kept.square()) > (tolerance * total).square()
        self.marks = (nonfinite_marks(quotients) + nonfinite_marks(self.roots.flatten(1))
                      + torch.where(drifted, torch.nan, 0.0).to(quotients.dtype))

    def results(self, positions: list[int], good: list[bool]
                ) -> list[tuple[RootResult, _Redo | None]]:
        """Per request, its refreshed result and the rows the eigen path must redo.

        Args:
            positions: The requests' positions in the call.
            good: Per matrix of the group, whether its refresh is kept.

        Returns:
            One pair per request, in order.
        """
        out: list[tuple[RootResult, _Redo | None]] = []
        for position, (rows, (request,)) in zip(positions, _segments(self.requests, id)):
            kept = good[rows]
            result = RootResult(self.roots[rows], [False] * len(kept), self.bases[rows], kept)
            out.append((result, _redo(position, self.matrices[rows], kept, request)))
        return out


def _subspace_inverse_roots(requests: Sequence[RootRequest], method: SubspaceRoots,
                            placement: SolvePlacement) -> list[RootResult]:
    """:func:`inverse_roots` under ``SubspaceRoots``: refreshed where bases come, else eigh.

    One host read of every refreshed matrix's mark; then one eigen batch per size for
    the requests without bases and the refreshed matrices that drifted or failed (their
    prepared matrices, so their roots are the eigen path's bit for bit).
    """
    carrying = [k for k, r in enumerate(requests) if r.bases is not None]
    if not carrying:
        return _eigen_inverse_roots(requests, placement)
    plain = [k for k, r in enumerate(requests) if r.bases is None]
    results: dict[int, RootResult] = {}
    redos: list[_Redo] = []
    with torch.autocast(device_type=requests[0].factors.device.type, enabled=False):
        kinds = _kinds(requests, carrying)
        groups = [_RefreshGroup([requests[k] for k in ks], method.tolerance)
                  for ks in kinds.values()]
        good = [mark == 0 for mark in _cat([g.marks for g in groups]).tolist()]  # one read
        at = 0
        for positions, group in zip(kinds.values(), groups):
            n = group.matrices.shape[0]
            for position, (result, redo) in zip(positions,
                                                group.results(positions, good[at:at + n])):
                results[position] = result
                if redo is not None:
                    redos.append(redo)
            at += n
        return _finish_on_eigen_path(results, requests, plain, redos, placement)


def _replace_rows(mine: RootResult, rows: list[int], redone: RootResult) -> None:
    """Put the eigen path's results for ``rows`` of a result in their place.

    The bases too, where the result has them (not Newton's).
    """
    where = device_index(rows, mine.roots.device)
    mine.roots.index_copy_(0, where, redone.roots)
    if mine.bases is not None:
        assert redone.bases is not None  # the eigen path returns bases
        mine.bases.index_copy_(0, where, redone.bases)
    for j, failed in zip(rows, redone.failed):
        mine.failed[j] = failed


def _eigen_inverse_roots(requests: Sequence[RootRequest], placement: SolvePlacement
                         ) -> list[RootResult]:
    """:func:`inverse_roots` by eigendecomposition."""
    by_kind = _kinds(requests, range(len(requests)))
    if not by_kind:
        return []
    with torch.autocast(device_type=requests[0].factors.device.type, enabled=False):
        groups = [_SizeGroup([requests[k] for k in ks]) for ks in by_kind.values()]
        for group, decomposed in zip(groups, eigh_batches([g.matrices for g in groups],
                                                          placement)):
            group.install(decomposed)
        marks = [g.marks for g in groups if g.marks is not None]
        # The one host read of the finiteness of every root (the eigensolver syncs anyway).
        finite = [mark == 0 for mark in _cat(marks).tolist()] if marks else []
        results: list[RootResult | None] = [None] * len(requests)
        at = 0
        for ks, group in zip(by_kind.values(), groups):
            n = group.matrices.shape[0] if group.marks is not None else 0
            for k, result in zip(ks, group.results(finite[at:at + n])):
                results[k] = result
            at += n
    return [r for r in results if r is not None]


def _integral_order(p: float) -> int | None:
    """``p`` as an int when it is a positive integer (Newton's ``T^p``), else None."""
    return int(p) if float(p).is_integer() and p >= 1 else None


def _deficient_float32(request: RootRequest) -> bool:
    """Whether the request's factors are float32 and known to be rank-deficient."""
    bound, f = request.rank_bound, request.factors
    return f.dtype == torch.float32 and bound is not None and bound < f.shape[-1]


def newton_inverse_roots(requests: Sequence[RootRequest], method: NewtonRoots, *,
                         placement: SolvePlacement = DEFAULT_PLACEMENT
                         ) -> tuple[list[RootResult], NewtonRun]:
    """:func:`inverse_roots` by the coupled Newton iteration, with what it cost.

    The requests are grouped by (size, dtype, device, p); each group's matrices
    (divided by their corrections, non-finite entries zeroed, as for the eigen path)
    are one :class:`~kfac_hpc.shampoo.newton.NewtonBatch`. Matrices the iteration gives
    up on, requests with a ``p`` that is not a positive integer and float32 requests
    whose ``rank_bound`` is below their size are computed by the eigen path
    (:func:`inverse_roots`' default, float64 retry included), batched.

    Args:
        requests: The batches of factors.
        method: The iteration's settings.
        placement: Where the eigen path's solves run.

    Returns:
        One result per request, in order; and the iteration's
        :class:`~kfac_hpc.shampoo.newton.NewtonRun` (host reads, iterations, per-matrix
        convergence).
    """
    if not requests:
        return [], NewtonRun()
    by_kind: dict[tuple[int, torch.dtype, torch.device, int], list[int]] = {}
    eigen_only: list[int] = []
    for k, request in enumerate(requests):
        f, order = request.factors, _integral_order(request.p)
        if order is None or f.shape[0] == 0 or _deficient_float32(request):
            eigen_only.append(k)
        else:
            by_kind.setdefault((f.shape[-1], f.dtype, f.device, order), []).append(k)
    results: dict[int, RootResult] = {}
    with torch.autocast(device_type=requests[0].factors.device.type, enabled=False):
        members = [[requests[k] for k in ks] for ks in by_kind.values()]
        matrices = [_prepared(m) for m in members]
        batches = [NewtonBatch(a, order, tuple((rows, group[0].epsilon) for rows, group in
                                               _segments(m, lambda r: r.epsilon)))
                   for a, m, (_, _, _, order) in zip(matrices, members, by_kind)]
        run = newton_roots(batches, method)
        redos: list[_Redo] = []  # what Newton gave up on, for the eigen path
        for ks, a, m, outcome in zip(by_kind.values(), matrices, members, run.outcomes):
            for k, (rows, (request,)) in zip(ks, _segments(m, id)):
                converged = outcome.converged[rows]
                results[k] = RootResult(outcome.roots[rows], [False] * len(converged))
                redo = _redo(k, a[rows], converged, request)
                if redo is not None:
                    redos.append(redo)
        return _finish_on_eigen_path(results, requests, eigen_only, redos, placement), run


