"""The driver's checkpoint ``extra``: its one layout, written and read here.

:func:`kfac_hpc.checkpoint.save` stores ``extra`` under ``/train`` of the file
(nested names, JSON-like values). The driver's layout::

    loader        ShardedLoader.state_dict(): epoch, batch index, global batch, seed
    epoch         the loader's epoch (informative)
    metrics       history        the epoch records so far
                  train_time     seconds of training steps so far
                  train_samples  samples trained on so far (all ranks)
                  epoch_stats    [loss_sum, correct, count] of the epoch in progress
                  loss_range     window: the last finite global losses;
                                 left: [step, loss, median, n] where the loss left its
                                 running range, or None
                  best           {metric, value, step, checkpoint} (--checkpoint-keep-best)
    config        TrainConfig.to_dict() of the run that wrote it
    grad_scaler   torch.amp.GradScaler.state_dict() (AMP float16 only)

Checkpoints written by earlier versions (or by the library API, without the driver)
lack some of these keys; they read as empty (no loader position, no metrics, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Best", "LeftRange", "TrainExtra"]


@dataclass(frozen=True)
class LeftRange:
    """Where the global loss left its running range (see :mod:`kfac_hpc.train.divergence`).

    Attributes:
        step: The first step of the out-of-range steps.
        loss: Its global loss (NaN/Inf, or above the range).
        median: The median of the window before it (NaN with too few steps).
        n: How many steps that window held.
    """

    step: int
    loss: float
    median: float
    n: int

    def to_list(self) -> list[float]:
        """Give the stored form.

        Returns:
            ``[step, loss, median, n]`` as floats.
        """
        return [float(self.step), self.loss, self.median, float(self.n)]

    @classmethod
    def from_list(cls, values: Any) -> LeftRange | None:
        """Read the stored form.

        Args:
            values: ``[step, loss, median, n]``, or None/empty.

        Returns:
            The range, or None when ``values`` is empty.
        """
        if not values:
            return None
        step, loss, median, n = (float(v) for v in values)
        return cls(step=int(step), loss=loss, median=median, n=int(n))


@dataclass(frozen=True)
class Best:
    """The best epoch so far by ``--checkpoint-keep-best`` and its checkpoint's file name.

    Attributes:
        metric: The metric (a key of :data:`kfac_hpc.train.config.KEEP_BEST_METRICS`).
        value: Its best value so far.
        step: The step of that checkpoint.
        checkpoint: The checkpoint's file name (kept by the rotation).
    """

    metric: str
    value: float
    step: int
    checkpoint: str

    def to_dict(self) -> dict[str, Any]:
        """Give the stored form.

        Returns:
            ``{"metric", "value", "step", "checkpoint"}``.
        """
        return {"metric": self.metric, "value": self.value, "step": self.step,
                "checkpoint": self.checkpoint}

    @classmethod
    def from_dict(cls, values: Any) -> Best | None:
        """Read the stored form.

        Args:
            values: What :meth:`to_dict` gave, or None/empty.

        Returns:
            The best so far, or None when ``values`` is empty.
        """
        if not values:
            return None
        return cls(metric=str(values["metric"]), value=float(values["value"]),
                   step=int(values["step"]), checkpoint=str(values["checkpoint"]))


@dataclass(frozen=True)
class TrainExtra:
    """Everything the driver keeps in a checkpoint besides the library's state.

    Attributes:
        loader: The training loader's position (None: none stored; resume at its start).
        epoch: The loader's epoch.
        history: The epoch records so far.
        train_time: Seconds of training steps so far.
        train_samples: Samples trained on so far, on all ranks.
        epoch_stats: ``(loss_sum, correct, count)`` of the epoch in progress.
        loss_window: The last finite global losses (the running range's window).
        left_range: Where the loss left its running range, if it has.
        best: The best epoch so far by ``--checkpoint-keep-best``, if any.
        config: The configuration of the run that wrote it.
        grad_scaler: The AMP gradient scaler's state, if any.
    """

    loader: dict[str, Any] | None = None
    epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_time: float = 0.0
    train_samples: int = 0
    epoch_stats: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loss_window: tuple[float, ...] = ()
    left_range: LeftRange | None = None
    best: Best | None = None
    config: dict[str, Any] = field(default_factory=dict)
    grad_scaler: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Give the ``extra`` to pass to :func:`kfac_hpc.checkpoint.save` (layout above).

        Returns:
            The nested dict.
        """
        extra: dict[str, Any] = {
            "loader": self.loader,
            "epoch": self.epoch,
            "metrics": {"history": self.history, "train_time": self.train_time,
                        "train_samples": self.train_samples,
                        "epoch_stats": list(self.epoch_stats),
                        "loss_range": {"window": list(self.loss_window),
                                       "left": (None if self.left_range is None
                                                else self.left_range.to_list())},
                        "best": None if self.best is None else self.best.to_dict()},
            "config": self.config,
        }
        if self.grad_scaler is not None:
            extra["grad_scaler"] = self.grad_scaler
        return extra

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any] | None) -> TrainExtra:
        """Read a checkpoint's ``extra`` (any version; missing keys read as empty).

        Args:
            extra: ``LoadInfo.extra`` of a loaded checkpoint (None: nothing stored).

        Returns:
            The driver's state in it.
        """
        extra = dict(extra or {})
        metrics = dict(extra.get("metrics") or {})
        loss_range = dict(metrics.get("loss_range") or {})
        loader = extra.get("loader")
        stats = tuple(float(v) for v in metrics.get("epoch_stats", (0.0, 0.0, 0.0)))
        return cls(
            loader=dict(loader) if loader is not None else None,
            epoch=int(extra.get("epoch", 0) or 0),
            history=list(metrics.get("history", [])),
            train_time=float(metrics.get("train_time", 0.0)),
            train_samples=int(metrics.get("train_samples", 0)),
            epoch_stats=(stats[0], stats[1], stats[2]),
            loss_window=tuple(float(v) for v in loss_range.get("window", ())),
            left_range=LeftRange.from_list(loss_range.get("left")),
            best=Best.from_dict(metrics.get("best")),
            config=dict(extra.get("config") or {}),
            grad_scaler=extra.get("grad_scaler"),
        )
