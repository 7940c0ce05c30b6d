"""DistributedShampoo on CUDA tensors: two ranks on the GPU equal the same run on the CPU.

``KFAC_HPC_TEST_DEVICE`` (default ``cuda``) is the device under test; without CUDA the
root conftest skips these tests. ``KFAC_HPC_TEST_DEVICE=cpu`` runs them on the CPU
(the comparison is then CPU against CPU), which checks the test code itself::

    launch/local -n 2 python -m mpi4py -m pytest --with-mpi --only-mpi tests/gpu
    KFAC_HPC_TEST_DEVICE=cpu launch/local -n 2 python -m mpi4py -m pytest --with-mpi \\
        --only-mpi tests/gpu

Tolerance: float64 factors, roots and communication; cuSOLVER and LAPACK
eigendecompositions and the matrix products differ in the last bits only, so after 5
steps parameters agree to ~1e-13 relative; 1e-10 leaves room, a wrong device, dtype or
update gives O(1e-3) or more. That holds for a well-conditioned root only: these 4x4
blocks see a few gradients, so their factors are rank-deficient, and their null-space
eigenvalues are rounding noise (about ``u·‖L‖``). With Shampoo's default
``epsilon=1e-12`` the root ``(λ + ε)^(-1/4)`` turns that noise into differences of
1e-9 relative between CUDA and the CPU (measured on an H200: 1.4e-9 and 2.6e-10); on
the CPU alone, a relative perturbation of 1e-16 of the inputs moves the parameters by
1e-6 relative after 5 steps with ``epsilon=1e-12`` and by 6e-12 with ``epsilon=1e-6``.
The comparison therefore runs with ``epsilon=1e-6`` (more than the noise by orders of
magnitude, well below the factors' scale), where rounding is not amplified and 1e-10
is a real bound.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
from shared_cases import SHAMPOO_KWARGS, held_tensors
from shared_cases import ShampooNet as Net
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.runtime import select_device
from kfac_hpc.shampoo import DistributedShampoo

KIND = os.environ.get("KFAC_HPC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.gpu

KWARGS: dict[str, Any] = dict(SHAMPOO_KWARGS, factor_dtype=torch.float64,
                              communication_dtype=torch.float64, epsilon=1e-6)


@pytest.fixture
def device() -> torch.device:
    """This rank's device, chosen from the launcher's local rank (as a script would)."""
    return select_device(KIND)


def batches(steps: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 2, 4, 4, generator=g, dtype=torch.float64),
             torch.randn(8, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(model: nn.Module, opt: DistributedShampoo, data: list[tuple[Tensor, Tensor]],
          device: torch.device) -> None:
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()


def assert_on(opt: DistributedShampoo, device: torch.device, *, with_state: bool = True) -> None:
    held = held_tensors(opt)
    wrong = {k: str(v.device) for k, v in held.items() if v.device != device}
    assert not wrong, f"not on {device}: {wrong}"
    if with_state and opt._owned:
        assert len(held) > 3, "no block state held: the check proved nothing"


def params_cpu(model: nn.Module) -> list[Tensor]:
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.mpi(min_size=2)
def test_two_ranks_on_the_device_equal_the_cpu(comm: Communicator,
                                               device: torch.device) -> None:
    cpu_model = Net().double()
    dev_model = copy.deepcopy(cpu_model).to(device)
    cpu_opt = DistributedShampoo(cpu_model.named_parameters(), comm=comm, **KWARGS)
    dev_opt = DistributedShampoo(dev_model.named_parameters(), comm=comm, **KWARGS)
    assert_on(dev_opt, device, with_state=False)
    data = batches(5, seed=1)
    train(cpu_model, cpu_opt, data, torch.device("cpu"))
    train(dev_model, dev_opt, data, device)
    for a, b in zip(params_cpu(dev_model), params_cpu(cpu_model)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert_on(dev_opt, device)
    rows = comm.allgather(torch.cat([p.reshape(-1) for p in params_cpu(dev_model)]))
    assert all(torch.equal(rows[0], row) for row in rows)  # identical on every rank

    # A state dict (CPU tensors) loads into an optimizer on the device, onto the device.
    sd = dev_opt.state_dict()
    assert all(v.device.type == "cpu" for blocks in sd["state"].values()
               for block in blocks.values() for v in block.values() if isinstance(v, Tensor))
    twin = copy.deepcopy(dev_model)
    other = DistributedShampoo(twin.named_parameters(), comm=comm, **KWARGS)
    other.load_state_dict(sd)
    assert_on(other, device)
    more = batches(3, seed=2)
    train(dev_model, dev_opt, more, device)
    train(twin, other, more, device)
    for a, b in zip(params_cpu(twin), params_cpu(dev_model)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _syncs(step: Any) -> int:
    """GPU synchronisations (CUDA's sync debug mode) during ``step()``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _syncs_per_step(params: list[nn.Parameter], steps: int, **options: Any) -> list[int]:
    from mpi4py import MPI

    opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF, name="self"), lr=0.01,
                             momentum=0.9, max_preconditioner_dim=4, **options)
    g = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        counts.append(_syncs(opt.step))
    return counts


