"""GPU tests (each module sets ``pytestmark = pytest.mark.gpu``; skipped without CUDA).

``KFAC_HPC_TEST_DEVICE`` (default ``cuda``) names the device; ``cpu`` runs the tests'
logic on a machine without a GPU (CUDA-only checks skip themselves), to check the tests.
With several ranks and one GPU, the ranks share it.

Several tests compare two runs bit for bit (a resumed run with the uninterrupted one, a
captured step with the eager one). The model's own backward must then be reproducible:
cuDNN's default convolution algorithms may accumulate with atomics (the weight gradients
of two identical passes differ in the last bits), so every GPU test asks cuDNN for
deterministic algorithms, as a user who needs reproducible runs does.

``KFAC_HPC_TEST_CUDA_GRAPHS=0`` runs every test with the optimizers' step graphs off by
default (``kfac_hpc.step_graph.DEFAULT_DEVICES`` empty; tests that pass ``cuda_graphs``
keep their choice): the eager path users get with ``cuda_graphs=False``. Unset or ``1``:
the library's default, graphs on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def deterministic_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.backends.cudnn.deterministic`` for the test, restored after it."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)


@pytest.fixture(autouse=True)
def step_graphs_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``KFAC_HPC_TEST_CUDA_GRAPHS=0``, ``cuda_graphs=None`` captures nowhere."""
    if os.environ.get("KFAC_HPC_TEST_CUDA_GRAPHS", "1") == "0":
        from kfac_hpc import step_graph

        monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset())


@pytest.fixture
def device() -> torch.device:
    """``cuda:<local rank mod GPUs>`` (made current), or the ``KFAC_HPC_TEST_DEVICE`` stand-in."""
    name = os.environ.get("KFAC_HPC_TEST_DEVICE", "cuda")
    if name != "cuda":
        return torch.device(name)
    from mpi4py import MPI

    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    index = local.Get_rank() % max(1, torch.cuda.device_count())
    local.Free()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
