"""What a run of the driver returns: :class:`TrainResult`, why it stopped, its summary."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from kfac_hpc.step_graph import describe
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.metrics import format_bytes

__all__ = ["LANGUAGE_DATASETS", "StopReason", "TrainResult", "param_checksum", "perplexity"]

LANGUAGE_DATASETS = ("stdlib-text",)
"""Data sets of next-token prediction: their records add perplexity (``exp`` of the mean
per-token cross-entropy); accuracy there is next-token accuracy."""


class StopReason(str, Enum):
    """Why a run ended; the value is what summaries, metrics and JSON files hold."""

    COMPLETED = "completed"
    """Every configured epoch ran."""
    MAX_STEPS = "max_steps"
    """``max_steps`` ended the run before the last epoch."""
    TARGET = "target"
    """The test accuracy reached ``target_accuracy``."""
    STOP_REQUESTED = "stop_requested"
    """A rank's ``should_stop`` said so (a signal): checkpointed, not evaluated."""

    def __str__(self) -> str:
        """Return the value, as in the summaries (``completed``, ``max_steps``, ...)."""
        return self.value


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean per-token cross-entropy (``inf`` on overflow, NaN stays).

    Args:
        loss: Mean per-token cross-entropy (nats).

    Returns:
        The perplexity.
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def param_checksum(model: nn.Module) -> str:
    """SHA-256 of the parameters' names and bytes (named order).

    Args:
        model: The model whose parameters are hashed.

    Returns:
        The hex digest: equal on two models iff their parameters are bitwise equal.
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class TrainResult:
    """What a run achieved; identical on every rank (metrics are global)."""

    epochs: float
    steps: int
    wall_time: float
    setup_time: float
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    samples_per_s: float
    bytes_per_step: float
    checksum: str
    ranks_agree: bool
    stopped: StopReason
    world_size: int
    global_batch_size: int
    device: str
    averaging: str
    out_dir: str | None
    time_to_target: float | None = None
    epochs_to_target: int | None = None
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    #: the optimizer's CUDA graph (``kfac_hpc.step_graph.StepGraph.report``): the fewest
    #: captures and replays over the ranks that have one, and why it is off, if it is
    step_graph: dict[str, Any] | None = None
    model: nn.Module | None = field(default=None, repr=False)

    def summary_rows(self, cfg: TrainConfig) -> list[tuple[str, str]]:
        """Rows of the final summary table.

        Args:
            cfg: The run's configuration (data set, model, optimizer, target).

        Returns:
            ``(label, value)`` rows, in print order.
        """
        rows = [
            ("ranks x device", f"{self.world_size} x {self.device}"),
            ("data / model", f"{cfg.dataset} / {cfg.model}"),
            ("optimizer", cfg.describe_optimizer()),
            ("gradient averaging", self.averaging),
            ("global batch", str(self.global_batch_size)),
            ("epochs / steps", f"{self.epochs:g} / {self.steps}"),
            ("wall time", f"{self.wall_time:.1f} s (+ {self.setup_time:.1f} s setup)"),
            ("final train loss", f"{self.train_loss:.4f}"),
            ("final train accuracy", f"{100 * self.train_acc:.2f} %"),
            ("test loss", f"{self.test_loss:.4f}"),
            ("test accuracy", f"{100 * self.test_acc:.2f} %"),
            *([("test perplexity", f"{perplexity(self.test_loss):.3f}")]
              if cfg.dataset in LANGUAGE_DATASETS else []),
            ("samples/s (training)", f"{self.samples_per_s:,.0f}"),
            ("communicated per step", format_bytes(self.bytes_per_step)),
            ("parameter checksum", self.checksum[:16]
             + ("" if self.ranks_agree else "  (RANKS DIFFER!)")),
        ]
        if self.stopped != StopReason.COMPLETED:
            rows.insert(5, ("stopped by", self.stopped.value.replace("_", " ")))
        if cfg.target_accuracy is not None:
            reached = (f"epoch {self.epochs_to_target}, {self.time_to_target:.1f} s"
                       if self.time_to_target is not None else "not reached")
            rows.insert(-3, (f"time to {100 * cfg.target_accuracy:g} %", reached))
        if self.step_graph is not None:
            rows.append(("step graph (CUDA, fewest of the ranks)", describe(self.step_graph)))
        if self.out_dir:
            rows.append(("metrics", self.out_dir))
        return rows
