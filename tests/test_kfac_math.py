"""K-FAC math against an independent dense reference (float64, tiny layers).

References are built without the code under test: factors from explicit per-example,
per-position Python loops (conv patches by slicing a zero-padded input, never
``F.unfold``), δ from per-example autograd, preconditioning from explicit
``torch.kron`` and ``torch.linalg.solve``.

Tolerance: everything is float64 on matrices of size ≤ ~40 with condition numbers
≤ ~1e4, so rounding error is ≲ 1e-13 relative; 1e-10 leaves room for summation-order
differences while any wrong scaling, ordering or padding gives O(1) errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.layers import (
    Conv2dCurvature,
    LayerCurvature,
    LinearCurvature,
    curvature_for,
    unsupported_reason,
)
from kfac_hpc.kfac.linalg import (
    covariance,
    damped_inverse,
    eigh_clamped,
    kl_clip_scale,
    precondition_eigen,
    precondition_inverse,
    update_running_average,
)

RTOL = 1e-10
DT = torch.float64


def rel_err(x: Tensor, ref: Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def per_example_loss(y: Tensor, target: Tensor) -> Tensor:
    """A non-quadratic per-example loss l_i (sums over all non-batch elements)."""
    e = 0.5 * (y - target) ** 2 + 0.3 * torch.sin(2.0 * y) * target
    return e.reshape(y.shape[0], -1).sum(dim=1)


def capture(module: nn.Module, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Batched forward/backward of L = mean_i l_i; returns hook-captured (input, grad_output)."""
    store: dict[str, Tensor] = {}

    def fwd(m: nn.Module, inp: tuple[Tensor, ...]) -> None:
        store["a"] = inp[0].detach()

    def bwd(m: nn.Module, gin: tuple[Tensor, ...], gout: tuple[Tensor, ...]) -> None:
        store["g"] = gout[0].detach()

    h1 = module.register_forward_pre_hook(fwd)
    h2 = module.register_full_backward_hook(bwd)
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)  # a realistic graph: the layer's input needs grad too
    per_example_loss(module(x), target).mean().backward()
    h1.remove()
    h2.remove()
    return store["a"], store["g"]


def per_example_delta(module: nn.Module, x: Tensor, target: Tensor) -> list[Tensor]:
    """δ_i = ∂l_i/∂y_i by running each example alone through autograd."""
    out = []
    for i in range(x.shape[0]):
        yi = module(x[i : i + 1])
        (d,) = torch.autograd.grad(per_example_loss(yi, target[i : i + 1]).sum(), yi)
        out.append(d[0].detach())
    return out


def outer_mean(vectors: list[Tensor]) -> Tensor:
    acc = torch.zeros(vectors[0].numel(), vectors[0].numel(), dtype=DT)
    for v in vectors:
        acc += torch.outer(v, v)
    return acc / len(vectors)


# --------------------------------------------------------------------------- references


