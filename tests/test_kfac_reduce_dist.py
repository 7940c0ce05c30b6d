"""K-FAC-reduce through the preconditioner: P ranks equal one rank with the whole batch.

Reduce's factors are means over examples (of position-averaged inputs and
position-summed output gradients), so averaging the ranks' factors gives the global
batch's factors exactly as for expand: every strategy but DP-KFAC reproduces one rank.
float64: only the summation order differs (1e-9 relative after 6 steps).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator

GLOBAL_BATCH = 8


class SeqNet(nn.Module):
    """A convolution, then a Linear over a sequence of positions (leading dimensions)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1, stride=2)
        self.mix = nn.Linear(4, 6)
        self.head = nn.Linear(6 * 9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))                       # (b, 4, 3, 3)
        h = torch.tanh(self.mix(h.flatten(2).transpose(1, 2)))  # (b, 9, 6): 9 positions
        return self.head(h.flatten(1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))


def train(comm: Communicator, strategy: str, fraction: float | None, approx) -> nn.Module:
    model = SeqNet().double()
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
                             damping=0.01, inv_update_steps=2, inv_dtype=torch.float64,
                             kfac_approx=approx)
    assert {c.approx for c in pre.layers.values()} == (
        {approx} if isinstance(approx, str) else {"expand", "reduce"})
    avg = GradientAverager(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = GLOBAL_BATCH // comm.size
    for step in range(6):
        x, y = batch(step)
        x, y = x[comm.rank * per_rank:(comm.rank + 1) * per_rank], \
            y[comm.rank * per_rank:(comm.rank + 1) * per_rank]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        avg.synchronize()
        pre.step()
        opt.step()
    pre.close()
    return model


STRATEGIES = [("comm-opt", None), ("mem-opt", None), ("hybrid-opt", 0.5)]
APPROX = ["reduce", {"Conv2d": "reduce"}]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, fraction", STRATEGIES)
@pytest.mark.parametrize("approx", APPROX, ids=["reduce", "conv-reduce"])
def test_reduce_world_size_invariance(comm, strategy, fraction, approx):
    if strategy == "hybrid-opt" and comm.size % 2:
        pytest.skip("fraction 1/2 needs an even world")
    distributed = train(comm, strategy, fraction, approx)
    single = train(Communicator(MPI.COMM_SELF), "comm-opt", None, approx)
    for (name, p), q in zip(distributed.named_parameters(), single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=f"{name} differs")


def test_reduce_differs_from_expand_and_is_recorded():
    expand = train(Communicator(MPI.COMM_SELF), "comm-opt", None, "expand")
    reduce = train(Communicator(MPI.COMM_SELF), "comm-opt", None, "reduce")
    assert not torch.allclose(expand.conv.weight, reduce.conv.weight)
    pre = KFACPreconditioner(SeqNet().double(), comm=Communicator(MPI.COMM_SELF),
                             kfac_approx="reduce")
    assert pre.config()["kfac_approx"] == "reduce"
    with pytest.raises(ValueError, match="approx must be one of"):
        KFACPreconditioner(SeqNet(), comm=Communicator(MPI.COMM_SELF), kfac_approx="bogus")
