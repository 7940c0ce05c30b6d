"""Phases declared in the library: the ``timed`` decorator, the timer, and the phases
K-FAC's and Shampoo's steps report (the driver's step records read them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc.kfac import KFACPreconditioner
from kfac_hpc.phases import PHASES, TRAFFIC_TAGS, Phase, PhaseTimer, Traffic, timed
from kfac_hpc.shampoo import DistributedShampoo


class _Worker:
    def __init__(self) -> None:
        self.phase_timer: PhaseTimer | None = None

    @timed(Phase.KFAC_FACTORS)
    def work(self, k: int) -> int:
        return k + 1


def test_timed_methods_report_to_their_objects_timer_only_when_enabled() -> None:
    worker = _Worker()
    assert worker.work(1) == 2  # no timer: runs untimed
    timer = PhaseTimer()
    worker.phase_timer = timer
    timer.start(False)
    assert worker.work(1) == 2 and timer.record() == {}
    timer.start(True)
    with timer.phase(Phase.OPTIMIZER):
        assert worker.work(2) == 3
    assert set(timer.record()) == {"time_optimizer", "time_kfac_factors"}
    assert timer.seconds(Phase.KFAC_FACTORS) <= timer.seconds(Phase.OPTIMIZER)
    assert timer.seconds(Phase.SHAMPOO_APPLY) == 0.0
    assert _Worker.work.phase is Phase.KFAC_FACTORS  # type: ignore[attr-defined]


def test_names_print_as_their_values() -> None:
    assert f"time_{Phase.KFAC}" == "time_kfac" and str(Traffic.FACTORS) == "factors"
    assert tuple(p.value for p in Phase) == PHASES and "kfac_factors" in PHASES
    assert TRAFFIC_TAGS == ("factors", "decompositions", "gradients", "agreement")
    assert {Traffic.GRADIENTS: 1}["gradients"] == 1  # keys interchangeable with strings


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _backward(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.randn(8, 6)).pow(2).sum().backward()


@pytest.mark.parametrize("lag", [0, 1])
def test_kfac_step_reports_its_declared_phases(lag: int) -> None:
    model = _model()
    pre = KFACPreconditioner(model, decomposition_lag=lag, inv_update_steps=2)
    timer = PhaseTimer()
    pre.phase_timer = timer
    kfac_phases = {Phase.KFAC_FACTORS, Phase.KFAC_AVERAGES, Phase.KFAC_DECOMPOSITIONS,
                   Phase.KFAC_DECOMPOSE, Phase.KFAC_PRECONDITION, Phase.KFAC_GRADIENTS}
    seen = []
    for step in range(4):
        _backward(model)
        timer.start(step != 1)
        pre.step()
        seen.append(set(timer.times))
    pre.close()
    assert seen[1] == set()  # a step not recorded times nothing
    # the first step decomposes in place; with a lag the update started at step 2 is
    # computed in the background (not timed) and installed at step 3, timed as the
    # decomposition phase there
    assert seen[0] == kfac_phases
    assert seen[2] == kfac_phases if lag == 0 else seen[2] == kfac_phases - {
        Phase.KFAC_DECOMPOSITIONS, Phase.KFAC_DECOMPOSE}
    assert seen[3] == kfac_phases - {Phase.KFAC_DECOMPOSE} if lag else seen[3] == (
        kfac_phases - {Phase.KFAC_DECOMPOSITIONS, Phase.KFAC_DECOMPOSE})


def test_shampoo_step_reports_its_declared_phases() -> None:
    model = _model()
    opt = DistributedShampoo(model.parameters(), lr=0.01)
    timer = PhaseTimer()
    opt.phase_timer = timer
    timer.start(True)
    _backward(model)
    opt.step()
    assert set(timer.times) == {Phase.SHAMPOO_BLOCKS, Phase.SHAMPOO_APPLY}


def test_phases_and_statistics_are_named_ranges_while_a_profiler_records() -> None:
    """Under ``torch.profiler`` a K-FAC step's phases and the hooks' statistics appear as
    ``kfac_hpc.<name>`` ranges (one statistics range per factor); without a profiler no
    range is made."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    from kfac_hpc.phases import profiler_range

    assert isinstance(profiler_range("kfac_statistics"), nullcontext)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    pre = KFACPreconditioner(model, inv_update_steps=1)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert not isinstance(profiler_range("kfac_statistics"), nullcontext)
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("kfac_hpc.")}
    assert calls["kfac_hpc.kfac_statistics"] == 4  # A and G of two layers
    for phase in (Phase.KFAC_FACTORS, Phase.KFAC_DECOMPOSITIONS, Phase.KFAC_PRECONDITION):
        assert calls[f"kfac_hpc.{phase.value}"] >= 1, calls
    pre.close()
