"""K-FAC's settings as one frozen, self-validating value.

:class:`KFACConfig` holds what ``KFACPreconditioner``'s keyword arguments say (with
``strategy="auto"`` already resolved by the planner). Building it validates it: the
option rules of :func:`kfac_hpc.kfac.options.conflicts` (the one source shared with the
planner and the driver), the choices of every named option, and the hyper-parameter
schedules. A bad value raises one ``ValueError`` (or ``TypeError``) naming the option
and the fix; a built config is always a valid one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch

from kfac_hpc.kfac.hyperparams import (
    Scalar,
    Schedule,
    non_negative,
    positive,
    unit_interval,
    whole_positive,
)
from kfac_hpc.kfac.options import (
    COMPUTE_METHODS,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    FACTOR_SYNCS,
    STRATEGIES,
    ComputeMethod,
    EigenRefresh,
    FactorSync,
    KFACApprox,
    LowRankRemainder,
    PrecisionOption,
    Strategy,
    conflicts,
    sends_factors,
)
from kfac_hpc.solves import DEFAULT_HOST_MAX_DIM, SolvePlacement, default_device_streams

__all__ = ["KFACConfig", "Schedules", "batch_shape", "dtype_name"]


class Schedules(NamedTuple):
    """The hyper-parameters that may change with the step, validated."""

    damping: Schedule
    factor_decay: Schedule
    kl_clip: Schedule | None
    lr: Schedule
    factor_update_steps: Schedule
    inv_update_steps: Schedule


@dataclass(frozen=True)
class KFACConfig:
    """Every setting of a :class:`~kfac_hpc.kfac.preconditioner.KFACPreconditioner`.

    The fields are the preconditioner's keyword arguments of the same names (see its
    docstring). ``strategy`` is a concrete one (``"auto"`` is resolved before);
    ``factor_dtype=None`` means "chosen from the model's weights". Hyper-parameters
    keep the value given (a number or a callable of the step); :attr:`schedules`
    evaluates them.
    """

    strategy: Strategy = "comm-opt"
    grad_worker_fraction: float | None = None
    compute_method: ComputeMethod = "eigen"
    damping: Scalar = 0.001
    factor_decay: Scalar = 0.95
    kl_clip: Scalar | None = 0.001
    lr: Scalar = 0.1
    factor_update_steps: Scalar = 1
    inv_update_steps: Scalar = 1
    skip_layers: tuple[str, ...] = ()
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype = torch.float32
    accumulation_steps: int = 1
    symmetric_packing: bool = False
    overlap: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    factor_sync: FactorSync = "step"
    local_decomposition_threshold: int = DEFAULT_LOCAL_THRESHOLD
    check_replicas: bool = True
    input_shape: tuple[int, ...] | None = None
    kfac_approx: KFACApprox | Mapping[str, KFACApprox] = "expand"
    low_rank: int | None = None
    low_rank_energy: float | None = None
    low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM
    low_rank_remainder: LowRankRemainder = "mean"
    decomposition_lag: int = 0
    eigen_refresh: EigenRefresh = "eigh"
    stats_precision: PrecisionOption = "auto"
    precondition_precision: PrecisionOption = "auto"
    host_decomposition_max_dim: int = DEFAULT_HOST_MAX_DIM
    decomposition_streams: int | None = None
    cuda_graphs: bool | None = None

    @property
    def solve_placement(self) -> SolvePlacement:
        """Where the batched decompositions of CUDA factors run (``kfac_hpc.solves``).

        Raises:
            ValueError: ``host_decomposition_max_dim`` or ``decomposition_streams`` is
                out of range.
        """
        return SolvePlacement.of(self.host_decomposition_max_dim, self.decomposition_streams)

    def __post_init__(self) -> None:
        """Validate every option (one error naming the first problem and its fix).

        ``decomposition_streams=None`` is resolved here, once
        (:func:`~kfac_hpc.solves.default_device_streams`), so the count recorded is the
        count used.
        """
        if self.decomposition_streams is None:
            object.__setattr__(self, "decomposition_streams", default_device_streams())
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {(*STRATEGIES, 'auto')}, "
                             f"got {self.strategy!r}")
        if self.compute_method not in COMPUTE_METHODS:
            raise ValueError(f"compute_method must be one of {COMPUTE_METHODS}, "
                             f"got {self.compute_method!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, "
                             f"got {self.accumulation_steps!r}")
        if self.factor_sync not in FACTOR_SYNCS:
            raise ValueError(f"factor_sync must be one of {FACTOR_SYNCS}, "
                             f"got {self.factor_sync!r}")
        problems = conflicts(
            strategy=self.strategy, grad_worker_fraction=self.grad_worker_fraction,
            overlap=self.overlap, symmetric_packing=self.symmetric_packing,
            factor_sync=self.factor_sync, compute_method=self.compute_method,
            low_rank=self.low_rank, low_rank_energy=self.low_rank_energy,
            low_rank_min_dim=self.low_rank_min_dim, low_rank_remainder=self.low_rank_remainder,
            stats_precision=self.stats_precision,
            precondition_precision=self.precondition_precision,
            factor_dtype=dtype_name(self.factor_dtype),
            inv_dtype=dtype_name(self.inv_dtype) or "float32",
            eigen_refresh=self.eigen_refresh, decomposition_lag=self.decomposition_lag)
        if problems:
            raise ValueError(f"{problems[0].option} {problems[0].text()}")
        self._check_rank_fits()
        self.solve_placement  # noqa: B018 (validates both options)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True, False or None (the device's default), "
                            f"got {self.cuda_graphs!r}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        if isinstance(self.skip_layers, str):
            object.__setattr__(self, "skip_layers", (self.skip_layers,))
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if not isinstance(self.kfac_approx, str):
            object.__setattr__(self, "kfac_approx", dict(self.kfac_approx))
        _ = self.schedules  # the hyper-parameters are validated with the rest

    def _check_rank_fits(self) -> None:
        """Check that the rank chosen by the energy rule is exact in ``inv_dtype``.

        It must be exact there (16-bit floats hold whole numbers up to 256 or 2048 only).
        """
        low_rank, inv_dtype = self.low_rank, self.inv_dtype
        if low_rank is None or self.low_rank_energy is None or not inv_dtype.is_floating_point:
            return
        exact_up_to = round(2 / torch.finfo(inv_dtype).eps)
        if low_rank > exact_up_to:
            raise ValueError(f"low_rank={low_rank} with low_rank_energy: the rank travels in "
                             f"inv_dtype={inv_dtype}, exact only up to {exact_up_to}; use a "
                             "smaller low_rank or inv_dtype=torch.float32")

    @cached_property
    def schedules(self) -> Schedules:
        """The hyper-parameters as validated schedules of the step."""
        return Schedules(
            damping=positive("damping", self.damping),
            factor_decay=unit_interval("factor_decay", self.factor_decay),
            kl_clip=None if self.kl_clip is None else positive("kl_clip", self.kl_clip),
            lr=non_negative("lr", self.lr),
            factor_update_steps=whole_positive("factor_update_steps", self.factor_update_steps),
            inv_update_steps=whole_positive("inv_update_steps", self.inv_update_steps))

    @property
    def sends_factors(self) -> bool:
        """Whether factors are reduced over ranks (not under DP-KFAC)."""
        return sends_factors(self.strategy)

    @property
    def deferred(self) -> bool:
        """Whether factors are synchronised at inverse steps only (``factor_sync``)."""
        return self.factor_sync == "inverse"

    def message_settings(self, factor_dtype: torch.dtype) -> dict[str, Any]:
        """The options that fix placement, message layouts and which steps send what.

        Agreed by all ranks; a schedule given as a callable is agreed as one.
        """

        def steps(value: Any) -> Any:
            return "<schedule>" if callable(value) else value

        return {"factor_update_steps": steps(self.factor_update_steps),
                "inv_update_steps": steps(self.inv_update_steps),
                "decomposition_lag": self.decomposition_lag,
                "input_shape": self.input_shape, "strategy": self.strategy,
                "grad_worker_fraction": self.grad_worker_fraction,
                "factor_dtype": str(factor_dtype), "overlap": self.overlap,
                "bucket_cap_mb": self.bucket_cap_mb, "factor_sync": self.factor_sync,
                "symmetric_packing": self.symmetric_packing,
                "local_decomposition_threshold": self.local_decomposition_threshold,
                "compute_method": self.compute_method, "low_rank": self.low_rank,
                "low_rank_min_dim": self.low_rank_min_dim}

    def to_json(self, *, grad_workers: int, world_size: int, factor_dtype: torch.dtype,
                stats_precision: str, precondition_precision: str) -> dict[str, Any]:
        """The settings, JSON-able (schedules shown as ``"<schedule>"``).

        Args:
            grad_workers: Gradient workers per layer of the placement.
            world_size: Ranks the preconditioner runs on.
            factor_dtype: The factor dtype in use (chosen from the model when unset).
            stats_precision: The resolved precision of the statistics GEMMs.
            precondition_precision: The resolved precision of preconditioning.

        Returns:
            What :meth:`KFACPreconditioner.config` returns.
        """
        s = self.schedules
        sched = {x.name: x.describe() for x in (s.damping, s.factor_decay, s.lr,
                                                s.factor_update_steps, s.inv_update_steps)}
        return {"strategy": self.strategy, "grad_workers": grad_workers,
                "compute_method": self.compute_method,
                "kl_clip": None if s.kl_clip is None else s.kl_clip.describe(),
                "factor_dtype": str(factor_dtype), "inv_dtype": str(self.inv_dtype),
                "symmetric_packing": self.symmetric_packing, "overlap": self.overlap,
                "bucket_cap_mb": self.bucket_cap_mb, "factor_sync": self.factor_sync,
                "local_decomposition_threshold": self.local_decomposition_threshold,
                "kfac_approx": self.kfac_approx, "low_rank": self.low_rank,
                "low_rank_energy": self.low_rank_energy,
                "low_rank_min_dim": self.low_rank_min_dim,
                "low_rank_remainder": self.low_rank_remainder,
                "decomposition_lag": self.decomposition_lag,
                "eigen_refresh": self.eigen_refresh,
                "host_decomposition_max_dim": self.host_decomposition_max_dim,
                "decomposition_streams": self.decomposition_streams,
                "cuda_graphs": self.cuda_graphs,
                "stats_precision": stats_precision,
                "precondition_precision": precondition_precision,
                "accumulation_steps": self.accumulation_steps, "world_size": world_size,
                **sched}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float32`` as ``"float32"`` (``None`` stays ``None``).

    Args:
        dtype: A torch dtype, or ``None``.

    Returns:
        Its name without ``torch.``.
    """
    return None if dtype is None else str(dtype).removeprefix("torch.")


def batch_shape(input_shape: Any) -> tuple[int, ...] | None:
    """``input_shape`` validated: one rank's input batch, e.g. ``(32, 3, 32, 32)``.

    Args:
        input_shape: An iterable of positive integers, or ``None``.

    Returns:
        The shape as a tuple (``None`` stays ``None``).
    """
    if input_shape is None:
        return None
    shape = tuple(input_shape)
    if len(shape) < 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                                 for d in shape):
        raise ValueError(f"input_shape must be one rank's input batch shape, (batch, *sample) "
                         f"with positive integers, e.g. (32, 3, 32, 32); got {input_shape!r}")
    return shape
