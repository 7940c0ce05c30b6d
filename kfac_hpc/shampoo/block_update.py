"""One Shampoo step of the blocks a rank owns, batched over runs of same-kind blocks.

Order of operations per block (``t`` = the block's step, counted from 1); a block of
order 1 (a vector after merging) in a group with ``precondition_vectors=False`` keeps no
factors and takes steps 2 and 5 not at all, and its direction in step 6 is always the
grafting direction:

1. coupled weight decay (``decoupled_weight_decay=False``): ``g ← g + wd·p``;
2. at ``t = 1, 1 + s, 1 + 2s, …`` (``s = statistics_frequency``, 1 by default):
   factors ``F_i ← β2·F_i + (1-β2)·X_(i)X_(i)ᵀ`` (``β2 = 1``: plain sum), in
   ``factor_dtype``; non-finite (the factors' diagonals, or the gradient at the steps
   between) ⇒ a device flag that the optimizer turns into
   :data:`STATUS_NONFINITE_STATISTICS` (the step goes on: no host sync per block);
3. grafting second moment from ``g``;
4. β1 filtering ``m ← β1·m + (1-β1)·g``, ``m̂ = m / (1-β1^t)`` with bias correction
   (``β1 = 0``: ``m̂ = g``);
5. at ``t = start, start + freq, …``: roots ``(F̂_i + εI)^(-1/2k)`` with
   ``F̂_i = F_i / (1-β2^n)`` under bias correction (``β2 < 1``; ``n`` the factor updates
   so far, ``t`` when ``s = 1``), by the optimizer's root
   method (``SubspaceRoots`` also keeps each factor's eigenbasis, ``basis_i``); a
   failure keeps the previous roots and bases (identity before the first success) and
   counts; reaching
   ``max_consecutive_root_failures`` ⇒ :data:`STATUS_ROOT_FAILURES`;
6. direction: ``t >= start``: ``m̂ ×_1 R_1 … ×_k R_k`` rescaled to the grafting
   direction's norm (no rescaling without grafting); before: the grafting direction
   (``m̂`` for ``"sgd"`` or no grafting);
7. decoupled weight decay: ``d ← d + wd·p``;
8. momentum ``b ← μ·b + d``; ``d ← d + μ·b`` (Nesterov) or ``d ← b``.

The parameter update ``p ← p − lr·d`` happens on every rank after the exchange.

Batching (what a GPU pays in kernel launches): the blocks are processed by *runs*
(:class:`~kfac_hpc.shampoo.stacks.Run`: blocks of one parameter group, shape and
dtype at the same step, whose state is stacked), so each matrix operation is one
batched GEMM per run and factor, and each element-wise operation one
``torch._foreach_*`` call over all the runs of a parameter group. Roots are computed
for all runs of all groups at once (:func:`~kfac_hpc.shampoo.roots.inverse_roots`).
Nothing here reads device memory on the host, except the root computation (one read
for all roots). Numerics equal the block-by-block algorithm above operation by
operation, except that the factor update is one fused ``baddbmm`` (its rounding in
the last bit differs from a product followed by ``mul_``/``add_``) and that small
batched products on the CPU (under 400 multiply-adds per matrix) and matrix-vector
products sum in another order than their one-block counterparts: ~1e-16 relative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.shampoo import grafting as graft
from kfac_hpc.shampoo.errors import nonfinite_marks
from kfac_hpc.shampoo.kronecker import (
    ProductPrecision,
    accumulate_factors,
    diagonal_marks,
    precondition,
)
from kfac_hpc.shampoo.root_methods import RootMethod
from kfac_hpc.shampoo.roots import RootRequest, RootResult
from kfac_hpc.shampoo.stacks import Run

__all__ = ["BiasCorrections", "BlockHyper", "BlockState", "RunStep", "advance", "bias_corrections",
           "directions", "install_roots", "is_preconditioned", "root_requests", "start_runs",
           "update_statistics"]

BlockState = dict[str, Any]
"""Keys: ``step`` (int), ``factor_<i>``, ``root_<i>`` (after the first root
computation), ``basis_<i>`` (with it, under ``SubspaceRoots``), ``root_failures`` (int,
consecutive), and where used
``second_moment``, ``filtered_grad``, ``momentum_buffer``."""


def is_preconditioned(order: int, precondition_vectors: bool) -> bool:
    """Say whether blocks of ``order`` keep Kronecker factors and use Shampoo's direction.

    Args:
        order: The block's number of dimensions (after merging).
        precondition_vectors: The group's setting.

    Returns:
        True for blocks of order 2 or more, and for vectors when ``precondition_vectors``.
    """
    return order >= 2 or precondition_vectors


@dataclass(frozen=True)
class BlockHyper:
    """The hyper-parameters of a parameter group that a block step reads."""

    beta1: float
    beta2: float
    epsilon: float
    momentum: float
    nesterov: bool
    weight_decay: float
    decoupled_weight_decay: bool
    precondition_frequency: int
    start_preconditioning_step: int
    grafting: str | None
    grafting_epsilon: float
    grafting_beta2: float
    use_bias_correction: bool
    max_consecutive_root_failures: int
    precondition_vectors: bool = True
    statistics_frequency: int = 1
    stats_precision: ProductPrecision = "full"
    precondition_precision: ProductPrecision = "full"

    @staticmethod
    def from_group(group: dict[str, Any], max_consecutive_root_failures: int) -> BlockHyper:
        """Read the hyper-parameters of ``group``.

        Args:
            group: A parameter group of the optimizer.
            max_consecutive_root_failures: The optimizer's limit, not a group setting.

        Returns:
            The hyper-parameters a block step reads.
        """
        beta1, beta2 = group["betas"]
        return BlockHyper(
            float(beta1), float(beta2), group["epsilon"], group["momentum"], group["nesterov"],
            group["weight_decay"], group["decoupled_weight_decay"],
            group["precondition_frequency"], group["start_preconditioning_step"],
            group["grafting"], group["grafting_epsilon"], group["grafting_beta2"],
            group["use_bias_correction"], max_consecutive_root_failures,
            group["precondition_vectors"], group["statistics_frequency"],
            group["stats_precision"], group["precondition_precision"])

    def preconditions(self, order: int) -> bool:
        """Whether the group's blocks of ``order`` are preconditioned (``is_preconditioned``)."""
        return is_preconditioned(order, self.precondition_vectors)

    def recomputes_roots(self, step: int, has_roots: bool) -> bool:
        """Say whether a block at ``step`` (after this step) recomputes its roots.

        Args:
            step: The block's step count after this step.
            has_roots: Whether the block has roots already.

        Returns:
            From ``start_preconditioning_step`` on: True every ``precondition_frequency``
            steps, and whenever the block has no roots yet.
        """
        start, freq = self.start_preconditioning_step, self.precondition_frequency
        return step >= start and ((step - start) % freq == 0 or not has_roots)

    def updates_factors(self, step: int) -> bool:
        """Say whether a block at ``step`` updates its factors (every ``statistics_frequency``).

        Args:
            step: The block's step count after this step.

        Returns:
            True at steps 1, 1 + s, 1 + 2s, … (``s = statistics_frequency``).
        """
        return (step - 1) % self.statistics_frequency == 0

    def factor_updates(self, step: int) -> int:
        """Count the factor updates of a block up to and including ``step``.

        Args:
            step: The block's step count after this step (>= 1).

        Returns:
            ``(step − 1) // statistics_frequency + 1``.
        """
        return (step - 1) // self.statistics_frequency + 1

    def root_computation(self, step: int) -> int:
        """Number the root computation of a block at ``step``, counting from 0.

        Args:
            step: The block's step count after this step (at least the start).

        Returns:
            ``(step − start_preconditioning_step) // precondition_frequency``.
        """
        return (step - self.start_preconditioning_step) // self.precondition_frequency


