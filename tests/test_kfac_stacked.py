"""K-FAC's layers of one gradient shape preconditioned as stacks, forced on the CPU.

On CUDA the layers a rank preconditions that share their gradient layout and hold full
eigendecompositions are preconditioned together (``kfac_hpc.kfac.stacked``): four
batched GEMMs, one division, one float64 KL inner product per stack, one multi-tensor
``.grad`` write. Here that choice is forced on the CPU (fixture ``stacked_path``) and
checked against the per-layer path:

* the same training in float64 for every strategy at 1, 2 and 4 ranks, with and
  without KL clipping, with bias and bias-free layers, Linear and Conv2d in one stack,
  and a layer that has no gradient every other step; the same preconditioned gradients
  in each operand precision; equal up to the batched GEMMs' summation order (a batched
  GEMM is not bitwise one GEMM per matrix: MKL blocks them differently);
* checkpoint resume stays bitwise (the stacks are derived state, rebuilt after a load);
* the operators of a precondition-only step follow the distinct layer shapes, not the
  layers (ResNet-50 and ResNet-101 at an eighth of the widths: the same count).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import test_kfac_faults
import torch
from mpi4py import MPI
from op_count import OpCounter
from shared_cases import case_ids, fraction_for, kfac_cases
from stale_steps import resnet_eighth, stale_step_ops
from torch import Tensor, nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import stacked
from kfac_hpc.kfac.decomposer import StackedEigenSolve
from kfac_hpc.kfac.layers import Conv2dCurvature, EmbeddingCurvature, LinearCurvature
from kfac_hpc.kfac.linalg import precondition_eigen
from kfac_hpc.kfac.stacked import stack_grads, stack_groups, write_grads

CASES = kfac_cases(input_shape=(4, 2, 5, 5))


@pytest.fixture
def stacked_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU layers are preconditioned as stacks while the test runs."""
    monkeypatch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"}))
    yield