def test_host_syncs_per_step_do_not_grow_with_blocks(device: torch.device) -> None:
    """Between root recomputations a step synchronises with the GPU as often for one
    block as for 14 (on one rank: the one status read; none per block)."""
    if device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs CUDA; tests/test_shampoo_device.py "
                    "counts host reads on the CPU")
    g = torch.Generator().manual_seed(0)
    per_step = []
    for shapes in ([(4, 4)], [(4, 4), (10,), (6, 10), (4, 5, 6)]):
        params = [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
        # step 0 computes the first roots (the eigensolver syncs)
        per_step.append(_syncs_per_step(params, 4, precondition_frequency=1000)[1:])
    assert per_step[0] == per_step[1], per_step
    assert min(per_step[0]) >= 1, per_step  # the status read registers: the count is real


def test_host_syncs_per_root_step_do_not_grow_with_same_shape_blocks(
        device: torch.device) -> None:
    """A step that recomputes every root synchronises as often for 4 blocks of a shape as
    for 16: one batched eigensolver per factor size, one read of the roots' finiteness,
    the status read."""
    if device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs CUDA")
    g = torch.Generator().manual_seed(0)
    counts = []
    for n in (4, 16):
        params = [nn.Parameter(torch.randn(4, 4, generator=g).to(device)) for _ in range(n)]
        counts.append(_syncs_per_step(params, 3, precondition_frequency=1))
    assert counts[0] == counts[1], counts
    assert min(counts[0]) >= 2, counts


def _gram(n: int, k: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    return x @ x.T / k


def test_newton_roots_on_the_device_equal_the_cpu_whatever_the_tf32_setting(
        device: torch.device) -> None:
    """NewtonRoots on the device: float64 equal to the CPU's to 1e-12 relative in the
    Frobenius norm (the same iterations, products summed in another order: entries of
    1e-6 next to entries of 1 make an element-wise relative check a matter of summation
    luck, 2.5e-12 at worst over 16 summation orders on the CPU); float32 the same bits
    with the user's TF32 setting on as off (the iteration runs its GEMMs at full float32
    precision: TF32 would move the roots by ~1e-3; checked to make a difference to a
    plain product here, else the check proves nothing), and within ``4·u·κ·√n`` (1.6e-5
    here: κ ≈ 8, n = 64) of float64 in the Frobenius norm (3.3e-6 measured on the CPU)."""
    from kfac_hpc.shampoo import NewtonRoots
    from kfac_hpc.shampoo.roots import RootRequest, inverse_roots

    factors = torch.stack([_gram(64, 256, s) for s in range(3)])
    method = NewtonRoots(tolerance=1e-10)
    roots = {}
    for where in ("cpu", device):
        request = RootRequest(factors.to(where), 1.0, 4.0, 1e-6)
        (result,) = inverse_roots([request], method=method)
        assert result.failed == [False] * 3
        roots[str(where)] = result.roots.cpu()
    gap = torch.linalg.matrix_norm(roots[str(device)] - roots["cpu"])
    assert float((gap / torch.linalg.matrix_norm(roots["cpu"])).max()) <= 1e-12
    flags = torch.backends.cuda.matmul
    before = flags.fp32_precision
    single, plain = [], []
    try:
        for setting in ("ieee", "tf32"):
            flags.fp32_precision = setting
            request = RootRequest(factors.float().to(device), 1.0, 4.0, 1e-6)
            (result,) = inverse_roots([request], method=NewtonRoots())
            assert result.failed == [False] * 3 and flags.fp32_precision == setting
            single.append(result.roots.cpu())
            operand = factors.float().to(device)
            plain.append(torch.bmm(operand, operand).cpu())
    finally:
        flags.fp32_precision = before
    if device.type == "cuda":
        assert not torch.equal(plain[0], plain[1]), "TF32 changed nothing: no check"
    assert torch.equal(single[0], single[1])
    error = torch.linalg.matrix_norm(single[0].double() - roots["cpu"])
    kappa = float(torch.linalg.cond(factors).max())
    allowed = 4 * 2.0**-24 * kappa * 64**0.5
    assert float((error / torch.linalg.matrix_norm(roots["cpu"])).max()) <= allowed


def test_host_syncs_of_a_newton_root_step_do_not_grow_with_same_shape_blocks(
        device: torch.device) -> None:
    """With NewtonRoots a root step synchronises once per convergence check (for all
    blocks at once) and once for the status: 4 blocks as often as 16 (the same gradient
    in every block, so the same iterations)."""
    if device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs CUDA")
    from mpi4py import MPI

    from kfac_hpc.shampoo import NewtonRoots

    grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    counts = []
    for n in (4, 16):
        params = [nn.Parameter(torch.zeros(8, 8, device=device)) for _ in range(n)]
        opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF, name="self"),
                                 lr=0.01, epsilon=1e-3, max_preconditioner_dim=8,
                                 precondition_frequency=1, root_method=NewtonRoots())
        per_step = []
        for _ in range(2):
            for p in params:
                p.grad = grad.clone()
            per_step.append(_syncs(opt.step))
        counts.append(per_step)
    assert counts[0] == counts[1], counts
    assert min(counts[0]) >= 2, counts


