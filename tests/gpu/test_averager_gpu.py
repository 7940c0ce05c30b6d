"""GradientAverager on CUDA: the same averages as on the CPU, overlapped with backward.

Each rank trains a float64 copy of one model on its own batch on the device and on the
CPU; after every step the averaged gradients must agree to 1e-12. Buckets are tiny in
one case, so reductions are posted from the hooks (on autograd's CUDA worker thread),
staged through pinned memory or handed to MPI on the device.
``KFAC_HPC_TEST_DEVICE=cpu`` runs the same logic with both copies on the CPU.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from shared_cases import direct_or_staged
from torch import nn

from kfac_hpc import GradientAverager
from kfac_hpc.comm import Communicator

pytestmark = pytest.mark.gpu
ON_CUDA = os.environ.get("KFAC_HPC_TEST_DEVICE", "cuda") == "cuda"
STEPS = 3


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3), nn.Linear(2, 2))  # the last one is never used
    return net.to(device=device, dtype=torch.float64)


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net[:5](x).square().sum()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("path", ["staged", "device"])
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
def test_averager_on_the_device_equals_the_cpu(device: torch.device, path: str,
                                               cap_mb: float) -> None:
    comm = direct_or_staged(path, device)
    reference_comm = Communicator(cuda_aware=False)
    gpu_net, cpu_net = model(device), model(torch.device("cpu"))
    gpu_avg = GradientAverager(gpu_net, comm, bucket_cap_mb=cap_mb)
    cpu_avg = GradientAverager(cpu_net, reference_comm, bucket_cap_mb=cap_mb)
    hook_threads: set[str] = set()
    for p in gpu_net.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _: hook_threads.add(threading.current_thread().name))
    g = torch.Generator().manual_seed(comm.rank)
    posted_early = []
    for _ in range(STEPS):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        for net, averager in ((gpu_net, gpu_avg), (cpu_net, cpu_avg)):
            net.zero_grad()
            loss_of(net, x.to(next(net.parameters()).device)).backward()
            if net is gpu_net:
                posted_early.append(averager._next)
            averager.synchronize()
        for (name, p), q in zip(gpu_net.named_parameters(), cpu_net.parameters()):
            if name.startswith("5."):
                assert p.grad is None and q.grad is None
                continue
            assert p.grad.device == device
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-12, atol=1e-12)
    assert comm.pending() == 0
    if comm.size > 1 and cap_mb < 1:
        assert posted_early[-1] > 0  # buckets handed to MPI from the hooks
    if ON_CUDA:
        assert threading.main_thread().name not in hook_threads  # autograd's worker thread
