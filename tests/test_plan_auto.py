"""``KFACPreconditioner(strategy="auto")``: resolved by the planner, the same on every rank."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.plan.auto import resolve_auto
from kfac_hpc.plan.collectives import COLLECTIVES, LinkCost
from kfac_hpc.plan.profile import ComputeRates, Profile


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 6))


def profile(alpha: float, beta: float) -> Profile:
    """A machine with cheap compute and the given network."""
    table = ((8, 1e-6), (1024, 1e-3))
    compute = ComputeRates(train_flops=1e12, gemm_flops=1e12, mem_bandwidth=1e11,
                           op_overhead_s=1e-7, eigh=table, inverse=table)
    return Profile("test", {k: LinkCost(alpha, beta, "ring") for k in COLLECTIVES}, compute)


SLOW_BANDWIDTH = profile(alpha=1e-9, beta=1e-6)  # bytes dominate: gradients are smaller
SLOW_LATENCY = profile(alpha=1e-2, beta=1e-15)  # messages dominate: comm-opt sends fewest


def test_world_of_one_is_comm_opt() -> None:
    pre = KFACPreconditioner(mlp(), comm=Communicator(MPI.COMM_SELF), strategy="auto",
                             plan_profile=SLOW_BANDWIDTH)
    assert pre.strategy == "comm-opt" and pre.placement.grad_workers == 1


def test_auto_rejects_a_fraction_and_profile_needs_auto() -> None:
    with pytest.raises(ValueError, match="chooses grad_worker_fraction"):
        KFACPreconditioner(mlp(), comm=Communicator(MPI.COMM_SELF), strategy="auto",
                           grad_worker_fraction=0.5)
    with pytest.raises(ValueError, match="plan_profile applies"):
        KFACPreconditioner(mlp(), comm=Communicator(MPI.COMM_SELF), plan_profile="a100-ib200")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_resolver_extremes(world: int) -> None:
    # bandwidth-bound, decompositions every step: gradients (g·a) beat eigenbases (n²+n),
    # so comm-opt loses and mem-opt broadcasts least (the factor reduce-scatter, priced by
    # its largest owner's segment, depends on each strategy's placement: it may decide)
    s, f, best, ests = resolve_auto(mlp(), world, profile=SLOW_BANDWIDTH)
    assert s != "comm-opt"
    assert best is not None and best.total_s == min(e.total_s for e in ests)
    broadcasts = {e.options.label(): e.time["decomp bcast"] + e.time["grad bcast"]
                  for e in ests}
    assert min(broadcasts, key=broadcasts.__getitem__) == "mem-opt"
    # latency-bound, decompositions rarely: comm-opt sends no per-step gradient messages
    s, f, _, _ = resolve_auto(mlp(), world, profile=SLOW_LATENCY, inv_update_steps=100)
    assert (s, f) == ("comm-opt", None)


def test_memory_budget_overrules_speed() -> None:
    _, _, fast, ests = resolve_auto(mlp(), 4, profile=SLOW_LATENCY, inv_update_steps=100)
    assert fast is not None and fast.options.strategy == "comm-opt"
    smallest = min(e.memory_peak for e in ests)
    s, _, best, _ = resolve_auto(mlp(), 4, profile=SLOW_LATENCY, inv_update_steps=100,
                                 memory_budget=smallest)
    assert best is not None and best.memory_peak == smallest and s != "comm-opt"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("prof,kwargs", [(SLOW_BANDWIDTH, {}),
                                         (SLOW_LATENCY, {"inv_update_steps": 100})])
def test_auto_in_preconditioner_mpi(prof: Profile, kwargs: dict[str, int],
                                    caplog: pytest.LogCaptureFixture) -> None:
    world = MPI.COMM_WORLD
    comm = Communicator(world.Dup())
    model = mlp()
    with caplog.at_level(logging.INFO, logger="kfac_hpc"):
        pre = KFACPreconditioner(model, comm=comm, strategy="auto", plan_profile=prof,
                                 **kwargs)
    expected, fraction, _, _ = resolve_auto(mlp(), comm.size, profile=prof, **kwargs)
    assert pre.strategy == expected
    assert pre.config()["strategy"] == expected
    assert pre.placement.grad_workers == (comm.size if expected == "comm-opt" else 1
                                          if expected == "mem-opt" else
                                          round(fraction * comm.size))
    assert len(set(world.allgather(pre.strategy))) == 1
    if comm.rank == 0:
        assert any("strategy='auto' chose" in r.getMessage() for r in caplog.records)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(comm.rank))
    F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
    pre.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.mpi(min_size=2)
def test_a_profile_rank_0_cannot_read_fails_every_rank_alike(tmp_path_factory) -> None:
    """Rank 0 plans and sends the choice on; its failure (a profile missing on its node)
    is every rank's error, not a hang of the others in the next collective."""
    comm = Communicator(MPI.COMM_WORLD.Dup())
    missing = tmp_path_factory.mktemp("profiles") / "only-elsewhere.json"
    with pytest.raises(ValueError, match=r"rank 0 could not plan: .*only-elsewhere\.json"):
        KFACPreconditioner(mlp(), comm=comm, strategy="auto",
                           plan_profile=missing if comm.rank == 0 else SLOW_LATENCY)


def test_step_kinds_weigh_the_schedule_in_closed_form() -> None:
    """The kinds' shares equal a count over one period, and a period of any length costs
    four kinds (lcm(3, 50000) = 150000 steps was refused before)."""
    from kfac_hpc.plan.distribution import Distribution
    from kfac_hpc.plan.model_shapes import model_spec
    from kfac_hpc.plan.options import KFACOptions

    spec = model_spec(mlp())
    for f, i in ((1, 1), (1, 10), (10, 100), (4, 6), (7, 1000), (3, 50_000)):
        dist = Distribution(spec, KFACOptions(factor_update_steps=f, inv_update_steps=i), 4)
        kinds = dict(dist.step_kinds())
        assert sum(kinds.values()) == pytest.approx(1.0, abs=1e-15)
        length = math.lcm(f, i)
        if length <= 10_000:
            counted: dict[tuple[bool, bool], int] = {}
            for k in range(length):
                kind = (k % f == 0, k % i == 0)
                counted[kind] = counted.get(kind, 0) + 1
            assert kinds == pytest.approx({k: n / length for k, n in counted.items()},
                                          rel=1e-14)
    _, _, best, _ = resolve_auto(mlp(), 4, profile=SLOW_LATENCY, factor_update_steps=3,
                                 inv_update_steps=50_000)
    assert best is not None


def test_a_forward_that_reads_values_is_planned_with_one_row_per_sample(
        caplog: pytest.LogCaptureFixture) -> None:
    """The shape probe runs on the meta device; a forward that reads values cannot, and
    the planner goes on with one row per sample (a warning says so)."""
    from kfac_hpc.plan.model_shapes import model_spec

    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.abs().max() > 1e4:
                h = h / 1e4
            return self.b(h)

    with caplog.at_level(logging.WARNING, logger="kfac_hpc"):
        spec = model_spec(ReadsValues(), input_shape=(5, 8))
    assert [layer.rows_per_sample for layer in spec.layers] == [1, 1]
    assert any("shape probe of ReadsValues" in r.getMessage() for r in caplog.records)
