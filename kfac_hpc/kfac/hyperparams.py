"""Hyper-parameters that are a constant or a callable of the K-FAC step.

A schedule is evaluated afresh at every step from the step number: it never
compounds (unlike multiplying the current value by a factor each epoch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Scalar = float | int | Callable[[int], float]


@dataclass(frozen=True)
class Schedule:
    """A named hyper-parameter: ``schedule(step)`` returns its validated value."""

    name: str
    value: Scalar
    check: Callable[[float], bool]
    requirement: str
    allow_none: bool = False

    def __post_init__(self) -> None:
        """Validate a constant value at once."""
        if not callable(self.value):
            self._validate(self.value)

    def __call__(self, step: int) -> float:
        """Return the validated value at ``step``."""
        value = self.value(step) if callable(self.value) else self.value
        return self._validate(value, step)

    def _validate(self, value: object, step: int | None = None) -> float:
        at = "" if step is None else f" (at step {step})"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{self.name} must be a number or a callable of the step, "
                            f"got {value!r}{at}")
        value = float(value)
        if not math.isfinite(value) or not self.check(value):
            raise ValueError(f"{self.name} must be {self.requirement}, got {value!r}{at}")
        return value

    @property
    def is_constant(self) -> bool:
        """Say whether the value is a constant (not a callable)."""
        return not callable(self.value)

    def describe(self) -> str:
        """Return the value for display (``"<schedule>"`` for a callable)."""
        return f"{self.value!r}" if self.is_constant else "<schedule>"


def positive(name: str, value: Scalar) -> Schedule:
    """Return the schedule of ``name``, which must be > 0."""
    return Schedule(name, value, lambda v: v > 0, "> 0")


def non_negative(name: str, value: Scalar) -> Schedule:
    """Return the schedule of ``name``, which must be >= 0."""
    return Schedule(name, value, lambda v: v >= 0, ">= 0")


def unit_interval(name: str, value: Scalar) -> Schedule:
    """Return the schedule of ``name``, which must be in [0, 1)."""
    return Schedule(name, value, lambda v: 0 <= v < 1, "in [0, 1)")


def whole_positive(name: str, value: Scalar) -> Schedule:
    """Return the schedule of ``name``, a whole number >= 1."""
    return Schedule(name, value, lambda v: v >= 1 and v == int(v), "a whole number >= 1")
