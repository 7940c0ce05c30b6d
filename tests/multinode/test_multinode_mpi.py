"""The MPI tests of ``across_nodes.py`` (and a few existing MPI tests) on 2, 3 and 4 nodes
of 2 ranks: runtime discovery, K-FAC bitwise equal to one rank for every strategy,
hybrid-opt groups inside and across nodes, Shampoo, checkpoints whose owners sit on
different nodes written to one shared directory and resumed bitwise."""

from __future__ import annotations

import re

import pytest
from netns_cluster import run

pytestmark = pytest.mark.timeout(400)
PYTEST = ["python", "-m", "mpi4py", "-m", "pytest", "-q", "--with-mpi", "--only-mpi",
          "-p", "no:cacheprovider", "-o", "addopts=", "-s"]
ACROSS = "tests/multinode/across_nodes.py"
# existing MPI tests that also run across nodes
SHAMPOO = "tests/test_shampoo_mpi.py::test_distributed_equals_single_rank_bitwise"
RESUME = "tests/test_kfac_faults.py::test_checkpoint_resume_is_bitwise"


def _pytest_on_nodes(nodes: int, per_node: int, targets: list[str], case: str,
                     timeout: int, select: str | None = None) -> str:
    command = [*PYTEST, *(["-k", select] if select else []), *targets]
    rc, out, _ = run(nodes, per_node, command, case=case, timeout=timeout)
    assert rc == 0, out[-6000:]
    assert " passed" in out and not re.search(r"\d+ failed", out), out[-3000:]
    return out


def test_two_nodes_every_case() -> None:
    """2x2: everything (every K-FAC strategy and option set, Shampoo, checkpoint resume)."""
    out = _pytest_on_nodes(2, 2, [ACROSS, SHAMPOO, RESUME],
                           "discovery, K-FAC all strategies, Shampoo, checkpoint resume", 300)
    assert "2 workers per layer: worker groups within nodes" in out


def test_three_nodes_hybrid_groups_across_nodes() -> None:
    """3x2: hybrid-opt with 3 workers per layer (worker groups span nodes) and 2 (inside
    nodes); discovery."""
    out = _pytest_on_nodes(3, 2, [ACROSS], "discovery, hybrid 2/3 workers", 300,
                           select="discovery or hybrid")
    assert "3 workers per layer: worker groups span nodes" in out
    assert "2 workers per layer: worker groups within nodes" in out


def test_four_nodes_discovery_and_groups() -> None:
    """4x2: discovery, owners on several nodes, hybrid-opt with 4 workers per layer."""
    out = _pytest_on_nodes(4, 2, [ACROSS], "discovery, owners, hybrid 4 workers", 300,
                           select="discovery or hybrid and 4 or owners")
    assert "4 workers per layer: worker groups span nodes" in out
