"""Pure tensor functions for K-FAC: factor statistics, decompositions, preconditioning.

Conventions (see docs/design.md, "kfac — the math contract"):

* A gradient matrix ``∇W̄`` has shape ``(g_dim, a_dim)`` (bias folded in as the last
  column); ``A`` is ``(a_dim, a_dim)``, ``G`` is ``(g_dim, g_dim)``.
* ``vec`` is column-major, so ``(A ⊗ G) vec(X) = vec(G X Aᵀ)``.
* Matrix products here run with autocast disabled, so a caller inside
  ``torch.autocast`` still gets the precision of the tensors it passes in.
* Nothing here communicates or synchronises on its own, except where a
  decomposition failure must be detected (``eigh_clamped``, ``damped_inverse``) and
  the single ``.item()`` in ``kl_clip_scale``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from kfac_hpc.kfac.precision import (
    MatmulPrecision,
    matmul,
    tf32_products,
    user_setting_matmul,
    user_setting_qr,
)
from kfac_hpc.solves import DEFAULT_PLACEMENT, SolvePlacement, Solver, solve_batches, symmetric_eigh

__all__ = [
    "column_covariance",
    "covariance",
    "damped_inverse",
    "damped_inverse_many",
    "default_gram_blocks",
    "eigen_denominators",
    "eigh_clamped",
    "eigh_clamped_many",
    "inner64",
    "kl_clip_factor",
    "kl_clip_from_inner",
    "kl_clip_scale",
    "mirror_upper",
    "precondition_eigen",
    "precondition_eigen_stacked",
    "precondition_inverse",
    "refresh_eigenbases",
    "scale_in_place",
    "split_gram",
    "splits_rows",
    "stacked_covariance",
    "subspace_step",
    "symmetric_gram_",
    "update_running_average",
    "update_running_averages",
    "uses_gpu_path",
]

_LINALG_DTYPES = (torch.float32, torch.float64)
_R = TypeVar("_R")  # a per-factor result of _solve_each


def _no_autocast(t: Tensor) -> contextlib.AbstractContextManager[None]:
    """Return a context that disables autocast for ``t``'s device type.

    A context that disables autocast for ``t``'s device type (a no-op context when
    autocast is off there: entering ``torch.autocast`` costs more than a small op).
    """
    device = t.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type without autocast support: disable it anyway
        enabled = True
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, enabled=False)


def _linalg_dtype(t: Tensor) -> torch.dtype:
    """``t``'s dtype if LAPACK/cuSOLVER support it, else float32 (fp16/bf16 inputs)."""
    return t.dtype if t.dtype in _LINALG_DTYPES else torch.float32


def uses_gpu_path(device: torch.device) -> bool:
    """Say whether statistics on ``device`` take the GPU path.

    Each factor one large GEMM (few kernels; a GPU pays every launch) instead of the CPU-tuned paths
    (symmetric block updates, per-sample partial sums, chunked patch rows) that save flops and
    memory traffic on a few CPU cores. Every device but the CPU takes it (docs/design.md, "GPU
    paths").
    """
    return device.type != "cpu"


#: Device types whose statistics of few columns and many rows are summed over chunks of
#: rows (:func:`splits_rows`): none. A small ``d×d`` product of a long contraction is few
#: output tiles, which may leave most of a GPU idle unless the GEMM library splits the
#: contraction itself; on an H200 it did not pay (``gpu_profile.py --kinds split-rows``:
#: ``f`` 56.2 against 56.6 ms; ``benchmarks/gram_layouts.py``' split-K column, ResNet-50's
#: TF32 products 11.20 against 9.81 ms; benchmarks/RESULTS.md, GPU, fourth session).
SPLIT_ROWS_DEVICES: frozenset[str] = frozenset()
#: Rows per chunk of :func:`split_gram`.
SPLIT_ROWS = 4096
#: :func:`splits_rows`: at most this many columns ...
SPLIT_ROWS_MAX_DIM = 1152
#: ... and at least this many rows (four chunks).
SPLIT_ROWS_MIN_ROWS = 4 * SPLIT_ROWS


def splits_rows(rows: Tensor) -> bool:
    """Say whether :func:`covariance` sums ``rows``' product over chunks of rows.

    On the devices of :data:`SPLIT_ROWS_DEVICES`, for float32 or float64 ``(n, d)`` rows
    with ``d`` at most :data:`SPLIT_ROWS_MAX_DIM` and ``n`` at least
    :data:`SPLIT_ROWS_MIN_ROWS`, laid out row-major or column-major (the layouts whose
    chunks are views). :func:`covariance` asks it on its float32/float64 product path
    only (bf16 operands keep one product).

    Args:
        rows: The ``(n, d)`` rows.
    """
    n, d = rows.shape
    return (rows.device.type in SPLIT_ROWS_DEVICES and rows.dtype in _LINALG_DTYPES
            and d <= SPLIT_ROWS_MAX_DIM and n >= SPLIT_ROWS_MIN_ROWS
            and (rows.is_contiguous() or rows.t().is_contiguous()))