@dataclass
class RunStep:
    """One run's tensors during a step (batches ``(n, *shape)``).

    Attributes:
        run: the run.
        factor_dtype: dtype of factors and roots.
        grad: the gradients (after coupled weight decay), parameters' dtype.
        param: the parameters, where weight decay needs them.
        stat_marks: per block, 0 if its factor statistics are finite, else NaN (device).
        filtered: the β1-filtered gradients.
        second_moment: the grafting second moments, where used.
        root_failures: positions of blocks whose roots failed too often (host).
    """

    run: Run
    factor_dtype: torch.dtype
    grad: Tensor
    param: Tensor | None
    stat_marks: Tensor | None = None
    filtered: Tensor | None = None
    second_moment: Tensor | None = None
    root_failures: list[int] = field(default_factory=list)

    @property
    def order(self) -> int:
        """The run's blocks' number of dimensions (one factor each)."""
        return len(self.run.stack.shape)

    def rows(self, key: str, item_shape: tuple[int, ...] | None = None,
             factor: bool = False) -> Tensor:
        """Return the run's stacked state ``key`` (block-shaped unless ``item_shape``)."""
        dtype = self.factor_dtype if factor else self.grad.dtype
        shape = self.run.stack.shape if item_shape is None else item_shape
        return self.run.rows(key, shape, dtype, self.grad.device)

    def factors(self, kind: str = "factor") -> list[Tensor]:
        """Return the stacked ``factor_<i>`` (``root_<i>``, ``basis_<i>``) of every dimension."""
        return [self.rows(f"{kind}_{i}", (d, d), factor=True)
                for i, d in enumerate(self.run.stack.shape)]


