"""Powers of stacked values that do not depend on where a value sits in its stack.

On the CPU torch computes ``pow`` over a tensor in vector registers and its last few
elements (fewer than two vectors' worth, and those at the edges of the chunks threads
take) with the scalar ``std::pow``; the two round differently in the last bit. A block's
inverse-root scales would then depend on which other blocks share its batch, i.e. on
how many ranks own blocks, and a run over 2 ranks would differ from one over 1 by an
ulp (seen on ShampooNet's 4x4 factors at their fourth root step). torch's CPU ``exp``
and ``log`` run every element, the tail included, through the same vector code
(partial loads), so :func:`pow_per_value` computes ``exp(e·log x)`` there: a few ulps
less accurate than ``pow`` (about ``|e·log x|`` ulps from the logarithm's rounding: under
16 for values in [1e-12, 1e12] and ``|e| <= 1/2``, Shampoo's scales with ``ε = 1e-12``),
and the same bits for a value wherever it sits
(``tests/test_shampoo_powers.py`` checks it, so a torch whose kernels change is
caught). On other devices one kernel computes every element alike: ``pow`` itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pow_per_value"]


def pow_per_value(values: Tensor, exponent: float) -> Tensor:
    """``values ** exponent`` (positive values), each result depending on its value only.

    Args:
        values: Positive values (0 gives ``0 ** exponent``: 0 or Inf), any shape.
        exponent: The power.

    Returns:
        A new tensor of ``values``' shape and dtype; bit for bit the same for a value
        whatever the tensor around it (its batch, its position).
    """
    if values.device.type != "cpu":
        return values.pow(exponent)
    return torch.exp(torch.log(values) * exponent)
