"""Operand precisions of K-FAC's GEMMs (``stats_precision``, ``precondition_precision``).

TF32 and bf16 round each float32 operand to ``u = 2⁻¹¹`` and ``2⁻⁸`` (round to
nearest) and accumulate in fp32. For a factor ``A = (1/n) Σ_r x_r x_rᵀ`` that gives,
entry by entry, ``|ΔA_ij| ≤ (2u + u²) (1/n) Σ_r |x_ri| |x_rj| + γ_n ≤ (2u + u² + γ_n)
√(A_ii A_jj)`` (Cauchy–Schwarz), with ``γ_n ≈ n·2⁻²⁴`` the fp32 summation's worst case:
the bound checked here against float64, on the CPU (where the operands are rounded
explicitly: the same numbers a GPU's tensor cores use, up to summation order).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.layers import Conv2dCurvature
from kfac_hpc.kfac.options import resolve_precision
from kfac_hpc.kfac.precision import matmul, round_operand

UNIT = {"full": 0.0, "tf32": 2.0**-11, "bf16": 2.0**-8}


def _activations(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Post-ReLU activations of mixed scales, as a network's layer sees them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    scale = torch.logspace(-2, 1, shape[1], dtype=torch.float64).reshape(1, -1, 1, 1)
    return torch.relu(x + 0.3) * scale


@pytest.mark.parametrize("precision", ["full", "tf32", "bf16"])
def test_factor_error_is_within_the_rounding_bound(precision):
    conv = nn.Conv2d(16, 32, 3, padding=1, bias=False)
    curv = Conv2dCurvature(conv)
    x = _activations((6, 16, 10, 10), seed=0)
    n = 6 * 10 * 10
    exact = curv.a_factor(x)  # float64
    approx = curv.a_factor(x, dtype=torch.float32, precision=precision).double()
    diag = exact.diagonal()
    normalised = (approx - exact).abs() / torch.sqrt(torch.outer(diag, diag))
    u = UNIT[precision]
    bound = 2 * u + u * u + n * 2.0**-24 + 2.0**-24  # + the final fp32 rounding
    worst = float(normalised.max())
    assert worst <= bound, f"{precision}: {worst:.3g} > bound {bound:.3g}"
    if precision != "full":  # the rounding is really applied (not the fp32 product)
        assert worst > 2.0**-24 * 8
    assert torch.equal(approx, approx.t())


def test_rounding_is_to_nearest_even():
    ones = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11 + 2.0**-20)])
    assert round_operand(ones, "tf32").tolist() == [1.0, 1 + 2.0**-9, -(1 + 2.0**-10)]
    special = torch.tensor([math.inf, -math.inf, math.nan])
    out = round_operand(special, "tf32")
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])
    assert torch.equal(round_operand(ones, "bf16"), ones.bfloat16().float())
    assert round_operand(ones.double(), "tf32").dtype == torch.float64  # never rounded


def test_matmul_full_is_the_plain_product():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 5, generator=g), torch.randn(5, 4, generator=g)
    assert torch.equal(matmul(a, b, "full"), a @ b)
    assert not torch.equal(matmul(a, b, "bf16"), a @ b)


@pytest.mark.parametrize("precision, bound", [("tf32", 2e-3), ("bf16", 2e-2)])
def test_preconditioned_gradient_error(precision, bound):
    """Relative (Frobenius) error of ``(A⊗G + γI)⁻¹ vec(∇W̄)`` from rounded GEMMs with
    float32 eigenbases, against float64: measured 5.7e-4 (TF32) and 4.8e-3 (bf16) for
    this layer (full fp32: 2.9e-7); the bounds leave a factor of about 4."""
    g = torch.Generator().manual_seed(5)
    a_rows = torch.randn(400, 65, generator=g, dtype=torch.float64)
    g_rows = torch.randn(400, 32, generator=g, dtype=torch.float64) * 3
    qa, la = linalg.eigh_clamped(linalg.covariance(a_rows), torch.float64)
    qg, lg = linalg.eigh_clamped(linalg.covariance(g_rows), torch.float64)
    grad = torch.randn(32, 65, generator=g, dtype=torch.float64)
    exact = linalg.precondition_eigen(grad, qa, la, qg, lg, 1e-3)
    f32 = [t.float() for t in (grad, qa, la, qg, lg)]
    approx = linalg.precondition_eigen(*f32, 1e-3, precision).double()
    error = float(torch.linalg.norm(approx - exact) / torch.linalg.norm(exact))
    assert error <= bound, f"{precision}: {error:.3g}"
    full = linalg.precondition_eigen(*f32, 1e-3, "full").double()
    assert error > float(torch.linalg.norm(full - exact) / torch.linalg.norm(exact))


def test_options_are_validated():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="stats_precision must be one of"):
        KFACPreconditioner(model, stats_precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precondition_precision rounds float32"):
        KFACPreconditioner(model, precondition_precision="tf32", inv_dtype=torch.float64)
    with pytest.raises(ValueError, match="stats_precision rounds float32"):
        KFACPreconditioner(model.double(), stats_precision="bf16", factor_dtype=torch.float64)


def test_auto_is_full_on_the_cpu_and_explicit_choices_apply():
    model = nn.Linear(4, 3)
    pre = KFACPreconditioner(model)
    assert (pre.stats_precision, pre.precondition_precision) == ("full", "full")
    pre.close()
    pre = KFACPreconditioner(model, stats_precision="bf16", precondition_precision="tf32")
    assert pre.config()["stats_precision"] == "bf16"
    x = torch.randn(8, 4)
    model(x).square().sum().backward()
    pre.step()
    a = pre.factors["Linear/A"].average
    assert a is not None
    rows = torch.cat([x, torch.ones(8, 1)], dim=1)
    torch.testing.assert_close(a, linalg.covariance(round_operand(rows, "bf16")))
    pre.close()


def test_auto_is_tf32_for_float32_on_cuda_only():
    """``auto`` (both options' default): TF32 operands for float32 on CUDA, measured faster
    there for statistics and preconditioning alike; full precision for float64 and on
    every other device; explicit choices pass through."""
    assert resolve_precision("auto", device_type="cuda", dtype="float32") == "tf32"
    assert resolve_precision("auto", device_type="cuda", dtype="float64") == "full"
    for device in ("cpu", "meta"):
        assert resolve_precision("auto", device_type=device, dtype="float32") == "full"
    assert resolve_precision("bf16", device_type="cpu", dtype="float32") == "bf16"
    assert resolve_precision("full", device_type="cuda", dtype="float32") == "full"


def test_the_preconditioner_resolves_both_options_for_its_device_and_dtypes(monkeypatch):
    """Both options go through ``resolve_precision`` with the layers' device and the
    factors' and decompositions' dtypes (a model on the meta device, so a device type
    written into the call would show), and the results are what the step uses."""
    from kfac_hpc.kfac import preconditioner

    calls = []

    def spy(value, **kw):
        calls.append((value, kw))
        return resolve_precision(value, **kw)

    monkeypatch.setattr(preconditioner, "resolve_precision", spy)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to("meta")
    pre = KFACPreconditioner(model, inv_dtype=torch.float64)
    assert calls == [("auto", {"device_type": "meta", "dtype": "float32"}),
                     ("auto", {"device_type": "meta", "dtype": "float64"})]
    assert (pre.stats_precision, pre.precondition_precision) == ("full", "full")
    pre.close()