class Repeats(nn.Module):
    """Convolutions and Linear layers of repeated shapes, float64.

    Stacks: ``c1, c2, side`` (3x3 convolutions with bias and a Linear layer of the same
    ``(g, a)`` and blocks), ``c3, c4`` (no bias), ``f1, f2, f3`` (Linear with bias;
    ``f3`` runs only on every other forward: no gradient on the others); ``c0``,
    ``f0``, ``out`` alone.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c0 = nn.Conv2d(2, 4, 3, padding=1)
        self.c1 = nn.Conv2d(4, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.c4 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.side = nn.Linear(36, 4)
        self.f0 = nn.Linear(100, 6)
        self.f1, self.f2, self.f3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        self.forwards = 0
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for conv in (self.c0, self.c1, self.c2, self.c3, self.c4):
            h = torch.tanh(conv(h))
        side = self.side(h[:, :, :3, :3].flatten(1))
        h = torch.tanh(self.f2(torch.tanh(self.f1(torch.tanh(self.f0(h.flatten(1)))))))
        if self.forwards % 2 == 0:
            h = torch.tanh(self.f3(h))
        self.forwards += 1
        return self.out(h) + side[:, :3]


GROUPS = [("c1", "c2", "side"), ("c3", "c4"), ("f1", "f2", "f3")]


def batches(n: int, dtype: torch.dtype = torch.float64) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 2, 5, 5, generator=g, dtype=dtype),
             torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def train(monkeypatch: pytest.MonkeyPatch, comm: Communicator, strategy: str,
          options: dict[str, Any], *, stack: bool, steps: int = 5) -> list[Tensor]:
    """``steps`` of K-FAC on SGD (inverse updates every 2), the parameters after them;
    ``stack``: with the stacked path forced (and checked to have run on some rank)."""
    with monkeypatch.context() as patch:
        if stack:
            patch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"}))
        strategy, fraction = fraction_for(strategy, comm.size)
        model = Repeats()
        pre = KFACPreconditioner(model, comm=comm, strategy=strategy,
                                 grad_worker_fraction=fraction, damping=0.1,
                                 inv_update_steps=2, inv_dtype=torch.float64, lr=0.01,
                                 **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        stacks_built = 0
        for step, (x, y) in enumerate(batches(steps)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            pre.step()
            assert (model.f3.weight.grad is None) == (step % 2 == 1), "f3 written unused"
            stacks_built += len(pre.decomps._stacks)
            opt.step()
        if stack and options.get("compute_method", "eigen") == "eigen":
            assert comm.any(stacks_built > 0), "the stacked path never ran"
        pre.close()
    return [p.detach().clone() for p in model.parameters()]


def assert_same_training(monkeypatch: pytest.MonkeyPatch, comm: Communicator, strategy: str,
                         options: dict[str, Any]) -> None:
    """float64: the stacked and per-layer runs agree to 1e-10 of each parameter's size
    (the batched GEMMs' summation order; measured differences about 1e-16)."""
    per_layer = train(monkeypatch, comm, strategy, options, stack=False)
    stacks = train(monkeypatch, comm, strategy, options, stack=True)
    names = [n for n, _ in Repeats().named_parameters()]
    for name, p, q in zip(names, stacks, per_layer):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


def test_stack_groups_follow_the_gradient_layout(stacked_path: None) -> None:
    pre = KFACPreconditioner(Repeats(), comm=Communicator(MPI.COMM_SELF))
    assert pre.stack_groups == GROUPS
    pre.close()


def test_the_cpu_keeps_the_per_layer_path() -> None:
    pre = KFACPreconditioner(Repeats(), comm=Communicator(MPI.COMM_SELF))
    assert pre.stack_groups == []
    assert "cpu" not in stacked.STACKED_DEVICES
    pre.close()


OPTIONS = [{"kl_clip": None}, {"kl_clip": 1e-4},
           {"eigen_refresh": "subspace", "decomposition_lag": 1}]


@pytest.mark.parametrize("options", OPTIONS, ids=["no-kl-clip", "kl-clip", "subspace-lag"])
def test_training_equals_the_per_layer_path(monkeypatch: pytest.MonkeyPatch,
                                            options: dict[str, Any]) -> None:
    """The subspace refresh starts from the held eigenbases: views of the stacks."""
    assert_same_training(monkeypatch, Communicator(MPI.COMM_SELF), "comm-opt", options)


def test_the_kl_clip_is_active_in_the_comparison(stacked_path: None) -> None:
    """With ``kl_clip=1e-4`` every layer's update is scaled by one ν < 1 here, from one
    float64 inner product per stack (and per lone layer), so the comparison above
    checks the stacked inner products."""
    def one_step(kl_clip: float | None) -> tuple[dict[str, Tensor], int]:
        model = Repeats()
        pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                                 kl_clip=kl_clip, lr=0.1, inv_dtype=torch.float64)
        x, y = batches(1)[0]
        nn.functional.cross_entropy(model(x), y).backward()
        inner = stacked.Stack.inner64
        sums: list[Tensor] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stacked.Stack, "inner64",
                          lambda stack: sums.append(inner(stack)) or sums[-1])
            pre.step()
        out = {n: c.grad_matrix() for n, c in pre.layers.items()}
        pre.close()
        return out, len(sums)

    (clipped, n_sums), (free, no_sums) = one_step(1e-4), one_step(None)
    assert (n_sums, no_sums) == (len(GROUPS), 0)
    nu = float(clipped["c0"].norm() / free["c0"].norm())
    assert nu < 0.9
    for name in free:
        torch.testing.assert_close(clipped[name], nu * free[name], rtol=1e-12, atol=0)


@pytest.mark.parametrize("strategy, options", CASES, ids=case_ids(CASES))
def test_every_strategy_equals_the_per_layer_path(monkeypatch: pytest.MonkeyPatch,
                                                  strategy: str,
                                                  options: dict[str, Any]) -> None:
    assert_same_training(monkeypatch, Communicator(MPI.COMM_SELF), strategy, options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=case_ids(CASES))