def test_subspace_roots_on_the_device_equal_the_cpu_and_read_the_host_once(
        device: torch.device) -> None:
    """SubspaceRoots refreshing float64 bases of factors that moved since them: the
    device's roots equal the CPU's to 1e-10 relative, 1e-12 absolute for the entries near
    0 (cuSOLVER's and LAPACK's QR may differ in the columns' signs, which a root does not
    see; the rest is summation order: 5e-11 relative at worst over 16 orders on the CPU),
    and the refresh reads the host once (its marks), whatever the
    number of blocks, with no solver call."""
    from kfac_hpc.shampoo import SubspaceRoots
    from kfac_hpc.shampoo.roots import RootRequest, inverse_roots

    old = torch.stack([_gram(64, 256, s) for s in range(3)])
    new = old + 0.05 * torch.stack([_gram(64, 256, s + 10) for s in range(3)])
    bases = torch.linalg.eigh(old).eigenvectors
    method = SubspaceRoots(tolerance=1.0)
    roots = {}
    for where in ("cpu", device):
        request = RootRequest(new.to(where), 1.0, 4.0, 1e-6, bases=bases.to(where))
        (result,) = inverse_roots([request], method=method)
        assert result.failed == [False] * 3
        roots[str(where)] = result.roots.cpu()
    torch.testing.assert_close(roots[str(device)], roots["cpu"], rtol=1e-10, atol=1e-12)
    if device.type != "cuda":
        return
    counts = []
    for n in (3, 12):
        request = RootRequest(new.repeat(n // 3, 1, 1).to(device), 1.0, 4.0, 1e-6,
                              bases=bases.repeat(n // 3, 1, 1).to(device))
        counts.append(_syncs(lambda r=request: inverse_roots([r], method=method)))
    assert counts == [1, 1], counts


def test_index_tensors_reach_the_device_without_a_sync(device: torch.device) -> None:
    """The row indices of the root paths (matrices that converged, drifted or failed)
    are copied from pinned memory, queued: no host synchronisation each (a pageable
    ``torch.tensor(rows, device=cuda)`` waits for its copy)."""
    from kfac_hpc.shampoo.newton import device_index

    index = device_index([0, 2, 5], device)
    assert index.device == device and index.tolist() == [0, 2, 5]
    if device.type != "cuda":
        return
    assert _syncs(lambda: device_index([1, 3], device)) == 0
    assert _syncs(lambda: torch.tensor([1, 3], dtype=torch.int64, device=device)) >= 1, \
        "CUDA's sync debug mode did not see a pageable copy: the check proves nothing"



def test_split_gram_products_on_the_device_equal_the_cpu(device: torch.device) -> None:
    """Blocks whose last mode has 9 rows and 65,536 columns: on CUDA that factor is summed
    over chunks of columns (``kronecker.splits_gram``), the other four with one product
    each; every factor equals the CPU's one product, in float64, to summation order."""
    from kfac_hpc.shampoo import kronecker

    g = torch.Generator().manual_seed(8)
    shape = (16, 16, 16, 16, 9)
    x = torch.randn(2, *shape, generator=g, dtype=torch.float64)
    start = [torch.randn(2, d, d, generator=g, dtype=torch.float64) for d in shape]
    on_cpu = [f.clone() for f in start]
    kronecker.accumulate_factors(on_cpu, x, 0.9)
    on_device = [f.to(device) for f in start]
    assert kronecker.splits_gram(kronecker.mode_matrices(x.to(device), 4)) \
        == (device.type == "cuda")
    kronecker.accumulate_factors(on_device, x.to(device), 0.9)
    for got, want in zip(on_device, on_cpu):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


def test_tf32_products_on_the_device_stay_within_tf32_rounding(device, monkeypatch):
    """``stats_precision``/``precondition_precision="tf32"`` on the device: the factors of
    the first step (the same weights and gradient as a full-precision run) within TF32's
    rounding of the full ones (operands within 2⁻¹⁰ each, kernels may truncate; the
    diagonal's sums of squares dominate the norm), a finite step, and on CUDA the
    products inside cuBLAS's TF32 mode (elsewhere rounded operands instead)."""
    from mpi4py import MPI

    from kfac_hpc.shampoo import DistributedShampoo, kronecker

    entered: list[int] = []
    tf32 = kronecker.tf32_products

    def counted():  # type: ignore[no-untyped-def]
        entered.append(1)
        return tf32()

    monkeypatch.setattr(kronecker, "tf32_products", counted)

    def first_step(precision: str) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Tanh(), nn.Flatten(),
                              nn.Linear(16 * 36, 10)).to(device)
        opt = DistributedShampoo(model.named_parameters(), lr=0.01, epsilon=1e-8,
                                 comm=Communicator(MPI.COMM_SELF),
                                 stats_precision=precision, precondition_precision=precision)
        g = torch.Generator().manual_seed(3)
        model(torch.randn(8, 3, 8, 8, generator=g).to(device)).square().mean().backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return opt.state_dict()["state"]

    full = first_step("full")
    assert entered == []
    tf32_state = first_step("tf32")
    assert (len(entered) > 0) == (device.type == "cuda")
    checked = 0
    for param, blocks in full.items():
        for index, state in blocks.items():
            for name, want in state.items():
                if name.startswith("factor_"):
                    got = tf32_state[param][index][name]
                    err = ((got - want).norm() / want.norm()).item()
                    assert err <= 8 * 2.0**-11, f"{param}[{index}] {name}: {err}"
                    checked += 1
    assert checked >= 4