def split_gram(rows: Tensor, alpha: float = 1.0) -> Tensor:
    """``alpha · rowsᵀ rows`` summed over chunks of :data:`SPLIT_ROWS` rows.

    One batched product of the chunks, views of ``rows`` in its layout (row-major
    ``(n, d)``, or column-major: ``rows.t()`` contiguous), a sum over the chunks, and the
    remainder's product added: three kernels whatever ``n``, ``alpha`` applied inside
    the products. Equals ``alpha · rows.t() @ rows`` up to the summation order.

    Args:
        rows: ``(n, d)`` rows, row-major or column-major, at least one chunk of them.
        alpha: The scale of the product.

    Returns:
        The ``(d, d)`` product, in ``rows``' dtype.
    """
    n, d = rows.shape
    count = n // SPLIT_ROWS
    head = count * SPLIT_ROWS
    if rows.is_contiguous():
        chunks = rows[:head].view(count, SPLIT_ROWS, d).mT  # (count, d, SPLIT_ROWS)
    else:
        chunks = rows.t()[:, :head].view(d, count, SPLIT_ROWS).transpose(0, 1)
    # beta=0: the input is ignored, so an uninitialised scalar costs no fill
    total = torch.baddbmm(rows.new_empty(()), chunks, chunks.mT, beta=0, alpha=alpha).sum(0)
    tail = rows[head:]
    if tail.shape[0]:
        total.addmm_(tail.t(), tail, alpha=alpha)
    return total


def covariance(rows: Tensor, scale: float = 1.0, *,
               precision: MatmulPrecision = "full",
               out_dtype: torch.dtype | None = None) -> Tensor:
    """``scale · rowsᵀ rows / n_rows`` for ``rows`` of shape ``(n_rows, d)``, in ``rows``' dtype.

    On the CPU the result is exactly symmetric: from ``d ≥ 64`` columns and ``n ≥ 2d``
    rows in float32/float64 at full precision only the upper triangle is computed
    (:func:`symmetric_gram_`) and mirrored; otherwise one full product, scaled by
    ``scale/(2n)`` inside the GEMM (full precision) or after it, is symmetrised as
    ``M + Mᵀ`` (a blocked GEMM does not guarantee bitwise symmetry). On the GPU path
    (:func:`uses_gpu_path`) the product is returned as the GEMM made it, symmetric to
    rounding: ``M + Mᵀ`` reads ``Mᵀ`` uncoalesced (7 ms per ResNet-50 factor update on
    an H200, as much as the statistics' GEMMs), and nothing downstream needs bitwise
    symmetry: the solvers read one triangle (``eigh`` and Cholesky the lower), packing
    the upper, and every rank receives the same reduced sums. There, rows of few columns
    and many rows may be summed over chunks (:func:`splits_rows`, :func:`split_gram`;
    on no device yet). ``precision`` rounds float32
    operands to TF32 or bf16 (:mod:`kfac_hpc.kfac.precision`). ``scale`` (e.g. ``b²``
    for ``δ = b·∂L/∂y``) is applied to the small result, never to the rows; with
    power-of-two ``scale`` and ``n_rows`` the result is bitwise that of scaling the
    rows. Raises ``ValueError`` for zero rows.

    ``out_dtype`` (float32, for bf16 ``rows`` on the GPU path): the product of the bf16
    rows accumulated and returned in float32 (``torch.mm(..., out_dtype=)`` on CUDA:
    bf16 tensor cores, half the bytes read). bf16 values are exact in float32 and so are
    their products, so this is the float32 product of the widened rows up to the
    summation order. Elsewhere the rows are widened first.
    """
    if rows.dim() != 2:
        raise ValueError(f"covariance expects a 2-D (rows, dim) tensor, got {tuple(rows.shape)}")
    n = rows.shape[0]
    if n == 0:
        raise ValueError("covariance of zero rows is undefined")
    d = rows.shape[1]
    if out_dtype is not None and out_dtype != rows.dtype:
        if rows.device.type == "cuda" and uses_gpu_path(rows.device) \
                and rows.dtype == torch.bfloat16 and out_dtype == torch.float32:
            with _no_autocast(rows):
                return torch.mm(rows.t(), rows, out_dtype=out_dtype).mul_(scale / n)
        rows = rows.to(out_dtype)
    with _no_autocast(rows):
        if (precision == "full" and not uses_gpu_path(rows.device) and d >= _SYMMETRIC_MIN_DIM
                and n >= 2 * d and rows.dtype in _LINALG_DTYPES):
            # upper triangle only: ≈ 2/3 of the flops, 1.2-1.5x faster once the product
            # is compute-bound (n ≥ 2d); with fewer rows the extra passes over d×d lose
            acc = rows.new_zeros(d, d)
            symmetric_gram_(acc, rows, default_gram_blocks(d))
            full = mirror_upper(acc).div_(n)
            return full if scale == 1.0 else full.mul_(scale)
        gpu = uses_gpu_path(rows.device)
        alpha = scale / n if gpu else 0.5 * scale / n
        cuda_tf32 = precision == "tf32" and rows.device.type == "cuda"
        if precision == "full" or rows.dtype != torch.float32 or cuda_tf32:
            # the scaling in the GEMM's epilogue (alpha·acc rounded once, as a separate
            # multiply of the same accumulator would be, without its pass over d×d);
            # beta=0: the input is ignored, so an uninitialised scalar costs no fill
            with tf32_products() if cuda_tf32 else contextlib.nullcontext():
                if gpu and splits_rows(rows):
                    m = split_gram(rows, alpha)
                else:
                    m = torch.addmm(rows.new_empty(()), rows.t(), rows, beta=0, alpha=alpha)
        else:
            m = matmul(rows.t(), rows, precision).mul_(alpha)
        return m if gpu else torch.add(m, m.t())


