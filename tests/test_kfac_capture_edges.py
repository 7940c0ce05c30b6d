"""K-FAC's statistics capture at its edges: inputs without rows, a layer called with a
keyword, a bias frozen after registration, hooks removed while inputs are held, and
``factor_sync="inverse"`` with a layer that runs on some ranks only.

Each on the CPU path, the GPU path forced layer by layer, and the GPU path grouped by
shape. The MPI test: ``launch/local -n 2 python -m mpi4py -m pytest --with-mpi
--only-mpi tests/test_kfac_capture_edges.py``.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, statistics_groups

PATHS = ["cpu", "gpu-path-per-layer", "gpu-path-grouped"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The statistics path: the CPU's, or the GPU path forced on CPU tensors."""
    if request.param != "cpu":
        for module in (linalg, layers, statistics_groups):
            monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
        monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
        if request.param == "gpu-path-per-layer":
            monkeypatch.setattr(statistics_groups, "STACKED_PRECISIONS", frozenset())
    yield request.param


def _pre(model: nn.Module) -> KFACPreconditioner:
    return KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                              factor_dtype=torch.float64, inv_dtype=torch.float64)


class Experts(nn.Module):
    """Two experts; the second is routed the rows given (none, in the test's first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3).double(), nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor, routed: int) -> torch.Tensor:
        return torch.cat([self.a(x[routed:]), self.b(x[:routed])])


def test_an_expert_routed_no_rows_adds_nothing(path: str) -> None:
    """An input without rows (an expert routed no token) is not captured: the step runs,
    and the expert's factors are those of the steps that routed it rows."""
    torch.manual_seed(0)
    model = Experts()
    pre = _pre(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    model(x, 0).square().sum().backward()  # b gets (0, 4): no statistics
    pre.step()
    assert pre.factors["b/A"].average is None and pre.factors["a/A"].average is not None
    model.zero_grad()
    model(x, 2).square().sum().backward()
    pre.step()
    rows = torch.cat([x[:2], torch.ones(2, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(pre.factors["b/A"].average, rows.T @ rows / 2)
    pre.close()


def test_a_layer_called_with_a_keyword_input_is_captured(path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    pre = _pre(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    model[0](input=x).square().sum().backward()
    pre.step()
    rows = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(pre.factors["0/A"].average, rows.T @ rows / 5)
    pre.close()


def test_a_bias_frozen_after_registration_gets_no_gradient(path: str) -> None:
    """The step wrote a ``.grad`` for it, and the optimizer then moved it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    pre = _pre(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2].bias.requires_grad_(False)
    before = model[2].bias.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
        pre.step()
        opt.step()
    assert model[2].bias.grad is None and torch.equal(model[2].bias, before)
    assert model[2].weight.grad is not None
    pre.close()


def test_removing_the_hooks_lets_go_of_held_inputs(path: str) -> None:
    """Train-mode forwards without a backward (a logging pass) leave inputs held for
    their group's gradient; ``remove()`` drops them, as ``clear()`` does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).double()
    pre = _pre(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    held = weakref.ref(x)
    model(x)
    del x
    pre.remove_hooks()
    gc.collect()
    assert held() is None
    pre.close()


@pytest.mark.mpi(min_size=2)
def test_deferred_sync_warns_about_a_layer_used_on_some_ranks_only(
        comm: Communicator, caplog: pytest.LogCaptureFixture) -> None:
    """factor_sync="inverse" folds c·F + mean_r D_r, which assumes every rank captures a
    layer at the same steps; its owner warns (once) when it sees otherwise."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(4, 4), "aux": nn.Linear(4, 2)}).double()
    pre = KFACPreconditioner(model, comm=comm, damping=0.01, factor_sync="inverse",
                             inv_update_steps=2, factor_dtype=torch.float64,
                             inv_dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="kfac_hpc"):
        for _ in range(5):
            model.zero_grad()
            h = model["trunk"](torch.randn(3, 4, dtype=torch.float64))
            loss = h.square().sum()
            if comm.rank == 1:  # aux reaches the loss on rank 1 only
                loss = loss + model["aux"](h).square().sum()
            loss.backward()
            pre.step()
    warned = [r.getMessage() for r in caplog.records
              if "got statistics on some ranks only" in r.getMessage()]
    assert len(warned) <= 1  # once per factor
    everyone = comm.allgather_object(warned)
    named = " ".join(m for ms in everyone for m in ms)
    assert "aux/A" in named and "aux/G" in named, everyone  # by the ranks that hold them
    assert "trunk" not in named
    pre.close()


def test_a_step_after_remove_hooks_says_so() -> None:
    """Not "run forward and backward in train mode": the hooks are gone."""
    model = nn.Sequential(nn.Linear(4, 3)).double()
    pre = _pre(model)
    pre.remove_hooks()
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"after remove_hooks\(\)"):
        pre.step()
    pre.close()
