"""``pow_per_value``: a value's power does not depend on the values stacked with it.

A vectorised ``pow`` and its scalar tail round differently in the last bit on the CPU, so
``x.pow(e)`` of a stack may differ from the same value raised alone; ``pow_per_value``
must give a value the same bits wherever it sits (alone, at any offset of any length,
in a tensor large enough for threads to split), and stay within a few ulps of ``pow``.
"""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.shampoo.powers import pow_per_value

EXPONENTS = (-0.25, -1 / 6, -0.5, 0.5, -1 / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_value_gets_the_same_bits_wherever_it_sits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(70_003, generator=g, dtype=torch.float64) * 1e-3 + 1e-12).to(dtype)
    for exponent in EXPONENTS:
        whole = pow_per_value(values, exponent)
        for start, length in ((0, 1), (1, 3), (7, 13), (5, 40_000), (3, 70_000)):
            piece = pow_per_value(values[start:start + length], exponent)
            assert torch.equal(piece, whole[start:start + length]), (exponent, start, length)
        alone = torch.cat([pow_per_value(values[i:i + 1], exponent) for i in range(300)])
        assert torch.equal(alone, whole[:300])
        rows = pow_per_value(values[:300].reshape(20, 15), exponent)
        assert torch.equal(rows.reshape(-1), whole[:300])


@pytest.mark.parametrize("dtype,ulps", [(torch.float32, 16), (torch.float64, 16)])
def test_within_a_few_ulps_of_pow(dtype: torch.dtype, ulps: int) -> None:
    """``exp(e·log x)``: the logarithm's rounding ``u·|log x|`` times ``|e|``, plus the
    exponential's and the product's: at most ``|e·log x| + 2`` ulps; with values from
    1e-12 to 1e12 and ``|e| <= 1/2`` that is under 16."""
    values = torch.logspace(-12, 12, 4001, dtype=torch.float64).to(dtype)
    exact = values.double()
    for exponent in EXPONENTS:
        got = pow_per_value(values, exponent).double()
        want = exact.pow(exponent)
        ulp = torch.finfo(dtype).eps * want
        assert float(((got - want).abs() / ulp).max()) <= ulps, exponent
    assert pow_per_value(torch.zeros(2, dtype=dtype), -0.5).isinf().all()