def stacked_covariance(rows: Tensor, scale: float = 1.0, *,
                       precision: MatmulPrecision = "full",
                       out_dtype: torch.dtype | None = None) -> Tensor:
    """``scale · rows[l]ᵀ rows[l] / n`` for each of ``L`` layers' ``(n, d)`` rows at once.

    The GPU path of :func:`covariance` for layers whose rows have the same shape
    (:mod:`kfac_hpc.kfac.statistics_groups`): one batched product instead of one per
    layer, ``scale/n`` applied inside it, the result returned as the GEMM made it
    (symmetric to rounding, as :func:`covariance`'s GPU path). Each layer's result equals
    :func:`covariance` of its rows on the GPU path up to the summation order.

    Args:
        rows: ``(L, n, d)``; each layer's rows row-major, or column-major (``rows.mT``
            contiguous), the layouts :func:`covariance` takes.
        scale: The scale of every product (e.g. ``b²`` for ``δ = b·∂L/∂y``).
        precision: The operand precision (:mod:`kfac_hpc.kfac.precision`).
        out_dtype: float32 for bf16 ``rows``: accumulated and returned in float32 (on
            CUDA one bf16 batched GEMM), as :func:`covariance`'s ``out_dtype``.

    Returns:
        The ``(L, d, d)`` products, in ``rows``' dtype (``out_dtype`` if given).
    """
    if rows.dim() != 3 or rows.shape[1] == 0:
        raise ValueError(f"stacked_covariance expects (layers, rows, dim) with rows > 0, got "
                         f"{tuple(rows.shape)}")
    alpha = scale / rows.shape[1]
    if out_dtype is not None and out_dtype != rows.dtype:
        if rows.device.type == "cuda" and rows.dtype == torch.bfloat16 \
                and out_dtype == torch.float32:
            with _no_autocast(rows):
                return torch.bmm(rows.mT, rows, out_dtype=out_dtype).mul_(alpha)
        rows = rows.to(out_dtype)
    cuda_tf32 = precision == "tf32" and rows.device.type == "cuda"
    with _no_autocast(rows):
        if precision == "full" or rows.dtype != torch.float32 or cuda_tf32:
            with tf32_products() if cuda_tf32 else contextlib.nullcontext():
                # beta=0: the input is ignored, so an uninitialised scalar costs no fill
                return torch.baddbmm(rows.new_empty(()), rows.mT, rows, beta=0, alpha=alpha)
        return matmul(rows.mT, rows, precision).mul_(alpha)


_SYMMETRIC_MIN_DIM = 64


def default_gram_blocks(d: int) -> int:
    """Return the block rows of :func:`symmetric_gram_` for ``d`` columns.

    3 up to ~400 columns, 4 up to ~1000, 8 above; below 64 one GEMM is as fast as any split.
    """
    return 1 if d < _SYMMETRIC_MIN_DIM else 3 if d < 400 else 4 if d < 1000 else 8


def symmetric_gram_(out: Tensor, rows: Tensor, blocks: int) -> Tensor:
    """``out += rowsᵀ rows`` on the **upper triangle** only (a symmetric rank-k update).

    ``rows`` is ``(n, d)``; ``out`` a ``(d, d)`` accumulator. The ``d`` columns are cut
    into ``blocks`` block rows; block row ``[a, b)`` gets ``rows[:, a:b]ᵀ rows[:, a:]``
    (``(m+1)/(2m)`` of the full product's flops for ``m`` blocks). Entries below the
    diagonal blocks are left untouched: :func:`mirror_upper` completes the matrix.
    """
    d = rows.shape[1]
    blocks = max(1, min(blocks, d))
    edges = [round(k * d / blocks) for k in range(blocks + 1)]
    for a, b in itertools.pairwise(edges):
        out[a:b, a:].addmm_(rows[:, a:b].t(), rows[:, a:])
    return out


