"""Your own model, loss and data with kfac_hpc: through the driver and without it.

Through the driver (factories named ``pkg.module:factory``, see docs/training.md)::

    launch/local -n 2 kfac-hpc train --model examples.custom_model:build_model \\
        --dataset examples.custom_model:build_dataset \\
        --loss examples.custom_model:smoothed_cross_entropy --epochs 3 --batch-size 32

or the same keys in a TOML config (``model = "examples.custom_model:build_model"``).

Through the library API, without the driver (your own training loop)::

    launch/local -n 2 python examples/custom_model.py

Nothing here imports mpi4py at module level: the driver imports this module on every
rank after MPI has started, and ``main()`` picks the device before MPI starts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Spirals(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``classes`` interleaved noisy 2-D spirals, lifted to ``dim`` features by a fixed
    random map: item ``i`` is the same on every rank (it depends only on the seed)."""

    def __init__(self, n: int, *, classes: int = 4, dim: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % classes
        t = torch.rand(n, generator=g) * 3.0 + 0.3
        angle = t * 2.2 + y * (2 * math.pi / classes)
        xy = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], 1)
        xy += 0.08 * torch.randn(n, 2, generator=g)
        lift = torch.randn(2, dim, generator=torch.Generator().manual_seed(1234))
        self.x = torch.tanh(xy @ lift)
        self.y = y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build_dataset(*, seed: int = 0, path: str | None = None
                  ) -> tuple[Spirals, Spirals, int]:
    """Data set factory: ``(train, test, num_classes)`` (``path`` unused here)."""
    del path
    return Spirals(2048, seed=seed), Spirals(512, seed=seed + 1), 4


class GatedMLP(nn.Module):
    """A user-defined model: K-FAC preconditions its nn.Linear layers, whatever the
    wiring around them (here a multiplicative gate)."""

    def __init__(self, input_dim: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.value = nn.Linear(input_dim, width)
        self.gate = nn.Linear(input_dim, width)
        self.out = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.value(x)) * torch.sigmoid(self.gate(x)))
        return out


def build_model(*, num_classes: int, input_dim: int, width: int = 64) -> nn.Module:
    """Model factory: takes the keywords it declares (``width`` from --model-options)."""
    return GatedMLP(input_dim, num_classes, width)


def smoothed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss: cross entropy with label smoothing 0.05 (mean over the batch)."""
    return F.cross_entropy(output, target, label_smoothing=0.05)


def main(epochs: int = 5, batch_size: int = 32) -> float:
    """The library path: your loop, K-FAC, MPI gradient averaging, the sharded loader.
    Returns the final test accuracy (the same on every rank)."""
    import kfac_hpc.runtime

    device = kfac_hpc.runtime.select_device()  # first: before anything starts MPI

    from kfac_hpc import GradientAverager, KFACPreconditioner
    from kfac_hpc.comm import world
    from kfac_hpc.train.data import ShardedLoader

    comm = world()
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = build_model(num_classes=4, input_dim=16).to(device)
    train, test, _ = build_dataset(seed=0)
    loader = ShardedLoader(train, batch_size=batch_size, rank=comm.rank,
                           world_size=comm.size, seed=0, shuffle=True)
    pre = KFACPreconditioner(model, comm=comm, lr=0.1, damping=0.01, inv_update_steps=5)
    averager = GradientAverager(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            smoothed_cross_entropy(model(x.to(device)), y.to(device)).backward()
            averager.synchronize()
            pre.step()
            opt.step()
    with torch.no_grad():  # every rank scores the whole (small) test set
        acc = float((model(test.x.to(device)).argmax(1).cpu() == test.y).float().mean())
    if comm.rank == 0:
        print(f"examples/custom_model.py: {comm.size} rank(s), test accuracy {100 * acc:.1f} %")
    pre.close()
    averager.remove()
    return acc


if __name__ == "__main__":
    main()
