"""Optimizers, the K-FAC preconditioner on top of them, gradient averaging, LR schedule.

* :func:`lr_at` is the learning rate as a pure function of the step (linear warm-up,
  then cosine / step / constant), so a resumed run continues the same curve.
* :func:`build_optimizer`: SGD (momentum, Nesterov), Adam, AdamW, or
  :class:`kfac_hpc.shampoo.DistributedShampoo`.
* :func:`build_preconditioner`: :class:`kfac_hpc.KFACPreconditioner` whose ``lr``
  follows the optimizer's current learning rate (needed by KL clipping).
* :func:`build_averager`: :class:`kfac_hpc.GradientAverager` (bucketed, overlapping
  backward).

The library's parts are imported directly (typed; mypy checks the driver against
them), inside the functions so that importing the driver does not start MPI.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kfac_hpc.kfac.options import (
    APPROXIMATIONS,
    COMPUTE_METHODS,
    EIGEN_REFRESHES,
    FACTOR_SYNCS,
    LOW_RANK_REMAINDERS,
    PRECISION_OPTIONS,
    STRATEGIES,
    one_of,
)
from kfac_hpc.train.config import TrainConfig

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator
    from kfac_hpc.comm.gradients import GradientAverager
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = [
    "build_averager",
    "build_optimizer",
    "build_preconditioner",
    "lr_at",
    "lr_schedule",
]


# ------------------------------------------------------------------- schedule


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    min_lr: float = 0.0,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based); a pure function, never compounding.

    * warm-up, ``step < warmup_steps``: ``base_lr * (step + 1) / warmup_steps``;
    * ``cosine``: ``min_lr + (base_lr - min_lr) * (1 + cos(pi * t)) / 2`` with
      ``t = (step - warmup_steps) / (total_steps - warmup_steps)`` clipped to [0, 1];
    * ``step``: ``base_lr * gamma ** (number of milestones <= step)``;
    * ``constant``: ``base_lr``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule == "step":
        return base_lr * gamma ** sum(1 for m in milestones if step >= m)
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        t = min(1.0, (step - warmup_steps) / span)
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"unknown lr schedule {schedule!r}; use cosine, step or constant")


def schedule_length(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """The steps a run trains, which its learning-rate schedule spans.

    Args:
        steps_per_epoch: Optimizer steps per epoch.
        epochs: ``--epochs``.
        max_steps: ``--max-steps`` (None or 0: none): it also ends the schedule.
    """
    full = steps_per_epoch * epochs
    return min(full, max_steps) if max_steps else full


def saved_schedule_length(config: Mapping[str, Any], steps_per_epoch: int) -> int | None:
    """:func:`schedule_length` of a checkpoint's stored configuration (None: not stored)."""
    try:
        max_steps = config.get("max_steps")
        return schedule_length(steps_per_epoch, int(config["epochs"]),
                               int(max_steps) if max_steps else None)
    except (KeyError, TypeError, ValueError):
        return None


