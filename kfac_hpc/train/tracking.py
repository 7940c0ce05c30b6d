"""What the driver counts and shows while it trains.

* :class:`RunTally`: training time, samples and epoch records (kept across a resume).
* :class:`TrafficMeter`: bytes of the training communicator per step, less what metrics
  and checkpoints put on it.
* :class:`Progress`: what rank 0 prints: a tqdm bar on a terminal, else a progress line
  every ``--progress-every-steps`` steps or ``--progress-every-minutes``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.metrics import TRAFFIC_TAGS, ProgressReporter, WeightedMean

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["Progress", "RunTally", "TrafficMeter", "gradient_bytes"]


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s gradients: what torch DDP reduces per step.

    Args:
        model: The model.

    Returns:
        The bytes of its trainable parameters.
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@dataclass
class RunTally:
    """Totals of the training steps so far (restored on resume).

    Attributes:
        history: The epoch records.
        train_time: Seconds spent in training steps.
        train_samples: Samples trained on, on all ranks.
        epoch_stats: Global loss and accuracy of the epoch in progress.
    """

    history: list[dict[str, Any]] = field(default_factory=list)
    train_time: float = 0.0
    train_samples: int = 0
    epoch_stats: WeightedMean = field(default_factory=WeightedMean)

    def add_step(self, loss_sum: float, correct: float, n: int, seconds: float) -> None:
        """Count one training step.

        Args:
            loss_sum: Its global loss summed over samples.
            correct: Its global number of correct predictions.
            n: Its global number of samples.
            seconds: Its wall time.
        """
        self.train_time += seconds
        self.train_samples += n
        self.epoch_stats.add(loss_sum / n, correct, n)

    @property
    def samples_per_s(self) -> float:
        """Training throughput over all steps so far (samples per second)."""
        return self.train_samples / max(self.train_time, 1e-9)


class TrafficMeter:
    """Bytes the training communicator put on the wire during training steps.

    Metric reductions and evaluation use another communicator; what a checkpoint puts
    on this one is excluded (:meth:`excluding`).

    Attributes:
        excluded: Bytes excluded so far.
    """

    def __init__(self, comm: Communicator, ddp_bytes_per_step: int = 0) -> None:
        """Meter ``comm``.

        Args:
            comm: The training communicator.
            ddp_bytes_per_step: Bytes torch DDP reduces per step (gloo/nccl, not seen
                by MPI's counters); 0 without DDP.
        """
        self.comm = comm
        self.ddp_bytes_per_step = ddp_bytes_per_step
        self.excluded = 0

    def total(self) -> int:
        """Bytes so far, less the excluded ones.

        Returns:
            The count.
        """
        return self.comm.traffic().total_bytes - self.excluded

    @contextlib.contextmanager
    def excluding(self) -> Iterator[None]:
        """Exclude what the block sends (a checkpoint).

        Yields:
            Nothing.
        """
        before = self.comm.traffic().total_bytes
        try:
            yield
        finally:
            self.excluded += self.comm.traffic().total_bytes - before

    def counts(self) -> dict[str, int]:
        """Bytes so far: ``step`` (all, less the excluded) and one entry per K-FAC tag.

        Returns:
            ``{"step": ..., <tag>: ...}`` (tags: :data:`TRAFFIC_TAGS`).
        """
        traffic = self.comm.traffic()
        counts = {"step": traffic.total_bytes - self.excluded}
        counts.update({tag: traffic.tag_bytes(tag) for tag in TRAFFIC_TAGS})
        return counts

    def per_step(self, bytes_start: int, steps: int) -> float:
        """Mean bytes per training step since a point of the run.

        Args:
            bytes_start: :meth:`total` at that point.
            steps: Steps taken since.

        Returns:
            Bytes per step (0 without steps).
        """
        if steps <= 0:
            return 0.0
        return (self.total() - bytes_start + steps * self.ddp_bytes_per_step) / steps


class Progress:
    """What rank 0 prints while training (nothing on the other ranks).

    A tqdm bar when a terminal is at hand (mpiexec gives ranks a pseudo-terminal for
    stdout only; srun none), else progress lines (:class:`ProgressReporter`) for
    batch output; neither with ``--no-progress``.
    """

    def __init__(self, cfg: TrainConfig, *, verbose: bool) -> None:
        """Set up; nothing is shown before :meth:`start`.

        Args:
            cfg: The run's configuration (its progress options).
            verbose: Print at all (rank 0 of a verbose run).
        """
        self.cfg = cfg
        self.verbose = verbose
        self._bar: Any = None
        self._reporter: ProgressReporter | None = None

    def start(self, *, total_steps: int, start_step: int) -> None:
        """Open the bar, or start the progress lines.

        Args:
            total_steps: Steps of the whole run.
            start_step: The step training starts at (a resumed run: its checkpoint's).
        """
        cfg = self.cfg
        if not (self.verbose and cfg.progress):
            return
        self._bar = _bar(total_steps, start_step)
        if self._bar is None:
            self._reporter = ProgressReporter(
                total_steps=total_steps, start_step=start_step, epochs=cfg.epochs,
                every_steps=cfg.progress_every_steps,
                every_minutes=cfg.progress_every_minutes)

    def print(self, text: str) -> None:
        """Print a line (above the bar, when there is one).

        Args:
            text: The line.
        """
        if not self.verbose:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def step(self, *, step: int, epoch: int, loss: float, acc: float, samples: int,
             seconds: float, epoch_progress: float) -> None:
        """Show a step's global metrics.

        Args:
            step: The step.
            epoch: Its epoch (0-based).
            loss: Its global mean loss.
            acc: Its global accuracy.
            samples: Its global number of samples.
            seconds: Its wall time.
            epoch_progress: The epochs done, fractional (e.g. 2.25).
        """
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(
                f"ep {epoch + 1}/{self.cfg.epochs} loss {loss:.3f} "
                f"acc {100 * acc:.1f}% {1000 * seconds:.0f} ms/step "
                f"{samples / seconds:,.0f} samples/s", refresh=False)
        elif self._reporter is not None:
            line = self._reporter.update(step, epoch_progress, loss, samples)
            if line is not None:
                self.print(line)

    def close(self) -> None:
        """Close the bar (later lines print plainly)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _bar(total_steps: int, start_step: int) -> Any:
    """Open a tqdm bar on the first terminal of stderr and stdout; None without either.

    Args:
        total_steps: Steps of the whole run.
        start_step: The step training starts at.

    Returns:
        The bar, or None (no terminal, or tqdm not installed).
    """
    stream = next((f for f in (sys.stderr, sys.stdout) if f.isatty()), None)
    if stream is None:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                file=stream, leave=False)
