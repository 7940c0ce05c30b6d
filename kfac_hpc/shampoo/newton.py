"""Inverse p-th roots by the coupled inverse Newton iteration, batched by size.

:func:`newton_roots` runs :class:`~kfac_hpc.shampoo.root_methods.NewtonRoots`'
iteration (its docstring has the algorithm, its convergence and iteration counts) on
stacks of matrices of one size, dtype, device and order ``p`` (:class:`NewtonBatch`):
each iteration is one ``torch.add`` and ``2 + ⌈log₂ p⌉``-ish batched GEMMs per stack,
whatever the number of matrices in it. Every ``check_every`` iterations the errors
``‖M − I‖_F`` of every matrix of every stack are read on the host at once (one read):
converged matrices leave their stack (their root is kept), diverging or non-finite ones
are given up, and the rest go on until ``max_iterations``. What is given up is reported
(``converged`` False) for the caller to compute another way
(:func:`kfac_hpc.shampoo.roots.inverse_roots` takes the eigen path for them).

The products run at the dtype's full precision whatever the user's TF32 settings
(:func:`kfac_hpc.kfac.precision.full_precision_products`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kfac_hpc.kfac.precision import full_precision_products
from kfac_hpc.shampoo.errors import nonfinite_marks
from kfac_hpc.shampoo.powers import pow_per_value
from kfac_hpc.shampoo.root_methods import NewtonRoots

__all__ = ["DIVERGENCE_GROWTH", "NewtonBatch", "NewtonOutcome", "NewtonRun", "device_index",
           "newton_roots"]

#: A matrix whose error grew by more than this factor between two checks diverges (in
#: exact arithmetic the error of a PSD matrix only decreases; float rounding moves it by
#: ~1e-7 relative at most, a negative eigenvalue of a matrix indefinite as stored makes
#: it grow without bound).
DIVERGENCE_GROWTH = 1.0 + 1e-3


@dataclass(frozen=True)
class NewtonBatch:
    """Stacked square matrices ``(n, d, d)`` of one dtype and device, and their root.

    Only the lower triangle of each matrix is read (as ``eigh`` does).

    Attributes:
        matrices: The matrices ``F`` (not changed).
        p: The root's order: the result is ``(F + εI)^(-1/p)``.
        epsilons: ``(rows, ε)``: the ε added to the diagonals of ``matrices[rows]``;
            the slices cover every row.
    """

    matrices: Tensor
    p: int
    epsilons: tuple[tuple[slice, float], ...]


@dataclass
class NewtonOutcome:
    """The roots of a :class:`NewtonBatch`.

    Attributes:
        roots: ``(n, d, d)`` in the batch's dtype; a row not ``converged`` is meaningless.
        converged: Per matrix, whether ``‖M − I‖_F <= tolerance`` was reached with finite
            values.
        iterations: Per matrix, the iterations it ran (a multiple of ``check_every``,
            or ``max_iterations``).
    """

    roots: Tensor
    converged: list[bool]
    iterations: list[int]


@dataclass
class NewtonRun:
    """What :func:`newton_roots` computed, and what it cost.

    Attributes:
        outcomes: One per batch, in order.
        host_reads: Reads of device memory on the host (one per check).
        iterations: Iterations run by the longest-running batch.
    """

    outcomes: list[NewtonOutcome] = field(default_factory=list)
    host_reads: int = 0
    iterations: int = 0


class _Iteration:
    """One batch's iteration state: the matrices still iterating, their ``X`` and ``M``."""

    def __init__(self, batch: NewtonBatch) -> None:
        n, d = batch.matrices.shape[0], batch.matrices.shape[-1]
        p = self.p = batch.p
        work = batch.matrices
        if work.dtype not in (torch.float32, torch.float64):
            work = work.to(torch.float32)
        a = work.tril() + work.tril(-1).mT  # symmetric, from the lower triangle
        for rows, epsilon in batch.epsilons:
            a[rows].diagonal(dim1=-2, dim2=-1).add_(epsilon)
        # min(‖A‖_F, ‖A‖_∞) bounds the largest eigenvalue of a symmetric A; scaled by z,
        # every eigenvalue lies in (0, (p+1)/2] ⊂ (0, p+1), where the iteration converges
        bound = torch.minimum(torch.linalg.matrix_norm(a), a.abs().sum(dim=-1).amax(dim=-1))
        z = ((p + 1) / 2) / bound
        z = torch.where(bound.isfinite() & (bound > 0), z, math.nan)  # overflow: give up
        self.m = a * z[:, None, None]
        # X₀ = z^(1/p)·I (each matrix's power its own: kfac_hpc.shampoo.powers)
        self.x = torch.diag_embed(pow_per_value(z, 1.0 / p)[:, None].expand(n, d))
        self.step = torch.eye(d, dtype=a.dtype, device=a.device) * ((p + 1) / p)
        self.out_dtype = batch.matrices.dtype
        self.roots = torch.empty_like(batch.matrices)
        self.active = list(range(n))  # rows of the batch still iterating, in stack order
        self.previous = [math.inf] * n
        self.converged = [False] * n
        self.iterations = [0] * n

    def iterate(self, count: int) -> None:
        """Run ``count`` iterations on every matrix still iterating.

        The products at the dtype's full precision, inside one precision block that holds
        no host read (the block's lock keeps other threads' products waiting).
        """
        with full_precision_products():
            for _ in range(count):
                t = torch.add(self.step, self.m, alpha=-1.0 / self.p)  # ((p+1)·I − M)/p
                self.x = torch.bmm(self.x, t)
                tp = t if self.p == 1 else torch.linalg.matrix_power(t, self.p)
                self.m = torch.bmm(tp, self.m)
        for i in self.active:
            self.iterations[i] += count

    def errors(self) -> Tensor:
        """``‖M − I‖_F`` per active matrix (NaN where ``X`` is not finite), float64."""
        residual = self.m.clone()
        residual.diagonal(dim1=-2, dim2=-1).sub_(1.0)
        errors: Tensor = torch.linalg.matrix_norm(residual)
        return (errors + nonfinite_marks(self.x.flatten(1))).to(torch.float64)

    def settle(self, errors: Sequence[float], tolerance: float, final: bool) -> None:
        """Keep the converged roots, give up the diverging ones, drop both from the stack."""
        keep: list[int] = []
        done: list[int] = []
        for k, (i, error) in enumerate(zip(self.active, errors)):
            if error <= tolerance:  # NaN compares False
                self.converged[i] = True
                done.append(k)
            elif math.isfinite(error) and not final \
                    and error <= self.previous[i] * DIVERGENCE_GROWTH:
                self.previous[i] = error
                keep.append(k)
        if done:
            x = self.x if len(done) == len(self.active) else self.x[self._index(done)]
            rows = self._index([self.active[k] for k in done])
            self.roots.index_copy_(0, rows, ((x + x.mT) / 2).to(self.out_dtype))
        if len(keep) < len(self.active):
            index = self._index(keep)
            self.x, self.m = self.x[index], self.m[index]
            self.active = [self.active[k] for k in keep]

    def _index(self, positions: list[int]) -> Tensor:
        return device_index(positions, self.m.device)

    def outcome(self) -> NewtonOutcome:
        return NewtonOutcome(self.roots, self.converged, self.iterations)