def ref_linear(module: nn.Linear, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    a_vecs, g_vecs = [], []
    deltas = per_example_delta(module, x, target)
    for i in range(x.shape[0]):
        xi = x[i].reshape(-1, module.in_features)  # positions of example i
        di = deltas[i].reshape(-1, module.out_features)
        for t in range(xi.shape[0]):
            a = xi[t]
            if module.bias is not None:
                a = torch.cat([a, torch.ones(1, dtype=DT)])
            a_vecs.append(a)
            g_vecs.append(di[t])
    return outer_mean(a_vecs), outer_mean(g_vecs)


def conv_pads(module: nn.Conv2d) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zero padding, written out independently."""
    (kh, kw), (dh, dw) = module.kernel_size, module.dilation
    if module.padding == "valid":
        return 0, 0, 0, 0
    if module.padding == "same":
        th, tw = dh * (kh - 1), dw * (kw - 1)
        return th // 2, th - th // 2, tw // 2, tw - tw // 2
    ph, pw = cast(tuple[int, int], module.padding)
    return ph, ph, pw, pw


def ref_conv(module: nn.Conv2d, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    pt, pb, pl, pr = conv_pads(module)
    deltas = per_example_delta(module, x, target)
    w = module.weight.detach().reshape(module.out_channels, -1)
    with torch.no_grad():
        y = module(x)
    a_vecs, g_vecs = [], []
    for i in range(x.shape[0]):
        c, h, wd = x[i].shape
        xp = torch.zeros(c, h + pt + pb, wd + pl + pr, dtype=DT)
        xp[:, pt : pt + h, pl : pl + wd] = x[i]
        ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
        wo = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
        assert (ho, wo) == tuple(y.shape[2:])
        for oh in range(ho):
            for ow in range(wo):
                r0, c0 = oh * sh, ow * sw
                patch = xp[:, r0 : r0 + dh * (kh - 1) + 1 : dh, c0 : c0 + dw * (kw - 1) + 1 : dw]
                patch = patch.reshape(-1)
                # the reference patch really is what the convolution sees
                out = w @ patch + (0 if module.bias is None else module.bias.detach())
                assert torch.allclose(out, y[i, :, oh, ow], rtol=1e-12, atol=1e-12)
                if module.bias is not None:
                    patch = torch.cat([patch, torch.ones(1, dtype=DT)])
                a_vecs.append(patch)
                g_vecs.append(deltas[i][:, oh, ow])
    return outer_mean(a_vecs), outer_mean(g_vecs)


# --------------------------------------------------------------------------- factors

Case = tuple[dict[str, Any], tuple[int, ...]]

LINEAR_CASES: dict[str, Case] = {
    "bias_2d": (dict(in_features=5, out_features=4, bias=True), (7, 5)),
    "nobias_2d": (dict(in_features=5, out_features=4, bias=False), (7, 5)),
    "bias_seq": (dict(in_features=4, out_features=3, bias=True), (3, 5, 4)),
    "nobias_seq4d": (dict(in_features=3, out_features=2, bias=False), (2, 3, 2, 3)),
}

CONV_CASES: dict[str, Case] = {
    "k3_bias": (dict(in_channels=2, out_channels=3, kernel_size=3, bias=True), (3, 2, 6, 6)),
    "k3_nobias_stride2_pad1": (
        dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1, bias=False),
        (3, 2, 7, 6),
    ),
    "same_even_kernel": (
        dict(in_channels=2, out_channels=3, kernel_size=(4, 3), padding="same", bias=True),
        (2, 2, 6, 5),
    ),
    "same_even_dilated": (
        dict(in_channels=1, out_channels=2, kernel_size=2, padding="same", dilation=3),
        (2, 1, 7, 6),
    ),
    "dilation2": (
        dict(in_channels=2, out_channels=2, kernel_size=3, dilation=2, padding=2, bias=True),
        (2, 2, 7, 7),
    ),
    "nonsquare_stride": (
        dict(
            in_channels=3,
            out_channels=2,
            kernel_size=(3, 2),
            stride=(2, 1),
            padding=(1, 0),
            bias=False,
        ),
        (3, 3, 7, 5),
    ),
    "valid": (dict(in_channels=2, out_channels=2, kernel_size=2, padding="valid"), (2, 2, 4, 5)),
    # more output positions (64) than A (2·1·1 + 1) or G (3) features: the per-sample path
    "k1_bias_many_positions": (dict(in_channels=2, out_channels=3, kernel_size=1, bias=True),
                               (3, 2, 8, 8)),
    "k3_nobias_many_positions": (
        dict(in_channels=1, out_channels=2, kernel_size=3, padding=1, bias=False), (2, 1, 9, 9)),
}


def make(
    kind: str, kwargs: dict[str, Any], shape: tuple[int, ...], seed: int = 0
) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    module: nn.Module = (nn.Linear if kind == "linear" else nn.Conv2d)(**kwargs).to(DT)
    x = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        target = torch.randn_like(module(x))
    return module, x, target


ALL_CASES = [("linear", k, *v) for k, v in LINEAR_CASES.items()] + [
    ("conv", k, *v) for k, v in CONV_CASES.items()
]
ALL_IDS = [f"{kind}-{name}" for kind, name, *_ in ALL_CASES]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("kind", "name", "kwargs", "shape"), ALL_CASES, ids=ALL_IDS)
def test_factors_match_dense_reference(kind: str, name: str, kwargs: dict, shape: tuple) -> None:
    module, x, target = make(kind, kwargs, shape)
    curv = curvature_for(module)
    assert curv is not None
    assert isinstance(curv, LinearCurvature if kind == "linear" else Conv2dCurvature)
    inputs, grad_output = capture(module, x, target)
    if isinstance(module, nn.Linear):
        a_ref, g_ref = ref_linear(module, x, target)
    else:
        assert isinstance(module, nn.Conv2d)
        a_ref, g_ref = ref_conv(module, x, target)

    a, g = curv.a_factor(inputs), curv.g_factor(grad_output)
    assert a.shape == (curv.a_dim, curv.a_dim) and g.shape == (curv.g_dim, curv.g_dim)
    assert a.dtype == g.dtype == DT
    assert rel_err(a, a_ref) < RTOL
    assert rel_err(g, g_ref) < RTOL


@pytest.mark.parametrize(("kind", "name", "kwargs", "shape"), ALL_CASES, ids=ALL_IDS)
def test_rows_reproduce_weight_gradient(kind: str, name: str, kwargs: dict, shape: tuple) -> None:
    """∇W̄ = (1/b) Σ_rows δ āᵀ: a_rows and g_rows are aligned row for row and scaled right."""
    module, x, target = make(kind, kwargs, shape, seed=1)
    curv = curvature_for(module)
    assert curv is not None
    inputs, grad_output = capture(module, x, target)
    a_rows, g_rows = curv.a_rows(inputs), curv.g_rows(grad_output)
    assert a_rows.shape[0] == g_rows.shape[0]
    assert rel_err(g_rows.t() @ a_rows / x.shape[0], curv.grad_matrix()) < RTOL


@pytest.mark.parametrize(("kind", "name", "kwargs", "shape"), ALL_CASES[::3], ids=ALL_IDS[::3])
def test_factors_symmetric_psd(kind: str, name: str, kwargs: dict, shape: tuple) -> None:
    module, x, target = make(kind, kwargs, shape, seed=2)
    curv = curvature_for(module)
    assert curv is not None
    inputs, grad_output = capture(module, x, target)
    for f in (curv.a_factor(inputs), curv.g_factor(grad_output)):
        assert torch.equal(f, f.t())  # exactly symmetric
        evals = torch.linalg.eigvalsh(f)
        assert evals.min() >= -1e-12 * evals.max()


def test_unbatched_linear_is_one_example() -> None:
    lin = nn.Linear(3, 2).to(DT)
    curv = curvature_for(lin)
    assert curv is not None
    x, go = torch.randn(3, dtype=DT), torch.randn(2, dtype=DT)
    assert torch.allclose(
        curv.a_factor(x), torch.outer(torch.cat([x, x.new_ones(1)]), torch.cat([x, x.new_ones(1)]))
    )
    assert torch.allclose(curv.g_factor(go), torch.outer(go, go))


# --------------------------------------------------------------------------- dtype, AMP


def test_factor_dtype_and_grad_scale() -> None:
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    curv = curvature_for(conv)
    assert curv is not None
    x = torch.randn(4, 2, 5, 5).to(torch.bfloat16)
    go = torch.randn(4, 3, 5, 5)

    a32 = curv.a_factor(x, dtype=torch.float32)
    assert a32.dtype == torch.float32
    assert curv.a_factor(x).dtype == torch.bfloat16
    assert rel_err(a32.double(), curv.a_factor(x, dtype=DT)) < 1e-6

    scale = 2.0**10  # a loss scale that still fits fp16 here
    g_scaled = curv.g_factor((go * scale).half(), dtype=torch.float32, grad_scale=scale)
    assert g_scaled.dtype == torch.float32
    assert rel_err(g_scaled.double(), curv.g_factor(go.half(), dtype=DT)) < 1e-6
    assert rel_err(curv.g_factor(go * scale, grad_scale=scale), curv.g_factor(go)) < 1e-6


def test_factors_ignore_enclosing_autocast() -> None:
    torch.manual_seed(4)
    lin = nn.Linear(6, 5)
    curv = curvature_for(lin)
    assert curv is not None
    x, go = torch.randn(8, 6), torch.randn(8, 5)
    a_ref, g_ref = curv.a_factor(x), curv.g_factor(go)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, g = curv.a_factor(x, dtype=torch.float32), curv.g_factor(go, dtype=torch.float32)
    assert a.dtype == g.dtype == torch.float32
    assert torch.allclose(a, a_ref, rtol=1e-6) and torch.allclose(g, g_ref, rtol=1e-6)


# --------------------------------------------------------------------------- grad round trip


@pytest.mark.parametrize("bias", [True, False])
def test_grad_matrix_set_grad_round_trip(bias: bool) -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(2, 3, (3, 2), bias=bias)  # float32 parameters
    curv = curvature_for(conv)
    assert curv is not None and curv.a_dim == 2 * 3 * 2 + int(bias) and curv.g_dim == 3

    # missing gradients read as zeros
    assert torch.equal(curv.grad_matrix(), torch.zeros(3, curv.a_dim))

    conv.weight.grad = torch.randn_like(conv.weight)
    if conv.bias is not None:
        conv.bias.grad = torch.randn_like(conv.bias)
    m = curv.grad_matrix()
    assert torch.equal(m[:, :12], conv.weight.grad.reshape(3, 12))
    if conv.bias is not None:
        assert conv.bias.grad is not None and torch.equal(m[:, 12], conv.bias.grad)

    w_grad = conv.weight.grad
    new = torch.randn(3, curv.a_dim, dtype=DT)
    curv.set_grad(new)
    assert conv.weight.grad is w_grad and w_grad.dtype == torch.float32  # in place, dtype kept
    assert torch.equal(curv.grad_matrix(dtype=DT), new.float().double())
    with pytest.raises(ValueError):
        curv.set_grad(torch.zeros(3, curv.a_dim + 1))


def test_set_grad_creates_missing_grad() -> None:
    lin = nn.Linear(3, 2).to(DT)
    curv = curvature_for(lin)
    assert curv is not None
    m = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    curv.set_grad(m)
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert lin.weight.grad.dtype == DT
    assert torch.equal(lin.weight.grad, m[:, :3].double())
    assert torch.equal(lin.bias.grad, m[:, 3].double())
    m.zero_()  # the created grads must not alias the argument
    assert lin.bias.grad.abs().sum() > 0


# --------------------------------------------------------------------------- preconditioning


def random_factor(n: int, rows: int, gen: torch.Generator) -> Tensor:
    r = torch.randn(rows, n, dtype=DT, generator=gen)
    return covariance(r)


def vec(x: Tensor) -> Tensor:
    """Column-major vec: stacks the columns of x."""
    return x.t().reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    return v.reshape(cols, rows).t()


def test_kron_vec_convention() -> None:
    gen = torch.Generator().manual_seed(6)
    a, g = random_factor(4, 9, gen), random_factor(3, 9, gen)
    x = torch.randn(3, 4, dtype=DT, generator=gen)
    assert rel_err(torch.kron(a, g) @ vec(x), vec(g @ x @ a.t())) < RTOL


# (a_dim, g_dim, rows used for A, damping): rank-deficient A exercises the damping.
PRECOND_CASES = [(5, 4, 20, 1e-3), (6, 3, 3, 1e-2), (7, 5, 30, 0.5)]


@pytest.mark.parametrize(("a_dim", "g_dim", "rows", "damping"), PRECOND_CASES)
def test_precondition_eigen_matches_kron_solve(
    a_dim: int, g_dim: int, rows: int, damping: float
) -> None:
    gen = torch.Generator().manual_seed(7)
    a, g = random_factor(a_dim, rows, gen), random_factor(g_dim, 2 * g_dim, gen)
    grad = torch.randn(g_dim, a_dim, dtype=DT, generator=gen)
    qa, la = eigh_clamped(a, dtype=DT)
    qg, lg = eigh_clamped(g, dtype=DT)
    v = precondition_eigen(grad, qa, la, qg, lg, damping)

    k = torch.kron(a, g) + damping * torch.eye(a_dim * g_dim, dtype=DT)
    v_ref = unvec(torch.linalg.solve(k, vec(grad)), g_dim, a_dim)
    assert v.dtype == DT
    assert rel_err(v, v_ref) < RTOL


@pytest.mark.parametrize(("a_dim", "g_dim", "rows", "damping"), PRECOND_CASES)
def test_precondition_inverse_matches_kron_solve(
    a_dim: int, g_dim: int, rows: int, damping: float
) -> None:
    gen = torch.Generator().manual_seed(8)
    a, g = random_factor(a_dim, rows, gen), random_factor(g_dim, 2 * g_dim, gen)
    grad = torch.randn(g_dim, a_dim, dtype=DT, generator=gen)
    v = precondition_inverse(grad, damped_inverse(a, damping), damped_inverse(g, damping))

    s = math.sqrt(damping)
    k = torch.kron(a + s * torch.eye(a_dim, dtype=DT), g + s * torch.eye(g_dim, dtype=DT))
    v_ref = unvec(torch.linalg.solve(k, vec(grad)), g_dim, a_dim)
    assert v.dtype == DT
    assert rel_err(v, v_ref) < RTOL


def test_precondition_real_layer_end_to_end() -> None:
    """Factors from a conv layer + its own gradient, eigen method vs dense solve."""
    kwargs, shape = CONV_CASES["same_even_kernel"]
    module, x, target = make("conv", kwargs, shape, seed=9)
    curv = curvature_for(module)
    assert curv is not None
    inputs, grad_output = capture(module, x, target)
    a, g, grad = curv.a_factor(inputs), curv.g_factor(grad_output), curv.grad_matrix()
    damping = 1e-2
    v = precondition_eigen(grad, *eigh_clamped(a, DT), *eigh_clamped(g, DT), damping)
    k = torch.kron(a, g) + damping * torch.eye(curv.a_dim * curv.g_dim, dtype=DT)
    assert rel_err(v, unvec(torch.linalg.solve(k, vec(grad)), curv.g_dim, curv.a_dim)) < RTOL


def test_precondition_dtype_follows_grad() -> None:
    gen = torch.Generator().manual_seed(10)
    a, g = random_factor(4, 10, gen), random_factor(3, 10, gen)
    grad = torch.randn(3, 4, dtype=torch.float32, generator=gen)
    qa, la = eigh_clamped(a)  # float32 by default
    qg, lg = eigh_clamped(g)
    assert qa.dtype == la.dtype == torch.float32
    assert precondition_eigen(grad, qa, la, qg, lg, 0.1).dtype == torch.float32
    qa64, la64 = eigh_clamped(a, DT)
    qg64, lg64 = eigh_clamped(g, DT)
    v64 = precondition_eigen(grad, qa64, la64, qg64, lg64, 0.1)
    assert v64.dtype == torch.float32
    assert rel_err(precondition_eigen(grad, qa, la, qg, lg, 0.1), v64) < 1e-5


# --------------------------------------------------------------------------- linalg pieces


def test_covariance() -> None:
    rows = torch.randn(11, 4, dtype=DT)
    ref = outer_mean(list(rows))
    c = covariance(rows)
    assert rel_err(c, ref) < RTOL and torch.equal(c, c.t())
    with pytest.raises(ValueError):
        covariance(torch.zeros(0, 3))


def test_eigh_clamped() -> None:
    gen = torch.Generator().manual_seed(11)
    f = random_factor(6, 3, gen)  # rank 3: tiny negative eigenvalues get clamped
    q, lam = eigh_clamped(f, DT)
    assert (lam >= 0).all()
    assert rel_err(q @ torch.diag(lam) @ q.t(), f) < RTOL

    indefinite = torch.diag(torch.tensor([-2.0, 1.0, 3.0], dtype=DT))
    _, lam = eigh_clamped(indefinite, DT)
    assert torch.equal(lam, torch.tensor([0.0, 1.0, 3.0], dtype=DT))

    q16, lam16 = eigh_clamped(f.half())  # fp16 input works, float32 out
    assert q16.dtype == lam16.dtype == torch.float32


def test_eigh_falls_back_to_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    real_eigh: Callable[..., tuple[Tensor, Tensor]] = torch.linalg.eigh
    seen: list[torch.dtype] = []

    def flaky(m: Tensor) -> tuple[Tensor, Tensor]:
        seen.append(m.dtype)
        if m.dtype != torch.float64:
            raise torch.linalg.LinAlgError("did not converge")
        return real_eigh(m)

    monkeypatch.setattr(linalg.torch.linalg, "eigh", flaky)
    f = torch.diag(torch.tensor([1.0, 2.0]))
    q, lam = eigh_clamped(f)
    assert seen == [torch.float32, torch.float64]
    assert q.dtype == lam.dtype == torch.float32
    assert torch.allclose(lam, torch.tensor([1.0, 2.0]))


def test_damped_inverse() -> None:
    gen = torch.Generator().manual_seed(12)
    f = random_factor(5, 3, gen)
    damping = 0.04
    inv = damped_inverse(f, damping)
    eye = torch.eye(5, dtype=DT)
    assert inv.dtype == DT and torch.equal(inv, inv.t())
    assert rel_err((f + 0.2 * eye) @ inv, eye) < RTOL
    assert damped_inverse(f.float(), damping).dtype == torch.float32
    assert damped_inverse(f, damping, dtype=torch.float32).dtype == torch.float32
    # not positive definite -> Cholesky fails -> LU fallback still inverts exactly
    indefinite = torch.diag(torch.tensor([-1.0, 2.0], dtype=DT))
    assert torch.allclose(
        damped_inverse(indefinite, 0.0), torch.diag(torch.tensor([-1.0, 0.5], dtype=DT))
    )
    # singular -> pseudo-inverse
    assert torch.allclose(
        damped_inverse(torch.zeros(2, 2, dtype=DT), 0.0), torch.zeros(2, 2, dtype=DT)
    )
    with pytest.raises(ValueError):
        damped_inverse(f, -1.0)


def test_running_average() -> None:
    b1, b2, b3 = (torch.randn(3, 3, dtype=DT) for _ in range(3))
    f = update_running_average(None, b1, 0.9)
    assert torch.equal(f, b1) and f.data_ptr() != b1.data_ptr()
    f2 = update_running_average(f, b2, 0.9)
    assert f2 is f  # in place
    assert rel_err(f2, 0.9 * b1 + 0.1 * b2) < RTOL
    f3 = update_running_average(f2, b3, 0.5)
    assert rel_err(f3, 0.5 * (0.9 * b1 + 0.1 * b2) + 0.5 * b3) < RTOL
    assert torch.equal(update_running_average(f3.clone(), b1, 0.0), b1)
    with pytest.raises(ValueError):
        update_running_average(f, b1, 1.5)


def test_kl_clip_scale() -> None:
    gen = torch.Generator().manual_seed(13)
    pairs = [
        (torch.randn(3, 4, dtype=DT, generator=gen), torch.randn(3, 4, dtype=DT, generator=gen))
        for _ in range(3)
    ]
    vg = sum(float((v * g).sum()) for v, g in pairs)
    lr = 0.1
    hand = lambda kl: min(1.0, math.sqrt(kl / abs(lr**2 * vg)))

    small = 1e-3 * abs(lr**2 * vg)  # clipping regime: nu = sqrt(1e-3)
    nu = kl_clip_scale(pairs, lr, small)
    assert nu < 1.0 and math.isclose(nu, hand(small), rel_tol=1e-12)
    assert math.isclose(nu, math.sqrt(1e-3), rel_tol=1e-12)
    assert kl_clip_scale(iter(pairs), lr, 1e6) == 1.0 == hand(1e6)  # no clipping; any iterable
    assert kl_clip_scale(pairs, lr, None) == 1.0
    zeros = [(torch.zeros(2, 2), torch.ones(2, 2))]
    assert kl_clip_scale(zeros, lr, 1e-3) == 1.0  # zero denominator
    assert kl_clip_scale(pairs, 0.0, 1e-3) == 1.0
    assert kl_clip_scale([], lr, 1e-3) == 1.0
    # float32 pairs are accumulated in float64
    nu32 = kl_clip_scale([(v.float(), g.float()) for v, g in pairs], lr, small)
    assert math.isclose(nu32, nu, rel_tol=1e-5)


def test_scaling_by_a_float64_factor_is_one_multiply_per_dtype_with_the_same_bits() -> None:
    """ν (a 0-dim float64 tensor on the GPU path) scales float32 and float64 tensors as
    tensor-by-tensor multiplies would, bit for bit, in one multi-tensor multiply per dtype
    (on CUDA its one-launch path needs the factor in the tensors' dtype)."""
    from op_count import count_ops

    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5, 7, generator=gen, dtype=dtype)
               for dtype in (torch.float32, torch.float64, torch.float32, torch.float32)]
    nu = torch.tensor(0.123456789012345678, dtype=torch.float64)
    want = [t.clone().mul_(nu) for t in tensors]
    got = [t.clone() for t in tensors]
    ops = count_ops(lambda: linalg.scale_in_place(got, nu))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    assert ops.calls("aten._foreach_mul_.") == 2 and ops.calls("aten.mul") == 0, ops.counts
    plain = [t.clone() for t in tensors]
    linalg.scale_in_place(plain, 0.5)  # a Python number: one multiply for all
    assert all(torch.equal(a, b * 0.5) for a, b in zip(plain, tensors))


