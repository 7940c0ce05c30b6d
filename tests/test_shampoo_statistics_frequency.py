"""``statistics_frequency=s``: factors updated at steps 1, 1 + s, 1 + 2s, … only.

A run with ``s = 3`` over 9 steps updates its factors at steps 1, 4 and 7; its factors
are then bit for bit those of a run with ``s = 1`` fed only those three gradients (same
GEMMs on the same values, same count of updates, so the same bias correction at the
root steps).

Run: ``pytest tests/test_shampoo_statistics_frequency.py``; the 2-rank test with
``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_shampoo_statistics_frequency.py``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import count_ops
from shampoo_ranks import distributed_vs_single
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo, ShampooNumericalError

# the tests below update factors less often than roots on purpose (the next-to-last tests
# check that warning)
pytestmark = pytest.mark.filterwarnings("ignore:DistributedShampoo. statistics_frequency")

SHAPES = [(6, 5), (7,), (3, 4, 2)]
KWARGS: dict[str, Any] = dict(lr=0.01, max_preconditioner_dim=8, epsilon=1e-6,
                              factor_dtype=torch.float64)


def _grads(steps: int) -> list[list[Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
            for _ in range(steps)]


def _optimizer(**options: Any) -> tuple[list[nn.Parameter], DistributedShampoo]:
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    return params, DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF),
                                      **{**KWARGS, **options})


def _step(params: list[nn.Parameter], opt: DistributedShampoo, grads: list[Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _factors(opt: DistributedShampoo) -> dict[tuple[int, int, str], Tensor]:
    """Every factor, keyed by (parameter position, block index, key)."""
    return {(i, index, k): v.clone() for i, per in enumerate(opt.state.values())
            for index, s in per.items() for k, v in s.items() if k.startswith("factor_")}


def test_factors_are_those_of_the_update_steps_alone() -> None:
    grads = _grads(9)
    params, every_third = _optimizer(statistics_frequency=3)
    for g in grads:
        _step(params, every_third, g)
    twin, alone = _optimizer()
    for g in (grads[0], grads[3], grads[6]):
        _step(twin, alone, g)
    mine, theirs = _factors(every_third), _factors(alone)
    assert mine.keys() == theirs.keys() and len(mine) == 5
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_roots_use_the_updates_count_for_the_bias_correction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Roots at every step (frequency 1), s = 3: at step 6 the factors have had 2
    updates, so the correction is 1 − β2²."""
    import kfac_hpc.shampoo.optimizer as optimizer

    corrections: list[set[float]] = []
    real = optimizer.inverse_roots

    def spy(requests: list[Any], **kwargs: Any) -> Any:
        corrections.append({r.correction for r in requests})
        return real(requests, **kwargs)

    monkeypatch.setattr(optimizer, "inverse_roots", spy)
    params, opt = _optimizer(statistics_frequency=3, precondition_frequency=1)
    for g in _grads(6):
        _step(params, opt, g)
    beta2 = opt.param_groups[0]["betas"][1]
    want = [{1 - beta2 ** ((t - 1) // 3 + 1)} for t in range(1, 7)]
    assert corrections == want


def test_steps_between_updates_launch_no_factor_gemm() -> None:
    params, opt = _optimizer(statistics_frequency=2, precondition_frequency=100)
    grads = _grads(3)
    counts = []
    for g in grads:
        counts.append(count_ops(lambda g=g: _step(params, opt, g)).calls("aten.baddbmm_."))
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == counts[0]


def test_a_nan_between_updates_is_still_an_error() -> None:
    params, opt = _optimizer(statistics_frequency=2)
    grads = _grads(2)
    _step(params, opt, grads[0])
    grads[1][0][2, 3] = math.nan
    before = [p.detach().clone() for p in params]
    with pytest.raises(ShampooNumericalError, match="statistics"):
        _step(params, opt, grads[1])
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_invalid_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"invalid statistics_frequency=0"):
        _optimizer(statistics_frequency=0)


def test_updating_factors_less_often_than_roots_warns() -> None:
    with pytest.warns(UserWarning, match=r"statistics_frequency=3 exceeds precondition_frequency"
                                         r"=2.*set statistics_frequency <= precondition"):
        _optimizer(statistics_frequency=3, precondition_frequency=2)
    _, opt = _optimizer()
    saved = opt.state_dict()
    saved["param_groups"][0]["statistics_frequency"] = 5
    with pytest.warns(UserWarning, match="statistics_frequency=5"):  # a restored group too
        opt.load_state_dict(saved)


def test_updating_factors_at_most_as_often_as_roots_is_quiet() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _optimizer(statistics_frequency=2, precondition_frequency=2)
        _optimizer(statistics_frequency=2, precondition_frequency=10)


@pytest.mark.mpi(min_size=2)
def test_two_ranks_equal_one_rank_bitwise(comm: Communicator) -> None:
    distributed_vs_single(comm, steps=7, statistics_frequency=2)
