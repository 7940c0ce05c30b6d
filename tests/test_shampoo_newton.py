"""Shampoo's inverse roots by the coupled Newton iteration (``NewtonRoots``).

Accuracy bound. When the iteration stops, ``‖M − I‖_F <= τ`` (``τ`` the tolerance), so
in exact arithmetic every eigenvalue of ``X^p·A`` (``A = F + εI``) lies in
``[1 − τ, 1 + τ]`` and ``X`` is within a relative ``τ / (p·(1 − τ))`` of ``A^(-1/p)``
in every eigendirection, hence in the Frobenius norm. Rounding adds what the problem
itself allows: an eigenvalue of ``A`` is known to about ``n·u·‖A‖₂`` (``u = 2⁻⁵³``,
float64, the dtype of these tests), which moves ``(λ + ε)^(-1/p)`` by a relative
``n·u·κ / p`` with ``κ = ‖A‖₂ / (λ_min + ε)``; the float64 ``eigh`` reference carries
the same. So ``bound = τ / (p(1 − τ)) + 2·n·u·κ / p`` (both methods' rounding); a wrong
exponent, scaling or iteration gives O(1) errors.

Fallback: a matrix Newton gives up on (not converged in ``max_iterations``, diverged,
non-finite) takes the eigen path, whose roots are then those of ``inverse_roots`` with
the default method, bit for bit.

Run: ``pytest tests/test_shampoo_newton.py``; the 2-rank test with
``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_shampoo_newton.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import count_host_reads, count_ops
from shampoo_ranks import distributed_vs_single
from shared_cases import SHAMPOO_KWARGS, ShampooNet, cuda_fp32_settings_seen
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import (
    DistributedShampoo,
    EigenRoots,
    NewtonRoots,
    ShampooNumericalError,
    root_method_from,
)
from kfac_hpc.shampoo.newton import NewtonBatch, newton_roots
from kfac_hpc.shampoo.roots import RootRequest, inverse_roots, newton_inverse_roots

U64 = 2.0**-53
TAU = 1e-10
EXACT = NewtonRoots(tolerance=TAU)


def psd(n: int, spectrum: Tensor, seed: int = 0) -> Tensor:
    """``Q diag(spectrum) Qᵀ`` with a random orthogonal ``Q`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * spectrum) @ q.T


def gram(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """``G·Gᵀ / k`` of a Gaussian ``n x k`` block (rank ``min(n, k)``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    return (x @ x.T / k).to(dtype)


def reference(a: Tensor, p: int, eps: float) -> Tensor:
    values, vectors = torch.linalg.eigh(a.double())
    return (vectors * (values.clamp(min=0) + eps).pow(-1.0 / p)) @ vectors.T


def bound(a: Tensor, p: int, eps: float, tau: float = TAU) -> float:
    values = torch.linalg.eigvalsh(a.double()).clamp(min=0)
    kappa = float((values[-1] + eps) / (values[0] + eps))
    return tau / (p * (1 - tau)) + 2 * a.shape[0] * U64 * kappa / p


def relative(x: Tensor, ref: Tensor) -> float:
    return float(torch.linalg.matrix_norm(x.double() - ref) / torch.linalg.matrix_norm(ref))


def newton(matrices: Tensor, p: int, eps: float, method: NewtonRoots = EXACT
           ) -> tuple[Tensor, list[bool], list[int]]:
    run = newton_roots([NewtonBatch(matrices, p, ((slice(0, matrices.shape[0]), eps),))],
                       method)
    (out,) = run.outcomes
    return out.roots, out.converged, out.iterations


CASES = {
    "well-conditioned": (gram(24, 96), 1e-12),
    "ill-conditioned": (psd(24, torch.logspace(0, -8, 24, dtype=torch.float64)), 1e-12),
    "rank-deficient": (gram(24, 6), 1e-7),
}


# ------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_newton_equals_float64_eigh_within_the_derived_bound(case: str, p: int) -> None:
    a, eps = CASES[case]
    (x,), (ok,), _ = newton(a[None], p, eps)
    assert ok
    error, allowed = relative(x, reference(a, p, eps)), bound(a, p, eps)
    assert error <= allowed, (error, allowed)
    assert torch.equal(x, x.mT)  # symmetrised


@pytest.mark.parametrize("p", [2, 4])
def test_default_epsilon_converges_in_the_predicted_iterations(p: int) -> None:
    """Rank-deficient with ε = 1e-12: the smallest scaled eigenvalue ``z·ε`` grows by
    ``((p+1)/p)^p`` per iteration until near 1, then about 5 quadratic iterations."""
    a, eps = gram(32, 8), 1e-12
    (x,), (ok,), (iterations,) = newton(a[None], p, eps)
    shifted = a + eps * torch.eye(32, dtype=torch.float64)
    b = min(float(torch.linalg.matrix_norm(shifted)), float(shifted.abs().sum(1).max()))
    growth = math.log(b / ((p + 1) / 2 * eps)) / math.log(((p + 1) / p) ** p)
    assert ok and growth <= iterations <= growth + 10 + EXACT.check_every, (iterations, growth)
    assert relative(x, reference(a, p, eps)) <= bound(a, p, eps)


def test_float32_well_conditioned() -> None:
    """float32: the floor of ‖M − I‖_F is ~1e-7·√n; the roots agree with float64 eigh to
    the float32 analogue of the bound (u = 2⁻²⁴)."""
    a = gram(64, 256, dtype=torch.float32)
    (x,), (ok,), _ = newton(a[None], 4, 1e-12, NewtonRoots())
    assert ok and x.dtype == torch.float32
    kappa = float(torch.linalg.cond(a.double()))
    allowed = 1e-4 / (4 * (1 - 1e-4)) + 2 * 64 * 2.0**-24 * kappa / 4
    assert relative(x, reference(a.double(), 4, 1e-12)) <= allowed


def test_batched_equals_one_by_one() -> None:
    """Each matrix leaves the stack at its own check, so its iterations and its root do
    not depend on its neighbours (to the last bits of the batched products)."""
    stack = torch.stack([gram(16, 64, seed=1), gram(16, 4, seed=2),
                         psd(16, torch.logspace(0, -6, 16, dtype=torch.float64), seed=3)])
    roots, ok, iterations = newton(stack, 2, 1e-9)
    assert all(ok) and len(set(iterations)) > 1  # they left at different checks
    for j in range(3):
        (alone,), _, (its,) = newton(stack[j:j + 1], 2, 1e-9)
        assert its == iterations[j]
        torch.testing.assert_close(roots[j], alone, rtol=1e-13, atol=0)


def test_requests_group_by_size_dtype_and_order() -> None:
    """Sizes, dtypes, orders, corrections and ε mixed: each root as computed alone."""
    requests = [RootRequest(torch.stack([gram(8, 32, 1), gram(8, 32, 2)]), 0.5, 2.0, 1e-9),
                RootRequest(gram(12, 48, 3)[None], 1.0, 4.0, 1e-6),
                RootRequest(gram(8, 32, 4)[None], 1.0, 2.0, 1e-3),
                RootRequest(gram(8, 32, 5, torch.float32)[None], 1.0, 2.0, 1e-3)]
    method = NewtonRoots()  # float32 stops at its rounding floor (~1e-7·√n) too
    results = inverse_roots(requests, method=method)
    for request, result in zip(requests, results):
        assert result.failed == [False] * request.factors.shape[0]
        for f, root in zip(request.factors, result.roots):
            (alone,), (ok,), _ = newton((f / request.correction)[None], int(request.p),
                                        request.epsilon, method)
            assert ok
            torch.testing.assert_close(root, alone, rtol=1e-13 if f.dtype == torch.float64
                                       else 1e-5, atol=0)


# ------------------------------------------------------------------ fallback
def test_matrices_not_converged_take_the_eigen_path_alone() -> None:
    """Three iterations: the well-conditioned factor converges, the rank-deficient one
    (ε = 1e-12: ~40 iterations) goes to eigh, and its root is the eigen path's, bit for
    bit; the other stays Newton's."""
    easy, hard = torch.eye(8, dtype=torch.float64) * 2.0, gram(8, 2)
    request = RootRequest(torch.stack([easy, hard]), 1.0, 2.0, 1e-12)
    (eigen,) = inverse_roots([request])
    (mixed,), run = newton_inverse_roots([request], NewtonRoots(max_iterations=5,
                                                                tolerance=TAU))
    assert run.outcomes[0].converged == [True, False] and mixed.failed == [False, False]
    assert torch.equal(mixed.roots[1], eigen.roots[1])
    assert not torch.equal(mixed.roots[0], eigen.roots[0])
    torch.testing.assert_close(mixed.roots[0], eigen.roots[0], rtol=1e-12, atol=0)


def test_non_finite_iteration_gives_up_at_the_first_check() -> None:
    """float32 entries of 3e38: ‖A‖_F and ‖A‖_∞ overflow, the matrix is given up at once
    and decomposed by the eigen path."""
    huge = torch.full((4, 4), 3e38)
    request = RootRequest(torch.stack([huge, torch.eye(4)]), 1.0, 2.0, 1e-12)
    (result,), run = newton_inverse_roots([request], NewtonRoots())
    assert run.outcomes[0].converged == [False, True]
    assert run.outcomes[0].iterations[0] == NewtonRoots().check_every
    (eigen,) = inverse_roots([request])
    assert torch.equal(result.roots[0], eigen.roots[0]) and result.failed == [False, False]


def test_indefinite_factor_diverges_and_is_given_up_early() -> None:
    """A float32 factor indefinite as stored (a negative eigenvalue −1e-4): its error
    grows between checks, so it leaves the iteration long before max_iterations."""
    a = psd(8, torch.tensor([1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01, -1e-4], dtype=torch.float64))
    request = RootRequest(a.float()[None], 1.0, 2.0, 1e-12)
    (result,), run = newton_inverse_roots([request], NewtonRoots())
    assert run.outcomes[0].converged == [False]
    assert run.iterations < NewtonRoots().max_iterations / 2
    (eigen,) = inverse_roots([request])
    assert torch.equal(result.roots, eigen.roots)


def test_float32_factors_rank_deficient_by_shape_skip_the_iteration() -> None:
    """A float32 factor whose rank bound is below its size goes to eigh without an
    iteration (no host read of Newton's); in float64, or without a bound, it iterates."""
    f = torch.stack([gram(16, 4, seed=s) for s in range(2)])
    eigen = inverse_roots([RootRequest(f.float(), 1.0, 2.0, 1e-12)])
    (skipped,), run = newton_inverse_roots([RootRequest(f.float(), 1.0, 2.0, 1e-12, 4)],
                                           NewtonRoots())
    assert run.host_reads == 0 and run.outcomes == []
    assert torch.equal(skipped.roots, eigen[0].roots)
    for request in (RootRequest(f, 1.0, 2.0, 1e-12, 4),
                    RootRequest(f.float(), 1.0, 2.0, 1e-3, 16),
                    RootRequest(f.float(), 1.0, 2.0, 1e-3)):
        _, run = newton_inverse_roots([request], NewtonRoots())
        assert run.host_reads > 0 and len(run.outcomes) == 1


def test_shampoo_requests_carry_the_rank_bound_of_their_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A (3, 8) block at step t: its 3x3 factor sums t products of 8 columns, its 8x8 one
    t products of 3 columns; a (5,) block: t products of one column."""
    import kfac_hpc.shampoo.optimizer as optimizer

    seen: list[list[tuple[int, int | None]]] = []
    real = optimizer.root_requests

    def spy(st: Any, hp: Any, method: Any) -> list[RootRequest]:
        requests = real(st, hp, method)
        seen.append([(r.factors.shape[-1], r.rank_bound) for r in requests])
        return requests

    monkeypatch.setattr(optimizer, "root_requests", spy)
    w, b = nn.Parameter(torch.zeros(3, 8)), nn.Parameter(torch.zeros(5))
    opt = DistributedShampoo([w, b], precondition_frequency=2, max_preconditioner_dim=8,
                             root_method=NewtonRoots())
    for _ in range(3):  # roots at steps 1 and 3
        w.grad, b.grad = torch.randn(3, 8), torch.randn(5)
        opt.step()
    assert sorted(map(sorted, seen)) == [[(3, 8), (8, 3)], [(3, 24), (8, 9)], [(5, 1)],
                                         [(5, 3)]]


def _failing_eigh(a: Tensor, *args: object, **kwargs: object) -> Any:
    raise torch.linalg.LinAlgError("injected failure")


def test_failures_of_both_paths_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    request = RootRequest(torch.stack([torch.eye(4) * 3, gram(4, 1, dtype=torch.float32)]),
                          1.0, 2.0, 1e-12)
    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh)
    (result,) = inverse_roots([request], method=NewtonRoots(max_iterations=10))
    assert result.failed == [False, True]  # Newton's root stands, the other failed
    torch.testing.assert_close(result.roots[0], torch.eye(4) * 3 ** -0.5)


def test_nan_statistics_fail_as_with_eigen() -> None:
    errors = []
    for method in (EigenRoots(), NewtonRoots()):
        model = nn.Linear(4, 3)
        opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=4,
                                 root_method=method)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model.weight.grad[1, 2] = math.nan
        with pytest.raises(ShampooNumericalError) as info:
            opt.step()
        errors.append((info.value.blocks, info.value.status))
    assert errors[0] == errors[1] == ([("weight", 0)], 1)


# ------------------------------------------------------------------ optimizer
def _run(method: Any, steps: int = 6, **options: Any) -> list[Tensor]:
    model = ShampooNet().double()
    opt = DistributedShampoo(model.named_parameters(), **{
        **SHAMPOO_KWARGS, "factor_dtype": torch.float64, "communication_dtype": torch.float64,
        "epsilon": 1e-6, "root_method": method, **options})
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 2, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randn(8, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_shampoo_with_newton_roots_follows_the_eigen_run() -> None:
    """float64, blocks of side ≤ 4, ε = 1e-6 (κ ≲ 1e6 on these factors): each root is
    within the bound above (τ/p + 2·4·u·κ/p ≲ 2e-9) of the eigen root; a block's direction
    is a product of at most 3 roots (and rescaled by grafting), so directions differ by
    ≲ 1e-8 relative, parameters (lr 0.01, 6 steps) by far less: 1e-8 relative leaves
    room, a wrong root would move them by O(lr)."""
    eigen, newton_run = _run(EigenRoots()), _run(EXACT)
    for a, b in zip(eigen, newton_run):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10)
    assert any(not torch.equal(a, b) for a, b in zip(eigen, newton_run))  # Newton ran


def test_state_dict_does_not_carry_the_method_and_resumes_either_way() -> None:
    model = ShampooNet().double()
    opt = DistributedShampoo(model.named_parameters(), **SHAMPOO_KWARGS,
                             root_method=NewtonRoots(max_iterations=50))
    model(torch.randn(2, 2, 4, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert "root_method" not in repr(state["param_groups"])
    resumed = DistributedShampoo(ShampooNet().double().named_parameters(), **SHAMPOO_KWARGS)
    resumed.load_state_dict(state)
    assert resumed.root_method == EigenRoots()


# ------------------------------------------------------------------ host reads
def _root_step_costs(layers: int) -> tuple[int, int]:
    """Host reads and kernels of a root step of ``layers`` equal Linear layers (each 2x2
    blocks of 12x12 at max dim 12), all with the same gradient (the same factors, hence
    the same iterations per block)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(24, 24, bias=False) for _ in range(layers)])
    opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=12,
                             epsilon=1e-4, root_method=NewtonRoots(check_every=4))
    grad = torch.randn(24, 24, generator=torch.Generator().manual_seed(1))
    for p in model.parameters():
        p.grad = grad.clone()
    reads: list[int] = []
    ops = count_ops(lambda: reads.append(count_host_reads(opt.step).total))
    return reads[0], ops.kernels


def test_host_reads_and_kernels_of_a_root_step_do_not_grow_with_blocks() -> None:
    """4 blocks per layer, 3 or 12 layers: the same reads (the checks, one for all
    blocks, plus the step's status word) and the same kernels."""
    few, many = _root_step_costs(3), _root_step_costs(12)
    assert few == many, (few, many)
    reads, _ = few
    assert 2 <= reads <= math.ceil(NewtonRoots().max_iterations / 4) + 1


# ------------------------------------------------------------------ precision
def test_products_run_at_full_precision_whatever_the_user_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's TF32 setting is ignored inside the iteration and restored after it."""
    seen = cuda_fp32_settings_seen(
        monkeypatch, torch, "bmm", lambda: newton(torch.eye(3)[None] * 2, 2, 1e-6, NewtonRoots()))
    assert seen and set(seen) == {"ieee"}


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs,field", [
    (dict(max_iterations=0), "max_iterations"), (dict(max_iterations=2.5), "max_iterations"),
    (dict(check_every=True), "check_every"), (dict(tolerance=0.0), "tolerance"),
    (dict(tolerance=1.0), "tolerance"), (dict(tolerance=math.nan), "tolerance"),
    (dict(tolerance="small"), "tolerance"),
])
def test_invalid_newton_settings_are_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"NewtonRoots: invalid {field}="):
        NewtonRoots(**kwargs)


def test_root_method_from_names_calls_and_tables() -> None:
    assert root_method_from("eigen") == EigenRoots()
    assert root_method_from("newton") == NewtonRoots()
    assert root_method_from(" Newton ") == NewtonRoots()
    assert root_method_from("newton(max_iterations=60, tolerance=1e-5)") == NewtonRoots(
        max_iterations=60, tolerance=1e-5)
    assert root_method_from(repr(NewtonRoots(check_every=2))) == NewtonRoots(check_every=2)
    assert root_method_from({"name": "newton", "tolerance": 1e-6}) == NewtonRoots(tolerance=1e-6)
    assert root_method_from(EXACT) is EXACT


@pytest.mark.parametrize("value,match", [
    ("cholesky", "unknown method 'cholesky'"), ("newton(iters=3)", "has no iters"),
    ("newton(3)", "KEY=NUMBER"), ("newton(tolerance=tiny)", "KEY=NUMBER"),
    ("newton(tolerance=2)", "invalid tolerance=2"), ("eigen(tolerance=1)", "has no tolerance"),
    (3, "invalid root_method=3"), ({"tolerance": 1}, "needs a 'name'"),
])
def test_root_method_from_rejects_bad_values(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        root_method_from(value)


def test_optimizer_takes_objects_only() -> None:
    with pytest.raises(ValueError, match=r"invalid root_method='newton'.*root_method_from"):
        DistributedShampoo(nn.Linear(2, 2).named_parameters(),
                           root_method="newton")  # type: ignore[arg-type]


def test_train_config_maps_the_option() -> None:
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.optim import build_optimizer

    base = dict(optimizer="shampoo", preconditioner="none", model="mlp", dataset="synthetic")
    bad = TrainConfig(**base, shampoo_options={"root_method": "newtonian"})  # type: ignore[arg-type]
    assert any("unknown method 'newtonian'" in p for p in bad.problems())
    cfg = TrainConfig(**base, shampoo_options={  # type: ignore[arg-type]
        "root_method": "newton(max_iterations=40)"})
    assert not cfg.problems()
    opt = build_optimizer(cfg, nn.Linear(3, 2), Communicator(MPI.COMM_SELF))
    assert isinstance(opt, DistributedShampoo)
    assert opt.root_method == NewtonRoots(max_iterations=40)


# ------------------------------------------------------------------ ranks
@pytest.mark.mpi(min_size=2)
def test_two_ranks_equal_one_rank_bitwise(comm: Communicator) -> None:
    """Each block's roots are computed by its owner alone, with its own checks: a run
    over the world equals one over COMM_SELF bit for bit, on every rank."""
    distributed_vs_single(comm, steps=4, root_method=NewtonRoots(check_every=3))