# --------------------------------------------------------------------------- support


def test_unsupported_reasons() -> None:
    grouped = nn.Conv2d(4, 4, 3, groups=2)
    assert unsupported_reason(grouped) == "grouped convolution (groups=2) is not supported"
    assert curvature_for(grouped) is None
    reflect = nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")
    reason = unsupported_reason(reflect)
    assert reason is not None and "reflect" in reason
    assert curvature_for(reflect) is None
    for m in (
        nn.Conv1d(2, 2, 3),
        nn.Conv3d(2, 2, 3),
        nn.ConvTranspose2d(2, 2, 3),
        nn.EmbeddingBag(5, 3),
    ):
        reason = unsupported_reason(m)
        assert reason is not None and type(m).__name__ in reason
        assert curvature_for(m) is None
    for other in (nn.ReLU(), nn.LayerNorm(3), nn.Sequential()):
        assert unsupported_reason(other) is None and curvature_for(other) is None
    for ok in (nn.Linear(2, 3), nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 2, padding="same")):
        assert unsupported_reason(ok) is None
        assert isinstance(curvature_for(ok), LayerCurvature)


@pytest.mark.parametrize("bias", [True, False])
def test_column_covariance_equals_row_covariance(bias: bool) -> None:
    """The per-sample path (no transposed copy) is the row path up to rounding."""
    from kfac_hpc.kfac.linalg import column_covariance, covariance

    torch.manual_seed(7)
    blocks = torch.randn(4, 5, 11, dtype=DT)
    rows = blocks.transpose(1, 2).reshape(-1, 5)
    if bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=DT)], dim=1)
    got = column_covariance(blocks, append_one=bias)
    assert rel_err(got, covariance(rows)) < 1e-14
    assert torch.equal(got, got.t())