def lr_schedule(cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
    """``step -> lr`` for ``cfg`` (warm-up and milestones given in epochs -> steps)."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    milestones = tuple(round(m * steps_per_epoch) for m in cfg.lr_milestones)
    base_lr = cfg.base_lr

    def fn(step: int) -> float:
        return lr_at(step, base_lr=base_lr, total_steps=total_steps, warmup_steps=warmup,
                     schedule=cfg.lr_schedule, milestones=milestones, gamma=cfg.lr_gamma,
                     min_lr=cfg.min_lr)

    return fn


# ----------------------------------------------------------------- optimizers


def build_optimizer(cfg: TrainConfig, model: nn.Module,
                    comm: Communicator | None = None) -> torch.optim.Optimizer:
    """Build the base optimizer of ``cfg`` over ``model``'s trainable parameters.

    Its lr is ``cfg.lr``; the loop overwrites it every step from the schedule.

    Args:
        cfg: The run's configuration.
        model: The model.
        comm: The training communicator (Shampoo's).

    Returns:
        The optimizer.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.base_lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    if cfg.optimizer in ("adam", "adamw"):
        cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
        b1, b2 = cfg.betas
        return cls(params, lr=lr, betas=(b1, b2), eps=cfg.eps,
                   weight_decay=cfg.weight_decay)
    if cfg.optimizer == "shampoo":
        from kfac_hpc.shampoo import DistributedShampoo

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # --momentum/--eps are SGD's/Adam's; Shampoo's own (momentum, epsilon,
        # grafting, ...) go through --shampoo-options.
        kwargs: dict[str, Any] = {"lr": lr, "comm": comm}
        accepted = _parameters(DistributedShampoo)
        for key, value in (("weight_decay", cfg.weight_decay), ("betas", tuple(cfg.betas)),
                           ("host_decomposition_max_dim", cfg.host_decomposition_max_dim),
                           ("decomposition_streams", cfg.decomposition_streams)):
            if key in accepted:
                kwargs[key] = value
        unknown = sorted(set(cfg.shampoo_options) - accepted) if accepted else []
        if unknown and "kwargs" not in accepted:
            raise ValueError(f"--shampoo-options: DistributedShampoo takes no "
                             f"{', '.join(unknown)}; it takes {', '.join(sorted(accepted))}")
        kwargs.update(cfg.shampoo_options)
        if "root_method" in kwargs:  # a name or call-like string from the command line
            from kfac_hpc.shampoo import root_method_from

            kwargs["root_method"] = root_method_from(kwargs["root_method"])
        return DistributedShampoo(named, **kwargs)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def _parameters(fn: Callable[..., object]) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {("kwargs" if p.kind is p.VAR_KEYWORD else p.name) for p in params}


def build_preconditioner(cfg: TrainConfig, model: nn.Module, comm: Communicator,
                         optimizer: torch.optim.Optimizer,
                         grad_scaler: torch.amp.GradScaler | None = None,
                         sample_shape: tuple[int, ...] | None = None
                         ) -> KFACPreconditioner | None:
    """``KFACPreconditioner`` for ``cfg`` (``None`` without K-FAC).

    Its ``lr`` is a callable returning the optimizer's current learning rate, so KL
    clipping follows the schedule (the loop sets the lr before each ``step()``).
    ``sample_shape`` (one input's shape) gives it ``input_shape=(batch, *sample_shape)``.
    """
    if not cfg.uses_kfac:
        return None
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

    def current_lr(_step: int = 0) -> float:
        return float(optimizer.param_groups[0]["lr"])

    return KFACPreconditioner(
        model,
        comm=comm,
        strategy=one_of("kfac_strategy", cfg.kfac_strategy, STRATEGIES),
        grad_worker_fraction=cfg.grad_worker_fraction,
        compute_method=one_of("kfac_compute_method", cfg.kfac_compute_method, COMPUTE_METHODS),
        damping=cfg.base_damping,
        factor_decay=cfg.factor_decay,
        kl_clip=cfg.kl_clip,
        lr=current_lr,
        factor_update_steps=cfg.base_update_steps[0],
        inv_update_steps=cfg.base_update_steps[1],
        skip_layers=tuple(cfg.skip_layers),
        accumulation_steps=cfg.accumulation_steps,
        grad_scaler=grad_scaler,
        symmetric_packing=cfg.kfac_symmetric_packing,
        overlap=cfg.kfac_overlap,
        bucket_cap_mb=cfg.kfac_bucket_cap_mb,
        factor_sync=one_of("kfac_factor_sync", cfg.kfac_factor_sync, FACTOR_SYNCS),
        factor_dtype=None if cfg.kfac_factor_dtype == "auto" else getattr(
            torch, cfg.kfac_factor_dtype),
        inv_dtype=getattr(torch, cfg.kfac_inv_dtype),
        input_shape=None if sample_shape is None else (cfg.batch_size, *sample_shape),
        kfac_approx=one_of("kfac_approx", cfg.kfac_approx, APPROXIMATIONS),
        low_rank=cfg.low_rank,
        low_rank_energy=cfg.low_rank_energy,
        low_rank_min_dim=cfg.low_rank_min_dim,
        low_rank_remainder=one_of("low_rank_remainder", cfg.low_rank_remainder,
                                  LOW_RANK_REMAINDERS),
        decomposition_lag=cfg.kfac_decomposition_lag,
        eigen_refresh=one_of("kfac_eigen_refresh", cfg.kfac_eigen_refresh, EIGEN_REFRESHES),
        stats_precision=one_of("kfac_stats_precision", cfg.kfac_stats_precision,
                               PRECISION_OPTIONS),
        precondition_precision=one_of("kfac_precondition_precision",
                                      cfg.kfac_precondition_precision, PRECISION_OPTIONS),
        host_decomposition_max_dim=cfg.host_decomposition_max_dim,
        decomposition_streams=cfg.decomposition_streams,
        cuda_graphs=cfg.kfac_cuda_graphs,
    )


# ------------------------------------------------------------------ averaging


def build_averager(model: nn.Module, comm: Communicator,
                   bucket_cap_mb: float = 25.0) -> tuple[GradientAverager, str]:
    """``(averager, name)``: the library's bucketed :class:`~kfac_hpc.GradientAverager`."""
    from kfac_hpc.comm.gradients import GradientAverager

    return GradientAverager(model, comm, bucket_cap_mb=bucket_cap_mb), "MPI GradientAverager"
