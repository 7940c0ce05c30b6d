"""The one description of K-FAC's strategies and options (docs/design.md, "kfac — options").

Read by the preconditioner (:class:`~kfac_hpc.kfac.preconditioner.KFACPreconditioner`
validates its arguments with it), the planner (:class:`kfac_hpc.plan.options.KFACOptions`
and the schedule of :func:`kfac_hpc.plan.timing.estimate`) and the driver's configuration
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
           "DEFAULT_LOCAL_THRESHOLD", "DEFAULT_LOW_RANK_MIN_DIM", "DTYPES", "EIGEN_REFRESHES",
           "FACTOR_SYNCS", "LOW_RANK_REMAINDERS", "PRECISIONS", "PRECISION_OPTIONS",
           "STRATEGIES", "ComputeMethod", "Conflict", "EigenRefresh", "FactorSync",
           "KFACApprox", "LowRankRemainder", "MatmulPrecision", "PrecisionOption",
           "Strategy", "conflicts", "default_factor_dtype", "low_rank_cap", "one_of",
           "reduces_factors", "resolve_precision", "sends_factors"]

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

MatmulPrecision = Literal["full", "tf32", "bf16"]
# the operand precision of K-FAC's GEMMs (kfac_hpc.kfac.precision)
PRECISIONS: tuple[MatmulPrecision, ...] = ("full", "tf32", "bf16")
PrecisionOption = Literal["auto", "full", "tf32", "bf16"]  # "auto": resolve_precision
PRECISION_OPTIONS: tuple[PrecisionOption, ...] = ("auto", "full", "tf32", "bf16")

EigenRefresh = Literal["eigh", "subspace"]
# how an eigenbasis is renewed at an inverse update (kfac_hpc.kfac.linalg)
EIGEN_REFRESHES: tuple[EigenRefresh, ...] = ("eigh", "subspace")

LowRankRemainder = Literal["mean", "zero"]
LOW_RANK_REMAINDERS: tuple[LowRankRemainder, ...] = ("mean", "zero")  # kfac.lowrank's rules

DEFAULT_BUCKET_CAP_MB = 25.0  # overlap: size of one fused factor reduction
DEFAULT_LOCAL_THRESHOLD = 16  # factors below this dimension are "local" (SPD-KFAC)
# low_rank: factors at least this large get the randomized decomposition. Below ~1000 a
# full eigh takes milliseconds (benchmarks/RESULTS.md, section 3: 0.25 s at 1569 on
# 2 cores), so the approximation buys little there.
DEFAULT_LOW_RANK_MIN_DIM = 1024


_Name = TypeVar("_Name", bound=str)


def one_of(option: str, value: str, valid: tuple[_Name, ...]) -> _Name:
    """``value`` as one of ``valid`` (typed: a ``Literal``), or a ValueError naming ``option``."""
    for name in valid:
        if name == value:
            return name
    raise ValueError(f"{option} must be one of {valid}, got {value!r}")


def default_factor_dtype(weight_dtypes: Iterable[str]) -> str:
    """Return the factor dtype when none is given.

    ``float64`` if any weight is, else ``float32`` (never lower: bf16/fp16 statistics lose the
    curvature). Names without ``torch.``.
    """
    return "float64" if "float64" in set(weight_dtypes) else "float32"


def sends_factors(strategy: str) -> bool:
    """Say whether the strategy reduces factors over ranks.

    Whether the strategy reduces factors over ranks (DP-KFAC's owners use their own
    batch and send none).
    """
    return strategy != "dp-kfac"


def reduces_factors(strategy: str, factor_sync: str, *, factor_step: bool,
                    inverse_step: bool) -> bool:
    """Say whether a step with these updates reduces factors.

    At factor steps, or with ``factor_sync="inverse"`` at inverse steps; never under DP-KFAC.
    """
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
        """Render the reason, naming other options with ``name(option, value)``."""
        return re.sub(r"<(\w+)=([\w-]+)>", lambda m: name(m.group(1), m.group(2)), self.reason)


def resolve_precision(value: str, *, device_type: str, dtype: str) -> MatmulPrecision:
    """Return the operand precision an option value means on a device for a dtype.

    Dtypes are named without ``torch.``. ``"auto"`` is ``"tf32"`` for float32 on CUDA and
    ``"full"`` everywhere else, for both of the preconditioner's options, measured on an
    H200 (docs/design.md, "Operand precision"): statistics (a factor update 90 → 73 ms on
    ResNet-50, entries within 1e-4 of float64) and preconditioning (the stale step 35.2 → 30.1
    ms and 36.8 → 30.8 in two runs; preconditioned gradients within 6e-4 of float64, the
    rounding that cuDNN's default TF32 convolutions already leave in the weight gradients).
    """
    if value == AUTO:
        return "tf32" if device_type == "cuda" and dtype == "float32" else "full"
    return one_of("precision", value, PRECISIONS)


def low_rank_cap(dim: int, low_rank: int | None, min_dim: int) -> int | None:
    """Return the most eigenpairs kept of a ``dim x dim`` factor.

    That is the width of its message pieces; ``None`` when it gets the full
    eigendecomposition. Low rank applies to factors with ``dim >= min_dim`` and ``dim > low_rank``.
    """
    if low_rank is None or dim < min_dim or dim <= low_rank:
        return None
    return low_rank


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def conflicts(*, strategy: str, grad_worker_fraction: float | None = None,
              overlap: bool = False, symmetric_packing: bool = False,
              factor_sync: str = "step", compute_method: str = "eigen",
              low_rank: int | None = None, low_rank_energy: float | None = None,
              low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM,
              low_rank_remainder: str = "mean", stats_precision: str = AUTO,
              precondition_precision: str = AUTO,
              factor_dtype: str | None = None, inv_dtype: str = "float32",
              eigen_refresh: str = "eigh", decomposition_lag: int = 0) -> list[Conflict]:
    """Every rule the options break, in a fixed order (empty: compatible).

    Dtypes are named without ``torch.`` (``factor_dtype=None``: chosen from the model).
    """
    out: list[Conflict] = []
    if not _whole(decomposition_lag, 0):
        out.append(Conflict("decomposition_lag", "must be a whole number of steps >= 0 (0: "
                                                 "decompositions in the inverse step); got "
                                                 f"{decomposition_lag!r}"))
    if eigen_refresh not in EIGEN_REFRESHES:
        out.append(Conflict("eigen_refresh", f"must be one of {EIGEN_REFRESHES}; got "
                                             f"{eigen_refresh!r}"))
    elif eigen_refresh != "eigh" and compute_method != "eigen":
        out.append(Conflict("eigen_refresh", f"needs <compute_method=eigen>: "
                                             f"<compute_method={compute_method}> has no "
                                             "eigenbasis"))
    for option, value, dtype in (("stats_precision", stats_precision, factor_dtype),
                                 ("precondition_precision", precondition_precision, inv_dtype)):
        if value not in PRECISION_OPTIONS:
            out.append(Conflict(option, f"must be one of {PRECISION_OPTIONS}; got {value!r}"))
        elif value not in (AUTO, "full") and dtype not in (None, "float32"):
            kind = "factor" if option == "stats_precision" else "inv"
            out.append(Conflict(option, f"rounds float32 operands only: with <{kind}_dtype="
                                        f"{dtype}> use 'full' or 'auto'"))
    if low_rank is not None and not _whole(low_rank, 1):
        out.append(Conflict("low_rank", f"must be a whole number >= 1 (the most eigenpairs "
                                        f"kept of a large factor), or None; got {low_rank!r}"))
    if low_rank_energy is not None and not (
            isinstance(low_rank_energy, (int, float)) and not isinstance(low_rank_energy, bool)
            and 0.0 < low_rank_energy <= 1.0):
        out.append(Conflict("low_rank_energy", "must be in (0, 1] (the fraction of a factor's "
                                               f"trace the kept eigenvalues hold); got "
                                               f"{low_rank_energy!r}"))
    if not _whole(low_rank_min_dim, 1):
        out.append(Conflict("low_rank_min_dim", f"must be a whole number >= 1; got "
                                                f"{low_rank_min_dim!r}"))
    if low_rank_remainder not in LOW_RANK_REMAINDERS:
        out.append(Conflict("low_rank_remainder", f"must be one of {LOW_RANK_REMAINDERS}; got "
                                                  f"{low_rank_remainder!r}"))
    if low_rank is None:
        for option, on in (("low_rank_energy", low_rank_energy is not None),
                           ("low_rank_min_dim", low_rank_min_dim != DEFAULT_LOW_RANK_MIN_DIM),
                           ("low_rank_remainder", low_rank_remainder != "mean")):
            if on:
                out.append(Conflict(option, "needs <low_rank=K>, the most eigenpairs kept "
                                            "(energy: the cap; it fixes the message layout)"))
    elif compute_method != "eigen":
        out.append(Conflict("low_rank", f"needs <compute_method=eigen>: "
                                        f"<compute_method={compute_method}> has no low-rank "
                                        "form"))
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
