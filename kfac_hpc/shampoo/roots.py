"""Inverse p-th roots of symmetric positive semi-definite factors by eigendecomposition.

``inverse_root(F, p, eps) = Q diag((max(λ, 0) + eps)^(-1/p)) Qᵀ`` for ``F = Q diag(λ) Qᵀ``,
i.e. ``(F + eps·I)^(-1/p)`` for a PSD ``F`` (the clamp removes the tiny negative
eigenvalues rounding produces). A failed decomposition (LAPACK/cuSOLVER error or a
non-finite result) is retried in float64; if that fails too
:class:`RootComputationError` is raised and the caller keeps its previous root.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RootComputationError", "inverse_root"]


class RootComputationError(RuntimeError):
    """The eigendecomposition failed in the factor's dtype and in float64."""


def _eigh_root(matrix: Tensor, p: float, epsilon: float) -> Tensor | None:
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError and backend errors
        return None
    scale = (eigenvalues.clamp(min=0) + epsilon).pow(-1.0 / p)
    root = (eigenvectors * scale.unsqueeze(0)) @ eigenvectors.mT
    # One host read: non-finite eigenvectors make the root non-finite (scale is finite
    # and positive), a +Inf eigenvalue would not (its scale is 0), so check both.
    if not bool(torch.isfinite(eigenvalues).all() & torch.isfinite(root).all()):
        return None
    return root


def inverse_root(matrix: Tensor, p: float, epsilon: float) -> Tensor:
    """``(matrix + epsilon·I)^(-1/p)`` of a symmetric PSD matrix, in ``matrix``'s dtype.

    Only the lower triangle is read. Tries ``matrix``'s dtype, then float64; raises
    :class:`RootComputationError` when both fail.
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"inverse_root needs a square matrix, got shape {tuple(matrix.shape)}")
    with torch.autocast(device_type=matrix.device.type, enabled=False):
        root = _eigh_root(matrix, p, epsilon)
        if root is None and matrix.dtype != torch.float64:
            root = _eigh_root(matrix.double(), p, epsilon)
        if root is None:
            raise RootComputationError(
                f"eigendecomposition of a {tuple(matrix.shape)} {matrix.dtype} factor failed "
                "(also in float64)")
        return root.to(matrix.dtype)
