"""The training steps whose metrics are still on the device: read in one go at a read point.

Reading a step's loss to the host synchronises a GPU: the host then cannot queue the
next step while this one runs. So the driver keeps each step's loss and accuracy as
0-d device tensors (:meth:`PendingMetrics.add`, no host read) and reads all of them at
the next *read point* (:meth:`PendingMetrics.read`): one device-to-host read for the
whole block, one collective for the global sums, then the steps' global metrics in
order, as each would have had them when read one by one.

Values and order of the sums are those of a step read alone: a rank's value is
``(float(loss_sum) / n) * n`` in float64, and the ranks' values are gathered and added in
rank order on the host, so the metrics do not depend on how many steps a block holds
(an allreduce may sum a longer message in another order).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["PendingMetrics", "StepInfo", "StepMetrics", "read_columns"]


@dataclass(frozen=True)
class StepInfo:
    """What the host knows of a step when it ends (no device value).

    Attributes:
        step: The step (1-based, counted over the run).
        epoch: Its epoch (0-based).
        epoch_progress: The epochs done after it, fractional (e.g. 2.25).
        lr: Its learning rate.
        fields: Its step record's own fields (phase times, bytes), for a logged step;
            None for a step without a record.
    """

    step: int
    epoch: int
    epoch_progress: float
    lr: float
    fields: Mapping[str, float] | None = None


@dataclass(frozen=True)
class StepMetrics:
    """A step's global metrics, as read at a read point.

    Attributes:
        info: What the host knew of the step when it ended.
        loss_sum: The loss summed over the step's samples of every rank.
        correct: Its correct predictions on every rank.
        samples: Its samples on every rank.
        seconds: Its wall time: the block's wall time (its steps and the read) shared
            equally by its steps, since a step's own time on a device is not known
            without a sync.
    """

    info: StepInfo
    loss_sum: float
    correct: float
    samples: int
    seconds: float

    @property
    def loss(self) -> float:
        """The global mean loss per sample."""
        return self.loss_sum / self.samples

    @property
    def acc(self) -> float:
        """The global share of correct predictions."""
        return self.correct / self.samples


def read_columns(*columns: list[torch.Tensor]) -> list[list[float]]:
    """Read lists of 0-d device tensors to the host in one read (one sync on a GPU).

    Args:
        columns: Lists of equal length of 0-d tensors (any dtype, one device).

    Returns:
        Per column, its values as float64 Python floats, in order.
    """
    values = torch.cat([torch.stack(c).to(torch.float64) for c in columns]).tolist()
    n = len(columns[0])
    return [values[i * n:(i + 1) * n] for i in range(len(columns))]


@dataclass
class _Step:
    info: StepInfo
    loss_sum: torch.Tensor
    correct: torch.Tensor
    samples: int


class PendingMetrics:
    """This rank's metrics of the steps since the last read point, kept on the device.

    Every rank holds the same steps (read points are agreed), so :meth:`read` is a
    collective that every rank joins with blocks of the same length.
    """

    def __init__(self, comm: Communicator | None) -> None:
        """Start with no step waiting; the block's clock starts now.

        Args:
            comm: The ranks whose metrics are summed (None or one rank: none to sum).
        """
        self.comm = comm
        self._steps: list[_Step] = []
        self._since = time.perf_counter()

    def __len__(self) -> int:
        """The number of steps waiting for a read."""
        return len(self._steps)

    def restart_clock(self) -> None:
        """Start the block's wall time now (what came before is no step's time)."""
        self._since = time.perf_counter()

    def add(self, info: StepInfo, loss_sum: torch.Tensor, correct: torch.Tensor,
            samples: int) -> None:
        """Keep a step's values until the next read (no host read, no device sync).

        Args:
            info: What the host knows of the step.
            loss_sum: This rank's loss summed over its samples (0-d, any device).
            correct: This rank's correct predictions (0-d, any device).
            samples: This rank's samples.
        """
        self._steps.append(_Step(info, loss_sum, correct, samples))

    def read(self) -> list[StepMetrics]:
        """Read the waiting steps' global metrics and start a new block (collective).

        One device-to-host read of every value, one allgather over ``comm``.

        Returns:
            The steps' global metrics, in order (empty when none was waiting).
        """
        steps, self._steps = self._steps, []
        if not steps:
            return []
        k = len(steps)
        losses, correct = read_columns([s.loss_sum for s in steps], [s.correct for s in steps])
        local = np.empty((k, 3), dtype=np.float64)
        for i, s in enumerate(steps):
            # as a step read alone: its mean loss to a Python float, times its samples
            local[i] = ((losses[i] / s.samples) * s.samples, correct[i], s.samples)
        total = self._sum_over_ranks(local)
        seconds = (time.perf_counter() - self._since) / k
        self._since = time.perf_counter()
        return [StepMetrics(info=s.info, loss_sum=float(total[i, 0]),
                            correct=float(total[i, 1]), samples=int(total[i, 2]),
                            seconds=seconds)
                for i, s in enumerate(steps)]

    def _sum_over_ranks(self, local: np.ndarray) -> np.ndarray:
        """Add every rank's ``local`` in rank order (the same result on every rank).

        Args:
            local: This rank's values.

        Returns:
            Their sum over the ranks.
        """
        if self.comm is None or self.comm.size == 1:
            return local
        gathered = np.empty((self.comm.size, *local.shape), dtype=np.float64)
        self.comm.allgather(local, out=gathered)
        total: np.ndarray = gathered[0].copy()
        for part in gathered[1:]:
            total += part
        return total
