"""Captured steps (``cuda_graphs=True``) on CUDA: the eager steps' numbers, few launches.

K-FAC's stale step and Shampoo's plain steps. The plumbing around the graph is checked
on the CPU with a recorder of CUDA-graph semantics (tests/test_kfac_step_graph.py,
tests/test_shampoo_graph.py); here real CUDA graphs are captured and replayed, and a
capture CUDA refuses falls back to eager steps with the allocator still usable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import count_ops
from shared_cases import narrow_resnet50, narrow_resnet50_batches
from torch import Tensor, nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only check")

STEPS = 8


def train(device: torch.device, dtype: torch.dtype, graphs: bool, steps: int = STEPS,
          **options: Any) -> tuple[list[dict[str, Tensor]], KFACPreconditioner]:
    """ResNet-50's layers at an eighth of the widths; the gradients after each step."""
    model = narrow_resnet50().to(device=device, dtype=dtype)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             lr=lambda k: 0.1 / (1 + k), kl_clip=1e-3, inv_update_steps=3,
                             factor_dtype=dtype, inv_dtype=dtype, cuda_graphs=graphs, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for x, y in narrow_resnet50_batches(steps, device):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
        pre.step()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None})
        opt.step()
    pre.close()
    return out, pre


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_replayed_steps_equal_eager_steps(device, dtype):
    """The graph launches the eager step's kernels on the same operands: every step's
    gradients are the eager run's, bit for bit (decompositions renewed at steps 0, 3 and
    6, which capture; every step replays)."""
    eager, _ = train(device, dtype, False)
    graphed, pre = train(device, dtype, True)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (3, 8)
    for k, (a, b) in enumerate(zip(graphed, eager)):
        for name in b:
            assert torch.equal(a[name], b[name]), (k, name)


@needs_cuda
def test_a_replayed_step_dispatches_its_copies_only(device):
    """A replayed stale step dispatches the copies in and out and the two scalar fills,
    whatever the number of layers (54 here)."""
    model = narrow_resnet50().to(device)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             factor_update_steps=10**9, inv_update_steps=10**9,
                             cuda_graphs=True)
    x, y = narrow_resnet50_batches(1, device)[0]
    x = x.float()
    counts = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        counts.append(count_ops(pre.step))
    assert pre.step_graph is not None and pre.step_graph.replays == 4  # step 0 captures
    assert counts[3].kernels <= 6, dict(counts[3].counts)
    assert counts[0].kernels > 100, "the eager step dispatches per layer"
    pre.close()


def train_shampoo(device: torch.device, dtype: torch.dtype, graphs: bool,
                  steps: int = STEPS) -> tuple[list[list[Tensor]], Any]:
    """ResNet-50's layers at an eighth of the widths with Shampoo; parameters per step."""
    from kfac_hpc.shampoo import DistributedShampoo

    model = narrow_resnet50().to(device=device, dtype=dtype)
    opt = DistributedShampoo(model.named_parameters(), comm=Communicator(MPI.COMM_SELF),
                             lr=0.01, epsilon=1e-10, weight_decay=0.01, momentum=0.5,
                             max_preconditioner_dim=64, precondition_frequency=3,
                             factor_dtype=dtype, cuda_graphs=graphs)
    out = []
    for k, (x, y) in enumerate(narrow_resnet50_batches(steps, device)):
        opt.param_groups[0]["lr"] = 0.01 / (1 + k)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out, opt


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_shampoo_replayed_steps_equal_eager_steps(device, dtype):
    """Roots at steps 1, 4 and 7 run eagerly, and step 2 (the key's first); step 3
    captures the block work and steps 5, 6 and 8 replay it: the parameters are the
    eager run's, bit for bit."""
    eager, _ = train_shampoo(device, dtype, False)
    graphed, opt = train_shampoo(device, dtype, True)
    assert opt.step_graph is not None
    assert (opt.step_graph.captures, opt.step_graph.replays) == (1, 4)
    for k, (a, b) in enumerate(zip(graphed, eager)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (k, j)


@needs_cuda
def test_a_replayed_shampoo_step_dispatches_few_operators(device):
    """A replayed plain step: the gradients and bias corrections copied in, the replay,
    the status read and the update, whatever the number of blocks."""
    from kfac_hpc.shampoo import DistributedShampoo

    model = narrow_resnet50().to(device)
    opt = DistributedShampoo(model.named_parameters(), comm=Communicator(MPI.COMM_SELF),
                             max_preconditioner_dim=64, precondition_frequency=10**9,
                             cuda_graphs=True)
    x, y = narrow_resnet50_batches(1, device)[0]
    counts = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x.float()), y).backward()
        counts.append(count_ops(opt.step))
    assert opt.step_graph is not None and opt.step_graph.replays == 3  # step 3 captures
    assert counts[3].kernels <= 12, dict(counts[3].counts)
    assert counts[4].kernels <= 12, dict(counts[4].counts)
    assert counts[1].kernels > 100, "the eager step dispatches per block"


@needs_cuda
def test_a_refused_capture_falls_back_and_leaves_the_allocator_usable(device, monkeypatch):
    """A host read inside the captured work (not capturable): the capture fails, a
    warning names it, the steps run eagerly with the eager results, and the caching
    allocator is back in its normal mode (``empty_cache`` works; its internal check
    fails while a capture's pool is still routed to)."""
    eager, _ = train(device, torch.float64, False, steps=4)
    real = KFACPreconditioner._graph_body

    def reads_the_host(self, k, lr, kl_clip):  # type: ignore[no-untyped-def]
        real(self, k, lr, kl_clip)
        float(lr)  # a device sync: cudaErrorStreamCaptureUnsupported while capturing

    monkeypatch.setattr(KFACPreconditioner, "_graph_body", reads_the_host)
    with pytest.warns(RuntimeWarning, match="capturing the step failed"):
        graphed, pre = train(device, torch.float64, True, steps=4)
    assert pre.step_graph is not None and pre.step_graph.disabled is not None
    for k, (a, b) in enumerate(zip(graphed, eager)):
        for name in b:
            assert torch.equal(a[name], b[name]), (k, name)
    torch.cuda.empty_cache()
    x = torch.ones(1 << 20, device=device)
    assert float(x.sum()) == float(1 << 20)