def _present(values: Sequence[Tensor | None]) -> list[Tensor]:
    """``values``, all of which must be set by now."""
    out = [v for v in values if v is not None]
    assert len(out) == len(values)
    return out


def _stacked(views: Sequence[Tensor]) -> Tensor:
    """Stack ``views`` along a new first dimension, contiguous.

    So that ``_foreach`` calls over them keep their fused path on a GPU; a view, not a
    copy, for one contiguous tensor.
    """
    if len(views) == 1:
        return views[0].contiguous().unsqueeze(0)
    return torch.stack(list(views))


def advance(runs: Sequence[Run]) -> None:
    """Set the step counters of the runs' blocks to this step's.

    Args:
        runs: The runs stepping now.
    """
    for run in runs:
        for state in run.states:
            state["step"] = run.step


@dataclass(frozen=True)
class BiasCorrections:
    """Per run of a parameter group, the divisors its step's bias corrections use.

    As numbers, or as 0-dim tensors holding them (a captured step reads them there;
    dividing by either is the same division).

    Attributes:
        filtered: ``1 − β1^t`` of the filtered gradient (None: no correction).
        grafting: Adam grafting's ``√(1 − β2^t)`` (None: no correction).
    """

    filtered: Sequence[float] | Sequence[Tensor] | None
    grafting: Sequence[float] | Sequence[Tensor] | None

    def values(self) -> list[float]:
        """Every number, ``filtered`` first (those of a numeric instance)."""
        return [float(v) for part in (self.filtered, self.grafting) if part is not None
                for v in part]


def bias_corrections(runs: Sequence[Run], hp: BlockHyper) -> BiasCorrections:
    """The bias corrections of the runs' steps (steps 3-4), as numbers.

    Args:
        runs: The runs of one parameter group.
        hp: The group's hyper-parameters.

    Returns:
        Their divisors.
    """
    steps = [run.step for run in runs]
    filtered = ([1.0 - hp.beta1**t for t in steps]
                if hp.beta1 > 0.0 and hp.use_bias_correction else None)
    return BiasCorrections(filtered, graft.second_moment_corrections(
        hp.grafting, hp.grafting_beta2, steps, hp.use_bias_correction))