def test_every_strategy_equals_the_per_layer_path_ranks(monkeypatch: pytest.MonkeyPatch,
                                                        comm: Communicator, strategy: str,
                                                        options: dict[str, Any]) -> None:
    """Each rank stacks the layers it preconditions (mem-opt, hybrid-opt: a subset)."""
    assert_same_training(monkeypatch, comm, strategy, options)


@pytest.mark.parametrize("precision", ["full", "tf32", "bf16"])
def test_each_precision_is_as_accurate_as_the_per_layer_path(
        monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """float32, one step: against the float64 solve with the same decompositions, each
    layer's stacked result is within twice the per-layer path's error, and the two
    differ by at most that. Both round the same operands alike (tf32, bf16); they
    differ in the GEMMs' summation order, which the division by ``λ_G λ_A + γ`` can
    amplify, and where it moves an intermediate product across a rounding boundary of
    the operand format (tf32, bf16: the second GEMM's operand), by one unit there."""
    def one_step(stack: bool) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        with monkeypatch.context() as patch:
            if stack:
                patch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"}))
            model = Repeats().float()
            pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                                     kl_clip=None, precondition_precision=precision)
            x, y = batches(1, torch.float32)[0]
            nn.functional.cross_entropy(model(x), y).backward()
            grads = {n: c.grad_matrix(torch.float64) for n, c in pre.layers.items()}
            pre.step()
            assert bool(pre.decomps._stacks) == stack
            dec = {k: {part: t.double() for part, t in parts.items()}
                   for k, parts in pre.decompositions.items()}
            exact = {n: precondition_eigen(grads[n], dec[f"{n}/A"]["Q"], dec[f"{n}/A"]["lambda"],
                                           dec[f"{n}/G"]["Q"], dec[f"{n}/G"]["lambda"], 0.01)
                     for n in pre.layers}
            out = {n: c.grad_matrix(torch.float64) for n, c in pre.layers.items()}
            pre.close()
            return out, exact

    (per_layer, exact), (stacks, exact_too) = one_step(False), one_step(True)
    for name, want in exact.items():
        assert torch.equal(exact_too[name], want)  # the same decompositions

        def err(got: Tensor) -> float:
            return float((got - want).norm() / want.norm())  # noqa: B023

        bound = 2 * err(per_layer[name]) + 2.0**-24
        assert err(stacks[name]) <= bound, (name, err(stacks[name]), err(per_layer[name]))
        assert float((stacks[name] - per_layer[name]).norm() / want.norm()) <= bound, name


def test_stacked_solve_is_kept_and_redamped(stacked_path: None) -> None:
    """One stacked solve per group serves the steps between inverse updates; a new
    damping rebuilds its denominators on the same stacked bases; an inverse update
    builds new ones. The held eigenbases are views of the stacks; the solves hold only
    the denominators beyond them."""
    damping = {0: 0.01, 1: 0.01, 2: 0.02, 3: 0.02}
    model = Repeats()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF),
                             damping=lambda k: damping[k], inv_update_steps=3,
                             inv_dtype=torch.float64)
    seen: list[StackedEigenSolve] = []
    for step, (x, y) in enumerate(batches(4)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        solve = pre.decomps.stacked_solve(GROUPS[1], damping[step])
        assert isinstance(solve, StackedEigenSolve)
        seen.append(solve)
    held = pre.decompositions
    for i, name in enumerate(GROUPS[1]):  # one copy of the bases: the held ones are views
        for side, q in (("A", seen[3].qa), ("G", seen[3].qg)):
            assert held[f"{name}/{side}"]["Q"].data_ptr() == q[i].data_ptr()
    assert seen[1] is seen[0]
    assert seen[2] is not seen[1] and seen[2].qa is seen[1].qa  # redamped, same bases
    assert seen[3].qa is not seen[2].qa  # step 3: an inverse update
    assert pre.memory_bytes()["solves"] == sum(
        s.nbytes for s in pre.decomps._stacks.values() if s is not None)
    pre.close()


def test_low_rank_and_inverse_groups_keep_the_per_layer_path(stacked_path: None) -> None:
    """No stacked solve where a member is low rank or the method is ``inverse``."""
    for options in ({"low_rank": 2, "low_rank_min_dim": 37}, {"compute_method": "inverse"}):
        model = Repeats()
        pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), **options)
        x, y = batches(1)[0]
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        solves = {group: pre.decomps._stacks.get(group, "absent") for group in GROUPS}
        if "low_rank" in options:  # c1, c2, side: A of 37 is low rank; the others stack
            assert solves[GROUPS[0]] is None
            assert all(isinstance(solves[g], StackedEigenSolve) for g in GROUPS[1:])
        else:
            assert all(s is None for s in solves.values())
        pre.close()


