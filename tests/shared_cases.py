"""What the device tests share with their CPU stand-ins (``tests/gpu/*`` and
``tests/test_*_device.py``, ``tests/test_shampoo_mpi.py``): the K-FAC option matrix and
the Shampoo test network; and the smooth digits MLP of the driver tests that compare runs
whose float32 reductions differ in order. Importable from ``tests/gpu`` too (``tests/``
is on ``sys.path`` there through ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def smooth_mlp(*, num_classes: int, input_dim: int) -> nn.Module:
    """The driver's ``mlp`` (hidden widths 128, 64; the same initial weights) with tanh in
    place of ReLU: a model factory, ``model="shared_cases:smooth_mlp"``.

    For driver runs compared up to the order of float32 reductions (P ranks against one,
    DDP against MPI averaging, micro-batches against one batch). With ReLU a unit whose
    pre-activation lies within the runs' rounding difference of zero gates a sample's
    gradient in one run and not in the other, a jump no tolerance bounds: in the digits
    MLP at step 21 one first-layer pre-activation is 7e-8 (1.3e-7 with ATen's AVX-512
    kernels) while 2 ranks and 1 rank differ by about 1e-6 there; with ATen's AVX2 kernels
    (``ATEN_CPU_CAPABILITY=avx2``, what a CPU without AVX-512 runs) it changed sign, the
    first layer's gradient moved by 0.7 % and K-FAC's parameters ended 4e-4 apart after 44
    steps; with AVX-512 it kept its sign by chance. Tanh leaves only rounding (2-4e-7 at 2
    and 4 ranks with the AVX2, AVX-512 and scalar kernels).
    """
    from kfac_hpc.models import MLP

    relu_mlp = MLP(input_dim, (128, 64), num_classes)
    return nn.Sequential(*(nn.Tanh() if isinstance(m, nn.ReLU) else m for m in relu_mlp))


#: Driver options for :func:`smooth_mlp`, with the damping the driver gives ``mlp``.
SMOOTH_MLP: dict[str, Any] = {"model": "shared_cases:smooth_mlp", "damping": 0.1}


def kfac_cases(input_shape: tuple[int, ...]) -> list[tuple[str, dict[str, Any]]]:
    """Every strategy and the options that change what travels or when; ``input_shape``
    (one rank's batch) for DP-KFAC's placement by measured work."""
    return [
        ("comm-opt", {}),
        ("comm-opt", {"compute_method": "inverse"}),
        ("comm-opt", {"overlap": True, "bucket_cap_mb": 1e-4}),
        ("comm-opt", {"symmetric_packing": True}),
        ("comm-opt", {"factor_sync": "inverse"}),
        ("comm-opt", {"local_decomposition_threshold": 10}),
        ("comm-opt", {"decomposition_lag": 1}),
        ("mem-opt", {}),
        ("mem-opt", {"overlap": True, "symmetric_packing": True}),
        ("mem-opt", {"compute_method": "inverse", "factor_sync": "inverse"}),
        ("mem-opt", {"decomposition_lag": 1, "symmetric_packing": True}),
        ("hybrid-opt", {}),
        ("dp-kfac", {}),
        ("dp-kfac", {"input_shape": input_shape}),
    ]


def case_ids(cases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{s}-" + "-".join(f"{k}={v}" for k, v in o.items()) for s, o in cases]


def fraction_for(strategy: str, size: int) -> tuple[str, float | None]:
    """``(strategy, grad_worker_fraction)`` for this world size: hybrid-opt at 1/2 (an
    odd world has no such fraction: comm-opt instead)."""
    if strategy == "hybrid-opt":
        return (strategy, 0.5) if size % 2 == 0 else ("comm-opt", None)
    return strategy, None


SHAMPOO_KWARGS: dict[str, Any] = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                      max_preconditioner_dim=4, precondition_frequency=2)


class ShampooNet(nn.Module):
    """Conv 4-D weight (merged to 3-D), matrices, vectors and a 0-d scale; max dim 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h))) * self.scale


