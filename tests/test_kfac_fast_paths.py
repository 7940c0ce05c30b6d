"""Fast paths of the K-FAC math against plain references (float64, tiny tensors).

* :func:`~kfac_hpc.kfac.patches.averaged_patches`: both the one-GEMM (``M_H ⊗ M_W``) and
  the two-thin-GEMM path against ``F.unfold(...).mean(-1)`` over Conv2d geometries;
* :func:`~kfac_hpc.kfac.linalg.covariance` with ``scale`` against scaling the rows and
  the dense ``scale · rowsᵀ rows / n`` (both the full-product and the upper-triangle
  path);
* :meth:`LayerCurvature.grad_dot` against ``inner64(v, grad_matrix(v.dtype))`` on real
  ``.grad`` fields (Linear, Conv2d, Embedding; missing grads);
* the non-finite screen ``nonfinite`` of the preconditioner (sum screen, entry-by-entry
  fallback when the sum itself overflows).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.kfac import patches
from kfac_hpc.kfac.factor_update import nonfinite
from kfac_hpc.kfac.layers import (
    Conv2dCurvature,
    EmbeddingCurvature,
    LayerCurvature,
    LinearCurvature,
    curvature_for,
    register_layers,
)
from kfac_hpc.kfac.linalg import covariance, inner64
from kfac_hpc.kfac.placement import FactorKey

DT = torch.float64
TOL = 1e-12

# ----- averaged_patches ------------------------------------------------------------------

Geometry = tuple[int, int, int, int, tuple[int, int], tuple[int, int], tuple[int, int],
                 tuple[int, int, int, int] | str]
# (batch, channels, H, W, kernel, stride, dilation, pads (top, bottom, left, right) | "same")

GEOMETRIES: list[Geometry] = [
    (2, 1, 5, 7, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
    (3, 2, 6, 5, (3, 3), (1, 1), (1, 1), (0, 0, 0, 0)),
    (2, 3, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    (2, 4, 8, 9, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    (2, 2, 9, 7, (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    (2, 3, 11, 10, (5, 5), (2, 1), (1, 1), (0, 0, 0, 0)),
    (2, 2, 9, 8, (3, 5), (1, 2), (1, 1), (1, 1, 2, 2)),
    (2, 1, 8, 10, (5, 1), (2, 1), (1, 1), (0, 0, 0, 0)),
    (2, 2, 10, 9, (1, 3), (1, 1), (1, 1), (0, 0, 1, 1)),
    (2, 3, 9, 11, (3, 3), (1, 1), (2, 2), (2, 2, 2, 2)),
    (2, 2, 12, 9, (3, 5), (2, 1), (2, 1), (1, 1, 0, 0)),
    (2, 4, 7, 9, (3, 3), (1, 1), (2, 1), "same"),
    (2, 2, 8, 7, (5, 3), (1, 1), (1, 2), "same"),
    (2, 3, 6, 9, (2, 4), (1, 1), (1, 1), "same"),  # even kernel: asymmetric "same" padding
    (1, 1, 1, 1, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
    (2, 1, 4, 4, (3, 3), (2, 2), (1, 1), (0, 1, 0, 1)),  # asymmetric explicit padding
]


def _pads(kernel: tuple[int, int], dilation: tuple[int, int],
          pads: tuple[int, int, int, int] | str) -> tuple[int, int, int, int]:
    """Explicit ``(top, bottom, left, right)``; ``"same"`` as PyTorch pads it (stride 1)."""
    if not isinstance(pads, str):
        return pads
    out: list[int] = []
    for k, d in zip(kernel, dilation):
        total = d * (k - 1)
        out += [total // 2, total - total // 2]
    return (out[0], out[1], out[2], out[3])


def _unfold_mean(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                 dilation: tuple[int, int], pads: tuple[int, int, int, int]) -> Tensor:
    """Reference: ``F.unfold`` of the zero-padded input, averaged over positions."""
    top, bottom, left, right = pads
    xp = F.pad(x, (left, right, top, bottom))
    return F.unfold(xp, kernel, dilation=dilation, padding=0, stride=stride).mean(dim=-1)


@pytest.mark.parametrize("kron_max", [1 << 62, 0], ids=["one_gemm", "two_gemms"])
@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:4])) + str(g[4:]))
def test_averaged_patches_matches_unfold(geom: Geometry, kron_max: int) -> None:
    b, c, h, w, kernel, stride, dilation, pad_spec = geom
    pads = _pads(kernel, dilation, pad_spec)
    x = torch.randn(b, c, h, w, dtype=DT, generator=torch.Generator().manual_seed(h * w + c))
    got = patches.averaged_patches(x, kernel, stride, dilation, pads, kron_max=kron_max)
    ref = _unfold_mean(x, kernel, stride, dilation, pads)
    assert got.shape == (b, c * kernel[0] * kernel[1])
    assert got.dtype == DT
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL)


def test_averaged_patches_same_as_conv2d_module() -> None:
    """The geometry a ``padding="same"`` Conv2d layer hands over gives the unfold mean."""
    conv = nn.Conv2d(3, 2, (3, 4), padding="same", dilation=(1, 2), dtype=DT)
    curv = curvature_for(conv)
    assert isinstance(curv, Conv2dCurvature)
    x = torch.randn(2, 3, 7, 9, dtype=DT, generator=torch.Generator().manual_seed(7))
    pads = curv.pads()
    ref = _unfold_mean(x, (3, 4), (1, 1), (1, 2), pads)
    for kron_max in (0, 1 << 62):
        got = patches.averaged_patches(x, (3, 4), (1, 1), (1, 2), pads, kron_max=kron_max)
        torch.testing.assert_close(got, ref, rtol=0, atol=TOL)


def test_averaged_patches_kron_max_selects_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kron_max`` is the bound on ``H·W·kh·kw``: at or below it, one GEMM with ``M_H ⊗
    M_W``; above it, two thin GEMMs (no Kronecker matrix)."""
    calls: list[int] = []
    real = patches._kron

    def counting(mh: Tensor, mw: Tensor) -> Tensor:
        calls.append(1)
        return real(mh, mw)

    monkeypatch.setattr(patches, "_kron", counting)
    x = torch.randn(1, 2, 6, 5, dtype=DT)
    entries = 6 * 5 * 3 * 3
    args = ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    patches.averaged_patches(x, *args, kron_max=entries)
    assert len(calls) == 1
    patches.averaged_patches(x, *args, kron_max=entries - 1)
    assert len(calls) == 1
    patches.averaged_patches(x, *args, kron_max=0)
    assert len(calls) == 1


