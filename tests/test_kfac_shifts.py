"""The expand A of stride-1 convolutions from shifted products (kfac_hpc.kfac.shifts)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc.kfac import layers, shifts
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
    "one_column_images": (dict(in_channels=3, out_channels=2, kernel_size=3, padding=1),
                          (2, 3, 5, 1)),
    "one_row_tall_kernel": (dict(in_channels=2, out_channels=2, kernel_size=(3, 1),
                                 padding=(1, 0), bias=False), (2, 2, 1, 6)),
}
CASES = {name: case for name, case in {**CONV_CASES, **FAST_CONV, **EXTRA_CASES}.items()
         if case[0].get("stride", 1) in (1, (1, 1))
         and nn.Conv2d(**case[0]).kernel_size not in ((1, 1),)}


def _conv(kwargs: dict) -> tuple[nn.Conv2d, Conv2dCurvature]:
    conv = nn.Conv2d(**kwargs).to(DT)
    curv = curvature_for(conv)
    assert isinstance(curv, Conv2dCurvature)
    return conv, curv


class ShiftedCalls:
    """What ``shifts.shifted_covariance`` was called with: input shapes and precisions."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.precisions: list[str] = []


@pytest.fixture
def shifted_calls(monkeypatch: pytest.MonkeyPatch) -> ShiftedCalls:
    """Record the calls of ``shifts.shifted_covariance`` (still computing the result)."""
    calls = ShiftedCalls()
    real = shifts.shifted_covariance

    def spy(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.shapes.append(tuple(x.shape))
        calls.precisions.append(kwargs.get("precision", "full"))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(shifts, "shifted_covariance", spy)
    return calls


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


def test_a_factor_takes_the_shifted_products_where_they_pay(monkeypatch, shifted_calls) -> None:  # type: ignore[no-untyped-def]
    """On the CPU a stride-1 3x3 convolution's A comes from shifted products (and equals
    the patch rows'); a strided one, the GPU path, or a path not in the set keeps the
    patch rows."""
    calls = shifted_calls.shapes
    torch.manual_seed(32)
    x = torch.randn(4, 16, 16, 16, dtype=DT)
    _, curv = _conv(dict(in_channels=16, out_channels=8, kernel_size=3, padding=1))
    assert rel_err(curv.a_factor(x), curv.a_factor_unfold(x)) < 1e-12
    assert calls == [(4, 16, 16, 16)]
    _, strided = _conv(dict(in_channels=16, out_channels=8, kernel_size=3, padding=1, stride=2))
    strided.a_factor(x)
    with monkeypatch.context() as gpu:
        gpu.setattr(layers, "uses_gpu_path", lambda device: True)
        curv.a_factor(x)
        assert calls == [(4, 16, 16, 16)]
        gpu.setattr(shifts, "SHIFTED_PRODUCTS_PATHS", frozenset({"cpu", "gpu"}))
        assert rel_err(curv.a_factor(x), curv.a_factor_unfold(x)) < 1e-12
        assert calls == [(4, 16, 16, 16)] * 2
    monkeypatch.setattr(shifts, "SHIFTED_PRODUCTS_PATHS", frozenset())
    curv.a_factor(x)
    assert calls == [(4, 16, 16, 16)] * 2


def test_unbatched_and_autocast_inputs_take_the_shifted_products(shifted_calls) -> None:  # type: ignore[no-untyped-def]
    """A ``(C, H, W)`` input is one image, and under CPU autocast the products stay in the
    input's dtype: both as the patch rows give them."""
    calls = shifted_calls.shapes
    torch.manual_seed(35)
    _, curv = _conv(dict(in_channels=16, out_channels=8, kernel_size=3, padding=1))
    x = torch.randn(16, 16, 16, dtype=DT)
    assert rel_err(curv.a_factor(x), curv.a_factor_unfold(x)) < 1e-12
    x32 = torch.randn(2, 16, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = curv.a_factor(x32)
    assert under.dtype == torch.float32
    assert rel_err(under.double(), curv.a_factor_unfold(x32.double())) < 1e-6
    assert calls == [(1, 16, 16, 16), (2, 16, 16, 16)]


def test_pays_where_the_multiply_adds_fall_enough() -> None:
    """Maps of 7x7 and more pay, at any batch and channel count; 4x4 not (see
    shifts.FLOPS_BELOW)."""
    kernel, one, two, same = (3, 3), (1, 1), (2, 2), (1, 1, 1, 1)

    def pays(shape: tuple[int, ...], kernel_size=kernel, stride=one,  # type: ignore[no-untyped-def]
             path: str = "cpu") -> bool:
        return shifts.pays(torch.empty(shape, device="meta"), kernel_size, stride, one, same,
                           path)

    assert pays((128, 64, 32, 32))
    assert not pays((128, 64, 32, 32), path="gpu")  # not in the set
    assert pays((8, 16, 32, 32)) and pays((128, 16, 32, 32))
    assert pays((8, 512, 8, 8)) and pays((8, 512, 7, 7))  # 0.68 and 0.73 of them
    assert not pays((8, 512, 6, 6)) and not pays((8, 512, 4, 4))  # 0.80 and 1.06
    assert pays((8, 256, 14, 14))
    assert not pays((8, 16, 32, 32), stride=two)
    assert not pays((8, 16, 32, 32), kernel_size=(1, 1))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_rounded_operands_give_the_product_of_the_rounded_input(precision) -> None:  # type: ignore[no-untyped-def]
    """TF32 or bf16 operands: the float32 product of the rounded input (every operand is
    a view of the one input copy, rounded once), not the full-precision one."""
    torch.manual_seed(33)
    _, curv = _conv(dict(in_channels=8, out_channels=4, kernel_size=3, padding=1))
    x = torch.randn(3, 8, 9, 7)
    got = _shifted(curv, x, precision=precision)
    rounded = _shifted(curv, round_operand(x, precision))
    full = _shifted(curv, x)
    assert torch.equal(got, rounded)  # the same buffer values, the same products
    assert rel_err(full.double(), rounded.double()) > 1e-5


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_a_factor_hands_its_precision_to_the_shifted_products(shifted_calls, precision) -> None:  # type: ignore[no-untyped-def]
    """``a_factor(..., precision=p)`` on the CPU takes the shifts with operands rounded as
    the rows' product rounds them (bias column included): bitwise the float32 factor of the
    rounded input, so the float64 factor of the rounded input to float32's accuracy, far
    closer than to the full-precision factor (the rounding moves it by 5e-4 in TF32, 4e-3
    in bf16; float32 accumulation by about 1e-6)."""
    calls = shifted_calls.precisions
    torch.manual_seed(36)
    _, curv = _conv(dict(in_channels=8, out_channels=4, kernel_size=3, padding=1))
    x = torch.randn(3, 8, 16, 16)
    got = curv.a_factor(x, torch.float32, precision)
    assert calls == [precision]
    x_rounded = round_operand(x, precision)
    assert torch.equal(got, curv.a_factor(x_rounded, torch.float32, "full"))
    rounded = curv.a_factor_unfold(x_rounded.double())
    full = curv.a_factor_unfold(x.double())
    assert rel_err(got.double(), rounded) < rel_err(got.double(), full) / 100


def test_symmetric_takes_the_upper_blocks_and_each_diagonal_block_s_upper_triangle() -> None:
    """Below the diagonal every block becomes the transposed block above it, and each
    diagonal block its own upper triangle mirrored: exactly symmetric whatever the lower
    parts held (the borders are only subtracted from the blocks on and above it)."""
    torch.manual_seed(37)
    lay = shifts._layout(5, 5, (3, 3), (1, 1), (1, 1, 1, 1), torch.device("cpu"))
    blocks = torch.randn(9, 9, 4, 4, dtype=DT)
    want = blocks.clone()
    got = shifts._symmetric(blocks, lay).permute(0, 2, 1, 3).reshape(36, 36)
    assert torch.equal(got, got.t())
    for i in range(9):
        for j in range(i + 1, 9):
            assert torch.equal(got[4 * i:4 * i + 4, 4 * j:4 * j + 4], want[i, j])
        assert torch.equal(got[4 * i:4 * i + 4, 4 * i:4 * i + 4].triu(), want[i, i].triu())


def test_float32_where_it_pays_is_as_accurate_as_the_patch_path() -> None:
    """Subtracting the borders from whole-image products cancels where the borders are a
    large part of the image; on the smallest maps the rule takes (7x7, 8x8), float32
    stays within twice the symmetric update's error against float64."""
    from kfac_hpc.kfac.patches import patch_covariance

    torch.manual_seed(38)
    geometry = ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    for shape in ((4, 32, 7, 7), (4, 32, 8, 8)):
        x = torch.relu(torch.randn(shape))  # activations after a ReLU: all of one sign
        exact = patch_covariance(x.double(), *geometry)
        shifted = shifts.shifted_covariance(x, (3, 3), (1, 1), (1, 1, 1, 1)).double()
        patches = patch_covariance(x, *geometry).double()
        assert rel_err(shifted, exact) <= 2 * rel_err(patches, exact), shape


def test_operators_do_not_grow_with_the_batch() -> None:
    """A fixed number of operators per layer (within one border chunk): no per-sample
    or per-pixel loop. With a bias, 3x3: 13 shifted products, and per border offset (8)
    a gather, a product, a sum and two subtractions; 86 in all."""
    _, curv = _conv(dict(in_channels=4, out_channels=4, kernel_size=3, padding=1))

    def kernels(b: int) -> int:
        x = torch.randn(b, 4, 8, 8, dtype=DT)
        _shifted(curv, x)  # the layout is built (and cached) outside the count
        return count_ops(lambda: _shifted(curv, x)).kernels

    assert kernels(1) == kernels(9) <= 90


def test_border_patches_are_gathered_a_few_images_at_a_time() -> None:
    """The border patches are the only ones built: at most ``border_chunk`` elements
    (whole images, at least one) at once, whatever the batch; every chunking gives the
    same factor to summation order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gathers(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if str(func).startswith("aten.index_select"):
                self.sizes.append(out.numel())
            return out

    torch.manual_seed(34)
    _, curv = _conv(dict(in_channels=4, out_channels=4, kernel_size=3, padding=1))
    x = torch.randn(12, 4, 8, 8, dtype=DT)
    whole = _shifted(curv, x)
    # per image, offset k's missed pixels (15 at a corner, 8 along an edge) against the
    # patch blocks from k on (9 - k), 4 channels
    per_image = 4 * (15 * 9 + 8 * 8 + 15 * 7 + 8 * 6 + 8 * 4 + 15 * 3 + 8 * 2 + 15 * 1)
    for chunk, images in ((1, [1] * 12), (5 * per_image, [5, 5, 2]), (1 << 30, [12])):
        with Gathers() as seen:
            got = _shifted(curv, x, border_chunk=chunk)
        per_chunk = [sum(seen.sizes[i:i + 8]) for i in range(0, len(seen.sizes), 8)]
        assert per_chunk == [n * per_image for n in images], (chunk, per_chunk)
        assert rel_err(got, whole) < 1e-13


def test_flops_against_the_patch_rows() -> None:
    """ResNet-50's stride-1 3x3 layers: 0.37 of the symmetric update's multiply-adds at
    56x56, 0.73 at 7x7 (the borders' share grows as the maps shrink)."""
    kernel, dilation, pads = (3, 3), (1, 1), (1, 1, 1, 1)
    big = shifts.shifted_products_flops(32, 56, 56, kernel, dilation, pads)
    small = shifts.shifted_products_flops(32, 7, 7, kernel, dilation, pads)
    assert big[1] == 32 * 56 * 56 * 81
    # 13 products over the padded maps, and per border offset k its missed pixels (111 at
    # a corner, 56 along an edge) against the 9 - k blocks from k on
    border = 111 * (9 + 7 + 3 + 1) + 56 * (8 + 6 + 4 + 2)
    assert big[0] == 32 * (13 * 58 * 58 + border)
    assert 0.36 < big[0] / (big[1] / 2) < 0.38
    assert 0.72 < small[0] / (small[1] / 2) < 0.74


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(b, C, H, W\)"):
        shifts.shifted_covariance(torch.randn(3, 5, 5), (3, 3), (1, 1), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="zero rows"):
        shifts.shifted_covariance(torch.randn(1, 2, 2, 2), (3, 3), (1, 1), (0, 0, 0, 0))
