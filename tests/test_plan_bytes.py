"""The planner's bytes equal the communicator's counters exactly (every strategy/option).

MPI: ``launch/local -n 2|4 python -m mpi4py -m pytest --with-mpi --only-mpi
tests/test_plan_bytes.py``. Each configuration builds a preconditioner on its own
duplicate of COMM_WORLD, runs a few steps of a tiny conv net, and compares, step by
step and per phase, the counters with :meth:`Distribution.step_traffic`:

* factors: the world communicator's reduce-scatter + allreduce bytes and calls;
* decompositions / gradients: the broadcasts of the worker / receiver communicator;
* total: ``comm.traffic().total_bytes`` (world + sub-communicators) = the phases' sum;
* the library's own tags, ``comm.traffic().tag_bytes(phase)`` (sub-communicators share
  the world's open tags; the overlap buckets posted from hooks are tagged too), bytes
  and calls.

Construction traffic (the replica check) is compared separately, and so is
``memory_bytes()`` with :meth:`Distribution.memory`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.plan.distribution import BYTE_PHASES, Distribution, construction_traffic
from kfac_hpc.plan.model_shapes import model_spec
from kfac_hpc.plan.options import KFACOptions

INPUT = (3, 8, 8)
STEPS = 5


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 3 * 3, 20), nn.ReLU(), nn.Linear(20, 5))


Opt = KFACOptions
CONFIGS: dict[str, KFACOptions] = {
    "comm-opt": Opt(),
    "mem-opt+reduce": Opt(strategy="mem-opt", kfac_approx="reduce"),
    "comm-opt+pack+F2I3": Opt(symmetric_packing=True, factor_update_steps=2, inv_update_steps=3),
    "comm-opt+overlap-small-buckets": Opt(overlap=True, bucket_cap_mb=0.002),
    "comm-opt+sync@inv": Opt(factor_sync="inverse", inv_update_steps=2),
    "comm-opt+local24+inverse": Opt(local_decomposition_threshold=24, compute_method="inverse"),
    "comm-opt+local0+pack+overlap": Opt(local_decomposition_threshold=0, symmetric_packing=True,
                                      overlap=True, bucket_cap_mb=0.004),
    "comm-opt+float64": Opt(factor_dtype="float64", inv_dtype="float64", inv_update_steps=2),
    "comm-opt+bf16-factors": Opt(factor_dtype="bfloat16", local_decomposition_threshold=24),
    "mem-opt": Opt(strategy="mem-opt"),
    "mem-opt+pack+overlap+I2": Opt(strategy="mem-opt", symmetric_packing=True, overlap=True,
                                 bucket_cap_mb=0.002, inv_update_steps=2),
    "mem-opt+sync@inv+inverse": Opt(strategy="mem-opt", factor_sync="inverse",
                                  inv_update_steps=3, compute_method="inverse"),
    "hybrid-1/2+local24+pack": Opt(strategy="hybrid-opt", grad_worker_fraction=0.5,
                                 local_decomposition_threshold=24, symmetric_packing=True),
    "hybrid-1/2+sync@inv+inverse": Opt(strategy="hybrid-opt", grad_worker_fraction=0.5,
                                     factor_sync="inverse", inv_update_steps=2,
                                     compute_method="inverse"),
    "hybrid-1/2+overlap+F2": Opt(strategy="hybrid-opt", grad_worker_fraction=0.5, overlap=True,
                               bucket_cap_mb=0.003, factor_update_steps=2),
    "dp-kfac": Opt(strategy="dp-kfac", inv_update_steps=2),
    "dp-kfac+inverse+bf16-inv": Opt(strategy="dp-kfac", compute_method="inverse",
                                  inv_dtype="bfloat16", factor_update_steps=2),
    "comm-opt+no-replica-check": Opt(check_replicas=False),
    # low rank (cap c: Q c·n, λ c, ρ, rank, #valid per factor): A 72, A 145 sketched, A 28,
    # G 20, A 21 exact eigh truncated to c; the energy rule keeps the layout of its cap
    "comm-opt+low-rank6+I2": Opt(low_rank=6, low_rank_min_dim=20, inv_update_steps=2),
    "mem-opt+low-rank8+energy": Opt(strategy="mem-opt", low_rank=8, low_rank_energy=0.9,
                                    low_rank_min_dim=16),
    "hybrid-1/2+low-rank6+energy+local24": Opt(
        strategy="hybrid-opt", grad_worker_fraction=0.5, low_rank=6, low_rank_energy=0.95,
        low_rank_min_dim=16, low_rank_remainder="zero", local_decomposition_threshold=24),
}


def _measure(pre: KFACPreconditioner) -> dict[str, int]:
    """Counters now, by phase, read by collective kind and communicator.

    factors: the world communicator's reduce-scatters and allreduces, less the agreement
    allreduces (read by their tag);
    decompositions / gradients: the broadcasts of the worker / receiver communicator.
    The library's own tags are returned too (``tag:<phase>``).
    """
    comm = pre.comm
    traffic = comm.traffic()  # the world's counters merged with its sub-communicators'
    agreed = traffic.tags.get("agreement")
    out: dict[str, int] = {
        "factors": comm.stats.bytes_of("reduce_scatter") + comm.stats.bytes_of("allreduce")
        - (agreed.bytes if agreed else 0),
        "factors#calls": comm.stats.calls_of("reduce_scatter") + comm.stats.calls_of("allreduce")
        - (agreed.calls if agreed else 0),
        "agreement": agreed.bytes if agreed else 0,
        "agreement#calls": agreed.calls if agreed else 0,
        "total": traffic.total_bytes}
    for phase, sub in (("decompositions", pre.worker_comm), ("gradients", pre.receiver_comm)):
        out[phase] = sub.stats.bytes_of("broadcast")
        out[phase + "#calls"] = sub.stats.calls_of("broadcast")
    for phase in BYTE_PHASES:
        out["tag:" + phase] = traffic.tag_bytes(phase)
        out["tag:" + phase + "#calls"] = traffic.tags[phase].calls if phase in traffic.tags else 0
    return out


def run_config(options: KFACOptions, mpi_comm: MPI.Comm) -> None:
    comm = Communicator(mpi_comm.Dup(), name="plan-bytes")
    world, rank = comm.size, comm.rank
    if options.strategy == "hybrid-opt" and world % 2:
        pytest.skip("hybrid 1/2 needs an even world size")
    model = tiny_net()
    spec = model_spec(model, input_shape=INPUT)
    dist = Distribution(spec, options, world)
    pre = KFACPreconditioner(model, comm=comm, lr=0.1, **options.preconditioner_kwargs())
    assert pre.placement == dist.placement
    built = _measure(pre)
    assert built["total"] == construction_traffic(spec, options, world).total
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x = torch.randn((4, *INPUT), generator=g)
        y = torch.randint(0, 5, (4,), generator=g)
        before = _measure(pre)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        after = _measure(pre)
        got = {k: after[k] - before[k] for k in after}
        want = dist.step_traffic(step, rank)
        for phase in BYTE_PHASES:
            assert got[phase] == want.bytes[phase], (
                f"step {step} rank {rank} {phase}: counted {got[phase]} B, "
                f"predicted {want.bytes[phase]} B")
            assert got[phase + "#calls"] == want.calls[phase], (
                f"step {step} rank {rank} {phase}: {got[phase + '#calls']} calls, "
                f"predicted {want.calls[phase]}")
        assert got["total"] == want.total, f"step {step}: unexpected traffic {got}"
        # the library's own tags (comm.traffic().tag_bytes) say the same
        for phase in BYTE_PHASES:
            assert got["tag:" + phase] == want.bytes[phase], (phase, got)
            assert got["tag:" + phase + "#calls"] == want.calls[phase], (phase, got)
    mem = pre.memory_bytes()
    predicted = dist.memory(rank)
    assert mem["factors"] == predicted["factors"]
    if options.low_rank_energy is None:
        assert mem["decompositions"] == predicted["decompositions"]
    else:  # the energy rule keeps at most the cap: the planner's memory is a bound
        assert mem["decompositions"] <= predicted["decompositions"]
    pre.remove_hooks()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_exact_mpi(name: str) -> None:
    run_config(CONFIGS[name], MPI.COMM_WORLD)


@pytest.mark.parametrize("name", ["comm-opt", "mem-opt+pack+overlap+I2", "dp-kfac",
                                  "comm-opt+low-rank6+I2"])
def test_world_of_one_counts_nothing(name: str) -> None:
    run_config(CONFIGS[name], MPI.COMM_SELF)


def test_configs_cover_every_strategy_and_option() -> None:
    seen = {o.strategy for o in CONFIGS.values()}
    assert seen == {"comm-opt", "mem-opt", "hybrid-opt", "dp-kfac"}
    for flag in ("symmetric_packing", "overlap", "check_replicas"):
        assert len({getattr(o, flag) for o in CONFIGS.values()}) == 2, flag
    assert {o.factor_sync for o in CONFIGS.values()} == {"step", "inverse"}
    assert {o.compute_method for o in CONFIGS.values()} == {"eigen", "inverse"}
    assert any(o.factor_update_steps > 1 for o in CONFIGS.values())
    assert any(o.inv_update_steps > 1 for o in CONFIGS.values())
    assert len({o.local_decomposition_threshold for o in CONFIGS.values()}) >= 3
    assert replace(CONFIGS["comm-opt"]) == KFACOptions()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_averaging_bytes_exact_with_a_frozen_backbone_mpi(dtype: torch.dtype) -> None:
    """GradientAverager sends the trainable gradients in their dtype, one flag each: the
    planner's ``grad_avg_bytes`` (it counted every parameter in fp32, 26x too many here)."""
    from kfac_hpc import GradientAverager
    from kfac_hpc.plan.profile import default_profile
    from kfac_hpc.plan.timing import estimate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)).to(dtype)
    model[0].requires_grad_(False)
    comm = Communicator(MPI.COMM_WORLD.Dup())
    averager = GradientAverager(model, comm)
    for _ in range(2):  # the second: the first also agrees on the buckets' order
        comm.stats.reset()
        model.zero_grad()
        F.cross_entropy(model(torch.randn(4, 64, dtype=dtype)),
                        torch.zeros(4, dtype=torch.long)).backward()
        averager.synchronize()
    spec = model_spec(model)
    assert comm.stats.total_bytes == spec.gradient_average_bytes, comm.stats.snapshot()
    est = estimate(spec, KFACOptions(), comm.size, 4, default_profile())
    assert est.grad_avg_bytes == spec.gradient_average_bytes
    size = dtype.itemsize
    assert est.model_bytes == (64 * 65 + 5 * 65) * size + 2 * 5 * 65 * size


