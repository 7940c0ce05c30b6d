"""How Shampoo computes its inverse roots ``(F + εI)^(-1/p)``: the variants.

``DistributedShampoo(root_method=...)`` takes one of these frozen, self-validating
objects (configuration, not state: nothing of it is saved in a state dict):

* :class:`EigenRoots` (the default): one batched ``torch.linalg.eigh`` per factor size
  (:func:`kfac_hpc.shampoo.roots.inverse_roots`). Exact to the factor dtype's rounding
  for any PSD factor and any ``ε > 0``; on a GPU its time is cuSOLVER's, one matrix
  after another.
* :class:`SubspaceRoots`: eigenbases kept between root computations and refreshed by
  one step of subspace iteration (two batched GEMMs and a batched QR, no solver) from
  the held ones; a full ``eigh`` every ``fresh_every``-th computation, and at once for a
  block whose refreshed basis leaves more than ``tolerance`` of its factor off the
  diagonal.
* :class:`NewtonRoots`: the coupled inverse Newton iteration
  (:mod:`kfac_hpc.shampoo.newton`), matrix products only, batched over every factor of
  one size (``torch.bmm``): what a GPU's GEMM units do best. A matrix that does not
  converge within ``max_iterations`` (or turns non-finite) is computed by the eigen path
  instead, so results are always those of one of the two methods.

:func:`root_method_from` turns a name (``"eigen"``, ``"subspace"``, ``"newton"``) or a
call-like string (``"newton(max_iterations=60, tolerance=1e-5)"``,
``"subspace(fresh_every=5)"``: what ``repr`` of the object prints) into the object, for
command lines and configuration files (``kfac-hpc train --shampoo-options
root_method=newton``).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["DEFAULT_ROOT_METHOD", "ROOT_METHOD_NAMES", "EigenRoots", "NewtonRoots", "RootMethod",
           "SubspaceRoots", "root_method_from"]


class _DecomposesEveryTime:
    """A root method that keeps no bases: every computation works from the factors."""

    #: Whether blocks keep their factors' eigenbases (state ``basis_<i>``) between root
    #: computations.
    keeps_bases: ClassVar[bool] = False

    def refreshes(self, computation: int) -> bool:
        """Say whether a block's ``computation``-th root computation refreshes held bases.

        Args:
            computation: ``(t − start) // frequency`` for a block at step ``t``.

        Returns:
            False: every computation works from the factors alone.
        """
        return False


@dataclass(frozen=True)
class EigenRoots(_DecomposesEveryTime):
    """Inverse roots by eigendecomposition: ``Q diag((max(λ, 0) + ε)^(-1/p)) Qᵀ``.

    One batched ``torch.linalg.eigh`` per (size, dtype, device), a float64 retry for a
    matrix that fails (:mod:`kfac_hpc.shampoo.roots`). The default.
    """


@dataclass(frozen=True)
class SubspaceRoots:
    """Inverse roots from eigenbases refreshed by one step of subspace iteration.

    Every block keeps the eigenbases of its factors (state ``basis_<i>``, in the factor
    dtype: one more ``d x d`` matrix per factor, as much memory as the roots). A root
    computation is either

    * *fresh*: :class:`EigenRoots`' ``eigh`` (the same roots, bit for bit), whose
      eigenvectors become the basis. The first computation of a block, every
      ``fresh_every``-th one after it (computation ``k = (t − start) // frequency`` of a
      block at step ``t`` is fresh when ``k % fresh_every == 0``, ``start`` and
      ``frequency`` being ``start_preconditioning_step`` and ``precondition_frequency``),
      and any of a block without a basis (a run resumed from a checkpoint of another
      method); or
    * *refreshed*: ``Q = qr(F·Q_prev).Q`` with the held basis' columns largest eigenvalue
      first, ``λ = diag(Qᵀ F Q)``, and the root ``Q diag((max(λ, 0) + ε)^(-1/p)) Qᵀ``
      (:func:`kfac_hpc.kfac.linalg.subspace_step`, shared with K-FAC's
      ``eigen_refresh="subspace"``). That is the exact root of ``F`` with its part off the
      diagonal in the basis ``Q`` dropped; each refresh moves every direction one power
      step towards the factor's eigenvectors (at the ratio of its eigenvalue to the next).
      The dropped part's share, ``r = ‖F − Q diag(λ) Qᵀ‖_F / ‖F‖_F =
      √(‖F‖²_F − ‖λ‖²) / ‖F‖_F`` (orthogonal invariance of the norm), is computed per
      matrix; a matrix with ``r > tolerance`` is recomputed fresh in the same step.

    Cost: two batched GEMMs and one batched QR per (size, dtype, device), at the factor
    dtype's full precision whatever the user's TF32 settings; no solver status to read,
    so one host read per root step (the residuals and finiteness of every refreshed
    matrix) before the fresh ones' ``eigh``. On an H200 a QR of a 4608² float32 matrix
    took 39 ms against 124 ms for its ``eigh``.

    With float32 factors ``r`` is resolved to about 3e-4 (``‖F‖² − ‖λ‖²`` cancels down to
    the factor's rounding), so a ``tolerance`` below about 1e-3 sends refreshes to
    ``eigh`` at random.

    What ``tolerance`` bounds is the factor's reconstruction, not the root: an inverse
    root amplifies the directions of small eigenvalues, and a refreshed basis that mixes
    two of them leaves ``r`` small while their roots differ (as float32 rounding of the
    factor itself does for eigenvalues near its resolution, whatever the method).
    ``benchmarks/shampoo_refresh.py`` measures both errors along training.

    Attributes:
        fresh_every: Every how many root computations of a block one is fresh (>= 1; 1:
            all, the roots of :class:`EigenRoots` with the bases kept).
        tolerance: Largest share ``r`` of a factor a refreshed basis may leave off the
            diagonal (in (0, 1]; ``r <= 1`` always, so 1 never recomputes).
    """

    fresh_every: int = 10
    tolerance: float = 0.05

    keeps_bases: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """Validate the fields (one error naming the field, its value and what is allowed)."""
        value = self.fresh_every
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"SubspaceRoots: invalid fresh_every={value!r}; allowed: an "
                             "integer >= 1")
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) \
                or not 0.0 < tol <= 1.0:
            raise ValueError(f"SubspaceRoots: invalid tolerance={tol!r}; allowed: a number in "
                             "(0, 1], e.g. 0.05")

    def refreshes(self, computation: int) -> bool:
        """Say whether a block's ``computation``-th root computation (from 0) refreshes bases.

        Args:
            computation: ``(t − start) // frequency`` for a block at step ``t``.

        Returns:
            False every ``fresh_every``-th computation, starting with the first (fresh
            ones); True for the others (where the block holds bases).
        """
        return computation % self.fresh_every != 0


@dataclass(frozen=True)
class NewtonRoots(_DecomposesEveryTime):
    """Inverse roots by the coupled inverse Newton iteration (GEMMs only, batched by size).

    With ``A = F + εI`` scaled by ``z = (p+1) / (2·b)``, ``b = min(‖A‖_F, ‖A‖_∞)`` (an
    upper bound of its largest eigenvalue), ``X₀ = z^(1/p)·I`` and ``M₀ = z·A``, every
    iteration computes ``T = ((p+1)·I − M)/p``, ``X ← X·T``, ``M ← T^p·M``. ``X^(-p)·M = A``
    holds throughout, and every eigenvalue ``m`` of ``M`` (in ``(0, (p+1)/2]``) moves
    monotonically to 1 (``m ← m·((p+1−m)/p)^p``), so ``X → A^(-1/p)``. The iteration stops
    when ``‖M − I‖_F ≤ tolerance``; then every eigenvalue of ``X^p·A`` is within
    ``tolerance`` of 1, so ``X`` is within a relative ``tolerance / (p·(1 − tolerance))``
    of ``A^(-1/p)`` in every eigendirection (plus rounding, which the factor dtype bounds
    as it bounds ``eigh``'s).

    Iterations: a small eigenvalue ``m`` grows by about ``((p+1)/p)^p`` per iteration
    (2.25 for ``p = 2``, 2.44 for ``p = 4``, at most e) until it is near 1, then the
    convergence is quadratic (about 5 more iterations). The smallest scaled eigenvalue
    is at least ``z·ε``, so a rank-deficient factor with ``ε = 1e-12`` (the default) and
    ``b ≈ 1`` needs ``log(1e12 / 1.5) / log(2.25) ≈ 34`` growth iterations for ``p = 2``,
    about 40 in all (measured: 41 for ``p = 2``, 37 for ``p = 4`` in float64); each
    further factor of 10 in ``b/ε`` costs about 3 iterations. Well-conditioned factors
    take 6-8. ``max_iterations`` (100) leaves room for ``b/ε`` up to about 1e30.

    Host reads: the errors of every matrix of every size are read on the host once
    every ``check_every`` iterations (one read for all of them); converged matrices
    leave the batch there, a matrix whose error grew since the last check (it diverges:
    a factor that is indefinite as stored) or is non-finite is given up at once. A root
    step thus reads about ``⌈iterations / check_every⌉`` times, whatever the number of
    blocks or sizes; ``check_every >= max_iterations`` runs all ``max_iterations``
    iterations and reads once (few reads, many more GEMMs).

    Precision: the products run at the factor dtype's full precision (float32 or
    float64) whatever the user's TF32 settings
    (:func:`kfac_hpc.kfac.precision.full_precision_products`). In float32,
    ``‖M − I‖_F`` cannot fall below about ``1e-7·√n`` (2e-6 to 4e-6 at ``n = 1024``),
    hence the default ``tolerance`` 1e-4; and a factor whose eigenvalues below about
    ``1e-7·λ_max`` matter (rank-deficient, with ``ε`` under float32's resolution of
    ``λ_max``, as with the default ``ε = 1e-12``) is indefinite as stored: the iteration
    diverges there and such factors take the eigen path (which clamps the negative
    eigenvalues to 0). Those known to be rank-deficient from their shapes and step
    count (Shampoo's 1-D blocks before ``d`` steps, blocks wider than tall at their
    first root steps) take it without iterating. Newton pays where ``ε`` is within
    float32's reach of the factors' scale, or with float64 factors.

    Attributes:
        max_iterations: Iterations before a matrix is handed to the eigen path (>= 1).
        tolerance: Stop when ``‖M − I‖_F`` is at most this (in (0, 1)).
        check_every: Iterations between reads of the errors on the host (>= 1).
    """

    max_iterations: int = 100
    tolerance: float = 1e-4
    check_every: int = 5

    def __post_init__(self) -> None:
        """Validate the fields (one error naming the field, its value and what is allowed)."""
        for name in ("max_iterations", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"NewtonRoots: invalid {name}={value!r}; allowed: an integer "
                                 ">= 1")
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) \
                or not 0.0 < tol < 1.0:
            raise ValueError(f"NewtonRoots: invalid tolerance={tol!r}; allowed: a number in "
                             "(0, 1), e.g. 1e-4 (float32) or 1e-10 (float64)")


#: A root method: one of the variants above.
RootMethod = EigenRoots | SubspaceRoots | NewtonRoots

#: The default root method (eigendecomposition; Newton is not a default until a GPU run
#: has measured both).
DEFAULT_ROOT_METHOD = EigenRoots()

#: The names :func:`root_method_from` understands, and their classes.
ROOT_METHOD_NAMES: dict[str, type[EigenRoots] | type[SubspaceRoots] | type[NewtonRoots]] = {
    "eigen": EigenRoots, "subspace": SubspaceRoots, "newton": NewtonRoots}

_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.DOTALL)


def root_method_from(value: Any) -> RootMethod:
    """Return the root method ``value`` names.

    Args:
        value: An :class:`EigenRoots`, :class:`SubspaceRoots` or :class:`NewtonRoots`; a
            name, ``"eigen"``, ``"subspace"`` or ``"newton"`` (the class names work too); a
            call-like string with keyword arguments,
            ``"newton(max_iterations=60, tolerance=1e-5)"``; or a mapping
            ``{"name": "newton", "tolerance": 1e-5}`` (a configuration file's table).

    Returns:
        The root method.

    Raises:
        ValueError: The value names no method, or names a field the method lacks or a
            bad value; the message lists what is allowed.
    """
    if isinstance(value, EigenRoots | SubspaceRoots | NewtonRoots):
        return value
    names = ", ".join(repr(n) for n in ROOT_METHOD_NAMES)
    usage = (f"allowed: {names}, or a call such as 'newton(max_iterations=60, tolerance=1e-5)'"
             " (fields: max_iterations, tolerance, check_every) or 'subspace(fresh_every=5)'"
             " (fields: fresh_every, tolerance)")
    if isinstance(value, Mapping):
        fields = dict(value)
        name = fields.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"invalid root_method={value!r}: a table needs a 'name'; {usage}")
        return _build(name, fields, value, usage)
    if not isinstance(value, str):
        raise ValueError(f"invalid root_method={value!r}; {usage}")
    match = _CALL.match(value)
    if match is None:
        raise ValueError(f"invalid root_method={value!r}; {usage}")
    name, arguments = match.group(1), match.group(2)
    fields = {}
    if arguments is not None and arguments.strip():
        try:
            call = ast.parse(f"f({arguments})", mode="eval").body
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None
                                                                 for k in call.keywords):
                raise ValueError("positional arguments")
            fields = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"invalid root_method={value!r}: arguments must be KEY=NUMBER "
                             f"({exc}); {usage}") from None
    return _build(name, fields, value, usage)


def _build(name: str, fields: dict[str, Any], value: Any, usage: str) -> RootMethod:
    key = name.strip().lower()
    by_class = {cls.__name__.lower(): cls for cls in ROOT_METHOD_NAMES.values()}
    cls = ROOT_METHOD_NAMES.get(key) or by_class.get(key)
    if cls is None:
        raise ValueError(f"invalid root_method={value!r}: unknown method {name!r}; {usage}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"invalid root_method={value!r}: {cls.__name__} has no "
                         f"{', '.join(unknown)}; its fields: {', '.join(sorted(known)) or 'none'}")
    return cls(**fields)
