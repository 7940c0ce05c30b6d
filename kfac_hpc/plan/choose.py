"""Which strategy: candidate configurations, the plan table, and ``strategy="auto"``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kfac_hpc.kfac.options import STRATEGIES
from kfac_hpc.plan.model_shapes import ModelSpec
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.plan.profile import Profile
from kfac_hpc.plan.timing import Estimate, estimate

__all__ = ["EXACT_STRATEGIES", "Choice", "baselines", "candidates", "choose", "hybrid_fractions",
           "plan"]

#: strategies whose preconditioned gradient equals the single-rank one (auto picks among them)
EXACT_STRATEGIES = ("comm-opt", "hybrid-opt", "mem-opt")
DEFAULTS = KFACOptions()


def hybrid_fractions(world: int, limit: int = 6) -> list[float]:
    """List the gradient-worker fractions ``g/P`` strictly between MEM-OPT and COMM-OPT.

    ``g`` runs over the divisors of ``P`` in ``(1, P)``; at most ``limit`` of them, evenly
    spaced over their sorted list (the first and the last included).

    Args:
        world: The number of ranks ``P``.
        limit: The most fractions returned.

    Returns:
        Fractions, ascending.
    """
    divisors = [g for g in range(2, world) if world % g == 0]
    if len(divisors) > limit:
        step = (len(divisors) - 1) / (limit - 1)
        divisors = sorted({divisors[round(i * step)] for i in range(limit)})
    return [g / world for g in divisors]


def candidates(world: int, base: KFACOptions = DEFAULTS, *,
               strategies: Sequence[str] = STRATEGIES, vary_options: bool = True,
               local_thresholds: Sequence[int] = ()) -> list[KFACOptions]:
    """List the configurations to compare on ``world`` ranks.

    Every strategy (hybrid-opt at each of :func:`hybrid_fractions`), and unless
    ``vary_options`` is false every valid combination of ``symmetric_packing``,
    ``overlap`` and (when inverses are rarer than factor updates) ``factor_sync``, and the
    given local-decomposition thresholds.

    Args:
        world: The number of ranks.
        base: Supplies every option not varied.
        strategies: The strategies to compare.
        vary_options: Also vary packing, overlap and ``factor_sync``.
        local_thresholds: Further ``local_decomposition_threshold`` values to try.

    Returns:
        The valid configurations.

    Raises:
        ValueError: A strategy is unknown.
    """
    out: list[KFACOptions] = []
    thresholds = list(dict.fromkeys([base.local_decomposition_threshold, *local_thresholds]))
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")
        fractions: list[float | None] = [None]
        if strategy == "hybrid-opt":
            fractions = list(hybrid_fractions(world))
            if not fractions:
                continue
        for fraction in fractions:
            first = replace(base, strategy=strategy, grad_worker_fraction=fraction,
                            factor_reduction="reduce_scatter")
            if strategy == "dp-kfac":
                out.append(replace(first, symmetric_packing=False, overlap=False,
                                   factor_sync="step"))
                continue
            variants = [first]
            if vary_options:
                syncs = ["step", "inverse"] if base.inv_update_steps > base.factor_update_steps \
                    else ["step"]
                variants = [replace(first, symmetric_packing=pack, overlap=ov, factor_sync=sync)
                            for pack in (False, True) for ov in (False, True) for sync in syncs
                            if not (ov and sync == "inverse")]
            local_matters = strategy != "mem-opt"
            for v in variants:
                for t in (thresholds if local_matters else thresholds[:1]):
                    out.append(replace(v, local_decomposition_threshold=t))
    return list(dict.fromkeys(out))


def baselines(base: KFACOptions = DEFAULTS) -> dict[str, KFACOptions]:
    """Express the published systems in the model (planner-only where marked).

    * ``D-KFAC``: factors allreduced to every rank (planner-only), decompositions placed
      by LPT and broadcast once all are computed, no pipelining, full matrices;
    * ``MPD-KFAC``: model-parallel D-KFAC: factors reduce-scattered to owners, who
      precondition and broadcast gradients (= mem-opt);
    * ``SPD-KFAC``: D-KFAC with pipelined, fused, upper-triangle factor allreduces and
      factors below 1400 decomposed on every rank (planner-only allreduce);
    * ``DP-KFAC``: owners build their layers' factors from their own batch (= dp-kfac).

    Args:
        base: Supplies the options the systems do not fix.

    Returns:
        The options of each system, by name.
    """
    common = replace(base, grad_worker_fraction=None, factor_sync="step")
    return {
        "D-KFAC": replace(common, strategy="comm-opt", factor_reduction="allreduce",
                          overlap=False, symmetric_packing=False,
                          local_decomposition_threshold=0, pipelined_broadcasts=False),
        "MPD-KFAC": replace(common, strategy="mem-opt", overlap=False,
                            symmetric_packing=False, pipelined_broadcasts=False),
        "SPD-KFAC": replace(common, strategy="comm-opt", factor_reduction="allreduce",
                            overlap=True, symmetric_packing=True,
                            local_decomposition_threshold=1400),
        "DP-KFAC": replace(common, strategy="dp-kfac", overlap=False, symmetric_packing=False),
    }


@dataclass(frozen=True)
class Choice:
    """The plan for one world size: every estimate (fastest first) and the pick."""

    world: int
    estimates: tuple[Estimate, ...]
    best: Estimate
    budget: int | None
    fits_budget: bool

    def fits(self, e: Estimate) -> bool:
        """Say whether the estimate's peak memory fits the budget (always, without one)."""
        return self.budget is None or e.memory_peak <= self.budget


def choose(estimates: Sequence[Estimate], budget: int | None = None) -> Choice:
    """Pick the fastest estimate whose peak memory fits ``budget`` (the smallest if none fits).

    Ties keep the order given (so the result is the same on every rank).

    Args:
        estimates: The candidates' estimates, all at one world size.
        budget: Peak bytes per rank allowed; None: no limit.

    Returns:
        The choice, with every estimate fastest first.

    Raises:
        ValueError: There are no estimates.
    """
    if not estimates:
        raise ValueError("nothing to choose from")
    ordered = sorted(estimates, key=lambda e: e.total_s)
    fitting = [e for e in ordered if budget is None or e.memory_peak <= budget]
    best = fitting[0] if fitting else min(ordered, key=lambda e: e.memory_peak)
    return Choice(ordered[0].world, tuple(ordered), best, budget, bool(fitting))


def plan(model: ModelSpec, worlds: Sequence[int], batch: int, profile: Profile,
         base: KFACOptions = DEFAULTS, *, strategies: Sequence[str] = STRATEGIES,
         vary_options: bool = True, local_thresholds: Sequence[int] = (),
         budget: int | None = None) -> list[Choice]:
    """Estimate every candidate at every world size and choose (see :func:`choose`).

    Args:
        model: The model's K-FAC layers and parameters.
        worlds: World sizes to plan for.
        batch: Samples per rank.
        profile: The machine's network and compute parameters.
        base: Supplies every option not varied.
        strategies: The strategies to compare.
        vary_options: Also vary packing, overlap and ``factor_sync``.
        local_thresholds: Further ``local_decomposition_threshold`` values to try.
        budget: Peak bytes per rank allowed; None: no limit.

    Returns:
        One choice per world size, in order.
    """
    out = []
    for world in worlds:
        configs = candidates(world, base, strategies=strategies, vary_options=vary_options,
                             local_thresholds=local_thresholds)
        ests = [estimate(model, c, world, batch, profile) for c in configs]
        out.append(choose(ests, budget))
    return out