def start_runs(runs: Sequence[Run], grads: Sequence[Sequence[Tensor]],
               params: Sequence[Sequence[Tensor]], hp: BlockHyper,
               factor_dtype: torch.dtype) -> list[RunStep]:
    """Stack the runs' gradients (step 1); their counters are advanced already (:func:`advance`).

    Args:
        runs: The runs of one parameter group.
        grads: Per run, its blocks' gradient views.
        params: Per run, its blocks' parameter views.
        hp: The group's hyper-parameters.
        factor_dtype: Dtype of factors and roots.

    Returns:
        One step record per run, in order.
    """
    stacked = [_stacked(g) for g in grads]
    if hp.weight_decay == 0.0:
        return [RunStep(run, factor_dtype, g, None) for run, g in zip(runs, stacked)]
    stacked_params = [_stacked(p) for p in params]
    if not hp.decoupled_weight_decay:
        stacked = list(torch._foreach_add(stacked, stacked_params, alpha=hp.weight_decay))
    return [RunStep(run, factor_dtype, g, p) for run, g, p in zip(runs, stacked, stacked_params)]


def update_statistics(steps: Sequence[RunStep], hp: BlockHyper,
                      corrections: BiasCorrections) -> None:
    """Update factors, their finiteness flags, grafting moments and filtered gradients (2-4).

    Args:
        steps: The runs' step records; updated in place.
        hp: The group's hyper-parameters.
        corrections: The runs' bias corrections (:func:`bias_corrections`).
    """
    for st in steps:
        preconditioned = hp.preconditions(st.order)
        if not preconditioned and any("factor_0" in state for state in st.run.states):
            _drop(st, ("factor", "root", "basis"))  # left from when it was preconditioned
        if not preconditioned or not hp.updates_factors(st.run.step):
            st.stat_marks = nonfinite_marks(st.grad.flatten(1))  # no factor update
            continue
        factors = st.factors()
        accumulate_factors(factors, st.grad.to(st.factor_dtype), hp.beta2, hp.stats_precision)
        st.stat_marks = diagonal_marks(factors)
    grads = [st.grad for st in steps]
    if graft.uses_second_moment(hp.grafting):
        moments = [st.rows("second_moment") for st in steps]
        graft.update_second_moments(hp.grafting, moments, grads, hp.grafting_beta2)
        for st, moment in zip(steps, moments):
            st.second_moment = moment
    filtered = grads
    if hp.beta1 > 0.0:
        filtered = [st.rows("filtered_grad") for st in steps]
        torch._foreach_lerp_(filtered, grads, 1.0 - hp.beta1)
        if corrections.filtered is not None:
            divisors: Any = list(corrections.filtered)  # numbers or 0-dim tensors alike
            filtered = list(torch._foreach_div(filtered, divisors))
    for st, f in zip(steps, filtered):
        st.filtered = f


def _refreshes(st: RunStep, hp: BlockHyper, method: RootMethod) -> bool:
    """Whether a run's roots are computed from its held bases (``SubspaceRoots``)."""
    return (method.refreshes(hp.root_computation(st.run.step))
            and all("basis_0" in state for state in st.run.states))