def test_averaged_patches_rejects_non_4d() -> None:
    with pytest.raises(ValueError, match="expects"):
        patches.averaged_patches(torch.zeros(2, 3, 4), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0))


# ----- covariance(rows, scale) -----------------------------------------------------------

# (n_rows, d): small ones take the full product, (160, 64) and (200, 70) the
# upper-triangle path (d ≥ 64 and n ≥ 2d)
COV_SHAPES = [(1, 1), (1, 5), (7, 3), (3, 9), (40, 17), (160, 64), (200, 70)]


def _dense(rows: Tensor, scale: float) -> Tensor:
    return scale * (rows.t() @ rows) / rows.shape[0]


@pytest.mark.parametrize("shape", COV_SHAPES, ids=str)
@pytest.mark.parametrize("scale", [0.37, 4.0, 1e3])
def test_covariance_scale(shape: tuple[int, int], scale: float) -> None:
    n, d = shape
    rows = torch.randn(n, d, dtype=DT, generator=torch.Generator().manual_seed(n * 131 + d))
    got = covariance(rows, scale)
    assert got.shape == (d, d) and got.dtype == DT
    assert torch.equal(got, got.t())  # exactly symmetric
    ref = _dense(rows, scale)
    tol = TOL * float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)
    torch.testing.assert_close(got, covariance(rows * math.sqrt(scale)), rtol=0, atol=tol)


@pytest.mark.parametrize("shape", COV_SHAPES, ids=str)
def test_covariance_default_scale_unchanged(shape: tuple[int, int]) -> None:
    n, d = shape
    rows = torch.randn(n, d, dtype=DT, generator=torch.Generator().manual_seed(n + 17 * d))
    got = covariance(rows)
    assert torch.equal(got, covariance(rows, 1.0))
    assert torch.equal(got, got.t())
    torch.testing.assert_close(got, _dense(rows, 1.0), rtol=0,
                               atol=TOL * float(got.abs().max()))


@pytest.mark.parametrize("shape", [(8, 5), (256, 64)], ids=str)
def test_covariance_power_of_two_scale_is_bitwise(shape: tuple[int, int]) -> None:
    """Power-of-two ``scale`` and row count: bitwise the result of scaling the rows."""
    rows = torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(3))
    assert torch.equal(covariance(rows, 16.0), covariance(rows * 4.0))


def test_covariance_float32_scale() -> None:
    rows = torch.randn(30, 6, generator=torch.Generator().manual_seed(5))
    got = covariance(rows, 2.5)
    assert got.dtype == torch.float32 and torch.equal(got, got.t())
    ref = _dense(rows.to(DT), 2.5)
    torch.testing.assert_close(got.to(DT), ref, rtol=1e-5, atol=1e-5)


# ----- LayerCurvature.grad_dot -----------------------------------------------------------


