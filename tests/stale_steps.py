"""Small ResNets with ResNet-50's (and -101's) K-FAC layer shapes, and the operators of
a K-FAC step that only preconditions (the stale step the op-count tests bound)."""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI
from op_count import OpCounter, count_ops
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.models import Bottleneck, ResNet


def resnet_eighth(blocks: tuple[int, int, int, int] = (3, 4, 6, 3)) -> nn.Module:
    """A bottleneck ResNet at an eighth of ResNet-50's widths.

    ``blocks`` (3, 4, 6, 3): ResNet-50's 54 K-FAC layers; (3, 4, 23, 3): ResNet-101's
    105, of the same shapes.
    """
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                         nn.ReLU())
    return ResNet(Bottleneck, blocks, (8, 16, 32, 64), stem=stem, stem_channels=8,
                  num_classes=10)


def stale_step_ops(model: nn.Module, **options: Any) -> tuple[OpCounter, KFACPreconditioner]:
    """Operators of one ``pre.step()`` that only preconditions (factors and
    decompositions from step 0; step 1 built what is kept between inverse updates).

    Args:
        model: The model (small inputs: 2 images of 3x16x16, 10 classes).
        **options: ``KFACPreconditioner`` options.

    Returns:
        The counter of the third step, and the preconditioner (close it).
    """
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             factor_update_steps=1000, inv_update_steps=1000, **options)
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 2])

    def backward() -> None:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()

    for _ in range(2):
        backward()
        pre.step()
    backward()
    return count_ops(pre.step), pre