def root_requests(st: RunStep, hp: BlockHyper, method: RootMethod) -> list[RootRequest]:
    """List the root computations of a run (step 5), one request per dimension.

    Args:
        st: The run's step record.
        hp: The group's hyper-parameters.
        method: The optimizer's root method; under ``SubspaceRoots`` a refreshed run's
            requests carry its held bases.

    Returns:
        One request per dimension of the run's blocks.
    """
    n = hp.factor_updates(st.run.step)
    correction = 1.0 - hp.beta2**n if hp.use_bias_correction and hp.beta2 < 1.0 else 1.0
    shape = st.run.stack.shape
    numel = math.prod(shape)
    bases: list[Tensor | None] = (list(st.factors("basis")) if _refreshes(st, hp, method)
                                  else [None] * len(shape))
    # factor i sums n products X_(i)X_(i)ᵀ of numel/d_i columns: rank <= n·numel/d_i
    return [RootRequest(factor, correction, 2.0 * len(shape), hp.epsilon,
                        rank_bound=n * (numel // d), bases=basis)
            for factor, d, basis in zip(st.factors(), shape, bases)]


def install_roots(st: RunStep, results: Sequence[RootResult], hp: BlockHyper,
                  method: RootMethod) -> None:
    """Keep a run's new roots (and bases), count failures, note blocks that failed too often.

    A failed block keeps its previous roots and bases (the identity before its first
    success). Under a method that keeps no bases, a block's bases are dropped (left by a
    run with ``SubspaceRoots`` before a resume).

    Args:
        st: The run's step record; ``root_failures`` is updated.
        results: The results of :func:`root_requests`' requests, in order.
        hp: The group's hyper-parameters.
        method: The optimizer's root method.
    """
    failed = [any(flags) for flags in zip(*(r.failed for r in results))]
    _keep(st, "root", [r.roots for r in results], failed)
    if method.keeps_bases:
        _keep(st, "basis", [r.bases for r in results], failed)
    else:
        _drop(st, ("basis",))
    for j, state in enumerate(st.run.states):
        state["root_failures"] = state["root_failures"] + 1 if failed[j] else 0
        if state["root_failures"] >= hp.max_consecutive_root_failures:
            st.root_failures.append(j)


def _keep(st: RunStep, kind: str, values: Sequence[Tensor | None], failed: list[bool]) -> None:
    """Copy per dimension the results into the run's ``<kind>_<i>``, skipping failed blocks.

    A failed block keeps what it had, the identity where it had nothing yet.
    """
    fresh = [f"{kind}_0" not in state for state in st.run.states]  # before binding them
    for rows, value in zip(st.factors(kind), values):
        assert value is not None  # the eigen and subspace paths return bases too
        if not any(failed):
            rows.copy_(value)
            continue
        for j, row in enumerate(rows):
            if not failed[j]:
                row.copy_(value[j])
            elif fresh[j]:
                torch.eye(row.shape[0], out=row)


def _drop(st: RunStep, kinds: Sequence[str]) -> None:
    """Remove the run's blocks' ``<kind>_<i>`` entries, for every dimension ``i``.

    When the run is its whole stack, the stacked tensors are freed too.
    """
    keys = [f"{kind}_{i}" for kind in kinds for i in range(st.order)]
    for state in st.run.states:
        for key in keys:
            state.pop(key, None)
    if st.run.size == st.run.stack.size:
        st.run.stack.forget(keys)


def directions(steps: Sequence[RunStep], hp: BlockHyper,
               corrections: BiasCorrections) -> list[Tensor]:
    """Compute the runs' final directions (steps 6-8), in the parameters' dtype.

    Args:
        steps: The runs' step records.
        hp: The group's hyper-parameters.
        corrections: The runs' bias corrections (:func:`bias_corrections`).

    Returns:
        One batch ``(n, *shape)`` per run.
    """
    filtered = _present([st.filtered for st in steps])
    moments = [st.second_moment for st in steps if st.second_moment is not None]
    grafted = graft.directions(hp.grafting, filtered, moments, hp.grafting_epsilon,
                               corrections.grafting)
    out: list[Tensor] = []
    preconditioned: list[int] = []
    for k, (st, grafting_direction) in enumerate(zip(steps, grafted)):
        if st.run.step >= hp.start_preconditioning_step and hp.preconditions(st.order):
            roots = st.factors("root")
            out.append(precondition(filtered[k].to(st.factor_dtype), roots,
                                    hp.precondition_precision).to(st.grad.dtype))
            preconditioned.append(k)
        else:
            out.append(grafting_direction)
    if hp.grafting is not None and preconditioned:
        graft.rescale_to([out[k] for k in preconditioned], [grafted[k] for k in preconditioned])
    if hp.weight_decay != 0.0 and hp.decoupled_weight_decay:
        out = list(torch._foreach_add(out, _present([st.param for st in steps]),
                                      alpha=hp.weight_decay))
    if hp.momentum != 0.0:
        buffers = [st.rows("momentum_buffer") for st in steps]
        torch._foreach_mul_(buffers, hp.momentum)
        torch._foreach_add_(buffers, out)
        out = list(torch._foreach_add(out, buffers, alpha=hp.momentum)) if hp.nesterov else buffers
    return out