def device_index(rows: list[int], device: torch.device) -> Tensor:
    """``rows`` as an int64 index tensor on ``device``, without a host synchronisation.

    ``torch.tensor(rows, device="cuda")`` copies from pageable memory and waits for the
    copy; from pinned memory the copy is queued (the caching host allocator keeps the
    buffer until it is done).
    """
    index = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def newton_roots(batches: Sequence[NewtonBatch], method: NewtonRoots) -> NewtonRun:
    """Run the coupled inverse Newton iteration on every batch, checking all at once.

    Args:
        batches: Stacks of matrices, each of one size, dtype, device and ``p``.
        method: Iteration limit, tolerance and check interval.

    Returns:
        The roots per batch, which matrices converged, and the host reads and
        iterations it took.
    """
    run = NewtonRun()
    if not batches:
        return run
    with torch.no_grad():
        states = [_Iteration(b) for b in batches]
        while run.iterations < method.max_iterations:
            active = [s for s in states if s.active]
            if not active:
                break
            count = min(method.check_every, method.max_iterations - run.iterations)
            for state in active:
                state.iterate(count)
            run.iterations += count
            # the one host read of this check: every active matrix's error
            errors = torch.cat([s.errors() for s in active]).tolist()
            run.host_reads += 1
            final = run.iterations >= method.max_iterations
            at = 0
            for state in active:
                n = len(state.active)
                state.settle(errors[at:at + n], method.tolerance, final)
                at += n
        run.outcomes = [s.outcome() for s in states]
    return run
