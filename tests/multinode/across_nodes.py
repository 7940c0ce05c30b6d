"""MPI tests that run across nodes (network namespaces, ``launch/netns-nodes``).

Not collected by a plain ``pytest tests`` (the name has no ``test_`` prefix): the
outer tests (``test_multinode_mpi.py``) run it under ``launch/netns-nodes -N NODES -n
RANKS_PER_NODE python -m mpi4py -m pytest --with-mpi --only-mpi tests/multinode/across_nodes.py``,
which sets ``KFAC_NETNS_NODES`` and ``KFAC_NETNS_RANKS_PER_NODE``; ranks fill node1 first
(ranks ``0..R-1`` on node1, ``R..2R-1`` on node2, ...). Every rank compares its run with
a one-rank run over ``COMM_SELF`` in the same process, so inter-node traffic (TCP between
the namespaces; shared memory only inside a node) must not change a single bit (on a
power-of-two number of ranks; see :func:`test_kfac_equals_one_rank`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from mpi4py import MPI
from shared_cases import case_ids, kfac_cases, small_cnn, small_cnn_batches, train_kfac
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.runtime import discovery
from kfac_hpc.runtime.device import local_rank_from_environment, select_device

pytestmark = pytest.mark.mpi(min_size=2)

NODES = int(os.environ.get("KFAC_NETNS_NODES", "0"))
PER_NODE = int(os.environ.get("KFAC_NETNS_RANKS_PER_NODE", "0"))
CASES = kfac_cases(input_shape=(4, 2, 5, 5))


@pytest.fixture(autouse=True)
def _on_nodes() -> None:
    if not NODES:
        pytest.skip("runs across nodes only: launch/netns-nodes sets KFAC_NETNS_NODES")


def node_of(rank: int) -> int:
    """1-based node of a world rank (ranks fill node1 first)."""
    return rank // PER_NODE + 1


def test_discovery_from_mpi_and_launcher(comm: Communicator) -> None:
    job = discovery.from_mpi(comm)
    assert (job.nodes, job.local_size, job.local_rank) == (NODES, PER_NODE, comm.rank % PER_NODE)
    assert job.host == f"node{node_of(comm.rank)}"
    launcher = discovery.from_environment()
    assert launcher.source == "openmpi"
    assert (launcher.rank, launcher.size, launcher.local_rank, launcher.local_size,
            launcher.nodes) == (comm.rank, comm.size, job.local_rank, job.local_size, NODES)
    assert launcher.host == job.host
    local = local_rank_from_environment()
    assert (local.rank, local.variable) == (job.local_rank, "OMPI_COMM_WORLD_LOCAL_RANK")
    # the device follows the local rank: cuda:<local rank mod GPUs>; the CPU here
    expected = (torch.device("cuda", job.local_rank % torch.cuda.device_count())
                if torch.cuda.is_available() else torch.device("cpu"))
    assert select_device("auto", local_rank=job.local_rank) == expected
    # the shared-memory split holds exactly the ranks of this node
    node = comm.split_shared()
    try:
        members = node.allgather_object(comm.rank)
    finally:
        comm.children.remove(node)
        node.free()
    assert sorted(members) == [r for r in range(comm.size) if node_of(r) == node_of(comm.rank)]


def _kfac_run(comm: Communicator, strategy: str, fraction: float | None,
              options: dict[str, Any]) -> tuple[nn.Module, KFACPreconditioner]:
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
                             damping=0.01, inv_update_steps=2, inv_dtype=torch.float64,
                             **options)
    train_kfac(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre,
               small_cnn_batches(5))
    return model, pre


def _assert_equal_to_one_rank(comm: Communicator, model: nn.Module, strategy: str,
                              options: dict[str, Any]) -> None:
    single, pre = _kfac_run(Communicator(MPI.COMM_SELF, name="self"),
                            "comm-opt" if strategy == "hybrid-opt" else strategy, None, options)
    pre.close()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        if comm.size & (comm.size - 1) == 0:
            assert torch.equal(p, q), f"{name} differs from one rank by {_diff(p, q):.3e}"
        else:  # the mean of k equal values is not always that value when k is not 2^m
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=f"{name} differs")


def _diff(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().max())


@pytest.mark.parametrize("strategy, options", CASES, ids=case_ids(CASES))
def test_kfac_equals_one_rank(comm: Communicator, strategy: str, options: dict[str, Any]) -> None:
    """Every strategy and option set: the one-rank run (every rank takes the same batch,
    so the averaged factors equal each rank's own): bitwise on 2^m ranks; on others the
    sum of k equal factors divided by k may round (6x/6 != x), 1e-12 relative."""
    fraction = 0.5 if strategy == "hybrid-opt" else None
    if strategy == "hybrid-opt" and comm.size % 2:
        pytest.skip("fraction 1/2 needs an even world")
    model, pre = _kfac_run(comm, strategy, fraction, options)
    pre.close()
    _assert_equal_to_one_rank(comm, model, strategy, options)


def _groups_span(comm: Communicator, pre: KFACPreconditioner) -> tuple[bool, bool]:
    """(some worker group spans nodes, some receiver group spans nodes)."""
    workers = pre.placement.grad_workers
    worker_groups = [range(g * workers, (g + 1) * workers) for g in range(comm.size // workers)]
    receiver_groups = [range(j, comm.size, workers) for j in range(workers)]

    def spans(groups: list[range]) -> bool:
        return any(len({node_of(r) for r in group}) > 1 for group in groups)

    return spans(worker_groups), spans(receiver_groups)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_hybrid_opt_groups_within_and_across_nodes(comm: Communicator, workers: int) -> None:
    """hybrid-opt with ``workers`` gradient workers per layer (consecutive ranks): worker
    groups inside one node when ``workers`` divides the ranks per node, across nodes
    otherwise; receiver groups across nodes. Bitwise the one-rank run either way."""
    if comm.size % workers or workers in (1, comm.size):
        pytest.skip(f"{workers} worker(s) per layer is not hybrid-opt at {comm.size} ranks")
    model, pre = _kfac_run(comm, "hybrid-opt", workers / comm.size, {})
    try:
        worker_span, receiver_span = _groups_span(comm, pre)
        # consecutive blocks of `workers` ranks stay on one node iff they tile a node
        assert worker_span == (PER_NODE % workers != 0)
        assert receiver_span
        print(f"\nhybrid-opt {NODES}x{PER_NODE}, {workers} workers per layer: worker groups "
              f"{'span nodes' if worker_span else 'within nodes'}, receiver groups span nodes")
        # the subcommunicators hold exactly the ranks the placement names
        members = pre.worker_comm.allgather_object(comm.rank)
        group = pre.placement.worker_group_of_rank(comm.rank)
        assert sorted(members) == list(range(group * workers, (group + 1) * workers))
    finally:
        pre.close()
    _assert_equal_to_one_rank(comm, model, "hybrid-opt", {})


def test_owners_on_every_node(comm: Communicator) -> None:
    """The placement ignores nodes: owners are spread over ranks, so every node owns
    factors (reduced to it, decomposed there, broadcast from it across the network)."""
    _, pre = _kfac_run(comm, "mem-opt", None, {"local_decomposition_threshold": 0})
    try:
        owners = {pre.factor_owner(k) for k in pre.factor_keys()}
    finally:
        pre.close()
    assert len({node_of(r) for r in owners}) > 1