@pytest.mark.parametrize("d", [63, 64, 150, 577])
def test_covariance_symmetric_path(d: int) -> None:
    """From 64 columns only the upper triangle is multiplied (symmetric rank-k update)."""
    from kfac_hpc.kfac.linalg import mirror_upper, symmetric_gram_

    gen = torch.Generator().manual_seed(d)
    n = 2 * d + 1  # enough rows for the symmetric path
    rows = torch.randn(n, d, dtype=DT, generator=gen)
    ref = rows.t() @ rows / n
    c = covariance(rows)
    assert rel_err(c, ref) < 1e-14 and torch.equal(c, c.t())
    c32 = covariance(rows.float())
    assert c32.dtype == torch.float32 and torch.equal(c32, c32.t())
    assert rel_err(c32.double(), ref) < 1e-6
    for blocks in (1, 2, 7, d + 5):
        acc = torch.zeros(d, d, dtype=DT)
        symmetric_gram_(acc, rows, blocks)
        symmetric_gram_(acc, rows, blocks)  # accumulates
        assert rel_err(mirror_upper(acc), 2 * ref * n) < 1e-14


def test_eigh_of_a_factor_with_zero_rows(monkeypatch):
    """A 3x3 convolution's A on 1x1 feature maps is mostly zero padding: exact zero rows,
    on which LAPACK's eigh can fail to converge (MKL did, in float32). eigh_clamped
    retries on a slightly shifted diagonal and still reconstructs the factor."""
    from kfac_hpc.kfac.layers import Conv2dCurvature

    torch.manual_seed(0)
    curv = Conv2dCurvature(torch.nn.Conv2d(64, 8, 3, padding=1, bias=False))
    a = curv.a_factor(torch.relu(torch.randn(4, 64, 1, 1)))
    assert int((a.abs().sum(0) == 0).sum()) > 400  # the padding's zero rows
    q, lam = linalg.eigh_clamped(a)
    torch.testing.assert_close(q @ torch.diag(lam) @ q.t(), a, rtol=0, atol=1e-5)

    real = torch.linalg.eigh  # a solver that, like MKL here, fails on exact zero diagonals

    def fails_on_zero_diagonal(m, *args, **kwargs):
        if bool((m.diagonal(dim1=-2, dim2=-1) == 0).any()):
            raise torch.linalg.LinAlgError("failed to converge (stand-in)")
        return real(m, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", fails_on_zero_diagonal)
    q, lam = linalg.eigh_clamped(a)
    assert q.dtype == torch.float32 and bool((lam >= 0).all())
    torch.testing.assert_close(q @ torch.diag(lam) @ q.t(), a, rtol=0, atol=1e-5)
