"""``KFACPreconditioner(strategy="auto")``: pick the strategy and fraction with the planner.

Only the strategies whose preconditioned gradient equals the single-rank one are
candidates (COMM-OPT, HYBRID-OPT at every fraction the world size allows, MEM-OPT);
DP-KFAC changes the curvature (each layer's factors come from one rank's batch), so
it is never chosen silently. The user's other options (packing, overlap, factor_sync,
update steps, dtypes, thresholds) are kept as given. The choice is a pure function of
the layer shapes, the world size, the options and the profile, so every rank makes
the same one without communicating.

Without ``input_shape`` (one rank's input batch shape) the batch size and input
resolution are unknown: the estimate then uses one row per sample and batch 32, which
changes only terms that are the same for every candidate (forward, backward, factor
statistics).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kfac_hpc.kfac.options import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    default_factor_dtype,
)
from kfac_hpc.plan.choose import choose, hybrid_fractions
from kfac_hpc.plan.model_shapes import model_spec
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.plan.profile import Profile, load_profile
from kfac_hpc.plan.timing import Estimate, estimate

__all__ = ["resolve_auto"]

ASSUMED_BATCH = 32


def _steps(value: int | Callable[[int], Any]) -> int:
    return max(1, int(value(0) if callable(value) else value))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_auto(
    model: nn.Module,
    world_size: int,
    *,
    profile: Profile | str | os.PathLike[str] | None = None,
    skip_layers: Sequence[str] = (),
    compute_method: str = "eigen",
    symmetric_packing: bool = False,
    overlap: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    factor_sync: str = "step",
    local_decomposition_threshold: int = DEFAULT_LOCAL_THRESHOLD,
    factor_update_steps: int | Callable[[int], Any] = 1,
    inv_update_steps: int | Callable[[int], Any] = 1,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype = torch.float32,
    memory_budget: int | None = None,
    input_shape: Sequence[int] | None = None,
    kfac_approx: str = "expand",
    low_rank: int | None = None,
    low_rank_energy: float | None = None,
    low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM,
    low_rank_remainder: str = "mean",
) -> tuple[str, float | None, Estimate | None, list[Estimate]]:
    """Choose the strategy and gradient-worker fraction for ``model`` with the planner.

    A pure function of its arguments: every rank makes the same choice without
    communicating. World size 1 gives ``("comm-opt", None, None, [])`` (every strategy
    is the same there).

    Args:
        model: The model whose K-FAC layers are placed.
        world_size: The number of ranks.
        profile: A :class:`Profile`, a JSON path or a bundled name; default
            :func:`~kfac_hpc.plan.profile.load_profile` ``(None)``.
        skip_layers: Names or types of layers left out of K-FAC, as the preconditioner's.
        compute_method: ``"eigen"`` or ``"inverse"``, as the preconditioner's.
        symmetric_packing: The preconditioner's option of that name.
        overlap: The preconditioner's option of that name.
        bucket_cap_mb: The preconditioner's option of that name, in MiB.
        factor_sync: The preconditioner's option of that name.
        local_decomposition_threshold: The preconditioner's option of that name.
        factor_update_steps: The preconditioner's schedule; a callable is read at step 0.
        inv_update_steps: The preconditioner's schedule; a callable is read at step 0.
        factor_dtype: The dtype factors are kept in (default: the preconditioner's).
        inv_dtype: The dtype decompositions are kept in.
        memory_budget: Bytes per rank a plan may use (default: the profile's memory per
            rank).
        input_shape: One rank's input batch shape ``(batch, *sample)``; None assumes one
            row per sample and a batch of 32.
        kfac_approx: The preconditioner's option of that name.
        low_rank: The preconditioner's option of that name.
        low_rank_energy: The preconditioner's option of that name.
        low_rank_min_dim: The preconditioner's option of that name.
        low_rank_remainder: The preconditioner's option of that name.

    Returns:
        ``(strategy, grad_worker_fraction, chosen estimate, all estimates)``; the
        fraction is None except for ``"hybrid-opt"``.
    """
    if world_size == 1:
        return "comm-opt", None, None, []
    prof = load_profile(profile)
    if isinstance(skip_layers, str):
        skip_layers = (skip_layers,)
    batch, sample = ((int(input_shape[0]), tuple(input_shape[1:])) if input_shape
                     else (ASSUMED_BATCH, None))
    spec = model_spec(model, input_shape=sample, skip_layers=tuple(skip_layers))
    if factor_dtype is None:  # the preconditioner's default (kfac_hpc.kfac.options)
        factor_dtype = getattr(torch, default_factor_dtype(
            _dtype_name(p.dtype) for p in model.parameters()))
    base = KFACOptions(
        compute_method=compute_method, symmetric_packing=symmetric_packing, overlap=overlap,
        bucket_cap_mb=bucket_cap_mb, factor_sync=factor_sync,
        local_decomposition_threshold=local_decomposition_threshold, kfac_approx=kfac_approx,
        low_rank=low_rank, low_rank_energy=low_rank_energy, low_rank_min_dim=low_rank_min_dim,
        low_rank_remainder=low_rank_remainder,
        factor_update_steps=_steps(factor_update_steps),
        inv_update_steps=_steps(inv_update_steps),
        factor_dtype=_dtype_name(factor_dtype), inv_dtype=_dtype_name(inv_dtype))
    configs = [KFACOptions(**{**base.to_json(), "strategy": "comm-opt"})]
    configs += [KFACOptions(**{**base.to_json(), "strategy": "hybrid-opt",
                               "grad_worker_fraction": f}) for f in hybrid_fractions(world_size)]
    configs.append(KFACOptions(**{**base.to_json(), "strategy": "mem-opt"}))
    estimates = [estimate(spec, c, world_size, batch, prof) for c in configs]
    budget = memory_budget if memory_budget is not None else prof.memory_per_rank_bytes
    best = choose(estimates, budget).best
    return best.options.strategy, best.options.grad_worker_fraction, best, estimates
