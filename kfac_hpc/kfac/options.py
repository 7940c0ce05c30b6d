"""The one description of K-FAC's strategies and options (docs/design.md, "kfac — options").

Read by the preconditioner (:class:`~kfac_hpc.kfac.preconditioner.KFACPreconditioner`
validates its arguments with it), the planner (:class:`kfac_hpc.plan.cost.KFACOptions`
and the schedule of :func:`kfac_hpc.plan.cost.estimate`) and the driver's configuration
(:meth:`kfac_hpc.train.config.TrainConfig.validate`). A new option or rule is added here
once; every reader then agrees.

Pure Python on purpose: no torch, no MPI (the driver validates its configuration before
either is imported).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

__all__ = ["APPROXIMATIONS", "AUTO", "COMPUTE_METHODS", "DEFAULT_BUCKET_CAP_MB",
           "DEFAULT_LOCAL_THRESHOLD", "DTYPES", "FACTOR_SYNCS", "STRATEGIES", "ComputeMethod",
           "Conflict", "FactorSync", "KFACApprox", "Strategy", "conflicts",
           "default_factor_dtype", "one_of", "reduces_factors", "sends_factors"]

Strategy = Literal["comm-opt", "mem-opt", "hybrid-opt", "dp-kfac"]
STRATEGIES: tuple[Strategy, ...] = ("comm-opt", "mem-opt", "hybrid-opt", "dp-kfac")
AUTO = "auto"  # resolved by the planner (kfac_hpc.plan.auto) in the constructor
ComputeMethod = Literal["eigen", "inverse"]
COMPUTE_METHODS: tuple[ComputeMethod, ...] = ("eigen", "inverse")
FactorSync = Literal["step", "inverse"]
FACTOR_SYNCS: tuple[FactorSync, ...] = ("step", "inverse")
DTYPES = ("float32", "float64")  # factor and decomposition dtypes the driver offers
KFACApprox = Literal["expand", "reduce"]
APPROXIMATIONS: tuple[KFACApprox, ...] = ("expand", "reduce")  # layers with positions

DEFAULT_BUCKET_CAP_MB = 25.0  # overlap: size of one fused factor reduction
DEFAULT_LOCAL_THRESHOLD = 16  # factors below this dimension are "local" (SPD-KFAC)


_Name = TypeVar("_Name", bound=str)


def one_of(option: str, value: str, valid: tuple[_Name, ...]) -> _Name:
    """``value`` as one of ``valid`` (typed: a ``Literal``), or a ValueError naming ``option``."""
    for name in valid:
        if name == value:
            return name
    raise ValueError(f"{option} must be one of {valid}, got {value!r}")


def default_factor_dtype(weight_dtypes: Iterable[str]) -> str:
    """The factor dtype when none is given: ``float64`` if any weight is, else ``float32``
    (never lower: bf16/fp16 statistics lose the curvature). Names without ``torch.``."""
    return "float64" if "float64" in set(weight_dtypes) else "float32"


def sends_factors(strategy: str) -> bool:
    """Whether the strategy reduces factors over ranks (DP-KFAC's owners use their own
    batch and send none)."""
    return strategy != "dp-kfac"


def reduces_factors(strategy: str, factor_sync: str, *, factor_step: bool,
                    inverse_step: bool) -> bool:
    """Whether a step with these updates reduces factors: at factor steps, or with
    ``factor_sync="inverse"`` at inverse steps; never under DP-KFAC."""
    if not sends_factors(strategy):
        return False
    return inverse_step if factor_sync == "inverse" else factor_step


@dataclass(frozen=True)
class Conflict:
    """A combination of options the preconditioner refuses.

    ``option`` is the keyword at fault (the preconditioner's name); ``reason`` reads after
    it and names other settings as ``<option=value>``, which each reader renders its own
    way with :meth:`text` (``strategy='dp-kfac'`` in Python, ``--kfac-strategy dp-kfac``
    on the command line).
    """

    option: str
    reason: str

    def text(self, name: Callable[[str, str], str] = lambda opt, value: f"{opt}={value!r}"
             ) -> str:
        return re.sub(r"<(\w+)=([\w-]+)>", lambda m: name(m.group(1), m.group(2)), self.reason)


def conflicts(*, strategy: str, grad_worker_fraction: float | None = None,
              overlap: bool = False, symmetric_packing: bool = False,
              factor_sync: str = "step") -> list[Conflict]:
    """Every rule the options break, in a fixed order (empty: compatible)."""
    out: list[Conflict] = []
    if grad_worker_fraction is not None and strategy != "hybrid-opt":
        out.append(Conflict("grad_worker_fraction",
                            "only applies to <strategy=hybrid-opt> (comm-opt is fraction 1, "
                            "mem-opt and dp-kfac are 1/ranks)"))
    if not sends_factors(strategy):
        for option, on in (("overlap", overlap), ("symmetric_packing", symmetric_packing),
                           ("factor_sync", factor_sync != "step")):
            if on:
                out.append(Conflict(option, f"does not apply to <strategy={strategy}>, "
                                            "which sends no factors"))
    if overlap and factor_sync == "inverse":
        out.append(Conflict("overlap", "pipelines every factor reduction; "
                                       "<factor_sync=inverse> has none to pipeline: pick one"))
    return out
