"""Ranks that would post reductions of different sizes get one clear error on every rank.

The case from the field: ranks differ only in which parameters train (one rank sets
``requires_grad=False`` on one layer; every shape is equal). Before the fix the rank
that freezes got ``MPI_ERR_TRUNCATE`` while rank 0 hung (or, through the driver, the
heap was corrupted). Each test ends with the same ``ValueError`` on every rank: the
harness aborts the job when any rank fails, so a rank that did not raise, or raised
something else, fails the test instead of hanging it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import FusedAllreduce
from kfac_hpc.comm.replicas import check_replicas


def make_model(comm, freeze_on_last_rank: bool = True) -> nn.Module:
    """Identical on every rank, except that the last rank freezes the first layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 3))
    if freeze_on_last_rank and comm.rank == comm.size - 1:
        model[2].requires_grad_(False)
    return model


FROZEN = (r"requires_grad=False on \['2\.weight', '2\.bias'\] \(rank 0 trains them\).*"
          r"set requires_grad identically on every rank")


@pytest.mark.mpi(min_size=2)
def test_frozen_layer_under_gradient_averager_and_sgd(comm):
    model = make_model(comm)
    with pytest.raises(ValueError, match=FROZEN):
        averager = GradientAverager(model, comm)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for _ in range(2):  # what the user ran: never reached once the check raises
            opt.zero_grad()
            model(torch.randn(4, 6)).square().sum().backward()
            averager.synchronize()
            opt.step()


@pytest.mark.mpi(min_size=2)
def test_frozen_layer_under_kfac(comm):
    model = make_model(comm)
    with pytest.raises(ValueError, match=FROZEN):
        KFACPreconditioner(model, comm=comm, damping=0.01, lr=0.1)


@pytest.mark.mpi(min_size=2)
def test_frozen_layer_under_kfac_with_an_averager(comm):
    """The order the driver builds them in: the averager first, K-FAC after."""
    model = make_model(comm)
    with pytest.raises(ValueError, match=FROZEN):
        GradientAverager(model, comm)
        KFACPreconditioner(model, comm=comm, damping=0.01, lr=0.1)


@pytest.mark.mpi(min_size=2)
def test_unchecked_kfac_agrees_on_its_layers(comm):
    """K-FAC without the replica check still agrees on what shapes its messages."""
    model = make_model(comm)
    with pytest.raises(ValueError, match=r"ranks disagree on K-FAC's layers and message options"
                                         r".*requires_grad"):
        KFACPreconditioner(model, comm=comm, damping=0.01, lr=0.1, check_replicas=False)


@pytest.mark.mpi(min_size=2)
def test_replica_check_names_the_frozen_parameters(comm):
    model = make_model(comm)
    with pytest.raises(ValueError, match=r"ranks hold different models .*" + FROZEN):
        check_replicas(model.named_parameters(), comm)


@pytest.mark.mpi(min_size=2)
def test_same_frozen_layer_everywhere_trains(comm):
    """Freezing the same layer on every rank is fine: nothing raises, grads agree."""
    model = make_model(comm, freeze_on_last_rank=False)
    model[2].requires_grad_(False)
    averager = GradientAverager(model, comm)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))).sum().backward()
    averager.synchronize()
    grads = comm.allgather(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                      if p.requires_grad]))
    torch.testing.assert_close(grads[0], grads[-1])
    assert model[2].weight.grad is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
def test_unchecked_averager_agrees_on_its_buckets(comm, cap_mb):
    """Without the replica check the bucket layout is still agreed before any bucket."""
    model = make_model(comm)
    with pytest.raises(ValueError, match=r"ranks disagree on the GradientAverager's buckets"):
        GradientAverager(model, comm, check_replicas=False, bucket_cap_mb=cap_mb)


@pytest.mark.mpi(min_size=2)
def test_mismatched_bucket_cap_is_refused(comm):
    model = make_model(comm, freeze_on_last_rank=False)
    cap = 1e-4 if comm.rank == 0 else 25.0
    with pytest.raises(ValueError, match=r"gradient buckets="):
        GradientAverager(model, comm, bucket_cap_mb=cap)


@pytest.mark.mpi(min_size=2)
def test_gradient_missing_on_one_rank_is_agreed(comm):
    """A layer unused in this step's forward on one rank only: every rank ends with the
    same gradient (the average, the missing one counted as zeros)."""
    model = make_model(comm, freeze_on_last_rank=False)
    averager = GradientAverager(model, comm, bucket_cap_mb=1e-4)
    for step in range(2):  # the first step agrees on the posting order, then hooks post
        model.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
        # rank 0 skips model[2] in this forward
        out = model[4](torch.relu(model[0](x))) if comm.rank == 0 else model(x)
        out.square().sum().backward()
        averager.synchronize()
        for name, p in model.named_parameters():
            assert p.grad is not None, (step, name)
            everyone = comm.allgather(p.grad)
            for other in everyone[1:]:
                torch.testing.assert_close(everyone[0], other, rtol=0, atol=0)


@pytest.mark.mpi(min_size=2)
def test_mismatched_fused_allreduce_raises_before_mpi(comm):
    tensors = [torch.ones(10), torch.ones(5 if comm.rank == 0 else 7)]
    fused = FusedAllreduce(comm, tensors, op="sum")
    with pytest.raises(ValueError, match=r"ranks disagree on the fused allreduce's messages"):
        fused.start()
    assert not fused._inflight  # nothing was handed to MPI


@pytest.mark.mpi(min_size=2)
def test_fused_allreduce_agrees_once(comm):
    tensors = [torch.ones(10), torch.ones(5)]
    fused = FusedAllreduce(comm, tensors, op="sum")
    comm.reset_traffic()
    fused.start().wait()
    fused.start().wait()
    assert comm.stats.calls_of("agree") == 1
    assert comm.stats.calls_of("allreduce") == 2
    torch.testing.assert_close(tensors[1], torch.full((5,), float(comm.size**2)))


@pytest.mark.mpi(min_size=2)
def test_agree_names_the_differing_ranks(comm):
    comm.agree([1, 2], "the same thing")
    mine = [1, 2] if comm.rank != comm.size - 1 else [1, 3]
    with pytest.raises(ValueError, match=rf"ranks disagree on x \(rank 0: \[1, 2\]; other "
                                         rf"ranks that differ: \{{{comm.size - 1}: '\[1, 3\]'\}}"):
        comm.agree(mine, "x")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check_replicas", [True, False])
@pytest.mark.parametrize("option, mine", [("inv_update_steps", lambda rank: 2 + rank % 2),
                                          ("factor_update_steps", lambda rank: 1 + rank % 2),
                                          ("decomposition_lag", lambda rank: rank % 2)])
def test_update_schedules_are_agreed(comm, check_replicas, option, mine):
    """Ranks with other update steps or lags post other collectives at a step: one error
    on every rank at construction (an MPI_ERR_TRUNCATE and a hang at step 2 before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    with pytest.raises(ValueError, match=r"ranks (hold different models|disagree)"):
        KFACPreconditioner(model, comm=comm, damping=0.01, lr=0.1,
                           check_replicas=check_replicas, **{option: mine(comm.rank)})