def mirror_upper(m: Tensor) -> Tensor:
    """Return the symmetric matrix whose upper triangle is ``m``'s.

    Exactly symmetric (a new tensor).
    """
    return m.triu() + m.triu(1).t()


def column_covariance(blocks: Tensor, *, append_one: bool = False) -> Tensor:
    """:func:`covariance` of the rows that are the columns of ``blocks`` ``(b, d, t)``.

    Equals ``covariance(blocks.transpose(1, 2).reshape(b*t, d))`` (with a column of
    ones appended when ``append_one``: the bias column, whose sums come analytically)
    without the transposed copy: one batched product and a sum over ``b``. It pays
    ``b·d²`` of partial sums instead of the ``b·t·d`` copy, so it is the cheaper path
    when ``d < t`` (a convolution with many output positions).
    """
    if blocks.dim() != 3:
        raise ValueError(f"column_covariance expects (b, d, t) blocks, got {tuple(blocks.shape)}")
    b, d, t = blocks.shape
    n = b * t
    if n == 0:
        raise ValueError("covariance of zero rows is undefined")
    with _no_autocast(blocks):
        m = torch.bmm(blocks, blocks.transpose(1, 2)).sum(0)
        if append_one:
            sums = blocks.sum(dim=(0, 2))
            full = m.new_empty(d + 1, d + 1)
            full[:d, :d] = m
            full[:d, d] = sums
            full[d, :d] = sums
            full[d, d] = n
            m = full
        m.div_(n)
    return _symmetrised(m)


def _symmetrised(m: Tensor) -> Tensor:
    """``(M + Mᵀ)/2`` (a new tensor): exactly symmetric (lossless upper-triangle packing).

    One pass reading ``Mᵀ`` strided, not a transposed copy first (same values).
    """
    return torch.add(m, m.t()).mul_(0.5)


def update_running_average(current: Tensor | None, batch: Tensor, decay: float) -> Tensor:
    """Exponential running average of a factor.

    The first update (``current is None``) returns a copy of ``batch`` (never an
    alias, so later in-place updates cannot modify the caller's batch tensor). Later
    updates compute ``current ← decay·current + (1-decay)·batch`` **in place** on
    ``current`` (keeping its dtype) and return it.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"factor decay must be in [0, 1], got {decay}")
    if current is None:
        return batch.detach().clone()
    if current.shape != batch.shape:
        raise ValueError(
            f"running average shape {tuple(current.shape)} != batch shape {tuple(batch.shape)}"
        )
    return current.mul_(decay).add_(batch, alpha=1.0 - decay)


def update_running_averages(currents: list[Tensor], batches: list[Tensor],
                            decay: float) -> None:
    """Apply :func:`update_running_average` to many factors at once, in place.

    Two multi-tensor kernels for all of them (``torch._foreach_*``), the same numbers as one call
    each. Every ``currents[i]`` must exist and have ``batches[i]``'s shape.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"factor decay must be in [0, 1], got {decay}")
    for current, batch in zip(currents, batches, strict=True):
        if current.shape != batch.shape:
            raise ValueError(f"running average shape {tuple(current.shape)} != batch shape "
                             f"{tuple(batch.shape)}")
    if currents:
        torch._foreach_mul_(currents, decay)
        torch._foreach_add_(currents, batches, alpha=1.0 - decay)