def test_stacked_gradients_and_writes_are_the_layers() -> None:
    """Gathering (missing ``.grad`` as zeros) and writing back equal ``grad_matrix``
    and ``set_grad`` for Linear (bias), Embedding (transposed) layers."""
    torch.manual_seed(3)
    linears = [nn.Linear(5, 4) for _ in range(3)]
    embeddings = [nn.Embedding(5, 4) for _ in range(2)]
    for m in (*linears, *embeddings):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
    linears[1].bias.grad = None
    curvs = [LinearCurvature(m) for m in linears]
    embs = [EmbeddingCurvature(m) for m in embeddings]
    assert stack_groups({"l0": curvs[0], "e0": embs[0], "l1": curvs[1], "e1": embs[1]}) \
        == [("l0", "l1"), ("e0", "e1")]
    for group in (curvs, embs):
        got = stack_grads(group, torch.float64)
        assert got.dtype == torch.float64
        for i, curv in enumerate(group):
            assert torch.equal(got[i], curv.grad_matrix(torch.float64))
        values = torch.randn_like(got)
        write_grads(pair for i, c in enumerate(group) for pair in c.grad_targets(values[i]))
        for i, curv in enumerate(group):
            assert torch.equal(curv.grad_matrix(torch.float64), values[i].float().double())
    assert linears[1].bias.grad is not None  # a missing .grad is created
    linears[2].weight.grad = None  # not preconditioned: zeros entirely
    assert not stack_grads(curvs, torch.float32)[2].any()


def test_gradient_writes_keep_contiguous_pairs_in_one_multi_tensor_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights (contiguous rows of a stack) are one multi-tensor copy; biases (a strided
    column of the stack) and channels-last gradients a second one: on CUDA one strided
    pair in the list would make the whole copy go pair by pair. The values are written
    exactly either way."""
    torch.manual_seed(4)
    linear = nn.Linear(5, 4)
    convs = [nn.Conv2d(3, 2, 3, bias=False) for _ in range(3)]
    for m in (linear, *convs):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
    convs[2].weight.grad = convs[2].weight.grad.to(memory_format=torch.channels_last)
    values = torch.randn(3, 2, 27)
    matrix = torch.randn(4, 6)
    pairs = [pair for i, m in enumerate(convs)
             for pair in Conv2dCurvature(m).grad_targets(values[i])]
    pairs += LinearCurvature(linear).grad_targets(matrix)
    seen: list[int] = []
    real = torch._foreach_copy_

    def spy(into: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        seen.append(len(into))
        real(into, src)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    write_grads(pairs)
    assert seen == [2, 3]  # two contiguous conv weights; the channels-last one, fc's two
    for i, m in enumerate(convs):
        assert torch.equal(m.weight.grad, values[i].view(2, 3, 3, 3))
    assert torch.equal(linear.weight.grad, matrix[:, :5])
    assert torch.equal(linear.bias.grad, matrix[:, 5])


# ------------------------------------------------------------------- checkpoint resume
def repeated_mlp(seed: int = 0) -> nn.Module:
    """``test_kfac_faults.mlp``'s input and output with two stacked layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(),
                         nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 3)).double()


RESUME_CASES = [("comm-opt", {}), ("mem-opt", {}), ("comm-opt", {"decomposition_lag": 1})]


