"""Defaults and validation of DistributedShampoo's per-group hyper-parameters.

Every invalid value raises ``ValueError`` naming the option, the value, and what is
allowed; the same checks run for the constructor's defaults, for every parameter
group, and for groups restored by ``load_state_dict``. A legal but wasteful combination
(``statistics_frequency > precondition_frequency``) warns instead.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch

from kfac_hpc.shampoo.blocking import MERGE_ORDERS
from kfac_hpc.shampoo.grafting import GRAFTING_KINDS

__all__ = ["COMMUNICATION_DTYPES", "FACTOR_DTYPES", "GROUP_OPTIONS", "PRODUCT_PRECISIONS",
           "validate_dtype", "validate_group", "validate_int"]

#: Options that may differ per parameter group (``max_preconditioner_dim`` and
#: ``merge_dims_from`` are read once, when the group is added: they decide the blocks).
GROUP_OPTIONS = (
    "lr", "betas", "epsilon", "momentum", "nesterov", "weight_decay", "decoupled_weight_decay",
    "max_preconditioner_dim", "merge_dims_from", "precondition_frequency",
    "start_preconditioning_step",
    "grafting", "grafting_epsilon", "grafting_beta2", "use_bias_correction",
    "precondition_vectors", "statistics_frequency", "stats_precision", "precondition_precision",
)
#: Operand precisions of the factor products and of the preconditioning products
#: (:mod:`kfac_hpc.kfac.precision`: ``"tf32"`` rounds float32 operands to TF32; float64
#: factors are always multiplied in full).
PRODUCT_PRECISIONS = ("full", "tf32")
FACTOR_DTYPES = (torch.float32, torch.float64)
COMMUNICATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"DistributedShampoo: invalid {name}={value!r}; allowed: {allowed}")


def _real(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _fail(name, value, allowed)
    return float(value)


def validate_int(name: str, value: Any, minimum: int) -> int:
    """Check that ``value`` is an ``int`` (not bool) ``>= minimum``.

    Args:
        name: The option's name, for the message.
        value: The value given.
        minimum: The smallest allowed value.

    Returns:
        ``value`` as an int.

    Raises:
        ValueError: It is not such an int.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(name, value, f"an integer >= {minimum}")
    return int(value)


def _check_range(name: str, value: Any, low: float, high: float, low_open: bool,
                 high_open: bool) -> None:
    text = f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    x = _real(name, value, text)
    if x < low or x > high or (low_open and x == low) or (high_open and x == high):
        raise _fail(name, value, text)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False")


def validate_group(group: dict[str, Any]) -> None:
    """Check every hyper-parameter of a parameter group (or of the defaults).

    Args:
        group: The group's settings.

    Raises:
        ValueError: A value is out of range; names it and what is allowed.

    Warns:
        UserWarning: ``statistics_frequency`` exceeds ``precondition_frequency`` (root
            steps between two factor updates recompute the same roots).
    """
    lr = _real("lr", group["lr"], "a number >= 0")
    if lr < 0:
        raise _fail("lr", group["lr"], "a number >= 0")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise _fail("betas", betas, "a pair (beta1, beta2) with 0 <= beta1 < 1 and 0 <= beta2 <= 1")
    _check_range("betas[0]", betas[0], 0.0, 1.0, False, True)
    _check_range("betas[1]", betas[1], 0.0, 1.0, False, False)
    eps = _real("epsilon", group["epsilon"], "a number > 0")
    if eps <= 0:
        raise _fail("epsilon", group["epsilon"], "a number > 0 (it regularises the root inverse)")
    _check_range("momentum", group["momentum"], 0.0, 1.0, False, True)
    _check_bool("nesterov", group["nesterov"])
    if group["nesterov"] and group["momentum"] == 0:
        raise _fail("nesterov", True, "False unless momentum > 0")
    wd = _real("weight_decay", group["weight_decay"], "a number >= 0")
    if wd < 0:
        raise _fail("weight_decay", group["weight_decay"], "a number >= 0")
    _check_bool("decoupled_weight_decay", group["decoupled_weight_decay"])
    validate_int("max_preconditioner_dim", group["max_preconditioner_dim"], 1)
    if group["merge_dims_from"] not in MERGE_ORDERS:
        raise _fail("merge_dims_from", group["merge_dims_from"],
                    " or ".join(repr(o) for o in MERGE_ORDERS))
    validate_int("precondition_frequency", group["precondition_frequency"], 1)
    validate_int("start_preconditioning_step", group["start_preconditioning_step"], 1)
    if group["grafting"] is not None and group["grafting"] not in GRAFTING_KINDS:
        raise _fail("grafting", group["grafting"],
                    ", ".join(repr(k) for k in GRAFTING_KINDS) + " or None")
    geps = _real("grafting_epsilon", group["grafting_epsilon"], "a number >= 0")
    if geps < 0:
        raise _fail("grafting_epsilon", group["grafting_epsilon"], "a number >= 0")
    _check_range("grafting_beta2", group["grafting_beta2"], 0.0, 1.0, False, True)
    _check_bool("use_bias_correction", group["use_bias_correction"])
    _check_bool("precondition_vectors", group["precondition_vectors"])
    validate_int("statistics_frequency", group["statistics_frequency"], 1)
    for name in ("stats_precision", "precondition_precision"):
        if group[name] not in PRODUCT_PRECISIONS:
            raise _fail(name, group[name], " or ".join(repr(p) for p in PRODUCT_PRECISIONS))
    stats, roots = group["statistics_frequency"], group["precondition_frequency"]
    if stats > roots:
        warnings.warn(
            f"DistributedShampoo: statistics_frequency={stats} exceeds precondition_frequency="
            f"{roots}: the factors change every {stats} steps, so root steps between two "
            "factor updates recompute the same roots; set statistics_frequency <= "
            "precondition_frequency", UserWarning, stacklevel=3)


def validate_dtype(name: str, value: Any, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    """Check that ``value`` is one of the ``allowed`` torch dtypes.

    Args:
        name: The option's name, for the message.
        value: The value given.
        allowed: The allowed dtypes.

    Returns:
        ``value``.

    Raises:
        ValueError: It is not one of them.
    """
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise _fail(name, value, ", ".join(str(d) for d in allowed))
    return value
