"""``kfac-hpc calibrate`` on a GPU: the probes run on the device, the profile says so.

On one rank (and on each of several, sharing the GPU): the compute probes at the GPU's
sizes and the library's default precision, the profile's description naming the GPU,
and its memory per rank the GPU's memory shared among the node's ranks that use it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from kfac_hpc.cli import main
from kfac_hpc.plan import load_profile
from kfac_hpc.plan.calibrate import PROBES, gpu_identity

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only check")


@needs_cuda
def test_calibrate_measures_the_gpu(device: torch.device, tmp_path: Path) -> None:
    out = Path(MPI.COMM_WORLD.bcast(str(tmp_path / "gpu.json"), 0))
    assert main(["calibrate", "--quick", "--device", "cuda", "--out", str(out)]) == 0
    profile = load_profile(out)
    compute = profile.compute
    assert [n for n, _ in compute.eigh] == list(PROBES["cuda"].quick_decompositions)
    assert torch.cuda.get_device_name(device) in profile.description
    assert profile.measured_on == f"GPU {torch.cuda.get_device_name(device)}"
    # the ranks of this node on this physical GPU (its UUID: ranks given a GPU each by
    # CUDA_VISIBLE_DEVICES all call theirs cuda:0)
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    sharing = node.allgather(gpu_identity(device)).count(gpu_identity(device))
    node.Free()
    total = torch.cuda.get_device_properties(device).total_memory
    assert profile.memory_per_rank_bytes == MPI.COMM_WORLD.allreduce(total // sharing,
                                                                      op=MPI.MIN)
    # a data-centre GPU's float32 products run at more than a teraflop (TF32: far more),
    # which no CPU core of the probes' sizes reaches
    assert compute.gemm_flops > 1e12
    assert all(seconds > 0 for _, seconds in compute.eigh + compute.inverse)


@pytest.mark.mpi(min_size=2)
@needs_cuda
def test_calibrate_on_ranks_sharing_gpus(device: torch.device, tmp_path: Path) -> None:
    test_calibrate_measures_the_gpu(device, tmp_path)