def assert_resume_is_bitwise(monkeypatch: pytest.MonkeyPatch, comm: Communicator,
                             strategy: str, options: dict[str, Any], root: Any) -> None:
    monkeypatch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(test_kfac_faults, "mlp", repeated_mlp)
    saving = test_kfac_faults.train_with_checkpoint(comm, strategy, options, root / "a",
                                                    resume=False)
    resumed = test_kfac_faults.train_with_checkpoint(comm, strategy, options, root / "b",
                                                     resume=True)
    for (name, p), q in zip(saving.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), f"{name}: resumed run differs from the run that saved"


@pytest.mark.parametrize("strategy, options", RESUME_CASES, ids=case_ids(RESUME_CASES))
def test_checkpoint_resume_is_bitwise(monkeypatch: pytest.MonkeyPatch, strategy: str,
                                      options: dict[str, Any], tmp_path: Any) -> None:
    assert_resume_is_bitwise(monkeypatch, Communicator(MPI.COMM_SELF), strategy, options,
                             tmp_path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", RESUME_CASES, ids=case_ids(RESUME_CASES))
def test_checkpoint_resume_is_bitwise_ranks(monkeypatch: pytest.MonkeyPatch,
                                            comm: Communicator, strategy: str,
                                            options: dict[str, Any],
                                            tmp_path_factory: Any) -> None:
    root = tmp_path_factory.mktemp("resume") if comm.rank == 0 else None
    assert_resume_is_bitwise(monkeypatch, comm, strategy, options,
                             comm.broadcast_object(root))


# ---------------------------------------------------------------------- operator count
def stale_step(model: nn.Module, stack: bool) -> tuple[OpCounter, KFACPreconditioner]:
    """Operators of a precondition-only step (KL clip on), stacked or per layer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"} if stack else {"cuda"}))
        return stale_step_ops(model)


def test_stale_step_kernels_follow_the_distinct_shapes() -> None:
    """ResNet-50 at an eighth of the widths, precondition-only step: 12 stacks (45
    layers) and 9 layers alone; stacked at most 10 operators per stack, 13 per lone
    layer and 8 in all besides (measured 237, per-layer path 657; 710 before the
    ``.grad`` writes were multi-tensor copies); 4 batched GEMMs per stack, 4 GEMMs per
    lone layer. ResNet-101's 105 layers (the same shapes) dispatch the same number."""
    per_layer, pre = stale_step(resnet_eighth(), stack=False)
    pre.close()
    ops, pre = stale_step(resnet_eighth(), stack=True)
    groups = len(pre.stack_groups)
    alone = len(pre.layers) - sum(map(len, pre.stack_groups))
    assert (len(pre.layers), groups, alone) == (54, 12, 9)
    bound = 10 * groups + 13 * alone + 8
    assert ops.kernels <= bound, (ops.kernels, bound)
    assert per_layer.kernels > bound, (per_layer.kernels, bound)  # the bound can fail
    assert ops.calls("aten.bmm.") == 4 * groups
    assert ops.calls("aten.mm.") == 4 * alone
    # the bias-free convolutions in one multi-tensor copy, fc's weight and bias (strided
    # columns of its matrix) in another
    assert ops.calls("aten._foreach_copy_") == 2
    pre.close()
    deeper, pre = stale_step(resnet_eighth((3, 4, 23, 3)), stack=True)
    assert (len(pre.layers), len(pre.stack_groups)) == (105, 12)
    assert deeper.kernels == ops.kernels
    pre.close()


def test_a_saved_state_holds_its_own_bytes(stacked_path: None) -> None:
    """The held eigenbases of stacked layers are views of their stacks; ``state_dict()``
    copies them out (the same values), so a saved factor does not carry its stack."""
    model = Repeats()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF))
    for x, y in batches(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
    stored = pre.state_dict()["eigenbases"]
    for name, parts in pre.decompositions.items():
        for part, held in parts.items():
            saved = stored[name][part]
            assert torch.equal(saved, held)
            assert saved.untyped_storage().nbytes() == saved.numel() * saved.element_size()
    assert pre.decompositions["c3/A"]["Q"].untyped_storage().nbytes() \
        == 2 * stored["c3/A"]["Q"].untyped_storage().nbytes()  # c3, c4: one stack
    pre.close()