def small_cnn() -> nn.Module:
    """Two convolutions (padding, stride) and a Linear layer, float64, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)).double()


def small_cnn_batches(n: int) -> list[tuple[Tensor, Tensor]]:
    """``n`` fixed float64 batches of 4 for :func:`small_cnn` (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 2, 5, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def train_kfac(model: nn.Module, opt: torch.optim.Optimizer, pre: Any,
               data: list[tuple[Tensor, Tensor]]) -> None:
    """Every rank takes the same batch: no gradient averaging needed."""
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


def narrow_resnet50(depths: tuple[int, ...] = (3, 4, 6, 3),
                    widths: tuple[int, ...] = (8, 16, 32, 64)) -> nn.Module:
    """ResNet-50's 54 K-FAC layers (bottlenecks 3, 4, 6, 3) at an eighth of its widths,
    seeded: the same operators per layer, factors small enough to decompose quickly."""
    from kfac_hpc.models import Bottleneck, ResNet

    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                         nn.BatchNorm2d(widths[0]), nn.ReLU())
    return ResNet(Bottleneck, depths, widths, stem=stem, stem_channels=widths[0],
                  num_classes=10)


def narrow_resnet50_batches(n: int, device: torch.device | str = "cpu"
                            ) -> list[tuple[Tensor, Tensor]]:
    """``n`` fixed float64 batches of 4 images of 16x16 for :func:`narrow_resnet50`."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        x = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (4,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def train_narrow_resnet50(device: torch.device | str = "cpu", steps: int = 3) -> nn.Module:
    """:func:`narrow_resnet50` in float64 trained ``steps`` steps with K-FAC (damping 0.01,
    inverse updates every 2 steps) and SGD; returns the model."""
    from mpi4py import MPI

    from kfac_hpc import KFACPreconditioner
    from kfac_hpc.comm import Communicator

    model = narrow_resnet50().to(device=device, dtype=torch.float64)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             inv_update_steps=2, factor_dtype=torch.float64,
                             inv_dtype=torch.float64)
    train_kfac(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pre,
               narrow_resnet50_batches(steps, device))
    pre.close()
    return model


def held_tensors(opt: Any) -> dict[str, Tensor]:
    """Every tensor a DistributedShampoo keeps: gather buffers and status offsets (none on
    one rank), stacked and per-block state."""
    out = dict(opt._exchange.tensors())
    for k, stack in enumerate(opt._stacks):
        for key, value in stack.tensors().items():
            out[f"stack {k} {key}"] = value
    for p, blocks in opt.state.items():
        for index, block in blocks.items():
            for key, value in block.items():
                if isinstance(value, Tensor):
                    out[f"{opt._name_of[p]} block {index} {key}"] = value
    return out


def direct_or_staged(path: str, device: torch.device) -> Any:
    """A Communicator that stages every CUDA tensor (``"staged"``), or one that hands device
    memory to every call the MPI library takes it for (skips where it is not CUDA-aware),
    routing rules undone: the library's device path is what these tests check, and the
    routed default is made of the two paths."""
    import os

    import pytest

    from kfac_hpc.comm import Communicator
    from kfac_hpc.comm.cuda import CUDA_AWARE_ENV, detect

    if path == "staged":
        return Communicator(cuda_aware=False)
    if device.type == "cuda":
        found = detect(env={k: v for k, v in os.environ.items() if k != CUDA_AWARE_ENV})
        if not found.aware:
            pytest.skip(f"device-direct path: the MPI library is not CUDA-aware here "
                        f"({found.summary()}; {'; '.join(found.evidence)})")
    return Communicator(cuda=detect(True).unrouted())


def cuda_fp32_settings_seen(monkeypatch: Any, owner: Any, name: str,
                            run: Callable[[], object]) -> list[str]:
    """Run ``run`` with the user's cuBLAS float32 setting at TF32; return what ``owner.name`` saw.

    ``owner.name`` (a product function) is wrapped to record
    ``torch.backends.cuda.matmul.fp32_precision`` at each call; the user's setting must
    be TF32 again after ``run`` (asserted), and is restored to what it was before.
    """
    flags = torch.backends.cuda.matmul
    seen: list[str] = []
    real = getattr(owner, name)

    def spy(*args: Any) -> Any:
        seen.append(flags.fp32_precision)
        return real(*args)

    before = flags.fp32_precision
    monkeypatch.setattr(owner, name, spy)
    try:
        flags.fp32_precision = "tf32"
        run()
        assert flags.fp32_precision == "tf32"
    finally:
        flags.fp32_precision = before
    return seen
