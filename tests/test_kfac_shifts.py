"""The expand A of stride-1 convolutions from shifted products (kfac_hpc.kfac.shifts)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc.kfac import shifts
from kfac_hpc.kfac.layers import Conv2dCurvature, curvature_for
from kfac_hpc.kfac.precision import round_operand
from tests.op_count import count_ops
from tests.test_kfac_math import CONV_CASES, DT, rel_err
from tests.test_kfac_reduce import FAST_CONV

EXTRA_CASES = {
    "padding_beyond_the_kernel": (dict(in_channels=3, out_channels=2, kernel_size=3,
                                       padding=3), (2, 3, 5, 6)),
    "one_row_images": (dict(in_channels=2, out_channels=2, kernel_size=(1, 3), padding=(0, 1)),
                       (3, 2, 1, 7)),
    "one_image_wide_kernel": (dict(in_channels=4, out_channels=2, kernel_size=(2, 5),
                                   padding=(1, 2), dilation=(2, 1)), (1, 4, 6, 9)),
}
CASES = {name: case for name, case in {**CONV_CASES, **FAST_CONV, **EXTRA_CASES}.items()
         if case[0].get("stride", 1) in (1, (1, 1))
         and nn.Conv2d(**case[0]).kernel_size not in ((1, 1),)}


def _conv(kwargs: dict) -> tuple[nn.Conv2d, Conv2dCurvature]:
    conv = nn.Conv2d(**kwargs).to(DT)
    curv = curvature_for(conv)
    assert isinstance(curv, Conv2dCurvature)
    return conv, curv


def _shifted(curv: Conv2dCurvature, x: torch.Tensor, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    kernel_size, _, dilation = curv._conv_geometry()
    return shifts.shifted_covariance(x, kernel_size, dilation, curv.pads(),
                                     append_one=curv.has_bias, **kwargs)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("kwargs", "shape"), list(CASES.values()), ids=list(CASES))
def test_shifted_products_equal_the_patch_rows(kwargs: dict, shape: tuple) -> None:
    """Padding (none, "same", one-sided, beyond the kernel), dilation, bias, non-square
    kernels, one image or one row: the patch rows' A up to summation order, exactly
    symmetric."""
    torch.manual_seed(31)
    _, curv = _conv(kwargs)
    x = torch.randn(*shape, dtype=DT)
    got = _shifted(curv, x)
    want = curv.a_factor_unfold(x)
    assert got.shape == want.shape and got.dtype == DT
    assert torch.equal(got, got.t())
    assert rel_err(got, want) < 1e-12


def test_a_factor_takes_the_shifted_products_where_they_pay(monkeypatch) -> None:
    """On the CPU a stride-1 3x3 convolution's A comes from shifted products (and equals
    the patch rows'); a strided one, or a device not in the set, keeps the patch rows."""
    calls: list[tuple[int, ...]] = []
    real = shifts.shifted_covariance

    def spy(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(shifts, "shifted_covariance", spy)
    torch.manual_seed(32)
    x = torch.randn(4, 16, 16, 16, dtype=DT)
    _, curv = _conv(dict(in_channels=16, out_channels=8, kernel_size=3, padding=1))
    assert rel_err(curv.a_factor(x), curv.a_factor_unfold(x)) < 1e-12
    assert calls == [(4, 16, 16, 16)]
    _, strided = _conv(dict(in_channels=16, out_channels=8, kernel_size=3, padding=1, stride=2))
    strided.a_factor(x)
    monkeypatch.setattr(shifts, "SHIFTED_PRODUCTS_DEVICES", frozenset())
    curv.a_factor(x)
    assert calls == [(4, 16, 16, 16)]


def test_pays_for_large_maps_with_many_channels_or_an_input_in_cache() -> None:
    """Few channels pay only while the input is small, and small maps not at all
    (measured: see shifts.pays)."""
    kernel, one, two, same = (3, 3), (1, 1), (2, 2), (1, 1, 1, 1)

    def pays(shape: tuple[int, ...], kernel_size=kernel, stride=one,  # type: ignore[no-untyped-def]
             device: str = "cpu") -> bool:
        return shifts.pays(torch.empty(shape, device=device), kernel_size, stride, one, same)

    assert pays((128, shifts.MANY_CHANNELS, 32, 32))
    assert not pays((128, shifts.MANY_CHANNELS, 32, 32), device="meta")  # not in the set
    assert pays((8, 16, 32, 32))
    assert not pays((128, 16, 32, 32))  # few channels, beyond cache
    assert not pays((8, 512, 8, 8))  # 0.92 of the multiply-adds
    assert pays((8, 256, 14, 14))
    assert not pays((8, 16, 32, 32), stride=two)
    assert not pays((8, 16, 32, 32), kernel_size=(1, 1))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_rounded_operands_give_the_product_of_the_rounded_input(precision) -> None:  # type: ignore[no-untyped-def]
    """TF32 or bf16 operands: the float32 product of the rounded input (every operand is
    a view of the one input copy), not the full-precision one."""
    torch.manual_seed(33)
    _, curv = _conv(dict(in_channels=8, out_channels=4, kernel_size=3, padding=1))
    x = torch.randn(3, 8, 9, 7)
    got = _shifted(curv, x, precision=precision)
    rounded = _shifted(curv, round_operand(x, precision))
    full = _shifted(curv, x)
    assert rel_err(got.double(), rounded.double()) < 1e-6
    assert rel_err(full.double(), rounded.double()) > 1e-5


def test_operators_do_not_grow_with_the_batch() -> None:
    """A fixed number of products per layer: no per-sample or per-pixel loop."""
    _, curv = _conv(dict(in_channels=4, out_channels=4, kernel_size=3, padding=1))

    def kernels(b: int) -> int:
        x = torch.randn(b, 4, 8, 8, dtype=DT)
        _shifted(curv, x)  # the layout is built (and cached) outside the count
        return count_ops(lambda: _shifted(curv, x)).kernels

    assert kernels(1) == kernels(9) <= 50


def test_flops_against_the_patch_rows() -> None:
    """ResNet-50's stride-1 3x3 layers: under half the symmetric update's multiply-adds
    at 56x56, about as many at 7x7."""
    kernel, dilation, pads = (3, 3), (1, 1), (1, 1, 1, 1)
    big = shifts.shifted_products_flops(32, 56, 56, kernel, dilation, pads)
    small = shifts.shifted_products_flops(32, 7, 7, kernel, dilation, pads)
    assert big[1] == 32 * 56 * 56 * 81
    assert big[0] < 0.45 * big[1] / 2
    assert 0.9 < small[0] / (small[1] / 2) < 1.1


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(b, C, H, W\)"):
        shifts.shifted_covariance(torch.randn(3, 5, 5), (3, 3), (1, 1), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="zero rows"):
        shifts.shifted_covariance(torch.randn(1, 2, 2, 2), (3, 3), (1, 1), (0, 0, 0, 0))