def eigh_clamped(F: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Eigendecomposition ``F = Q diag(λ) Qᵀ`` of a symmetric factor, λ clamped at 0.

    Computed in ``F``'s dtype (float32 for fp16/bf16 inputs); if that raises
    ``torch.linalg.LinAlgError`` (non-convergence), it is retried in float64, and then
    on ``F + s·I`` in float64 with ``s = 1e-9·max|diag F|`` (λ shifted back by ``s``):
    LAPACK's divide and conquer can fail on factors with rows that are exactly zero,
    e.g. a 3x3 convolution's ``A`` on 1x1 feature maps, where the zero padding is most
    of every patch (seen with MKL, in float32 and float64). Only the lower triangle of
    ``F`` is read. Returns ``(Q, λ)`` cast to ``dtype``, with λ in ascending order.
    """
    try:
        evals, evecs = torch.linalg.eigh(F.to(_linalg_dtype(F)))
    except torch.linalg.LinAlgError:
        f64 = F.to(torch.float64)
        try:
            evals, evecs = torch.linalg.eigh(f64)
        except torch.linalg.LinAlgError:
            shift = f64.diagonal().abs().amax() * 1e-9
            shifted = f64.clone()
            shifted.diagonal().add_(shift)
            evals, evecs = torch.linalg.eigh(shifted)
            evals = evals - shift
    return evecs.to(dtype), evals.clamp(min=0.0).to(dtype)


def _same_kind(tensors: list[Tensor]) -> list[list[int]]:
    """Group the indices of ``tensors`` by shape and dtype.

    The batches of one solver call each.
    """
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((tuple(t.shape), t.dtype), []).append(i)
    return list(groups.values())


def eigh_clamped_many(factors: list[Tensor], dtype: torch.dtype = torch.float32, *,
                      placement: SolvePlacement = DEFAULT_PLACEMENT
                      ) -> list[tuple[Tensor, Tensor] | Exception]:
    """:func:`eigh_clamped` of every factor, one batched ``eigh`` per size.

    A solver call reads its error flags back to the host (a device sync on a GPU), so
    on the GPU path (:func:`uses_gpu_path`) factors of the same size and dtype go to
    ``torch.linalg.eigh`` together: the syncs (and launches) grow with the number of
    distinct sizes, not of factors (cuSOLVER may pick its batched Jacobi solver for
    batches of matrices up to 32x32: equal to rounding); the batches of CUDA factors of
    at most ``placement.host_max_dim`` rows are decomposed on the host meanwhile
    (:func:`kfac_hpc.solves.solve_batches`). On the CPU, where a call costs
    no sync, every factor is solved alone as before: a matrix inside a stacked batch
    sits at another alignment, which BLAS libraries that choose kernels by alignment
    (MKL) could answer with other bits, and the world-size invariance is bitwise.
    If a batch fails, its factors are decomposed one by one
    (each with :func:`eigh_clamped`'s float64 retry); a factor that still fails gets its
    exception in its place of the result, so one bad factor never hides the others.

    Args:
        factors: Symmetric factors (only their lower triangles are read).
        dtype: The dtype of the results.
        placement: Which CUDA batches the host and the device's streams solve.

    Returns:
        Per factor, ``(Q, λ)`` or the exception its decomposition raised.
    """
    def split(result: tuple[Tensor, ...], _: Tensor) -> list[tuple[Tensor, Tensor]]:
        evals, evecs = result
        q, lam = evecs.to(dtype), evals.clamp(min=0.0).to(dtype)
        return list(zip(q.unbind(), lam.unbind()))

    return _solve_each(factors, lambda stack: stack.to(_linalg_dtype(stack)), symmetric_eigh,
                       split, lambda f: eigh_clamped(f, dtype), placement)


def _solve_each(factors: list[Tensor], prepare: Callable[[Tensor], Tensor], solve: Solver,
                split: Callable[[tuple[Tensor, ...], Tensor], list[_R]],
                one: Callable[[Tensor], _R], placement: SolvePlacement
                ) -> list[_R | Exception]:
    """Solve every factor: one batched call per size and dtype on the GPU path.

    On the GPU path the factors of one size and dtype are stacked, ``prepare``d and
    solved together (:func:`kfac_hpc.solves.solve_batches`: the small CUDA ones on the
    host meanwhile) and ``split`` into per-factor results (given the result and one
    member). Every factor not solved that way (the CPU path, a batch whose solver
    raised) gets ``one(factor)`` (with its own fallbacks); an exception it raises takes
    the factor's place.
    """
    out: dict[int, _R | Exception] = {}
    batched = [members for members in _same_kind(factors)
               if uses_gpu_path(factors[members[0]].device)]
    stacks = [prepare(torch.stack([factors[i] for i in members])) for members in batched]
    for members, result in zip(batched, solve_batches(stacks, solve, placement)):
        if not isinstance(result, Exception):  # else one by one below, with the fallbacks
            out.update(zip(members, split(result, factors[members[0]])))
    for i, factor in enumerate(factors):
        if i not in out:
            try:
                out[i] = one(factor)
            except Exception as exc:  # reported per factor by the caller
                out[i] = exc
    return [out[i] for i in range(len(factors))]


def refresh_eigenbases(factors: list[Tensor], bases: list[Tensor],
                       dtype: torch.dtype = torch.float32) -> list[tuple[Tensor, Tensor]]:
    """Refresh eigenbases by one step of subspace iteration from the previous ones.

    ``Q = qr(F·Q_prev).Q``, ``λ = diag(Qᵀ F Q)`` clamped at 0, in the factor's dtype (float32 for
    half inputs), returned in ``dtype``.

    ``bases`` hold their eigenvectors in ascending order of eigenvalue (as ``eigh`` and
    this function return them); the QR takes them largest first, so the dominant
    directions are orthonormalised first and the small ones keep what is left (in
    ascending order a small direction, which the change of ``F`` since ``Q_prev``
    dominates, would take a large one's place: on a ResNet-20 conv factor that made the
    reconstruction error 0.63 instead of 0.012).

    ``Q diag(λ) Qᵀ`` is the factor with its off-diagonal part in the basis ``Q`` dropped:
    exact when ``Q_prev`` spans the factor's eigenvectors, and each refresh moves
    ``Q`` one power step towards them (a direction converges at the ratio of its
    eigenvalue to the next). Two GEMMs and a QR per factor (no solver error flags, so no
    host sync), against a full ``eigh``: a fraction of its time on a GPU (a QR of a
    4608² float32 matrix takes 39 ms on an H200, its ``eigh`` 124 ms). Factors of one
    size and dtype are refreshed as one batch. λ is returned in ascending order.
    """
    for f, q in zip(factors, bases, strict=True):
        if q.shape != f.shape:
            raise ValueError(f"basis of shape {tuple(q.shape)} for a factor of shape "
                             f"{tuple(f.shape)}")
    out: dict[int, tuple[Tensor, Tensor]] = {}
    for members in _same_kind(factors):
        dt = _linalg_dtype(factors[members[0]])
        f = torch.stack([factors[i] for i in members]).to(dt)
        q, lam = subspace_step(f, torch.stack([bases[i] for i in members]).to(dt))
        q, lam = q.to(dtype), lam.clamp(min=0.0).to(dtype)
        for j, i in enumerate(members):
            out[i] = (q[j], lam[j])
    return [out[i] for i in range(len(factors))]


def subspace_step(factors: Tensor, bases: Tensor) -> tuple[Tensor, Tensor]:
    """One step of subspace iteration of stacked factors from their previous eigenbases.

    The stacked core of :func:`refresh_eigenbases`: ``Q = qr(F·Q_prev).Q`` with
    ``Q_prev``'s columns taken largest eigenvalue first (``bases`` hold them in ascending
    order, as ``eigh`` returns them), and the Rayleigh quotients ``diag(Qᵀ F Q)``; both
    then in ascending order of the quotients. Two batched GEMMs and one batched QR, at
    the user's precision setting (:func:`~kfac_hpc.kfac.precision.user_setting_matmul`:
    inside a precision block, that block's), no host sync.

    Args:
        factors: ``(n, d, d)`` symmetric matrices.
        bases: ``(n, d, d)`` orthonormal bases, columns in ascending order of eigenvalue.

    Returns:
        The new bases ``(n, d, d)`` and their Rayleigh quotients ``(n, d)`` (unclamped:
        a PSD factor's may be slightly negative from rounding), ascending.
    """
    q = user_setting_qr(user_setting_matmul(factors, bases.flip(-1)))
    quotients, order = (q * user_setting_matmul(factors, q)).sum(dim=1).sort(dim=-1)
    return q.gather(2, order.unsqueeze(1).expand_as(q)), quotients


def precondition_eigen(
    grad: Tensor, qa: Tensor, la: Tensor, qg: Tensor, lg: Tensor, damping: float,
    precision: MatmulPrecision = "full",
) -> Tensor:
    """``V = Q_G [(Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + damping)] Q_Aᵀ = (A⊗G + damping·I)⁻¹ vec(∇W̄)``.

    ``grad`` is ``(g_dim, a_dim)``; the product is computed in the eigenbases' dtype (its
    four GEMMs in ``precision``, :mod:`kfac_hpc.kfac.precision`) and returned in
    ``grad``'s dtype.
    """
    with _no_autocast(grad):
        g = grad if grad.dtype == qa.dtype else grad.to(qa.dtype)
        v = matmul(matmul(qg.t(), g, precision), qa, precision)
        v.div_(torch.outer(lg, la).add_(damping))
        out = matmul(matmul(qg, v, precision), qa.t(), precision)
        return out if out.dtype == grad.dtype else out.to(grad.dtype)


def eigen_denominators(lg: Tensor, la: Tensor, damping: float) -> Tensor:
    """``λ_G λ_Aᵀ + damping`` of a stack of layers: ``(n, g_dim, a_dim)``.

    ``lg`` is ``(n, g_dim)``, ``la`` ``(n, a_dim)``; each entry is the one product and
    sum of :func:`precondition_eigen`'s ``outer(λ_G, λ_A) + damping`` (the same numbers).
    """
    return (lg[:, :, None] * la[:, None, :]).add_(damping)


def precondition_eigen_stacked(
    grads: Tensor, qa: Tensor, qg: Tensor, denominators: Tensor,
    precision: MatmulPrecision = "full",
) -> Tensor:
    """:func:`precondition_eigen` of ``n`` layers of one shape: four batched GEMMs, one division.

    ``grads`` is ``(n, g_dim, a_dim)`` in the eigenbases' dtype, ``qa`` ``(n, a_dim,
    a_dim)``, ``qg`` ``(n, g_dim, g_dim)`` (row-major stacks), ``denominators`` from
    :func:`eigen_denominators`. Layer ``i`` of the result is ``precondition_eigen`` of
    layer ``i``'s operands up to the summation order of the batched GEMMs.

    The products are ordered so that no batched GEMM reaches cuBLAS as "nt" (a
    transposed view times a row-major matrix): ``Q_Gᵀ ∇W̄`` would be one, and on an H200
    cuBLAS ran such batched float32 GEMMs with 32x32 tiles, 6x slower than their "tn"
    counterparts of the same flops (Shampoo's factor products, benchmarks/RESULTS.md).
    So ``T = Q_Aᵀ ∇W̄ᵀ`` ("tt") and ``C = Q_Gᵀ Tᵀ`` ("tt"), then ``W = (C / D) Q_Aᵀ``
    ("tn") and ``Q_G W`` ("nn"): the same four products' flops
    (``benchmarks/gram_layouts.py`` times this order against the direct one).
    """
    with _no_autocast(grads):
        t = matmul(qa.mT, grads.mT, precision)  # (∇W̄ Q_A)ᵀ
        c = matmul(qg.mT, t.mT, precision)  # Q_Gᵀ ∇W̄ Q_A
        c.div_(denominators)
        return matmul(qg, matmul(c, qa.mT, precision), precision)


def damped_inverse(F: Tensor, damping: float, dtype: torch.dtype | None = None) -> Tensor:
    """``(F + sqrt(damping)·I)⁻¹`` of a symmetric PSD factor, symmetrised.

    The result is in ``dtype`` (default: ``F``'s dtype).

    Cholesky in ``F``'s dtype (float32 for fp16/bf16) first; if the damped matrix is not
    numerically positive definite there, Cholesky in float64; if that fails too (``F``
    not PSD, e.g. corrupted), a general LU inverse in float64; and if the matrix is
    singular, the float64 pseudo-inverse.
    """
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    out_dtype = F.dtype if dtype is None else dtype
    shift = math.sqrt(damping)

    def damped(dt: torch.dtype) -> Tensor:
        m = F.to(dt)
        return m + shift * torch.eye(m.shape[0], dtype=dt, device=m.device)

    inv: Tensor | None = None
    for dt in dict.fromkeys((_linalg_dtype(F), torch.float64)):
        try:
            inv = torch.cholesky_inverse(torch.linalg.cholesky(damped(dt)))
            break
        except torch.linalg.LinAlgError:
            continue
    if inv is None:
        m64 = damped(torch.float64)
        try:
            inv = torch.linalg.inv(m64)
        except torch.linalg.LinAlgError:
            inv = torch.linalg.pinv(m64, hermitian=True)
    return ((inv + inv.t()) / 2).to(out_dtype)


def damped_inverse_many(factors: list[Tensor], damping: float, dtype: torch.dtype | None = None,
                        *, placement: SolvePlacement = DEFAULT_PLACEMENT
                        ) -> list[Tensor | Exception]:
    """:func:`damped_inverse` of every factor, one batched Cholesky per size.

    As :func:`eigh_clamped_many`: on the GPU path the factors of one size and dtype are
    damped, factored and inverted together (one solver call, one host read of its error
    flags), the CUDA batches of at most ``placement.host_max_dim`` rows on the host meanwhile
    (:func:`kfac_hpc.solves.solve_batches`); on the CPU every factor alone, as before. A
    batch whose Cholesky fails is redone factor by factor with :func:`damped_inverse`'s
    fallbacks; a factor that still fails gets its exception in its place.

    Args:
        factors: Symmetric PSD factors.
        damping: ``γ``; ``sqrt(γ)`` is added to the diagonals.
        dtype: The dtype of the results (default: each factor's dtype).
        placement: Which CUDA batches the host and the device's streams solve.

    Returns:
        Per factor, ``(F + sqrt(γ)·I)⁻¹`` (symmetrised) or the exception it raised.
    """
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    def damped(stack: Tensor) -> Tensor:
        stack = stack.to(_linalg_dtype(stack))
        stack.diagonal(dim1=-2, dim2=-1).add_(math.sqrt(damping))
        return stack

    def split(result: tuple[Tensor, ...], member: Tensor) -> list[Tensor]:
        (inv,) = result
        return list(((inv + inv.mT) / 2).to(dtype or member.dtype).unbind())

    return _solve_each(factors, damped, _cholesky_inverse, split,
                       lambda f: damped_inverse(f, damping, dtype), placement)


def _cholesky_inverse(batch: Tensor) -> tuple[Tensor, ...]:
    """The inverses of a batch of symmetric positive definite matrices (Cholesky)."""
    return (torch.cholesky_inverse(torch.linalg.cholesky(batch)),)


def precondition_inverse(grad: Tensor, a_inv: Tensor, g_inv: Tensor,
                         precision: MatmulPrecision = "full") -> Tensor:
    """Precondition with damped inverses: ``V = G⁻¹ ∇W̄ A⁻¹``.

    ``V = G⁻¹ ∇W̄ A⁻¹`` with precomputed (damped) inverses; result in ``grad``'s dtype
    (the two GEMMs in ``precision``).
    """
    with _no_autocast(grad):
        g = grad.to(a_inv.dtype)
        return matmul(matmul(g_inv, g, precision), a_inv, precision).to(grad.dtype)


def kl_clip_scale(
    pairs: Iterable[tuple[Tensor, Tensor]], lr: float, kl_clip: float | None
) -> float:
    """KL-clipping factor ``nu = min(1, sqrt(κ / |lr² Σ ⟨V, ∇W̄⟩|))`` over ``(V, ∇W̄)`` pairs.

    ``kl_clip=None`` disables clipping (1.0, pairs not read). A zero or non-finite
    denominator (``lr = 0``, all-zero gradients, or inf/NaN gradients that an AMP
    GradScaler will reject anyway) gives 1.0 so nothing is masked. The inner products
    are accumulated in float64 on the tensors' device with a single host sync.
    """
    if kl_clip is None:
        return 1.0
    if kl_clip < 0:
        raise ValueError(f"kl_clip must be >= 0 or None, got {kl_clip}")
    total: Tensor | None = None
    for v, g in pairs:
        if v.shape != g.shape:
            raise ValueError(
                f"shape mismatch in kl_clip_scale: {tuple(v.shape)} vs {tuple(g.shape)}"
            )
        term = inner64(v, g)
        total = term if total is None else total + term.to(total.device)
    return kl_clip_from_inner(total, lr, kl_clip)


def inner64(a: Tensor, b: Tensor) -> Tensor:
    """Return ``Σ a∘b`` in float64 (0-dim, on ``a``'s device).

    Products of float32 values are exact in float64, so only the summation rounds.
    """
    return (a.to(torch.float64) * b.to(torch.float64)).sum()


def kl_clip_from_inner(total: Tensor | None, lr: float, kl_clip: float | None) -> float:
    """Return :func:`kl_clip_scale` from ``Σ ⟨V, ∇W̄⟩`` already summed, on the host.

    ``total``: the sum (``None``: no pairs). One host sync; :func:`kl_clip_factor` is
    the same number left on the device.
    """
    if kl_clip is None:
        return 1.0
    if kl_clip < 0:
        raise ValueError(f"kl_clip must be >= 0 or None, got {kl_clip}")
    if total is None:
        return 1.0
    denom = abs(lr * lr * float(total.item()))
    if denom == 0.0 or not math.isfinite(denom):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / denom))


def kl_clip_factor(total: Tensor, lr: float | Tensor, kl_clip: float | Tensor
                   ) -> float | Tensor:
    """Return ν of :func:`kl_clip_from_inner`, left on the device on the GPU path.

    On the CPU path (:func:`uses_gpu_path`) this is :func:`kl_clip_from_inner` (a
    Python float; reading ``total`` costs nothing there, and Python's ``sqrt`` is
    correctly rounded on every CPU, where torch's float64 ``sqrt`` on the CPU may not
    be). On the GPU path ν is computed on the device as a 0-dim float64 tensor, without
    reading ``total`` back: no host sync stalls the step. Every operation there is a
    float64 ``*``, ``/``, ``sqrt`` (correctly rounded on CUDA) or a comparison, so ν
    equals the host's value.

    ``lr`` and ``kl_clip`` may be 0-dim float64 tensors on the device (a captured step
    reads them there, :mod:`kfac_hpc.step_graph`): ``lr·lr`` and every later
    operation are then the same float64 operations on the device, so ν is the same.

    Args:
        total: ``Σ ⟨V, ∇W̄⟩`` (0-dim, float64).
        lr: The learning rate.
        kl_clip: ``κ >= 0``.

    Returns:
        ``min(1, sqrt(κ / |lr² total|))``, or 1 where that denominator is 0 or not
        finite: a float on the CPU path, a 0-dim float64 tensor on ``total``'s device
        on the GPU path.
    """
    if not uses_gpu_path(total.device):
        return kl_clip_from_inner(total, float(lr), float(kl_clip))
    if not isinstance(kl_clip, Tensor) and kl_clip < 0:
        raise ValueError(f"kl_clip must be >= 0, got {kl_clip}")
    denom = (total.to(torch.float64) * (lr * lr)).abs()
    usable = (denom != 0.0) & denom.isfinite()
    one = torch.ones((), dtype=torch.float64, device=total.device)
    kappa = kl_clip if isinstance(kl_clip, Tensor) else torch.full(
        (), kl_clip, dtype=torch.float64, device=total.device)
    # a tensor numerator: Python's ``kl_clip / denom`` is ``reciprocal(denom) * kl_clip``
    nu = torch.div(kappa, torch.where(usable, denom, one)).sqrt().clamp(max=1.0)
    return torch.where(usable, nu, one)


def scale_in_place(tensors: Sequence[Tensor], factor: float | Tensor) -> None:
    """Multiply every tensor by ``factor`` in place (ν of :func:`kl_clip_factor`).

    One multi-tensor multiply per dtype. A 0-dim tensor factor (the GPU path's float64 ν)
    is cast to each group's dtype first: CUDA's multi-tensor kernel takes its one-launch
    path only when the factor's dtype is the tensors', and otherwise multiplies tensor by
    tensor; the product is the same either way (an in-place multiply computes in the
    tensor's dtype, casting the 0-dim factor to it).

    Args:
        tensors: The tensors to scale.
        factor: A Python number or a 0-dim tensor on their device.
    """
    if not isinstance(factor, Tensor):
        torch._foreach_mul_(list(tensors), factor)
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, factor.to(dtype))
