"""The phases of a training step, declared once, and the timer that measures them.

Two vocabularies, each spelled in one place:

* :class:`Traffic`: what the bytes a communicator sends are for. The library tags its
  collectives with it (``with comm.stats.tagged(Traffic.FACTORS): ...``), the planner
  predicts bytes per member and the driver records ``bytes_<tag>`` per step.
* :class:`Phase`: the timed parts of a step. The library declares the phase of a method
  where the method is defined (``@timed(Phase.KFAC_FACTORS)``); the driver and the
  benchmarks hand the object a :class:`PhaseTimer` (its ``phase_timer`` attribute) and
  read the seconds per phase back. Nothing outside the library wraps its methods.

A disabled timer (or none) costs one attribute read per timed call; an enabled one
synchronises a CUDA device at both ends of a phase, so that the time is the work's and
not the launch's. While a ``torch.profiler`` records, every phase (and K-FAC's statistics
in the hooks, :func:`profiler_range`) is also a named range, ``kfac_hpc.<phase>``, so
traces and ``key_averages()`` show where the library's time goes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

__all__ = ["PHASES", "TRAFFIC_TAGS", "Phase", "PhaseTimer", "Timed", "Traffic", "profiler_range",
           "timed"]


class _Name(str, Enum):
    """A string-valued member that prints as its value (``f"time_{phase}"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Traffic(_Name):
    """What the bytes of a collective are for (K-FAC's phases of communication)."""

    FACTORS = "factors"
    """Factor statistics summed onto their owners (and local factors' allreduce)."""
    DECOMPOSITIONS = "decompositions"
    """Eigenbases or inverses broadcast in a layer's gradient-worker group."""
    GRADIENTS = "gradients"
    """Preconditioned gradients broadcast to the ranks that did not compute them."""
    AGREEMENT = "agreement"
    """The counters ranks agree on before acting on a fault (one integer each)."""


class Phase(_Name):
    """A timed part of a training step; recorded as ``time_<value>`` (seconds)."""

    FORWARD_BACKWARD = "forward_backward"
    """The model's forward and backward (with K-FAC's overlapped factor reductions)."""
    GRAD_SYNC = "grad_sync"
    """Averaging the gradients over the ranks."""
    KFAC = "kfac"
    """K-FAC's ``step()`` as a whole."""
    KFAC_FACTORS = "kfac_factors"
    """Factor update: statistics to their owners, running averages."""
    KFAC_DECOMPOSITIONS = "kfac_decompositions"
    """Inverse update: decompositions computed (or installed) and broadcast."""
    KFAC_DECOMPOSE = "kfac_decompose"
    """Computing this rank's decompositions in the step (inside ``kfac_decompositions``;
    background ones, ``decomposition_lag``, are not timed)."""
    KFAC_AVERAGES = "kfac_averages"
    """Folding statistics into the running or local averages (inside ``kfac_factors``)."""
    KFAC_PRECONDITION = "kfac_precondition"
    """Preconditioning of the layers this rank is a gradient worker of."""
    KFAC_GRADIENTS = "kfac_gradients"
    """Sharing the preconditioned gradients with the receiver groups."""
    OPTIMIZER = "optimizer"
    """The base optimizer's step (Shampoo's whole step)."""
    SHAMPOO_BLOCKS = "shampoo_blocks"
    """Shampoo: statistics, roots and directions of the blocks this rank owns."""
    SHAMPOO_APPLY = "shampoo_apply"
    """Shampoo: applying the exchanged directions to the parameters."""


#: Every phase's record name, in declaration order.
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)
#: Every traffic tag, in declaration order.
TRAFFIC_TAGS: tuple[str, ...] = tuple(t.value for t in Traffic)


class PhaseTimer:
    """Seconds per :class:`Phase` of the current step, while ``enabled``.

    ``with timer.phase(Phase.OPTIMIZER): ...`` adds the block's wall time. On CUDA the
    device is synchronised at both ends while enabled (steps that are not recorded pay
    nothing). Nested phases are each timed in full (an outer phase includes its inner
    ones).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        """Make a disabled timer.

        Args:
            device: The device the timed work runs on; CUDA devices are synchronised
                around each phase. ``None`` or a CPU device: no synchronisation.
        """
        self.enabled = False
        self.cuda = device is not None and device.type == "cuda"
        self.times: dict[Phase, float] = {}

    def start(self, enabled: bool) -> None:
        """Begin a step: clear the times, and time this step only if ``enabled``.

        Args:
            enabled: Whether the phases of this step are timed.
        """
        self.enabled = enabled
        self.times = {}

    def _sync(self) -> None:
        # the current stream only: work a phase hands to other streams is joined to it
        # (statistics, stream lanes); a background job's stream is not, and waiting for
        # it would time the job into the phase and undo its overlap on timed steps
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Time the block as ``phase`` (added to the phase's seconds of this step).

        Args:
            phase: The phase the block's time belongs to.

        Yields:
            Nothing; the block runs inside.
        """
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def seconds(self, phase: Phase) -> float:
        """Return the seconds spent in ``phase`` this step (0.0 if it did not run).

        Args:
            phase: The phase asked for.

        Returns:
            Its accumulated wall time.
        """
        return self.times.get(phase, 0.0)

    def record(self) -> dict[str, float]:
        """Return the step's times as record fields.

        Returns:
            ``{"time_<phase>": seconds}`` for the phases that ran this step.
        """
        return {f"time_{p.value}": self.times[p] for p in Phase if p in self.times}


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``kfac_hpc.<name>`` while a profiler records.

    Args:
        name: The range's name after ``kfac_hpc.`` (a :class:`Phase`'s value, or
            ``kfac_statistics`` for the hooks' statistics).

    Returns:
        ``torch.profiler.record_function`` while a profiler records, else a context that
        does nothing (the check costs about 0.1 µs).
    """
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"kfac_hpc.{name}")
    return nullcontext()


class Timed(Protocol):
    """An object whose methods declare their phase: it holds the timer to report to."""

    phase_timer: PhaseTimer | None


_S = TypeVar("_S", bound=Timed)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def timed(phase: Phase) -> Callable[[Callable[Concatenate[_S, _P], _R]],
                                    Callable[Concatenate[_S, _P], _R]]:
    """Declare that a method does ``phase``: it is timed by its object's ``phase_timer``.

    Args:
        phase: The phase the method's calls belong to.

    Returns:
        A decorator for methods of a class with a ``phase_timer`` attribute
        (:class:`Timed`); the call runs untimed when that is ``None`` or disabled.
    """

    def decorate(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
        @functools.wraps(method)
        def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            timer = self.phase_timer
            with profiler_range(phase.value):
                if timer is None or not timer.enabled:
                    return method(self, *args, **kwargs)
                with timer.phase(phase):
                    return method(self, *args, **kwargs)

        run.phase = phase  # type: ignore[attr-defined]
        return run

    return decorate