def _grads_from_backward(model: nn.Module, x: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    y = model(x)
    (torch.sin(y) * y).sum().backward()


def _check_grad_dot(curv: LayerCurvature, dtype: torch.dtype = DT) -> None:
    v = torch.randn(curv.g_dim, curv.a_dim, dtype=dtype,
                    generator=torch.Generator().manual_seed(curv.a_dim * 7 + curv.g_dim))
    got = curv.grad_dot(v)
    assert got is not None
    assert got.dtype == torch.float64 and got.dim() == 0
    ref = inner64(v, curv.grad_matrix(v.dtype))
    assert abs(float(ref)) > 1e-3  # a non-trivial pairing
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


def _layer_cases() -> list[tuple[str, nn.Module, Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        ("linear_bias", nn.Linear(5, 4, dtype=DT), torch.randn(3, 5, dtype=DT, generator=g)),
        ("linear_nobias", nn.Linear(5, 4, bias=False, dtype=DT),
         torch.randn(3, 5, dtype=DT, generator=g)),
        ("linear_seq", nn.Linear(3, 6, dtype=DT), torch.randn(2, 4, 3, dtype=DT, generator=g)),
        ("conv_bias", nn.Conv2d(3, 4, 3, padding=1, dtype=DT),
         torch.randn(2, 3, 5, 6, dtype=DT, generator=g)),
        ("conv_nobias", nn.Conv2d(2, 3, (3, 2), stride=2, bias=False, dtype=DT),
         torch.randn(2, 2, 7, 6, dtype=DT, generator=g)),
        ("embedding", nn.Embedding(7, 5, dtype=DT), torch.randint(0, 7, (3, 4), generator=g)),
    ]


def _registered(module: nn.Module) -> LayerCurvature:
    layers, skipped = register_layers(nn.Sequential(module))
    assert not skipped and list(layers) == ["0"]
    return layers["0"]


EXPECTED_TYPES = {"linear": LinearCurvature, "conv": Conv2dCurvature,
                  "embedding": EmbeddingCurvature}


@pytest.mark.parametrize("case", range(len(_layer_cases())),
                         ids=[c[0] for c in _layer_cases()])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_grad_dot_matches_grad_matrix(case: int, approx: str) -> None:
    name, module, x = _layer_cases()[case]
    layers, _ = register_layers(nn.Sequential(module), approx=approx)
    curv = layers["0"]
    assert isinstance(curv, EXPECTED_TYPES[name.split("_")[0]])
    _grads_from_backward(module, x)
    _check_grad_dot(curv)
    _check_grad_dot(curv, torch.float32)  # v in float32: the grads are cast to v's dtype


def test_grad_dot_bias_grad_only_and_weight_grad_only() -> None:
    """A missing ``.grad`` contributes nothing (grad_matrix reads it as zeros)."""
    lin = nn.Linear(4, 3, dtype=DT)
    curv = _registered(lin)
    _grads_from_backward(lin, torch.randn(2, 4, dtype=DT))
    assert lin.bias.grad is not None
    lin.weight.grad = None
    _check_grad_dot(curv)  # bias term only
    _grads_from_backward(lin, torch.randn(2, 4, dtype=DT))
    lin.bias.grad = None
    _check_grad_dot(curv)  # weight term only


@pytest.mark.parametrize("case", range(len(_layer_cases())),
                         ids=[c[0] for c in _layer_cases()])
def test_grad_dot_none_without_grads(case: int) -> None:
    _, module, _ = _layer_cases()[case]
    curv = _registered(module)
    module.zero_grad(set_to_none=True)
    v = torch.ones(curv.g_dim, curv.a_dim, dtype=DT)
    assert curv.grad_dot(v) is None
    assert float(inner64(v, curv.grad_matrix(DT))) == 0.0  # zeros, consistently


# ----- nonfinite ------------------------------------------------------------------------


def _factors(*tensors: Tensor) -> dict[FactorKey, Tensor]:
    return {FactorKey(f"l{i}", "A" if i % 2 == 0 else "G"): t for i, t in enumerate(tensors)}


def _finite(dtype: torch.dtype, seed: int) -> Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_nonfinite_empty_and_all_finite() -> None:
    assert nonfinite({}) == []
    assert nonfinite(_factors(*(_finite(torch.float32, s) for s in range(4)))) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_flags_exactly_bad_keys(dtype: torch.dtype, bad: float) -> None:
    ts = [_finite(dtype, s) for s in range(5)]
    ts[1][2, 3] = bad
    ts[4][0, 0] = bad
    keys = list(_factors(*ts))
    assert nonfinite(_factors(*ts)) == [keys[1], keys[4]]


@pytest.mark.parametrize(("dtype", "big"), [(torch.float32, 3e38), (torch.bfloat16, 3e38),
                                            (torch.float16, 6e4)], ids=str)
def test_nonfinite_sum_overflow_is_not_flagged(dtype: torch.dtype, big: float) -> None:
    """Finite entries whose sum overflows: the screen is not finite, the entry-by-entry
    check clears them; a NaN next to them is still flagged."""
    huge = torch.tensor([[big, big], [big, big]], dtype=dtype)
    assert not bool(torch.isfinite(huge.sum()))  # the screen does overflow
    assert bool(torch.isfinite(huge).all())
    neg = -huge
    nan = huge.clone()
    nan[1, 0] = math.nan
    mapping = _factors(huge, _finite(dtype, 0), neg, nan)
    keys = list(mapping)
    assert nonfinite(mapping) == [keys[3]]
    assert nonfinite(_factors(huge)) == []


def test_nonfinite_mixed_dtypes() -> None:
    mapping = _factors(_finite(torch.float32, 1), _finite(torch.float64, 2),
                       _finite(torch.float16, 3))
    assert nonfinite(mapping) == []
    mapping[FactorKey("l2", "A")][0, 1] = math.inf
    assert nonfinite(mapping) == [FactorKey("l2", "A")]