@pytest.mark.parametrize("name", ["comm-opt", "comm-opt+overlap-small-buckets",
                                  "comm-opt+local0+pack+overlap"])
def test_reduce_scatters_are_priced_by_their_largest_segment(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Owners hold whole factors, so segments are uneven; a ring reduce-scatter takes
    P - 1 rounds of the largest: priced as an even call of P times it (the total before,
    8.9x too cheap for ResNet-50 on 64 ranks)."""
    from kfac_hpc.kfac.layouts import factor_layout
    from kfac_hpc.plan.collectives import LinkCost
    from kfac_hpc.plan.profile import default_profile
    from kfac_hpc.plan.timing import estimate

    options, world = CONFIGS[name], 3
    spec = model_spec(tiny_net(), input_shape=(3, 8, 8))
    dist = Distribution(spec, options, world)
    if options.overlap:
        assert len(dist.reduce_segments) == len(dist.buckets)
        assert all(s <= b for s, b in zip(dist.reduce_segments, dist.buckets))
    else:
        counts = factor_layout(dist.placement, dist.dims, options.symmetric_packing).counts()
        assert dist.reduce_segments == [max(counts)] and max(counts) * world > sum(counts)
    priced: list[float] = []
    time = LinkCost.time

    def spy(self: LinkCost, kind: str, nbytes: float, p: int) -> float:
        if kind == "reduce_scatter":
            priced.append(nbytes)
        return time(self, kind, nbytes, p)

    monkeypatch.setattr(LinkCost, "time", spy)
    estimate(spec, options, world, 2, default_profile())
    size = 4  # float32 factors
    want = [max(b, world * s) * size for b, s in zip(
        dist.buckets if options.overlap else [dist.reduce_numel[0]], dist.reduce_segments)]
    assert priced[:len(want)] == want
